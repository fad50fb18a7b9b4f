"""fp8 attention backward's accuracy: which of the backward's five GEMMs may run in fp8 (issue 45, part 3).

    python benchmarks/fp8_backward_accuracy.py [--quick]

Inputs: B 1, H 4, Hk 2, N 512, d 128 (--quick: N 128, d 64), standard normal q, k, v, dO; three cases:
not causal, causal, and causal with outliers (two channels of q and k 10x the rest, the softmax scale
shrunk by 10 / 3 so that rows stay soft, as benchmarks/fp8_accuracy.py). q, k, v, O quantised to e4m3
and dO to e4m3 or e5m2, each with a descale per (batch, K/V head). The oracle: float64 gradients of
the dequantised inputs (`attention_backward`); O is the oracle's, quantised (so only the backward's
roundings are measured), lse the oracle's in fp32.

Each cell: RMSE / RMS of the oracle, of
  (a) plain PyTorch in bf16 on the dequantised inputs (`attention_same_dtype`), FlashAttention-2's yardstick
  (dO) the oracle's gradients of the unquantised dO: what dO's format costs before any kernel runs
  (b) the rounding model (`same_fp8_backward`) with every GEMM in bf16: the fp8 inputs' roundings only
  (c) the model with one GEMM in fp8 (dS in e4m3 scaled per 64 x 128 tile, unless the row says otherwise)
  (d) the model with all five in fp8
The rule: a GEMM may be fp8 if every gradient's RMSE is at most 2x (b)'s plus the suite's 1e-5 floor
(tests/support/kernel_cases.py), in every case and for both dO formats.
"""

import argparse

import torch

from fagen.ops.fp8_inputs import dequantize, quantize, quantize_qkv, saturated
from fagen.reference import attention_backward, attention_forward, attention_same_dtype
from fagen.reference.same_fp8_backward import GEMMS, attention_backward_same_fp8

FACTOR, ABS_FLOOR = 2.0, 1e-5
GRADS = ("dq", "dk", "dv")
CASES = (("normal", False, 1.0), ("causal", True, 1.0), ("outliers", True, 10.0))


