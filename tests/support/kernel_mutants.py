"""Kernel mutants: named wrong kernels the suite must kill (tests/kernels/test_kernel_mutants.py).

A mutant is a small patch on a rendered variant's CUDA (or on a header it includes, which
is then inlined into the source with the patch). Each names the checks that claim to cover
it (tests/support/kernel_checks.py, the same functions the coverage tests run) and is killed when
one of them fails. Together with the barrier deletions of tests/support/barrier_mutations.py they
give the mutation score; the target is 100%.
"""

from __future__ import annotations

from fagen.kernels.render import render   # the tests compare a mutant with its render (km.render)
from fagen.arch_families import chosen_decoding_spec
from fagen.spec import Spec
import barrier_mutations
import fp8_mutants
import kernel_checks as checks
import sm90_cases
import twin_mutants
from kernel_mutant import Edit, KernelMutant, killed_by

DEFAULT_SCALE_LOG2 = "(1.4426950408889634f * rsqrtf((float)kHeadDim))"   # log2(e) / sqrt(d): the default


FA2 = Spec(64, block_m=64, block_n=32)
FA2_CAUSAL = FA2.replace(mask="causal")
FA2_PADDED_CAUSAL = FA2_CAUSAL.replace(key_padding=True)
FA2_DROPOUT = Spec(64, dropout=True)
FA2_DETERMINISTIC = Spec(64, mask="causal", deterministic=True)

MUTANTS = [
    KernelMutant("no max subtraction", FA2,
                 (Edit("const float new_max = fmaxf(row_max[rt][half], quad_max(tile_max));",
                       "const float new_max = 0.f;  // mutant: P~ = exp2(S), m pinned at 0", "online_softmax.cuh"),),
                 (checks.large_logits_check,)),
    KernelMutant("causal aligned to the padded Nk", FA2_PADDED_CAUSAL,
                 (Edit("keys - seqlen_q", "seqlen_k - seqlen_q"),), (checks.uneven_lengths_check,)),
    KernelMutant("softmax_scale ignored in the forward", FA2_CAUSAL,
                 (Edit("fagen::online_softmax_step(s, row_max, row_sum, rescale, softmax_scale_log2);",
                       f"fagen::online_softmax_step(s, row_max, row_sum, rescale, {DEFAULT_SCALE_LOG2});"),),
                 (checks.softmax_scale_forward_check,)),
    KernelMutant("softmax_scale ignored in the backward", FA2_CAUSAL,
                 (Edit("fmaf(st[kt][qt][e], softmax_scale_log2, ",
                       f"fmaf(st[kt][qt][e], {DEFAULT_SCALE_LOG2}, "),),
                 (checks.softmax_scale_check,)),
    KernelMutant("the last key tile dropped", FA2,
                 (Edit("const int num_tiles = (key_limit + kBlockN - 1) / kBlockN;",
                       "const int num_tiles = key_limit / kBlockN;"),), (checks.ragged_check,)),
    KernelMutant("the O rescale omitted when the max changes", FA2,
                 (Edit("fagen::rescale_rows(o, rescale);", "/* mutant: no O rescale */"),), (checks.ragged_check,)),
    KernelMutant("L written as -inf for empty rows", FA2_CAUSAL,
                 (Edit("logf(total) : fagen::infinity();", "logf(total) : -fagen::infinity();"),),
                 (checks.empty_rows_check,)),
    KernelMutant("the dropout offset shifted in the backward", FA2_DROPOUT,
                 (Edit("fagen::dropout_words(seed, philox_offset, batch, head, heads, group_row, group_col)",
                       "fagen::dropout_words(seed, philox_offset + 1u, batch, head, heads, group_row, group_col)"),),
                 (checks.ragged_check,)),
    KernelMutant("the GQA head mapping head % kv_heads", FA2,
                 (Edit("const int kv_head = head / (heads / kv_heads);", "const int kv_head = head % kv_heads;"),),
                 (checks.gqa_check,)),
    KernelMutant("D computed from dO * dO", FA2,
                 (Edit("partial += fagen::to_float(o_row[c]) * fagen::to_float(do_row[c]);",
                       "partial += fagen::to_float(do_row[c]) * fagen::to_float(do_row[c]);"),),
                 (checks.ragged_check,)),
    KernelMutant("an atomic dQ in the deterministic variant", FA2_DETERMINISTIC,
                 (Edit("        *reinterpret_cast<unsigned*>(dq_row + col) = fagen::pack2<elem_t>(",
                       "        atomicAdd(reinterpret_cast<float*>(dq_row + col), 0.f);  // mutant\n"
                       "        *reinterpret_cast<unsigned*>(dq_row + col) = fagen::pack2<elem_t>("),),
                 (checks.no_atomics_check,)),
]
# FA-1's forward is its own kernel (its backward is FA-2's, with L built from m and l).
FA1 = Spec(64, version=1, block_m=64, block_n=32)
FA1_PADDED_CAUSAL = FA1.replace(mask="causal", key_padding=True)
MUTANTS += [
    KernelMutant("FA-1: no max subtraction", FA1, MUTANTS[0].edits, (checks.large_logits_check,)),
    KernelMutant("FA-1: causal aligned to the padded Nk", FA1_PADDED_CAUSAL, MUTANTS[1].edits,
                 (checks.uneven_lengths_check,)),
    KernelMutant("FA-1: softmax_scale ignored in the forward", FA1_PADDED_CAUSAL,
                 (Edit("fagen::online_softmax_step(s, tile_max, tile_sum, unused, softmax_scale_log2);",
                       f"fagen::online_softmax_step(s, tile_max, tile_sum, unused, {DEFAULT_SCALE_LOG2});"),),
                 (checks.softmax_scale_forward_check,)),
    KernelMutant("FA-1: the O rescale omitted when the max changes", FA1,
                 (Edit("a = exp2f(m_old - offset) * l_old,", "a = l_old,  /* mutant: no e^(m_i - m_new) */"),),
                 (checks.ragged_check,)),
    KernelMutant("FA-1: m left at 0 for empty rows", FA1_PADDED_CAUSAL,
                 (Edit("row_max_out[stat0 + row] = -fagen::infinity();", "row_max_out[stat0 + row] = 0.f;"),),
                 (checks.empty_rows_check,)),
    KernelMutant("FA-1: L in the backward without log l", FA1,
                 (Edit("row_max[stat] * fagen::kLog2e + log2f(l)", "row_max[stat] * fagen::kLog2e"),),
                 (checks.ragged_check,)),
]


