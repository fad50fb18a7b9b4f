"""A decoding step's cases and their check against the float64 oracle (tests/ops/test_kvcache.py,
and kernel_checks.kv_cache_check for the mutation harness).

`check_call` runs `flash_attn_with_kvcache` and checks three things: the cache after the call
equals the cache an independent oracle appends to (rows not appended untouched, bit for bit;
rotated rows within one rounding); each batch entry's output and L match the float64 oracle run
on that entry's keys alone, within FlashAttention-2's rule (the same-dtype PyTorch
implementation on the same keys is the yardstick).
"""

import torch

import fagen
from fagen.reference import attention_forward, attention_same_dtype
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, lse_tolerance, max_error, softcap_output_slack

B, H, HK, D = 3, 4, 2, 64
SEQLENS = [37, 0, 90]   # keys already cached per entry: one entry starts empty


def rotary_oracle(x, cos, sin, positions, interleaved):
    """Rotary written independently of the cache update kernel: complex multiplication in float64."""
    half = cos.shape[1]
    x = x.double()
    angle = torch.complex(cos.double(), sin.double())[positions].unsqueeze(2)   # (B, N, 1, half)
    head = x[..., :2 * half]
    if interleaved:
        pairs = torch.view_as_complex(head.reshape(*head.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(pairs * angle).flatten(-2)
    else:
        pairs = torch.complex(head[..., :half], head[..., half:])
        rotated = pairs * angle
        turned = torch.cat((rotated.real, rotated.imag), dim=-1)
    return torch.cat((turned, x[..., 2 * half:]), dim=-1)


def rotary_tables(rows, rotary_dim, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Case:
    """A cache, its new tokens, and where each entry's keys live (paged or not)."""

    def __init__(self, dtype=torch.float16, nq=1, new=0, capacity=128, page=None, batch_idx=False,
                 leftpad=False, seed=0, head_dim=D, head_dim_v=None):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.page, self.capacity = dtype, page, capacity
        d, dv = head_dim, head_dim_v or head_dim   # V's head dim: head_dim_v (unset: head_dim)
        self.q = torch.randn(B, nq, H, d, generator=gen).to(dtype)
        self.k = torch.randn(B, new, HK, d, generator=gen).to(dtype) if new else None
        self.v = torch.randn(B, new, HK, dv, generator=gen).to(dtype) if new else None
        self.seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
        self.batch_idx = torch.tensor([2, 0, 1], dtype=torch.int32) if batch_idx else None
        self.leftpad = torch.tensor([5, 0, 17], dtype=torch.int32) if leftpad else None
        if page is None:
            entries = B + 1 if batch_idx else B
            self.k_cache = torch.randn(entries, capacity, HK, d, generator=gen).to(dtype)
            self.v_cache = torch.randn(entries, capacity, HK, dv, generator=gen).to(dtype)
            self.block_table = None
        else:
            per_entry = capacity // page
            pages = B * per_entry + 2   # spare pages no entry names
            order = torch.randperm(pages, generator=gen)[:B * per_entry]
            self.block_table = order.view(B, per_entry).to(torch.int32)
            self.k_cache = torch.randn(pages, page, HK, d, generator=gen).to(dtype)
            self.v_cache = torch.randn(pages, page, HK, dv, generator=gen).to(dtype)

    def rows(self, cache, b):
        """Entry b's rows (capacity, HK, D) of a cache, in key order: a view for a contiguous one."""
        if self.block_table is None:
            return cache[b if self.batch_idx is None else int(self.batch_idx[b])]
        return torch.cat([cache[int(p)] for p in self.block_table[b]])

    def kwargs(self, **extra):
        return {**dict(k=self.k, v=self.v, cache_seqlens=self.seqlens, cache_batch_idx=self.batch_idx,
                       cache_leftpad=self.leftpad, block_table=self.block_table), **extra}


def _on(device, value):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return {n: _on(device, x) for n, x in value.items()} if isinstance(value, dict) else value


def run_call(case: Case, device, causal, rotary, num_splits, variant):
    """The op on `device` (the case's tensors copied there); returns (out, lse, k_cache, v_cache) on
    the CPU, the caches as the call left them."""
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(case.capacity, rotary[0], case.dtype)
    k_cache, v_cache = case.k_cache.to(device), case.v_cache.to(device)   # a copy, written in place
    out, lse = fagen.flash_attn_with_kvcache(_on(device, case.q), k_cache, v_cache, rotary_cos=_on(device, cos),
                                             rotary_sin=_on(device, sin),
                                             rotary_interleaved=rotary[1] if rotary else True, causal=causal,
                                             num_splits=num_splits, return_softmax_lse=True,
                                             **_on(device, case.kwargs(**variant)))
    return out.cpu(), lse.cpu(), k_cache.cpu(), v_cache.cpu()


def entry_errors(b: int, q_b, out_b, lse_b, keys_k, keys_v, causal, variant) -> tuple[float, float]:
    """Batch entry b's output against the float64 oracle on its keys alone: L checked here (rows
    that see no key at +inf exactly), and (the kernel's max error, the same-dtype PyTorch one's)
    returned for FlashAttention-2's rule over the whole call."""
    one = {n: (x[b:b + 1] if x.dim() == 2 else x) for n, x in variant.items() if isinstance(x, torch.Tensor)}
    args = {**variant, **one}
    ref_out, ref_lse = attention_forward(q_b, keys_k, keys_v, causal=causal, **args)
    dout = q_b.new_zeros(*q_b.shape[:-1], keys_v.shape[-1])   # O's (V's) head dim
    same = attention_same_dtype(q_b, keys_k, keys_v, dout, causal=causal, **args)[0]
    # NaN first: Python's max() over the entries' errors would drop a NaN error silently.
    assert not torch.isnan(out_b).any(), f"entry {b}: NaN in the output (unwritten or poisoned values)"
    empty = torch.isinf(ref_lse)   # rows that see no key: L = +inf, O = 0
    assert torch.equal(torch.isinf(lse_b), empty), f"entry {b}: rows without keys"
    assert max_error(lse_b[~empty], ref_lse[~empty]) < lse_tolerance(variant.get("softcap", 0.0)), f"entry {b}: L"
    return max_error(out_b, ref_out), max_error(same, ref_out)


def check_call(case: Case, causal=False, rotary=None, num_splits=0, device="cpu", **variant):
    """Run the op (on `device`); check the cache it leaves and each entry's output and L against
    the oracle. On the CPU the case's own caches are written, as a user's would be."""
    before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(case.capacity, rotary[0], case.dtype)
    if device == "cpu":
        out, lse = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, rotary_cos=cos,
                                                 rotary_sin=sin, rotary_interleaved=rotary[1] if rotary else True,
                                                 causal=causal, num_splits=num_splits, return_softmax_lse=True,
                                                 **case.kwargs(**variant))
    else:
        out, lse, case.k_cache, case.v_cache = run_call(case, device, causal, rotary, num_splits, variant)
    new = 0 if case.k is None else case.k.shape[1]
    seqlens = case.seqlens.tolist()   # SEQLENS, unless the case was given its own
    worst_kernel = worst_torch = slack = 0.0
    for b in range(B):
        start, stop = seqlens[b], seqlens[b] + new
        k_new, v_new = (case.k[b:b + 1], case.v[b:b + 1]) if new else (None, None)
        q_b = case.q[b:b + 1]
        if rotary is not None:
            k_new = rotary_oracle(k_new, cos, sin, torch.arange(start, stop)[None], rotary[1])
            q_pos = torch.arange(start, start + q_b.shape[1]) if causal or variant.get("window_size") else \
                torch.full((q_b.shape[1],), start)
            q_b = rotary_oracle(q_b, cos, sin, q_pos[None], rotary[1]).to(case.dtype)
        for cache, old, appended in ((case.k_cache, before_k, k_new), (case.v_cache, before_v, v_new)):
            got, was = case.rows(cache, b), case.rows(old, b)
            assert torch.equal(got[:start], was[:start]) and torch.equal(got[stop:], was[stop:]), f"entry {b}"
            if new:
                # fp32 rotation rounded once vs the float64 oracle's: at most one ulp apart
                eps = torch.finfo(case.dtype).eps if rotary is not None else 0.0
                torch.testing.assert_close(got[start:stop].double(), appended[0].to(case.dtype).double(),
                                           atol=eps * 1e-2, rtol=eps)
        first = 0 if case.leftpad is None else int(case.leftpad[b])
        keys_k = case.rows(case.k_cache, b)[first:stop][None]
        keys_v = case.rows(case.v_cache, b)[first:stop][None]
        if keys_k.shape[1] == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and bool(torch.isinf(lse[b]).all())
            continue
        kernel, torch_error = entry_errors(b, q_b, out[b:b + 1], lse[b:b + 1], keys_k, keys_v, causal, variant)
        worst_kernel, worst_torch = max(worst_kernel, kernel), max(worst_torch, torch_error)
        slack = max(slack, softcap_output_slack(variant.get("softcap", 0.0), keys_v))
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR + slack, \
        f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g} (tanh.approx's share: {slack:.3g})"
    return out, lse


def check_long_cache(num_splits: int, page: int | None = None, nq: int = 1, causal: bool = False):
    """Long entries (many tiles, so that splits share several): 450, 0 and 300 keys, in a contiguous
    cache of 512 rows from rows 5, 0 and 17 (cache_batch_idx and cache_leftpad), or in pages of
    `page` rows (480 per entry); each entry's output and L against the oracle on its keys, the
    empty one at O = 0, L = +inf."""
    contiguous = page is None
    case = Case(nq=nq, capacity=512 if contiguous else 480, page=page, batch_idx=contiguous, leftpad=contiguous,
                seed=9)
    seqlens = torch.tensor([455, 0, 317], dtype=torch.int32)
    out, lse = fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=seqlens,
                                             cache_batch_idx=case.batch_idx, cache_leftpad=case.leftpad,
                                             block_table=case.block_table, causal=causal, num_splits=num_splits,
                                             return_softmax_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isinf(lse[1]).all())
    worst_kernel = worst_torch = 0.0
    for b in (0, 2):
        first, end = (int(case.leftpad[b]) if contiguous else 0), int(seqlens[b])
        keys_k, keys_v = (case.rows(cache, b)[first:end][None] for cache in (case.k_cache, case.v_cache))
        kernel, torch_error = entry_errors(b, case.q[b:b + 1], out[b:b + 1], lse[b:b + 1], keys_k, keys_v, causal, {})
        worst_kernel, worst_torch = max(worst_kernel, kernel), max(worst_torch, torch_error)
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR, f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g}"


