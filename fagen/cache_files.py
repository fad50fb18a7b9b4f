"""fagen's files on disk: the cache folder every cache lives under, and whole-file writes.

Cubins (kernels.compile), emulator builds (emulate.build), tuning results and self-test verdicts
each keep a subfolder of `cache_dir()`. Every file fagen writes there (and a profile's report) is
written to a temporary name and renamed into place, so concurrent writers both succeed and a
reader sees the old file or the whole new one, never half of one.

Imports nothing of fagen, so the kernels, the emulator and the caches above them can all use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_ENV = "FAGEN_CACHE_DIR"


def cache_dir() -> Path:
    """$FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen, else ~/.cache/fagen."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fagen"


def process_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (os.umask can only
    be read by setting it, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one.

    The file gets the permissions a plain open() would give it (0666 less the umask):
    mkstemp's private 0600 would leave build outputs and cache entries readable by their
    owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~process_umask())
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
