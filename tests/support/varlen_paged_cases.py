"""Packed queries over a paged K/V cache (`flash_attn_varlen_func(..., block_table=...)`): the
cases of tests/ops/test_varlen_paged.py and the kernel mutants' paged_varlen_check, and their
oracle (each sequence against the float64 oracle on its keys gathered from its pages, under
FlashAttention-2's rule)."""

import torch

from fagen.reference import attention_forward, attention_same_dtype
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, lse_tolerance, max_error

LENGTHS_Q, LENGTHS_K = [5, 0, 40, 17, 3], [30, 12, 70, 17, 0]   # prefill chunks, an empty query, no keys
H, HK, D = 4, 2, 64


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def paged(page, dtype=torch.float16, seed=0, d=D):
    gen = torch.Generator().manual_seed(seed)
    per_sequence = -(-max(LENGTHS_K) // page)
    pages = len(LENGTHS_K) * per_sequence + 3
    table = torch.randperm(pages, generator=gen)[:len(LENGTHS_K) * per_sequence].view(len(LENGTHS_K), -1)
    k = torch.randn(pages, page, HK, d, generator=gen).to(dtype)
    v = torch.randn(pages, page, HK, d, generator=gen).to(dtype)
    q = torch.randn(sum(LENGTHS_Q), H, d, generator=gen).to(dtype)
    return q, k, v, table.to(torch.int32)


def recorded_families(monkeypatch) -> list:
    """FAGEN_ARCH_FAMILY's effect, seen: the arch_family of every spec flash_attn_varlen_func's paged
    path builds from now on (appended to the list returned)."""
    from fagen.ops import varlen as varlen_ops

    built, real = [], varlen_ops.source_for
    monkeypatch.setattr(varlen_ops, "source_for", lambda spec: (built.append(spec.arch_family), real(spec))[1])
    return built


def gathered(cache, table, b):
    return torch.cat([cache[int(p)] for p in table[b]])[:LENGTHS_K[b]][None]


def check_against_the_oracle(out, lse, q, k, v, table, causal, variant):
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    cu_q = cu(LENGTHS_Q)
    worst_kernel = worst_torch = 0.0
    for b, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        rows = slice(cu_q[b], cu_q[b + 1])
        if lq == 0:
            continue
        if lk == 0:   # no key: O = 0, L = +inf
            assert torch.equal(out[rows], torch.zeros_like(out[rows])) and bool(torch.isinf(lse[:, rows]).all())
            continue
        one = (q[rows][None], gathered(k, table, b), gathered(v, table, b))
        ref_out, ref_lse = attention_forward(*one, causal=causal, **variant)
        same = attention_same_dtype(*one, torch.zeros_like(one[0]), causal=causal, **variant)[0]
        seen = ~torch.isinf(ref_lse[0])
        assert torch.equal(torch.isinf(lse[:, rows]), ~seen), f"sequence {b}: rows without keys"
        assert max_error(lse[:, rows][seen], ref_lse[0][seen]) < lse_tolerance(variant.get("softcap", 0.0)), \
            f"sequence {b}: L"
        worst_kernel = max(worst_kernel, max_error(out[rows][None], ref_out))
        worst_torch = max(worst_torch, max_error(same, ref_out))
    assert worst_kernel <= OUTPUT_FACTOR * worst_torch + ABS_FLOOR, f"{worst_kernel:.3g} vs PyTorch's {worst_torch:.3g}"