def _documents() -> Spec:
    from fagen.variants import custom_mod, trace_mask_mod

    return FA2.replace(mask_mod=custom_mod(trace_mask_mod(checks.document_mask)))


# Variants (fagen/variants): their device functions and the template steps that call them.
MUTANTS += [
    KernelMutant("softcap: the chain rule through the score dropped", FA2.replace(softcap=True),
                 (Edit("dpt[kt][qt][e] = ds * grad;", "dpt[kt][qt][e] = ds;"),), (checks.variant_check,)),
    KernelMutant("sinks: rows start from -inf, not from the sink", FA2.replace(sinks=True),
                 (Edit("row_max[rt][half] = sink_max, row_sum[rt][half] = lane % 4 == 0 ? 1.f : 0.f;",
                       "row_max[rt][half] = -fagen::infinity(), row_sum[rt][half] = 0.f;"),),
                 (checks.variant_check,)),
    KernelMutant("sinks: the logit left in natural-log units beside raw scores", FA2.replace(sinks=True),
                 (Edit("const float sink_max = sinks[head] / softmax_scale;", "const float sink_max = sinks[head];"),),
                 (checks.variant_check,)),
    KernelMutant("window: one key too many on the right", FA2.replace(window=True),
                 (Edit("kv_idx <= ctx.keys + q_idx - ctx.seqlen_q + ctx.window_right",
                       "kv_idx <= ctx.keys + q_idx - ctx.seqlen_q + ctx.window_right + 1"),),
                 (checks.variant_check,)),
    KernelMutant("ALiBi: the distance without the bottom-right offset Nk - Nq", FA2.replace(softcap=True, alibi=True),
                 (Edit("abs((ctx.keys - kv_idx) + (q_idx - ctx.seqlen_q))", "abs(q_idx - kv_idx)"),),
                 (checks.variant_check,)),
    KernelMutant("ALiBi alone: the raw scores' bias without the offset Nk - Nq", FA2.replace(alibi=True),
                 (Edit("(float)(q_idx + ctx.keys - ctx.seqlen_q)", "(float)(q_idx)"),), (checks.variant_check,)),
    KernelMutant("softcap alone: the exponent scaled by log2(e), not by the cap's c log2(e)", FA2.replace(softcap=True),
                 (Edit("rescale, ctx.softcap_log2);", "rescale, fagen::kLog2e);"),), (checks.variant_check,)),
    KernelMutant("softcap alone: the backward's chain rule through tanh dropped", FA2.replace(softcap=True),
                 (Edit("const float grad = 1.f - t * t;", "const float grad = 1.f;"),), (checks.variant_check,)),
    KernelMutant("softcap alone: L from the cap's units without the cap", FA2.replace(softcap=True),
                 (Edit("row_max[rt][half] * ctx.softcap + logf(total)", "row_max[rt][half] + logf(total)"),),
                 (checks.variant_check,)),
    KernelMutant("documents: tiles whose id ranges touch skipped as empty", _documents(),
                 (Edit("mask_cap0_qmax < mask_cap0_kvmin", "mask_cap0_qmax <= mask_cap0_kvmin"),
                  Edit("mask_cap0_kvmax < mask_cap0_qmin", "mask_cap0_kvmax <= mask_cap0_qmin")),
                 (checks.variant_check,)),
]
# Decoding (Spec.kv_cache): the cache views, the page lookup, the splits, the combine, the update.
# The cases have two query heads per K/V head, so their steps pack them (Spec.pack_gqa).
DECODE_PAGED = Spec.for_kv_cache(64, "fp16", causal=True, page_size=48, pack_gqa=True)   # 16-key tiles, 3 per page
DECODE_CACHE = Spec.for_kv_cache(64, "fp16", causal=True, page_size=None, pack_gqa=True)
DECODE_WINDOW = Spec.for_kv_cache(64, "fp16", causal=False, page_size=None, window=True, pack_gqa=True)
MUTANTS += [
    KernelMutant("paged: every K tile read from its page's first rows", DECODE_PAGED,
                 (Edit("(long long)page_row * k_stride_n", "0LL"),), (checks.kv_cache_check,)),
    KernelMutant("paged: the page cursor steps to the next page one tile late", DECODE_PAGED,
                 (Edit("if (page_row == page_size)", "if (page_row > page_size)"),), (checks.kv_cache_check,)),
    KernelMutant("cache_leftpad ignored by the keys", DECODE_CACHE,
                 (Edit("(long long)cache_start[batch] * k_stride_n", "0"),), (checks.kv_cache_check,)),
    KernelMutant("the keys appended this step not counted (contiguous cache)", DECODE_CACHE,
                 (Edit("(long long)seqlens_k[batch] + new_tokens", "(long long)seqlens_k[batch]"),),
                 (checks.kv_cache_check,)),
    KernelMutant("the keys appended this step not counted (paged cache)", DECODE_PAGED,
                 (Edit("(long long)seqlens_k[batch] + new_tokens", "(long long)seqlens_k[batch]"),),
                 (checks.kv_cache_check,)),
    KernelMutant("split-KV: splits overlap by a tile", DECODE_PAGED,
                 (Edit("min(split_share, num_tiles_all", "min(split_share + 1, num_tiles_all"),),
                  (checks.kv_cache_check,)),
    KernelMutant("combine: splits weighed by the largest L, not by L", DECODE_PAGED,
                 (Edit("expf(split_lse[s] - row_lse) * o_partial", "expf(split_lse[s] - max_lse) * o_partial"),),
                 (checks.kv_cache_check,)),
    KernelMutant("rotary: the pair's second member turned the wrong way", DECODE_CACHE,
                 (Edit(": value * c + other * s;", ": value * c - other * s;"),), (checks.kv_cache_check,)),
    KernelMutant("GQA packing: the window evaluated at the packed row", DECODE_WINDOW,
                 (Edit("packed_query[rt][half] = r / pack_group,", "packed_query[rt][half] = r,"),
                  Edit("const fagen_variant::Context ctx = {query_len,", "const fagen_variant::Context ctx = {seqlen_q,")),
                 (checks.packed_window_check,)),
]
# V's head dim below Q's: the d_v index paths (O's columns, D, dP's k-steps, dV's slices).
HEAD_DIM_V = Spec(128, head_dim_v=64, mask="causal")
HEAD_DIM_V_SLICED = Spec(192, head_dim_v=128)   # four warps split d (48 columns) and d_v (32)
WIDE = Spec(320, mask="causal")   # pairs of warps split O's columns (Spec.column_split)
WIDE_DETERMINISTIC = Spec(320, deterministic=True)   # ... and the dQ kernel's
DECODE_MLA = Spec.for_kv_cache(576, "fp16", causal=False, page_size=64, pack_gqa=True, head_dim_v=512, v_from_k=True)
DECODE_PAGED_V = Spec.for_kv_cache(64, "fp16", causal=True, page_size=48, pack_gqa=True, head_dim_v=32)
MUTANTS += [
    KernelMutant("d_v: V's last 8 columns not copied", HEAD_DIM_V,
                 (Edit("TileCopy<kBlockN, kHeadDimV, kHeadDimVPad, kRowElems, kThreads> v_copy",
                       "TileCopy<kBlockN, kHeadDimV - 8, kHeadDimVPad, kRowElems, kThreads> v_copy"),),
                 (checks.ragged_check,)),
    KernelMutant("d_v: D summed over d columns", HEAD_DIM_V,
                 (Edit("for (int c = lane; c < kHeadDimV; c += 32) partial +=",
                       "for (int c = lane; c < kHeadDim; c += 32) partial +="),), (checks.ragged_check,)),
    KernelMutant("d_v: dP's k-steps over d", HEAD_DIM_V_SLICED,
                 (Edit("<kKeyTiles, kQueryTiles, kDimStepsV, kRowElems>(dpt, v_tile",
                       "<kKeyTiles, kQueryTiles, kDimSteps, kRowElems>(dpt, v_tile"),), (checks.ragged_check,)),
    KernelMutant("d_v: dV's slices at dK's columns", HEAD_DIM_V_SLICED,
                 (Edit("(dv, st, do_tile, col0_v)", "(dv, st, do_tile, col0)"),), (checks.ragged_check,)),
    KernelMutant("d > 256: both warps of a row group accumulate O's first columns", WIDE,
                 (Edit("(o, s, v_tile, col0_v)", "(o, s, v_tile, 0)"),), (checks.ragged_check,)),
    KernelMutant("d > 256: both warps of a row group accumulate dQ's first columns", WIDE_DETERMINISTIC,
                 (Edit("(dq_acc, dp, k_tile, col0_q)", "(dq_acc, dp, k_tile, 0)"),), (checks.ragged_check,)),
    KernelMutant("MLA: the append writes V's columns of the row only", DECODE_MLA,
                 (Edit("(void)v_src, (void)v_dst;\n    for (int col = threadIdx.x; col < kHeadDim;",
                       "(void)v_src, (void)v_dst;\n    for (int col = threadIdx.x; col < 512;"),), (checks.mla_check,)),
    KernelMutant("MLA: V read from the K stage after this one", DECODE_MLA,
                 (Edit("const elem_t* v_tile = v_stages + (j % kStages) * kStageElems;",
                       "const elem_t* v_tile = v_stages + ((j + 1) % kStages) * kStageElems;"),), (checks.mla_check,)),
    KernelMutant("d_v: a paged cache's V tiles copied by K's plan", DECODE_PAGED_V,
                 (Edit("v_next = v_copy.source(v_head + page", "v_next = kv_copy.source(v_head + page"),),
                  (checks.kv_cache_check,)),
    KernelMutant("d_v: a split's partial O misses its last 8 columns", DECODE_PAGED_V,
                 (Edit("if (col < kHeadDimV)\n            *reinterpret_cast<float2*>(o_partial",
                       "if (col < kHeadDimV - 8)\n            *reinterpret_cast<float2*>(o_partial"),),
                 (checks.kv_cache_check,)),
]
# The sm90 family's forward (templates/sm90/hopper_fwd.cu.j2): its pipeline's barriers and its registers' layouts.
SM90 = Spec(64, dtype="fp16", arch_family="sm90")
FULL_WAIT = "    fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(j / kStages) & 1);\n"
MUTANTS += [KernelMutant(f"sm90: {name}", SM90, (Edit(old, new),), (checks.sm90_pipeline_check,))
            for name, old, new in [
    ("the consumers' wait for a full stage deleted", FULL_WAIT, ""),
    ("the full barrier's parity flipped", "static_cast<uint32_t>(j / kStages) & 1);",
     "(static_cast<uint32_t>(j / kStages) & 1) ^ 1);"),
    ("the producer's wait for an empty stage deleted",
     "    fagen::mbarrier_wait_parity(&bars->empty[s], (round & 1) ^ 1);", ""),
    ("a consumer warp's release of a stage deleted",
     "  if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);\n", ""),
    ("the producer's stage off by one", "const int s = t % kStages, j = first_tile + t;",
     "const int s = (t + 1) % kStages, j = first_tile + t;"),
    ("P's A fragment with its two rows swapped", "pack2(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1])",
     "pack2(p[8 * kk + 2 * (r ^ 1)], p[8 * kk + 2 * (r ^ 1) + 1])"),
    ("S read before its wgmma group retires", "fagen::wgmma_wait<1>();", "fagen::wgmma_wait<2>();"),
    ("the wgmma fence before a step's GEMMs deleted",
     "    fagen::wgmma_fence();   // P was written since the last groups\n", ""),
    ("the ping-pong turns not taken", "    wait_turn();\n", ""),
    ("O's shared writes not fenced for the TMA store", "  fagen::fence_proxy_async_shared();   // the writes above", "  // the writes above"),
    ("the TMA store of O issued before its warpgroup's writes", "  fagen::named_barrier_sync(kEpilogue + consumer, 128);", "  // (deleted)"),
    ("O written to shared memory unswizzled", "swizzled = chunk ^ (local % 8);", "swizzled = chunk;"),
    ("P written into P V's A registers before that P V retires",
     "    fagen::wgmma_wait<0>();   // P_{j-1} V_{j-1} has landed",
     "    probabilities_as_a(p, a);\n    fagen::wgmma_wait<0>();   // P_{j-1} V_{j-1} has landed"),
]]
MUTANTS.append(KernelMutant("sm90: a window's first tile skipped", SM90.replace(window=True),
                            (Edit("return {seen.first / kBlockN, seen.last / kBlockN + 1};",
                                  "return {seen.first / kBlockN + 1, seen.last / kBlockN + 1};"),),
                            (checks.variant_check,)))
