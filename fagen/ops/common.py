"""The front end's common layer: what every entry point shares, and the only part of `ops` that
`distributed/` and `integrations/` import.

  - argument checks: flags, dense tensors, q/k/v, seqlens_k, the softmax scale, the options;
    every error names the caller's own argument and says what was expected;
  - the dtype table (fagen.dtypes'), 16-byte row alignment, and head dims padded to a multiple of 8;
  - the Philox (seed, offset) pair of a dropout call.
"""

from __future__ import annotations

import math

import torch

from ..environment import setting
from ..errors import InputError, InputTypeError, assert_lazily
from ..kernels import launch
from ..spec import MAX_HEAD_DIM, check_dropout_p

ALIGN_ELEMENTS = 8   # cp.async moves 16 bytes: rows must start 16-byte aligned
HEAD_DIM_MULTIPLE = 8  # head dims in between are zero-padded up to this (flash-attn does too)
CHECK_VALUES_ENV = "FAGEN_CHECK_VALUES"   # 1: index values are read and checked on the host (values_checked)
MAX_INT32 = 2**31 - 1  # sequence lengths, heads and batch reach the kernels as int


# -- input checking --------------------------------------------------------------------------

FLASH_LAYOUT = ("batch", "seqlen", "heads", "head_dim")
TORCH_LAYOUT = ("batch", "heads", "seqlen", "head_dim")   # PyTorch's (SDPA's) order


def _check_tensor(name: str, t, dims=FLASH_LAYOUT, dtypes=None) -> None:
    check_dense_tensor(name, t)
    if t.dim() != 4:
        raise InputError(f"{name} must have 4 dims ({', '.join(dims)}), got shape {tuple(t.shape)}")
    check_half_rows(name, t, dtypes)


