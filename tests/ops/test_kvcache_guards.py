"""The kernels' guards (issue 26, section 3): index values are not read on the host by default.

cache_seqlens, cache_batch_idx, cache_leftpad, block tables and cu_seqlens reach the kernels
unchecked unless FAGEN_CHECK_VALUES=1 (reading them is a device sync). The kernels check them: a
value that would reach outside a tensor is refused (an append is refused whole), nothing is read
or written outside the cache, and the call raises lazily from the guards' error flag (on the
CPU at once, as an InputError naming the arguments). FAGEN_CHECK_VALUES=1 checks them on the
host first, with messages that name the entry and its value.
"""

import pytest
import torch

import fagen
from fagen.errors import InputError
from fagen.kernels import attention_kernels
from fagen.kernels import kv_kernels
from fagen.kernels.render import render
from fagen.ops import kvcache
from fagen.spec import Spec
from kvcache_cases import (B, D, Case, bad_index, cache_guard_check, check_call, forward_past_the_table, in_arena,
                           one_column, table_seqlens)


@pytest.mark.parametrize("page", [48, None], ids=["paged", "contiguous"])
def test_a_bad_index_is_refused_and_nothing_around_the_cache_is_written(page):
    """Appends and reads with an index one past the cache, in caches with NaN margins."""
    cache_guard_check(Spec.for_kv_cache(D, "fp16", causal=True, page_size=page, pack_gqa=True))


def _step(case, **change):
    return fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs(**change))


@pytest.mark.parametrize("change", [dict(cache_seqlens=torch.tensor([37, 0, 127], dtype=torch.int32)),
                                    dict(cache_seqlens=torch.tensor([37, -1, 90], dtype=torch.int32)),
                                    dict(cache_leftpad=torch.tensor([0, 1, 0], dtype=torch.int32))],
                         ids=["past the end", "negative", "leftpad past the keys"])
def test_one_bad_entry_refuses_the_whole_append(change):
    """Entries 0 and 2 (or 0 and 1) are fine; one bad value and no entry's rows are appended."""
    case = Case(nq=2, new=2, batch_idx=True, leftpad=True, seed=40)
    before = case.k_cache.clone(), case.v_cache.clone()
    with pytest.raises(InputError, match="out of range in cache_seqlens, cache_batch_idx, cache_leftpad"):
        _step(case, **change)
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])


def test_given_a_flag_the_forward_sets_it_and_reads_page_0_for_a_page_outside_the_cache():
    """The caller raises (a step: once, after its last kernel); the pages around the cache are NaN
    and the output stays finite: nothing outside was read."""
    case = Case(nq=1, page=16, seed=41)
    in_arena(case)
    spec = kvcache.decode_spec(D, torch.float16, False, 16, {})
    table = bad_index(case, append=False)["block_table"]
    flag = attention_kernels.error_flag(case.q.device)
    keys = case.seqlens.clone()
    out, lse = kv_kernels.forward_kv_cache(render(spec), case.q, case.k_cache, case.v_cache, keys,
                                           seqlen_k=case.capacity, block_table=table, num_splits=2, flag=flag)
    assert flag.tolist() == [1] and bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[B - 1]).all())
    with pytest.raises(InputError, match="block_table"):
        kv_kernels.forward_kv_cache(render(spec), case.q, case.k_cache, case.v_cache, keys, seqlen_k=case.capacity,
                             block_table=table, num_splits=2)


def test_a_padded_step_refused_on_a_gpu_leaves_the_callers_cache_before_its_raise(monkeypatch):
    """On a GPU the raise is asynchronous and the step goes on to copy the appended rows back into
    the caller's (head_dim 59) cache: where the flag is set each row gets its old value back. The
    raise is switched off here to run that path on the CPU."""
    monkeypatch.setattr(attention_kernels, "raise_flagged", lambda flag, message: None)
    case = Case(new=2, head_dim=59, page=16, seed=42)
    before = case.k_cache.clone(), case.v_cache.clone()
    _step(case, cache_seqlens=torch.tensor([37, 0, 127], dtype=torch.int32))
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])


