"""What every timing section shares: inputs, one timed cell, the check of a fast kernel against
torch, and the failure bookkeeping (the time guard's reason, a lost CUDA context).

Torch is imported inside the functions: the plan, the report and --dry-run import the sections
on machines where only their text is needed.
"""

from __future__ import annotations

import gc
import math
from typing import Callable

from .flops import tflops
from .peers import NotAvailable, System, failure_reason, is_out_of_memory
from .speed.config import FORWARD_ONLY, timed_passes
from .timing import Timing

GUARD_REASON = "skipped: time guard (the section's deadline was reached)"
# A kernel fault leaves the process's CUDA context unusable: every later
# launch fails with the same error, so the sweep stops instead of recording it
# a thousand times. (The correctness section runs first, in a subprocess, so
# a faulting kernel is normally caught there.)
CONTEXT_LOST_MARKERS = ("illegal memory access", "illegal address", "illegal instruction",
                        "unspecified launch failure", "misaligned address", "device-side assert",
                        "cuda_error_launch", "context is destroyed")
FLEX_FIRST_COMPILE_S = 25.0  # do not start a Flex compile with less than this left


def context_lost(reason: str) -> bool:
    text = reason.lower()
    return any(marker in text for marker in CONTEXT_LOST_MARKERS)


def torch_dtype(name: str):
    from ..dtypes import TORCH_DTYPE   # imports torch: not at the plan's import

    return TORCH_DTYPE[name]


def make_inputs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: str, device):
    """q, k, v (B, N, H, d) of standard normal values, requiring grad."""
    import torch

    shape = (batch, seqlen, heads, head_dim)
    return tuple(torch.randn(shape, device=device, dtype=torch_dtype(dtype)).requires_grad_()
                 for _ in range(3))


def free_memory(device) -> None:
    gc.collect()
    try:
        import torch

        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def free_bytes(device) -> int:
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return 1 << 62  # CPU tests: never refuse on memory


# -- one measurement ---------------------------------------------------------

def timed_cell(fn: Callable[[], object], flops: float, timer: Callable[..., Timing],
               timer_kwargs: dict) -> dict:
    timing = timer(fn, **timer_kwargs)
    cell = timing.to_dict()
    cell["tflops"] = tflops(flops, timing.median_ms)
    # The host issuing calls slower than the GPU finishes them means the
    # number is a host-overhead figure, not the kernel's speed.
    cell["host_bound"] = timing.host_ms >= 0.9 * timing.median_ms
    return cell


def measure_system(system: System, q, k, v, causal: bool, passes: tuple, flops: dict,
                   timer: Callable[..., Timing], timer_kwargs: dict) -> dict:
    """{pass: cell} for one system at one point; exceptions become skipped cells."""
    import torch

    cells: dict = {}
    grads = (q, k, v)
    try:
        out = system.forward(q, k, v, causal)  # also the first warm-up (compiles)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        reason = failure_reason(exc)
        return {p: {"skipped": reason, "oom": is_out_of_memory(exc), "stage": "forward"} for p in passes}
    dout = torch.randn_like(out)
    no_graph = None
    if not getattr(out, "requires_grad", False) or out.grad_fn is None:
        no_graph = f"{system.label} has no backward here (its output has no grad_fn)"
    # Drop the probe's graph: for the math backend it holds N x N matrices,
    # and the forward timing below builds (and frees) its own each call.
    out = None
    timed = timed_passes(system.name, passes)
    for pass_ in passes:
        if pass_ not in timed:
            cells[pass_] = {"skipped": FORWARD_ONLY[system.name]}
            continue
        try:
            if pass_ == "fwd":
                fn = lambda: system.forward(q, k, v, causal)  # noqa: E731
            elif no_graph is not None:
                raise NotAvailable(no_graph)
            elif pass_ == "bwd":
                out = system.forward(q, k, v, causal)  # one graph, replayed backward
                fn = lambda: torch.autograd.grad(out, grads, dout, retain_graph=True)  # noqa: E731
            else:
                fn = lambda: torch.autograd.grad(system.forward(q, k, v, causal), grads, dout)  # noqa: E731
            cells[pass_] = timed_cell(fn, flops[pass_], timer, timer_kwargs)
        except Exception as exc:  # noqa: BLE001
            cells[pass_] = {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
        out = None
    return cells


# -- sanity: is a fast kernel also right? ---------------------------------------

def torch_attention(q, k, v, causal: bool, compute_dtype):
    """softmax(Q K^T / sqrt(d)) V in `compute_dtype` with plain torch ops, (B, N, H, d)."""
    import torch

    qh, kh, vh = (x.transpose(1, 2).to(compute_dtype) for x in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        i = torch.arange(nq, device=q.device).unsqueeze(1)
        j = torch.arange(nk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(j > i + nk - nq, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def add_gradient_errors(result: dict, out, ref, same, inputs) -> None:
    """dq, dk, dv errors of `out` against fp32 `ref`, beside the same-dtype `same`'s (the 3x rule),
    into `result`; a missing backward or a failing one is recorded, not raised."""
    import torch

    if not (getattr(out, "requires_grad", False) and out.grad_fn is not None):
        result["bwd_error"] = "no backward (output has no grad_fn)"
        return
    dout = torch.randn_like(out)
    try:
        ours = torch.autograd.grad(out, inputs, dout)
        refs = torch.autograd.grad(ref, inputs, dout.float())
        pts = torch.autograd.grad(same, inputs, dout)
        for name, a, r, p in zip(("dq", "dk", "dv"), ours, refs, pts):
            e, e_pt = (a.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
            result[f"{name}_err"], result[f"{name}_torch_err"] = e, e_pt
            result["ok"] = bool(result["ok"] and e <= 3 * e_pt + 1e-4)
    except Exception as exc:  # noqa: BLE001
        result["bwd_error"] = failure_reason(exc)
