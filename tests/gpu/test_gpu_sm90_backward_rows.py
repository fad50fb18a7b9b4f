"""The sm90 family's backward on a compute capability 9.0 GPU: issue 44's GPU rows.

- deterministic=True at d 64, 128 and 256: three runs bit-identical, within two bf16 steps of the
  default backward, and what it costs (record_property: both times and their ratio);
- the backward's speed at d 64, 128 and 256, causal and not, against the sm80 family's backward,
  SDPA's cuDNN and flash backends (record_property: TF/s and ratios), after a check that its
  gradients err against a peer's no more than 3x the sm80 family's do.

Marked `gpu` (not `twins`): the GPU check's correctness section runs it, and its measurements reach
the short table. `FAGEN_GPU_TESTS_DEVICE=cpu` runs the same logic through the emulator at a small
size, without timing or SDPA: a check of the tests themselves before a GPU session.
"""

from __future__ import annotations

import pytest
import torch

from fagen.bench.flops import attention_flops, tflops
from fagen.bench.gpu_cases import SM90_BACKWARD_ROW_HEAD_DIMS as HEAD_DIMS, SM90_BACKWARD_ROW_SMALL
from fagen.bench.peers import in_family, make_system
from gpu_rows import DEVICE, ON_GPU, require_sm90, timed_ms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PEERS = ("sdpa_cudnn", "sdpa_flash")


def size(head_dim: int) -> tuple[int, int, int]:
    """(batch, seqlen, heads): 8k tokens and a hidden size of 1024 on a GPU (about a millisecond
    of backward at d = 128); a small ragged case on the emulator."""
    return (2, 4096, 1024 // head_dim) if ON_GPU else SM90_BACKWARD_ROW_SMALL


def problem(head_dim: int, seed: int = 0):
    batch, seqlen, heads = size(head_dim)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
                     for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def fagen_backward(family: str, inputs, dout, causal: bool, deterministic: bool = False):
    """fagen's forward in `family` (its backward is that call's Spec's), then a function that
    runs the backward alone on the kept graph."""
    from fagen import flash_attn_func

    out = in_family(family, flash_attn_func, *inputs, causal=causal, deterministic=deterministic)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_sm90_deterministic_backward_is_bit_identical_and_its_cost_measured(head_dim, causal, record_property):
    require_sm90()
    inputs, dout = problem(head_dim, seed=1)
    deterministic = fagen_backward("sm90", inputs, dout, causal, deterministic=True)
    runs = [deterministic() for _ in range(3)]
    for name, first, *others in zip(("dq", "dk", "dv"), *runs):
        for other in others:
            assert torch.equal(first, other), f"{name} differs between deterministic runs"
    default = fagen_backward("sm90", inputs, dout, causal)
    for name, ordered, free in zip(("dq", "dk", "dv"), runs[0], default()):
        # The same sums in another order, then one rounding to bf16: two bf16 steps at the largest.
        assert (ordered.float() - free.float()).abs().max() <= 2.0 ** -7 * free.float().abs().max(), name
    if ON_GPU:
        det_ms, plain_ms = timed_ms(deterministic), timed_ms(default)
        record_property("deterministic_ms", f"{det_ms:.3f}")
        record_property("default_ms", f"{plain_ms:.3f}")
        record_property("deterministic_cost", f"{det_ms / plain_ms:.2f}x")


def max_error(grads, reference) -> list[float]:
    return [(g.float() - r.float()).abs().max().item() for g, r in zip(grads, reference)]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_sm90_backward_against_sm80_cudnn_and_flash(head_dim, causal, record_property):
    require_sm90()
    inputs, dout = problem(head_dim, seed=2)
    ours = {family: fagen_backward(family, inputs, dout, causal) for family in ("sm90", "sm80")}
    peers = {}
    for name in PEERS if ON_GPU else ():
        system = make_system(name)
        reason = system.unavailable_reason()
        try:
            if reason is None:
                out = system.forward(*inputs, causal)
                peers[name] = (lambda o: lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True))(out)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case is recorded, not failed
            reason = f"{type(exc).__name__}: {str(exc)[:120]}"
        if reason:
            record_property(f"{name}_unavailable", reason)
    # Correctness first: against the first peer that runs (on the emulator, against each other).
    reference = next(iter(peers.values()), ours["sm80"])()
    sm90_grads = ours["sm90"]()
    errors_90 = max_error(sm90_grads, reference)
    if peers:
        errors_80 = max_error(ours["sm80"](), reference)
        for name, e90, e80 in zip(("dq", "dk", "dv"), errors_90, errors_80):
            assert e90 <= 3 * e80 + 1e-3, f"{name}: sm90 errs {e90:.3g} against a peer, sm80 {e80:.3g}"
    else:
        for name, error, g in zip(("dq", "dk", "dv"), errors_90, reference):
            assert error <= 2.0 ** -6 * g.float().abs().max().item() + 1e-3, f"{name}: sm90 and sm80 differ by {error:.3g}"
    if not ON_GPU:
        return
    batch, seqlen, heads = size(head_dim)
    flops = attention_flops("bwd", batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim, causal=causal)
    rates = {name: tflops(flops, timed_ms(fn)) for name, fn in {**ours, **peers}.items()}
    for name, rate in rates.items():
        record_property(f"{name}_tflops", f"{rate:.0f}")
    for name in ("sm80", *peers):
        record_property(f"sm90_over_{name}", f"{rates['sm90'] / rates[name]:.2f}")
