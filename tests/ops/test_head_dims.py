"""Today's models' head dims (issue 27, items 1 and 2), through the entry points.

V's head dim below Q's and K's: DeepSeek-V3's q/k 192 with v 128, and 128 with 64, through every
entry point that takes dense or packed q, k, v. The output has d_v columns, dV has d_v and dQ,
dK have d. Head dims past 256, up to 512 (Gemma-class): training and decoding. Absorbed MLA
decoding: one cache of 576-wide rows whose first 512 columns are V (a view). Each result is
held to FlashAttention-2's rule against the float64 oracle. A v wider than q, a v cache of other
rows than the k cache, or a head dim past 512 is refused by name.
"""

import pytest
import torch

import fagen
from fagen.errors import InputError
from fagen.reference import attention_backward, attention_forward, attention_same_dtype
from kernel_cases import GRAD_FACTOR, OUTPUT_FACTOR, max_error
from kvcache_cases import Case, check_call, check_mla

GEN = torch.Generator().manual_seed(27)


def _randn(*shape, grad=False):
    return (torch.randn(*shape, generator=GEN) * 0.5).half().requires_grad_(grad)


def _hold_to_the_rule(got: dict, q, k, v, dout, **kwargs):
    """Each of got's tensors against the oracle, at most FA2's factor times PyTorch's error."""
    ref_out, _ = attention_forward(q, k, v, **kwargs)
    refs = dict(zip(("dq", "dk", "dv"), attention_backward(q, k, v, ref_out, dout, **kwargs)), out=ref_out)
    same = dict(zip(("out", "dq", "dk", "dv"), attention_same_dtype(q, k, v, dout, **kwargs)))
    for name, t in got.items():
        assert t.shape == same[name].shape, (name, t.shape, same[name].shape)
        factor = OUTPUT_FACTOR if name == "out" else GRAD_FACTOR
        assert max_error(t, refs[name]) <= factor * max_error(same[name], refs[name]) + 1e-5, name


@pytest.mark.parametrize("head_dim, head_dim_v, causal", [(192, 128, True), (128, 64, False), (60, 36, True)],
                         ids=["192-128-causal", "128-64", "60-36-causal (zero-padded to 64, 40)"])
def test_flash_attn_func_forward_and_backward(head_dim, head_dim_v, causal):
    q, k = _randn(2, 40, 4, head_dim, grad=True), _randn(2, 56, 2, head_dim, grad=True)
    v = _randn(2, 56, 2, head_dim_v, grad=True)
    out = fagen.flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, 40, 4, head_dim_v)
    dout = _randn(*out.shape)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    _hold_to_the_rule({"out": out, "dq": dq, "dk": dk, "dv": dv}, q.detach(), k.detach(), v.detach(), dout,
                      causal=causal)


