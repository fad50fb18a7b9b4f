"""A kernel mutant: a named wrong kernel, made by patching a rendered source (or a header it
includes), and killed when one of the checks that claim to cover it fails. The mutants themselves
are tests/support/kernel_mutants.py's."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable
from unittest import mock

from fagen.emulate import EmulationError
from fagen.kernels import attention_kernels
from fagen.kernels.render import Source, include_dir, render
from fagen.spec import Spec
from kernel_cases import poisoned_empty


@dataclass(frozen=True)
class Edit:
    """Replace `old` by `new` (every occurrence), in the rendered source or, with `header`,
    in that include (templates/include/fagen/<header>), inlined into the source."""

    old: str
    new: str
    header: str | None = None


@dataclass(frozen=True)
class KernelMutant:
    name: str
    spec: Spec
    edits: tuple[Edit, ...]
    checks: tuple[Callable[..., None], ...]
    # Host code the kernel relies on, wrong instead: (object, attribute, replacement), patched while
    # the checks run (the 8-bit forward's V^T, which the op makes: tests/support/fp8_mutants.py).
    host: tuple[tuple[object, str, object], ...] = ()

    def source(self) -> Source:
        correct = render(self.spec)
        code = correct.code
        for edit in self.edits:
            if edit.header is None:
                if edit.old not in code:
                    raise ValueError(f"mutant {self.name}: {edit.old!r} is no longer in the source")
                code = code.replace(edit.old, edit.new)
                continue
            include = f"#include <fagen/{edit.header}>"
            text = (include_dir() / "fagen" / edit.header).read_text()
            if edit.old not in text or include not in code:
                raise ValueError(f"mutant {self.name}: {edit.old!r} is no longer in {edit.header}")
            inlined = text.replace("#pragma once", f"// {edit.header}, inlined with a mutation").replace(edit.old,
                                                                                                        edit.new)
            code = code.replace(include, inlined)
        return Source(spec=self.spec, code=code, kernels=correct.kernels)


def killed_by(mutant: KernelMutant) -> str | None:
    """The first check that fails on the mutant (its name and the failure), or None."""
    source = mutant.source()
    with mock.patch.object(attention_kernels, "_empty", poisoned_empty), \
            mock.patch.dict(os.environ, {"FAGEN_EMULATE_THREADS": "1"}), contextlib.ExitStack() as patches:
        for target, attribute, replacement in mutant.host:
            patches.enter_context(mock.patch.object(target, attribute, replacement))
        for check in mutant.checks:
            try:
                check(mutant.spec, source)
            except (AssertionError, EmulationError) as failure:
                first_line = str(failure).splitlines()[0][:200] if str(failure) else type(failure).__name__
                return f"{check.__name__}: {first_line}"
    return None
