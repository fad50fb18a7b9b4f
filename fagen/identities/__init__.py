"""Symbolic proofs of the identities the attention kernels rely on.

`core` holds the records (Identity, Result), the proof tools (`is_zero`,
`equal`, `gradient`, `softmax_rows`, ...) and the identities of plain
attention; `variants` those of sinks, a differentiable lse and score mods
(softcap, ALiBi, traced score_mods: `mod_identities`); `merge` those of
merging partial attention results (fagen.merge_attention). This package joins
them into IDENTITIES; `run()` proves them and returns timed Results;
`for_spec(spec)` lists the ones a kernel spec relies on; `format_table`
prints what `fagen verify` shows.
"""

from __future__ import annotations

import time

from fagen.spec import Spec

from . import core, variants
from .core import (BASE_IDENTITIES, Identity, Result, block_stats, blocked_accumulation, delta_from_output,
                   delta_from_output_symbolic, dropout_expectation, dropout_gradient, empty_row_convention,
                   equal, fa1_rescaled_output, fa2_unscaled_output, format_table, frobenius, gradient,
                   is_zero, masked_block_contributes_nothing, matrix, merge_stats, online_softmax,
                   online_softmax_symbolic, p_from_stats_and_lse, p_from_stats_and_lse_symbolic, pv_gradients,
                   pv_gradients_symbolic, rowsum, score_gradients, score_gradients_symbolic, softmax_jacobian,
                   softmax_rows)
from .merge import MERGE_IDENTITIES
from .variants import (NUMERIC_POINTS, VARIANT_IDENTITIES, attention_backward, attention_forward,
                       derivative_is, mod_identities, numerically_equal, sink_gradient, sink_is_extra_key)

__all__ = ["BASE_IDENTITIES", "IDENTITIES", "MERGE_IDENTITIES", "NUMERIC_POINTS", "VARIANT_IDENTITIES", "Identity",
           "Result", "attention_backward", "attention_forward", "block_stats", "blocked_accumulation", "core",
           "delta_from_output", "delta_from_output_symbolic", "derivative_is", "dropout_expectation",
           "dropout_gradient", "empty_row_convention", "equal", "fa1_rescaled_output", "fa2_unscaled_output",
           "for_spec", "format_table", "frobenius", "gradient", "is_zero", "masked_block_contributes_nothing",
           "matrix", "merge_stats", "mod_identities", "numerically_equal", "online_softmax",
           "online_softmax_symbolic", "p_from_stats_and_lse", "p_from_stats_and_lse_symbolic", "pv_gradients",
           "pv_gradients_symbolic", "rowsum", "run", "score_gradients", "score_gradients_symbolic",
           "sink_gradient", "sink_is_extra_key", "softmax_jacobian", "softmax_rows", "variants"]

IDENTITIES: list[Identity] = [*BASE_IDENTITIES, *VARIANT_IDENTITIES, *MERGE_IDENTITIES]


def run(identities=None, spec: Spec | None = None) -> list[Result]:
    """Prove `identities` (default: those `spec` relies on, or all of them)."""
    if identities is None:
        identities = IDENTITIES if spec is None else for_spec(spec)
    results = []
    for identity in identities:
        start = time.perf_counter()
        try:
            outcome = identity.check()
            ok = outcome is True
            detail = "" if ok else f"check returned {outcome!r}"
        except Exception as exc:  # a crashing proof is a failed proof, reported
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append(Result(identity.name, identity.shapes, ok, time.perf_counter() - start, detail))
    return results


def for_spec(spec: Spec) -> list[Identity]:
    """The identities a kernel variant relies on; with a score chain (softcap, ALiBi, a
    score_mod), also its own: the derivative its CUDA computes equals sympy's, each captured
    tensor's gradient, the chain rule."""
    found = [identity for identity in IDENTITIES if identity.relied_on_by(spec)]
    if spec.score_mod is not None or spec.softcap or spec.alibi:   # what this variant's CUDA computes
        from ..variants.compose import variant_math
        from ..variants.cuda import capture_load_grads, emitted_score_grad
        from ..variants.language import SCORE

        math = variant_math(spec)
        grad, substitutions = emitted_score_grad(math)
        found += mod_identities(SCORE, math.score, grad, loads=capture_load_grads(math), substitutions=substitutions,
                                name=f"emitted score chain {math.score}")
    return found
