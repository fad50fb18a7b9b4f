"""Ring attention on a real GPU: a single-rank group (world 1, NCCL) against the plain op and the
float64 oracle, forward and backward, with dropout too (the GPU check's correctness section runs
this).

Marked `gpu` and skipped without CUDA (FAGEN_GPU_TESTS_DEVICE=cpu runs it on gloo and the
emulator instead).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import fagen
from fagen.bench.gpu_cases import RING_DROPOUT_PS, RING_LAYOUTS, RING_SHAPE
from fagen.reference import attention_backward, attention_forward, attention_same_dtype, dropout_keep_mask

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OUTPUT_FACTOR, GRAD_FACTOR, ABS_FLOOR = 2.0, 3.0, 1e-5
BF16_EPS = torch.finfo(torch.bfloat16).eps   # the spacing at 1: an ulp of |x| is at most eps |x|
PAIR = (11, 4)   # the Philox (seed, offset) every rank draws, fixed here


@pytest.fixture
def single_rank_group():
    import torch.distributed as dist

    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ring_run(q, k, v, dout, layout, dropout_p):
    """out, dq, dk, dv of ring_attention, back in the sequence's own order."""
    from fagen.distributed import ring, ring_attention, shard, unshard

    leaves = [shard(t, layout).requires_grad_() for t in (q, k, v)]
    original, ring._philox_pair = ring._philox_pair, lambda *args: PAIR
    try:
        out = ring_attention(*leaves, causal=True, layout=layout, dropout_p=dropout_p)
    finally:
        ring._philox_pair = original
    out.backward(shard(dout, layout))
    return [unshard(t, layout) for t in (out.detach(), *(leaf.grad for leaf in leaves))]


def plain_out(q, k, v, dropout_p):
    """The plain kernel's output for the same Philox pair (as the test renders it)."""
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render
    from fagen.spec import Spec

    source = render(Spec(q.shape[-1], dtype="bf16", mask="causal", dropout=dropout_p > 0))
    return attention_kernels.forward(source, q, k, v, dropout_p=dropout_p, seed=PAIR[0], philox_offset=PAIR[1])[0]


@pytest.mark.parametrize("layout", RING_LAYOUTS)
@pytest.mark.parametrize("dropout_p", RING_DROPOUT_PS)
def test_a_single_rank_ring_equals_the_plain_op(single_rank_group, layout, dropout_p):
    batch, n, heads, kv_heads, d = RING_SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, n, h, d, generator=gen).to(DEVICE, torch.bfloat16)
                     for h in (heads, kv_heads, kv_heads, heads))
    out, *grads = ring_run(q, k, v, dout, layout, dropout_p)
    plain = plain_out(q, k, v, dropout_p)
    # Forward, against the plain kernel: each chunk pair's output is rounded to bf16 (a pair's
    # output is a convex combination of V's rows, scaled by 1/(1-p) with dropout: at most
    # max|v| / (1-p)), merged in fp32 and rounded again; the plain kernel rounds once. Half an ulp
    # per rounding, and an ulp of |x| is at most eps |x|; the fp32 merge adds ~2^-20 max|v|.
    vmax, omax = v.float().abs().max().item(), plain.float().abs().max().item()
    limit = BF16_EPS * (0.5 * vmax / (1 - dropout_p) + omax) + 2.0 ** -20 * vmax
    assert (out.float() - plain.float()).abs().max().item() <= limit
    # Everything against the float64 oracle by FA-2's rule (the reference uses the kernel's own
    # mask: ring dropout keys on global coordinates, the single-device mask bit for bit). The
    # gradients are sums over chunk pairs of partials rounded to bf16, which the rule bounds.
    keep = dropout_keep_mask(*PAIR, batch, heads, n, n, dropout_p) if dropout_p else None
    cpu = [t.cpu() for t in (q, k, v, dout)]
    options = dict(causal=True, dropout_p=dropout_p, keep_mask=keep)
    ref_out, _ = attention_forward(*cpu[:3], **options)
    refs = attention_backward(*cpu[:3], ref_out, cpu[3], **options)
    same = attention_same_dtype(*cpu, **options)
    for name, mine, ref, pt, factor in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *refs), same,
                                           (OUTPUT_FACTOR, GRAD_FACTOR, GRAD_FACTOR, GRAD_FACTOR)):
        err, err_pt = max_error(mine, ref), max_error(pt, ref)
        assert err <= factor * err_pt + ABS_FLOOR, f"{name}: {err:.3g} > {factor} x PyTorch's {err_pt:.3g}"
    assert fagen.distributed.ring.step_blocks("contiguous", 1, 0, 0, True)[0].causal


def max_error(a, b) -> float:
    return (a.detach().double().cpu() - b.double().cpu()).abs().max().item()