# -- the kernels' guards (index values are not read on the host by default) ---------------------

def in_arena(case: Case) -> tuple:
    """The case's caches as views inside buffers one entry (or page) larger on each side, filled
    with NaN: a guard that lets an index one past either end through reads NaN or writes there,
    inside the buffer (never outside memory the process owns). Returns the two buffers."""
    arenas = []
    for name in ("k_cache", "v_cache"):
        cache = getattr(case, name)
        arena = torch.full((cache.shape[0] + 2, *cache.shape[1:]), float("nan"), dtype=cache.dtype)
        arena[1:-1] = cache
        setattr(case, name, arena[1:-1])
        arenas.append(arena)
    return tuple(arenas)


def bad_index(case: Case, append: bool) -> dict:
    """One index value just outside the cache, for the step's last entry: with an append, where
    the new rows go (the update's guard); without, one the forward reads (its guards)."""
    last = B - 1
    if case.block_table is None:   # a cache entry past the last
        batch_idx = torch.tensor([2, 0, case.k_cache.shape[0]], dtype=torch.int32)
        return dict(cache_batch_idx=batch_idx)
    table = case.block_table.clone()
    slot = SEQLENS[last] // case.page if append else 0   # the appended page, or the first page read
    table[last, slot] = case.k_cache.shape[0]
    return dict(block_table=table)


