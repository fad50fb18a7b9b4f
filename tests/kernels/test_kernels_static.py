"""Static checks of the generated kernels: NVRTC for sm_80 and sm_90, no spills,
and the machine code uses what the design says (tensor cores in the main
loops, ldmatrix, 128-bit global accesses). No GPU needed; SASS comes from
cuobjdump (PyPI's nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm)."""

import re

import pytest
import torch

from fagen.kernels.build import default_specs
from fagen.kernels.render import render
from fagen.kernels.compile import compile_source
from fagen.sass.facts import sass_reports
from fagen.sass.listing import disassemble, find_cuobjdump
from fagen.sass.report import report_for_spec
from fagen.arch import SMEM_LIMIT_BYTES
from fagen.spec import Spec

ARCHS = ("sm_80", "sm_90")
# The default set plus every head dim, both versions, and the flags that change the code.
FLAG_SETS = ({}, {"mask": "causal", "dropout": True}, {"mask": "causal", "key_padding": True, "dropout": True},
             {"mask": "causal", "key_padding": True, "dropout": True, "deterministic": True})
WIDE_SET = [Spec(d, version=v, **flags) for v in (1, 2) for d in (32, 64, 96, 128, 160, 192, 256)
            for flags in FLAG_SETS]
SPECS = default_specs() + [Spec(s.head_dim, version=1, mask=s.mask, dtype=s.dtype) for s in default_specs()]
# The wide set beyond the shipped specs: 54 more specs per arch, the slow tier (CI compiles the
# shipped set, its FlashAttention-1 twins, every variant at once and packed sequences).
WIDE_ONLY = [s for s in WIDE_SET if s not in SPECS]


def _custom_mods():
    import torch

    from fagen.variants import custom_mod, trace_mask_mod, trace_score_mod

    bias = torch.zeros(8, 4096, requires_grad=True)
    doc = torch.zeros(2, 4096, dtype=torch.int32)
    return {"score_mod": custom_mod(trace_score_mod(lambda s, b, h, q, k: s * torch.sigmoid(s) + bias[h, q - k])),
            "mask_mod": custom_mod(trace_mask_mod(lambda b, h, q, k: doc[b, q] == doc[b, k]))}


# Every built-in variant at once (the heaviest combination): spill-free like plain attention.
SPECS += [Spec(d, version=v, mask="causal", window=True, softcap=True, alibi=True, sinks=True, dropout=True,
               key_padding=True, deterministic=det)
          for d in (64, 128, 256) for v in (1, 2) for det in (False, True)]
# The softcap alone (its backward in units of the cap, without dropout), with what Gemma 2 adds.
SPECS += [Spec(d, mask="causal", softcap=True, window=True, key_padding=True, **extra)
          for d in (64, 128, 256) for extra in ({}, {"sinks": True, "deterministic": True})]
# Packed sequences (flash_attn_varlen_func), with and without the built-ins.
SPECS += [Spec(d, version=v, mask="causal", dropout=True, varlen=True, **extra)
          for d in (64, 128, 256) for v in (1, 2)
          for extra in ({}, {"deterministic": True, "window": True, "softcap": True, "sinks": True})]


# V's head dim below Q's (DeepSeek-V3's 192/128, and 128/64): plain, every built-in, deterministic,
# packed sequences.
SPECS += [Spec(d, head_dim_v=dv, mask="causal", dropout=True, **extra)
          for d, dv in ((192, 128), (128, 64))
          for extra in ({"key_padding": True},
                        {"key_padding": True, "window": True, "softcap": True, "alibi": True, "sinks": True},
                        {"key_padding": True, "window": True, "softcap": True, "alibi": True, "sinks": True,
                         "deterministic": True},
                        {"varlen": True, "deterministic": True, "window": True, "softcap": True, "sinks": True})]


