"""Autotuning: candidates, pruning, the output check, selection, the cache, the fallback table,
`fagen tune`. Everything but the last test runs on a CPU, with injected checks and timers."""

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import warnings

import pytest
import torch

from fagen import tuning as autotune
from fagen.tuning import (DeviceIdentity, DeviceLimits, ReferenceCheck, ShapeBucket, TileGrid, TuneEntry,
                            TuningError, add_tune_parser, candidates, cmd_tune, fallback_spec, fallback_tiles,
                            lookup, prune, tune)
from fagen.tuning import cache as tune_cache
from fagen.tuning.fallback import (ARCH_CLASSES, FALLBACK_OVERRIDES, SMEM_99K, SMEM_163K, SMEM_227K, arch_class,
                                   head_dim_bucket)
from fagen.tuning.measure import CHECK_DROPOUT_P, rotation_sets
from fagen.tuning.space import ProgressLine, compile_all, nvrtc_resources
from fagen.kernels.render import kernel_entries
from fagen.kernels.compile import CompileError, ResourceReport
from fagen.reference import attention_forward, attention_same_dtype, dropout_keep_mask
from fagen.arch import smem_limit
from fagen.arch_families import chosen_family
from fagen.spec import Spec
from fagen.tile_shapes import default_tiles

FAKE_GPU = DeviceIdentity(name="Fake GPU 80GB", arch="sm_90", driver="555.42.06", nvrtc="12.9")
SM90 = DeviceLimits.preset("sm_90")
SMALL_GRID = TileGrid(block_m=(64, 128), block_n=(32, 64), num_warps=(4,), num_stages=(1, 2))
SHAPE = {"seqlen_q": 3000, "batch": 2, "heads": 8}   # bucket q4096_k4096_bh16


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    autotune.reload_cache()
    yield tmp_path / "cache" / "tune"
    autotune.reload_cache()


def report(spec, registers=96, spills=0, static_shared=0, arch="sm_90"):
    name = kernel_entries(spec).forward.name
    return {name: ResourceReport(kernel=name, arch=arch, registers=registers, spill_store_bytes=spills,
                                 spill_load_bytes=spills, stack_bytes=0, static_shared_bytes=static_shared)}


def clean_compile(spec):
    return report(spec)


def fake_tune(spec, *, timer, check=None, identity=FAKE_GPU, shape=SHAPE, **options):
    """tune() with everything but the selection logic faked."""
    return tune(spec, **shape, device="cpu", grid=SMALL_GRID, limits=SM90, identity=identity,
                compile_one=clean_compile, check=check or (lambda s: True), timer=timer, verbose=False, **options)


def rounded_reference_runner(wrong=()):
    """A stand-in kernel: the float64 oracle rounded to the input dtype, which is what a perfect
    kernel returns; specs in `wrong` get a visibly wrong output instead."""
    def run(spec, q, k, v, *, softmax_scale, seqlens_k, dropout_p, generator=None):
        assert dropout_p == 0.0
        out, _ = attention_forward(q, k, v, softmax_scale=softmax_scale, causal=spec.causal,
                                   seqlens_k=seqlens_k)
        if spec in wrong:
            out = out + 0.05   # e.g. a tile size that drops part of the last K/V block
        return out.to(q.dtype)
    return run


# -- candidates and pruning --------------------------------------------------

@pytest.mark.parametrize("head_dim,arch", [(64, "sm_80"), (128, "sm_90"), (256, "sm_89")])
def test_candidates_cover_the_legal_grid_and_start_with_the_fallback(head_dim, arch):
    base = Spec(head_dim, mask="causal", dtype="bf16")
    limits = DeviceLimits.preset(arch)
    found = candidates(base, limits)
    assert found[0] == fallback_spec(base, arch)
    assert len(set(found)) == len(found)
    if arch == "sm_90":   # one more: the sm90 family's forward, the fallback's tiles for the backward
        assert found[-1] == found[0].replace(arch_family="sm90")
        found = found[:-1]
    assert {s.base_name for s in found} == {base.base_name}
    legal = set()
    for tiles in autotune.DEFAULT_GRID.combinations():
        try:
            legal.add(base.replace(**tiles))
        except ValueError:
            pass
    assert legal and set(found) == legal | {found[0]}