def test_with_FAGEN_CHECK_VALUES_the_host_names_the_entry_and_its_value(monkeypatch):
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    case = Case(new=2, page=16, seed=43)
    before = case.k_cache.clone()
    with pytest.raises(InputError, match=r"cache_seqlens\[2\] = 127 is out of range: the block_table's 8 pages"):
        _step(case, cache_seqlens=torch.tensor([37, 0, 127], dtype=torch.int32))
    with pytest.raises(InputError, match=r"block_table\[2, 5\] = 26 is out of range: pages are 0..25"):
        _step(case, **bad_index(case, append=True))
    assert torch.equal(case.k_cache, before)
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "yes")
    with pytest.raises(ValueError, match="FAGEN_CHECK_VALUES='yes': expected 0 or 1"):
        _step(case)


def test_a_paged_cache_without_pages_is_refused_for_a_block_table_that_names_some():
    """The paged forward's guard reads page 0 in place of a bad page: there must be one."""
    case = Case(page=16, seed=44)
    empty = case.k_cache[:0]
    with pytest.raises(InputError, match="k_cache has no pages"):
        fagen.flash_attn_with_kvcache(case.q, empty, empty.clone(), block_table=case.block_table,
                                      cache_seqlens=0)


# -- a block table's width (issue 42) -----------------------------------------------------------
# flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: a block table of one column, pages of
# 256, cache_seqlens 257. The default tier runs it on sm90 (one spec for every page size: the one
# test_kvcache_sm90.py builds) and on sm80 in pages of 48 (the spec of the guard test above); sm80's
# pages of 256 take 64-key tiles, a spec of their own, and run in the slow tier.
TABLE_CASES = [pytest.param("sm80", 48, id="sm80-pages48"), pytest.param("sm90", 256, id="sm90-pages256"),
               pytest.param("sm80", 256, id="sm80-pages256", marks=pytest.mark.slow)]


@pytest.fixture
def family(request, monkeypatch):
    """FAGEN_ARCH_FAMILY (the test's first parameter), from empty step plans; afterwards, that every
    step built that family's spec."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", request.param)
    monkeypatch.setattr(kvcache, "_plans", {})
    built, real = [], kvcache.source_for
    monkeypatch.setattr(kvcache, "source_for", lambda spec: (built.append(spec.arch_family), real(spec))[1])
    yield request.param
    assert built and set(built) == {request.param}, built


@pytest.mark.parametrize("family, page", TABLE_CASES, indirect=["family"])
@pytest.mark.parametrize("new", [0, 2], ids=["no append", "append"])
def test_keys_past_a_one_column_block_table_are_refused(family, page, new):
    """The last entry's keys (with the appended ones) end one row past its page: refused, the error
    naming block_table (a RuntimeError, as flash-attn's; a ValueError for Python code), and nothing
    appended. Before issue 42 a step without append attended the page's keys alone and returned."""
    case = one_column(page, new=new)
    before = case.k_cache.clone(), case.v_cache.clone()
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match="more than its row of block_table has pages for"):
            _step(case, causal=True, num_splits=3, cache_seqlens=table_seqlens(case, 1))
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])


@pytest.mark.parametrize("family, page", TABLE_CASES, indirect=["family"])
@pytest.mark.parametrize("new", [0, 2], ids=["no append", "append"])
def test_keys_that_fill_a_one_column_block_table_meet_the_oracle(family, page, new):
    """At the bound (the last entry's keys fill its page): the cache and each entry's output and L
    against the oracle (kvcache_cases.check_call), in two splits."""
    check_call(one_column(page, new=new), causal=True, num_splits=2)


def test_with_FAGEN_CHECK_VALUES_the_host_names_the_entry_and_the_table(monkeypatch):
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    case = one_column(48)
    with pytest.raises(InputError, match=r"cache_seqlens\[2\] = 49 is out of range: the block_table's 1 page of 48 "
                                         r"rows holds 48 rows per entry"):
        _step(case, cache_seqlens=table_seqlens(case, 1))


def test_a_packed_sequence_past_a_one_column_block_table_is_refused_on_the_host():
    """flash-attn's case for packed sequences: max_seqlen_k (an int, no sync) bounds every sequence,
    and more than the table holds is refused before any launch. The kernels' own guard of the
    table's width: kernel_checks.table_width_check (the kernel mutants' positive control runs it in
    the default tier), and test_nothing_outside_the_block_table_is_read below."""
    q, k, v = (torch.zeros(2, 4, D, dtype=torch.float16), *torch.zeros(2, 3, 256, 2, D, dtype=torch.float16))
    table, cu = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="max_seqlen_k = 257 is more than block_table's 1 page of 256 rows holds"):
        fagen.flash_attn_varlen_func(q, k, v, cu, torch.tensor([0, 257, 514], dtype=torch.int32), 1, 257,
                                     block_table=table)


