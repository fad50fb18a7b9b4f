"""fagen.sass: the main-loop steady state of a SASS listing, on hand-written listings whose
answer is known, and on fagen's own kernels (`fagen sass`)."""

import json

import pytest

from fagen.cli import main
from fagen.sass.listing import find_cuobjdump
from fagen.sass.cfg import build_graph
from fagen.sass.classes import classify
from fagen.sass.listing import parse_instruction, parse_listing
from fagen.sass.report import KernelGeometry, analyse_function, occupancy
from fagen.sass.steady_state import steady_iteration
from sass_listings import listing


# A main loop (header 0x30, back edge at 0xd0) whose steady state is known: the mask block
# (0x50) is skipped, the next tile's prefetch (0xe0, placed out of line at a higher address
# and jumping back) is taken, and the loop's two HMMA and one BAR run.
MAIN_LOOP = """
0000 S2R R0, SR_TID.X
0010 MOV R1, RZ
0020 MOV R2, RZ
0030 HMMA.16816.F32 R4, R8, R12, R4
0040 @P0 BRA 0x60
0050 FSEL R4, R4, -INF , P1
0060 MUFU.EX2 R5, R5
0070 @P2 BRA 0xe0
0080 HMMA.16816.F32 R4, R8, R12, R4
0090 BAR.SYNC.DEFER_BLOCKING 0x0
00a0 IADD3 R1, R1, 0x1, RZ
00b0 ISETP.GE.AND P3, PT, R1, R2, PT
00c0 NOP
00d0 @!P3 BRA 0x30
00d8 EXIT
00e0 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]
00f0 LDGSTS.E.BYPASS.128 [R3+0x800], desc[UR4][R6.64+0x80]
0100 BRA 0x80
"""


def test_instructions_parse_guards_opcodes_and_targets():
    i = parse_instruction(0x40, "@!P0 BRA 0x60")
    assert (i.guard, i.opcode, i.base, i.target, i.always) == ("!P0", "BRA", "BRA", 0x60, False)
    assert parse_instruction(0, "@!PT LDS RZ, [RZ]").never
    assert parse_instruction(0, "HMMA.16816.F32 R4, R8, R12, R4").base == "HMMA"
    call = parse_instruction(0x10, "@P2 CALL.REL.NOINC 0x90")   # ptxas's loop break on sm_80
    assert call.target == 0x90 and not call.ends_path
    assert parse_instruction(0, "BRA 0x30").ends_path and not parse_instruction(0, "@P0 BRA 0x30").ends_path


def test_the_loop_is_found_and_an_out_of_line_block_is_not_one():
    (name, instructions), = parse_listing(listing(MAIN_LOOP)).items()
    graph = build_graph(instructions)
    headers = [graph.blocks[loop.header].start for loop in graph.loops]
    assert headers == [0x30]   # the jump back from 0x100 to 0x80 closes no loop of its own
    (loop,) = graph.loops
    assert {graph.blocks[b].start for b in loop.body} >= {0x30, 0x50, 0x60, 0x80, 0xe0}


def test_the_steady_state_takes_the_prefetch_and_skips_the_mask():
    (name, instructions), = parse_listing(listing(MAIN_LOOP)).items()
    graph = build_graph(instructions)
    iteration = steady_iteration(graph, graph.loops[0], expected_ldgsts=2)
    assert set(iteration.visits) == {0x30, 0x60, 0x80, 0xe0}
    assert iteration.counts["HMMA"] == 2 and iteration.counts["LDGSTS"] == 2 and iteration.counts["fp32"] == 0
    assert iteration.path == (0x30, 0x60, 0xe0, 0x80)   # in the order it runs, not by address
    # Without a copy count to meet, the cheapest full-HMMA path skips the prefetch too.
    assert 0xe0 not in steady_iteration(graph, graph.loops[0]).visits


# A loop with two optional blocks: a mask that reads a captured tensor (0x30: a partial tile's
# loads) and a guarded store (0x60: a full tile's atomic, skipped by a tail tile).
LOADS_AND_STORES = """
0000 HMMA.16816.F32 R4, R8, R12, R4
0010 @P0 BRA 0x50
0020 LDG.E.64.CONSTANT R10, desc[UR4][R6.64]
0030 ISETP.NE.AND P1, PT, R10, R11, PT
0040 FSEL R4, R4, -INF , P1
0050 @P2 BRA 0x70
0060 REDG.E.ADD.F32.FTZ.RN.STRONG.GPU [R2.64], R4
0070 @P3 BRA 0x0
0080 EXIT
"""


def test_the_steady_state_does_the_stores_and_skips_a_mask_s_loads():
    (name, instructions), = parse_listing(listing(LOADS_AND_STORES)).items()
    graph = build_graph(instructions)
    iteration = steady_iteration(graph, graph.loops[0])
    assert 0x60 in iteration.visits and 0x20 not in iteration.visits
    assert iteration.counts["memory"] == 1 and iteration.stores == 1


