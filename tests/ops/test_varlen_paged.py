"""Packed queries over a paged K/V cache (`flash_attn_varlen_func(..., block_table=...)`, Spec
varlen + kv_cache="paged") on the emulator: forward only, as in flash-attn. Each sequence's
output and L against the float64 oracle on that sequence's keys gathered from its pages
(FlashAttention-2's rule), with ragged and empty sequences, pages of 16 and 48 rows in a
shuffled table, causal bottom-right per sequence, GQA, window / softcap / ALiBi, score_mod /
mask_mod, and the bad inputs. The oracle tests run on both kernel families (FAGEN_ARCH_FAMILY: the
sm90 forward reads a page's keys by TMA boxes, templates/sm90/hopper_kv_cache.j2)."""

import pytest
import torch

import fagen
from fagen.kernels.render import render
from fagen.kernels.compile import compile_source
from fagen.spec import Spec
from kernel_cases import max_error
from varlen_paged_cases import (H, HK, D, LENGTHS_K, LENGTHS_Q, check_against_the_oracle, cu, gathered, paged,
                                recorded_families)


# The sm90 family's cases, but for the variants' case and the racecheck's, are in the slow tier: each
# spec the emulator builds costs CI about 10 s on two cores.
SM90_SLOW = pytest.param("sm90", marks=pytest.mark.slow)


@pytest.fixture(params=["sm80", SM90_SLOW])
def family(request, monkeypatch):
    """FAGEN_ARCH_FAMILY for the test's calls; afterwards, that every call built that family's spec."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", request.param)
    built = recorded_families(monkeypatch)
    yield request.param
    assert built and set(built) == {request.param}, built


@pytest.mark.parametrize("page, causal, variant", [
    (16, True, {}),
    (48, False, {}),
    (16, True, {"window_size": (9, 0), "softcap": 20.0, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}),
    # ALiBi alone adds its bias to the raw scores (variants.cuda alibi_raw_scale); the softcap
    # alone runs in units of the cap (capped_score)
    (16, True, {"alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}),
    (48, False, {"softcap": 5.0}),
])
def test_each_sequence_against_the_oracle(page, causal, variant, family):
    q, k, v, table = paged(page, seed=page)
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                            causal=causal, block_table=table, return_lse=True, **variant)
    check_against_the_oracle(out, lse, q, k, v, table, causal, variant)


@pytest.mark.parametrize("family", ["sm90"], indirect=True)
def test_the_sm90_family_with_a_window_softcap_and_alibi(family):
    """The default tier's sm90 case: pages of 48 (three TMA boxes of 16 keys each), causal."""
    test_each_sequence_against_the_oracle(48, True, {"window_size": (9, 0), "softcap": 20.0,
                                                     "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}, family)


HEAD_BIAS = torch.tensor([0.4, -0.3, 0.2, 0.1])


def head_score(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS[h] - 0.02 * (q_idx - kv_idx)


def head_mask(b, h, q_idx, kv_idx):
    return kv_idx >= 3 * h + q_idx % 4


def test_score_and_mask_mods_over_pages(family):
    """A score_mod and a mask_mod that read the head and the sequence's own query index, over a
    paged cache (the decoding kernels take mods as the training ones do)."""
    q, k, v, table = paged(16, seed=5)
    variant = {"score_mod": head_score, "mask_mod": head_mask}
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                            causal=True, block_table=table, return_lse=True, **variant)
    check_against_the_oracle(out, lse, q, k, v, table, True, variant)


def test_head_dim_not_a_multiple_of_8_reads_a_padded_copy(family):
    """flash-attn pads d = 59 (and its default scale keeps the true d); the caller's cache is read,
    never written."""
    q, k, v, table = paged(16, seed=11, d=59)
    before_k, before_v = k.clone(), v.clone()
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K),
                                            causal=True, block_table=table, return_lse=True)
    check_against_the_oracle(out, lse, q, k, v, table, True, {})
    assert torch.equal(k, before_k) and torch.equal(v, before_v)


