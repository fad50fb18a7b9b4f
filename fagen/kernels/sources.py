"""The kernel sources of the op modules `fagen build` writes.

A generated module runs its own NAME.cu beside it, never a fresh render, and
checks it against the SHA-256 recorded at build time: a source edited after
the build is refused, with the command that rebuilds it. For debugging (a
`printf` in a kernel, say), FAGEN_ALLOW_EDITED_SOURCE=1 runs the edited file
anyway, with a one-time warning per file. Its kernels keep the spec's
signatures and launch geometry, so an edit must keep those.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

from .render import Source, kernel_entries
from ..spec import Spec
from ..spec_flags import build_command

ALLOW_EDITED_ENV = "FAGEN_ALLOW_EDITED_SOURCE"


def module_source(spec: Spec, source_path, sha256: str) -> str:
    """The custom ops take strings: a generated module's source travels as `name|path|sha256`."""
    return f"{spec.name}|{source_path}|{sha256}"


def edited_sources_allowed() -> bool:
    value = os.environ.get(ALLOW_EDITED_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ALLOW_EDITED_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def source_of(module_source_text: str) -> Source:
    """The Source a generated module runs, checked against its recorded hash."""
    return _load(module_source_text, edited_sources_allowed())


@functools.lru_cache(maxsize=256)
def _load(module_source_text: str, allow_edited: bool) -> Source:
    spec_name, path, sha256 = module_source_text.split("|")
    spec = Spec.from_name(spec_name)
    source = Source(spec=spec, code=Path(path).read_text(), kernels=kernel_entries(spec))
    if source.hash == sha256:
        return source
    if not allow_edited:
        raise RuntimeError(
            f"{path} does not match its module (sha256 {source.hash[:12]} != {sha256[:12]}): it was edited "
            f"after `fagen build`. Rebuild it with\n    {build_command(spec, Path(path).parent)}\n"
            f"or, to run the edited file anyway (debugging), set {ALLOW_EDITED_ENV}=1.")
    warnings.warn(f"fagen: running {path}, edited after its build ({ALLOW_EDITED_ENV}=1); its kernels must "
                  f"keep the signatures of {spec.name}", stacklevel=2)
    return source