# A copy loop with a run-time trip count, as ptxas lays it out: a one-chunk remainder loop
# (0x40), a test that skips the unrolled body, and the body (0x70, two chunks an iteration).
NESTED_COPY = """
0000 MOV R1, RZ
0010 HMMA.16816.F32 R4, R8, R12, R4
0020 @!P0 BRA 0x60
0030 IADD3 R9, R9, 0x1, RZ
0040 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]
0050 @P1 BRA 0x40
0060 @!P2 BRA 0xa0
0070 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]
0080 LDGSTS.E.BYPASS.128 [R3+0x10], desc[UR4][R6.64+0x10]
0090 @P3 BRA 0x70
00a0 IADD3 R1, R1, 0x1, RZ
00b0 @P4 BRA 0x10
00c0 EXIT
"""


def test_copy_loops_run_at_their_trip_count_and_skip_the_remainder():
    (name, instructions), = parse_listing(listing(NESTED_COPY)).items()
    graph = build_graph(instructions)
    (outer,) = [loop for loop in graph.loops if loop.depth == 0]
    assert len(outer.children) == 2
    iteration = steady_iteration(graph, outer, expected_ldgsts=4)
    assert iteration.counts["LDGSTS"] == 4
    assert iteration.trips == {0x70: 2}   # the body twice, the remainder loop (0x40) not at all
    assert 0x40 not in iteration.visits and iteration.visits[0x70] == 2


def test_instruction_classes():
    def cls(text):
        return classify(parse_instruction(0, text))

    assert [cls(t) for t in ("HMMA.16816.F32 R0, R4, R8, R0", "LDSM.16.MT88.4 R0, [R2]", "FFMA R0, R1, R2, R3",
                             "MUFU.EX2 R0, R1", "IMAD.WIDE.U32 R0, R1, R2, R4", "UIADD3 UR4, UR4, 0x1, URZ",
                             "BSYNC B0", "LDL R0, [R1]", "REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU [R2.64], R4",
                             "@!PT LDS RZ, [RZ]", "SHFL.BFLY PT, R0, R1, 0x1, 0x1f")] == [
        "HMMA", "LDSM", "fp32", "MUFU", "integer", "integer", "control", "local", "memory", "other", "SHFL"]


def test_the_report_divides_by_the_useful_hmma():
    geometry = KernelGeometry(gemms=2, rows=128, cols=64, head_dim=64, warps=4, copied_bytes=2 * 64 * 64 * 2)
    assert geometry.useful_hmma == 128 and geometry.expected_ldgsts == 8
    (name, instructions), = parse_listing(listing(MAIN_LOOP)).items()
    report = analyse_function(name, instructions, "sm_90", KernelGeometry(2, 16, 8, 16, 1, 32 * 16 * 2))
    assert report.useful_hmma == 2 and report.hmma == 2
    assert report.non_hmma_per_useful_hmma == (report.instructions - 2) / 2
    assert report.to_json()["main_loop"] == "0x0030"


def test_the_gemms_over_v_step_over_its_head_dim():
    """d = 192, d_v = 128: the forward's O += P V and the backward's dP, dV count d_v's HMMA."""
    from fagen.kernels.render import render
    from fagen.sass.report import spec_geometries
    from fagen.spec import Spec

    spec = Spec(192, head_dim_v=128)
    geometries = spec_geometries(spec, render(spec).kernels)
    forward, backward = geometries[f"{spec.name}_fwd"], geometries[f"{spec.name}_bwd"]
    assert forward.useful_hmma == spec.block_m * spec.block_n * (192 + 128) / 2048 / spec.num_warps
    t = spec.backward_tiles
    assert backward.useful_hmma == t.block_m * t.block_n * (3 * 192 + 2 * 128) / 2048 / t.num_warps


def test_occupancy_counts_registers_shared_memory_and_threads():
    assert occupancy("sm_90", 255, 55296, 128) == 8        # registers allow two blocks of four warps
    assert occupancy("sm_80", 128, 92160 + 1024, 128) == 4  # shared memory allows one block
    assert occupancy("sm_90", 64, 0, 256) == 32            # registers: 2048 per warp
    assert occupancy("sm_90", 32, 0, 256) == 64            # the warp limit


needs_cuobjdump = pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")