def test_on_compute_capability_9_0_the_tuner_chooses_the_kernel_family_too(cache):
    base = Spec(128, mask="causal", dtype="bf16")
    hopper = fallback_spec(base, "sm_90").replace(arch_family="sm90")
    result = fake_tune(base, timer=lambda spec: 0.5 if spec == hopper else 1.0)
    assert result.winner == hopper and result.entry.tiles["arch_family"] == "sm90"
    tuned = lookup(base, **SHAPE, identity=FAKE_GPU)
    assert tuned == hopper
    # A call takes it by default on a 9.0 GPU; FAGEN_ARCH_FAMILY=sm80 still forces the sm80 family.
    assert chosen_family(tuned, "", (9, 0)) == "sm90" and chosen_family(tuned, "sm80", (9, 0)) == "sm80"
    # Where the family does not take the spec (FlashAttention-1), or off Hopper, no such candidate.
    assert all(s.arch_family == "sm80" for s in candidates(base.replace(version=1), SM90))
    assert all(s.arch_family == "sm80" for s in candidates(base, DeviceLimits.preset("sm_80")))
    # An sm80 winner's entry reads as before: no family in its tiles.
    assert "arch_family" not in fake_tune(Spec(64), timer=lambda spec: 1.0).entry.tiles


def test_static_pruning_checks_the_devices_shared_memory():
    base = Spec(128, mask="causal")
    small = DeviceLimits.preset("sm_89")
    found = candidates(base, small)
    kept, pruned = prune(found, small)
    limit = small.shared_per_block_optin
    assert kept and pruned and len(kept) + len(pruned) == len(found)
    assert all(s.shared_layout.total_bytes <= limit for s in kept)
    for spec, reason in pruned:
        assert spec.shared_layout.total_bytes > limit
        assert f"{spec.shared_layout.total_bytes} B of shared memory" in reason and str(limit) in reason
    # The same candidates all fit Hopper's larger shared memory.
    assert prune(found, SM90)[1] == []


def test_static_pruning_checks_threads_per_block():
    limits = DeviceLimits("sm_90", 232448, 65536, max_threads_per_block=128)
    grid = TileGrid(block_m=(128,), block_n=(32, 64), num_warps=(4, 8), num_stages=(1,))
    kept, pruned = prune(candidates(Spec(64), SM90, grid), limits)
    assert kept and pruned
    threads = {s: kernel_entries(s).forward.threads for s in kept + [s for s, _ in pruned]}
    assert all(threads[s] <= 128 for s in kept)
    # The sm80 family's 8 warps, and the sm90 family's 3 warpgroups (its candidate on sm_90).
    assert all(threads[s] > 128 and f"{threads[s]} threads per block" in r for s, r in pruned)
    assert {threads[s] for s, _ in pruned} == {256, 384}


def test_pruning_by_the_resource_report():
    a, b, c, d, e = (Spec(64, block_m=128, block_n=n, num_warps=w, num_stages=1)
                     for n, w in ((32, 4), (64, 4), (32, 8), (64, 8), (16, 4)))
    limits = DeviceLimits("sm_80", shared_per_block_optin=66000, registers_per_block=32768,
                          max_threads_per_block=1024)
    resources = {
        a: report(a, registers=128),                          # 128 threads x 128 = 16384: fine
        b: report(b, spills=6),                               # spills 12 B
        c: report(c, registers=160),                          # 256 threads x 160 = 40960 > 32768
        d: report(d, registers=64, static_shared=30000),      # dynamic + static > 66000
    }                                                         # e: no report (kept)
    assert d.shared_layout.total_bytes + 30000 > 66000 >= d.shared_layout.total_bytes
    kept, pruned = prune([a, b, c, d, e], limits, resources)
    reasons = dict(pruned)
    assert kept == [a, e]
    assert "spills 12 B (stores 6, loads 6)" in reasons[b]
    assert "160 registers x 256 threads = 40960" in reasons[c] and "32768" in reasons[c]
    assert "30000 B static" in reasons[d] and "66000" in reasons[d]