def _refused(run, arenas, what: str) -> None:
    """`run` raises the guards' error and leaves both buffers as they were, bit for bit (NaN
    margins included). AssertionError otherwise (the mutation harness counts those)."""
    from fagen.errors import InputError

    before = [a.clone() for a in arenas]
    try:
        run()
    except InputError as error:
        assert "out of range" in str(error), f"{what}: {error}"
    else:
        raise AssertionError(f"{what}: a bad index value was not refused")
    for arena, was in zip(arenas, before):
        assert torch.equal(arena.isnan(), was.isnan()) and torch.equal(arena.nan_to_num(), was.nan_to_num()), \
            f"{what}: the cache or the memory around it was written"


def cache_guard_check(spec, source=None) -> None:
    """The guards of a decoding spec's kernels: an append (rotary, three splits) with one index
    just outside the cache, and a step without append that would read outside it, each refused
    (InputError, by default without any host read of the values) with nothing written anywhere
    in or around the cache. Cases as kernel_checks.kv_cache_check builds them."""
    from unittest import mock

    from fagen.kernels.render import render
    from fagen.ops import kvcache

    source = render(spec) if source is None else source

    def step_source(built):
        assert built == spec, f"the case builds {built.name}, not {spec.name}"
        return source

    for append in (True, False):
        if spec.kv_cache == "paged":
            case = Case(nq=2, new=2 if append else 0, page=48, capacity=96, seed=11)
        else:
            case = Case(nq=2, new=2 if append else 0, batch_idx=True, leftpad=True, seed=12)
        arenas = in_arena(case)
        cos, sin = rotary_tables(case.capacity, 32, case.dtype)
        rotary = dict(rotary_cos=cos, rotary_sin=sin) if append else {}
        with mock.patch.object(kvcache, "source_for", step_source), mock.patch.object(kvcache, "_plans", {}):
            _refused(lambda: fagen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, causal=spec.causal,
                                                           num_splits=3, **rotary,
                                                           **case.kwargs(**bad_index(case, append))),
                     arenas, "append" if append else "step without append")


