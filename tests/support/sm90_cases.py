"""What the sm90 family's test files share (tests/kernels/test_sm90_forward.py,
test_sm90_wide_head_dims.py, tests/ops/test_kvcache_sm90.py): the custom mods over captured
tensors they run, the static check of a spec's forward compiled by NVRTC for sm_90a, and the
overlap read from its machine code."""

from __future__ import annotations

import pytest
import torch

from fagen.arch_families import sm90_tiles
from fagen.kernels.render import render
from fagen.variants import custom_mod, trace_mask_mod, trace_score_mod

# A relative-position bias table (its gradient checked through either family's backward) and documents.
BIAS = (torch.randn(4, 400, generator=torch.Generator().manual_seed(3)) * 0.5).requires_grad_()
DOCUMENTS = torch.sort(torch.randint(0, 4, (2, 200), generator=torch.Generator().manual_seed(4), dtype=torch.int32),
                       dim=1).values


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + 199]


def gated(score, b, h, q_idx, kv_idx):
    """A score_mod whose derivative is not 1: ds'/dx per element in the backward."""
    return score * torch.sigmoid(score)


# ALiBi with a softcap: a score chain in natural-log units without a score_mod (flash_attn_func's keywords).
ALIBI_SOFTCAP = {"alibi_slopes": torch.tensor([0.25, 0.0625, 0.5, 0.125]), "softcap": 5.0}


def same_document(b, h, q_idx, kv_idx):
    return DOCUMENTS[b, q_idx] == DOCUMENTS[b, kv_idx]


def relative_bias_check(spec, source=None) -> None:
    """`relative_bias` on `spec` (its score_mod) against the oracle, BIAS's gradient included: a
    ragged GQA shape (the mutants' check of the sm90 backward's score chain)."""
    from kernel_cases import Shape
    from variant_cases import run_variant_case

    run_variant_case(spec.replace(score_mod=None), Shape(2, 150, 200, heads=4, kv_heads=2),
                     {"score_mod": relative_bias}, captures=(BIAS,), source=source)


def traced(score=None, mask=None) -> dict:
    """Spec fields for these mods, traced as the ops trace a call's."""
    return {"score_mod": score and custom_mod(trace_score_mod(score)), "mask_mod": mask and custom_mod(trace_mask_mod(mask))}


def check_sm90_forward_compiles(spec) -> None:
    """NVRTC for sm_90a (`check_sm90_kernel_compiles`), and Q with its stages within an sm_90
    block's shared memory."""
    source = check_sm90_kernel_compiles(spec, "forward")
    assert source.kernels.forward.shared_bytes == sm90_tiles(spec).shared_bytes and sm90_tiles(spec).fits


def check_sm90_kernel_compiles(spec, role: str):
    """NVRTC for sm_90a: the source compiles, ptxas does not serialise its wgmma pipeline (C7510-C7520
    raise), and the kernel of `role` (an `Entries` field) spills nothing and fits the budgets: 384
    threads, one block per SM, so ptxas allocates at most 65536 / 384 = 168 registers a thread (the
    consumers' setmaxnreg takes 240). Returns the rendered source."""
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import check_wgmma_pipeline, nvrtc_compile, parse_ptxas_log

    assert spec.arch_family == "sm90"
    source = render(spec)
    cubin, log = nvrtc_compile(source.code, "sm_90a")
    assert cubin, log
    check_wgmma_pipeline(log, spec.name, "sm_90a")
    usage = parse_ptxas_log(log, "sm_90a")[getattr(source.kernels, role).name]
    assert usage.spill_store_bytes == usage.spill_load_bytes == 0 and usage.registers <= 168, usage
    return source


def check_every_exp2_in_flight(spec) -> None:
    """FlashAttention-3's intra-warpgroup overlap, read from the machine code (fagen.sass.overlap):
    every exp2 of the consumer loop issues while a P V group is in flight."""
    pytest.importorskip("cuda.bindings")
    from fagen.sass.listing import find_cuobjdump
    from fagen.sass.report import report_for_spec

    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    overlap = report_for_spec(spec, "sm_90a")[render(spec).kernels.forward.name].overlap
    assert overlap.exp2 > 0 and overlap.exp2_in_flight == overlap.exp2, overlap
