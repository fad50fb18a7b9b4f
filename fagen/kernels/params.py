"""The kernels' parameter tables: which arguments each kernel of a Spec takes, one table per
feature (sizes and strides, statistics, dropout, a variant's values, decoding's cache, packed
sequences, test instrumentation), and how the launcher passes each one. A feature a Spec does not
use adds no parameter, so its kernels' signatures, and sources, stay as they were."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..arch_families import BOX_COLUMNS, SM90_FP8_KEY_STEP, sm90_backward_tiles, sm90_tiles
from ..spec import Spec
from ..variants.builtins import derived_values
from ..variants.compose import mod_expression
from ..variants.cuda import variant_code
from ..variants.tiles import summaries
from .tensor_map import PageBox, Swizzle

ELEM_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}   # by a spec's output dtype (Spec.output_dtype)
TENSOR_MAP = "const __grid_constant__ fagen::TensorMap"   # a TMA map, passed by value


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type, name, and how the launcher passes it."""

    name: str
    ctype: str
    kind: str  # "tensor" (a device pointer), "tensor_map" (a TMA map of a tensor, by value) or a NumPy
    #            scalar type name: "int32", "float32", ...
    box: tuple = ()   # a tensor map's box, in the tensor's own dim order (TensorMapSpec.of_tensor)
    swizzle: Swizzle = Swizzle.B128   # a tensor map's swizzle (none for rows of fp32 statistics)


def _strides(*tensors: str) -> list[Param]:
    return [Param(f"{t}_stride_{axis}", "long long", "int64") for t in tensors for axis in ("b", "n", "h")]


def _tensor(name: str, ctype: str, const: bool = False) -> Param:
    return Param(name, f"{'const ' if const else ''}{ctype}* __restrict__", "tensor")


def _stats(spec: Spec, const: bool) -> list[Param]:
    names = ("lse",) if spec.version == 2 else ("row_max", "row_sum")
    if not const and spec.version == 1:
        names = ("row_max_out", "row_sum_out")
    return [_tensor(n, "float", const) for n in names]


def _sizes(spec: Spec) -> list[Param]:
    params = [_tensor("seqlens_k", "int", const=True)] if spec.key_padding else []
    return params + [Param(n, "int", "int32") for n in ("heads", "kv_heads", "seqlen_q", "seqlen_k")]


def _dropout(spec: Spec) -> list[Param]:
    if not spec.dropout:
        return []
    offsets = [Param("row_offset", "int", "int32"), Param("col_offset", "int", "int32")] if spec.coord_offsets else []
    return [Param("seed", "unsigned long long", "uint64"), Param("philox_offset", "unsigned int", "uint32"),
            Param("keep_threshold", "unsigned int", "uint32"), Param("keep_scale", "float", "float32")] + offsets


def forward_params(spec: Spec, debug: bool = False) -> tuple[Param, ...]:
    elem = ELEM_CTYPE[spec.dtype]
    params = ([_tensor("q", elem, const=True)] + [_tensor(n, cache_ctype(spec), const=True) for n in ("k", "v")]
              + [_tensor("out", elem)])
    params += _stats(spec, const=False)
    if spec.version == 1:
        params.append(_tensor("o_accum", "float"))  # FA-1 keeps O in HBM between steps
    params += _sizes(spec) + _strides("q", "k", "v", "o")
    params.append(Param("softmax_scale_log2", "float", "float32"))
    if spec.has_mods:   # variant scores are scaled before their score_mod
        params.append(Param("softmax_scale", "float", "float32"))
    params += _dropout(spec) + _variant(spec) + _kv_cache(spec)
    return tuple(params + _debug(spec, debug, "tiles_visited"))


