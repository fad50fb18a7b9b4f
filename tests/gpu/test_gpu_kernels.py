"""fagen's kernels on a real GPU, through the user op, against the float64 oracle.

Marked `gpu` and skipped without CUDA. `python -m fagen.bench gpu-check` runs
them (with the emulator's layout tests and every other `gpu` test) as its
correctness section.

The rule is FlashAttention-2's: the kernel's max error against the float64
reference is at most 2x (output) / 3x (dq, dk, dv) the max error of a
same-dtype PyTorch implementation (plain torch ops in fp16/bf16 on the same
GPU) against the same reference, plus a 1e-5 floor for cases where PyTorch
happens to be exact. Tests of APIs still being built (autograd, the
deterministic flag, an explicit Philox seed) skip with the missing piece
named, so they light up when it lands.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from fagen.bench.gpu_cases import (DETERMINISTIC_CASES, DROPOUT_CASES, DROPOUT_P, KERNEL_CASE_HEAD_DIMS,
                                   KERNEL_CASE_VERSIONS, KERNEL_CASES, MATRIX, SEEDED_DROPOUT, SHAPES,
                                   SINGLE_STAGE_CASES)
from fagen.dtypes import TORCH_DTYPE
from fagen.emulate import assert_written
from fagen.reference import attention_backward, attention_forward, dropout_keep_mask

# FAGEN_GPU_TESTS_DEVICE=cpu runs these same tests through the emulator (slow; not in CI):
# a check of the tests' own logic before a GPU session spends minutes on them. The parameter
# tables live in fagen.bench.gpu_cases: the GPU check's precompile section builds their kernels.
DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
# A record run (fagen.bench.record_plugin) runs the CUDA-only tests too, as far as their first
# eager call: which kernels they load is what it records.
RECORDING = bool(os.environ.get("FAGEN_RECORD_KERNELS"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]
needs_cuda = pytest.mark.skipif(DEVICE != "cuda" and not RECORDING, reason="CUDA graphs need a CUDA device")
OUTPUT_FACTOR, GRAD_FACTOR, ABS_FLOOR = 2.0, 3.0, 1e-5
# L is fp32 from fp32 scores on every path (no 16-bit rounding on the way), so its error is a few
# fp32 roundings, ex2.approx / lg2.approx included (~1e-6 at |L| ~ 10): far below this bound, and
# far below FA-2's rule, whose same-dtype yardstick (L from 16-bit scores) is ~1e-2.
LSE_ATOL = 1e-3
MATRIX_IDS = [f"v{v}-{dt}-{'causal' if c else 'none'}-d{d}" for v, dt, c, d in MATRIX]


def flash_attn_func():
    from fagen import flash_attn_func as func

    return func


def inputs(shape, dtype, head_dim, *, seed=0, requires_grad=False):
    """q (B, Nq, H, d), k and v (B, Nk, Hk, d): fresh standard normals (never zeros)."""
    batch, nq, nk, heads, kv_heads = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*size):
        t = torch.randn(*size, generator=gen, device=DEVICE).to(TORCH_DTYPE[dtype])
        return t.requires_grad_(requires_grad)

    return (randn(batch, nq, heads, head_dim), randn(batch, nk, kv_heads, head_dim),
            randn(batch, nk, kv_heads, head_dim))


def torch_same_dtype(q, k, v, *, causal=False, keep_mask=None, dropout_p=0.0):
    """Attention with plain torch ops in q's dtype on q's device, (B, Nq, H, d):
    the "same-dtype PyTorch implementation" of the tolerance rule. Causal is
    aligned bottom-right; rows that see no key give 0 (and finite gradients)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        i = torch.arange(nq, device=q.device).unsqueeze(1)
        j = torch.arange(nk, device=q.device).unsqueeze(0)
        visible = j <= i + nk - nq
        has_key = visible.any(-1, keepdim=True)
        # -inf only in rows that keep some key: an all -inf row would give NaN.
        scores = scores.masked_fill(~visible & has_key, float("-inf"))
        probs = torch.softmax(scores, dim=-1) * has_key
    else:
        probs = torch.softmax(scores, dim=-1)
    if keep_mask is not None:
        probs = probs * keep_mask.to(probs.device, probs.dtype) / (1.0 - dropout_p)
    return (probs @ vh).transpose(1, 2)