def test_pruning_agrees_with_real_nvrtc_reports(cache):
    base = Spec(64, mask="causal")
    specs = [fallback_spec(base, "sm_90"), base.replace(block_m=256, block_n=128, num_warps=4, num_stages=1)]
    resources, failed = compile_all(specs, lambda s: nvrtc_resources(s, "sm_90"))
    assert failed == [] and set(resources) == set(specs)
    kept, pruned = prune(specs, SM90, resources)
    for spec in specs:
        forward = resources[spec][kernel_entries(spec).forward.name]   # prune reads the right kernel
        assert (spec in kept) == (forward.spill_bytes == 0 and forward.registers * spec.threads <= 65536)
    assert all(" spills " in reason for _, reason in pruned)


def test_compile_all_reports_failures_in_order(capsys):
    specs = [Spec(64, block_m=128, block_n=n, num_warps=4, num_stages=1) for n in (32, 64, 128)]

    def compile_one(spec):
        if spec.block_n != 64:
            raise CompileError(f"\nNVRTC compile for sm_90 failed: error in {spec.name}\nmore log")
        return report(spec)

    import io
    stream = io.StringIO()
    progress = ProgressLine("compiling", len(specs), stream=stream)
    resources, failed = compile_all(specs, compile_one, workers=2, progress=progress)
    progress.close()
    assert list(resources) == [specs[1]]
    assert [s for s, _ in failed] == [specs[0], specs[2]]
    assert failed[0][1] == f"does not compile: NVRTC compile for sm_90 failed: error in {specs[0].name}"
    assert "3/3" in stream.getvalue()


# -- the output check --------------------------------------------------------

@pytest.mark.parametrize("fields", [{"mask": "causal"}, {"key_padding": True, "dtype": "bf16"},
                                    {"mask": "causal", "version": 1}])
def test_reference_check_applies_the_flash_attention_2_rule(fields):
    spec = Spec(64, **fields)
    check = ReferenceCheck(spec, seqlen_q=300, seqlen_k=300, device="cpu", runner=rounded_reference_runner())
    assert check.baseline_error > 0
    assert check.tolerance == 2 * check.baseline_error + 1e-5
    verdict = check(spec)
    assert verdict.ok and verdict.error <= check.tolerance

    def same_dtype_torch(spec, q, k, v, *, softmax_scale, seqlens_k, **_):
        return attention_same_dtype(q, k, v, torch.ones_like(q), softmax_scale=softmax_scale,
                                    causal=spec.causal, seqlens_k=seqlens_k)[0]
    check.runner = same_dtype_torch            # exactly the baseline: within 2x of itself
    assert check(spec).ok

    def off_by_three_baselines(spec, q, k, v, **kwargs):
        return (check.reference + 3 * check.baseline_error + 1e-4).to(q.dtype)
    check.runner = off_by_three_baselines
    verdict = check(spec)
    assert not verdict.ok and verdict.error > verdict.tolerance and "wrong output" in verdict.reason

    def nan_in_one_row(spec, q, k, v, **kwargs):
        out = check.reference.to(q.dtype).clone()
        out[0, -1, 0, 0] = float("nan")
        return out
    check.runner = nan_in_one_row
    assert not check(spec).ok


def test_reference_check_of_a_dropout_spec_uses_the_kernels_mask():
    spec = Spec(64, dropout=True)
    seen = {}

    def kernel_like(spec, q, k, v, *, softmax_scale, seqlens_k, dropout_p, seed, philox_offset):
        # What the kernel does: Philox keyed by the seed and offset it is handed.
        b, nq, h, _ = q.shape
        keep = dropout_keep_mask(seed, philox_offset, b, h, nq, k.shape[1], dropout_p)
        seen["p"] = dropout_p
        out, _ = attention_forward(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep)
        return out.to(q.dtype)

    check = ReferenceCheck(spec, seqlen_q=128, seqlen_k=128, device="cpu", runner=kernel_like)
    assert check(spec).ok and seen["p"] == CHECK_DROPOUT_P

    def ignores_dropout(spec, q, k, v, *, softmax_scale, **_):
        return attention_forward(q, k, v, softmax_scale=softmax_scale)[0].to(q.dtype)
    check.runner = ignores_dropout
    assert not check(spec).ok


