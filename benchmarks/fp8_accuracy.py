"""fp8 attention's accuracy: the fp8 forward kernel's RMSE against the float64 oracle and its
rounding model's, beside plain PyTorch in bf16's, with and without FlashAttention-3's Hadamard rotation.

    python benchmarks/fp8_accuracy.py [--seqlen 512] [--device cpu|cuda]

Inputs: q, k, v random normal (B 2, H 4, Hk 2), causal; "outliers x N": two channels of q and k N
times the rest (the softmax scale shrunk by N / 3 so that rows stay soft), FlashAttention-3's case for
incoherent processing. fp8: `fagen.ops.fp8_inputs.quantize_qkv` (e4m3, a descale per batch and K/V
head), then `fagen.reference.same_fp8` (e4m3 inputs, P scaled by 2^8 and rounded to e4m3, fp32 sums,
bf16 out). The kernel: `fagen.flash_attn_func` on the same e4m3 inputs (the sm90 family's e4m3
forward, d 64 to 256; on the CPU the emulator runs it).
bf16: `fagen.reference.same_dtype` (the yardstick of the bf16 kernels' tolerance rule). The oracle:
`fagen.reference.attention_forward` in float64 on the unquantised inputs.
"""

import argparse

import torch

import fagen
from fagen.arch_families import SM90_FP8_HEAD_DIMS
from fagen.ops.fp8_inputs import quantize_qkv
from fagen.reference import attention_forward
from fagen.reference.same_dtype import attention_same_dtype
from fagen.reference.same_fp8 import attention_same_fp8


def rmse(a, b) -> float:
    return ((a.double() - b.double()) ** 2).mean().sqrt().item()


def row(d: int, n: int, boost: float, device: str) -> dict:
    g = torch.Generator().manual_seed(d * 1000 + int(boost))
    q, k, v = (torch.randn(2, n, h, d, generator=g) for h in (4, 2, 2))
    q[..., [3, d // 2 + 13]] *= boost
    k[..., [3, d // 2 + 13]] *= boost
    scale = d ** -0.5 / max(1.0, boost / 3)
    oracle = attention_forward(q.double(), k.double(), v.double(), causal=True, softmax_scale=scale)[0]
    bf16 = attention_same_dtype(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.zeros_like(q).bfloat16(),
                                causal=True, softmax_scale=scale)[0]
    result = {"bf16": rmse(bf16, oracle)}
    for rotate in (False, True):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, rotate=rotate)
        out = attention_same_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                 softmax_scale=scale)
        name = "fp8 rotated" if rotate else "fp8"
        result[name] = rmse(out, oracle)
        if d in SM90_FP8_HEAD_DIMS:
            on = (t.to(device) for t in (q8, k8, v8, qd, kd, vd))
            q8, k8, v8, qd, kd, vd = on
            kernel = fagen.flash_attn_func(q8, k8, v8, causal=True, softmax_scale=scale, q_descale=qd, k_descale=kd,
                                           v_descale=vd)
            result[f"kernel {name}"] = rmse(kernel.cpu(), oracle)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--device", default="cpu", help="where the kernel runs (cpu: the emulator)")
    args = parser.parse_args()
    print(f"RMSE against float64, causal, B 2, H 4 / Hk 2, N {args.seqlen}; model: the e4m3 rounding model, "
          f"kernel: fagen's e4m3 forward on {args.device}")
    print(f"{'d':>4} {'inputs':<14} {'bf16':>9} {'model':>9} {'kernel':>9} {'model rot':>9} {'kernel rot':>10} "
          f"{'kernel/bf16':>11} {'rot/plain':>9}")
    for d in (64, 128, 256):
        for boost in (1.0, 10.0, 30.0, 100.0):
            r = row(d, args.seqlen, boost, args.device)
            label = "normal" if boost == 1 else f"outliers x{boost:g}"
            kernel, rotated = r.get("kernel fp8"), r.get("kernel fp8 rotated")
            cell = (lambda x: f"{x:.2e}") if kernel is not None else (lambda x: "-")
            ratio = f"{kernel / r['bf16']:.1f}" if kernel is not None else "-"
            drop = f"{rotated / kernel:.2f}" if kernel is not None else f"({r['fp8 rotated'] / r['fp8']:.2f})"
            print(f"{d:>4} {label:<14} {r['bf16']:9.2e} {r['fp8']:9.2e} {cell(kernel):>9} {r['fp8 rotated']:9.2e} "
                  f"{cell(rotated):>10} {ratio:>11} {drop:>9}", flush=True)


if __name__ == "__main__":
    main()
