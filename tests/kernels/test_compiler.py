"""NVRTC compile without a GPU, the resource report, and the disk cache."""

import json
import multiprocessing
import warnings

import pytest

from fagen.kernels import compile as compiler
from fagen.kernels.render import render
from fagen.kernels.compile import compile_source, parse_archs, parse_ptxas_log
from fagen.spec import Spec

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'alpha' for 'sm_80'
ptxas info    : Function properties for alpha
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'beta' for 'sm_80'
ptxas info    : Function properties for beta
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 368 bytes cmem[0]
"""


def test_parse_ptxas_log():
    reports = parse_ptxas_log(PTXAS_LOG, "sm_80")
    alpha, beta = reports["alpha"], reports["beta"]
    assert (alpha.registers, alpha.spill_store_bytes, alpha.spill_load_bytes) == (255, 8, 4)
    assert (alpha.stack_bytes, alpha.static_shared_bytes, alpha.barriers) == (16, 2048, 1)
    assert alpha.spill_bytes == 12
    assert (beta.registers, beta.spill_bytes, beta.static_shared_bytes) == (40, 0, 0)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_a_gpu(cache, arch):
    spec = Spec(64, mask="causal")
    kernel = compile_source(render(spec), arch)
    assert [cubin[:4] for cubin in kernel.cubins] == [b"\x7fELF"] * 2   # the forward's unit, the backward's
    report = kernel.resources[f"{spec.name}_fwd"]
    assert report.arch == arch and report.registers > 0 and report.spill_bytes == 0


def test_compile_error_carries_the_log(cache):
    with pytest.raises(compiler.CompileError, match="undefined_thing"):
        compile_source('extern "C" __global__ void k() { undefined_thing(); }', "sm_80")


def test_memory_then_disk_cache(cache):
    source = render(Spec(32))
    first = compile_source(source, "sm_80")
    assert first.cache == "miss"
    assert compile_source(source, "sm_80").cache == "memory"
    compiler.clear_memory_cache()
    hit = compile_source(source, "sm_80")
    assert hit.cache == "disk" and hit.cubins == first.cubins and hit.resources == first.resources
    assert len(list((cache / "cubin").glob("*.json"))) == 2   # an entry per translation unit


def test_cache_key_covers_source_arch_and_nvrtc(cache):
    h = render(Spec(32)).hash
    keys = {compiler.cache_key(h, "sm_80"), compiler.cache_key(h, "sm_90"),
            compiler.cache_key(render(Spec(64)).hash, "sm_80")}
    assert len(keys) == 3


def test_corrupt_entry_is_ignored_and_rewritten(cache):
    source = render(Spec(32))
    compile_source(source, "sm_80")
    entry, _ = (cache / "cubin").glob("*.json")
    entry.write_text("{not json")
    compiler.clear_memory_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = compile_source(source, "sm_80")
    assert kernel.cache == "miss"
    assert any("corrupt fagen cache entry" in str(w.message) for w in caught)
    assert json.loads(entry.read_text())["arch"] == "sm_80"


def _build_in_child(cache_dir, barrier, queue):
    import os

    os.environ["FAGEN_CACHE_DIR"] = cache_dir
    from fagen.kernels import compile as child_compiler
    from fagen.kernels.render import render as child_render
    from fagen.spec import Spec as ChildSpec

    source = child_render(ChildSpec(64, dtype="bf16"))
    barrier.wait()
    kernel = child_compiler.compile_source(source, "sm_90")
    queue.put((kernel.cache, kernel.cubins))


def test_two_processes_building_one_variant_both_succeed(cache):
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(cache), barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][1] == results[1][1]
    entries = list((cache / "cubin").glob("*"))
    assert len(entries) == 2 and {e.suffix for e in entries} == {".json"}  # a unit's each; no temp files left behind
    compiler.clear_memory_cache()
    assert compile_source(render(Spec(64, dtype="bf16")), "sm_90").cache == "disk"


def test_arch_selection(monkeypatch):
    assert parse_archs("sm_80, sm_90") == ["sm_80", "sm_90"]
    with pytest.raises(ValueError, match="unknown arch 'sm_99'"):
        parse_archs("sm_99")
    monkeypatch.setenv("FAGEN_ARCH", "sm_86")
    import torch

    if not torch.cuda.is_available():
        assert compiler.default_archs() == ["sm_86"]
    monkeypatch.delenv("FAGEN_ARCH")
    if not torch.cuda.is_available():
        assert compiler.default_archs() == ["sm_80", "sm_90"]


def test_spec_too_big_for_arch_is_rejected_before_compiling(cache):
    spec = Spec(128, block_m=128, block_n=128, num_stages=2)
    with pytest.raises(ValueError, match="sm_80 allows at most"):
        compile_source(render(spec), "sm_80")
