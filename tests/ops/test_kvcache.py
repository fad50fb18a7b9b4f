"""Decoding against a KV cache (`flash_attn_with_kvcache`, Spec.kv_cache) on the emulator.

Each call is checked against an independent oracle of the append and against the float64
attention oracle per batch entry (tests/support/kvcache_cases.py `check_call`); refused calls must
leave the cache exactly as it was. Covered: contiguous and paged caches (pages of 16, 32, 48 rows
in a shuffled block table), append with and without rotary (interleaved and not),
cache_batch_idx and cache_leftpad, causal, window / softcap / ALiBi, GQA packing, empty
entries, and split counts 1, 2, 3 and the heuristic.
"""

import math

import pytest
import torch

import fagen
from fagen.kernels import kv_kernels
from fagen.kernels.render import render
from fagen.kernels.compile import compile_source
from fagen.kernels.splits import choose_splits
from fagen.ops.kvcache import decode_spec
from kernel_cases import max_error
from kvcache_cases import HK, B, D, H, Case, check_call

@pytest.mark.parametrize("num_splits", [1, 2, 3, 0])
def test_decode_without_append_every_split_count(num_splits):
    check_call(Case(capacity=160), num_splits=num_splits)   # Nq = 1 with GQA: packed


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_append_with_rotary_causal(interleaved, num_splits):
    check_call(Case(nq=3, new=3, seed=1), causal=True, rotary=(32, interleaved), num_splits=num_splits)


@pytest.mark.parametrize("page", [16, 32, 48])
def test_paged_cache_with_append(page):
    check_call(Case(nq=2, new=2, capacity=96 if page == 48 else 128, page=page, seed=2), causal=True,
               rotary=(64, False), num_splits=2)


def test_paged_decode_heuristic_split_and_full_rotary():
    check_call(Case(new=1, page=16, seed=3), rotary=(64, True))


def test_cache_batch_idx_and_leftpad():
    check_call(Case(nq=2, new=2, batch_idx=True, leftpad=True, seed=4), causal=True, rotary=(16, True),
               num_splits=3)


def test_variants_window_softcap_alibi():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check_call(Case(nq=2, new=1, seed=5), causal=True, num_splits=2, window_size=(20, 0), softcap=15.0,
               alibi_slopes=slopes)


def test_softcap_alone_in_the_cap_s_units_over_splits():
    # The softcap alone runs in units of the cap (variants.cuda.capped): the split partials' L
    # comes back from those units.
    check_call(Case(nq=2, new=1, seed=7), causal=True, num_splits=3, softcap=15.0)


def test_bf16_non_causal_queries_share_the_last_position():
    check_call(Case(torch.bfloat16, nq=2, new=2, seed=6), rotary=(32, True), num_splits=0)


def test_splits_merge_to_the_unsplit_result():
    case = Case(capacity=256, seed=7)
    one = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=200, num_splits=1,
                                        return_softmax_lse=True)
    three = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=200, num_splits=3,
                                          return_softmax_lse=True)
    assert max_error(one[0], three[0]) <= 2 * 2**-10 and max_error(one[1], three[1]) < 1e-5


def test_choose_splits():
    assert choose_splits(row_blocks=200, key_tiles=128, processors=132) == 1     # the SMs are already full
    chosen = choose_splits(row_blocks=8, key_tiles=128, processors=132)
    assert 1 < chosen <= 128 and (8 * chosen) / 132 / math.ceil(8 * chosen / 132) >= 0.85 * 0.99
    assert choose_splits(row_blocks=1, key_tiles=3, processors=132) == 3        # never more splits than tiles
    assert choose_splits(row_blocks=1, key_tiles=1, processors=132) == 1


def _bad_inputs():
    """(change to the call, error, message): each refused before anything is written."""
    bt = torch.zeros(B, 8, dtype=torch.int32)
    return [
        (dict(cache_seqlens=torch.tensor([37, 0, 127], dtype=torch.int32)), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([-1, 0, 5], dtype=torch.int32)), ValueError, "out of range"),
        (dict(cache_seqlens=torch.tensor([1, 2, 3])), TypeError, "cache_seqlens must be an int32"),
        (dict(cache_seqlens=None), ValueError, "cache_seqlens is needed"),
        (dict(block_table=bt.long()), TypeError, "block_table must be an int32"),
        (dict(block_table=bt + 99), ValueError, "block_table"),
        (dict(cache_batch_idx=torch.tensor([0, 1, 9], dtype=torch.int32)), ValueError, "cache_batch_idx"),
        (dict(cache_leftpad=torch.tensor([40, 0, 0], dtype=torch.int32)), ValueError, "cache_leftpad"),
        (dict(k=None), ValueError, "k and v must be given together"),
        (dict(rotary_cos=torch.zeros(128, 4).half(), rotary_sin=torch.zeros(128, 3).half()), ValueError,
         "same shape"),
        (dict(rotary_cos=torch.zeros(128, 4).half()), ValueError, "given together"),
        (dict(k_cache=torch.empty(B, 128, HK, D, dtype=torch.float16, device="meta")), ValueError, "device"),
        (dict(rotary_cos=torch.zeros(128, 40).half(), rotary_sin=torch.zeros(128, 40).half()), ValueError,
         "rotary dimension"),
        (dict(rotary_cos=torch.zeros(64, 16).half(), rotary_sin=torch.zeros(64, 16).half()), ValueError,
         "a row per cache position"),
        (dict(q=torch.randn(B, 1, 3, D).half()), ValueError, "multiple of k_cache's"),
        (dict(q=torch.randn(B, 1, H, D).bfloat16()), ValueError, "dtype"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(window_size=(3,)), ValueError, "window_size"),
    ]


