"""sm_90a, the Hopper family's arch-specific target: NVRTC compiles for it without a GPU, the cache
and the resource report keep it apart from sm_90, and a build whose wgmma pipeline ptxas
serialises (C7510-C7520) fails instead of shipping a slow kernel."""

import pytest

from fagen.kernels import compile as compiler
from fagen.kernels.compile import CompileError, compile_source, nvrtc_target, parse_archs, wgmma_serialisation
from fagen.kernels.render import render
from fagen.spec import Spec

# One warpgroup, two m64n8k16 wgmmas in one pipeline stage (A and B from shared memory, no
# swizzle), then commit and wait. IN_STAGE goes between the two wgmmas, BEFORE_WAIT between the
# commit and the wait: code there that touches the accumulators d0..d3 makes ptxas serialise.
WGMMA_KERNEL = r'''
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned long long smem_desc(const void* p) {
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (8ull << 32);
}
#define WGMMA(da, db) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(da), "l"(db), "r"(1))
extern "C" __global__ void wgmma_probe(float* out) {
  __shared__ __align__(128) __half a[64 * 32];
  __shared__ __align__(128) __half b[8 * 32];
  for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) a[i] = __float2half(1.0f);
  for (int i = threadIdx.x; i < 8 * 32; i += blockDim.x) b[i] = __float2half(1.0f);
  __syncthreads();
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  WGMMA(smem_desc(a), smem_desc(b));
  IN_STAGE
  WGMMA(smem_desc(a + 64 * 16), smem_desc(b + 8 * 16));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  BEFORE_WAIT
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) :: "memory");
  float* o = out + 4 * threadIdx.x;
  o[0] = d0; o[1] = d1; o[2] = d2; o[3] = d3;
}
'''


def wgmma_kernel(in_stage: str = "", before_wait: str = "") -> str:
    return WGMMA_KERNEL.replace("IN_STAGE", in_stage).replace("BEFORE_WAIT", before_wait)


def test_an_mma_sync_spec_compiles_for_sm_90a_apart_from_sm_90(cache):
    source = render(Spec(64, mask="causal"))
    hopper, plain = compile_source(source, "sm_90a"), compile_source(source, "sm_90")
    assert "for 'sm_90a'" in hopper.log and "for 'sm_90'" in plain.log
    report = hopper.resources[f"{source.spec.name}_fwd"]
    assert report.arch == "sm_90a" and report.registers > 0 and report.spill_bytes == 0
    assert hopper.cubins[0][:4] == b"\x7fELF" and hopper.cubins != plain.cubins
    assert compiler.cache_key(source.hash, "sm_90a") != compiler.cache_key(source.hash, "sm_90")
    assert len(list((cache / "cubin").glob("*.json"))) == 4   # two archs' forward and backward units
    assert wgmma_serialisation(hopper.log) == []   # no wgmma in the mma.sync family


def test_a_clean_wgmma_kernel_compiles_for_sm_90a_and_plain_sm_90_refuses_it(cache):
    kernel = compile_source(wgmma_kernel(), "sm_90a")
    assert kernel.cubins[0][:4] == b"\x7fELF" and kernel.resources["wgmma_probe"].registers > 0
    assert "C75" not in kernel.log and wgmma_serialisation(kernel.log) == []
    with pytest.raises(CompileError, match="wgmma.mma_async.*not supported on .target 'sm_90'"):
        compile_source(wgmma_kernel(), "sm_90")


@pytest.mark.parametrize("in_stage, before_wait, code", [
    ("out[threadIdx.x] = d0;", "", "C7514"),   # reads an accumulator inside the pipeline stage
    ("d0 += 1.0f;", "", "C7511"),              # writes one there
    ("", "out[threadIdx.x] = d1;", "C7517"),   # reads one after the commit, before the wait
])
def test_a_serialised_wgmma_pipeline_fails_the_build(cache, in_stage, before_wait, code):
    with pytest.raises(CompileError) as caught:
        compile_source(wgmma_kernel(in_stage, before_wait), "sm_90a")
    message = str(caught.value)
    assert "wgmma pipeline of wgmma_probe" in message and "one at a time" in message
    quoted = [line for line in message.splitlines() if f"({code})" in line]
    assert quoted and quoted[0].strip().startswith("ptxas info") and "'wgmma_probe'" in quoted[0]
    assert not (cache / "cubin").exists() or not list((cache / "cubin").glob("*.json"))  # nothing cached


def test_wgmma_serialisation_reads_only_the_pipeline_lines():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to the presence of Extern calls in the function 'k'\n"
           "ptxas info    : (C7509) some other note\n"
           "ptxas info    : Used 90 registers, used 1 barriers, 2304 bytes smem\n")
    (line,) = wgmma_serialisation(log)
    assert line.startswith("ptxas info    : (C7515)")
    with pytest.raises(CompileError, match=r"pipeline of k \(fa2_x, sm_90a\)[^\n]*\n  ptxas info    : \(C7515\)"):
        compiler.check_wgmma_pipeline(log, "fa2_x", "sm_90a")
    compiler.check_wgmma_pipeline(log.replace("(C7515)", "(C7509)").replace("wgmma", "x"), "fa2_x", "sm_90a")


@pytest.mark.parametrize("device_arch, supported, arch_specific, target", [
    ("sm_90", (80, 86, 89, 90, 100), False, "sm_90"),    # the mma.sync family's target on Hopper
    ("sm_90", (80, 86, 89, 90, 100), True, "sm_90a"),    # the Hopper family asks for wgmma's target
    ("sm_100", (80, 90, 100), True, "sm_100a"),
])
def test_the_arch_specific_target_is_the_devices_own(device_arch, supported, arch_specific, target):
    assert nvrtc_target(device_arch, supported, arch_specific=arch_specific) == target
    assert nvrtc_target(device_arch, supported) == device_arch  # the default never changes


def test_an_arch_specific_target_has_no_fallback():
    with pytest.raises(ValueError, match="sm_89 has no arch-specific target"):
        nvrtc_target("sm_89", (80, 86, 89, 90), arch_specific=True)
    with pytest.raises(CompileError, match="cannot compile for sm_100a"):
        nvrtc_target("sm_100", (80, 90), arch_specific=True)   # no sm_90a or PTX stand-in
    assert "arch-specific" in compiler.describe_target("sm_90", "sm_90a")


def test_sm_90a_is_accepted_wherever_archs_are_parsed(monkeypatch):
    assert parse_archs("sm_80, sm_90a") == ["sm_80", "sm_90a"]
    monkeypatch.setattr(compiler, "gpu_arch", lambda: None)
    monkeypatch.setenv("FAGEN_ARCH", "sm_90a")
    assert compiler.default_archs() == ["sm_90a"]
