// fagen/cp_async.cuh — asynchronous global -> shared copies (sm_80+):
//   cp.async.cg.shared.global [dst], [src], 16, src_bytes;
//   cp.async.commit_group;  cp.async.wait_group N;  cp.async.wait_all;
//
// cp_async_16 copies 16 bytes; both addresses must be 16-byte aligned. With
// src_bytes < 16 only src_bytes are read and the rest of the 16 destination
// bytes are zero; src_bytes = 0 reads nothing (ragged tails load zeros with
// no branch and no out-of-bounds read). Per thread, not warp-collective.
//
// Copies issued since the last commit form a group. cp_async_wait<N>() waits
// until at most the N most recent committed groups are still in flight; the
// data then is visible to the issuing thread, and to the rest of the block
// after a __syncthreads(). cp_async_wait_all() commits and waits for all.
//
// Emulated twin (fagen/emulate/src/cp_async.cpp): the destination reads as
// NaN garbage from issue until the issuing thread's wait retires the group,
// so a missing wait or barrier shows up as wrong results.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src,
                                            int src_bytes FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::cp_async_16(smem_dst, gmem_src, src_bytes, FAGEN_CALL_SITE);
#else
  const uint32_t dst = shared_address(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::cp_async_commit(FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait(FAGEN_CALL_SITE_PARAMS_FIRST) {
  static_assert(N >= 0, "cp.async.wait_group takes a count >= 0");
#ifdef FAGEN_EMULATE
  ::fagen_emu::cp_async_wait(N, FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::cp_async_wait_all(FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace fagen