def sm90_forward_params(spec: Spec) -> tuple[Param, ...]:
    """The sm90 family's forward (templates/sm90/hopper_fwd.cu.j2): q, k and v as TMA tensor maps passed
    by value, each box one 64-column box of a tile's rows, (1, rows, 1, 64) of (B, N, H, d); O,
    and L in natural log. Decoding (kv_cache) adds the cache's rows and the split-KV partials, k
    and v being the caches (`k_cache`, `v_cache`: a paged cache's pages, (pages, page_size, Hk, d))."""
    tiles = sm90_tiles(spec)
    key_rows = PageBox(tiles.block_n) if spec.kv_cache == "paged" else tiles.block_n   # a box per page, or per tile
    swizzle = Swizzle.B64 if tiles.box_bytes == 64 else Swizzle.B128
    maps = [Param(name, TENSOR_MAP, "tensor_map", box=(1, rows, 1, tiles.box_columns), swizzle=swizzle)
            for name, rows in (("q", tiles.block_m), ("k", key_rows), ("v", key_rows))]
    if spec.fp8:   # V^T (B, Hk, d_v, keys: fp8_operands.v_in_slot_order): boxes of d_v rows of 32 keys
        maps[2] = Param("vt", TENSOR_MAP, "tensor_map", box=(1, 1, tiles.head_dim_v, SM90_FP8_KEY_STEP),
                        swizzle=Swizzle.B32)
        if spec.varlen:   # packed sequences' V^T: each sequence's keys from its start there, in whole tiles
            maps.append(_tensor("vt_starts", "int", const=True))
    # O: stored by TMA, one consumer warpgroup's 64 rows a box; packed sequences and decoding by the
    # threads (a box would write past a sequence's end, into the next one's rows; a split writes
    # fp32 partials), and the 8-bit forward's bf16 O too (twice Q's tile, where a box would be staged).
    by_threads = spec.varlen or spec.kv_cache is not None or spec.fp8
    out = ([_tensor("out", ELEM_CTYPE[spec.output_dtype])] if by_threads else
           [Param("out", TENSOR_MAP, "tensor_map", box=(1, 64, 1, BOX_COLUMNS))])
    return tuple(maps + out + [_tensor("lse", "float")] + _fp8_descales(spec) + _sizes(spec)
                 + (_strides("o") if by_threads else []) + [Param("softmax_scale_log2", "float", "float32")]
                 + ([Param("softmax_scale", "float", "float32")] if spec.sinks or spec.alibi or spec.score_mod else [])
                 + _dropout(spec) + _variant(spec) + _kv_cache(spec))


def sm90_backward_params(spec: Spec) -> tuple[Param, ...]:
    """The sm90 family's backward main kernel (templates/sm90/hopper_bwd.cu.j2): q, k, v and dO as
    TMA tensor maps (one 64-column box of a tile's rows, 128B swizzle), and the preprocess's rows
    of L in log2 units and D, (B, H, padded Nq) fp32, as maps of one query block's 64 floats (no
    swizzle); dQ's fp32 accumulator in whole query blocks (`dq_blocks`), summed into by bulk
    reductions; dK and dV per query head (in fp32 under GQA, as the sm80 backward's). With
    8-bit S^T and dP^T (Sm90BackwardTiles.fp8_scores), q8, k8, v8 and dout8 too, the 8-bit tensors
    (a box of d bytes a row), and no bf16 v."""
    tiles = sm90_backward_tiles(spec)
    elem = ELEM_CTYPE[spec.output_dtype]
    maps = [Param(name, TENSOR_MAP, "tensor_map", box=(1, rows, 1, BOX_COLUMNS))
            for name, rows in (("q", tiles.block_m), ("k", tiles.block_n), ("v", tiles.block_n),
                               ("dout", tiles.block_m)) if not (tiles.fp8_scores and name == "v")]
    if tiles.fp8_scores:   # S^T's and dP^T's 8-bit operands: a row of d bytes, one box (V's bf16 is not read)
        swizzle = Swizzle.B128 if spec.head_dim == 128 else Swizzle.B64
        maps += [Param(name + "8", TENSOR_MAP, "tensor_map", box=(1, rows, 1, spec.head_dim), swizzle=swizzle)
                 for name, rows in (("q", tiles.block_m), ("k", tiles.block_n), ("v", tiles.block_n),
                                    ("dout", tiles.block_m))]
    rows = [Param(name, TENSOR_MAP, "tensor_map", box=(1, 1, tiles.block_m), swizzle=Swizzle.NONE)
            for name in ("lse_log2", "delta")]
    outputs = ([_tensor("dq_blocks", "float")] + dq_order(spec) + [_tensor(n, elem) for n in ("dk_out", "dv_out")]
               + [_tensor(n, "float") for n in ("dk_out_fp32", "dv_out_fp32")])
    return tuple(maps + rows + outputs + _sizes(spec) + _strides("dk", "dv")
                 + [Param("softmax_scale", "float", "float32"), Param("softmax_scale_log2", "float", "float32")]
                 + _dropout(spec) + _variant(spec, grads=True) + (_descales(*FP8_BACKWARD_DESCALES) if spec.fp8 else []))


def _fp8_descales(spec: Spec) -> list[Param]:
    """An 8-bit spec's descales (FlashAttention-3's q_descale, k_descale, v_descale): fp32, one per
    (batch entry, K/V head), the real tensors being the e4m3 ones times them."""
    return _descales("q", "k", "v") if spec.fp8 else []


