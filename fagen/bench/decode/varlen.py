"""The decode section's varlen training: documents packed back to back and the same padded to
the longest, the contenders (fagen varlen, fagen padded, SDPA padded), and the check of each
fagen call against each document alone in fp32 torch. See run.py for the section as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..measure import add_gradient_errors, torch_attention, torch_dtype
from ..peers import NotAvailable, SdpaSystem, System, failure_reason
from .config import DECODE_LABELS
from .step import fagen_decode_functions


# -- varlen training --------------------------------------------------------------------------

@dataclass
class Documents:
    """Documents packed back to back, and the same padded to the longest."""

    lengths: list
    cu_seqlens: object      # int32 (B + 1,)
    seqlens: object         # int32 (B,)
    packed: tuple           # q, k, v (total, H, d), requiring grad
    padded: tuple           # q, k, v (B, N_max, H, d), the same rows, zeros past each end

    @property
    def max_len(self) -> int:
        return max(self.lengths)


def make_documents(lengths: list[int], heads: int, head_dim: int, dtype: str, device) -> Documents:
    import torch

    total, batch, longest = sum(lengths), len(lengths), max(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    packed = [torch.randn(total, heads, head_dim, device=device, dtype=torch_dtype(dtype)) for _ in range(3)]
    padded = [torch.zeros(batch, longest, heads, head_dim, device=device, dtype=torch_dtype(dtype)) for _ in range(3)]
    for b, n in enumerate(lengths):
        for flat, batched in zip(packed, padded):
            batched[b, :n] = flat[starts[b]:starts[b] + n]
    return Documents(list(lengths), torch.tensor(starts, device=device, dtype=torch.int32),
                     torch.tensor(lengths, device=device, dtype=torch.int32),
                     tuple(t.requires_grad_() for t in packed), tuple(t.requires_grad_() for t in padded))


class VarlenSystem(System):
    """A varlen-training contender; `packed` says which of the Documents' tensors it takes."""

    packed = False

    def __init__(self, docs: Documents | None = None):
        self.docs = docs

    @property
    def label(self) -> str:
        return DECODE_LABELS.get(self.name, self.name)

    def inputs(self) -> tuple:
        return self.docs.packed if self.packed else self.docs.padded

    def prepare(self) -> dict:
        """Choose what to run (before timing); extra fields for the system's cells."""
        return {}


class FagenVarlen(VarlenSystem):
    name, is_fagen, packed = "fagen_varlen", True, True

    def forward(self, q, k, v, causal: bool):
        docs = self.docs
        return fagen_decode_functions()[1](q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len,
                                           causal=causal)


class FagenPadded(VarlenSystem):
    """flash_attn_func, causal, on the right-padded batch. Without seqlens_k: fagen aligns
    causal to each entry's own key count (bottom-right), so seqlens_k would shift a short
    document's diagonal by its padding; causal alone keeps every document's rows off its
    padding (the padding rows' work is the waste a padded batch pays)."""

    name, is_fagen = "fagen_padded", True

    def forward(self, q, k, v, causal: bool):
        from fagen import flash_attn_func

        return flash_attn_func(q, k, v, causal=causal)


class SdpaPadded(VarlenSystem):
    """SDPA's flash backend on the padded batch, else its efficient one (probed forward)."""

    name = "sdpa_padded"
    BACKENDS = ("sdpa_flash", "sdpa_efficient")

    def __init__(self, docs: Documents | None = None):
        super().__init__(docs)
        self.sdpa = None

    def forward(self, q, k, v, causal: bool):
        return (self.sdpa or SdpaSystem(self.BACKENDS[0])).forward(q, k, v, causal)

    def prepare(self) -> dict:
        import warnings

        refused = []
        for backend in self.BACKENDS:
            self.sdpa = SdpaSystem(backend)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.forward(*self.inputs(), True)
                return {"backend": DECODE_LABELS.get(backend, backend)}
            except Exception as exc:  # noqa: BLE001 - the next backend, or a skipped cell
                refused.append(f"{backend}: {failure_reason(exc, limit=120)}")
        raise NotAvailable("; ".join(refused))


def varlen_sanity(system: VarlenSystem, docs: Documents, causal: bool = True) -> dict:
    """A varlen system's output on each document's rows against each document alone in fp32
    torch, next to bf16 torch (2x forward; 3x gradients where the inputs are packed)."""
    import torch

    q, k, v = docs.packed
    starts = docs.cu_seqlens.tolist()

    def per_document(dtype):
        return torch.cat([torch_attention(*(t[s:e].unsqueeze(0) for t in (q, k, v)), causal, dtype).squeeze(0)
                          for s, e in zip(starts[:-1], starts[1:])])

    try:
        out = system.forward(*system.inputs(), causal)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    if not system.packed:   # the padded rows: each document's first L of its entry
        out = torch.cat([out[b, :n] for b, n in enumerate(docs.lengths)])
    ref, same = per_document(torch.float32), per_document(q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    result = {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4)}
    if system.packed:
        add_gradient_errors(result, out, ref, same, (q, k, v))
    return result
