"""The systems the sweep compares, behind one small interface.

Every system takes q, k, v in fagen's (and flash-attn's) layout (B, N, H, d)
and returns the output in that layout. PyTorch's peers want (B, H, N, d):
they get transposed views of the same storage (no copy, last dim still
contiguous, as in a model that projects to (B, N, H, d)), and their output is
transposed back as a view, so `torch.randn_like(out)` keeps the peer's own
memory layout for the backward pass's dout.

A system that cannot run raises; the sweep records the reason and goes on.
"""

from __future__ import annotations

import os
from typing import Callable
from unittest import mock

from ..arch_families import SM90
from .speed.config import SYSTEM_LABELS


class NotAvailable(RuntimeError):
    """This system cannot run this case; the message says why."""


class System:
    """One contender. Subclasses set `name` and implement `forward`."""

    name = "system"
    is_fagen = False

    @property
    def label(self) -> str:
        return SYSTEM_LABELS.get(self.name, self.name)

    def unavailable_reason(self) -> str | None:
        """Why this system cannot run at all on this machine, or None."""
        return None

    def forward(self, q, k, v, causal: bool):
        raise NotImplementedError

    def memory_needed(self, *, batch: int, heads: int, seqlen: int, head_dim: int,
                      training: bool) -> int:
        """Bytes of working memory beyond the inputs, when a system needs far
        more than its output (the math backend's N x N matrices); 0 = small."""
        return 0


# -- fagen -------------------------------------------------------------------

def fagen_attention_func() -> Callable:
    """fagen's user op (imported late: a broken install is reported, not raised)."""
    from fagen import flash_attn_func

    return flash_attn_func


class FagenSystem(System):
    """fagen's flash_attn_func, FlashAttention `version` 1 or 2; with `family` sm90 (arch_families.SM90), version 2
    on the Hopper family (FAGEN_ARCH_FAMILY=sm90 around each call: the backward, which autograd runs
    later, is that call's Spec's, the family's own where `sm90_backward_refusal` lets it through)."""

    is_fagen = True

    def __init__(self, version: int, family: str = ""):
        self.version, self.family = version, family
        self.name = f"fagen_{family}" if family else f"fagen_v{version}"
        self._func = None

    def unavailable_reason(self) -> str | None:
        try:
            self._func = fagen_attention_func()
        except Exception as exc:  # noqa: BLE001 - report any import failure
            return f"cannot import fagen's flash_attn_func: {type(exc).__name__}: {exc}"
        try:
            import cupy  # noqa: F401 - fagen launches through CuPy on a GPU
        except Exception as exc:  # noqa: BLE001
            return f"cupy does not import: {type(exc).__name__}: {exc}"
        return sm90_unavailable() if self.family == SM90.name else None

    def forward(self, q, k, v, causal: bool):
        return self.call(q, k, v, causal=causal, version=self.version)

    def call(self, *args, **kwargs):
        """fagen's flash_attn_func in this system's kernel family."""
        if self._func is None:
            self._func = fagen_attention_func()
        return in_family(self.family, self._func, *args, **kwargs)


def sm90_unavailable() -> str | None:
    """Why fagen's sm90 family cannot run here (its cubins are sm_90a: compute capability 9.0
    only), or None."""
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability != (9, 0):
        return f"the sm90 family runs on compute capability 9.0 only (sm_90a), this GPU is {capability}"
    return None


def in_family(family: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with fagen's kernels in `family` (FAGEN_ARCH_FAMILY, which fagen reads on
    every call); as it is for "" (the default)."""
    if not family:
        return fn(*args, **kwargs)
    from fagen.arch_families import ARCH_FAMILY_ENV

    with mock.patch.dict(os.environ, {ARCH_FAMILY_ENV: family}):
        return fn(*args, **kwargs)


# -- PyTorch scaled_dot_product_attention, one backend at a time --------------

SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


class SdpaSystem(System):
    def __init__(self, name: str):
        self.name = name
        self.backend_name = SDPA_BACKENDS[name]
        self._backend = None

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"torch.nn.attention.sdpa_kernel is missing: {exc}"
        self._backend = getattr(SDPBackend, self.backend_name, None)
        if self._backend is None:
            return f"this torch has no SDPBackend.{self.backend_name}"
        return None

    def forward(self, q, k, v, causal: bool):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = self._backend or getattr(SDPBackend, self.backend_name)
        # The backend chosen here also fixes the backward kernel: autograd
        # records a backend-specific node.
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    def memory_needed(self, *, batch, heads, seqlen, head_dim, training) -> int:
        if self.name != "sdpa_math":
            return 0
        # The math backend materialises fp32 scores and probabilities (it
        # upcasts 16-bit inputs), and training keeps them plus their gradient.
        scores = batch * heads * seqlen * seqlen * 4
        return scores * (4 if training else 2)


# -- FlexAttention --------------------------------------------------------------

def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlexSystem(System):
    """torch.nn.attention.flex_attention under torch.compile (eager Flex
    materialises the scores and would time the wrong thing)."""

    name = "flex"

    def __init__(self):
        self._compiled = None
        self._block_masks: dict = {}

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"torch.nn.attention.flex_attention does not import: {exc}"
        try:
            import triton  # noqa: F401 - Inductor's GPU code generator
        except Exception as exc:  # noqa: BLE001
            return f"triton does not import (needed by torch.compile): {exc}"
        return None

    def _function(self):
        if self._compiled is None:
            import torch
            import torch._dynamo
            from torch.nn.attention.flex_attention import flex_attention

            # Each sequence length is a new shape; Dynamo's default limit of 8
            # recompiles would silently fall back to eager Flex.
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            self._compiled = torch.compile(flex_attention)
        return self._compiled

    def _block_mask(self, seqlen: int, device):
        key = (seqlen, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_masks[key] = create_block_mask(_causal_mask, None, None, seqlen, seqlen,
                                                       device=device)
        return self._block_masks[key]

    def forward(self, q, k, v, causal: bool):
        if q.shape[1] != k.shape[1] and causal:
            raise NotAvailable("the Flex causal mask here is for Nq == Nk")
        block_mask = self._block_mask(q.shape[1], q.device) if causal else None
        out = self._function()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               block_mask=block_mask)
        return out.transpose(1, 2)


# -- construction and failure text ----------------------------------------------

def make_system(name: str) -> System:
    if name == "fagen_sm90":
        return FagenSystem(2, family=SM90.name)
    if name.startswith("fagen_v"):
        return FagenSystem(int(name[len("fagen_v"):]))
    if name in SDPA_BACKENDS:
        return SdpaSystem(name)
    if name == "flex":
        return FlexSystem()
    raise ValueError(f"unknown system {name!r}")


def is_out_of_memory(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except Exception:  # noqa: BLE001 - torch missing: fall back to the message
        pass
    return "out of memory" in str(exc).lower()


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """One line naming the error: what the report shows for a skipped run."""
    if is_out_of_memory(exc):
        return "OOM"
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def math_fits(system: System, *, free_bytes: int, **shape) -> tuple[bool, str]:
    """Whether a system's working memory plausibly fits; the reason if not."""
    need = system.memory_needed(**shape)
    if need and need > 0.85 * free_bytes:
        return False, (f"skipped: needs about {need / 2**30:.0f} GiB for its N x N matrices, "
                       f"{free_bytes / 2**30:.0f} GiB free")
    return True, ""