def max_error(a, b) -> float:
    return (a.detach().double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0


def assert_fa2_rule(name, ours, torch_pt, ref, factor):
    assert_written(ours.detach(), name)
    assert torch.isfinite(ours).all(), f"{name}: NaN or inf (unwritten or overflowed elements)"
    err, err_pt = max_error(ours, ref), max_error(torch_pt, ref)
    assert err <= factor * err_pt + ABS_FLOOR, (
        f"{name}: fagen max error {err:.3g} exceeds {factor}x PyTorch's {err_pt:.3g} "
        "(same-dtype torch vs float64)")
    return err, err_pt


def cpu(*tensors):
    return [t.detach().cpu() for t in tensors]


def has_graph(out) -> bool:
    return bool(getattr(out, "requires_grad", False) and out.grad_fn is not None)


# -- the matrix: v1/v2 x fp16/bf16 x none/causal x d 64/128 --------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{s[0]}_q{s[1]}_k{s[2]}_h{s[3]}/{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("version, dtype, causal, head_dim", MATRIX, ids=MATRIX_IDS)
def test_forward_matches_reference(version, dtype, causal, head_dim, shape):
    q, k, v = inputs(shape, dtype, head_dim)
    out = flash_attn_func()(q, k, v, causal=causal, version=version)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    ref, _ = attention_forward(*cpu(q, k, v), causal=causal)
    assert_fa2_rule("out", out, torch_same_dtype(q, k, v, causal=causal), ref, OUTPUT_FACTOR)


@pytest.mark.parametrize("version, dtype, causal, head_dim", MATRIX, ids=MATRIX_IDS)
def test_lse_matches_reference(version, dtype, causal, head_dim):
    shape = SHAPES[2]  # with empty causal rows
    q, k, v = inputs(shape, dtype, head_dim, seed=1)
    out, lse = flash_attn_func()(q, k, v, causal=causal, version=version, return_lse=True)
    _, ref_lse = attention_forward(*cpu(q, k, v), causal=causal)
    lse = lse.detach().cpu().double()
    assert lse.shape == ref_lse.shape
    finite = torch.isfinite(ref_lse)
    assert torch.equal(lse[~finite], torch.full_like(lse[~finite], float("inf"))), "rows that see no key need L = +inf"
    assert torch.isfinite(lse[finite]).all(), "rows that see a key need a finite L"
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < LSE_ATOL


@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{s[0]}_q{s[1]}_k{s[2]}_h{s[3]}/{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("version, dtype, causal, head_dim", MATRIX, ids=MATRIX_IDS)
def test_backward_matches_reference(version, dtype, causal, head_dim, shape):
    q, k, v = inputs(shape, dtype, head_dim, seed=2, requires_grad=True)
    out = flash_attn_func()(q, k, v, causal=causal, version=version)
    assert has_graph(out), "flash_attn_func's output must carry its backward"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    pt_out = torch_same_dtype(q, k, v, causal=causal)
    pt_grads = torch.autograd.grad(pt_out, (q, k, v), dout)
    ref_out, _ = attention_forward(*cpu(q, k, v), causal=causal)
    refs = attention_backward(*cpu(q, k, v), ref_out, dout.cpu(), causal=causal)
    assert_fa2_rule("out", out, pt_out, ref_out, OUTPUT_FACTOR)
    for name, ours, pt, ref in zip(("dq", "dk", "dv"), grads, pt_grads, refs):
        assert ours.shape == ref.shape and ours.dtype == q.dtype
        assert_fa2_rule(name, ours, pt, ref, GRAD_FACTOR)


# -- dropout: the kernel's mask is the NumPy Philox's, in both passes ----------------------

def one_hot_values(batch, seqlen_k, kv_heads, head_dim, dtype):
    """V with row j = e_j: then out[b, i, h, j] = P_ij * Z_ij, which is 0
    exactly where the kernel dropped (i, j). The mask is read off the output,
    with no debug API. Needs seqlen_k <= head_dim."""
    assert seqlen_k <= head_dim
    eye = torch.zeros(seqlen_k, head_dim, device=DEVICE)
    eye[torch.arange(seqlen_k), torch.arange(seqlen_k)] = 1.0
    return eye.view(1, seqlen_k, 1, head_dim).expand(batch, seqlen_k, kv_heads, head_dim) \
        .contiguous().to(TORCH_DTYPE[dtype])


def mask_from_output(out, seqlen_k):
    """(B, H, Nq, Nk) keep mask from the output of a one-hot-V run."""
    assert (out[..., seqlen_k:] == 0).all(), "columns beyond Nk must be exactly 0 with one-hot V"
    return (out[..., :seqlen_k] != 0).permute(0, 2, 1, 3).cpu()


@pytest.mark.parametrize("version, dtype, head_dim", DROPOUT_CASES,
                         ids=[f"v{v}-{dt}-d{d}" for v, dt, d in DROPOUT_CASES])
def test_dropout_mask_matches_numpy_philox(version, dtype, head_dim):
    """The kernel-level launch with an explicit seed and offset keeps exactly
    the elements fagen.reference.dropout_keep_mask keeps."""
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render
    from fagen.spec import Spec

    batch, nq, nk, heads = 2, 100, min(head_dim, 96), 3
    seed, offset = 0x5EED_1234_ABCD, 7
    q, k, _ = inputs((batch, nq, nk, heads, heads), dtype, head_dim, seed=3)
    q, k = q * 0.5, k * 0.5  # keep every P_ij well above fp16's underflow
    v = one_hot_values(batch, nk, heads, head_dim, dtype)
    spec = Spec(head_dim=head_dim, dtype=dtype, version=version, dropout=True)
    out, _ = attention_kernels.forward(render(spec), q, k, v, dropout_p=DROPOUT_P, seed=seed, philox_offset=offset)
    kept = mask_from_output(out, nk)
    expected = dropout_keep_mask(seed, offset, batch, heads, nq, nk, DROPOUT_P)
    assert kept.shape == expected.shape
    mismatches = (kept != expected).sum().item()
    assert mismatches == 0, f"{mismatches} of {kept.numel()} mask elements differ from the NumPy Philox"
    assert abs(kept.float().mean().item() - (1 - DROPOUT_P)) < 0.02
    ref, _ = attention_forward(*cpu(q, k, v), dropout_p=DROPOUT_P, keep_mask=expected)
    pt = torch_same_dtype(q, k, v, keep_mask=expected, dropout_p=DROPOUT_P)
    assert_fa2_rule("out", out, pt, ref, OUTPUT_FACTOR)


@pytest.mark.parametrize("version", [2, 1])
def test_dropout_mask_is_seeded_by_torch(version):
    """torch.manual_seed reproduces a dropout run; another seed changes the mask."""
    attention = flash_attn_func()
    dtype, d = SEEDED_DROPOUT
    batch, nq, nk, heads = 1, 80, 64, 2
    q, k, _ = inputs((batch, nq, nk, heads, heads), dtype, d, seed=4)
    v = one_hot_values(batch, nk, heads, d, dtype)
    masks = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        masks.append(mask_from_output(attention(q * 0.5, k * 0.5, v, dropout_p=DROPOUT_P, version=version), nk))
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], masks[2])