def packed_guard_check(spec, source=None) -> None:
    """The guard of a packed-sequences spec's kernels (macros.j2 varlen_views): cu_seqlens_q, then
    cu_seqlens_k, that put a sequence one row past the packed tensors, forward and (for a spec
    with a backward) backward, in the AddressSanitizer build of the emulator: each refused
    (InputError) with no access outside a tensor (one is an EmulationError)."""
    import os
    from unittest import mock

    from fagen.errors import InputError
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render

    source = render(spec) if source is None else source
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(8, 2, spec.head_dim, generator=gen).to(torch.float16) for _ in range(3))
    good, bad = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 9], dtype=torch.int32)

    def refused(what, run):
        try:
            run()
        except InputError:
            return
        raise AssertionError(f"{what}: cu_seqlens past the packed rows were not refused")

    with mock.patch.dict(os.environ, {"FAGEN_EMULATE_CHECKED": "1"}):
        refused("forward, cu_seqlens_q", lambda: attention_kernels.forward(source, q, k, v, varlen=(bad, good, 6, 5)))
        refused("forward, cu_seqlens_k", lambda: attention_kernels.forward(source, q, k, v, varlen=(good, bad, 5, 6)))
        if source.kernels.bwd_main is not None:
            out, stats = attention_kernels.forward(source, q, k, v, varlen=(good, good, 5, 5))
            refused("backward, cu_seqlens_k",
                    lambda: attention_kernels.backward(source, q, k, v, out, stats, torch.ones_like(out),
                                                       varlen=(good, bad, 5, 6)))


# -- a block table's width (issue 42): an entry's keys past the pages its row lists -------------

def one_column(page: int, new: int = 0, seed: int = 46) -> Case:
    """flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: a block table of one column,
    each entry one page of `page` rows. Its cache_seqlens: `table_seqlens`."""
    case = Case(nq=2, new=new, page=page, capacity=page, seed=seed)
    case.seqlens = table_seqlens(case, 0)
    return case


def table_seqlens(case: Case, past: int) -> torch.Tensor:
    """cache_seqlens whose last entry's keys (with the case's new tokens) end `past` rows beyond
    the pages its row of the block table lists (0: exactly at the bound); one entry empty."""
    new = 0 if case.k is None else case.k.shape[1]
    return torch.tensor([min(SEQLENS[0], case.capacity - new), 0, case.capacity - new + past], dtype=torch.int32)


def refused_past_the_table(run, what: str) -> None:
    """`run` raises the guards' InputError, naming block_table, and nothing else (an EmulationError
    of the checked build: an access outside a tensor). AssertionError otherwise (the mutation
    harness counts those)."""
    from fagen.errors import InputError

    try:
        run()
    except InputError as error:
        assert "block_table" in str(error), f"{what}: {error}"
    else:
        raise AssertionError(f"{what}: keys past the block table's row were not refused")


def column_of_two(table: torch.Tensor, strided: bool) -> torch.Tensor:
    """A one-column block table; `strided`: as column 0 of a two-column table whose column 1 names
    pages too, so that a kernel reading past a row finds a page there (no fault, no flag) and only
    the guard of the table's width (max_pages, from the view's shape) refuses."""
    if not strided:
        return table
    return torch.cat([table, table.roll(1, dims=0)], dim=1)[:, :1]