def _descales(*names: str) -> list[Param]:
    """Descale tensors by the name of what they scale: fp32, one per (batch entry, K/V head)."""
    return [_tensor(f"{name}_descale", "float", const=True) for name in names]


FP8_BACKWARD_DESCALES = ("q", "k", "v", "do")   # the sm90 main kernel's (hopper_bwd_walk.j2)


def _fp8_backward_descales(spec: Spec, *names: str) -> list[Param]:
    """A row kernel's descales of an 8-bit spec's backward (bwd_rows.j2), with kv_heads to index
    them by (batch entry, K/V head)."""
    return _descales(*names) + [Param("kv_heads", "int", "int32")] if spec.fp8 else []


def _kv_cache(spec: Spec) -> list[Param]:
    """Decoding against a KV cache (Spec.kv_cache): where each batch entry's keys live, and the
    split-KV partials. k and v arrive as `k_cache` / `v_cache` (macros.j2 `cache_views`)."""
    if spec.kv_cache is None:
        return []
    if spec.kv_cache == "paged":   # key j of entry b: page block_table[b][j / page_size], row j % page_size
        # max_pages: the table's columns; the guard refuses an entry with more keys than its row's pages hold.
        rows = [_tensor("block_table", "int", const=True), Param("block_table_stride", "int", "int32"),
                Param("page_size", "int", "int32"), Param("max_pages", "int", "int32")]
    else:                          # entry b reads cache entry cache_batch[b] from row cache_start[b] on
        rows = [_tensor("cache_batch", "int", const=True), _tensor("cache_start", "int", const=True)]
    group = [Param("pack_group", "int", "int32")] if spec.pack_gqa else []   # query heads per K/V head
    # An entry's keys end at its seqlens_k (cache_seqlens) plus the new_tokens this step appended.
    appended = [Param("new_tokens", "int", "int32")] if spec.key_padding else []
    return rows + [Param("k_cache_stride_b", "long long", "int64"), Param("v_cache_stride_b", "long long", "int64"),
                   Param("num_splits", "int", "int32"), _tensor("o_partial", "float"), _tensor("lse_partial", "float"),
                   *appended, *group, *_cache_descales(spec), *_guard()]


def cache_ctype(spec: Spec) -> str:
    """The C type of a decoding spec's cache elements: an 8-bit cache's bytes (Spec.cache_dtype),
    else dtype's."""
    return "unsigned char" if spec.cache_fp8 else ELEM_CTYPE[spec.dtype]


def _cache_descales(spec: Spec) -> list[Param]:
    """An 8-bit cache's descales (Spec.cache_dtype): fp32 (batch, Hk), the cached K and V being the
    e4m3 values times them; the append divides the new rows by them."""
    return _descales("k", "v") if spec.cache_fp8 else []


def _guard() -> list[Param]:
    """What a decoding kernel's guard needs (macros.j2 cache_views / page_sources, cache_update):
    k_cache.shape[0] (cache entries, or pages) bounds every index value read from the device, and
    an index out of range is refused and flagged in error_flag (int32 (1,), raised lazily)."""
    return [Param("cache_entries", "int", "int32"), ERROR_FLAG]


ERROR_FLAG = _tensor("error_flag", "int")


def cache_update_params(spec: Spec) -> tuple[Param, ...]:
    """The KV cache update kernel's: new keys / values appended in place, rotary on them and q."""
    elem = ELEM_CTYPE[spec.dtype]
    rows = ([_tensor("block_table", "int", const=True), Param("block_table_stride", "int", "int32"),
             Param("page_size", "int", "int32")] if spec.kv_cache == "paged"
            else [_tensor("cache_batch", "int", const=True)])
    if spec.kv_cache != "paged":   # the append is refused unless every entry's cache_leftpad fits too
        rows.append(_tensor("cache_start", "int", const=True))
    # batch_size and capacity: the guard checks every entry's rows (0 .. capacity) before any is written.
    ints = ("rotary_dim", "rotary_interleaved", "q_positions_step", "new_tokens", "seqlen_q", "heads", "kv_heads",
            "batch_size", "capacity")
    return (_tensor("q", elem, const=True), _tensor("k_new", elem, const=True), _tensor("v_new", elem, const=True),
            _tensor("q_rot", elem), _tensor("k_cache", cache_ctype(spec)), _tensor("v_cache", cache_ctype(spec)),
            _tensor("cache_seqlens", "int", const=True), *rows, _tensor("rotary_cos", elem, const=True),
            _tensor("rotary_sin", elem, const=True), *(Param(n, "int", "int32") for n in ints),
            *_strides("q", "kn", "vn", "qr", "k", "v"), *_cache_descales(spec), *_guard())


