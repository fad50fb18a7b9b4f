"""fagen.sass on warp-specialised kernels: each role's loop (roles.py), the setmaxnreg each runs
under, the overlap signature (overlap.py) and sm_90a's limits (facts.py), on hand-written
listings whose answer is known and on FlashAttention-3's own kernels where they are cached."""

import json

import pytest

from bench_stand_ins import load_benchmark
from fagen.cli import main
from fagen.sass.cfg import build_graph
from fagen.sass.facts import SM90A, limit_problems
from fagen.sass.listing import parse_instruction, parse_listing
from fagen.sass.overlap import exp2_overlap
from fagen.sass.report import analyse_foreign, analyse_function
from fagen.sass.roles import SHARED_LOADS, RegisterSetting
from fagen.sass.steady_state import steady_iteration
from sass_listings import listing

# One producer warpgroup (threads 0-127: warp 0 loads, warp 1 writes) and consumer warpgroups,
# as FlashAttention-3 lays them out. The producer's loop (0x50) waits on an mbarrier (its
# retry loop out of line at 0x200) and only an elected thread (P1) arrives and loads; the
# writer's loop (0xd0) bulk-reduces from one thread; the consumer's loop (0x140) runs one
# wgmma group with one exp2 before its wait and one after.
WARP_SPECIALISED = """
0000 S2R R0, SR_TID.X
0010 ISETP.GE.AND P0, PT, R0, 0x80, PT
0020 @P0 BRA 0x120
0030 USETMAXREG.DEALLOC.CTAPOOL 0x18
0040 @P5 BRA 0xd0
0050 SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4+0x10], R3
0060 @!P2 BRA 0x200
0070 @!P1 BRA 0xa0
0080 SYNCS.ARRIVE.TRANS64 RZ, [UR4], R2
0090 UTMALDG.2D [UR8], [UR16]
00a0 IADD3 R1, R1, 0x1, RZ
00b0 @P3 BRA 0x50
00c0 EXIT
00d0 BAR.SYNC.DEFER_BLOCKING 0x1, 0x100
00e0 @!P1 BRA 0x100
00f0 UBLKRED.G.S.ADD.F32.RN [UR30], [UR13], UR14, desc[UR32]
0100 @P4 BRA 0xd0
0110 EXIT
0120 USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0
0130 @!UP0 BRA 0x120
0140 SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], R3
0150 WARPGROUP.ARRIVE
0160 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT
0170 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0
0180 MUFU.EX2 R2, R2
0190 WARPGROUP.DEPBAR.LE gsb0, 0x0
01a0 MUFU.EX2 R3, R24
01b0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR12], RZ
01c0 @P4 BRA 0x140
01d0 EXIT
0200 SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4+0x10], R3
0210 @!P2 BRA 0x200
0220 BRA 0x70
"""


def _report(body: str):
    (name, instructions), = parse_listing(listing(body)).items()
    return analyse_function(name, instructions, "sm_90", None)


def test_a_warp_specialised_kernel_splits_into_its_roles_loops():
    report = _report(WARP_SPECIALISED)
    assert list(report.roles) == ["consumer", "producer", "writer"]
    consumer, producer, writer = report.roles.values()
    # The consumer's loop is the main loop, read the same way: its figures are the report's.
    assert consumer.loop_address == report.loop_address == 0x140
    assert (consumer.counts, consumer.tensor_ops) == (report.counts, report.tensor_ops) and consumer.tensor_ops == 32
    assert consumer.non_tensor_per_tensor_op == report.non_tensor_per_tensor_op == 7 / 32   # 9 instructions, 2 HGMMA
    # The producer's loop: the elected thread's arrive and load taken, the mbarrier's retry loop not.
    assert producer.loop_address == 0x50 and producer.tensor_ops == 0
    assert producer.work == {"SYNCS": 2, "UTMALDG": 1} and producer.instructions == 7
    assert writer.loop_address == 0xd0 and writer.work == {"UBLKRED": 1} and writer.counts["BAR"] == 1