MUTANTS.append(KernelMutant("sm90: dropout keyed on each 8 keys' first pair", SM90.replace(dropout=True),
                            (Edit("key0 + 8 * c + dropout.col_offset", "key0 + dropout.col_offset"),),
                            (checks.ragged_check,)))
MUTANTS.append(KernelMutant("sm90: rows start from -inf, not from the sink", SM90.replace(sinks=True),
                            (Edit("  c.start_from(sink);\n", ""),), (checks.variant_check,)))
MUTANTS.append(KernelMutant("sm90: ALiBi's bias not added", SM90.replace(alibi=True),
                            (Edit("    bias(j);\n", ""),), (checks.variant_check,)))
MUTANTS.append(KernelMutant("sm90: the softcap's tanh not applied", SM90.replace(softcap=True),
                            (Edit("    cap();\n", ""),), (checks.variant_check,)))
MUTANTS.append(KernelMutant("sm90: packed sequences' K and V read from the first sequence's rows",
                            SM90.replace(varlen=True, mask="causal"),
                            (Edit("kv_row0 + j * kBlockN, kv_head", "j * kBlockN, kv_head"),),
                            (checks.packed_forward_check,)))
MUTANTS.append(KernelMutant("sm90: the score chain (ALiBi with a softcap) skipped past the first tile",
                            SM90.replace(alibi=True, softcap=True), (Edit("    score(j);\n", ""),),
                            (checks.variant_check,)))