def test_tune_end_to_end_on_the_cpu_emulator(cache):
    """Real NVRTC reports, the real kernels checked through the SIMT emulator; only the timer
    is fake (timing needs a GPU)."""
    base = Spec(32, mask="causal")
    grid = TileGrid(block_m=(64,), block_n=(32,), num_warps=(4,), num_stages=(1,))
    check = ReferenceCheck(base, seqlen_q=40, device="cpu")
    result = tune(base, seqlen_q=40, batch=1, heads=2, device="cpu", grid=grid, limits=SM90,
                  identity=FAKE_GPU, check=check, timer=lambda spec: spec.block_m, verbose=False)
    assert result.rejected == [] and result.pruned == []
    small = base.replace(block_m=64, block_n=32, num_warps=4, num_stages=1)
    assert [s for s, _ in result.timings] == [small, fallback_spec(base, "sm_90")]   # both checked, both timed
    assert lookup(base, seqlen_q=40, batch=1, heads=2, identity=FAKE_GPU) == result.winner


# -- selection -----------------------------------------------------------------

def test_a_wrong_candidate_never_wins_however_fast(cache):
    base = Spec(64, mask="causal")
    found = candidates(base, SM90, SMALL_GRID)
    wrong = found[-1]
    times = {spec: 10.0 - i for i, spec in enumerate(found)}   # later candidates are faster
    times[wrong] = 0.001
    timed = []

    def timer(spec):
        timed.append(spec)
        return times[spec]

    check = ReferenceCheck(base, seqlen_q=SHAPE["seqlen_q"], device="cpu",
                           runner=rounded_reference_runner(wrong={wrong}))
    result = fake_tune(base, check=check, timer=timer)
    assert wrong not in timed
    assert result.winner != wrong and result.winner == min((s for s in found if s != wrong), key=times.get)
    assert [s for s, _ in result.rejected] == [wrong] and "wrong output" in result.rejected[0][1]
    assert lookup(base, **SHAPE, identity=FAKE_GPU) == result.winner


def test_selection_takes_the_fastest_and_drops_candidates_that_fail_to_run(cache):
    base = Spec(128)
    found = candidates(base, SM90, SMALL_GRID)
    crashing, nan_timed, fastest = found[1], found[2], found[3]

    def timer(spec):
        if spec == crashing:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        if spec == nan_timed:
            return math.nan
        return 0.5 if spec == fastest else 1.0 + spec.block_n / 1000

    result = fake_tune(base, timer=timer)
    assert result.winner == fastest
    assert [ms for _, ms in result.timings] == sorted(ms for _, ms in result.timings)
    reasons = dict(result.rejected)
    assert "CUDA_ERROR_LAUNCH_FAILED" in reasons[crashing] and "nan" in reasons[nan_timed]
    assert result.entry.median_ms == 0.5
    assert result.entry.fallback_ms == pytest.approx(1.0 + found[0].block_n / 1000)


def test_ties_go_to_the_fallback(cache):
    base = Spec(64)
    result = fake_tune(base, timer=lambda spec: 1.0)
    assert result.winner == fallback_spec(base, "sm_90")


def test_no_surviving_candidate_raises_and_caches_nothing(cache):
    with pytest.raises(TuningError, match="no candidate of fa2_d64_fp16 survived"):
        fake_tune(Spec(64), check=lambda spec: False, timer=lambda spec: 1.0)
    assert not cache.exists() or not list(cache.iterdir())


def test_tuning_without_a_gpu_needs_injected_parts():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tune(Spec(64), seqlen_q=1024, device="cpu")


