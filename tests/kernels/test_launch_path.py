"""The host side of a launch: grid limits, streams, NVRTC buffers and options, archs and
NVRTC targets, file permissions. CPU only: CuPy and the driver are stood in for where needed."""

import os
import subprocess
import sys
import types

import pytest
import torch

from fagen import cache_files
from fagen.kernels import attention_kernels, compile as compiler, launch
from fagen.kernels.render import render
from fagen.arch import SMEM_LIMIT_BYTES, base_arch, smem_limit
from fagen.spec import Spec
from kernel_cases import DROPOUT_P, OFFSET, SEED, Shape, make_inputs

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


# -- 1. grid limits ------------------------------------------------------------------------------

def test_grid_chunks_cover_the_grid_once():
    chunks = list(launch.grid_chunks((3, 7, 5), limit=3))
    assert [c[1:] for c in chunks] == [(y, z) for z in (0, 3) for y in (0, 3, 6)]
    covered = {(y0 + y, z0 + z) for (x, ny, nz), y0, z0 in chunks for y in range(ny) for z in range(nz)}
    assert covered == {(y, z) for y in range(7) for z in range(5)} and len(covered) == 7 * 5
    assert all(x == 3 and ny <= 3 and nz <= 3 for (x, ny, nz), _, _ in chunks)
    assert list(launch.grid_chunks((4, 2, 1))) == [((4, 2, 1), 0, 0)]   # fits: one launch
    with pytest.raises(ValueError, match="gridDim.x limit of 2147483647"):
        list(launch.grid_chunks((2**31, 1, 1)))


def run_both_passes(spec, shape):
    q, k, v, dout, seqlens_k = make_inputs(spec, shape)
    source = render(spec)
    p = DROPOUT_P if spec.dropout else 0.0
    out, stats = attention_kernels.forward(source, q, k, v, seqlens_k=seqlens_k, dropout_p=p, seed=SEED,
                                           philox_offset=OFFSET)
    drop = attention_kernels.dropout_args(p, SEED, OFFSET) if spec.dropout else None
    grads = attention_kernels.backward(source, q, k, v, out, stats, dout, seqlens_k=seqlens_k, dropout_args=drop)
    return (out, *stats, *grads)


@pytest.mark.parametrize("spec", [Spec(32, mask="causal", key_padding=True, dropout=True),
                                  Spec(32, version=1, dropout=True, deterministic=True)],
                         ids=lambda spec: spec.name)
def test_chunked_launches_give_the_same_bits(spec, monkeypatch):
    """With gridDim.y / .z's limit lowered to 2, heads and batch go out in chunks: every
    output, the dropout mask (keyed on absolute batch and head) and the statistics match
    the one-launch run bit for bit."""
    shape = Shape(5, 40, 33, heads=3, kv_heads=1)
    whole = run_both_passes(spec, shape)
    monkeypatch.setattr(attention_kernels, "_plans", {})
    monkeypatch.setattr(launch, "GRID_YZ_LIMIT", 2)
    calls = []
    real_bind = launch.LoadedSource.bind

    def counting_bind(self, entry, grid, values, per_call=frozenset()):
        bound = real_bind(self, entry, grid, values, per_call)
        calls.append(len(bound.chunks))
        return bound

    monkeypatch.setattr(launch.LoadedSource, "bind", counting_bind)
    chunked = run_both_passes(spec, shape)
    assert calls and all(n == 3 * 2 for n in calls)   # ceil(5 / 2) batch x ceil(3 / 2) head chunks
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


# -- 3. NVRTC buffers and 5. options ---------------------------------------------------------------