def test_each_role_runs_under_the_setmaxnreg_above_its_loop():
    report = _report(WARP_SPECIALISED)
    assert report.register_settings == [RegisterSetting(0x30, 24, "dealloc", ("producer", "writer")),
                                        RegisterSetting(0x120, 240, "alloc", ("consumer",))]
    assert {role: loop.registers for role, loop in report.roles.items()} == {
        "consumer": 240, "producer": 24, "writer": 24}
    data = report.to_json()
    assert data["roles"]["producer"]["setmaxnreg"] == 24 and data["roles"]["consumer"]["loop"] == "0x0140"
    assert data["setmaxnreg"][0] == {"address": "0x0030", "registers": 24, "kind": "dealloc",
                                     "roles": ["producer", "writer"]}
    # 24 x 128 + 240 x 256 fits the register file; a third consumer warpgroup at 240 does not.
    # The writer's warps are the producer's warpgroup: its setting counts once.
    assert report.limit_problems({"producer": 1, "writer": 1, "consumer": 2}) == []
    (problem,) = report.limit_problems({"producer": 1, "consumer": 3})
    assert "24 x 128 + 240 x 384 = 95232 > the register file's 65536" in problem


def test_a_producer_s_steady_state_takes_its_elected_thread_s_loads():
    (name, instructions), = parse_listing(listing(WARP_SPECIALISED)).items()
    graph = build_graph(instructions)
    loop = next(loop for loop in graph.loops if graph.blocks[loop.header].start == 0x50)
    assert 0x80 not in steady_iteration(graph, loop).visits       # the cheapest path skips the load
    taken = steady_iteration(graph, loop, prefer=SHARED_LOADS)
    assert taken.visits[0x80] == 1 and taken.counts["memory"] == 1 and taken.preferred == 1
    assert 0x200 not in taken.visits                                # the mbarrier's wait succeeds at once
    assert taken.path == (0x50, 0x70, 0x80, 0xa0)


def test_a_kernel_without_a_producer_loop_has_no_roles():
    hopper = _report("""
0000 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0
0010 MUFU.EX2 R2, R2
0020 WARPGROUP.DEPBAR.LE gsb0, 0x0
0030 @P0 BRA 0x0
0040 EXIT
""")
    assert hopper.roles == {} and hopper.register_settings == [] and str(hopper.overlap) == "1 of 1 exp2 in flight"
    mma_sync = _report("""
0000 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]
0010 HMMA.16816.F32 R4, R8, R12, R4
0020 MUFU.EX2 R2, R2
0030 @P0 BRA 0x0
0040 EXIT
""")
    assert mma_sync.roles == {} and mma_sync.overlap is None   # HMMA is synchronous


# -- the overlap signature --------------------------------------------------------------------------

def _overlap(*lines):
    return exp2_overlap([parse_instruction(16 * n, text) for n, text in enumerate(lines)])


S = "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"             # S = Q K^T, one group
PV = "HGMMA.64x128x16.F32.BF16 R112, R176, gdesc[UR8].tnspB, R112, gsb0"   # O += P V, another


def test_an_exp2_before_the_wait_is_in_flight_and_one_after_is_not():
    overlap = _overlap(S, "MUFU.EX2 R2, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R3, R3")
    assert (overlap.exp2_in_flight, overlap.exp2, overlap.groups, overlap.carried) == (1, 2, 1, 0)
    assert str(overlap) == "1 of 2 exp2 in flight"


