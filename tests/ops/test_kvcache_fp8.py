"""flash_attn_with_kvcache over an 8-bit cache (issue 45, part 2): float8_e4m3fn k_cache and
v_cache with k_descale / v_descale (B, Hk), q and the new keys in bf16 or fp16; the accuracy rule
and the append's model are tests/support/fp8_cache_cases.py's."""

import math

import pytest
import torch

import fagen
from fagen.errors import InputError
from fagen.kernels import kv_kernels
from fagen.kernels.compile import compile_source
from fagen.kernels.render import render
from fagen.reference import attention_forward, attention_same_dtype
from fagen.spec import Spec
from fp8_cache_cases import B, E4M3, H, HK, Fp8Case, check_fp8_call
from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, lse_tolerance, max_error


@pytest.mark.parametrize("page", [None, 32], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_appends_bit_exactly_and_attends_within_the_rule(page, num_splits):
    """GQA packing (4 query heads on 2 K/V heads), an empty entry, split-KV's combine."""
    check_fp8_call(Fp8Case(page=page), num_splits=num_splits)


def test_fp8_cache_under_causal_queries_window_softcap_alibi_and_fp16():
    case = Fp8Case(dtype=torch.float16, d=128, nq=3, page=64, seed=3)
    check_fp8_call(case, causal=True, window_size=(40, 0), softcap=20.0,
                   alibi_slopes=torch.rand(B, H, dtype=torch.float32) * 0.3)


def test_fp8_cache_of_absorbed_mla_takes_k_descale_alone():
    """One cache (576-wide rows, V their first 512 columns): k_descale scales both."""
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(4, 16, 1, 576, generator=gen).to(E4M3)
    q = torch.randn(1, 1, 8, 576, generator=gen).bfloat16()
    descale = torch.tensor([[0.5]])
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    out, lse = fagen.flash_attn_with_kvcache(q, kv, kv[..., :512], cache_seqlens=torch.tensor([40], dtype=torch.int32),
                                             block_table=table, k_descale=descale, return_softmax_lse=True)
    keys = torch.cat([kv[int(p)] for p in table[0]])[:40][None].double() * 0.5
    ref_out, ref_lse = attention_forward(q, keys, keys[..., :512])
    same = attention_same_dtype(q, keys.bfloat16(), keys[..., :512].bfloat16(), q.new_zeros(1, 1, 8, 512))[0]
    assert max_error(out, ref_out) <= OUTPUT_FACTOR * max_error(same, ref_out) + ABS_FLOOR
    assert max_error(lse, ref_lse) < lse_tolerance(0.0)
    with pytest.raises(InputError, match="v_descale: v_cache is a view of k_cache"):
        fagen.flash_attn_with_kvcache(q, kv, kv[..., :512], block_table=table, k_descale=descale, v_descale=descale)


def test_every_e4m3_byte_widens_as_torch_casts_it():
    """One key (its softmax weight exactly 1), V's row the 256 byte values: O is the widened row,
    rounded to bf16 (exact), NaN where the byte is e4m3's NaN: the kernel's widening against
    torch's float8 -> float cast, the largest values (+-448) and the subnormals included (-0 reads
    as 0: O's accumulator starts at +0, and +0 + -0 is +0)."""
    row = torch.arange(256, dtype=torch.uint8).view(E4M3)
    v_cache = row.view(1, 1, 1, 256).expand(1, 16, 1, 256).contiguous()
    k_cache = torch.zeros(1, 16, 1, 256, dtype=E4M3)
    q = torch.randn(1, 1, 1, 256).bfloat16()
    out = fagen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1, k_descale=torch.ones(1, 1),
                                        v_descale=torch.ones(1, 1))
    want = row.float().bfloat16()
    assert torch.equal(out[0, 0, 0].isnan(), want.isnan()) and want.isnan().sum() == 2
    finite = ~want.isnan()
    assert torch.equal(out[0, 0, 0][finite].float(), want[finite].float())


def _bad_calls():
    case = Fp8Case()
    bf16_cache = case.k_cache.bfloat16()
    return [
        (dict(k_descale=torch.ones(B, HK + 1)), "k_descale must be a float32 tensor of shape \\(batch, kv_heads\\)"),
        (dict(v_descale=torch.ones(B, HK, dtype=torch.float64)), "v_descale must be a float32"),
        (dict(k_cache=bf16_cache, v_cache=bf16_cache.clone()), "k_descale scales an 8-bit"),
        (dict(v_cache=case.v_cache.bfloat16()), "k_cache and v_cache must have one dtype"),
        (dict(k_cache=case.k_cache[..., :8].contiguous(), v_cache=case.v_cache[..., :8].contiguous(),
              q=case.q[..., :8].contiguous(), k=None, v=None, cache_seqlens=None),
         "an 8-bit cache's head dims must be multiples of 16"),
    ]