def test_an_empty_nvrtc_log_leaves_bytes_singletons_alone():
    """A one-byte log buffer used to be CPython's shared b" ", which NVRTC's NUL overwrote."""
    script = (
        "from cuda.bindings import nvrtc\n"
        "from fagen.kernels import compile as compiler\n"
        "_, prog = nvrtc.nvrtcCreateProgram(b'extern \"C\" __global__ void k() {}', b'k.cu', 0, [], [])\n"
        "nvrtc.nvrtcCompileProgram(prog, 1, [b'-arch=sm_80'])\n"
        "assert nvrtc.nvrtcGetProgramLogSize(prog)[1] == 1\n"
        "assert compiler._program_log(prog) == ''\n"
        "assert bytes([32])[0] == 32 and b' '.join([b'a', b'b']) == b'a b', repr(bytes([32]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_lineinfo_is_on_and_in_the_cache_key(monkeypatch):
    assert "-lineinfo" in compiler.nvrtc_options("sm_90")
    key = compiler.cache_key("0" * 64, "sm_90")
    options = compiler.nvrtc_options
    monkeypatch.setattr(compiler, "nvrtc_options", lambda arch: [o for o in options(arch) if o != "-lineinfo"])
    assert compiler.cache_key("0" * 64, "sm_90") != key


# -- 4. streams ------------------------------------------------------------------------------------

class FakeDevice:
    """cupy.cuda.Device's stand-in: a context manager that does nothing."""

    def __init__(self, index):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeStream:
    def __init__(self, handle):
        self.handle = handle


def fake_cupy(modern: bool):
    made = []

    class Stream:
        @staticmethod
        def from_external(obj):
            made.append(("from_external", obj.__cuda_stream__()[1]))
            return FakeStream(obj.__cuda_stream__()[1])

    def external_stream(handle, device):
        made.append(("ExternalStream", handle))
        return FakeStream(handle)

    cuda = types.SimpleNamespace(Stream=Stream if modern else types.SimpleNamespace(), ExternalStream=external_stream,
                                 Device=FakeDevice, driver=types.SimpleNamespace(funcSetAttribute=lambda *a: None))
    return types.SimpleNamespace(cuda=cuda), made


@pytest.mark.parametrize("modern", [True, False], ids=["cupy14", "older-cupy"])
def test_streams_are_wrapped_once_and_the_cache_is_bounded(monkeypatch, modern):
    cupy, made = fake_cupy(modern)
    monkeypatch.setattr(launch, "_cupy", lambda: cupy)
    handles = iter(range(1000, 1300))
    current = {"handle": 7}
    monkeypatch.setattr(launch, "current_stream_handle", lambda index: current["handle"])
    launched = []
    function = launch._CudaFunction(lambda grid, block, args, shared_mem, stream: launched.append(stream.handle), 0)
    function((1, 1, 1), (32, 1, 1), ())
    function((1, 1, 1), (32, 1, 1), ())
    assert launched == [7, 7] and len(made) == 1   # one wrapper per stream, reused
    assert made[0][0] == ("from_external" if modern else "ExternalStream")
    for handle in handles:                        # many short-lived streams
        current["handle"] = handle
        function((1, 1, 1), (32, 1, 1), ())
    assert len(function.streams) == launch.MAX_STREAMS_PER_FUNCTION
    assert launched[-1] == 1299 and 1299 in function.streams and 1000 not in function.streams


# -- 8. archs and NVRTC targets ----------------------------------------------------------------------

def test_the_table_covers_every_arch_the_installed_nvrtc_accepts():
    missing = [f"sm_{a}" for a in compiler.supported_archs()
               if a >= compiler.MIN_COMPUTE_CAPABILITY and f"sm_{a}" not in SMEM_LIMIT_BYTES]
    assert set(missing) <= {"sm_107"}, missing   # sm_107: no published limit (see spec.py)
    for arch in ("sm_100", "sm_103", "sm_110", "sm_120", "sm_121", "sm_88"):
        assert arch in SMEM_LIMIT_BYTES
    assert smem_limit("sm_90a") == smem_limit("sm_90") and smem_limit("sm_100f") == smem_limit("sm_100")
    assert base_arch("compute_90") == "sm_90"
    with pytest.raises(ValueError, match="unknown arch 'sm_75'"):
        smem_limit("sm_75")


@pytest.mark.parametrize("device_arch, supported, target", [
    ("sm_90", (80, 86, 89, 90, 100), "sm_90"),        # known: its own cubin
    ("sm_121", (80, 86, 89, 90, 120), "sm_120"),      # newer minor: the same major's cubin runs
    ("sm_100", (80, 86, 89, 90), "compute_90"),       # newer major: PTX, compiled by the driver
    ("sm_110", (80, 90, 100, 101, 103, 120), "compute_103"),
])
def test_the_nvrtc_target_is_the_newest_arch_not_newer_than_the_device(device_arch, supported, target):
    assert compiler.nvrtc_target(device_arch, supported) == target


def test_gpus_older_than_sm80_are_refused_clearly():
    with pytest.raises(ValueError, match="compute capability 8.0 or newer"):
        compiler.nvrtc_target("sm_75", (75, 80, 90))


def test_a_ptx_target_compiles_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    compiled = compiler.compile_source(render(Spec(32)), "compute_90")
    assert len(compiled.cubins) == 2   # the forward's unit and the backward's
    for ptx in compiled.cubins:
        assert ptx.startswith(b"//") and ptx.endswith(b"\0")  # PTX text, NUL-terminated
        assert b".target sm_90" in ptx
    assert compiled.resources == {}


def test_an_arch_the_table_lacks_uses_the_driver_limit():
    spec = Spec(128)
    with pytest.raises(ValueError, match="unknown arch 'sm_130'"):
        spec.check_arch("sm_130")
    spec.check_arch("sm_130", shared_limit=SMEM_LIMIT_BYTES["sm_90"])
    with pytest.raises(ValueError, match="sm_130 allows at most 50000"):
        spec.check_arch("sm_130", shared_limit=50000)


# -- 14. file permissions --------------------------------------------------------------------------

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert cache_files.process_umask() == umask
        path = tmp_path / "sub" / "entry.json"
        cache_files.write_atomic(path, b"{}")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
    assert path.read_bytes() == b"{}"


# -- the CPU backend -------------------------------------------------------------------------------

def test_the_emulator_is_the_registered_cpu_backend(monkeypatch):
    """kernels.launch never imports fagen.emulate: the emulator registers itself (importing fagen
    does), and the launcher calls what it registered, counters included."""
    import fagen.emulate

    assert launch._load_emulator_module is fagen.emulate.load_module
    assert launch.counters_collected is fagen.emulate.instrumentation.collecting
    monkeypatch.delenv(launch.RACECHECK_ENV, raising=False)
    monkeypatch.delenv(launch.CHECKED_ENV, raising=False)
    assert launch.emulator_build() == "fast"
    with fagen.emulate.collect_counters():
        assert launch.counters_collected() and launch.emulator_build() == "instrumented"


def test_without_the_emulator_a_cpu_load_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(launch, "_load_emulator_module", launch._no_emulator)
    monkeypatch.setattr(launch, "_loaded", {})
    with pytest.raises(RuntimeError, match="fagen.emulate"):
        launch.load(render(Spec(32)), torch.device("cpu"))


def test_a_gpu_load_takes_each_kernel_from_its_own_units_module(tmp_path, monkeypatch):
    """The CUDA side of `launch.load` with CuPy stood in: a spec's forward and backward units (two
    cubins) load as two modules, and each kernel is looked up in the module of its unit alone."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    loaded = []

    class Module:
        def load(self, cubin):
            self.cubin = cubin
            loaded.append(self)

        def get_function(self, name):
            return (self.cubin, name)

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=FakeDevice,
                                                            function=types.SimpleNamespace(Module=Module)))
    monkeypatch.setattr(launch, "_cupy", lambda: cupy)
    monkeypatch.setattr(launch, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(launch, "shared_limit", lambda device: SMEM_LIMIT_BYTES["sm_90"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a stand-in GPU")
    source = render(Spec(64, mask="causal", dtype="bf16"))
    functions = launch._load_cuda(source, torch.device("cuda", 0)).functions
    compiled = compiler.compile_source(source, "sm_90")
    assert [m.cubin for m in loaded] == list(compiled.cubins) and len(loaded) == 2
    for unit, cubin in zip(source.units, compiled.cubins):
        for name in unit.names:
            assert functions[name].function == (cubin, name)
    assert set(functions) == {e.name for e in source.entries}
