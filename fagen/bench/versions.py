"""The versions the GPU check runs with, as found: it runs from the working tree under the GPU
machine's own python3 and packages (no install step, so fagen's pins do not apply there), and a
result is only readable next to them. --dry-run prints them; the run records them in results.json
and prints them in its summary.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

# (label, module to import, distribution to ask importlib.metadata when the module has no __version__)
PACKAGES = (("torch", "torch", "torch"), ("cupy", "cupy", None), ("cuda-bindings", "cuda.bindings", "cuda-bindings"),
            ("transformers", "transformers", "transformers"), ("triton", "triton", "triton"),
            ("numpy", "numpy", "numpy"), ("matplotlib", "matplotlib", "matplotlib"), ("pytest", "pytest", "pytest"),
            ("pytest-timeout", "pytest_timeout", "pytest-timeout"))
# The order of the one-line summary: what decides whether a section can run at all.
HEADLINE = ("python", "torch", "cupy", "cuda-bindings", "nvrtc", "transformers", "pytest-timeout")
DISPLAY = {"nvrtc": "NVRTC"}


def _module_version(module: str, distribution: str | None) -> str | None:
    """The module's version, None when it does not import (absent is a fact to record)."""
    try:
        found = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means the package is unusable here
        return None
    version = getattr(found, "__version__", None)
    if version is None and distribution is not None:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
    return str(version) if version is not None else "imported"


def found_versions() -> dict[str, str | None]:
    """python, each package of PACKAGES, torch's CUDA, the NVRTC fagen compiles with, and fagen."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for label, module, distribution in PACKAGES:
        found[label] = _module_version(module, distribution)
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        found["torch_cuda"] = None
    try:
        from fagen.kernels.compile import nvrtc_version

        found["nvrtc"] = nvrtc_version()
    except Exception:  # noqa: BLE001 - the precompile section reports why
        found["nvrtc"] = None
    found["fagen"] = _module_version("fagen", None)
    return found


def versions_line(found: dict) -> str:
    """One line: the headline versions first, 'absent' for what did not import."""
    def text(name):
        value = found.get(name)
        if name == "torch" and value and found.get("torch_cuda"):
            return f"{value} (CUDA {found['torch_cuda']})"
        return value or "absent"

    return ", ".join(f"{DISPLAY.get(name, name)} {text(name)}" for name in HEADLINE)
