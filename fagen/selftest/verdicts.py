"""The self-test's verdicts: per template, what one GPU made of a family's kernels, on disk.

Key. A verdict holds for one GPU model, driver, CUDA runtime, NVRTC, fagen version and the
family's sources (`templates.sources_digest`): `VerdictKey`. A new driver, toolchain, release or
template edit is a new key, and the next eligible call tests again.

Files. `<cache dir>/tune/selftest/<family>.<key digest>.json`, beside the tuning cache's per-GPU
entries, written whole to a temporary name and renamed (cache_files.write_atomic): a reader
sees the old verdict or the new one, never half of one. The child's log of the run that made
it is `<family>.<key digest>.log` next to it, named in each failed template's warning.

Statuses: "passed"; "failed" (a result off the tolerance rule, or an error); "timed_out" (the
watchdog ended it); "not_run" (the run's budget ended first). Only "passed" serves.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cache_files import cache_dir, write_atomic

VERDICT_FORMAT = 1
SELFTEST_SUBDIR = "tune/selftest"
STATUSES = ("passed", "failed", "timed_out", "not_run")


@dataclass(frozen=True)
class VerdictKey:
    """What a family's verdict on one GPU depends on."""

    family: str
    gpu: str        # "NVIDIA H100 80GB HBM3"
    driver: str     # "580.159.04"
    runtime: str    # the CUDA runtime, "12.9"
    nvrtc: str      # "12.9"
    fagen: str      # fagen's version
    sources: str    # templates.sources_digest(family)

    @property
    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def stem(self) -> str:
        return f"{self.family}.{self.digest}"


@dataclass(frozen=True)
class TemplateResult:
    status: str               # one of STATUSES
    detail: str = ""          # the failed check, the error, or why it did not run
    seconds: float = 0.0


@dataclass
class Verdict:
    """One family's verdict on one GPU: a result per template, and where the run's log is."""

    key: VerdictKey
    results: dict = field(default_factory=dict)   # template -> TemplateResult
    log: str = ""
    seconds: float = 0.0
    made_at: str = ""

    def status(self, template: str) -> str:
        result = self.results.get(template)
        return "not_run" if result is None else result.status

    def unproven(self, templates) -> list[str]:
        """The templates of `templates` (this family's) that did not pass."""
        return [t for t in templates if self.status(t) != "passed"]

    def broken(self, templates) -> list[str]:
        """The templates of `templates` that failed or hung (not merely unrun)."""
        return [t for t in templates if self.status(t) in ("failed", "timed_out")]

    def to_json(self) -> dict:
        return {"format": VERDICT_FORMAT, "key": asdict(self.key), "log": self.log, "seconds": self.seconds,
                "made_at": self.made_at, "results": {name: asdict(r) for name, r in self.results.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Verdict":
        """Parse and validate; raises ValueError, KeyError or TypeError on anything off."""
        if data.get("format") != VERDICT_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {VERDICT_FORMAT}")
        key = VerdictKey(**{name: str(data["key"][name]) for name in VerdictKey.__dataclass_fields__})
        results = {}
        for name, result in data["results"].items():
            if result["status"] not in STATUSES:
                raise ValueError(f"template {name!r}: unknown status {result['status']!r}")
            results[str(name)] = TemplateResult(str(result["status"]), str(result.get("detail", "")),
                                                float(result.get("seconds", 0.0)))
        return cls(key, results, str(data.get("log", "")), float(data.get("seconds", 0.0)),
                   str(data.get("made_at", "")))


def selftest_dir() -> Path:
    return cache_dir() / SELFTEST_SUBDIR


def verdict_path(key: VerdictKey) -> Path:
    return selftest_dir() / f"{key.stem}.json"


def log_path(key: VerdictKey) -> Path:
    return selftest_dir() / f"{key.stem}.log"


def read_verdict(key: VerdictKey) -> Verdict | None:
    """The stored verdict for `key`, or None (with a warning when the file is corrupt: the next
    eligible call then tests again and rewrites it)."""
    path = verdict_path(key)
    try:
        verdict = Verdict.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        warnings.warn(f"fagen: ignoring the corrupt self-test verdict {path} ({type(exc).__name__}: {exc}); "
                      f"the self-test runs again", stacklevel=2)
        return None
    return verdict if verdict.key == key else None


def write_verdict(verdict: Verdict) -> Path:
    path = verdict_path(verdict.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(verdict.to_json(), indent=2) + "\n").encode())
    return path
