"""benchmarks/sass_vs_fa3.py's contract (a benchmark: nothing here fetches FA3's wheels): which of
FlashAttention-3's kernels it measures, read from their demangled template arguments."""

from bench_stand_ins import load_benchmark

PLAIN_FWD = (False,) * 7 + (True, True) + (False,) * 3   # only FA3's MmaPV_is_RS and IntraWGOverlap on


def _fwd(cluster=1, tile=(128, 176, 128), d_v=128, element="bfloat16_t", flags=PLAIN_FWD):
    shape = ", ".join(f"cute::C<{x}>" for x in tile)
    bools = ", ".join("true" if f else "false" for f in flags)
    return ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
            f"flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<{cluster}>, cute::C<1>, cute::C<1> >, "
            f"cute::tuple<{shape} >, {d_v}, cutlass::{element}, float, cutlass::arch::Sm90, {bools}>, "
            "flash::CollectiveEpilogueFwd<...> > > >(...)")


def _bwd(flags=(False,) * 5, element="half_t"):
    bools = ", ".join("true" if f else "false" for f in flags)
    return ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<"
            "flash::CollectiveMainloopBwdSm90<2, 2, 2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
            f"cute::tuple<cute::C<64>, cute::C<128>, cute::C<128> >, cutlass::{element}, float, cutlass::arch::Sm90, "
            f"{bools}, false, false, false, 2, 1, 2, 1, false>, ...> > >(...)")


def test_the_plain_forward_and_backward_kernels_are_picked_and_the_rest_left():
    describe = load_benchmark("sass_vs_fa3").describe
    assert describe(_fwd()) == {"pass": "fwd", "head_dim": 128, "dtype": "bf16", "causal": False, "tile": "128x176"}
    causal = (True,) + (False,) * 6 + (True, True) + (False,) * 3
    assert describe(_fwd(cluster=2, tile=(128, 128, 128), flags=causal)) == {
        "pass": "fwd", "head_dim": 128, "dtype": "bf16", "causal": True, "tile": "128x128 c2"}
    softcap = (False, False, True) + (False,) * 4 + (True, True) + (False,) * 3
    assert describe(_fwd(flags=softcap)) is None                 # a feature on
    assert describe(_fwd(d_v=64)) is None                        # d_v != d
    assert describe(_fwd(element="float_e4m3_t"))["dtype"] == "e4m3"   # issue 45's peer: FA3's e4m3 forward
    assert describe(_bwd()) == {"pass": "bwd", "head_dim": 128, "dtype": "fp16", "causal": False, "tile": "64x128"}
    assert describe(_bwd(flags=(False, False, False, False, True))) is None   # deterministic
    assert describe("void flash::prepare_varlen_num_blocks(...)") is None


def test_fa3_s_warpgroups_are_read_from_its_epilogue_s_thread_count():
    warpgroups = load_benchmark("sass_vs_fa3").warpgroups
    fwd = _fwd().replace("flash::CollectiveEpilogueFwd<...>", "flash::CollectiveEpilogueFwd<cute::tuple<cute::C<192>, "
                         "cute::C<64>, cute::C<64> >, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
                         "cutlass::bfloat16_t, cutlass::arch::Sm90, 384, false, false, false, false>")
    assert warpgroups(fwd) == {"producer": 1, "consumer": 3}
    bwd = _bwd().replace("...> > >", "flash::CollectiveEpilogueBwd<cute::tuple<cute::C<80>, cute::C<128>, "
                         "cute::C<128> >, cutlass::half_t, cutlass::arch::Sm90, 256, false, false, 1>, ...> > >")
    assert warpgroups(bwd) == {"producer": 1, "consumer": 2}
    assert warpgroups(_fwd()) is None                                  # the name does not say
