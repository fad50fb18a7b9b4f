"""Decoding on the sm90 family (issue 29): `flash_attn_with_kvcache` with FAGEN_ARCH_FAMILY=sm90
runs the Hopper forward (templates/sm90/hopper_fwd.cu.j2, hopper_kv_cache.j2) over the cache: a
contiguous cache through cache_batch_idx / cache_leftpad, a paged one by TMA boxes (a tile per box
where the pages hold whole tiles, else a box per 16 keys), split-KV partials merged by the sm80
family's combine, GQA packing. Each step is checked as the sm80
family's are (kvcache_cases.check_call: the cache after the call, each entry against the float64
oracle under FlashAttention-2's rule), after asserting that the step did run on sm90; what the
family does not take yet runs on sm80."""

from __future__ import annotations

import pytest
import torch

from fagen.arch_families import PAGE_BOX_ROWS, chosen_decoding_spec, page_box_rows, sm90_refusal, sm90_tiles
from fagen.kernels.tensor_map import PageBox, TensorMapSpec
from fagen.ops import kvcache
from fagen.spec import Spec
from kvcache_cases import D, Case, cache_guard_check, check_call, check_long_cache, check_mla
from sm90_cases import check_sm90_forward_compiles


@pytest.fixture
def families(monkeypatch):
    """FAGEN_ARCH_FAMILY=sm90, from empty step plans; returns the families of the steps' specs."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    monkeypatch.setattr(kvcache, "_plans", {})
    seen = []
    real = kvcache.source_for

    def recorded(spec):
        seen.append(spec.arch_family)
        return real(spec)

    monkeypatch.setattr(kvcache, "source_for", recorded)
    return seen


def _mha(case: Case) -> Case:
    """The case with a K/V head per query head: nothing packs (the variants on rows of one head each,
    beside the packed test above)."""
    case.k_cache, case.v_cache = (c.repeat_interleave(2, dim=2) for c in (case.k_cache, case.v_cache))
    if case.k is not None:
        case.k, case.v = (t.repeat_interleave(2, dim=2) for t in (case.k, case.v))
    return case


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_one_packed_query_over_a_contiguous_cache(families, num_splits):
    check_call(Case(capacity=160), num_splits=num_splits)
    assert families == ["sm90"]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page", [None, 48], ids=["contiguous", "paged48"])
def test_long_entries_over_many_tiles(families, num_splits, page):
    """128-key tiles over entries of 450 and 300 keys (from their leftpads, or in pages of 48 rows
    with two causal queries per head): splits share several tiles."""
    check_long_cache(num_splits, page=page, nq=1 if page is None else 2, causal=page is not None)
    assert families == ["sm90"]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_append_rotary_and_causal_packed_queries(families, num_splits):
    """Three queries of two heads packed per K/V head: causal reads each packed row's own query."""
    check_call(Case(nq=3, new=3, seed=1), causal=True, rotary=(32, False), num_splits=num_splits)
    assert families == ["sm90"]


@pytest.mark.parametrize("page", [16, 48, 128, 256])
def test_a_paged_cache_by_boxes_of_a_page_or_of_16_keys(families, page):
    """128-key tiles: pages of 128 and 256 rows hold whole tiles (a box per tile); pages of 16 and 48
    take a box per 16 keys, 8 per tile, from 8 or 3 pages (the last tile's boxes past the block
    table read page 0, masked)."""
    check_call(Case(nq=2, new=2, capacity=96 if page == 48 else 256, page=page, seed=2), causal=True,
               rotary=(64, True), num_splits=2)
    assert families == ["sm90"]


def test_cache_batch_idx_and_leftpad(families):
    check_call(Case(nq=2, new=2, batch_idx=True, leftpad=True, seed=4), causal=True, num_splits=3)
    assert families == ["sm90"]


def test_softcap_alone_packed_over_splits(families):
    check_call(Case(nq=2, new=1, seed=7), causal=True, num_splits=3, softcap=15.0)
    assert families == ["sm90"]


