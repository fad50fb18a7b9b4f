"""benchmarks/sass_vs_fa3.py's FA3 backward table (issue 44's SASS target): which of FlashAttention-3's
backward kernels it reads, from their demangled names (captured from `dew-flash-attn-cu12` 0.3.6,
nothing fetched), and the loops it reads in them; on the cached cubins too, where they are."""

import json

import pytest

from bench_stand_ins import load_benchmark
from fagen.sass.listing import parse_listing
from fagen.sass.report import analyse_foreign, analyse_function
from sass_listings import listing

# dew-flash-attn-cu12 0.3.6, libdew_flash_attn3.so: the d192 causal deterministic bf16 backward, as
# c++filt prints it (its mainloop's thirteen arguments after Sm90; 384 epilogue threads: 3 consumer WGs).
_MAINLOOP = ("flash::CollectiveMainloopBwdSm90<2, 1, 1, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
             "cute::tuple<cute::C<64>, cute::C<96>, cute::C<192> >, cutlass::bfloat16_t, float, cutlass::arch::Sm90, "
             "true, false, false, false, true, false, true, false, 3, 1, 1, 1, false>, "
             "flash::CollectiveEpilogueBwd<cute::tuple<cute::C<64>, cute::C<96>, cute::C<192> >, cutlass::bfloat16_t, "
             "cutlass::arch::Sm90, 384, false, true, 3>, flash::SingleTileBwdLPTScheduler<false, 96, true>")
D192_CAUSAL_DET = (f"void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<{_MAINLOOP} > > >"
                   f"(flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<{_MAINLOOP} > >::Params)")
FLAGS = "true, false, false, false, true, false, true, false, 3"   # causal .. dQ_swapAB, NumMmaWarpGroups


def test_the_backward_picker_reads_the_deterministic_flag_and_leaves_gqa_local_and_fp8():
    bench = load_benchmark("sass_vs_fa3")
    assert bench.describe_backward(D192_CAUSAL_DET) == {
        "pass": "bwd", "head_dim": 192, "dtype": "bf16", "causal": True, "deterministic": True, "tile": "64x96",
        "template": {"stages": 2, "stages_do": 1, "stages_ds": 1, "sdp_swap_ab": False, "dkv_swap_ab": True,
                     "dq_swap_ab": False, "mma_warpgroups": 3, "atom_m_sdp": 1, "atom_n_dkv": 1, "atom_m_dq": 1,
                     "dp_is_rs": False}}
    assert bench.warpgroups(D192_CAUSAL_DET) == {"producer": 1, "consumer": 3}
    plain = D192_CAUSAL_DET.replace(FLAGS, "false, false, false, false, false, false, true, false, 3")
    assert {k: bench.describe_backward(plain)[k] for k in ("causal", "deterministic")} == {
        "causal": False, "deterministic": False}
    assert bench.describe(D192_CAUSAL_DET) is None     # the forward table's picker keeps the plain ones only
    assert bench.describe(plain)["tile"] == "64x96"
    gqa = D192_CAUSAL_DET.replace("CollectiveEpilogueBwd<cute::tuple<cute::C<64>, cute::C<96>, cute::C<192> >, "
                                  "cutlass::bfloat16_t", "CollectiveEpilogueBwdGQA<cute::tuple<cute::C<64>, "
                                  "cute::C<96>, cute::C<192> >, float")
    assert gqa != D192_CAUSAL_DET and bench.describe_backward(gqa) is None   # GQA's fp32 dK, dV epilogue
    local = D192_CAUSAL_DET.replace(FLAGS, "false, true, false, false, true, false, true, false, 3")
    assert bench.describe_backward(local) is None
    fp8 = D192_CAUSAL_DET.replace("cutlass::bfloat16_t, float", "cutlass::float_e4m3_t, float")
    assert bench.describe_backward(fp8) is None
    assert bench.describe_backward("void flash::prepare_varlen_num_blocks_kernel<32, false>(int)") is None