# Head dims past 256: every d the issue names, every built-in at 512 (deterministic: the dQ
# kernel's column split), packed sequences.
SPECS += [Spec(d, mask="causal", dropout=True, key_padding=True) for d in (320, 384, 448, 512)]
SPECS += [Spec(512, mask="causal", window=True, softcap=True, alibi=True, sinks=True, dropout=True, key_padding=True,
               deterministic=True),
          Spec(512, mask="causal", dropout=True, varlen=True, window=True, softcap=True, sinks=True)]


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    import os

    old = os.environ.get("FAGEN_CACHE_DIR")
    os.environ["FAGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cubins"))
    yield
    if old is None:
        os.environ.pop("FAGEN_CACHE_DIR")
    else:
        os.environ["FAGEN_CACHE_DIR"] = old


# The default tier compiles the shipped set with its FlashAttention-1 twins for sm_80 and sm_90,
# and FlashAttention-2's variant, packed and d_v combinations above at d = 128, 192/128 and 512
# for sm_80; the slow tier adds the rest of them, sm_90 (the same mma.sync source, recompiled),
# FlashAttention-1's combinations and the wide set.
SHIPPED = SPECS[:2 * len(default_specs())]


def _compile_params():
    params = []
    for arch in ARCHS:
        for spec in SPECS + WIDE_ONLY:
            sampled = spec not in WIDE_ONLY and spec.version == 2 and spec.head_dim in (128, 192, 512)
            default = spec in SHIPPED or (arch == "sm_80" and sampled)
            params.append(pytest.param(spec, arch, id=f"{spec.name}-{arch}",
                                       marks=() if default else pytest.mark.slow))
    return params


@pytest.mark.parametrize("spec, arch", _compile_params())
def test_compiles_without_spills(spec, arch):
    source = render(spec)
    compiled = compile_source(source, arch)
    assert set(compiled.resources) == {e.name for e in source.entries}
    for name, report in compiled.resources.items():
        assert report.spill_bytes == 0, f"{name} on {arch} spills {report.spill_bytes} bytes"
        assert report.stack_bytes == 0, f"{name} on {arch} uses a {report.stack_bytes}-byte stack frame"
        assert report.registers <= 255


# Every case for sm_80; for sm_90 (the same source) one in the default tier, the rest in the slow.
CUSTOM_MOD_CASES = [pytest.param(head_dim, deterministic, arch, id=f"{head_dim}-{deterministic}-{arch}",
                                 marks=() if arch == "sm_80" or (head_dim, deterministic) == (128, False)
                                 else pytest.mark.slow)
                    for arch in ARCHS for head_dim, deterministic in ((64, False), (128, False), (256, False),
                                                                      (64, True), (256, True))]


@pytest.mark.parametrize("head_dim, deterministic, arch", CUSTOM_MOD_CASES)
def test_custom_mods_compile(head_dim, deterministic, arch):
    """A custom score_mod with a captured tensor's gradient (atomics; deterministic, an order-free
    sum's integer atomics) beside a document mask compiles for both archs. (Per-element loads cost
    registers: at some tiles such mods spill, which `fagen build` reports; the built-ins never do.)"""
    spec = Spec(head_dim, mask="causal", dropout=True, deterministic=deterministic, **_custom_mods())
    source = render(spec)
    compiled = compile_source(source, arch)
    assert set(compiled.resources) == {e.name for e in source.entries}
    adds = "fagen::exact_sum_add(ctx.score_cap0_grad" if deterministic else "atomicAdd(ctx.score_cap0_grad"
    assert adds in source.code


def assert_spill_free_and_fits(spec: Spec, arch: str) -> None:
    """Every kernel of `spec` compiles for `arch` without spills or a stack frame, within its
    shared memory (the dynamic layout plus ptxas's static share)."""
    source = render(spec)
    compiled = compile_source(source, arch)
    for entry in source.entries:
        report = compiled.resources[entry.name]
        assert report.spill_bytes == 0 and report.stack_bytes == 0, (entry.name, arch)
        assert entry.shared_bytes + report.static_shared_bytes <= SMEM_LIMIT_BYTES[arch], (entry.name, arch)