@needs_cuda
def test_cuda_graph_capture_replays_and_refuses_dropout():
    """Without dropout a captured call replays to the eager result; with dropout capture is
    refused (the Philox pair would be baked into the graph)."""
    attention = flash_attn_func()
    q, k, v = inputs((1, 128, 128, 2, 2), "bf16", 64, seed=9)
    eager = attention(q, k, v, causal=True)
    attention(q, k, v, causal=True)   # compile and load before capture
    torch.cuda.synchronize()
    graph, static_out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        static_out = attention(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            attention(q, k, v, dropout_p=DROPOUT_P)


@needs_cuda
def test_cuda_graph_capture_with_seqlens_k_replays():
    """seqlens_k's value check reads the device; under capture it is skipped (the kernels
    clamp the lengths), so the call captures and replays to the eager result."""
    attention = flash_attn_func()
    q, k, v = inputs((2, 96, 130, 2, 2), "fp16", 64, seed=10)
    seqlens_k = torch.tensor([130, 57], dtype=torch.int32, device=DEVICE)
    eager = attention(q, k, v, causal=True, seqlens_k=seqlens_k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention(q, k, v, causal=True, seqlens_k=seqlens_k)
    seqlens_k.copy_(torch.tensor([40, 130], dtype=torch.int32))   # new lengths, same graph
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, attention(q, k, v, causal=True, seqlens_k=seqlens_k))
    assert not torch.equal(static_out, eager)


def test_a_batch_of_65536_single_query_sequences(monkeypatch):
    """Past gridDim.z's 65535 the batch goes out in chunks. On the emulator (slow per block)
    the same path runs with the limit lowered to 64 and a batch of 130."""
    from fagen.kernels import launch

    batch = 65536
    if DEVICE != "cuda":
        monkeypatch.setattr(launch, "GRID_YZ_LIMIT", 64)
        batch = 130
    q, k, v = inputs((batch, 1, 3, 2, 1), "bf16", 64, seed=11, requires_grad=True)
    out = flash_attn_func()(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    pt_out = torch_same_dtype(q, k, v)
    pt_grads = torch.autograd.grad(pt_out, (q, k, v), dout)
    ref_out, _ = attention_forward(*cpu(q, k, v))
    refs = attention_backward(*cpu(q, k, v), ref_out, dout.cpu())
    assert_fa2_rule("out", out, pt_out, ref_out, OUTPUT_FACTOR)
    for name, ours, pt, ref in zip(("dq", "dk", "dv"), grads, pt_grads, refs):
        assert_fa2_rule(name, ours, pt, ref, GRAD_FACTOR)


@pytest.mark.parametrize("version, dtype, head_dim", DROPOUT_CASES,
                         ids=[f"v{v}-{dt}-d{d}" for v, dt, d in DROPOUT_CASES])
def test_dropout_mask_is_the_same_in_forward_and_backward(version, dtype, head_dim):
    """Gradients match the reference run with the forward's own mask: dV =
    (P * Z)^T dO depends on every mask bit, so a backward that regenerated a
    different mask fails."""
    batch, nq, nk, heads = 2, 90, min(head_dim, 80), 2
    q, k, _ = inputs((batch, nq, nk, heads, heads), dtype, head_dim, seed=5)
    q = (q * 0.5).detach().requires_grad_()
    k = (k * 0.5).detach().requires_grad_()
    v = one_hot_values(batch, nk, heads, head_dim, dtype).requires_grad_()
    torch.manual_seed(1234)
    out = flash_attn_func()(q, k, v, dropout_p=DROPOUT_P, version=version)
    assert has_graph(out), "flash_attn_func's output must carry its backward"
    keep = mask_from_output(out.detach(), nk)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    pt_out = torch_same_dtype(q, k, v, keep_mask=keep.to(DEVICE), dropout_p=DROPOUT_P)
    pt_grads = torch.autograd.grad(pt_out, (q, k, v), dout)
    ref_out, _ = attention_forward(*cpu(q, k, v), dropout_p=DROPOUT_P, keep_mask=keep)
    refs = attention_backward(*cpu(q, k, v), ref_out, dout.cpu(), dropout_p=DROPOUT_P, keep_mask=keep)
    for name, ours, pt, ref in zip(("dq", "dk", "dv"), grads, pt_grads, refs):
        assert_fa2_rule(name, ours, pt, ref, GRAD_FACTOR)


# -- deterministic mode ----------------------------------------------------------------------

@pytest.mark.parametrize("version, causal, head_dim", DETERMINISTIC_CASES)
def test_deterministic_mode_is_bit_identical(version, causal, head_dim):
    attention = flash_attn_func()
    shape = (2, 384, 384, 4, 4)  # several K/V blocks per query block: where atomics would race
    q, k, v = inputs(shape, "bf16", head_dim, seed=6, requires_grad=True)
    dout = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    runs = []
    for _ in range(3):
        out = attention(q, k, v, causal=causal, version=version, deterministic=True)
        assert has_graph(out), "flash_attn_func's output must carry its backward"
        runs.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    for name, first, *others in zip(("out", "dq", "dk", "dv"), *runs):
        for other in others:
            assert torch.equal(first, other), f"{name} differs between deterministic runs"
    ref_out, _ = attention_forward(*cpu(q, k, v), causal=causal)
    refs = attention_backward(*cpu(q, k, v), ref_out, dout.cpu(), causal=causal)
    pt_out = torch_same_dtype(q, k, v, causal=causal)
    pt_grads = torch.autograd.grad(pt_out, (q, k, v), dout)
    for name, ours, pt, ref in zip(("dq", "dk", "dv"), runs[0][1:], pt_grads, refs):
        assert_fa2_rule(name, ours, pt, ref, GRAD_FACTOR)


# -- the emulated matrix's checks, on the hardware -------------------------------------------

@pytest.mark.parametrize("version", KERNEL_CASE_VERSIONS)
@pytest.mark.parametrize("flags, shape", KERNEL_CASES, ids=[f"case{i}" for i in range(len(KERNEL_CASES))])
@pytest.mark.parametrize("head_dim", KERNEL_CASE_HEAD_DIMS)  # d=128 is in the matrix above; keep compiles few
def test_kernel_cases_on_the_gpu(version, flags, shape, head_dim):
    """tests/support/kernel_cases.run_and_check (poisoned outputs, FA-2's rule, key padding with an
    entry of zero keys, dropout with the NumPy Philox mask) on CUDA tensors."""
    from fagen.spec import Spec
    from kernel_cases import Shape, run_and_check

    spec = Spec(head_dim, version=version, dtype="bf16", **flags)
    run_and_check(spec, Shape(*shape), device=DEVICE)


@pytest.mark.parametrize("version", KERNEL_CASE_VERSIONS)
@pytest.mark.parametrize("flags, shape", SINGLE_STAGE_CASES, ids=["key padding", "deterministic"])
def test_single_stage_backward_of_99kb_parts_on_the_gpu(version, flags, shape):
    """The d=128 tiles and one-stage backward that sm_86/89/120 run (fallback table), here on
    whatever GPU is at hand: the same code path, checked on hardware."""
    from fagen.spec import Spec
    from kernel_cases import Shape, run_and_check

    batch, nq, nk, heads, kv_heads = shape
    run_and_check(Spec(128, version=version, dtype="bf16", **flags),
                  Shape(batch, nq, nk, heads=heads, kv_heads=kv_heads), device=DEVICE)
