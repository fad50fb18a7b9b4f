"""fagen's settings from the environment, read on every call that needs one.

Tests and users switch FAGEN_CHECK_VALUES, FAGEN_EMULATE_CHECKED and FAGEN_EMULATE_RACECHECK
between calls, so a warm call reads them each time. `os.environ.get` costs ~0.7 us for a
variable that is not set (Mapping.get raises and catches a KeyError inside), several times the
rest of a warm call's bookkeeping for that setting; `setting` reads the same mapping without it.

Imports nothing of the pipeline, so every stage can use it.
"""

from __future__ import annotations

import os

# POSIX keeps os.environ's contents, bytes to bytes, in `_data`; os.environ's own writes (and
# monkeypatch.setenv's) update it. Elsewhere (Windows: str keys, upper-cased) the public path.
_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def setting(name: str) -> str:
    """The environment variable `name`, "" when unset."""
    if _DATA is None or type(_DATA) is not dict:
        return os.environ.get(name, "")
    value = _DATA.get(name.encode())
    return "" if value is None else os.fsdecode(value)


def setting_keys(*names: str) -> tuple:
    """`names` as `raw_settings` takes them (encoded once, where os.environ keeps bytes)."""
    return names if _DATA is None or type(_DATA) is not dict else tuple(n.encode() for n in names)


def raw_settings(keys: tuple) -> tuple:
    """Several variables' raw values in one step (None when unset), `keys` from `setting_keys`:
    for a cache key that must change when any of them does (equal tuples, equal settings)."""
    if _DATA is None or type(_DATA) is not dict:
        return tuple(map(os.environ.get, keys))
    return tuple(map(_DATA.get, keys))
