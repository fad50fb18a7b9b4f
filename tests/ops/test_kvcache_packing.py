"""GQA packing in decoding (Spec.pack_gqa): the query heads that share a K/V head fill one tile's
rows, and every mask, window and mod must still see each row's own query and head.

Each packed step is held to two yardsticks: the unpacked kernels on the same problem, bit for bit
(the API through an MHA cache, where nothing packs; the kernels directly with GQA indexing), and
the float64 oracle within FlashAttention-2's rule. Covered: windows (one query and several, causal
or not), causal, ALiBi (per head and per batch entry), softcap, paged caches with splits, the
append with rotary, and a score_mod and a mask_mod that read the head and the query index. The
steps and the mods run on both kernel families (the sm90 forward's Consumer::pack maps its rows).
"""

import pytest
import torch

import fagen
from fagen.kernels import kv_kernels
from fagen.kernels.render import render
from fagen.kernels.compile import compile_source
from fagen.ops import kvcache
from fagen.ops.kvcache import decode_spec
from fagen.reference import attention_forward, attention_same_dtype
from fagen.spec import Spec
from fagen.ops.variant_args import variant_call
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, max_error
from kvcache_cases import entry_errors

D = 64
SEQLENS = [100, 37]   # keys in each entry's cache


def _caches(batch, heads_kv, capacity, page, gen):
    """Contiguous caches (B, capacity, Hk, D), or paged ones with a shuffled block table."""
    if page is None:
        shape, table = (batch, capacity, heads_kv, D), None
    else:
        per_entry = capacity // page
        table = torch.randperm(batch * per_entry + 1, generator=gen)[:batch * per_entry].view(batch, per_entry)
        shape, table = (batch * per_entry + 1, page, heads_kv, D), table.to(torch.int32)
    return torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half(), table


def _entry_rows(cache, table, b, keys):
    """Entry b's first `keys` rows of a cache, in key order."""
    if table is None:
        return cache[b, :keys]
    return torch.cat([cache[int(p)] for p in table[b]])[:keys]


def _mha(cache, group):
    """The same cache with each K/V head repeated for its query heads: MHA, which never packs."""
    return cache.repeat_interleave(group, dim=2)


def _check_oracle(q, out, lse, k_cache, v_cache, table, keys, causal, **variant):
    """Each entry's output and L against the float64 oracle on that entry's keys alone."""
    worst_kernel = worst_torch = 0.0
    for b, n in enumerate(keys):
        k_b, v_b = _entry_rows(k_cache, table, b, n)[None], _entry_rows(v_cache, table, b, n)[None]
        kernel, torch_error = entry_errors(b, q[b:b + 1], out[b:b + 1], lse[b:b + 1], k_b, v_b, causal, variant)
        worst_kernel, worst_torch = max(worst_kernel, kernel), max(worst_torch, torch_error)
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR, f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g}"


def test_a_window_in_one_query_mqa_decoding_step_sees_the_same_keys_in_every_head():
    """The issue's case: H = 4, Hk = 1, 100 keys, window (5, 0). Every head sees keys 94..99, so
    each head's output is its softmax over those six keys alone."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, D, generator=gen).half()
    k_cache, v_cache = (torch.randn(1, 100, 1, D, generator=gen).half() for _ in range(2))
    out = fagen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100, window_size=(5, 0))
    six = attention_forward(q, k_cache[:, 94:], v_cache[:, 94:])[0]
    same = attention_same_dtype(q, k_cache[:, 94:], v_cache[:, 94:], torch.zeros_like(q))[0]
    assert max_error(out, six) <= OUTPUT_FACTOR * max_error(same, six) + ABS_FLOOR


# (name, queries, causal, page, num_splits, variant keywords, query heads, K/V heads)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.005])
FEATURES = [
    ("window, one query", 1, False, None, 1, {"window_size": (5, 0)}, 8, 2),
    ("window both sides, three queries", 3, False, None, 2, {"window_size": (4, 2)}, 8, 2),
    ("causal window, three queries, MQA", 3, True, None, 1, {"window_size": (6, 0)}, 4, 1),
    ("causal, five queries", 5, True, None, 3, {}, 8, 2),
    ("ALiBi per head, one query", 1, False, None, 2, {"alibi_slopes": SLOPES}, 8, 2),
    ("ALiBi per entry, causal, two queries", 2, True, None, 1,
     {"alibi_slopes": torch.stack([SLOPES, SLOPES.flip(0)])}, 8, 2),
    ("paged: window, softcap and ALiBi, causal", 2, True, 16, 3,
     {"window_size": (9, 0), "softcap": 3.0, "alibi_slopes": SLOPES[:4]}, 4, 1),
]


FAMILIES = ["sm80", "sm90"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name, nq, causal, page, splits, variant, heads, heads_kv", FEATURES,
                         ids=[f[0] for f in FEATURES])
def test_packed_steps_equal_the_unpacked_ones_and_the_oracle(name, nq, causal, page, splits, variant, heads,
                                                              heads_kv, family, monkeypatch):
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
    monkeypatch.setattr(kvcache, "_plans", {})
    gen = torch.Generator().manual_seed(len(name))
    q = torch.randn(2, nq, heads, D, generator=gen).half()
    k_cache, v_cache, table = _caches(2, heads_kv, 128, page, gen)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
    call = dict(cache_seqlens=seqlens, block_table=table, causal=causal, num_splits=splits,
                return_softmax_lse=True, **variant)
    packed = fagen.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    group = heads // heads_kv
    unpacked = fagen.flash_attn_with_kvcache(q, _mha(k_cache, group), _mha(v_cache, group), **call)
    assert torch.equal(packed[0], unpacked[0]) and torch.equal(packed[1], unpacked[1])
    assert {plan.source.spec.arch_family for plan in kvcache._plans.values()} == {family}
    _check_oracle(q, *packed, k_cache, v_cache, table, SEQLENS, causal, **variant)


def test_packed_steps_are_race_free(monkeypatch):
    """A packed paged step with every built-in variant and splits, under racecheck (warp-serial)."""
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "warp-serial")
    for family in FAMILIES:
        test_packed_steps_equal_the_unpacked_ones_and_the_oracle(*FEATURES[-1], family, monkeypatch)


def test_append_with_rotary_under_packing():
    """The append and the rotation of q (at each query's own position) before a packed causal step."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 8, D, generator=gen).half()
    k_new, v_new = (torch.randn(2, 2, 2, D, generator=gen).half() for _ in range(2))
    angles = torch.arange(128, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(16) / 16)
    cos, sin = angles.cos().half(), angles.sin().half()
    results = []
    for group in (1, 4):   # MHA (repeated K/V: unpacked), then the packed GQA step
        k_cache, v_cache, _ = _caches(2, 2, 128, None, torch.Generator().manual_seed(4))
        if group == 1:
            k_cache, v_cache = _mha(k_cache, 4), _mha(v_cache, 4)
        kn, vn = (_mha(k_new, 4), _mha(v_new, 4)) if group == 1 else (k_new, v_new)
        results.append(fagen.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                                     cache_seqlens=torch.tensor(SEQLENS, dtype=torch.int32),
                                                     causal=True, num_splits=2, return_softmax_lse=True))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# -- mods that read the head and the query index, through the kernels directly -------------------------