MUTANTS.append(KernelMutant("sm90: a mask_mod's tiles taken as full", _documents().replace(arch_family="sm90"),
                            (Edit("fagen_variant::kFullTile;\n  }", "fagen_variant::kFullTile && false;\n  }"),),
                            (checks.variant_check,)))

# The sm90 family's backward (templates/sm90/hopper_bwd.cu.j2): its pipeline's barriers, the bulk
# reduction's read wait, and the layouts of dS^T, L and D. Each edit's text is the backward's alone.
SM90_BWD = Spec(64, dtype="bf16", mask="causal", arch_family="sm90")
MUTANTS += [KernelMutant(f"sm90 backward: {name}", SM90_BWD, (Edit(old, new),), (checks.sm90_backward_check,))
            for name, old, new in [
    ("the consumers' wait for a full stage deleted",
     "    fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(it / kStages) & 1);\n", ""),
    ("the consumers' wait for K and V deleted", "  fagen::mbarrier_wait_parity(&bars->kv_full, 0);\n", ""),
    ("the producer's wait for an empty stage deleted",
     "    fagen::mbarrier_wait_parity(&bars->empty[s], (static_cast<uint32_t>(it / kStages) & 1) ^ 1);", ""),
    ("the dQ tile rewritten before its bulk reduction has read it",
     "        fagen::bulk_wait_group_read<0>();\n", ""),
    ("the writer's wait for a consumer's dQ tile deleted",
     "      fagen::named_barrier_sync(kDqFullBarrier + c, kWriterThreads);\n", ""),
    ("the consumers' wait for the writer to hand their tiles back deleted",
     "    if (i > first) fagen::named_barrier_sync(sync_id + 2 * kConsumers, kWriterThreads);\n", ""),
    ("dS^T's 8 x 8 fragments stored transposed", "fagen::stmatrix_x4(tile", "fagen::stmatrix_x4_trans(tile"),
    ("L read from the neighbouring query's row", "scale_log2 - lse_log2[col])", "scale_log2 - lse_log2[col ^ 1])"),
    ("D read from the neighbouring query's row", "delta[8 * (i / 4) + 2 * quad + i % 2]",
     "delta[(8 * (i / 4) + 2 * quad + i % 2) ^ 1]"),
    ("dS^T made before dP^T's wgmma group retires",
     "    fagen::wgmma_wait<0>();\n    fagen::wgmma_fence_operands<kBlockM>(dpt);\n    dscores(",
     "    fagen::wgmma_fence_operands<kBlockM>(dpt);\n    dscores("),
    # d = 64's 128-query blocks (sm90_backward_tiles): the second 64 queries in dS^T's, dQ's halves.
    ("dS^T's second 64 queries stored over its first", "tile_window + box * kDsBox + key * 128",
     "tile_window + key * 128"),
    ("dQ's second 64 queries computed from the first's dS", "advance(dsd, half * kDsBox + kk * 2048)",
     "advance(dsd, kk * 2048)"),
    ("dQ's second 64 queries stored over its first", "dq, dq_tile + half * 64 * kHeadDim, 0, t)", "dq, dq_tile, 0, t)"),
    ("dq_blocks read back row by row by dQ's conversion", "dq_block[fagen::dq_block_offset<kHeadDim>(idx / kHeadDim, col)]",
     "dq_block[idx]"),
    ("the causal walk starting a query block late", "return {row <= 0 ? 0 : (row >= nq ? end : row / kBlockM), end};",
     "return {row <= 0 ? 1 : (row >= nq ? end : row / kBlockM + 1), end};"),
    ("a causal block on the diagonal walked without its mask",
     "max(first, (last_key + kBlockM - 1) / kBlockM)", "max(first, last_key / kBlockM)"),
    ("dK not scaled (GQA's fp32 dK)", "make_float2(dk[i] * scale, dk[i + 1] * scale)", "make_float2(dk[i], dk[i + 1])"),
    ("dQ's tile handed to the writer before the warpgroup has written it",
     "    fagen::fence_proxy_async_shared();   // the tile's stores, visible to the bulk reduction's async proxy\n"
     "    fagen::named_barrier_arrive(sync_id + kConsumers, kWriterThreads);   // the tile is the writer's (write_dq)\n",
     ""),
]]
# dq_blocks (fagen/dq_blocks.cuh): dQ's partials in the accumulators' order, zeroed by the preprocess.
MUTANTS += [
    KernelMutant("sm90 backward: dQ's partials stored at the neighbouring rows' places in dq_blocks", SM90_BWD,
                 (Edit("reinterpret_cast<float4*>(rows) + 128 * j0 + t;", "reinterpret_cast<float4*>(rows) + 128 * j0 + (t ^ 4);",
                       header="dq_blocks.cuh"),), (checks.sm90_backward_check,)),
    KernelMutant("sm90 backward: a query block of dq_blocks zeroed only at its first 16 rows' places", SM90_BWD,
                 (Edit("    dq_block[idx] = make_float4(0.f, 0.f, 0.f, 0.f);",
                       "    if (idx < 4 * kHeadDim) dq_block[idx] = make_float4(0.f, 0.f, 0.f, 0.f);"),),
                 (checks.sm90_backward_check,)),
]
# d = 128: a row's second 64-column box, in each operand that spans d.
SM90_BWD_128 = Spec(128, dtype="bf16", mask="causal", arch_family="sm90")
MUTANTS += [KernelMutant(f"sm90 backward d128: {name}", SM90_BWD_128, (Edit(old, new),), (checks.sm90_backward_check,))
            for name, old, new in [
    ("S^T's and dP^T's k-steps past the first box read the first box again",
     "const uint32_t a_step = kk / 4 * kKBox + kk % 4 * 32, b_step = kk / 4 * kQBox + kk % 4 * 32;",
     "const uint32_t a_step = kk % 4 * 32, b_step = kk / 4 * kQBox + kk % 4 * 32;"),
    ("dV's and dK's second 64 columns read from the first box (Q's MN-major LBO)",
     "q_mn_desc = fagen::make_smem_desc(base + kStageOffset, kQBox, 1024", "q_mn_desc = fagen::make_smem_desc(base + kStageOffset, 0, 1024"),
    ("dQ's second 64 columns computed from K's first box (its MN-major LBO)",
     "k_mn_desc = fagen::make_smem_desc(base + kKOffset + mine, kKBox, 1024",
     "k_mn_desc = fagen::make_smem_desc(base + kKOffset + mine, 0, 1024"),
]]
# The paired form (d > 128, templates/sm90/hopper_bwd_paired.cu.j2): two warpgroups share the key block,
# each making half of P^T and dS^T; one accumulates dK, the other dV; dQ's boxes split between them
# into one tile. d = 192: three boxes (the first warpgroup takes two), two stages; d = 256: one stage;
# d_v != d.
SM90_BWD_PAIRED = Spec(192, dtype="bf16", mask="causal", arch_family="sm90")
SM90_BWD_PAIRED_V = Spec(192, head_dim_v=128, dtype="bf16", arch_family="sm90")   # DeepSeek-V3's 192/128
SM90_BWD_PAIRED_DROPOUT = Spec(128, dtype="bf16", mask="causal", dropout=True, arch_family="sm90")
MUTANTS += [KernelMutant(f"sm90 paired backward: {name}", spec, (Edit(old, new),), (checks.sm90_backward_check,))
            for name, spec, old, new in [
    ("the consumers' wait for a full stage deleted", SM90_BWD_PAIRED,
     "    fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(it / kStages) & 1);\n", ""),
    ("the producer's wait for its one stage to empty deleted",
     Spec(256, dtype="bf16", mask="causal", arch_family="sm90"),
     "    fagen::mbarrier_wait_parity(&bars->empty[s], (static_cast<uint32_t>(it / kStages) & 1) ^ 1);", ""),
    ("P^T and dS^T read before the other warpgroup has stored its half", SM90_BWD_PAIRED,
     "    fagen::named_barrier_sync(kSyncBarrier, kConsumerThreads);\n", ""),
    ("the consumers' wait for the writer to hand the tiles back deleted", SM90_BWD_PAIRED,
     "    if (i > first) fagen::named_barrier_sync(kDqEmptyBarrier, kWriterThreads);\n", ""),
    ("the writer's wait for the dQ tile deleted", SM90_BWD_PAIRED,
     "      fagen::named_barrier_sync(kDqFullBarrier + c, kWriterThreads);\n", ""),
    ("the dQ tile rewritten before its bulk reduction has read it", SM90_BWD_PAIRED,
     "        fagen::bulk_wait_group_read<0>();\n", ""),
    ("the dQ tile handed to the writer before the warpgroups have written it", SM90_BWD_PAIRED,
     "    fagen::fence_proxy_async_shared();   // the tile's stores, visible to the bulk reduction's async proxy\n"
     "    fagen::named_barrier_arrive(kDqFullBarrier, kWriterThreads);   // the tile is the writer's (write_dq)\n", ""),
    ("the second warpgroup's S^T made from the first half's queries", SM90_BWD_PAIRED,
     "base + kStageOffset + query_half * 128, 16", "base + kStageOffset, 16"),
    ("L read from the first half's rows", SM90_BWD_PAIRED, "probabilities<kMasked>(st, rows + query_half,",
     "probabilities<kMasked>(st, rows,"),
    ("D read from the first half's rows", SM90_BWD_PAIRED, "dscores(st, dpt, rows + kBlockM + query_half,",
     "dscores(st, dpt, rows + kBlockM,"),
    ("a half's second k16 step stored over its first", SM90_BWD_PAIRED,
     "const uint32_t query = query0 + 16 * kk + 8 * (matrix / 2);", "const uint32_t query = query0 + 8 * (matrix / 2);"),
    ("dK made from P^T and dV from dS^T", SM90_BWD_PAIRED, "consumer == 0 ? ds_window : p_window",
     "consumer == 0 ? p_window : ds_window"),
    ("both warpgroups computing dQ's even boxes", SM90_BWD_PAIRED, "kKOffset + consumer * kKBox, kKBox",
     "kKOffset, kKBox"),
    ("both warpgroups storing into dQ's even boxes", SM90_BWD_PAIRED, "dq_tile, 8 * (2 * pass + consumer), t)",
     "dq_tile, 8 * (2 * pass), t)"),
    ("S^T's and dP^T's k-steps past the first box read the first box again", SM90_BWD_PAIRED,
     "const uint32_t a_step = kk / 4 * kKBox + kk % 4 * 32, b_step = kk / 4 * kQBox + kk % 4 * 32;",
     "const uint32_t a_step = kk % 4 * 32, b_step = kk / 4 * kQBox + kk % 4 * 32;"),
    ("dK not scaled (GQA's fp32 dK)", SM90_BWD_PAIRED, "consumer.key0, seqlen_k, softmax_scale,",
     "consumer.key0, seqlen_k, 1.f,"),
    # d_v != d: V's, dO's and dV's own width.
    ("dP^T's k-steps past d_v read from Q's tile", SM90_BWD_PAIRED_V, "product_over_d<kHeadDimV>(dpt",
     "product_over_d<kHeadDim>(dpt"),
    ("the producer's stages two Q tiles apart", SM90_BWD_PAIRED_V,
     "tiles + kStageOffset + s * kStageBytes;\n      unsigned char* rows",
     "tiles + kStageOffset + s * 2 * kQTileBytes;\n      unsigned char* rows"),
    ("dV's tile loaded d wide", SM90_BWD_PAIRED_V, "load_boxes<kBoxesV>(tiles + kVOffset", "load_boxes(tiles + kVOffset"),
    # Dropout at d = 128 (which spilled beside the other form's dK and dV): each half's own keep bits.
    ("the keep bits of the first half's queries drawn for both", SM90_BWD_PAIRED_DROPOUT,
     "keep_bits(dropout, batch, head, i * kBlockM + query_half,", "keep_bits(dropout, batch, head, i * kBlockM,"),
    ("dV not scaled by 1 / (1 - p)", SM90_BWD_PAIRED_DROPOUT, "consumer.key0, seqlen_k, keep_scale,",
     "consumer.key0, seqlen_k, 1.f,"),
]]
# Dropout (d = 64): the keep bits of the transposed tile, half of them drawn by the partner lane.
SM90_BWD_DROPOUT = SM90_BWD.replace(dropout=True)
MUTANTS += [KernelMutant(f"sm90 backward dropout: {name}", SM90_BWD_DROPOUT, (Edit(old, new),),
                         (checks.sm90_backward_check,))
            for name, old, new in [
    ("the keep bits of the partner's pair taken as the lane's own",
     "keep[0] = (parity ? theirs : mine) >> parity;\n  keep[1] = (parity ? mine : theirs) >> parity;",
     "keep[0] = (parity ? mine : theirs) >> parity;\n  keep[1] = (parity ? theirs : mine) >> parity;"),
    ("the keep bits of the transposed tile read in the forward's order",
     "(4 * (2 * (i / 8) + i % 2) + 2 * ((i / 4) % 2))", "(4 * (2 * (i / 8) + (i / 4) % 2) + 2 * (i % 2))"),
    ("dV not scaled by 1 / (1 - p)", "pack2(dv[i] * dv_scale, dv[i + 1] * dv_scale)", "pack2(dv[i], dv[i + 1])"),
]]
# A variant's mask (a window; document ids through summaries): its walk and its tile classes.
SM90_BWD_WINDOW = Spec(64, window=True, dtype="bf16", arch_family="sm90")
MUTANTS += [KernelMutant(f"sm90 backward variant: {name}", spec, (Edit(old, new),), (checks.variant_check,))
            for name, spec, old, new in [
    ("partial blocks walked as full", SM90_BWD_WINDOW, "if (tile == fagen_variant::kFullTile && !ragged_keys)",
     "if (tile != fagen_variant::kEmptyTile && !ragged_keys)"),
    ("the walk starting a query block past query_range's first", SM90_BWD_WINDOW,
     "return {met.first / kBlockM, met.last / kBlockM + 1};", "return {met.first / kBlockM + 1, met.last / kBlockM + 1};"),
    ("every document block classed as full", _documents().replace(arch_family="sm90"),
     "block_keys, ctx);", "block_keys, ctx) * 0 + fagen_variant::kFullTile;"),
    ("the softcap's chain rule dropped from dS", SM90_BWD_WINDOW.replace(window=False, softcap=True),
     "    dp[i] = ds * grad[i];\n", "    dp[i] = ds;\n"),
    ("ALiBi's bias left out of P", SM90_BWD_WINDOW.replace(window=False, alibi=True),
     "fagen_variant::alibi_biased(s[i], query, key, alibi_scale, ctx) * scale_log2", "s[i] * scale_log2"),
    ("the softcap's chain rule dropped from dS under dropout",
     SM90_BWD_WINDOW.replace(window=False, softcap=True, dropout=True), "    dp[i] = ds * grad[i];\n", "    dp[i] = ds;\n"),
]]
# A score_mod over a captured bias table: its gradient, taken from dS.
SM90_BWD_BIAS = Spec(64, mask="causal", arch_family="sm90", **sm90_cases.traced(sm90_cases.relative_bias))
MUTANTS += [KernelMutant(f"sm90 backward variant: {name}", SM90_BWD_BIAS, (Edit(old, new),),
                         (sm90_cases.relative_bias_check,))
            for name, old, new in [
    ("the captured bias's gradient never added", "    if (ds != 0.f) {\n", "    if (ds != ds) {\n"),
    ("the captured bias's gradient from the key's row", "min(query, ctx.seqlen_q - 1), min(key, ctx.keys - 1), ctx);",
     "min(key, ctx.seqlen_q - 1), min(query, ctx.keys - 1), ctx);"),
]]
# ... and in the paired form (d = 128, where the other form spilled): the element's query is its half's.
MUTANTS.append(KernelMutant("sm90 paired backward: the captured bias's gradient at the first half's queries",
                            Spec(128, mask="causal", arch_family="sm90", **sm90_cases.traced(sm90_cases.relative_bias)),
                            (Edit("x, batch, head, key0, i * kBlockM + query_half, ctx",
                                  "x, batch, head, key0, i * kBlockM, ctx"),),
                            (sm90_cases.relative_bias_check,)))