def test_rotation_covers_twice_the_l2_within_memory():
    mib = 2**20
    assert rotation_sets(set_bytes=10 * mib, l2_bytes=50 * mib, free_bytes=80 * 1024 * mib) == 10
    assert rotation_sets(set_bytes=300 * mib, l2_bytes=50 * mib, free_bytes=80 * 1024 * mib) == 2
    assert rotation_sets(set_bytes=1 * mib, l2_bytes=50 * mib, free_bytes=40 * mib) == 20
    for set_mib, l2_mib in itertools.product((0.01, 1, 7, 64, 900), (6, 40, 60)):
        sets = rotation_sets(int(set_mib * mib), l2_mib * mib, 80 * 1024 * mib)
        assert sets >= 2 and sets * set_mib >= 2 * l2_mib


# -- the cache -----------------------------------------------------------------

def test_shape_buckets_round_up_to_powers_of_two():
    bucket = ShapeBucket.of(seqlen_q=1000, seqlen_k=1025, batch=3, heads=12)
    assert (bucket.seqlen_q, bucket.seqlen_k, bucket.batch_heads) == (1024, 2048, 64)
    assert bucket.label == "q1024_k2048_bh64"
    assert ShapeBucket.of(seqlen_q=1024) == ShapeBucket.of(seqlen_q=513, seqlen_k=1024)
    assert ShapeBucket.of(seqlen_q=1).seqlen_q == 16
    with pytest.raises(ValueError):
        ShapeBucket.of(seqlen_q=0)


def test_cache_file_holds_the_key_and_the_winner(cache):
    base = Spec(64, mask="causal", dtype="bf16")
    result = fake_tune(base, timer=lambda spec: 1.0 / spec.block_m)
    (path,) = cache.glob("*.json")
    assert path.name == f"fa2_d64_causal_bf16.q4096_k4096_bh16.{FAKE_GPU.digest}.json"
    data = json.loads(path.read_text())
    assert data["key"] == {"gpu": FAKE_GPU.name, "arch": "sm_90", "driver": FAKE_GPU.driver,
                           "nvrtc": FAKE_GPU.nvrtc, "family": base.base_name,
                           "bucket": {"seqlen_q": 4096, "seqlen_k": 4096, "batch_heads": 16}}
    assert data["tiles"] == result.winner.tiles and result.winner.block_m == 128
    assert data["shape"] == {"batch": 2, "heads": 8, "seqlen_q": 3000, "seqlen_k": 3000}
    assert TuneEntry.from_json(data).spec(base) == result.winner


def test_lookup_matches_gpu_toolchain_spec_and_bucket(cache):
    base = Spec(64, mask="causal")
    winner = fake_tune(base, timer=lambda spec: spec.block_m * spec.block_n + spec.num_stages).winner
    assert winner != fallback_spec(base, "sm_90")
    assert lookup(base, seqlen_q=4096, batch=1, heads=16, identity=FAKE_GPU) == winner   # same bucket
    for other in (dataclasses.replace(FAKE_GPU, driver="560.1"), dataclasses.replace(FAKE_GPU, nvrtc="13.0"),
                  dataclasses.replace(FAKE_GPU, name="Other GPU")):
        assert lookup(base, **SHAPE, identity=other) == fallback_spec(base, "sm_90")
    assert lookup(Spec(64), **SHAPE, identity=FAKE_GPU) == fallback_spec(Spec(64), "sm_90")
    # An untuned bucket takes the nearest tuned one of the same GPU and spec.
    assert lookup(base, seqlen_q=65536, batch=1, heads=1, identity=FAKE_GPU) == winner


def test_lookup_prefers_the_nearest_tuned_bucket(cache):
    base = Spec(64)
    short = fake_tune(base, timer=lambda s: 1.0 / s.block_n, shape={"seqlen_q": 512}).winner
    long = fake_tune(base, timer=lambda s: 1.0 * s.block_n, shape={"seqlen_q": 32768}).winner
    assert short != long
    assert lookup(base, seqlen_q=1024, identity=FAKE_GPU) == short
    assert lookup(base, seqlen_q=16384, identity=FAKE_GPU) == long


def test_lookup_on_cpu_is_the_sm80_fallback(cache):
    for spec in (Spec(64), Spec(128, dtype="bf16", mask="causal"), Spec(256, version=1)):
        assert lookup(spec, seqlen_q=128, device="cpu").tiles == fallback_tiles(spec.head_dim, spec.version)
        assert lookup(spec, seqlen_q=128, device=torch.device("cpu")) == fallback_spec(spec, "sm_80")


