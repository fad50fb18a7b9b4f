"""The e4m3 forward on a compute capability 9.0 GPU: issue 45's forward rows.

- the accuracy rule on the GPU (tests/support/fp8_cases.py: O within twice the e4m3 rounding
  model's error of the float64 oracle, L within 1e-3), at d 128 and 256, causal or not, GQA;
- its speed (B 2, N 4k, hidden 1024, causal or not), with the per-call V^T copy and without it,
  against fagen's bf16 sm90 forward, SDPA's cuDNN and flash backends in bf16, and cuDNN's fp8 SDPA
  where this torch exposes it (record_property: TF/s, ratios, the copy's time, and why a peer is
  unavailable).

Marked `gpu`: the GPU check's correctness section runs it, and its measurements reach the short
table. `FAGEN_GPU_TESTS_DEVICE=cpu` runs the same logic through the emulator at a small size,
without timing or SDPA.
"""

from __future__ import annotations

import pytest
import torch

from fagen.bench.flops import attention_flops, tflops
from fagen.bench.gpu_cases import FP8_FORWARD_ROW_HEAD_DIMS as HEAD_DIMS, FP8_FORWARD_ROW_SMALL
from fagen.arch_families import sm90_tiles
from fagen.bench.peers import in_family, make_system
from fagen.spec import Spec
from fp8_cases import run_fp8_case
from gpu_rows import DEVICE, ON_GPU, require_sm90, timed_ms
from kernel_cases import Shape

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PEERS = ("sdpa_cudnn", "sdpa_flash")


def size(head_dim: int) -> tuple[int, int, int]:
    """(batch, seqlen, heads): 8k tokens and a hidden size of 1024 on a GPU; small on the emulator."""
    return (2, 4096, 1024 // head_dim) if ON_GPU else FP8_FORWARD_ROW_SMALL


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_fp8_forward_meets_the_accuracy_rule(head_dim, causal):
    require_sm90()
    spec = Spec(head_dim, dtype="e4m3", arch_family="sm90", mask="causal" if causal else "none")
    shape = Shape(2, 1000, 1100, heads=8, kv_heads=2) if ON_GPU else Shape(1, 150, 300, heads=2, kv_heads=1)
    run_fp8_case(spec, shape, device=DEVICE)


def cudnn_fp8_sdpa(q8, k8, v8, causal: bool):
    """cuDNN's fp8 SDPA through torch, where this torch exposes it: F.scaled_dot_product_attention on
    float8_e4m3fn tensors under the cuDNN backend (raises where it does not)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2),
                                              is_causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_fp8_forward_against_bf16_cudnn_and_flash(head_dim, causal, record_property):
    import fagen
    from fagen.kernels.fp8_operands import v_in_slot_order

    require_sm90()
    batch, seqlen, heads = size(head_dim)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=g, device=DEVICE) for _ in range(3))
    q8, k8, v8, qd, kd, vd = fagen.quantize_qkv(q, k, v)
    fp8 = lambda: fagen.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)  # noqa: E731
    out = fp8()
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v)]
    reference = in_family("sm90", fagen.flash_attn_func, *bf16, causal=causal)
    # e4m3's inputs against bf16's: the RMSE of fp8 attention on normal inputs is about 1e-2
    # (benchmarks/fp8_accuracy.py: 7.5e-3 at N 512); a wrong kernel errs by O's own size, about 1e-1 here.
    rmse = (out.float() - reference.float()).pow(2).mean().sqrt().item()
    assert rmse < 0.03, f"fp8 O against bf16 O: RMSE {rmse:.3g}"
    if not ON_GPU:
        return
    flops = attention_flops("fwd", batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim, causal=causal)
    fns = {"fp8": fp8, "bf16_sm90": lambda: in_family("sm90", fagen.flash_attn_func, *bf16, causal=causal)}
    for name in PEERS:
        system = make_system(name)
        reason = system.unavailable_reason()
        if reason is None:
            fns[name] = (lambda s: lambda: s.forward(*bf16, causal))(system)
        else:
            record_property(f"{name}_unavailable", reason)
    try:
        cudnn_fp8_sdpa(q8, k8, v8, causal)
        fns["cudnn_fp8"] = lambda: cudnn_fp8_sdpa(q8, k8, v8, causal)
    except Exception as exc:  # noqa: BLE001 - a peer this torch does not expose is recorded, not failed
        record_property("cudnn_fp8_unavailable", f"{type(exc).__name__}: {str(exc)[:120]}")
    rates = {name: tflops(flops, timed_ms(fn)) for name, fn in fns.items()}
    key_tile = sm90_tiles(Spec(head_dim, dtype="e4m3", arch_family="sm90")).block_n
    copy_ms = timed_ms(lambda: v_in_slot_order(v8, key_tile))
    fp8_ms = flops / rates["fp8"] / 1e9
    record_property("vt_copy_ms", f"{copy_ms:.3f}")
    record_property("fp8_without_copy_tflops", f"{tflops(flops, max(fp8_ms - copy_ms, 1e-6)):.0f}")
    for name, rate in rates.items():
        record_property(f"{name}_tflops", f"{rate:.0f}")
    for name in rates:
        if name != "fp8":
            record_property(f"fp8_over_{name}", f"{rates['fp8'] / rates[name]:.2f}")
