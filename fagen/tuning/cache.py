"""The persistent tuning cache: one JSON file per (GPU, toolchain, spec, shape bucket).

Key. A tuning is valid for one GPU model and toolchain (`DeviceIdentity`:
GPU name, compute capability, driver version, NVRTC version), one kernel
variant (`Spec.base_name`, the name without tiles, e.g. `fa2_d64_causal_fp16`)
and one shape bucket (`ShapeBucket`: seqlen_q, seqlen_k and batch*heads, each
rounded up to a power of two).

Files. `<cache dir>/tune/<base_name>.<bucket>.<identity digest>.json`, e.g.
`fa2_d64_causal_fp16.q4096_k4096_bh64.3f9a0c1e22b7.json`, where the cache
dir is `fagen.cache_files.cache_dir()` ($FAGEN_CACHE_DIR, else
$XDG_CACHE_HOME/fagen, else ~/.cache/fagen). One file per key means
concurrent tuners never read-modify-write a shared file: each file is written
whole to a temporary name and renamed into place, so the last writer of a
key wins and writers of different keys never interfere.

Reads. The directory is read once per process, on the first lookup, into an
in-memory index; later lookups are dict reads. The index changes only
through this process's own tuning (and `reload_cache`), so a running job
never switches tiles, and therefore numerics, halfway through. A file that
does not parse or names illegal tiles is ignored with a warning and
rewritten the next time its key is tuned.
"""

from __future__ import annotations

import datetime
import json
import os
import math
import threading
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cache_files import cache_dir, write_atomic
from ..spec import Spec
from .device import DeviceIdentity
from .fallback import fallback_spec, fit_backward_to

CACHE_FORMAT = 1
TUNE_SUBDIR = "tune"
MIN_SEQLEN_BUCKET = 16
TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages")


_CACHE_ENV = ("FAGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME")  # what cache_files.cache_dir() reads


def tune_dir() -> Path:
    return cache_dir() / TUNE_SUBDIR


def _power_of_two_at_least(n: int, floor: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"shape sizes must be positive ints, got {n!r}")
    return max(floor, 1 << (n - 1).bit_length())


@dataclass(frozen=True, order=True)
class ShapeBucket:
    """Problem sizes rounded up to powers of two: one tuning serves the whole bucket."""

    seqlen_q: int
    seqlen_k: int
    batch_heads: int

    @classmethod
    def of(cls, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1, heads: int = 1) -> "ShapeBucket":
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        return cls(_power_of_two_at_least(seqlen_q, MIN_SEQLEN_BUCKET),
                   _power_of_two_at_least(seqlen_k, MIN_SEQLEN_BUCKET),
                   _power_of_two_at_least(batch * heads))

    @property
    def label(self) -> str:
        return f"q{self.seqlen_q}_k{self.seqlen_k}_bh{self.batch_heads}"

    def distance(self, other: "ShapeBucket") -> float:
        """How many doublings apart two buckets are, summed over the three sizes."""
        return sum(abs(math.log2(a / b)) for a, b in
                   ((self.seqlen_q, other.seqlen_q), (self.seqlen_k, other.seqlen_k),
                    (self.batch_heads, other.batch_heads)))