def test_lookup_reads_the_directory_once(cache, monkeypatch):
    base = Spec(64)
    winner = fake_tune(base, timer=lambda spec: 1.0 / spec.block_n).winner
    autotune.reload_cache()
    reads = []
    real_read = tune_cache.read_entry
    monkeypatch.setattr(tune_cache, "read_entry", lambda path: reads.append(path) or real_read(path))
    for seqlen in range(1000, 1200):
        assert lookup(base, seqlen_q=seqlen, identity=FAKE_GPU) == winner
    assert len(reads) == 1


def test_corrupt_entry_is_ignored_with_a_warning_and_rewritten(cache):
    base = Spec(64, mask="causal")
    timer = lambda spec: 1.0 / spec.block_m   # noqa: E731
    winner = fake_tune(base, timer=timer).winner
    (path,) = cache.glob("*.json")
    good = json.loads(path.read_text())
    illegal_tiles = {**good, "tiles": {**good["tiles"], "block_n": 24}}
    for corrupt in ("{not json", json.dumps(illegal_tiles), json.dumps({"format": 1})):
        path.write_text(corrupt)
        autotune.reload_cache()
        with pytest.warns(UserWarning, match="ignoring corrupt fagen tuning cache entry"):
            assert lookup(base, **SHAPE, identity=FAKE_GPU) == fallback_spec(base, "sm_90")
    assert fake_tune(base, timer=timer).winner == winner
    assert json.loads(path.read_text()) | {"tuned_at": None} == good | {"tuned_at": None}
    autotune.reload_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup(base, **SHAPE, identity=FAKE_GPU) == winner


def _store_in_child(cache_dir, barrier, identity_name, block_n):
    import os

    os.environ["FAGEN_CACHE_DIR"] = cache_dir
    from fagen.tuning import cache as child_cache
    from fagen.tuning.device import DeviceIdentity as ChildIdentity

    def entry(name, seqlen):
        return child_cache.TuneEntry(
            identity=ChildIdentity(name, "sm_90", "555.42.06", "12.9"), base_name="fa2_d64_fp16",
            bucket=child_cache.ShapeBucket.of(seqlen_q=seqlen), median_ms=1.0,
            tiles={"block_m": 128, "block_n": block_n, "num_warps": 4, "num_stages": 2})

    barrier.wait()
    for _ in range(20):   # many rounds, so the two writers overlap
        child_cache.INDEX.store(entry("Shared GPU", 1024))
        child_cache.INDEX.store(entry(identity_name, 2048))


def test_concurrent_writers_both_succeed(cache):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_store_in_child, args=(str(cache.parent), barrier, name, block_n))
             for name, block_n in (("GPU A", 32), ("GPU B", 64))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert sorted(path.suffix for path in cache.iterdir()) == [".json"] * 3   # no temp files left
    autotune.reload_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # every file whole: none reads as corrupt
        entries = tune_cache.INDEX.all_entries()
    by_gpu = {e.identity.name: e.tiles["block_n"] for e in entries}
    assert by_gpu["GPU A"] == 32 and by_gpu["GPU B"] == 64 and by_gpu["Shared GPU"] in (32, 64)


def test_show_and_clear(cache):
    assert autotune.show_cache().startswith("no tunings in")
    fake_tune(Spec(64, mask="causal"), timer=lambda spec: 1.0)
    fake_tune(Spec(128), timer=lambda spec: 1.0, shape={"seqlen_q": 512})
    shown = autotune.show_cache()
    assert "fa2_d64_causal_fp16" in shown and "q4096_k4096_bh16" in shown
    assert "fa2_d128_fp16" in shown and "q512_k512_bh16" in shown and FAKE_GPU.key in shown
    (cache / "stray.json.123.tmp").write_text("half a file")
    assert autotune.clear_cache() == 3
    assert list(cache.iterdir()) == []
    assert autotune.show_cache().startswith("no tunings in")
    assert lookup(Spec(128), seqlen_q=512, identity=FAKE_GPU) == fallback_spec(Spec(128), "sm_90")