def test_paged_equals_packed_keys(family):
    """The same keys packed (the training path) and paged give the same attention."""
    q, k, v, table = paged(16, seed=7)
    packed_k = torch.cat([gathered(k, table, b)[0] for b in range(len(LENGTHS_K))])
    packed_v = torch.cat([gathered(v, table, b)[0] for b in range(len(LENGTHS_K))])
    args = (cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    from_pages = fagen.flash_attn_varlen_func(q, k, v, *args, causal=True, block_table=table)
    from_packed = fagen.flash_attn_varlen_func(q, packed_k, packed_v, *args, causal=True)
    assert max_error(from_pages, from_packed) <= 2 * 2**-10   # different tiles: a rounding apart at most


def _args():
    q, k, v, table = paged(16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(LENGTHS_Q), cu_seqlens_k=cu(LENGTHS_K), max_seqlen_q=max(LENGTHS_Q),
                max_seqlen_k=max(LENGTHS_K), block_table=table)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"block_table": torch.zeros(5, 5)}, TypeError, "block_table must be a 2-D int32"),
    ({"block_table": torch.zeros(4, 5, dtype=torch.int32)}, ValueError, r"block_table must be \(5, max_pages\)"),
    ({"block_table": torch.full((5, 5), 99, dtype=torch.int32)}, ValueError, "block_table names page 99"),
    ({"max_seqlen_k": 500}, ValueError, "max_seqlen_k = 500 is more than"),
    ({"k": torch.zeros(28, 24, HK, D, dtype=torch.float16), "v": torch.zeros(28, 24, HK, D, dtype=torch.float16)},
     ValueError, "page_size .* multiple of 16"),
    ({"k": torch.zeros(28 * 16, HK, D, dtype=torch.float16)}, ValueError, "k must have 4 dims"),
    ({"dropout_p": 0.1}, ValueError, "without dropout"),
    ({"sinks": torch.zeros(H)}, ValueError, "with a block_table"),
])
def test_bad_paged_inputs(change, error, message, monkeypatch):
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")   # the block table's values too, with their messages
    with pytest.raises(error, match=message):
        fagen.flash_attn_varlen_func(**{**_args(), **change})


def test_a_page_outside_the_cache_is_refused_by_the_kernel_by_default(family):
    """Not read on the host: the forward's guard reads page 0 in its place and the call raises."""
    with pytest.raises(ValueError, match="out of range in cu_seqlens_q, cu_seqlens_k or block_table"):
        fagen.flash_attn_varlen_func(**{**_args(), "block_table": torch.full((5, 5), 99, dtype=torch.int32)})


def test_paged_runs_the_forward_on_inputs_that_require_grad_and_refuses_a_backward():
    """As flash-attn: its tests call it with q requiring grad and never differentiate it."""
    args = _args()
    with torch.no_grad():
        expected, expected_lse = fagen.flash_attn_varlen_func(**args, return_lse=True)
    args["q"].requires_grad_(True)
    out, lse = fagen.flash_attn_varlen_func(**args, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert out.requires_grad
    out.mul_(2)   # an ordinary output: in-place use is fine
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func with a block_table is forward only"):
        (out.float().sum() + lse.sum()).backward()
    assert args["q"].grad is None


# producer-first and random order the sm90 family's warp roles (its producer and consumers).
@pytest.mark.parametrize("family, schedule", [("sm80", "warp-serial"), ("sm90", "producer-first"),
                                              pytest.param("sm90", "warp-serial-reverse", marks=pytest.mark.slow),
                                              pytest.param("sm90", "random", marks=pytest.mark.slow)],
                         indirect=["family"])
def test_paged_varlen_kernel_is_race_free(monkeypatch, family, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    q, k, v, table = paged(48, seed=5)
    fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K), causal=True,
                                 block_table=table)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_varlen_kernels_compile_without_spills(head_dim, arch):
    spec = Spec.for_kv_cache(head_dim, "bf16", causal=True, page_size=16, varlen=True, window=True, softcap=True,
                             alibi=True)
    assert spec.name.endswith("varlen_paged_m64n16w4s2") and spec.block_n == 16   # tiles never straddle a page
    for name, report in compile_source(render(spec), arch).resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name} on {arch}: {report}"


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_the_sm90_forward_compiles_for_sm_90a_without_spills(head_dim):
    """The sm90 family's spec (arch_families.chosen_decoding_spec: its own key tiles, a TMA box per
    16 keys of pages of 16), every variant it takes here."""
    pytest.importorskip("cuda.bindings")
    from fagen.arch_families import chosen_decoding_spec

    spec = chosen_decoding_spec(Spec.for_kv_cache(head_dim, "bf16", causal=True, page_size=16, varlen=True,
                                                  window=True, softcap=True, alibi=True), "sm90", None)
    assert spec.arch_family == "sm90" and spec.name.endswith("varlen_paged_sm90")
    for name, report in compile_source(render(spec), "sm_90a").resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name}: {report}"