def _case_id(value):
    # A case's id names the arguments it changes, never their values: a random tensor's
    # printed values would differ between processes (pytest-xdist's workers collect alike).
    if isinstance(value, dict):
        return "+".join(value)
    return value.__name__ if isinstance(value, type) else str(value)


@pytest.mark.parametrize("checked", ["", "1"], ids=["kernel guards", "FAGEN_CHECK_VALUES=1"])
@pytest.mark.parametrize("change, error, message", _bad_inputs(), ids=_case_id)
def test_bad_inputs_leave_the_cache_untouched(change, error, message, checked, monkeypatch):
    """Refused by the host's checks, or (index values, by default) by the kernels' guards."""
    monkeypatch.setenv("FAGEN_CHECK_VALUES", checked)
    case = Case(nq=1, new=2, seed=8)
    before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, **case.kwargs())
    if "block_table" in change:   # a table for a contiguous cache is read as paged: page_size 128 is fine
        args.update(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32))
    args.update(change)
    with pytest.raises(error, match=message):
        fagen.flash_attn_with_kvcache(**args)
    assert torch.equal(case.k_cache, before_k) and torch.equal(case.v_cache, before_v)


def test_bad_page_size_and_paged_with_batch_idx():
    case = Case(page=16, new=1, seed=9)
    cache = torch.zeros(20, 24, HK, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="page_size .* multiple of 16"):
        fagen.flash_attn_with_kvcache(case.q, cache, cache.clone(), **case.kwargs())
    assert not cache.any()
    with pytest.raises(ValueError, match="no cache_batch_idx"):
        fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache,
                                      **case.kwargs(cache_batch_idx=torch.zeros(B, dtype=torch.int32)))


def test_kv_cache_kernels_are_race_free(monkeypatch):
    """The update, the split forward and the combine under racecheck (warp-serial schedule)."""
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "warp-serial")
    case = Case(nq=2, new=2, page=48, capacity=96, seed=10)
    source = render(decode_spec(D, torch.float16, True, 48, {}))
    cos = torch.rand(case.capacity, 16).half()
    q = kv_kernels.update_kv_cache(source, case.q, case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                            block_table=case.block_table, rotary=(cos, cos, True), q_positions_step=True)
    keys = (case.seqlens + 2).to(torch.int32)
    kv_kernels.forward_kv_cache(source, q, case.k_cache, case.v_cache, keys, seqlen_k=case.capacity,
                         block_table=case.block_table, num_splits=3)


KERNEL_SPECS = [decode_spec(d, torch.float16, causal, page, fields)
                for d in (64, 128, 256)
                for causal, page, fields in ((True, None, {}), (False, 16, {"window": True, "softcap": True,
                                                                           "alibi": True}))]
# V's own head dim (Spec.head_dim_v), with GQA packing and every built-in a decode step takes.
KERNEL_SPECS += [decode_spec(d, torch.float16, True, page, {"head_dim_v": dv, "pack_gqa": True, "window": True,
                                                              "softcap": True, "alibi": True})
                 for d, dv, page in ((192, 128, 64), (128, 64, None), (512, 512, 64))]
# Absorbed MLA (Spec.v_from_k): 576-wide rows, V their first 512 columns, paged (64) and not.
KERNEL_SPECS += [decode_spec(576, torch.bfloat16, False, page, {"head_dim_v": 512, "v_from_k": True, "pack_gqa": True})
                 for page in (64, None)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=lambda s: s.name)
def test_decode_kernels_compile_without_spills(spec, arch):
    compiled = compile_source(render(spec), arch)
    assert set(compiled.resources) == {e.name for e in render(spec).entries}
    for name, report in compiled.resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name} on {arch}: {report}"


def test_kv_cache_spec_names_round_trip_and_refuse_training_flags():
    spec = decode_spec(128, torch.bfloat16, True, 32, {"softcap": True})
    assert spec.name.startswith("fa2_d128_causal_softcap_bf16_pad_paged") and fagen.Spec.from_name(spec.name) == spec
    with pytest.raises(ValueError, match="key_padding"):
        fagen.Spec(64, kv_cache="contiguous")
    with pytest.raises(ValueError, match="dropout"):
        fagen.Spec(64, kv_cache="paged", key_padding=True, dropout=True)


def test_fagen_show_prints_a_decoding_kernel(capsys, tmp_path):
    from fagen.cli import main

    name = decode_spec(D, torch.float16, True, 32, {}).name
    assert main(["show", name, "--dir", str(tmp_path)]) == 0
    code = capsys.readouterr().out
    assert f"fagen generated kernel source: {name}" in code and f"{name}_cache_update" in code
    assert main(["show", name, "--resources", "--dir", str(tmp_path)]) == 2
    assert "decoding kernel" in capsys.readouterr().err


def test_value_checks_run_with_FAGEN_CHECK_VALUES_where_values_can_be_read(monkeypatch):
    """By default the index values are left to the kernels' guards (reading them would sync);
    FAGEN_CHECK_VALUES=1 checks them on the host, except under CUDA graph capture or
    torch.compile, where they cannot be read. The shape and dtype checks always run."""
    from fagen.ops import common, kvcache_args

    case = Case(new=1, seed=13)
    bad = torch.tensor([500, 0, 0], dtype=torch.int32)
    args = (case.q, case.k_cache, case.v_cache, case.k, case.v, bad, None, None, None)
    assert kvcache_args.check_kvcache(*args).cache_seqlens is bad
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 500 is out of range"):
        kvcache_args.check_kvcache(*args)
    monkeypatch.setattr(common, "values_checkable", lambda t: False)
    assert kvcache_args.check_kvcache(*args).cache_seqlens is bad
    with pytest.raises(TypeError, match="cache_seqlens must be an int32"):
        kvcache_args.check_kvcache(*args[:5], bad.long(), None, None, None)