@pytest.mark.parametrize("change,message", _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_fp8_cache_calls_name_the_argument_and_leave_the_cache_untouched(change, message):
    case = Fp8Case()
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, k=case.k, v=case.v, cache_seqlens=case.seqlens,
                cache_batch_idx=case.batch_idx, cache_leftpad=case.leftpad, k_descale=case.k_descale,
                v_descale=case.v_descale)
    args.update(change)
    before = args["k_cache"].clone()
    with pytest.raises(InputError, match=message):
        fagen.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"].view(torch.uint8) if args["k_cache"].dtype == E4M3 else args["k_cache"],
                       before.view(torch.uint8) if before.dtype == E4M3 else before)


FP8_CACHE_SPECS = [Spec.for_kv_cache(d, "bf16", causal=causal, page_size=page, cache_dtype="e4m3", **fields)
                   for d, causal, page, fields in (
                       (64, True, None, {}), (128, False, 64, {"pack_gqa": True, "window": True, "softcap": True,
                                                              "alibi": True}),
                       (256, False, 64, {"pack_gqa": True}), (192, True, None, {"head_dim_v": 128}),
                       (576, False, 64, {"head_dim_v": 512, "v_from_k": True, "pack_gqa": True}))]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
# d 64 and 128 in the fast tier; the wider ones (10 s a compile on sm_80) in the slow one.
@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.slow) if s.head_dim > 128 else s
                                  for s in FP8_CACHE_SPECS], ids=lambda s: s.name)
def test_fp8_cache_kernels_compile_without_spills(spec, arch):
    compiled = compile_source(render(spec), arch)
    assert set(compiled.resources) == {e.name for e in render(spec).entries}
    for name, report in compiled.resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name} on {arch}: {report}"


@pytest.mark.parametrize("schedule", ["warp-serial", "reverse"])
def test_fp8_cache_kernels_are_race_free(monkeypatch, schedule):
    """The append, the split forward (raw stages, the widened tiles) and the combine under racecheck."""
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    case = Fp8Case(page=32, nq=2, seed=11)
    source = render(Spec.for_kv_cache(64, "bf16", causal=True, page_size=32, cache_dtype="e4m3"))
    descales = (case.k_descale, case.v_descale)
    kv_kernels.update_kv_cache(source, case.q, case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                               block_table=case.block_table, descales=descales)
    out, _ = kv_kernels.forward_kv_cache(source, case.q, case.k_cache, case.v_cache, case.seqlens,
                                         seqlen_k=case.capacity, block_table=case.block_table, num_splits=3,
                                         new_tokens=case.new, descales=descales)
    assert not out.isnan().any()


def test_fp8_cache_spec_names_round_trip_and_refusals():
    spec = Spec.for_kv_cache(128, "bf16", causal=False, page_size=64, cache_dtype="e4m3")
    assert spec.name.endswith("_paged_kve4m3_m64n64w4s2") and Spec.from_name(spec.name) == spec
    assert "cache_dtype" not in Spec.for_kv_cache(128, "bf16", causal=False, page_size=64).to_dict()
    with pytest.raises(ValueError, match="cache_dtype='e4m3' is a KV cache's dtype: it needs kv_cache"):
        Spec(128, dtype="bf16", cache_dtype="e4m3")
    with pytest.raises(ValueError, match="multiples of 16"):
        Spec.for_kv_cache(72, "bf16", causal=False, page_size=None, cache_dtype="e4m3")
    with pytest.raises(ValueError, match="an 8-bit KV cache is widened by the sm80 family"):
        spec.replace(arch_family="sm90")
    assert math.isclose(spec.shared_layout.total_bytes,
                        64 * 136 * 2 * 3 + 2 * 2 * 64 * 144)   # Q, K and V widened, two raw stages of each


def test_an_fp8_step_compiles_without_graph_breaks_and_equals_eager():
    """The custom op (fagen::flash_attn_with_kvcache) takes the descales: fullgraph, one graph, and
    the compiled step's output and the bytes it appends equal eager's."""
    torch._dynamo.reset()
    eager_case, compiled_case = Fp8Case(page=32, seed=7), Fp8Case(page=32, seed=7)

    def step(case):
        return case.call(causal=True, num_splits=2)

    explained = torch._dynamo.explain(step)(Fp8Case(page=32, seed=7))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    expected, got = step(eager_case), torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_case)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(compiled_case.k_cache.view(torch.uint8), eager_case.k_cache.view(torch.uint8))


def test_an_fp8_cache_step_stays_on_the_sm80_family_under_FAGEN_ARCH_FAMILY_sm90(monkeypatch):
    from fagen.ops.kvcache import decode_spec

    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    fields = {"cache_dtype": "e4m3", "pack_gqa": True}
    assert decode_spec(128, torch.bfloat16, False, 64, fields, device=torch.device("cpu")).arch_family == "sm80"
    assert decode_spec(128, torch.bfloat16, False, 64, {"pack_gqa": True},
                       device=torch.device("cpu")).arch_family == "sm90"