# deterministic=True: the bias's gradient in an order-free sum (fagen/exact_sum.cuh); the header's
# unit tests (tests/kernels/test_exact_sum.py) check its order-freedom, these its use.
MUTANTS += [KernelMutant(f"deterministic captured gradient: {name}", SM90_BWD_BIAS.replace(deterministic=True),
                         (Edit(old, new, header="exact_sum.cuh"),), (sm90_cases.relative_bias_check,))
            for name, old, new in [
    ("the carry into the next digit dropped",
     "  atomicAdd(reinterpret_cast<unsigned long long*>(words + digit + 1), static_cast<unsigned long long>(high));\n",
     ""),
    ("a normal float's place off by one", "const int place = biased ? biased - 1 : 0;",
     "const int place = biased;"),
    ("the sign dropped", "const int sign = static_cast<int>(bits) >> 31;", "const int sign = 0;"),
]]
# deterministic=True: dQ's turns (templates/sm90/hopper_bwd_dq_order.j2).
SM90_BWD_TURNS = SM90_BWD.replace(deterministic=True, dtype="fp16")   # bf16's rounding hides a reordered sum
MUTANTS += [KernelMutant(f"sm90 backward deterministic: {name}", SM90_BWD_TURNS, (Edit(old, new),),
                         (checks.sm90_turns_check,))
            for name, old, new in [
    ("the turn's wait deleted", "        fagen::semaphore_wait_eq(turns, dq_turn(n_block, c));\n", ""),
    ("the turns' order flipped (a block waits for later ones)", "{ return n_block * kConsumers + consumer; }",
     "{ return (static_cast<int>(gridDim.x) - 1 - n_block) * kConsumers + consumer; }"),
    ("the turn passed on before the partial's writes are done",
     "        fagen::bulk_wait_group<0>();\n        fagen::semaphore_arrive(turns);\n",
     "        fagen::semaphore_arrive(turns);\n"),
    ("the turn passed on once the partial's source is read, its writes maybe not",
     "        fagen::bulk_wait_group<0>();\n        fagen::semaphore_arrive(turns);\n",
     "        fagen::bulk_wait_group_read<0>();\n        fagen::semaphore_arrive(turns);\n"),
    ("the last query block's turn never passed on",
     "        fagen::semaphore_arrive(turns);\n", "        if (i + 1 < blocks.end) fagen::semaphore_arrive(turns);\n"),
    ("the counters left unzeroed", "  if (threadIdx.x == 0) dq_semaphore[padded0 + blockIdx.x * kBlockM] = 0;\n", ""),
]]
MUTANTS.append(KernelMutant("sm90 backward: keys past Nk left unmasked (TMA's zero rows)", SM90_BWD.replace(mask="none"),
                            (Edit("const bool visible = key < nk && (", "const bool visible = ("),),
                            (checks.negative_scores_check,)))