def test_window_softcap_and_alibi_packed(families):
    """Each packed row's own (query, head): the window's diagonal and ALiBi's slope (in the score
    chain's natural-log units)."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check_call(Case(nq=3, new=1, seed=6), causal=True, num_splits=2, window_size=(20, 0), softcap=15.0,
               alibi_slopes=slopes)
    assert families == ["sm90"]


@pytest.mark.parametrize("variant", [{}, {"window_size": (30, 0)}], ids=["causal", "causal_window"])
def test_packed_queries_over_two_row_blocks(families, variant):
    """70 queries of two heads: 140 packed rows, two 128-row blocks whose rows map back to queries
    across the block boundary (the causal tile span, the tile classes, the diagonal)."""
    check_call(Case(nq=70, new=3, capacity=256, page=32, seed=22), causal=True, num_splits=3, **variant)
    assert families == ["sm90"]


def test_window_and_alibi_unpacked(families):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check_call(_mha(Case(nq=2, new=1, seed=5)), causal=True, num_splits=2, window_size=(20, 0), softcap=15.0,
               alibi_slopes=slopes)
    assert families == ["sm90"]


@pytest.mark.parametrize("head_dim, head_dim_v, dtype", [(128, None, torch.bfloat16), (256, None, torch.float16),
                                                         (192, 128, torch.bfloat16)])
def test_wider_heads_and_v_s_own_head_dim(families, head_dim, head_dim_v, dtype):
    check_call(Case(dtype, nq=1, new=1, capacity=192, page=64, head_dim=head_dim, head_dim_v=head_dim_v, seed=8),
               num_splits=2)
    assert families == ["sm90"]


# Past d = 256 (tests/kernels/test_sm90_wide_head_dims.py): narrower key tiles, and past d_v = 256 a
# block per column slice of O, each writing its columns of a split's partials (the slice 0 block L).
# Each spec the emulator builds costs CI about 10 s: one of a kind in the default tier, the rest slow.
slow = pytest.mark.slow


@pytest.mark.parametrize("head_dim, head_dim_v, page, num_splits", [
    (512, None, None, 2), pytest.param(320, None, 16, 1, marks=slow), pytest.param(448, 256, 64, 3, marks=slow),
    pytest.param(384, None, 32, 2, marks=slow), pytest.param(448, None, None, 3, marks=slow)])
def test_head_dims_past_256(families, head_dim, head_dim_v, page, num_splits):
    check_call(Case(nq=2, new=1, capacity=128, page=page, head_dim=head_dim, head_dim_v=head_dim_v, seed=11),
               causal=True, num_splits=num_splits)
    assert families == ["sm90"]


@pytest.mark.parametrize("layout", [pytest.param(dict(), marks=slow), dict(page=64, num_splits=2),
                                    pytest.param(dict(batch=1, heads=128, page=64, capacity=192), marks=slow)],
                         ids=["contiguous", "paged64_split2", "128_heads_one_block"])
def test_absorbed_mla(families, layout):
    """One cache of 576-wide rows, v_cache its first 512 columns (Spec.v_from_k): V's slices are
    K's tile from column 0 and 256 on, nothing loaded twice; 128 query heads pack into one block."""
    check_mla(**layout)
    assert set(families) == {"sm90"}