def forward_past_the_table(spec, source, strided: bool = True) -> None:
    """The forward alone (kv_kernels.forward_kv_cache: no host check of the table's width) over
    a one-column table of pages of 48, told of more keys than the table holds (two pages: a
    decoding step's seqlen_k, packed sequences' max_seqlen_k): the last entry's 49 keys must be
    refused by the guard of the table's width (max_pages). A packed spec with a window takes
    paged_varlen_check's variant (window, softcap and ALiBi)."""
    from fagen.kernels import kv_kernels

    case = one_column(48, seed=47)
    table, seqlens, told = column_of_two(case.block_table, strided), table_seqlens(case, 1), 2 * case.capacity

    def packed_sequences():
        from fagen.ops.variant_args import variant_call

        q = case.q[:, 0]   # one query per sequence, packed: (B, H, d)
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), seqlens.cumsum(0, dtype=torch.int32)])
        fields = dict(window_size=(9, 0), softcap=20.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.05]))
        call = variant_call(q, case.k_cache, causal=spec.causal, sizes=(B, 1, H, told), **(fields if spec.window else {}))
        kv_kernels.forward_kv_cache(source, q, case.k_cache, case.v_cache, None, seqlen_k=told, block_table=table,
                                    variant_values=call.values if call else None,
                                    varlen=(torch.arange(B + 1, dtype=torch.int32), cu_k, 1, told))

    def decoding_step():
        group = H // HK if spec.pack_gqa else None
        q = case.q.reshape(B, -1, HK, case.q.shape[-1]) if group else case.q   # packed rows (B, Nq * group, Hk, d)
        kv_kernels.forward_kv_cache(source, q, case.k_cache, case.v_cache, seqlens, seqlen_k=told, block_table=table,
                                    pack_group=group)

    refused_past_the_table(packed_sequences if spec.varlen else decoding_step, f"{spec.name}: the forward alone")


# -- absorbed MLA: one cache whose first 512 columns are V ---------------------------------------

MLA_D, MLA_DV = 576, 512


def check_mla(batch=2, heads=16, page=None, num_splits=0, new=1, capacity=128, seed=0, device="cpu"):
    """A decoding step over one cache (B, N, 1, 576) with v_cache = its first 512 columns and the
    new rows appended through k only, run on `device`: the cache after the call (the new rows
    once, nothing else touched), and each entry's output (B, 1, H, 512) against the float64
    oracle on its rows, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    if page:
        pages = batch * capacity // page + 1
        kv = (torch.randn(pages, page, 1, MLA_D, generator=gen) * 0.5).half()
        table = torch.randperm(pages, generator=gen)[:batch * capacity // page].view(batch, -1).int()
    else:
        kv, table = (torch.randn(batch, capacity, 1, MLA_D, generator=gen) * 0.5).half(), None
    before = kv.clone()
    q = (torch.randn(batch, 1, heads, MLA_D, generator=gen) * 0.5).half()
    k_new = (torch.randn(batch, new, 1, MLA_D, generator=gen) * 0.5).half()
    seqlens = torch.tensor([37, 90, 5][:batch], dtype=torch.int32)
    scale = MLA_D ** -0.5
    on = [t.to(device) if t is not None else None for t in (q, kv, k_new, seqlens, table)]
    out = fagen.flash_attn_with_kvcache(on[0], on[1], on[1][..., :MLA_DV], on[2], on[2][..., :MLA_DV],
                                        cache_seqlens=on[3], block_table=on[4], causal=True, num_splits=num_splits,
                                        softmax_scale=scale).cpu()
    kv = on[1].cpu()
    assert out.shape == (batch, 1, heads, MLA_DV)
    worst_kernel = worst_torch = 0.0
    for b in range(batch):
        pick = (lambda c: c[b]) if table is None else (lambda c: torch.cat([c[p] for p in table[b].tolist()]))
        rows, old = pick(kv), pick(before)
        start, stop = int(seqlens[b]), int(seqlens[b]) + new
        assert torch.equal(rows[:start], old[:start]) and torch.equal(rows[stop:], old[stop:]), f"entry {b}"
        assert torch.equal(rows[start:stop], k_new[b]), f"entry {b}: the appended rows"
        keys = rows[:stop][None]
        assert not torch.isnan(out[b]).any(), f"entry {b}: NaN in the output"
        ref, _ = attention_forward(q[b:b + 1], keys, keys[..., :MLA_DV], causal=True, softmax_scale=scale)
        same = attention_same_dtype(q[b:b + 1], keys, keys[..., :MLA_DV], q.new_zeros(1, 1, heads, MLA_DV),
                                    causal=True, softmax_scale=scale)[0]
        worst_kernel = max(worst_kernel, max_error(out[b:b + 1], ref))
        worst_torch = max(worst_torch, max_error(same, ref))
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR, f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g}"
    return out
