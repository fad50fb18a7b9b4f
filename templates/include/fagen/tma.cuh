// fagen/tma.cuh — TMA tile copies of a tensor map (sm_90; PTX ISA "Data Movement and Conversion
// Instructions: cp.async.bulk.tensor", "cp.reduce.async.bulk", "cp.async.bulk.commit_group",
// "cp.async.bulk.wait_group"):
//   tma_load<R>(dst, map, coords, bar)   cp.async.bulk.tensor.Rd.shared::cluster.global.tile
//                                         .mbarrier::complete_tx::bytes
//   tma_store<R>(map, coords, src)       cp.async.bulk.tensor.Rd.global.shared::cta.tile.bulk_group
//   bulk_reduce_add_f32(dst, src, bytes) cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32
//   bulk_commit_group(), bulk_wait_group_read<N>(), bulk_wait_group<N>()
//
// `map` is a kernel parameter `const __grid_constant__ fagen::TensorMap` (fagen/tensor_map.cuh);
// coords are element coordinates, innermost first, and may lie outside the tensor (those
// elements load as zero and are not stored), but a load's box must meet the tensor in every dim:
// whether a box wholly outside it completes its bytes is not documented (the emulator's twin
// refuses one). A load's bytes count against its mbarrier's
// tx-count (announce them with mbarrier_arrive_expect_tx, fagen/mbarrier.cuh); the data may be
// read once a wait on that barrier's phase returns. A store or reduction reads its shared source
// asynchronously: it must not be rewritten before a bulk_wait_group_read retires its group, and
// its shared writes must be made visible to the async proxy first (fence_proxy_async,
// fagen/proxy_fence.cuh). Destinations in shared memory are 128-byte aligned; a swizzled box's
// inner dim spans the swizzle (128 bytes for 128B).
//
// Emulated twins: fagen_emu::tma_* and bulk_* (fagen/emulate/src/tma.cpp, tma_box.cpp): a load
// poisons its destination until it lands, as late as the barrier allows; a store reads its source
// at the wait that retires it.
#pragma once

#include <fagen/prelude.cuh>
#include <fagen/tensor_map.cuh>

#ifdef FAGEN_EMULATE
#include <fagen_emulate/tma.h>
#endif

namespace fagen {

template <int kRank>
__device__ __forceinline__ void tma_load(void* dst, const TensorMap& map, const int (&coords)[kRank],
                                         uint64_t* bar FAGEN_CALL_SITE_PARAMS) {
  static_assert(kRank >= 1 && kRank <= 5, "a tensor map has 1 to 5 dims");
#ifdef FAGEN_EMULATE
  ::fagen_emu::tma_load(dst, &map, kRank, coords, bar, FAGEN_CALL_SITE);
#else
  const uint64_t m = reinterpret_cast<uint64_t>(&map);
  const uint32_t d = shared_address(dst), b = shared_address(bar);
  if constexpr (kRank == 1) {
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2}], [%3];\n" ::"r"(d), "l"(m), "r"(coords[0]), "r"(b) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(d), "l"(m), "r"(coords[0]), "r"(coords[1]), "r"(b)
                 : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(d), "l"(m), "r"(coords[0]), "r"(coords[1]),
                 "r"(coords[2]), "r"(b) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(d), "l"(m), "r"(coords[0]), "r"(coords[1]),
                 "r"(coords[2]), "r"(coords[3]), "r"(b) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(d), "l"(m), "r"(coords[0]), "r"(coords[1]),
                 "r"(coords[2]), "r"(coords[3]), "r"(coords[4]), "r"(b) : "memory");
  }
#endif
}

template <int kRank>
__device__ __forceinline__ void tma_store(const TensorMap& map, const int (&coords)[kRank],
                                          const void* src FAGEN_CALL_SITE_PARAMS) {
  static_assert(kRank >= 1 && kRank <= 5, "a tensor map has 1 to 5 dims");
#ifdef FAGEN_EMULATE
  ::fagen_emu::tma_store(&map, kRank, coords, src, FAGEN_CALL_SITE);
#else
  const uint64_t m = reinterpret_cast<uint64_t>(&map);
  const uint32_t s = shared_address(src);
  if constexpr (kRank == 1) {
    asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%0, {%2}], [%1];\n"
                 ::"l"(m), "r"(s), "r"(coords[0]) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(m), "r"(s), "r"(coords[0]), "r"(coords[1]) : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(m), "r"(s), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(m), "r"(s), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                 ::"l"(m), "r"(s), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]), "r"(coords[4])
                 : "memory");
  }
#endif
}

// dst[i] += src[i] for bytes / 4 floats, atomically per element (bytes: a multiple of 16).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src,
                                                    uint32_t bytes FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::bulk_reduce_add_f32(dst, src, bytes, FAGEN_CALL_SITE);
#else
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(shared_address(src)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit_group(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::bulk_commit_group(FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Until at most kPending of this thread's bulk groups still read their shared sources.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::bulk_wait_group_read(kPending, FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Until at most kPending of this thread's bulk groups are incomplete (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::bulk_wait_group(kPending, FAGEN_CALL_SITE);
#else
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace fagen