def _paged_specs():
    from fagen.arch_families import chosen_decoding_spec

    decoding = Spec.for_kv_cache(D, "fp16", causal=True, page_size=48, pack_gqa=True)
    packed = Spec.for_kv_cache(D, "fp16", causal=True, page_size=16, varlen=True, window=True, softcap=True,
                               alibi=True)
    return [s for spec in (decoding, packed) for s in (spec, chosen_decoding_spec(spec, "sm90", None))]


@pytest.mark.slow
@pytest.mark.parametrize("spec", _paged_specs(), ids=lambda s: s.name)
def test_nothing_outside_the_block_table_is_read(monkeypatch, spec):
    """The AddressSanitizer build: the forward alone, told of more keys than a one-column table
    (contiguous: its last row's end is the allocation's) holds, refuses the last entry and reads
    nothing past the table. Before issue 42 each of these four kernels read 4 bytes past it
    (a heap-buffer-overflow READ of block_table[batch * stride + 1])."""
    monkeypatch.setenv("FAGEN_EMULATE_CHECKED", "1")
    forward_past_the_table(spec, render(spec), strided=False)


@pytest.mark.slow
@pytest.mark.parametrize("family, page", [("sm80", 48), ("sm90", 256)], indirect=["family"])
@pytest.mark.parametrize("new", [0, 2], ids=["no append", "append"])
def test_flash_attns_case_reads_nothing_outside_the_block_table(monkeypatch, family, page, new):
    """The refusal of test_keys_past_a_one_column_block_table_are_refused in the AddressSanitizer
    build (an access outside a tensor would be an EmulationError, not the InputError)."""
    monkeypatch.setenv("FAGEN_EMULATE_CHECKED", "1")
    test_keys_past_a_one_column_block_table_are_refused(family, page, new)


# -- packed sequences ---------------------------------------------------------------------------

def _packed(total=8, heads=2):
    gen = torch.Generator().manual_seed(45)
    q, k, v = (torch.randn(total, heads, D, generator=gen).half() for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("cu, max_seqlen", [([0, 3, 9], 6), ([0, 5, 3, 8], 5), ([0, 3, 8], 4), ([-2, 3, 8], 5)],
                         ids=["past the rows", "decreasing", "longer than max_seqlen", "before the rows"])
def test_inconsistent_cu_seqlens_are_refused_by_the_kernels(cu, max_seqlen):
    q, k, v = _packed()
    bad = torch.tensor(cu, dtype=torch.int32)
    good = torch.tensor([0] * (len(cu) - 2) + [3, 8], dtype=torch.int32)
    with pytest.raises(InputError, match="out of range in cu_seqlens_q or cu_seqlens_k"):
        fagen.flash_attn_varlen_func(q, k, v, bad, good, max_seqlen, 8)
    with pytest.raises(InputError, match="out of range in cu_seqlens_q or cu_seqlens_k"):
        fagen.flash_attn_varlen_func(q, k, v, good, bad, 8, max_seqlen, causal=True)


def test_the_packed_backward_kernels_refuse_too():
    """The backward's kernels take the same guard (cu_seqlens_k past k's rows)."""
    q, k, v = _packed()
    source = render(Spec(D, varlen=True, mask="causal"))
    good, bad = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 9], dtype=torch.int32)
    out, stats = attention_kernels.forward(source, q, k, v, varlen=(good, good, 5, 5))
    with pytest.raises(InputError, match="cu_seqlens_q or cu_seqlens_k"):
        attention_kernels.backward(source, q, k, v, out, stats, torch.ones_like(out), varlen=(good, bad, 5, 6))


def test_with_FAGEN_CHECK_VALUES_packed_sequences_keep_their_exact_messages(monkeypatch):
    monkeypatch.setenv("FAGEN_CHECK_VALUES", "1")
    q, k, v = _packed()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(InputError, match=r"cu_seqlens_q\[-1\] must equal the 8 tokens packed, got 9"):
        fagen.flash_attn_varlen_func(q, k, v, torch.tensor([0, 3, 9], dtype=torch.int32), cu, 6, 5)
    with pytest.raises(InputError, match="max_seqlen_k = 4 is smaller than a sequence of 5 tokens"):
        fagen.flash_attn_varlen_func(q, k, v, cu, cu, 5, 4)