# Decoding on the sm90 family (templates/sm90/hopper_kv_cache.j2): where a tile's keys lie in the cache,
# the splits, and packed rows' diagonal: 128-key tiles, from pages of 48 rows (a box per 16 keys),
# over entries of up to 94 keys (kv_cache_check) or of 450 and 300 (long_cache_check).
SM90_PAGED = chosen_decoding_spec(DECODE_PAGED, "sm90", None)
SM90_CACHE = chosen_decoding_spec(DECODE_CACHE.replace(mask="none"), "sm90", None)
MUTANTS += [KernelMutant(f"sm90 decoding: {name}", spec, (Edit(old, new),), (check,))
            for name, spec, check, old, new in [
    ("every tile read from the entry's first page", SM90_PAGED, checks.kv_cache_check,
     "listed = pages[key / page_size];", "listed = pages[0 * page_size];"),
    ("cache_leftpad ignored", SM90_CACHE, checks.long_cache_check,
     "key_source = {cache_first, cache_entry};", "key_source = {0, cache_entry};"),
    ("cache_batch_idx ignored", SM90_CACHE, checks.long_cache_check,
     "key_source = {cache_first, cache_entry};", "key_source = {cache_first, batch};"),
    ("an entry's tiles one key apart", SM90_CACHE, checks.long_cache_check,
     "key_source.at(j * kBlockN + row)", "key_source.at(j + row)"),
    ("a page's boxes all at the tile's first rows", SM90_PAGED, checks.kv_cache_check,
     "load_tile<kBoxes>(stage + row * 128,", "load_tile<kBoxes>(stage,"),
    ("every split from the block's first tile", SM90_PAGED, checks.long_cache_check,
     "const int first_tile = span.first + split * split_share;", "const int first_tile = span.first;"),
    ("a split's unmasked tiles counted from tile 0", SM90_PAGED, checks.long_cache_check,
     "max(0, limit / kBlockN - first_tile)", "limit / kBlockN"),
    ("packed rows' diagonal at the packed row", SM90_PAGED, checks.kv_cache_check,
     "col > row / group + nk - nq / group", "col > row + nk - nq / group"),
    ("the keys appended this step not counted", SM90_PAGED, checks.kv_cache_check,
     "(long long)seqlens_k[batch] + new_tokens", "(long long)seqlens_k[batch]"),
    ("a packed row's window at the packed row", chosen_decoding_spec(DECODE_WINDOW, "sm90", None),
     checks.packed_window_check, "query[r] = row / group,", "query[r] = row,"),
    ("a split's L in the scores' units, not natural log", SM90_CACHE, checks.long_cache_check,
     "m[r] * scale_log2 * fagen::kLn2 + logf(l[r]) : -fagen::infinity()", "m[r] + logf(l[r]) : -fagen::infinity()"),
]]
# Past d = 256 on the sm90 family: a block per column slice of O (Sm90Tiles.slices) and V as K's
# columns (absorbed MLA). d_v = 320: two 192-column slices, the second's last 64 columns past d_v
# (neither loaded nor stored).
SM90_WIDE = Spec(320, dtype="fp16", arch_family="sm90")
SM90_WIDE_CACHE = chosen_decoding_spec(Spec.for_kv_cache(320, "fp16", causal=True, page_size=None, pack_gqa=True),
                                       "sm90", None)