# One arch per fallback family (163, 99 and 227 KB per block; sm_89 also 99 KB): the tiles an
# untuned call runs with there, and the backward depth fitted to them.
FALLBACK_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


@pytest.mark.parametrize("arch", FALLBACK_ARCHS)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_fallback_tiles_compile_without_spills_and_fit(head_dim, arch):
    from fagen.tuning import fallback_spec

    spec = fallback_spec(Spec(head_dim, mask="causal", dropout=True, deterministic=True), arch)
    assert_spill_free_and_fits(spec, arch)


# Decoding past d = 256 and absorbed MLA on the 99 KB parts: Spec.for_kv_cache fits the tiles to
# the GPU's shared memory (the ops pass it; fagen.ops.common.device_shared_limit).
SMALL_PART_DECODING = [
    dict(head_dim=512, page_size=32, causal=True),
    dict(head_dim=512, page_size=None, causal=False, pack_gqa=True, window=True, softcap=True, alibi=True),
    dict(head_dim=448, page_size=None, causal=True, head_dim_v=384),
    dict(head_dim=576, page_size=64, causal=False, head_dim_v=512, v_from_k=True, pack_gqa=True),
]


@pytest.mark.parametrize("arch", ["sm_86", "sm_89"])
@pytest.mark.parametrize("fields", SMALL_PART_DECODING, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_decoding_tiles_fit_the_99_kb_parts_without_spills(fields, arch):
    fields = dict(fields)
    head_dim, page_size, causal = fields.pop("head_dim"), fields.pop("page_size"), fields.pop("causal")
    default = Spec.for_kv_cache(head_dim, "fp16", causal=causal, page_size=page_size, **fields)
    assert default.shared_layout.total_bytes > SMEM_LIMIT_BYTES[arch]   # the case needs fitting
    spec = Spec.for_kv_cache(head_dim, "fp16", causal=causal, page_size=page_size,
                             shared_limit=SMEM_LIMIT_BYTES[arch], **fields)
    spec.check_arch(arch)
    assert_spill_free_and_fits(spec, arch)


needs_cuobjdump = pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")


# sm_80 in the default tier, and for sm_90 (the same source) d = 128 causal bf16; the rest slow.
SASS_CASES = [pytest.param(spec, arch, id=f"{spec.name}-{arch}",
                           marks=() if arch == "sm_80" or spec.name == "fa2_d128_causal_bf16" else pytest.mark.slow)
              for arch in ARCHS for spec in default_specs() + [Spec(64, version=1, mask="causal"),
                                                               Spec(128, version=1, dtype="bf16")]]


@needs_cuobjdump
@pytest.mark.parametrize("spec, arch", SASS_CASES)
def test_sass_uses_tensor_cores_ldmatrix_and_wide_accesses(spec, arch):
    source = render(spec)
    reports = sass_reports(disassemble(*compile_source(source, arch).cubins))
    kernels = source.kernels
    forward = reports[kernels.forward.name]
    assert forward.tensor_core_in_loop > 0, "forward: no HMMA inside a loop"
    assert forward.ldmatrix_ops > 0, "forward: no LDSM"
    assert forward.global_loads_128 > 0, "forward: no 128-bit global loads"
    assert forward.global_stores_128 > 0, "forward: O is not written with 128-bit stores"
    backward = reports[kernels.bwd_main.name]
    assert backward.tensor_core_in_loop > 0 and backward.ldmatrix_ops > 0 and backward.global_loads_128 > 0


@needs_cuobjdump
def test_deterministic_dq_kernel_uses_tensor_cores():
    source = render(Spec(64, deterministic=True))
    reports = sass_reports(disassemble(*compile_source(source, "sm_90").cubins))
    assert reports[source.kernels.bwd_dq.name].tensor_core_in_loop > 0


def test_sass_report_finds_loops():
    sass = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0040*/              @P0 BRA 0x20 ;
        /*0050*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0070*/                   EXIT ;
    """
    (report,) = sass_reports(sass).values()
    assert (report.tensor_core_ops, report.tensor_core_in_loop, report.ldmatrix_ops) == (2, 1, 1)
    assert (report.global_loads_128, report.global_stores_128) == (1, 1)


# Integer division in SASS: a run-time divisor takes the reciprocal trick (I2F.*.RP, MUFU.RCP,
# F2I.*.TRUNC), a constant one a multiply-high (IMAD.HI). Philox's rounds multiply-high
# too, so with dropout only the first kind is looked for.
RUNTIME_DIVISION = re.compile(r"^(I2F\S*\.RP|F2I\S*\.TRUNC|MUFU\.RCP)")
CONSTANT_DIVISION = re.compile(r"^IMAD\.HI")


def shipped_variants():
    """(spec, arch): the default set as built, and the fallback tiles untuned calls run with."""
    from fagen.tuning import fallback_spec

    extra = [Spec(64, mask="causal", deterministic=True, dropout=True)]
    pairs = [(spec, arch) for arch in ARCHS for spec in default_specs() + extra]
    for arch in ARCHS:
        for spec in default_specs() + extra:
            tuned = fallback_spec(spec, arch)
            if (tuned, arch) not in pairs:
                pairs.append((tuned, arch))
    return pairs


# Every pair for sm_80; for sm_90 the causal bf16 ones (the default and fallback tiles), the rest slow.
MAIN_LOOP_CASES = [pytest.param(spec, arch, id=f"{spec.name}-{arch}",
                                marks=() if arch == "sm_80" or (spec.mask == "causal" and spec.dtype == "bf16")
                                else pytest.mark.slow)
                   for spec, arch in shipped_variants()]


@needs_cuobjdump
@pytest.mark.parametrize("spec, arch", MAIN_LOOP_CASES)
def test_main_loops_run_only_useful_tensor_core_work_and_no_division(spec, arch):
    """A structural check of the machine code, not a timing (fagen/sass): each kernel's main
    loop is straight-line work per iteration (no nested loop; with dropout only the
    backward's Philox loop, kept rolled on purpose), executes no HMMA beyond the useful
    count of its tiles, and holds no integer division."""
    reports = report_for_spec(spec, arch)
    looped = [r for r in reports.values() if r.loop_address is not None]
    assert {r.kernel for r in looped} >= {spec.name + "_fwd", spec.name + "_bwd"}
    for report in looped:
        rolled_philox = spec.dropout and report.kernel.endswith("_bwd") and len(report.trips) == 1
        assert not report.trips or rolled_philox, f"{report.kernel}: nested loops in the main loop {report.trips}"
        assert report.hmma <= report.useful_hmma, f"{report.kernel}: {report.hmma} HMMA for {report.useful_hmma}"
        divisions = sorted(op for op in report.opcodes if RUNTIME_DIVISION.match(op)
                           or (not spec.dropout and CONSTANT_DIVISION.match(op)))
        assert not divisions, f"{report.kernel} on {arch}: integer division in the main loop: {divisions}"


@needs_cuobjdump
@pytest.mark.parametrize("arch", ARCHS)
def test_the_softcaps_tanh_is_the_hardwares_and_a_score_mods_is_not(arch):
    """The softcap's tanh is tanh.approx.f32 (MUFU.TANH, one per score in both main loops: no
    tanhf's twenty-odd instructions); a score_mod's own tanh stays tanhf (no MUFU.TANH)."""
    from fagen.variants.compose import custom_mod
    from fagen.variants.language import trace_score_mod

    softcap = report_for_spec(Spec(64, softcap=True), arch)
    for kernel in ("fa2_d64_softcap_fp16_fwd", "fa2_d64_softcap_fp16_bwd"):
        assert softcap[kernel].opcodes.get("MUFU.TANH", 0) > 0, f"{kernel} on {arch}: no MUFU.TANH in the main loop"
    mod = custom_mod(trace_score_mod(lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0)))
    own = report_for_spec(Spec(64, score_mod=mod), arch)
    assert all(r.opcodes.get("MUFU.TANH", 0) == 0 for r in own.values()), f"a score_mod's tanh on {arch}"