HEAD_BIAS = torch.tensor([0.3, -0.2, 0.1, 0.4, -0.5, 0.0, 0.25, -0.1])


def head_and_query_score(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS[h] * (q_idx + 1) - 0.01 * (kv_idx % 7)


def head_and_query_mask(b, h, q_idx, kv_idx):
    return (kv_idx >= 9 * h + q_idx) & (kv_idx <= 90 - 5 * h + 3 * q_idx)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("causal", [False, True])
def test_score_and_mask_mods_reading_the_head_and_query_under_packing(causal, family):
    """A per-head score bias and a per-head key band (so the tile ranges differ between the heads
    of one tile): the packed kernel against the unpacked GQA kernel, bit for bit, and the oracle."""
    gen = torch.Generator().manual_seed(5 + causal)
    batch, nq, heads, heads_kv = 2, 3, 8, 2
    q = torch.randn(batch, nq, heads, D, generator=gen).half()
    k_cache, v_cache, _ = _caches(batch, heads_kv, 128, None, gen)
    keys = torch.tensor(SEQLENS, dtype=torch.int32)
    rows = (torch.arange(batch, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32))
    call = variant_call(q, k_cache, causal=causal, score_mod=head_and_query_score, mask_mod=head_and_query_mask,
                        sizes=(batch, nq, heads, 128))
    results = []
    for packed in (False, True):
        spec = Spec.for_kv_cache(D, "fp16", causal=causal, page_size=None, pack_gqa=packed,
                                 **call.spec_fields).replace(arch_family=family)
        q_kernel = q.view(batch, nq, heads_kv, 4, D).transpose(2, 3).reshape(batch, nq * 4, heads_kv, D) \
            if packed else q
        out, lse = kv_kernels.forward_kv_cache(render(spec), q_kernel, k_cache, v_cache, keys, seqlen_k=128,
                                                      cache_rows=rows, num_splits=2, variant_values=call.values,
                                                      pack_group=4 if packed else None)
        if packed:   # back to (B, Nq, H, D) and (B, H, Nq)
            out = out.view(batch, nq, 4, heads_kv, D).transpose(2, 3).reshape(batch, nq, heads, D)
            lse = lse.view(batch, heads_kv, nq, 4).transpose(2, 3).reshape(batch, heads, nq)
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    seen = torch.isfinite(results[1][1])   # rows whose band holds no key: O = 0, L = +inf, as the oracle's
    assert not seen.all() and seen.any()
    _check_oracle(q, *results[1], k_cache, v_cache, None, SEQLENS, causal, score_mod=head_and_query_score,
                  mask_mod=head_and_query_mask)


# -- specs ------------------------------------------------------------------------------------------

def test_pack_gqa_names_round_trip_and_is_refused_outside_decoding():
    spec = decode_spec(D, torch.float16, False, None, {"window": True, "pack_gqa": True})
    assert "_cache_packgqa" in spec.name and Spec.from_name(spec.name) == spec
    assert "pack_gqa" not in decode_spec(D, torch.float16, False, None, {"window": True}).to_dict()
    with pytest.raises(ValueError, match="pack_gqa"):
        Spec(64, pack_gqa=True)
    with pytest.raises(ValueError, match="pack_gqa"):
        Spec.for_kv_cache(64, "fp16", causal=False, page_size=16, varlen=True, pack_gqa=True)


PACKED_SPECS = [decode_spec(d, torch.float16, causal, page, {**fields, "pack_gqa": True})
                for d in (64, 128, 256)
                for causal, page, fields in ((True, None, {"window": True}),
                                             (True, 16, {"window": True, "softcap": True, "alibi": True}))]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", PACKED_SPECS, ids=lambda s: s.name)
def test_packed_decode_kernels_compile_without_spills(spec, arch):
    for name, report in compile_source(render(spec), arch).resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name} on {arch}: {report}"