def combine_params(spec: Spec) -> tuple[Param, ...]:
    """The split-KV combine kernel's: fp32 partials (B, H, Nq, splits[, d]) in, O and L out."""
    return (_tensor("o_partial", "float", const=True), _tensor("lse_partial", "float", const=True),
            _tensor("out", ELEM_CTYPE[spec.dtype]), _tensor("lse", "float"), Param("heads", "int", "int32"),
            Param("seqlen_q", "int", "int32"), Param("num_splits", "int", "int32"), *_strides("o"))


def _variant(spec: Spec, grads: bool = False) -> list[Param]:
    """A variant's run-time values (fagen/variants), and with `grads` the backward's buffers
    for the gradients of captured tensors."""
    code = variant_code(spec)
    if code is None:
        return []
    params = [Param(*p) for p in code.params]
    return params + ([Param(*p) for p in code.grad_params] if grads else [])


def _debug(spec: Spec, debug: bool, *counters: str) -> list[Param]:
    """Test instrumentation: counters, and the dropout keep mask a kernel used."""
    if not debug:
        return []
    params = [_tensor(name, "int") for name in counters]
    if spec.dropout:
        params.append(_tensor("keep_mask", "unsigned char"))
    return params


def dq_order(spec: Spec) -> list[Param]:
    """A deterministic spec's turn counters for dQ's ordered reductions (sm90): one int per query
    block of every (batch, head), at its first row of a (B, H, padded Nq) tensor as D's rows; key
    block j's reduction into query block i waits until the counter says the earlier ones are done."""
    return [_tensor("dq_semaphore", "int")] if spec.deterministic else []


def backward_params(spec: Spec, debug: bool = False, blocked_dq: bool = False) -> dict[str, tuple[Param, ...]]:
    """The backward's kernels' parameters. dQ's fp32 accumulator is `dq_accum`, (B, H, Nq, d) row
    by row, summed into by atomics (the sm80 family; a deterministic spec's dQ comes from its own
    pass without them), or with `blocked_dq` `dq_blocks`: (B, H, padded Nq, d) in whole query blocks,
    each holding its elements in the main kernel's order (`bwd::dq_offset`), summed into block by
    block by bulk reductions, in a fixed order of key blocks when deterministic (the sm90 family:
    the preprocess then also zeroes `dq_order`'s turn counters). An 8-bit spec's kernels read its
    tensors widened to bf16 (`fp8_operands.widened`), and their descales (`_fp8_backward_descales`)."""
    elem = ELEM_CTYPE[spec.output_dtype]
    scales = [Param("softmax_scale", "float", "float32"), Param("softmax_scale_log2", "float", "float32")]
    dq_pass = spec.deterministic and not blocked_dq
    accumulator = "dq_blocks" if blocked_dq else "dq_accum"
    dq_accum = [] if dq_pass else [_tensor(accumulator, "float")] + dq_order(spec)
    # The preprocess kernel turns the forward's statistics into lse_log2 (and D) for the
    # others, in rows padded to whole backward Q blocks.
    inputs = [_tensor(n, elem, const=True) for n in ("q", "k", "v", "dout")]
    inputs += [_tensor("lse_log2", "float", const=True), _tensor("delta", "float", const=True)]
    params = {
        "bwd_preprocess": [_tensor("out", elem, const=True), _tensor("dout", elem, const=True)]
                          + _stats(spec, const=True) + [_tensor("delta", "float"), _tensor("lse_log2", "float")]
                          + dq_accum + [Param("heads", "int", "int32"), Param("seqlen_q", "int", "int32")]
                          + _strides("o", "do") + _fp8_backward_descales(spec, "o", "v"),
        # dK/dV per query head: in the element type, or in fp32 under GQA (the op sums a
        # group's heads before it rounds); the kernel writes one pair, by heads != kv_heads.
        "bwd_main": inputs + dq_accum + [_tensor(n, elem) for n in ("dk_out", "dv_out")]
                    + [_tensor(n, "float") for n in ("dk_out_fp32", "dv_out_fp32")] + _sizes(spec)
                    + _strides("q", "k", "v", "do", "dk", "dv") + scales + _dropout(spec)
                    + _variant(spec, grads=True) + _debug(spec, debug),
    }
    if dq_pass:
        params["bwd_dq"] = (inputs + [_tensor("dq", elem)] + _sizes(spec)
                            + _strides("q", "k", "v", "do", "dq") + scales + _dropout(spec) + _variant(spec))
    else:
        params["bwd_dq_convert"] = [_tensor(accumulator, "float", const=True), _tensor("dq", elem),
                                    Param("heads", "int", "int32"), Param("seqlen_q", "int", "int32")] \
                                   + _strides("dq") + [Param("softmax_scale", "float", "float32")] \
                                   + _fp8_backward_descales(spec, "k", "v", "do")
    return {role: tuple(p) for role, p in params.items()}