# -- the fallback table ----------------------------------------------------------

def test_fallback_tiles_fit_every_arch_and_head_dim():
    """Forward and backward: an untuned spec trains on every arch fagen lists."""
    for arch, version, head_dim in itertools.product(ARCH_CLASSES, (1, 2), range(8, 513, 8)):
        if version == 1 and head_dim > 256:   # FlashAttention-1 stops at 256
            continue
        for deterministic in (False, True):
            spec = fallback_spec(Spec(head_dim, version=version, deterministic=deterministic), arch)
            assert spec.shared_layout.total_bytes <= smem_limit(arch), (arch, spec.name)
            spec.check_arch(arch)   # the backward kernels too


def test_fallback_shortens_the_backward_pipeline_only_where_it_must():
    assert fallback_spec(Spec(128), "sm_86").bwd_stages == 1
    assert fallback_spec(Spec(128), "sm_86").bwd_block_n == 64   # 128 keys fit no pipeline in 99 KB
    assert fallback_spec(Spec(128), "sm_89").name == "fa2_d128_fp16_m128n32w8s2_bwd1_bwdn64"
    for arch in ("sm_80", "sm_90"):
        assert fallback_spec(Spec(128), arch).bwd_stages == Spec(128).bwd_stages == 2
        assert fallback_spec(Spec(128), arch).bwd_block_n == Spec(128).bwd_block_n == 128
    assert fallback_spec(Spec(64), "sm_86").bwd_stages == 2
    # An unlisted arch is fitted by the shared memory its device reports.
    assert fallback_spec(Spec(128), "sm_121", shared_per_block_optin=101376).bwd_stages == 1


def test_tuned_entries_and_candidates_get_a_backward_that_fits(cache):
    found = candidates(Spec(128), DeviceLimits.preset("sm_86"))
    assert found and all(spec.bwd_stages == 1 for spec in found)
    assert len({tuple(sorted(spec.tiles.items())) for spec in found}) == len(found)  # no tiles twice
    identity = DeviceIdentity(name="GeForce test", arch="sm_89", driver="1", nvrtc="12.9")
    base = Spec(128, mask="causal")
    bucket = ShapeBucket.of(seqlen_q=1024)
    entry = TuneEntry(identity=identity, base_name=base.base_name, bucket=bucket,
                      tiles={"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
                      median_ms=1.0, fallback_ms=2.0)
    tune_cache.INDEX.store(entry)
    spec = lookup(base, seqlen_q=1024, identity=identity)
    assert spec.tiles == entry.tiles and spec.bwd_stages == 1
    spec.check_arch("sm_89")


def test_fallback_table_entries_are_used_as_written():
    """No override is silently replaced by the base: each one is legal for its whole bucket."""
    archs_of = {}
    for arch, arch_class_ in ARCH_CLASSES.items():
        archs_of.setdefault(arch_class_, []).append(arch)
    for (arch_class_, bucket), overrides in FALLBACK_OVERRIDES.items():
        for arch, version in itertools.product(archs_of[arch_class_], (1, 2)):
            for head_dim in (d for d in range(8, 513, 8) if head_dim_bucket(d) == bucket):
                if version == 1 and head_dim > 256:
                    continue
                spec = fallback_spec(Spec(head_dim, version=version), arch)
                assert spec.tiles == {**default_tiles(head_dim, version), **overrides}, (arch, spec.name)


def test_fallback_is_the_base_on_sm80_and_places_unknown_archs_by_shared_memory():
    for head_dim, version in itertools.product(range(8, 513, 8), (1, 2)):
        assert fallback_tiles(head_dim, version, "sm_80") == default_tiles(head_dim, version)
    assert arch_class("sm_75", 65536) == SMEM_99K
    assert arch_class("sm_107", 232448) == SMEM_227K   # NVRTC 13 knows sm_107; the guide gives no limit
    assert arch_class("sm_130", 166912) == SMEM_163K
    assert arch_class("sm_88") == SMEM_99K and arch_class("sm_103") == SMEM_227K   # listed archs
    assert arch_class("sm_100a") == arch_class("sm_100f") == SMEM_227K          # arch-specific forms


# -- fagen tune ----------------------------------------------------------------

def tune_args(*argv):
    parser = argparse.ArgumentParser(prog="fagen")
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["tune", *argv])