def check_inputs(q, k, v, seqlens_k=None, names=("q", "k", "v"), dims=FLASH_LAYOUT, dtypes=None) -> None:
    """Validate q, k, v; raises TypeError/ValueError naming the argument. `names` are the
    caller's own argument names and `dims` its layout (fagen.sdpa: query, key, value in
    TORCH_LAYOUT), so every message speaks of what the user passed, in its shape. `dtypes`: the
    ones taken, where not fp16 and bf16 (the 8-bit forward's, ops/fp8.py)."""
    nq, nk, nv = names
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t, dims, dtypes)
    q_shape, k_shape = q.shape, k.shape
    if not q.dtype == k.dtype == v.dtype:
        raise InputTypeError(f"{nq}, {nk} and {nv} must share a dtype, got {nq} {q.dtype}, {nk} {k.dtype}, "
                             f"{nv} {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"{nq}, {nk} and {nv} must be on one device, got {nq} {q.device}, {nk} {k.device}, "
                         f"{nv} {v.device}")
    if k_shape[:-1] != v.shape[:-1]:   # v's head dim (d_v) may differ: checked below
        raise InputError(f"{nk} and {nv} must have the same shape but for the head dim, got {nk} {tuple(k_shape)} "
                         f"and {nv} {tuple(v.shape)}")
    heads_axis, seq_axis = dims.index("heads"), dims.index("seqlen")
    batch, heads, head_dim = q_shape[0], q_shape[heads_axis], q_shape[3]
    if batch != k_shape[0]:
        raise InputError(f"{nq} and {nk} must have the same batch size, got {batch} and {k_shape[0]}")
    if head_dim != k_shape[3]:
        raise InputError(f"{nq} and {nk} must have the same head_dim, got {head_dim} and {k_shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise InputError(f"head_dim ({nq}.shape[-1]) must be from 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if not 1 <= v.shape[-1] <= head_dim:
        raise InputError(f"{nv}'s head dim ({nv}.shape[-1] = {v.shape[-1]}) must be from 1 to {nq}'s ({head_dim}): "
                         f"the kernels stage V in K's shared-memory rows")
    if k_shape[heads_axis] == 0 or heads % k_shape[heads_axis]:
        raise InputError(f"{nq}'s number of heads ({heads}) must be a multiple of {nk}'s ({k_shape[heads_axis]})")
    if max(batch, q_shape[seq_axis], heads, k_shape[seq_axis]) > MAX_INT32:
        for name, size in (("batch", batch), ("seqlen_q", q_shape[seq_axis]), ("heads", heads),
                           ("seqlen_k", k_shape[seq_axis])):
            if size > MAX_INT32:
                raise InputError(f"{name} = {size} is above {MAX_INT32}, the largest size the kernels' "
                                 f"int arguments hold")
    if seqlens_k is not None:
        _check_seqlens_k(seqlens_k, q, k)


def _check_seqlens_k(seqlens_k, q, k) -> None:
    if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype != torch.int32:
        got = seqlens_k.dtype if isinstance(seqlens_k, torch.Tensor) else type(seqlens_k).__name__
        raise InputTypeError(f"seqlens_k must be an int32 tensor of shape (batch,), got {got}")
    if tuple(seqlens_k.shape) != (q.shape[0],):
        raise InputError(f"seqlens_k must have shape ({q.shape[0]},), got {tuple(seqlens_k.shape)}")
    if seqlens_k.device != q.device:
        raise InputError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    # Unchecked (traced or captured), a value above Nk counts as Nk and one below 0 as 0:
    # the kernels clamp each length to [0, Nk], so no value reads outside k and v.
    if seqlens_k.numel() == 0 or not values_checkable(seqlens_k):
        return
    expected = f"seqlens_k values must be in [0, {k.shape[1]}] (the keys k holds)"
    if values_checked(seqlens_k):   # FAGEN_CHECK_VALUES=1: read on the host (one sync), named
        low, high = (int(x) for x in torch.aminmax(seqlens_k))
        if low < 0 or high > k.shape[1]:
            raise InputError(f"{expected}, got values from {low} to {high}")
        return
    assert_lazily(((seqlens_k >= 0) & (seqlens_k <= k.shape[1])).all(), f"{expected}; FAGEN_CHECK_VALUES=1 "
                  "names the values")



def check_scale(name: str, scale, head_dim: int) -> float:
    """A softmax scale (None: 1/sqrt(head_dim)) as a float; `name` is the caller's argument."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InputTypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        # The kernels take each row's max of the raw scores S and fold the scale into the
        # exponent: max(tau S) = tau max(S) holds for tau > 0 only.
        raise InputError(f"{name} must be a positive finite float, got {scale}")
    return float(scale)


def check_options(dropout_p, softmax_scale, causal, return_lse, deterministic, version, head_dim):
    """The non-tensor arguments, checked; returns (dropout_p, softmax_scale, causal, return_lse,
    deterministic) as floats and Python bools: a NumPy bool must not reach the custom op."""
    causal, return_lse, deterministic = (check_flag(name, value) for name, value in (
        ("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)))
    if isinstance(version, bool) or version not in (1, 2):
        raise InputError(f"version must be 1 or 2, got {version!r}")
    return check_dropout_p(dropout_p), check_scale("softmax_scale", softmax_scale, head_dim), causal, return_lse, \
        deterministic


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself if its rows are contiguous and start 16-byte aligned (cp.async's need), else an
    aligned contiguous copy (this also covers broadcast tensors such as the dO of `out.sum()`,
    and a contiguous view that starts off alignment, which .contiguous() would return as is).
    Any number of dims: (B, N, H, d) or packed (total, H, d)."""
    return t if t.data_ptr() % 16 == 0 and strides_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def strides_aligned(t: torch.Tensor) -> bool:
    """Whether t's strides keep every row 16-byte aligned when its first element is: the last
    dim contiguous, every other stride a positive multiple of 16 bytes (`aligned_rows`'s stride
    half: a caller that knows the strides checks only the pointers)."""
    if t.dim() == 4:   # the hot path of every call: unrolled
        s_b, s_n, s_h, s_d = t.stride()
        return (s_d == 1 and s_b > 0 and s_n > 0 and s_h > 0
                and not (s_b % ALIGN_ELEMENTS or s_n % ALIGN_ELEMENTS or s_h % ALIGN_ELEMENTS))
    *outer, s_d = t.stride()
    return s_d == 1 and all(s > 0 and s % ALIGN_ELEMENTS == 0 for s in outer)


def refuse_graph_capture(device: torch.device) -> None:
    """Dropout's (seed, offset) reach the kernels as launch arguments, so a CUDA graph would
    replay the captured pair, one dropout mask on every replay: capturing is refused instead."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fagen: dropout_p > 0 inside CUDA graph capture is not supported: the graph would replay "
            "one dropout mask on every replay. Capture with dropout_p=0, or run this call eagerly.")


def philox_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """(seed, offset) for Philox, drawn from torch's default CPU generator whatever the device:
    torch.manual_seed (which seeds it) reproduces a run, and no device sync is needed."""
    if dropout_p == 0:
        return None
    # Dynamo cannot trace the capture query (a torch function returning a bool): a compiled
    # call is checked at run time instead, by the custom op's implementation (_forward_impl).
    if not torch.compiler.is_compiling():
        refuse_graph_capture(device)
    state = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return torch.stack([state[0], state[1] % 2**32])


def padded_width(head_dim: int) -> int:
    """A head dim rounded up to the kernels' multiple of 8 (what `padded_head_dim` pads to)."""
    return head_dim + -head_dim % HEAD_DIM_MULTIPLE


def padded_head_dim(q, k, v):
    """q, k, v with their head dims zero-padded up to a multiple of 8 (the kernels' 16-byte
    rows), and v's true head dim (the output's). Zero columns add nothing to Q K^T, and the
    output's extra columns are dropped."""
    head_dim_v = v.shape[-1]
    if not (q.shape[-1] % HEAD_DIM_MULTIPLE or head_dim_v % HEAD_DIM_MULTIPLE):
        return q, k, v, head_dim_v
    q, k, v = (torch.nn.functional.pad(t, (0, padded_width(t.shape[-1]) - t.shape[-1])) for t in (q, k, v))
    return q, k, v, head_dim_v


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading a tensor's values is allowed here: not while torch.compile traces
    (they are data) and not during CUDA graph capture (the device sync would fail it)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def values_checked(t: torch.Tensor) -> bool:
    """Whether index values (cache_seqlens, block_table, cu_seqlens, seqlens_k) are read and
    checked before the launch, with messages that name the entry and its value: only with
    FAGEN_CHECK_VALUES=1 (a device sync per call) and where values can be read. By default
    the kernels' guards refuse an out-of-range index and the call raises lazily from their
    error flag (fagen.kernels.attention_kernels.raise_flagged)."""
    if not values_checkable(t):   # first: under torch.compile the environment is never read
        return False
    value = setting(CHECK_VALUES_ENV)
    if value not in ("", "0", "1"):
        raise ValueError(f"{CHECK_VALUES_ENV}={value!r}: expected 0 or 1")
    return value == "1"


# -- flags and tensors ----------------------------------------------------------------------------

def check_flag(name: str, value) -> bool:
    """A flag, as a Python bool: `causal="no"` or `causal=1` must not quietly mean causal=True.
    NumPy bools (np.True_, what `arr.any()` gives) are accepted. A tensor is refused: reading
    it would be a device sync eagerly and a graph break under torch.compile."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy":   # known by its module: NumPy need not be imported
        if torch.compiler.is_compiling():
            # dynamo traces np.True_ as a 0-d array whose value is data (like a tensor's)
            raise InputTypeError(f"{name}: under torch.compile pass a Python bool, not a NumPy one")
        item = value.item() if getattr(value, "ndim", None) == 0 else None
        if isinstance(item, bool):
            return item
    if isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be True or False, got a tensor ({value.dtype}, shape "
                             f"{tuple(value.shape)}): pass a Python bool, e.g. bool({name}) outside the "
                             f"compiled region")
    raise InputTypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


HALF_DTYPES = (torch.float16, torch.bfloat16)   # every kernel's inputs but the 8-bit forward's (ops/fp8.py)


def check_half_rows(name: str, t, dtypes=None) -> None:
    """`t` is fp16 or bf16 (or of `dtypes`) with a contiguous last dimension: what every kernel input needs."""
    if dtypes is not None:
        if t.dtype not in dtypes:
            raise InputTypeError(f"{name} must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                                 f"got {t.dtype}")
    elif t.dtype not in HALF_DTYPES:
        hint = " (float8_e4m3fn inputs: fagen.flash_attn_func alone, on the sm90 family)" \
            if t.dtype == torch.float8_e4m3fn else ""
        raise InputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}{hint}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")


def check_dense_tensor(name: str, t) -> None:
    """`t` is a torch.Tensor with the strided layout (a sparse one reports stride 0, which would
    read as a broadcast: say what it is instead)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InputTypeError(f"{name} must be a dense (torch.strided) tensor, got layout {t.layout}: pass "
                             f"{name}.to_dense()")


def device_shared_limit(device: torch.device) -> int | None:
    """Shared memory per block on `device`, a GPU (what its driver allows: the decoding tiles are
    fitted to it, Spec.for_kv_cache); None on the CPU, whose emulator runs sm_80's tiles."""
    return launch.shared_limit(device) if device.type == "cuda" else None
