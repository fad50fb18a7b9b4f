"""An 8-bit KV cache's cases (issue 45, part 2) and their check against the float64 oracle
(tests/ops/test_kvcache_fp8.py, tests/gpu/test_gpu_fp8_decode.py).

The accuracy rule: the cache is what it holds, K = e4m3 * k_descale (exact in float64), so the
kernel is held to FlashAttention-2's rule on those keys (OUTPUT_FACTOR times the same-dtype
PyTorch error, whose keys are K rounded to q's dtype, plus the floor; L to lse_tolerance). The
append is bit-exact: each new row is torch's float8 cast of (x / descale) clamped to +-448
(cvt.rn.satfinite saturates; torch's cast of a finite overflow is NaN)."""

import torch

import fagen
from fagen.reference import attention_forward, attention_same_dtype
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, lse_tolerance, max_error, softcap_output_slack

E4M3 = torch.float8_e4m3fn
B, H, HK = 3, 4, 2
SEQLENS = [37, 0, 90]


def quantised(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """The append's model: x / descale (per batch entry and K/V head, x (B, N, Hk, d)) rounded to
    e4m3, saturated at +-448."""
    return (x.float() / descale[:, None, :, None]).clamp(-448, 448).to(E4M3)


class Fp8Case:
    """An 8-bit cache (contiguous with cache_batch_idx and cache_leftpad, or paged), its descales,
    bf16 (or fp16) queries and new rows to append."""

    def __init__(self, dtype=torch.bfloat16, d=64, nq=1, new=2, capacity=128, page=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.page, self.capacity, self.new = dtype, page, capacity, new
        self.q = torch.randn(B, nq, H, d, generator=gen).to(dtype)
        self.k = (2 * torch.randn(B, new, HK, d, generator=gen)).to(dtype)
        self.v = torch.randn(B, new, HK, d, generator=gen).to(dtype)
        self.k_descale = 0.25 + torch.rand(B, HK, generator=gen)
        self.v_descale = 0.25 + torch.rand(B, HK, generator=gen)
        self.seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
        if page is None:
            self.batch_idx = torch.tensor([2, 0, 1], dtype=torch.int32)
            self.leftpad = torch.tensor([5, 0, 17], dtype=torch.int32)
            shape, self.block_table = (B + 1, capacity, HK, d), None
        else:
            self.batch_idx = self.leftpad = None
            pages = B * capacity // page + 2   # spare pages no entry names
            self.block_table = torch.randperm(pages, generator=gen)[:B * capacity // page].view(B, -1).to(torch.int32)
            shape = (pages, page, HK, d)
        self.k_cache = (3 * torch.randn(shape, generator=gen)).to(E4M3)
        self.v_cache = torch.randn(shape, generator=gen).to(E4M3)

    def rows(self, cache, b):
        if self.block_table is None:
            return cache[int(self.batch_idx[b])]
        return torch.cat([cache[int(p)] for p in self.block_table[b]])

    def call(self, device="cpu", **options):
        """The step on `device` (the case's tensors copied there, its caches copied back after)."""
        on = {name: None if t is None else t.to(device) for name, t in (
            ("q", self.q), ("k_cache", self.k_cache), ("v_cache", self.v_cache), ("k", self.k), ("v", self.v),
            ("cache_seqlens", self.seqlens), ("cache_batch_idx", self.batch_idx), ("cache_leftpad", self.leftpad),
            ("block_table", self.block_table), ("k_descale", self.k_descale), ("v_descale", self.v_descale))}
        options = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
        out, lse = fagen.flash_attn_with_kvcache(**on, return_softmax_lse=True, **options)
        if device != "cpu":
            self.k_cache.copy_(on["k_cache"].cpu()), self.v_cache.copy_(on["v_cache"].cpu())
        return out.cpu(), lse.cpu()


def check_fp8_call(case: Fp8Case, causal=False, num_splits=0, device="cpu", **variant):
    """The call (on `device`), then: the appended rows bit for bit, the rows around them untouched, and each
    entry's O and L against the float64 oracle on the dequantised keys."""
    before = case.k_cache.clone(), case.v_cache.clone()
    out, lse = case.call(device, causal=causal, num_splits=num_splits, **variant)
    check_appended(case, before)
    check_entries(case, out, lse, causal, variant)


def check_appended(case: Fp8Case, before: tuple | None = None) -> None:
    """Each entry's new rows are the model's bytes (`quantised`); with `before` (the caches as they
    were), every other row is as it was."""
    for cache, new, descale, old in zip((case.k_cache, case.v_cache), (case.k, case.v),
                                        (case.k_descale, case.v_descale), before or (None, None)):
        appended = quantised(new, descale).view(torch.uint8)
        for b in range(B):
            start, stop = SEQLENS[b], SEQLENS[b] + case.new
            got = case.rows(cache, b).view(torch.uint8)
            assert torch.equal(got[start:stop], appended[b]), f"entry {b}: the appended rows"
            if old is not None:
                was = case.rows(old, b).view(torch.uint8)
                assert torch.equal(got[:start], was[:start]) and torch.equal(got[stop:], was[stop:]), f"entry {b}"


def check_entries(case: Fp8Case, out, lse, causal=False, variant=None) -> None:
    """Each entry's O and L against the float64 oracle on its dequantised keys, FlashAttention-2's
    rule over the call (the same-dtype PyTorch error on the keys rounded to q's dtype)."""
    variant = variant or {}
    worst_kernel = worst_torch = slack = 0.0
    for b in range(B):
        first, stop = (0 if case.leftpad is None else int(case.leftpad[b])), SEQLENS[b] + case.new
        keys_k, keys_v = (case.rows(cache, b)[first:stop][None].double() * descale[b][None, None, :, None].double()
                          for cache, descale in ((case.k_cache, case.k_descale), (case.v_cache, case.v_descale)))
        one = {n: (x[b:b + 1] if isinstance(x, torch.Tensor) and x.dim() == 2 else x) for n, x in variant.items()}
        ref_out, ref_lse = attention_forward(case.q[b:b + 1], keys_k, keys_v, causal=causal, **one)
        dout = case.q.new_zeros(1, case.q.shape[1], H, keys_v.shape[-1])
        same = attention_same_dtype(case.q[b:b + 1], keys_k.to(case.dtype), keys_v.to(case.dtype), dout,
                                    causal=causal, **one)[0]
        assert not torch.isnan(out[b]).any(), f"entry {b}"
        empty = torch.isinf(ref_lse)   # rows that see no key: L = +inf, O = 0
        assert torch.equal(torch.isinf(lse[b:b + 1]), empty), f"entry {b}: rows without keys"
        assert max_error(lse[b:b + 1][~empty], ref_lse[~empty]) < lse_tolerance(variant.get("softcap", 0.0)), \
            f"entry {b}: L"
        worst_kernel = max(worst_kernel, max_error(out[b:b + 1], ref_out))
        worst_torch = max(worst_torch, max_error(same, ref_out))
        slack = max(slack, softcap_output_slack(variant.get("softcap", 0.0), keys_v))
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR + slack, \
        f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g}"


def fp8_cache_kernels_check(spec, source=None) -> None:
    """The mutants' check (tests/support/fp8_mutants.py): `spec`'s kernels (a paged decoding spec over
    an 8-bit cache without GQA packing; or `source`, another rendering of it) called directly on a
    paged Fp8Case whose first new key is past e4m3's range (600 descales: the append saturates it to
    448): the appended bytes, then O and L over three splits, as check_fp8_call checks them."""
    from fagen.kernels import kv_kernels
    from fagen.kernels.render import render

    source = render(spec) if source is None else source
    case = Fp8Case(page=32, seed=13)
    case.k[0, 0, 0, 0] = 600 * case.k_descale[0, 0]
    descales = (case.k_descale, case.v_descale)
    kv_kernels.update_kv_cache(source, case.q, case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                               block_table=case.block_table, descales=descales)
    check_appended(case)
    out, lse = kv_kernels.forward_kv_cache(source, case.q, case.k_cache, case.v_cache, case.seqlens,
                                           seqlen_k=case.capacity, block_table=case.block_table, num_splits=3,
                                           new_tokens=case.new, descales=descales)
    check_entries(case, out, lse)