def test_tune_flags_parse():
    args = tune_args("--d", "64", "--causal", "--key-padding", "--dropout", "--version", "1",
                     "--dtype", "fp16", "bf16", "--seqlen", "1024", "4096", "--batch", "2", "--heads", "8")
    assert (args.head_dim, args.causal, args.key_padding, args.dropout) == (64, True, True, True)
    assert args.version == 1
    assert (args.dtype, args.seqlen, args.batch, args.heads) == (["fp16", "bf16"], [1024, 4096], 2, 8)
    assert args.func is cmd_tune and not args.show and not args.clear


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_tune_without_a_gpu_exits_2_with_a_message(cache, capsys):
    assert cmd_tune(tune_args("--d", "64", "--causal")) == 2
    err = capsys.readouterr().err
    assert "GPU" in err and "--show" in err
    assert not cache.exists()


@pytest.mark.parametrize("flags", [("--softcap",), ("--window", "8", "0", "--alibi")])
def test_tune_refuses_variant_flags_before_anything_runs(cache, capsys, monkeypatch, flags):
    """Its oracle check has no variant values: a variant is exit 2 with a message, on a GPU too
    (where the tuner would otherwise fail on the variant's missing run-time arguments)."""
    import fagen.tuning.tuner as tuner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: pytest.fail("tuned a variant"))
    assert cmd_tune(tune_args("--d", "64", *flags)) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in flags if flag.startswith("--")) and "fallback tile table" in err
    assert not cache.exists()


def test_tune_show_and_clear_work_without_a_gpu(cache, capsys):
    assert cmd_tune(tune_args()) == 2 and "--d" in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiple of 8"):   # `fagen` turns it into exit 2
        cmd_tune(tune_args("--d", "7"))
    fake_tune(Spec(64, mask="causal"), timer=lambda spec: 1.0)
    assert cmd_tune(tune_args("--show")) == 0
    assert "fa2_d64_causal_fp16" in capsys.readouterr().out
    assert cmd_tune(tune_args("--clear")) == 0
    assert "removed 1 file(s)" in capsys.readouterr().out
    assert cmd_tune(tune_args("--show")) == 0
    assert "no tunings" in capsys.readouterr().out


# -- on a GPU ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tune_for_real_on_the_gpu(cache):
    base = Spec(64, mask="causal")
    grid = TileGrid(block_m=(64, 128), block_n=(64,), num_warps=(4,), num_stages=(2,))
    result = tune(base, seqlen_q=1024, batch=2, heads=8, grid=grid, verbose=False)
    assert result.timings and all(ms > 0 for _, ms in result.timings)
    assert result.winner in {s for s, _ in result.timings}
    check = ReferenceCheck(base, seqlen_q=1024, seqlen_k=1024, device="cuda")
    assert check(result.winner).ok
    assert lookup(base, seqlen_q=1024, batch=2, heads=8, device="cuda") == result.winner
    assert list(cache.glob("*.json"))


def test_a_gpu_whose_arch_the_table_lacks_is_fitted_by_its_driver_limit(cache, monkeypatch):
    from fagen.tuning import tuner

    identity = DeviceIdentity(name="future part", arch="sm_130", driver="1", nvrtc="13.5")
    monkeypatch.setattr(tuner, "_is_cuda", lambda device: True)
    monkeypatch.setattr(DeviceIdentity, "from_device", classmethod(lambda cls, device: identity))
    monkeypatch.setattr(tuner, "_device_shared_limit", lambda index: 101376)
    monkeypatch.setattr(tuner, "cuda_index", lambda device: 0)
    spec = lookup(Spec(128), seqlen_q=1024, device="cuda")
    assert spec.bwd_stages == 1 and spec.backward_shared_bytes <= 101376
    spec.check_arch("sm_130", shared_limit=101376)