# Packed sequences (Spec.varlen): these kernel parameters arrive as `<name>_packed` and each
# kernel views its sequence through a local `<name>` (macros.j2 `varlen_views`), so that the
# templates index as for a padded batch. Q-side rows start at cu_seqlens_q[b], K-side rows at
# cu_seqlens_k[b]; statistics and workspaces are (B, H, max_seqlen_q[, d]) slots.
VARLEN_Q_ROWS = {"q": "q", "out": "o", "dout": "do", "dq": "dq"}
VARLEN_K_ROWS = {"k": "k", "v": "v", "dk_out": "dk", "dv_out": "dv", "dk_out_fp32": "dk", "dv_out_fp32": "dv"}
VARLEN_STATS = ("lse", "row_max", "row_sum", "row_max_out", "row_sum_out")
VARLEN_ROW_WORKSPACES = ("o_accum", "dq_accum")      # (B, H, max_seqlen_q, d)
VARLEN_BLOCK_WORKSPACES = ("dq_blocks",)             # (B, H, padded max_seqlen_q, d)
VARLEN_PADDED = ("delta", "lse_log2", "dq_semaphore")   # (B, H, padded max_seqlen_q)
VARLEN_PACKED = (*VARLEN_Q_ROWS, *VARLEN_K_ROWS, *VARLEN_STATS, *VARLEN_ROW_WORKSPACES, *VARLEN_BLOCK_WORKSPACES,
                 *VARLEN_PADDED)


def varlen_params(params: list[Param]) -> list[Param]:
    """A kernel's parameters for packed sequences: data as `_packed`, the max lengths, cu_seqlens,
    and for the guard of macros.j2 `varlen_views` the packed totals (total_q: q's rows, total_k:
    k's) and the error flag: a sequence that cu_seqlens puts outside them is refused and flagged."""
    out = []
    flagged = any(p.name == ERROR_FLAG.name for p in params)
    for p in params:
        if p.name in VARLEN_PACKED:
            out.append(replace(p, name=p.name + "_packed"))   # a tensor map keeps its box
        elif p.name in ("seqlen_q", "seqlen_k"):
            side = p.name[-1]
            out += [_tensor(f"cu_seqlens_{side}", "int", const=True), Param("max_" + p.name, p.ctype, p.kind),
                    Param(f"total_{side}", "int", "int32")]
            if not flagged:
                out.append(ERROR_FLAG)
                flagged = True
        else:
            out.append(p)
    return out


# Every kernel's last two parameters: the first head and batch of its launch. gridDim.y
# (heads) and gridDim.z (batch) stop at 65535, so `launch` splits larger grids into
# chunks and passes each chunk's offsets; the kernels add them to blockIdx.y and .z.
GRID_OFFSETS = (Param("head_offset", "int", "int32"), Param("batch_offset", "int", "int32"))


def variant_arguments(spec: Spec, variant: dict, softmax_scale: float) -> dict:
    """A variant's kernel arguments: its values (fagen.ops.variant_args: window sizes, softcap,
    ALiBi slopes, sinks, captured tensors, summaries, lifted numbers) and what follows from its
    tensors (the strides of captured tensors and of their summaries, a summary's group count,
    ALiBi's batch stride), so that callers pass values and nothing derived."""
    out = {**variant, **derived_values(variant, softmax_scale)}   # the built-ins' (variants.builtins)
    for name, value in variant.items():
        if name.startswith(("score_cap", "mask_cap")) and not name.endswith(("_gmin", "_gmax")):
            out.update({f"{name}_stride{axis}": stride for axis, stride in enumerate(value.stride())})
    for summary in (summaries(mod_expression(spec.mask_mod, "mask")) if spec.mask_mod is not None else ()):
        low = variant[f"{summary.capture}_gmin"]
        out[f"{summary.capture}_groups"] = low.shape[summary.dim]
        out.update({f"{summary.capture}_sumstride{axis}": stride for axis, stride in enumerate(low.stride())})
    return out
