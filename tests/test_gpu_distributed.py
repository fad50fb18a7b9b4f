"""Ring attention on a real GPU: a single-rank group (world 1, NCCL) must equal the plain op,
forward and backward, with dropout too (the GPU check's correctness section runs this).

Marked `gpu` and skipped without CUDA (FAGEN_GPU_TESTS_DEVICE=cpu runs it on gloo and the
emulator instead).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import fagen

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def single_rank_group():
    import torch.distributed as dist

    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_a_single_rank_ring_equals_the_plain_op(single_rank_group, layout, dropout_p):
    from fagen.distributed import ring, ring_attention, shard, unshard

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 512, h, 128, generator=gen).to(DEVICE, torch.bfloat16) for h in (8, 2, 2, 8))
    leaves = [shard(t, layout).requires_grad_() for t in (q, k, v)]
    pair = (11, 4)
    original, ring._philox_pair = ring._philox_pair, lambda *args: pair
    try:
        out = ring_attention(*leaves, causal=True, layout=layout, dropout_p=dropout_p)
    finally:
        ring._philox_pair = original
    out.backward(shard(dout, layout))
    from fagen import attention_kernels as ops
    from fagen.codegen import render
    from fagen.spec import Spec

    source = render(Spec(128, dtype="bf16", mask="causal", dropout=dropout_p > 0))
    ref, stats = ops.forward(source, q, k, v, dropout_p=dropout_p, seed=pair[0], philox_offset=pair[1])
    grads = ops.backward(source, q, k, v, ref, stats, dout,
                         dropout_args=ops.dropout_args(dropout_p, *pair) if dropout_p else None)
    for mine, plain in zip((out.detach(), *(t.grad for t in leaves)), (ref, *grads)):
        # The merge of the chunk pairs rounds differently from one kernel: two bf16 roundings apart.
        limit = 2 * torch.finfo(torch.bfloat16).eps * plain.float().abs().max().item()
        assert (unshard(mine, layout).float() - plain.float()).abs().max().item() <= limit
    assert fagen.distributed.ring.step_blocks("contiguous", 1, 0, 0, True)[0].causal