# Two consumer loops with the same tensor work, as FA3 lays out a causal key block at d <= 64: the
# masked iterations' loop (0x10: the mask's ISETP and FSEL), then the unmasked one (0x80).
TWO_LOOPS = """
0000 S2R R0, SR_TID.X
0010 WARPGROUP.ARRIVE
0020 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0
0030 WARPGROUP.DEPBAR.LE gsb0, 0x0
0040 ISETP.GE.AND P1, PT, R1, R2, PT
0050 FSEL R24, R24, RZ, P1
0060 IADD3 R1, R1, 0x1, RZ
0070 @P2 BRA 0x10
0080 WARPGROUP.ARRIVE
0090 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0
00a0 WARPGROUP.DEPBAR.LE gsb0, 0x0
00b0 IADD3 R1, R1, 0x1, RZ
00c0 @P3 BRA 0x80
00d0 EXIT
"""


def test_the_other_loops_column_reads_the_loop_the_main_loop_rule_leaves():
    bench = load_benchmark("sass_vs_fa3")
    (name, instructions), = parse_listing(listing(TWO_LOOPS)).items()
    report = analyse_function(name, instructions, "sm_90", None)
    assert report.loop_address == 0x10 and report.non_tensor_per_tensor_op == 6 / 8   # the tie's first: masked
    assert bench.other_loops(instructions, report) == [
        {"loop": "0x0080", "instructions": 5, "hmma_equivalents": 8.0, "shfl": 0, "fa3": 4 / 8}]
    single = parse_listing(listing(TWO_LOOPS.replace("0090 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0",
                                                     "0090 NOP")))["k"]
    assert bench.other_loops(single, analyse_function("k", single, "sm_90", None)) == []   # less work: not a twin


def test_dew_backward_kernels_where_cached():
    bench = load_benchmark("sass_vs_fa3")
    peer = bench.backward_dir()
    if not (peer / "kernels.json").exists():
        pytest.skip("FA3's backward kernels are not in the fagen cache (python benchmarks/sass_vs_fa3.py)")
    kernels = json.loads((peer / "kernels.json").read_text())
    dew = [k for k in kernels if k["wheel"] == "dew-flash-attn-cu12"]
    assert {k["head_dim"] for k in dew} == {64, 128, 192, 256}
    assert {k["head_dim"] for k in dew if k["deterministic"]} == {64, 128, 192}   # none at d256 in the wheel
    index, kernel = next((i, k) for i, k in enumerate(kernels) if (k["wheel"], k["head_dim"], k["causal"],
                         k["deterministic"], k["dtype"]) == ("dew-flash-attn-cu12", 64, True, False, "bf16"))
    (name, instructions), = parse_listing((peer / f"{index}.sass").read_text()).items()
    report = analyse_foreign(name, instructions, "sm_90")
    assert kernel["tile"] == "128x128" and report.counts["SHFL"] == 64   # L and D broadcast by SHFL.IDX
    assert f"{report.non_tensor_per_tensor_op:.2f}" == "2.33"            # the masked loop, read first
    (other,) = bench.other_loops(instructions, report)
    assert f"{other['fa3']:.2f}" == "1.99" and other["hmma_equivalents"] == report.tensor_ops == 320


def test_the_prototype_backward_columns_read_one_loop_for_both_dtypes():
    """The d64 rows' prototype columns: the micro-kernel compiled for sm_90a and read as FA3's
    cubins are; one consumer loop per kernel (causal is a runtime argument), 5 GEMMs of 4 k16
    HGMMA.64x64 steps per iteration, 24/240 setmaxnreg, no spills. A missing figure prints dashes."""
    pytest.importorskip("cuda.bindings")
    from fagen.sass.listing import find_cuobjdump

    bench = load_benchmark("sass_vs_fa3")
    text, versus = bench.prototype_cells(None, 2.10)
    assert versus is None and set(text.split()) == {"-"}
    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    figures = bench.prototype_figures()
    assert set(figures) == {"bf16", "fp16"}
    for figure in figures.values():
        assert figure["problem"] == "" and figure["hmma_equivalents"] == 5 * 4 * 8
        assert figure["setmaxnreg"] == "24/240" and figure["spill_bytes"] == 0 and figure["ratio"] > 0
    assert figures["bf16"]["loop"] == figures["fp16"]["loop"]
    text, versus = bench.prototype_cells(figures["bf16"], 2.0)
    assert versus == figures["bf16"]["ratio"] / 2.0 and text.split()[0] == figures["bf16"]["loop"]
