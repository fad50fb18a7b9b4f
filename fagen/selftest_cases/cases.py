"""The self-test's cases: one small call per template (fagen.selftest.templates), run by the
child (fagen.selftest_cases.child) in the template's family (FAGEN_ARCH_FAMILY).

Each template's case uses its feature at one head dim, d = 64 unless the template is a head
dim; the head-dim cases run plain attention (sm90: the forward; sm80: forward and backward).
The sm90 family's feature cases check O and L only (packed sequences run both, as a call does):
the backward of those features is proven by `sm90.backward` where the family's own takes them (d =
64 and 128: masks, sinks, the softcap or ALiBi alone; at 64 dropout, mask_mods and score_mods),
else by the sm80 cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..arch_families import ARCH_FAMILIES, FAMILIES
from ..selftest.templates import all_templates, fallback_backward_family
from .decoding import Decoding, PagedPacked, check_decoding, check_paged_packed
from .fp8 import check_fp8
from .training import Packed, Training, check_packed, check_training


@dataclass(frozen=True)
class Case:
    """A template's case: `run(device)` makes its calls and returns the problems it found. It
    proves its template only if those calls ran kernels of the template's family (the child
    checks: `runs_kernels`; the tests' planted cases run none)."""

    template: str
    run: Callable[[torch.device], list]
    runs_kernels: bool = True

    @property
    def family(self) -> str:
        return self.template.split(".")[0]


def _training(**fields):
    return partial(check_training, Training(**fields))


def _every(runs: tuple, device: torch.device) -> list[str]:
    """Several calls as one case: the problems of each."""
    return [problem for run in runs for problem in run(device)]


def _features(family: str) -> dict:
    """Each feature's case in `family`. A family that runs another's backward for these features
    (sm90 runs sm80's) checks its forward alone (backward=False): the other's cases check that
    backward. Its own backward, where it has one, is the `backward` case's."""
    backward = fallback_backward_family(family) == family
    train = partial(_training, backward=backward)
    return {
        "causal": train(causal=True, shape=(1, 170, 140, 2, 1), dtype="bf16"),   # rows with no key
        "key_padding": train(key_padding=True, shape=(2, 140, 170, 2, 1)),
        "window": train(window=(37, 11), causal=False),
        "softcap": train(softcap=30.0, dtype="bf16"),
        "alibi": train(alibi=True, causal=True),
        "sinks": train(sinks=True),
        "dropout": train(dropout=True),
        "mods": train(mods=True),
        "varlen": partial(check_packed, Packed()),
        "head_dim_v": train(head_dim=192, head_dim_v=128, dtype="bf16"),
        "decode": partial(check_decoding, Decoding()),
        "paged": partial(check_decoding, Decoding(page=16, seqlens=(37, 130), capacity=160, splits=(1, 2))),
        "varlen_paged": partial(check_paged_packed, PagedPacked()),
        "pack_gqa": partial(check_decoding, Decoding(heads=(8, 2), nq=1, new=1, causal=False, softcap=20.0)),
        "mla": partial(check_decoding, Decoding(mla=True, heads=(16, 1), nq=1, new=1, seqlens=(37, 90),
                                                capacity=128, page=64, splits=(1, 2))),
        "fa1": train(version=1, causal=True),
        "fp8": partial(_every, tuple(partial(check_fp8, d) for d in (64, 128))),
        "fp8_cache": partial(check_decoding, Decoding(cache_fp8=True, heads=(4, 2), page=16, seqlens=(37, 130),
                                                      capacity=160, splits=(1, 2))),
        # ... and with a bias table's gradient, in an exact sum: repeated bit for bit
        "deterministic": partial(_every, (train(deterministic=True, dropout=True),
                                          train(deterministic=True, mods=True))),
        # its own backward (sm90's at d = 64 and 128, and its paired form at 192 and 256: odd boxes of
        # dQ, one stage, d_v != d, and d = 128's dropout and mods): causal with rows that see no key,
        # ragged, GQA; key padding; d = 128's second column box; dropout's keep bits of the transposed tile; a
        # window's walk and tile classes; sinks; the softcap's and ALiBi's chains; a bias table's
        # score_mod with its gradient, over documents (deterministic too: the gradient's exact sum);
        # deterministic dQ (turns in key-block order), four key blocks into each query block,
        # repeated bit for bit
        "backward": partial(_every, (_training(backward=True, causal=True, shape=(1, 170, 140, 4, 2), dtype="bf16"),
                                     _training(backward=True, key_padding=True, shape=(2, 140, 170, 2, 1)),
                                     _training(backward=True, head_dim=128, shape=(1, 150, 200, 2, 1)),
                                     _training(backward=True, head_dim=192, causal=True, shape=(1, 150, 200, 2, 1),
                                               dtype="bf16"),
                                     _training(backward=True, head_dim=256, deterministic=True,
                                               shape=(1, 150, 200, 2, 1)),
                                     _training(backward=True, head_dim=192, head_dim_v=128,
                                               shape=(1, 150, 200, 2, 1)),
                                     _training(backward=True, head_dim=128, dropout=True, causal=True),
                                     _training(backward=True, head_dim=128, mods=True),
                                     _training(backward=True, dropout=True, causal=True),
                                     _training(backward=True, window=(37, 11)),
                                     _training(backward=True, sinks=True),
                                     _training(backward=True, softcap=30.0, dtype="bf16"),
                                     _training(backward=True, alibi=True, causal=True),
                                     _training(backward=True, mods=True),
                                     _training(backward=True, mods=True, deterministic=True),
                                     _training(backward=True, deterministic=True, causal=True,
                                               shape=(1, 150, 400, 2, 1)))),
    }


def _head_dims(family: str) -> dict:
    dims = FAMILIES[family].head_dims
    names = all_templates(family)[:len(dims)]
    return {name: _training(head_dim=d, backward=fallback_backward_family(family) == family,
                            dtype="bf16" if d % 128 else "fp16")
            for name, d in zip(names, dims)}


def cases() -> dict:
    """{template: Case} for both families."""
    found = {}
    for family in ARCH_FAMILIES:
        runs = {**_head_dims(family), **{f"{family}.{name}": run for name, run in _features(family).items()}}
        for template in all_templates(family):
            if template in runs:
                found[template] = Case(template, runs[template])
    return found


CASES = cases()