@dataclass(frozen=True)
class TuneEntry:
    """One cached winner and how it was found."""

    identity: DeviceIdentity
    base_name: str
    bucket: ShapeBucket
    tiles: dict
    median_ms: float | None = None        # the winner's median time on the tuned shape
    fallback_ms: float | None = None      # the untuned fallback's, for the speedup
    shape: dict = field(default_factory=dict)       # batch, heads, seqlen_q, seqlen_k tuned on
    counts: dict = field(default_factory=dict)      # candidates: generated, pruned, rejected, timed
    tuned_at: str = ""

    @property
    def path(self) -> Path:
        return entry_path(self.identity, self.base_name, self.bucket)

    def spec(self, base: Spec) -> Spec:
        return base.replace(**self.tiles)

    def to_json(self) -> dict:
        # The key's "family" is the spec's base name (Spec.base_name): the name of the files' format,
        # kept so that caches written before the rename still read.
        return {"format": CACHE_FORMAT, "key": {"gpu": self.identity.name, "arch": self.identity.arch,
                                                "driver": self.identity.driver, "nvrtc": self.identity.nvrtc,
                                                "family": self.base_name, "bucket": asdict(self.bucket)},
                "tiles": dict(self.tiles), "median_ms": self.median_ms, "fallback_ms": self.fallback_ms,
                "shape": self.shape, "counts": self.counts, "tuned_at": self.tuned_at}

    @classmethod
    def from_json(cls, data: dict) -> "TuneEntry":
        """Parse and validate; raises ValueError, KeyError or TypeError on anything off."""
        key = data["key"]
        identity = DeviceIdentity(name=_text(key["gpu"]), arch=_text(key["arch"]),
                                  driver=_text(key["driver"]), nvrtc=_text(key["nvrtc"]))
        bucket = ShapeBucket(**{k: int(key["bucket"][k]) for k in ("seqlen_q", "seqlen_k", "batch_heads")})
        tiles = {k: data["tiles"][k] for k in TILE_KEYS}
        Spec.from_name(key["family"]).replace(**tiles)   # the name parses and the tiles are legal
        return cls(identity=identity, base_name=key["family"], bucket=bucket, tiles=tiles,
                   median_ms=data.get("median_ms"), fallback_ms=data.get("fallback_ms"),
                   shape=dict(data.get("shape", {})), counts=dict(data.get("counts", {})),
                   tuned_at=str(data.get("tuned_at", "")))


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def entry_path(identity: DeviceIdentity, base_name: str, bucket: ShapeBucket) -> Path:
    return tune_dir() / f"{base_name}.{bucket.label}.{identity.digest}.json"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class TuneIndex:
    """The cache directory's entries in memory, loaded once per process and per cache dir."""

    def __init__(self):
        self._lock = threading.Lock()
        self._directory: Path | None = None
        self._entries: dict[tuple[str, str], dict[ShapeBucket, TuneEntry]] = {}
        self._specs: dict[tuple, Spec] = {}   # memo of spec_for: lookups must stay cheap
        self.generation = 0                   # bumped whenever a lookup's answer may change
        self._env: tuple | None = None

    def _ensure_loaded(self) -> None:
        directory = tune_dir()
        if directory == self._directory:
            return
        with self._lock:
            if directory != self._directory:
                self._entries, self._specs = self._read_all(directory), {}
                self._directory = directory
                self.generation += 1

    @staticmethod
    def _read_all(directory: Path) -> dict:
        entries: dict = {}
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            entry = read_entry(path)
            if entry is not None:
                entries.setdefault((entry.identity.key, entry.base_name), {})[entry.bucket] = entry
        return entries

    def find(self, identity: DeviceIdentity, base_name: str, bucket: ShapeBucket) -> TuneEntry | None:
        """The entry for this bucket, else the one of the nearest tuned bucket, else None.

        A tuning made for a neighbouring shape on the same GPU beats the
        static table: tile choice changes slowly with shape."""
        self._ensure_loaded()
        tuned = self._entries.get((identity.key, base_name))
        if not tuned:
            return None
        if bucket in tuned:
            return tuned[bucket]
        nearest = min(tuned, key=lambda other: (bucket.distance(other), other))
        return tuned[nearest]

    def spec_for(self, base: Spec, identity: DeviceIdentity, bucket: ShapeBucket,
                 shared_per_block_optin: int | None = None) -> Spec:
        """The tuned spec, else the fallback; `shared_per_block_optin` (the driver's limit) places
        an arch the shared-memory table lacks."""
        self._ensure_loaded()
        memo_key = (identity, base, bucket)
        spec = self._specs.get(memo_key)
        if spec is None:
            optin = shared_per_block_optin
            entry = self.find(identity, base.base_name, bucket)
            spec = (fit_backward_to(entry.spec(base), identity.arch, optin) if entry is not None
                    else fallback_spec(base, identity.arch, optin))
            self._specs[memo_key] = spec
        return spec

    def store(self, entry: TuneEntry) -> Path:
        self._ensure_loaded()
        path = entry.path
        write_atomic(path, (json.dumps(entry.to_json(), indent=2) + "\n").encode())
        with self._lock:
            self._entries.setdefault((entry.identity.key, entry.base_name), {})[entry.bucket] = entry
            self._specs = {}
            self.generation += 1
        return path

    def all_entries(self) -> list[TuneEntry]:
        self._ensure_loaded()
        return [entry for by_bucket in self._entries.values() for entry in by_bucket.values()]

    def forget(self) -> None:
        """Drop the in-memory view; the next lookup rereads the directory."""
        with self._lock:
            self._directory, self._entries, self._specs = None, {}, {}
            self.generation += 1

    def current_generation(self) -> int:
        """The generation, after picking up a change of cache directory. Called on every
        op call, so it compares the environment variables that choose the directory
        rather than building the path."""
        env = tuple(os.environ.get(name) for name in _CACHE_ENV)
        if env != self._env or self._directory is None:
            self._ensure_loaded()
            self._env = env
        return self.generation


def read_entry(path: Path) -> TuneEntry | None:
    """One cache file, or None (with a warning if it is corrupt)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != CACHE_FORMAT:
            return None   # another fagen version's layout: not corrupt, just not ours
        return TuneEntry.from_json(data)
    except FileNotFoundError:
        return None   # removed by a concurrent `fagen tune --clear`
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        warnings.warn(f"ignoring corrupt fagen tuning cache entry {path} ({type(exc).__name__}: {exc}); "
                      f"it is rewritten the next time this spec and shape are tuned", stacklevel=2)
        return None


INDEX = TuneIndex()


def reload_cache() -> None:
    """Make the next lookup reread the cache directory (e.g. after another process tuned)."""
    INDEX.forget()


def clear_cache() -> int:
    """Delete every tuning (and stray temporary file) in the cache; returns how many files went."""
    directory = tune_dir()
    removed = 0
    if directory.is_dir():
        for path in directory.iterdir():
            if path.is_file() and (path.suffix == ".json" or path.name.endswith(".tmp")):
                path.unlink(missing_ok=True)
                removed += 1
    INDEX.forget()
    return removed


def show_cache() -> str:
    """A table of every cached tuning, for `fagen tune --show`."""
    directory = tune_dir()
    entries = sorted(INDEX.all_entries(), key=lambda e: (e.identity.key, e.base_name, e.bucket))
    if not entries:
        return f"no tunings in {directory}"
    lines = [f"tunings in {directory}:",
             f"{'spec (no tiles)':<30} {'shape bucket':<22} {'tiles':<14} {'ms':>8} {'vs fallback':>11}  gpu"]
    for e in entries:
        t = e.tiles
        tiles = f"m{t['block_m']}n{t['block_n']}w{t['num_warps']}s{t['num_stages']}"
        ms = f"{e.median_ms:.4f}" if isinstance(e.median_ms, (int, float)) else "?"
        speedup = (f"{e.fallback_ms / e.median_ms:.2f}x" if isinstance(e.median_ms, (int, float))
                   and isinstance(e.fallback_ms, (int, float)) and e.median_ms > 0 else "?")
        lines.append(f"{e.base_name:<30} {e.bucket.label:<22} {tiles:<14} {ms:>8} {speedup:>11}  "
                     f"{e.identity.key}")
    return "\n".join(lines)
