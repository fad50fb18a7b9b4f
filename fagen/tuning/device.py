"""What tuning needs to know about a GPU: its limits and its identity.

`DeviceLimits` holds the per-block limits pruning checks candidates against.
On a GPU they come from the driver (`cudaGetDeviceProperties`, through CuPy,
else torch); on a CPU-only machine a preset per arch stands in, so pruning is
testable without a GPU.

`DeviceIdentity` is the hardware-and-toolchain half of a tuning cache key:
GPU name, compute capability, driver version and NVRTC version. A driver or
NVRTC upgrade can change code generation or scheduling, so it invalidates
every tuning made before it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
from dataclasses import dataclass

import torch

from ..kernels import compile as compiler
from ..arch import SMEM_LIMIT_BYTES


@dataclass(frozen=True)
class DeviceLimits:
    """Per-block hardware limits, as `cudaDeviceProp` names them."""

    arch: str                       # the NVRTC target, e.g. "sm_90"
    shared_per_block_optin: int     # sharedMemPerBlockOptin: dynamic + static shared bytes
    registers_per_block: int        # regsPerBlock
    max_threads_per_block: int      # maxThreadsPerBlock
    max_registers_per_thread: int = 255   # the ISA's limit on sm_50 and later
    l2_bytes: int = 0               # l2CacheSize (timing rotates at least 2x this)
    multiprocessors: int = 0        # multiProcessorCount

    @classmethod
    def preset(cls, arch: str) -> "DeviceLimits":
        """Published limits of an arch's flagship part, for tests and dry runs."""
        if arch not in LIMIT_PRESETS:
            raise ValueError(f"no device-limit preset for {arch!r}; presets: {', '.join(LIMIT_PRESETS)}")
        return LIMIT_PRESETS[arch]

    @classmethod
    def from_device(cls, device) -> "DeviceLimits":
        """Read the limits of a CUDA device from the driver."""
        index = cuda_index(device)
        arch = arch_of(index)
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(index)
            return cls(arch=arch, shared_per_block_optin=int(props["sharedMemPerBlockOptin"]),
                       registers_per_block=int(props["regsPerBlock"]),
                       max_threads_per_block=int(props["maxThreadsPerBlock"]),
                       l2_bytes=int(props["l2CacheSize"]),
                       multiprocessors=int(props["multiProcessorCount"]))
        except ImportError:
            # Without CuPy nothing can launch either, but torch still reports
            # most limits; the ones it lacks are the same on every arch fagen targets.
            props = torch.cuda.get_device_properties(index)
            return cls(arch=arch,
                       shared_per_block_optin=int(getattr(props, "shared_memory_per_block_optin",
                                                          SMEM_LIMIT_BYTES.get(arch, 49152))),
                       registers_per_block=int(getattr(props, "regs_per_block", 65536)),
                       max_threads_per_block=int(getattr(props, "max_threads_per_block", 1024)),
                       l2_bytes=int(getattr(props, "L2_cache_size", 0)),
                       multiprocessors=int(props.multi_processor_count))


# Values from the CUDA C Programming Guide ("Technical Specifications per
# Compute Capability") and the A100/H100/RTX 4090 whitepapers.
LIMIT_PRESETS = {
    "sm_80": DeviceLimits("sm_80", 166912, 65536, 1024, l2_bytes=40 * 2**20, multiprocessors=108),
    "sm_86": DeviceLimits("sm_86", 101376, 65536, 1024, l2_bytes=6 * 2**20, multiprocessors=84),
    "sm_89": DeviceLimits("sm_89", 101376, 65536, 1024, l2_bytes=72 * 2**20, multiprocessors=128),
    "sm_90": DeviceLimits("sm_90", 232448, 65536, 1024, l2_bytes=50 * 2**20, multiprocessors=132),
}


@dataclass(frozen=True)
class DeviceIdentity:
    """Which GPU and toolchain a tuning was measured on."""

    name: str          # "NVIDIA H200"
    arch: str          # compute capability as an NVRTC target: "sm_90"
    driver: str        # "560.35.03" from NVML, else the driver's CUDA version "cuda 12.6"
    nvrtc: str         # "12.9"

    @property
    def key(self) -> str:
        return f"{self.name} | {self.arch} | driver {self.driver} | nvrtc {self.nvrtc}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:12]

    @classmethod
    def from_device(cls, device) -> "DeviceIdentity":
        return _identity_of(cuda_index(device))


def cuda_index(device) -> int:
    """The CUDA ordinal of `device` (None, an int, "cuda", "cuda:1" or a torch.device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _identity_of(index: int) -> DeviceIdentity:
    # Cached per process: `lookup` runs on every attention call.
    return DeviceIdentity(name=torch.cuda.get_device_name(index), arch=arch_of(index),
                          driver=driver_version(), nvrtc=compiler.nvrtc_version())


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The installed driver's version: NVML's exact build string when NVML loads, else the
    CUDA version the driver supports (coarser: two builds of one branch look the same)."""
    exact = _nvml_driver_version()
    if exact:
        return exact
    try:
        import cupy

        version = cupy.cuda.runtime.driverGetVersion()
        return f"cuda {version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - no CuPy or no driver: the key still names the GPU
        return "unknown"


def _nvml_driver_version() -> str | None:
    name = ctypes.util.find_library("nvidia-ml") or "libnvidia-ml.so.1"
    try:
        nvml = ctypes.CDLL(name)
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            buffer = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(len(buffer))) != 0:
                return None
            return buffer.value.decode()
        finally:
            nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