SM90_MLA = chosen_decoding_spec(DECODE_MLA, "sm90", None)
MUTANTS += [KernelMutant(f"sm90 wide: {name}", spec, (Edit(old, new),), (check,))
            for name, spec, check, old, new in [
    ("V's slice loaded from column 0", SM90_WIDE, checks.sm90_pipeline_check,
     "{column0 + 64 * box, h, row, b}", "{64 * box, h, row, b}"),
    ("O's slice stored at column 0", SM90_WIDE, checks.sm90_pipeline_check,
     "{column0 + 64 * box, head, first_row, batch}", "{64 * box, head, first_row, batch}"),
    ("no slice writes L", SM90_WIDE, checks.sm90_pipeline_check, "row < nq && column0 == 0)", "row < nq && column0 < 0)"),
    ("the last slice's columns past d_v written", SM90_WIDE_CACHE, checks.checked_kv_cache_check,
     "      if (column0 + 8 * j >= kOutColumns) break;   // the last slice's columns past d_v\n", ""),
    ("a split's partial O of every slice at column 0", SM90_WIDE_CACHE, checks.kv_cache_check,
     "slot * kOutColumns + column0", "slot * kOutColumns"),
    ("MLA: every slice of V read from K's first columns", SM90_MLA, checks.mla_check,
     "  c.read_v_from(slice_column0());\n", ""),
    # The box past d_v lies wholly outside V (the emulator refuses its load) ...
    ("the last slice's V box past d_v loaded", SM90_WIDE, checks.sm90_pipeline_check,
     "return column0 + kHeadDimV > kOutColumns ? kLastSliceBoxesV : kBoxesV;", "return kBoxesV;"),
    ("the last slice's V box past d_v loaded (decoding)", SM90_WIDE_CACHE, checks.kv_cache_check,
     "return column0 + kHeadDimV > kOutColumns ? kLastSliceBoxesV : kBoxesV;", "return kBoxesV;"),
    # ... and counted without its load, a stage's barrier waits for bytes that never come (a deadlock).
    ("the last slice's V box past d_v counted in a stage's bytes", SM90_WIDE, checks.sm90_pipeline_check,
     "const uint32_t stage_bytes = kKBytes + boxes_v * kKBox;", "const uint32_t stage_bytes = kStageBytes;"),
]]
# Packed queries over a paged cache on the sm90 family: each sequence's keys from its own row of
# the block table, as many as cu_seqlens_k gives it.
SM90_VARLEN_PAGED = chosen_decoding_spec(Spec.for_kv_cache(64, "fp16", causal=True, page_size=16, varlen=True,
                                                           window=True, softcap=True, alibi=True), "sm90", None)