def test_varlen_forward_and_backward():
    cu_q, cu_k = torch.tensor([0, 17, 40], dtype=torch.int32), torch.tensor([0, 30, 56], dtype=torch.int32)
    q, k = _randn(40, 4, 192, grad=True), _randn(56, 2, 192, grad=True)
    v = _randn(56, 2, 128, grad=True)
    out = fagen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 30, causal=True)
    assert out.shape == (40, 4, 128)
    dout = _randn(*out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [t.detach()[rows if i == 0 else keys].unsqueeze(0) for i, t in enumerate((q, k, v))]
        got = {"out": out[rows].unsqueeze(0), "dq": grads[0][rows].unsqueeze(0),
               "dk": grads[1][keys].unsqueeze(0), "dv": grads[2][keys].unsqueeze(0)}
        _hold_to_the_rule(got, *one, dout[rows].unsqueeze(0), causal=True)


def test_sdpa_and_flex_attention_take_a_narrower_value():
    query, key = _randn(2, 4, 33, 128), _randn(2, 2, 47, 128)
    value = _randn(2, 2, 47, 64)
    expanded = [t.double().repeat_interleave(2, 1) for t in (key, value)]
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(query.double(), *expanded, is_causal=causal)
        got = fagen.sdpa(query, key, value, is_causal=causal, enable_gqa=True)
        assert got.shape == (2, 4, 33, 64) and max_error(got, want) < 2e-3
    want = torch.nn.functional.scaled_dot_product_attention(query.double(), *expanded)
    got = fagen.flex_attention(query, key, value, enable_gqa=True)
    assert got.shape == (2, 4, 33, 64) and max_error(got, want) < 2e-3


def test_compiles_fullgraph_bit_identical_to_eager():
    q, k = _randn(1, 24, 2, 128, grad=True), _randn(1, 24, 2, 128, grad=True)
    v = _randn(1, 24, 2, 64, grad=True)

    def step(q, k, v):
        return fagen.flash_attn_func(q, k, v, causal=True, return_lse=True)

    assert torch._dynamo.explain(step)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        out, lse = fn(q, k, v)
        runs.append((out, lse, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)
    assert runs[0][0].shape == (1, 24, 2, 64) and runs[0][-1].shape == v.shape


def test_a_wider_value_is_refused_by_name():
    q, k = _randn(1, 8, 2, 64), _randn(1, 8, 2, 64)
    with pytest.raises(InputError, match=r"v's head dim \(v.shape\[-1\] = 128\) must be from 1 to q's \(64\)"):
        fagen.flash_attn_func(q, k, _randn(1, 8, 2, 128))
    with pytest.raises(InputError, match=r"value's head dim \(value.shape\[-1\] = 128\)"):
        fagen.sdpa(q.transpose(1, 2), k.transpose(1, 2), _randn(1, 2, 8, 128))
    with pytest.raises(InputError, match=r"v's head dim \(v.shape\[-1\] = 96\)"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        fagen.flash_attn_varlen_func(q[0], k[0], _randn(8, 2, 96), cu, cu, 8, 8)


def test_a_value_that_differs_in_more_than_its_head_dim_is_refused():
    q, k = _randn(1, 8, 2, 64), _randn(1, 8, 2, 64)
    with pytest.raises(InputError, match="k and v must have the same shape but for the head dim"):
        fagen.flash_attn_func(q, k, _randn(1, 9, 2, 32))


# Decoding: the caches' V rows are d_v wide; the append writes them so, rotary turns q and k only.
KV_CASES = {
    "contiguous, append 2, rotary, 3 splits": (dict(nq=2, new=2, head_dim=128, head_dim_v=64),
                                               dict(causal=True, rotary=(32, False), num_splits=3)),
    "paged, one query (GQA packing by views)": (dict(new=1, page=16, head_dim=192, head_dim_v=128, seed=1),
                                                dict(causal=True)),
    "paged, three queries (packed copies), split": (dict(nq=3, new=3, page=32, head_dim=64, head_dim_v=32, seed=2),
                                                    dict(causal=True, num_splits=2)),
    "zero-padded head dims (60 and 36)": (dict(nq=1, new=1, head_dim=60, head_dim_v=36, seed=3), dict()),
}


@pytest.mark.parametrize("case", KV_CASES)
def test_flash_attn_with_kvcache(case):
    layout, call = KV_CASES[case]
    out, _ = check_call(Case(**layout), **call)
    assert out.shape[-1] == layout["head_dim_v"]


def test_varlen_over_a_paged_cache():
    """flash_attn_varlen_func with a block_table: the cache's V rows are d_v wide."""
    pages = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    k_cache, v_cache = _randn(4, 16, 2, 128), _randn(4, 16, 2, 64)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 20, 45], dtype=torch.int32)
    q = _randn(8, 4, 128)
    out = fagen.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 25, causal=True, block_table=pages)
    assert out.shape == (8, 4, 64)
    for b in range(2):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys = int(cu_k[b + 1] - cu_k[b])
        k, v = (torch.cat([cache[p] for p in pages[b].tolist()])[:keys][None] for cache in (k_cache, v_cache))
        want, _ = attention_forward(q[rows][None], k, v, causal=True)
        same = attention_same_dtype(q[rows][None], k, v, torch.zeros_like(want).half(), causal=True)[0]
        assert max_error(out[rows][None], want) <= OUTPUT_FACTOR * max_error(same, want) + 1e-5


def test_a_kv_cache_whose_value_is_wider_or_of_other_rows_is_refused():
    q, k_cache = _randn(1, 1, 2, 64), _randn(1, 16, 2, 64)
    seqlens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(InputError, match=r"v_cache's head dim \(v_cache.shape\[-1\] = 128\) must be from 1 to q's"):
        fagen.flash_attn_with_kvcache(q, k_cache, _randn(1, 16, 2, 128), cache_seqlens=seqlens)
    with pytest.raises(InputError, match="k_cache and v_cache must have the same shape but for the head dim"):
        fagen.flash_attn_with_kvcache(q, k_cache, _randn(1, 8, 2, 32), cache_seqlens=seqlens)
    with pytest.raises(InputError, match=r"v must have shape \(batch, seqlen_new, kv_heads, head_dim\) = "
                                         r"\(1, 1, 2, 32\)"):
        fagen.flash_attn_with_kvcache(q, k_cache, _randn(1, 16, 2, 32), _randn(1, 1, 2, 64), _randn(1, 1, 2, 64),
                                      cache_seqlens=seqlens)


