"""A decoding step's plan (issue 26 §5): a warm step whose arguments have a seen signature
(shapes, strides, dtypes, devices, grad flags, alignment, options) skips the checks and reuses
the plan's bound launches. These tests pin what that must not change: results equal a fresh
plan's and the float64 oracle's, and every argument the checks would refuse is still refused
when it comes with the shapes of a call that was fine."""

import pytest
import torch

import fagen
from fagen.ops import kvcache
from kvcache_cases import Case, check_call
from call_counts import count_calls


@pytest.fixture
def prepares(monkeypatch):
    """Counts `_prepare` calls (the checks and kernel lookup of a step), from empty plans."""
    monkeypatch.setattr(kvcache, "_plans", {})
    return count_calls(monkeypatch, kvcache, "_prepare")


@pytest.mark.parametrize("layout", [dict(), dict(page=16), dict(batch_idx=True, leftpad=True)],
                         ids=["contiguous", "paged", "batch_idx+leftpad"])
def test_a_warm_step_reuses_its_plan_and_still_matches_the_oracle(prepares, layout):
    """Two steps with one signature and different values: one prepare, both against the oracle
    (the second's cache_seqlens, new keys and cache contents are its own)."""
    for seed in (40, 41):
        check_call(Case(new=1, seed=seed, **layout), rotary=(32, True), num_splits=2)
    assert len(prepares) == 1


def test_a_warm_step_equals_a_fresh_plan_bit_for_bit(prepares):
    """The packed one-query step (the kernel reads q and writes the caller's output through
    views) of a reused plan, against the same step prepared afresh."""
    results = []
    for fresh in (False, True):
        if fresh:
            kvcache._plans.clear()
        for _ in range(2):   # the second step of each runs the plan of the first
            case = Case(new=1, seed=42)
            results.append(fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, return_softmax_lse=True,
                                                         **case.kwargs()) + (case.k_cache,))
    for warm, fresh in zip(results[1], results[2]):
        assert torch.equal(warm, fresh)
    assert len(prepares) == 2


def _shared(case):
    return dict(v_cache=case.k_cache), "k_cache and v_cache share memory"


def _requires_grad(case):
    return dict(k_cache=case.k_cache.clone().requires_grad_()), "k_cache requires grad"


def _misaligned(case):
    """The same shape and strides as the case's cache, starting 8 bytes off alignment."""
    flat = torch.zeros(case.k_cache.numel() + 4, dtype=case.dtype)
    return dict(k_cache=flat[4:].view(case.k_cache.shape)), "k_cache must be 16-byte aligned"


@pytest.mark.parametrize("change", [_shared, _requires_grad, _misaligned], ids=lambda f: f.__name__.strip("_"))
def test_what_the_checks_refuse_is_refused_after_a_warm_step_of_the_same_shapes(prepares, change):
    case = Case(new=1, seed=43)
    fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs())
    changed, message = change(case)
    args = {**dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, **case.kwargs()), **changed}
    with pytest.raises(ValueError, match=message):
        fagen.flash_attn_with_kvcache(**args)


def test_checked_values_are_read_on_every_step(prepares, monkeypatch):
    """FAGEN_CHECK_VALUES=1 after warm steps: the host check runs and names the entry."""
    case = Case(new=1, seed=44)
    for _ in range(2):
        fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs())
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    bad = case.seqlens.clone()
    bad[2] = case.capacity
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 128 is out of range"):
        fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs(cache_seqlens=bad))


def test_a_padded_head_dims_plan_is_not_kept(prepares):
    """Its plan holds copies of the call's caches: each call prepares."""
    padded = Case(new=1, seed=46, head_dim=60)
    for _ in range(2):
        fagen.flash_attn_with_kvcache(padded.q, padded.k_cache, padded.v_cache, **padded.kwargs())
    assert len(prepares) == 2 and kvcache._plans == {}


def test_a_warm_alibi_step_takes_its_own_slopes(prepares):
    """ALiBi slopes are the call's: a warm step with other slopes equals a fresh plan's step."""
    case = Case(nq=2, seed=45)
    slopes = [torch.rand(4, dtype=torch.float32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    warm = [fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, alibi_slopes=a, causal=True,
                                          **case.kwargs()) for a in slopes]
    assert len(prepares) == 1
    kvcache._plans.clear()
    fresh = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, alibi_slopes=slopes[1], causal=True,
                                          **case.kwargs())
    assert torch.equal(warm[1], fresh) and not torch.equal(warm[0], warm[1])


def test_a_warm_packed_step_passes_q_and_out_as_they_are_unless_q_was_copied(prepares):
    """GQA packing of one query: the first step binds the launch to the packed views' strides; a
    warm one passes q and out themselves (the views start at their first elements), except where
    the first step had to copy q into alignment. Each warm step equals a fresh one bit for bit."""
    case = Case(seed=47)
    fresh = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs())
    (plan,) = kvcache._plans.values()
    assert plan.packs_in_place
    assert torch.equal(fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs()), fresh)
    flat = torch.zeros(case.q.numel() + 4, dtype=case.dtype)
    misaligned = flat[4:].view(case.q.shape)   # 8 bytes off: the packed view is copied
    misaligned.copy_(case.q)
    steps = [fagen.flash_attn_with_kvcache(misaligned, case.k_cache, case.v_cache, **case.kwargs()) for _ in range(2)]
    assert len(prepares) == 2
    assert not [p for p in kvcache._plans.values() if p is not plan][0].packs_in_place
    assert all(torch.equal(step, fresh) for step in steps)