MUTANTS += [KernelMutant(f"sm90 paged varlen: {name}", SM90_VARLEN_PAGED, (Edit(old, new),),
                         (checks.paged_varlen_check,))
            for name, old, new in [
    ("every sequence's keys from the first row of the block table",
     "{block_table + (long long)batch * block_table_stride, page_size", "{block_table, page_size"),
    ("a sequence's keys counted as its queries", "  const int keys = seqlen_k;\n  const KeySource",
     "  const int keys = seqlen_q;\n  const KeySource"),
]]

# A block table's width (issue 42): an entry's keys, or a packed sequence's, past the pages its row
# lists, refused by the guard (max_pages); removed, the kernels read past the row (a strided
# table's next column, in table_width_check: a real page, so nothing else raises).
VARLEN_PAGED = Spec.for_kv_cache(64, "fp16", causal=True, page_size=16, varlen=True, window=True, softcap=True,
                                 alibi=True)
DECODE_GUARD = "if (entry_end < 0 || entry_end > seqlen_k || entry_end > (long long)max_pages * page_size) {"
PACKED_GUARD = " && k_past - k_start <= (long long)max_pages * page_size"
MUTANTS += [KernelMutant(f"{name}: keys past the block table's row not refused", spec, (Edit(old, new),),
                         (checks.table_width_check,))
            for name, spec, old, new in [
    ("paged", DECODE_PAGED, DECODE_GUARD, "if (false) {"),
    ("sm90 decoding", SM90_PAGED, DECODE_GUARD, "if (false) {"),
    ("paged varlen", VARLEN_PAGED, PACKED_GUARD, ""),
    ("sm90 paged varlen", SM90_VARLEN_PAGED, PACKED_GUARD, ""),
]]

MUTANTS += fp8_mutants.MUTANTS   # the 8-bit forward's (issue 45)

SAMPLE = ("no max subtraction", "causal aligned to the padded Nk", "softmax_scale ignored in the backward",
          "L written as -inf for empty rows", "an atomic dQ in the deterministic variant",
          "softcap: the chain rule through the score dropped",
          "documents: tiles whose id ranges touch skipped as empty",
          "combine: splits weighed by the largest L, not by L", "GQA packing: the window evaluated at the packed row",
          "d_v: dV's slices at dK's columns", "sm90 backward: the dQ tile rewritten before its bulk reduction has read it",
          "deterministic captured gradient: the carry into the next digit dropped", "fp8: V not transposed",
          "fp8 cache: the bytes widened as e5m2")


def mutation_score() -> tuple[int, int, list[str]]:
    """(killed, total, the survivors' names) over the kernel mutants, the barrier deletions
    (justified barriers count as neither) and the bugs planted in the twins' micro-kernels
    (tests/support/twin_mutants.py)."""
    survivors, total = [], 0
    for planted, outputs_correct in twin_mutants.all_planted():
        total += 1
        if twin_mutants.verdict(planted, outputs_correct) is not None:
            survivors.append(planted.label)
    for mutant in MUTANTS:
        total += 1
        if killed_by(mutant) is None:
            survivors.append(mutant.name)
    for mutant in barrier_mutations.all_mutants():
        if barrier_mutations.justification(mutant) is not None:
            continue
        total += 1
        if barrier_mutations.verdict(mutant) is None:
            survivors.append(mutant.name)
    return total - len(survivors), total, survivors