@needs_cuobjdump
def test_fagen_sass_reports_every_kernel_as_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "sass.json"
    assert main(["sass", "--d", "64", "--causal", "--arch", "sm_80", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fa2_d64_causal_fp16_fwd" in printed and "non-HMMA/useful" in printed
    data = json.loads(out.read_text())
    forward = data["fa2_d64_causal_fp16_fwd"]
    keys = {"instructions", "hmma", "useful_hmma", "non_hmma_per_useful_hmma", "registers", "spill_bytes",
            "HMMA", "LDSM", "LDGSTS", "BAR", "SHFL", "MUFU", "fp32", "integer", "control", "local"}
    assert keys <= set(forward)
    assert forward["hmma"] == forward["HMMA"] == forward["useful_hmma"] == 128
    assert forward["instructions"] == sum(forward[c] for c in ("HMMA", "LDSM", "LDGSTS", "BAR", "SHFL", "MUFU",
                                                                "fp32", "integer", "control", "local", "memory",
                                                                "other"))
    assert data["fa2_d64_causal_fp16_bwd_preprocess"]["main_loop"] is None   # no tensor-core loop
    # An mma.sync kernel is not warp-specialised, and its HMMA are synchronous: no roles, no overlap.
    assert (forward["roles"], forward["setmaxnreg"], forward["overlap"]) == ({}, [], None)


def test_fagen_sass_names_its_errors(capsys):
    assert main(["sass"]) == 2
    assert "name a spec" in capsys.readouterr().err
    assert main(["sass", "--d", "64", "--arch", "sm_80,sm_90"]) == 2
    assert "one arch" in capsys.readouterr().err


# -- Hopper's warpgroup ops and a peer's cubin (fagen sass --cubin) ------------------------------

def test_hopper_instructions_are_classed_and_hgmma_counted_in_hmma_equivalents():
    from fagen.sass.classes import tensor_equivalents

    cases = {"HGMMA.64x176x16.F32.BF16 R24, gdesc[UR36], RZ, !UPT": ("HGMMA", 22.0),      # 176 / 8
             "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24": ("HGMMA", 32.0),     # fp8: K = 32, N / 4
             "QGMMA.64x224x32.F32.E4M3.E4M3 R24, R88, gdesc[UR8], R24, gsb0": ("HGMMA", 56.0),   # A from registers
             "@!PT QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24": ("other", 0.0),
             "HMMA.16816.F32 R4, R8, R12, R4": ("HMMA", 1.0),
             "@!PT HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24": ("other", 0.0),       # never executes
             "USETMAXREG.DEALLOC.CTAPOOL 0x18": ("control", 0.0),
             "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x30], R3": ("control", 0.0),
             "WARPGROUP.DEPBAR.LE gsb0, 0x0": ("control", 0.0),
             "UTMALDG.2D [UR8], [UR16]": ("memory", 0.0),
             "UBLKRED.G.S.ADD.F32.RN [UR4], [UR6], UR8": ("memory", 0.0)}
    for text, (cls, equivalents) in cases.items():
        instruction = parse_instruction(0, text)
        assert (classify(instruction), tensor_equivalents(instruction)) == (cls, equivalents), text


# A consumer loop as FlashAttention-3 lays it out: two warpgroup GEMMs, the softmax between.
HOPPER_LOOP = """
0000 S2R R0, SR_TID.X
0010 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24
0020 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0
0030 WARPGROUP.DEPBAR.LE gsb0, 0x0
0040 FMNMX R2, R24, R25, !PT
0050 MUFU.EX2 R3, R2
0060 HGMMA.64x64x16.F32.BF16 R56, R8, gdesc[UR12], R56, gsb0
0070 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR16], RZ
0080 @P0 BRA 0x10
0090 EXIT
"""


def test_a_warpgroup_loop_is_measured_per_hmma_equivalent():
    (name, instructions), = parse_listing(listing(HOPPER_LOOP)).items()
    report = analyse_function(name, instructions, "sm_90", None)
    assert report.loop_address == 0x10 and report.counts["HGMMA"] == 3
    assert report.tensor_ops == 16 + 16 + 8
    assert report.non_tensor_per_tensor_op == 5 / 40   # DEPBAR, FMNMX, MUFU, SYNCS, BRA


@needs_cuobjdump
def test_fagen_sass_reads_a_cubin_built_elsewhere(tmp_path, capsys, monkeypatch):
    from fagen.kernels.compile import compile_source
    from fagen.kernels.render import render
    from fagen.spec import Spec

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    cubin = tmp_path / "peer.cubin"
    cubin.write_bytes(compile_source(render(Spec(64, mask="causal")), "sm_80").cubins[0])   # the forward's unit
    out = tmp_path / "peer.json"
    assert main(["sass", "--cubin", str(cubin), "--arch", "sm_80", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fa2_d64_causal_fp16_fwd" in printed and "non-tensor/HMMA-eq" in printed
    forward = json.loads(out.read_text())["fa2_d64_causal_fp16_fwd"]
    assert forward["tensor_ops"] == forward["HMMA"] == 128   # the spec's own geometry agrees
    assert main(["sass", "--cubin", str(tmp_path / "missing.cubin")]) == 2
    assert "--cubin" in capsys.readouterr().err