def test_flash_attention_1_keeps_one_head_dim():
    q, k, v = _randn(1, 8, 2, 64), _randn(1, 8, 2, 64), _randn(1, 8, 2, 32)
    with pytest.raises(InputError, match="head_dim_v=32 != head_dim=64 needs version=2"):
        fagen.flash_attn_func(q, k, v, version=1)


# -- head dims past 256 ----------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, head_dim_v", [(512, 512), (300, 300), (384, 128)],
                         ids=["512", "300 (zero-padded to 304)", "384-128"])
def test_wide_head_dims_forward_and_backward(head_dim, head_dim_v):
    q, k = _randn(1, 33, 2, head_dim, grad=True), _randn(1, 47, 1, head_dim, grad=True)
    v = _randn(1, 47, 1, head_dim_v, grad=True)
    out = fagen.flash_attn_func(q, k, v, causal=True)
    dout = _randn(*out.shape)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    _hold_to_the_rule({"out": out, "dq": dq, "dk": dk, "dv": dv}, q.detach(), k.detach(), v.detach(), dout,
                      causal=True)


def test_wide_head_dims_in_decoding():
    out, _ = check_call(Case(nq=1, new=1, head_dim=512, page=32, seed=5), causal=True, num_splits=2)
    assert out.shape[-1] == 512
    check_call(Case(nq=2, new=2, head_dim=320, head_dim_v=256, seed=6), causal=True, rotary=(64, True))


def test_a_head_dim_past_512_is_refused_by_name():
    wide = _randn(1, 4, 1, 520)
    with pytest.raises(InputError, match=r"head_dim \(q.shape\[-1\]\) must be from 1 to 512, got 520"):
        fagen.flash_attn_func(wide, wide, wide)
    with pytest.raises(InputError, match=r"head_dim \(query.shape\[-1\]\) must be from 1 to 512, got 520"):
        fagen.sdpa(wide, wide, wide)
    with pytest.raises(InputError, match="needs version=2: FlashAttention-1"):
        fagen.flash_attn_func(*(_randn(1, 4, 1, 320) for _ in range(3)), version=1)


@pytest.fixture
def a_99_kb_gpu(monkeypatch):
    """Decoding as on a 99 KB part (sm_86, sm_89, sm_120): the ops fit their tiles to its shared
    memory per block (Spec.for_kv_cache); the emulator runs them. Returns the specs built."""
    from fagen.arch import SMEM_LIMIT_BYTES
    from fagen.ops import kvcache

    built = []
    real = kvcache.step_spec

    def step_spec(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(kvcache, "device_shared_limit", lambda device: SMEM_LIMIT_BYTES["sm_86"])
    monkeypatch.setattr(kvcache, "step_spec", step_spec)
    monkeypatch.setattr(kvcache, "_plans", {})   # a device's limit is fixed: plans made for sm_80's are not remade
    return built


def test_wide_decoding_on_99_kb_parts(a_99_kb_gpu):
    check_call(Case(nq=1, new=1, head_dim=512, page=32, seed=7), causal=True, num_splits=2)
    check_mla(page=64, num_splits=2)
    assert [(s.head_dim, s.block_m, s.num_warps) for s in a_99_kb_gpu] == [(512, 32, 4), (576, 32, 4)]
    assert all(s.shared_layout.total_bytes <= 101376 for s in a_99_kb_gpu)


# -- absorbed MLA decoding: v_cache = k_cache[..., :512] (Spec.v_from_k) --------------------------

@pytest.mark.parametrize("layout", [dict(), dict(page=64, num_splits=2), dict(batch=1, heads=128, page=64)],
                         ids=["contiguous", "paged, split", "128 query heads of one K/V head"])
def test_mla_decoding(layout):
    check_mla(**layout)


def test_mla_refusals_name_the_argument():
    kv, k_new = _randn(1, 64, 1, 576), _randn(1, 1, 1, 576)
    q, seqlens = _randn(1, 1, 8, 576), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(InputError, match=r"so v must be k's: pass v = k\[..., :512\]"):
        fagen.flash_attn_with_kvcache(q, kv, kv[..., :512], k_new, _randn(1, 1, 1, 512), cache_seqlens=seqlens)
    cos = sin = torch.ones(64, 32).half()
    with pytest.raises(InputError, match="rotary_cos / rotary_sin turn a row's first features"):
        fagen.flash_attn_with_kvcache(q, kv, kv[..., :512], k_new, k_new[..., :512], rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=seqlens)
    with pytest.raises(InputError, match=r"head_dim \(q.shape\[-1\]\) must be from 1 to 512, got 576"):
        fagen.flash_attn_func(q, kv, kv[..., :512])   # 576 is MLA's decoding width, not a training one