@slow
@pytest.mark.parametrize("schedule", ["producer-first", "consumer-first", "random"])
def test_mla_is_race_free_under_every_schedule(families, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    check_mla(page=64, num_splits=2)
    assert set(families) == {"sm90"}


@pytest.mark.parametrize("schedule", ["producer-first", "consumer-first", "random"])
def test_every_schedule_is_race_free_and_exact(families, monkeypatch, schedule):
    """A paged step with an append and splits, under the happens-before racecheck."""
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    check_call(Case(nq=2, new=2, capacity=96, page=48, seed=10), causal=True, num_splits=3)
    assert families == ["sm90"]


def _sm90_step_spec(page, causal=True):
    return chosen_decoding_spec(kvcache.decode_spec(D, torch.float16, causal, page, {"pack_gqa": True}), "sm90", None)


@pytest.mark.parametrize("page", [48, None], ids=["paged", "contiguous"])
def test_a_bad_index_is_refused_and_nothing_around_the_cache_is_written(monkeypatch, page):
    """The guards: a page outside the cache read as page 0 and flagged; a contiguous entry outside
    the cache refused before anything is read."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    spec = _sm90_step_spec(page)
    assert spec.arch_family == "sm90"
    cache_guard_check(spec)


def test_what_sm90_does_not_take_runs_on_sm80(families):
    """A head dim the family has no forward for (arch_families.SM90_HEAD_DIMS)."""
    check_call(Case(nq=2, new=1, head_dim=96, seed=5), causal=True, window_size=(20, 0))
    assert families == ["sm80"]


def test_the_default_stays_sm80(monkeypatch):
    """Unset, decoding runs the sm80 family on every device until the sm90 forward has passed the
    GPU check (arch_families.chosen_family)."""
    monkeypatch.delenv("FAGEN_ARCH_FAMILY", raising=False)
    spec = kvcache.decode_spec(D, torch.float16, False, None, {"pack_gqa": True})
    assert chosen_decoding_spec(spec, "", (9, 0)) is spec
    assert chosen_decoding_spec(spec, "sm90", (8, 0)) is spec   # sm_90a cubins run on 9.0 only
    assert chosen_decoding_spec(spec, "sm90", (9, 0)).arch_family == "sm90"


def test_a_paged_map_s_box_follows_the_page_size():
    """The host's maps and the kernel's loads share the rule (arch_families.page_box_rows)."""
    spec = _sm90_step_spec(64)
    # The sm80 tiles a page size picks go back to the defaults: one spec serves every page size.
    assert spec == _sm90_step_spec(16) == _sm90_step_spec(256)
    assert spec.name == "fa2_d64_causal_fp16_pad_paged_packgqa_sm90"
    assert sm90_tiles(spec).block_n == 128
    wide = chosen_decoding_spec(kvcache.decode_spec(256, torch.float16, False, None, {}), "sm90", None)
    assert sm90_tiles(wide).block_n == 64
    assert [page_box_rows(128, page) for page in (128, 256, 16, 48, 64)] == [128, 128, 16, 16, 16]
    assert PAGE_BOX_ROWS == 16
    for page, rows in ((256, 128), (48, 16)):
        cache = torch.zeros(5, page, 2, 128, dtype=torch.float16)
        assert TensorMapSpec.of_tensor(cache, (1, PageBox(128), 1, 64)).box_dims == (64, 1, rows, 1)


@pytest.mark.parametrize("fields, named", [
    (dict(head_dim=576, head_dim_v=512, kv_cache="paged", key_padding=True), "head_dim=576"),   # V from K only
])   # packed queries over a paged cache: tests/ops/test_varlen_paged.py runs them on both families
def test_what_the_family_cannot_decode_yet_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=f"arch_family='sm90' has no forward for .*{named}"):
        Spec(**{"head_dim": 128, **fields}, arch_family="sm90")
    assert sm90_refusal(Spec(**{"head_dim": 128, **fields})) is not None


DECODE_SPECS = [_sm90_step_spec(None, causal=False), _sm90_step_spec(64),
                chosen_decoding_spec(kvcache.decode_spec(256, torch.bfloat16, True, 64, {}), "sm90", None),
                chosen_decoding_spec(kvcache.decode_spec(128, torch.float16, True, None,
                                                         {"window": True, "softcap": True, "alibi": True}),
                                     "sm90", None),
                chosen_decoding_spec(kvcache.decode_spec(128, torch.bfloat16, True, 16,
                                                         {"window": True, "softcap": True, "alibi": True,
                                                          "pack_gqa": True}), "sm90", None),
                chosen_decoding_spec(kvcache.decode_spec(192, torch.bfloat16, False, None,
                                                         {"head_dim_v": 128, "pack_gqa": True}), "sm90", None)]


@pytest.mark.parametrize("spec", DECODE_SPECS, ids=lambda s: s.name)
def test_nvrtc_compiles_the_decoding_forward_for_sm_90a_without_spills(spec):
    check_sm90_forward_compiles(spec)


def test_a_warm_step_reuses_its_plan_on_sm90(families):
    """One query packed: the sm90 forward's q map is encoded from the view each step (the plan
    never passes q itself), and the second step of the signature matches the oracle too."""
    for seed in (40, 41):
        check_call(Case(new=1, seed=seed), rotary=(32, True), num_splits=2)
    assert families == ["sm90"]
    assert not next(iter(kvcache._plans.values())).packs_in_place