def test_a_group_is_in_flight_from_its_first_hgmma_not_its_gsb0():
    overlap = _overlap("WARPGROUP.ARRIVE", "MUFU.EX2 R1, R1", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
                       "MUFU.EX2 R2, R2", S.replace("RZ, !UPT", "R24"), "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert (overlap.exp2_in_flight, overlap.exp2, overlap.groups) == (1, 2, 1)   # the fence starts nothing


def test_a_wait_for_one_leaves_the_newest_group_in_flight():
    # FlashAttention-3's intra-warpgroup overlap: S and the previous P V issued, wait until one
    # is left (S retires), the exponentials run under P V, then wait for all.
    overlap = _overlap(S, PV, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R2, R2", "MUFU.EX2 R3, R3",
                       "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R4, R4")
    assert (overlap.exp2_in_flight, overlap.exp2, overlap.groups) == (2, 3, 2)
    alone = _overlap(S, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R2, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert alone.exp2_in_flight == 1   # with one group committed, a wait for one retires nothing


def test_a_group_left_in_flight_at_the_back_edge_covers_the_next_iteration_s_start():
    overlap = _overlap("MUFU.EX2 R2, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", PV, "@!PT MUFU.EX2 R5, R5")
    assert (overlap.exp2_in_flight, overlap.exp2, overlap.groups, overlap.carried) == (1, 1, 1, 1)


def test_the_signature_follows_the_order_the_iteration_runs_its_blocks():
    # The wait sits in a block ptxas placed above the exp2 (0x100): by address the exp2 would be
    # under the group, in the order the path runs them it is not.
    report = _report("""
0000 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0
0010 BRA 0x100
0020 MUFU.EX2 R2, R2
0030 @P0 BRA 0x0
0040 EXIT
0100 WARPGROUP.DEPBAR.LE gsb0, 0x0
0110 BRA 0x20
""")
    assert report.loop_address == 0x0 and str(report.overlap) == "0 of 1 exp2 in flight"


# -- sm_90a's limits ---------------------------------------------------------------------------------

def test_sm90a_limits_flag_what_a_kernel_asks_beyond_them():
    assert limit_problems(SM90A, registers=255, shared_bytes=227 * 1024, setmaxnreg=(24, 240, 256),
                          budgets=((24, 1), (240, 2))) == []
    assert limit_problems(SM90A, budgets=((32, 1), (160, 3))) == []   # 65536 exactly: FA3's d64
    problems = limit_problems(SM90A, registers=256, shared_bytes=227 * 1024 + 1, setmaxnreg=(16, 244, 264),
                              budgets=((24, 1), (240, 3)))
    assert len(problems) == 6
    assert problems[0] == "256 registers per thread > 255"
    assert problems[1] == "232449 bytes of shared memory per block > 232448"
    assert [p.split(" outside")[0] for p in problems[2:5]] == ["setmaxnreg 16", "setmaxnreg 244", "setmaxnreg 264"]
    assert problems[2].endswith("outside 24..256 in steps of 8")
    assert problems[5].startswith("register budgets 24 x 128 + 240 x 384")


def test_a_setmaxnreg_out_of_range_is_flagged_in_the_report():
    report = _report(WARP_SPECIALISED.replace("UP0, 0xf0", "UP0, 0xf4"))
    assert report.limit_problems() == ["setmaxnreg 244 outside 24..256 in steps of 8"]
    assert report.to_json()["limit_problems"] == report.limit_problems()


# -- the command line and FlashAttention-3's kernels ----------------------------------------------------

def test_fagen_sass_cubin_prints_the_roles(tmp_path, capsys, monkeypatch):
    import fagen.sass.listing as sass_listing

    # The listing stands in for cuobjdump's: the test reads no real cubin.
    monkeypatch.setattr(sass_listing, "find_cuobjdump", lambda: "cuobjdump")
    monkeypatch.setattr(sass_listing, "disassemble", lambda cubin: listing(WARP_SPECIALISED, "ws_kernel"))
    cubin, out = tmp_path / "ws.cubin", tmp_path / "ws.json"
    cubin.write_bytes(b"\x7fELF")
    assert main(["sass", "--cubin", str(cubin), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("consumer loop 0x140: 9 instr, 32 HMMA-eq, 0.22 non-tensor/HMMA-eq, setmaxnreg 240",
                 "producer loop 0x50: 7 instr, setmaxnreg 24", "(SYNCS 2, UTMALDG 1)",
                 "setmaxnreg: 24 (dealloc at 0x30: producer, writer), 240 (alloc at 0x120: consumer)",
                 "overlap: 1 of 2 exp2 in flight (1 wgmma groups per iteration, 0 carried in)"):
        assert line in printed, line
    data = json.loads(out.read_text())["ws_kernel"]
    assert set(data["roles"]) == {"consumer", "producer", "writer"}
    assert data["overlap"] == {"exp2_in_flight": 1, "exp2": 2, "groups": 1, "carried_groups": 0}


def _fa3_kernels():
    bench = load_benchmark("sass_vs_fa3")
    peer = bench.peer_dir()
    if not (peer / "kernels.json").exists():
        pytest.skip("FlashAttention-3's kernels are not in the fagen cache (python benchmarks/sass_vs_fa3.py)")
    kernels = json.loads((peer / "kernels.json").read_text())
    names = bench.readable_names(k["name"] for k in kernels)

    def read(wheel, pass_, head_dim, tile, causal=False, dtype="bf16"):
        index, kernel = next((i, k) for i, k in enumerate(kernels) if (
            k["wheel"], k["pass"], k["head_dim"], k["tile"], k["causal"], k["dtype"]) == (
            wheel, pass_, head_dim, tile, causal, dtype))
        (name, instructions), = parse_listing((peer / f"{index}.sass").read_text()).items()
        return analyse_foreign(name, instructions, "sm_90"), bench.warpgroups(names[name])

    return read


def test_fa3_d128_forward_roles_registers_and_overlap():
    read = _fa3_kernels()
    report, groups = read("fa3-fwd", "fwd", 128, "128x176")
    assert groups == {"producer": 1, "consumer": 2}
    consumer, producer = report.roles["consumer"], report.roles["producer"]
    assert consumer.loop_address == report.loop_address
    assert f"{consumer.non_tensor_per_tensor_op:.2f}" == "1.59"   # the main loop's figure, as before
    assert producer.tensor_ops == 0 and producer.work["UTMALDG"] == 8 and producer.work["SYNCS"] == 8
    assert (producer.registers, consumer.registers) == (24, 240)
    assert [(s.registers, s.kind, s.roles) for s in report.register_settings] == [
        (240, "alloc", ("consumer",)), (24, "dealloc", ("producer",))]
    assert report.limit_problems(groups) == []
    # The exp2 between `DEPBAR.LE gsb0, 0x1` (S retired) and `DEPBAR.LE gsb0, 0x0` run under P V.
    assert str(report.overlap) == "19 of 90 exp2 in flight"
    other, _ = read("flash-attn3-jax", "fwd", 128, "128x176")
    assert str(other.overlap) == "0 of 90 exp2 in flight"   # the other wheel's ptxas waits for both first


def test_fa3_d64_forward_and_d128_backward_roles():
    read = _fa3_kernels()
    d64, groups = read("fa3-fwd", "fwd", 64, "192x192")
    assert groups == {"producer": 1, "consumer": 3}
    assert (d64.roles["producer"].registers, d64.roles["consumer"].registers) == (32, 160)
    assert d64.limit_problems(groups) == []   # 32 x 128 + 160 x 384 = 65536, the whole register file
    bwd, groups = read("flash-attn3-jax", "bwd", 128, "80x128")
    assert set(bwd.roles) == {"consumer", "producer", "writer"} and bwd.roles["writer"].work["UBLKRED"] > 0
    assert f"{bwd.roles['consumer'].non_tensor_per_tensor_op:.2f}" == "1.21"
    assert [s.roles for s in bwd.register_settings] == [("consumer",), ("producer", "writer")]


# ptxas's guard before an ELECT or a uniform-datapath instruction: BRA.DIV jumps to a collective
# fallback only when the warp is not converged, so it falls through too (unguarded as it is).
DIVERGENCE_CHECK = """
0000 IADD3 R1, R1, 0x1, RZ
0010 BRA.DIV UR6, 0x50
0020 ELECT P0, URZ, PT
0030 @P4 BRA 0x0
0040 EXIT
0050 WARPSYNC.COLLECTIVE R5, 0x60
0060 BRA 0x20
"""


def test_a_branch_on_divergence_falls_through_as_well():
    (name, instructions), = parse_listing(listing(DIVERGENCE_CHECK)).items()
    graph = build_graph(instructions)
    check = next(block for block in graph.blocks if block.instructions[-1].opcode == "BRA.DIV")
    assert sorted(graph.blocks[s].instructions[0].address for s in check.successors) == [0x20, 0x50]
    loop = next(loop for loop in graph.loops if graph.blocks[loop.header].start == 0x0)
    assert steady_iteration(graph, loop).path == (0x0, 0x20)   # converged: the fallback not taken