def quantize_e5m2(x: torch.Tensor, group: int):
    """x (B, N, heads, d) as e5m2 with a descale per group of heads, its largest magnitude at 57344."""
    batch, _, heads, _ = x.shape
    amax = x.abs().float().amax(dim=(1, 3)).view(batch, heads // group, group).amax(-1)
    descale = amax / 57344.0
    scaled = x.float() / descale.repeat_interleave(group, 1)[:, None, :, None]
    return saturated(scaled, torch.float8_e5m2), descale


def make_case(n: int, d: int, causal: bool, boost: float, do_format: str, seed: int = 0) -> dict:
    """The model's inputs (e4m3 q, k, v, O; dO in do_format; descales; fp32 lse), the oracle's
    gradients, and plain bf16's."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, h, d, generator=g) for h in (4, 2, 2, 4))
    q[..., [3, d // 2 + 13]] *= boost
    k[..., [3, d // 2 + 13]] *= boost
    scale = d ** -0.5 / max(1.0, boost / 3)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    do8, dod = quantize(dout, 2) if do_format == "e4m3" else quantize_e5m2(dout, 2)
    qx, kx, vx, dox = (dequantize(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd), (do8, dod)))
    out, lse = attention_forward(qx, kx, vx, causal=causal, softmax_scale=scale)
    o8, od = quantize(out.float(), 2)
    oracle = attention_backward(qx, kx, vx, out, dox, causal=causal, softmax_scale=scale)
    plain = attention_same_dtype(*(t.bfloat16() for t in (qx, kx, vx, dox)), causal=causal, softmax_scale=scale)[1:]
    unrounded_do = attention_backward(qx, kx, vx, out, dout.double(), causal=causal, softmax_scale=scale)
    inputs = dict(q=q8, k=k8, v=v8, out=o8, dout=do8, lse=lse.float(), q_descale=qd, k_descale=kd, v_descale=vd,
                  o_descale=od, do_descale=dod, softmax_scale=scale, causal=causal)
    return {"inputs": inputs, "oracle": oracle, "plain": plain, "unrounded_do": unrounded_do}


def relative_errors(grads, oracle) -> dict:
    """RMSE / RMS(oracle) per gradient, and the floor in the same units."""
    rel = {name: ((g.double() - o) ** 2).mean().sqrt().item() / o.pow(2).mean().sqrt().item()
           for name, g, o in zip(GRADS, grads, oracle)}
    floor = {name: ABS_FLOOR / o.pow(2).mean().sqrt().item() for name, o in zip(GRADS, oracle)}
    return rel, floor


def configurations(n: int) -> dict:
    """Row label -> the model's keyword arguments, or the name of gradients `make_case` made."""
    rows = {"(a) plain bf16": "plain", "(dO) its own rounding": "unrounded_do", "(b) bf16 GEMMs": dict(fp8_gemms=())}
    rows.update({f"(c) {g} fp8": dict(fp8_gemms=(g,)) for g in GEMMS})
    rows.update({f"(c) {g} fp8, dS e5m2": dict(fp8_gemms=(g,), ds_dtype=torch.float8_e5m2) for g in ("dk", "dq")})
    rows["(c) dk+dq fp8, dS scale/head"] = dict(fp8_gemms=("dk", "dq"), ds_block=(n, n))
    rows["(d) all fp8"] = dict(fp8_gemms=GEMMS)
    return rows


def measure(n: int, d: int) -> dict:
    """{(row, do_format, case): (relative errors, floors)}."""
    results = {}
    for do_format in ("e4m3", "e5m2"):
        for label, causal, boost in CASES:
            case = make_case(n, d, causal, boost, do_format)
            for row, kwargs in configurations(n).items():
                grads = (case[kwargs] if isinstance(kwargs, str) else
                         attention_backward_same_fp8(**case["inputs"], **kwargs))
                results[row, do_format, label] = relative_errors(grads, case["oracle"])
    return results


def print_table(results: dict, n: int) -> None:
    head = " | ".join(f"{c} {g}" for c, _, _ in CASES for g in GRADS)
    print(f"| row | dO | {head} |\n|---|---|" + "---:|" * (len(CASES) * len(GRADS)))
    for row in configurations(n):
        for do_format in ("e4m3", "e5m2"):
            cells = " | ".join(f"{results[row, do_format, c][0][g]:.2e}" for c, _, _ in CASES for g in GRADS)
            print(f"| {row} | {do_format} | {cells} |")


def verdict(results: dict, row: str) -> tuple:
    """(passes, worst ratio to (b), worst ratio to (a)) of a row over every case, dO format and gradient."""
    passes, to_b, to_a = True, 0.0, 0.0
    for (r, do_format, c), (rel, floor) in results.items():
        if r != row:
            continue
        base, plain = results["(b) bf16 GEMMs", do_format, c][0], results["(a) plain bf16", do_format, c][0]
        for g in GRADS:
            passes &= rel[g] <= FACTOR * base[g] + floor[g]
            to_b, to_a = max(to_b, rel[g] / base[g]), max(to_a, rel[g] / plain[g])
    return passes, to_b, to_a


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="N 128, d 64")
    args = parser.parse_args()
    n, d = (128, 64) if args.quick else (512, 128)
    results = measure(n, d)
    print(f"RMSE / RMS of the float64 oracle; B 1, H 4, Hk 2, N {n}, d {d}\n")
    print_table(results, n)
    print(f"\nThe rule: each gradient's RMSE <= {FACTOR:g} x (b)'s + {ABS_FLOOR:g} (worst over cases, dO formats, "
          "gradients)")
    for row in configurations(n):
        if row.startswith(("(c)", "(d)")):
            passes, to_b, to_a = verdict(results, row)
            print(f"  {row:<30} {'pass' if passes else 'FAIL'}   worst x(b) {to_b:5.2f}   worst x(a) {to_a:5.2f}")
    fp8_ok = [g for g in GEMMS if verdict(results, f"(c) {g} fp8")[0]]
    print(f"Recommended: fp8 for {', '.join(fp8_ok) or 'none'}; bf16 for "
          f"{', '.join(g for g in GEMMS if g not in fp8_ok) or 'none'}")


if __name__ == "__main__":
    main()
