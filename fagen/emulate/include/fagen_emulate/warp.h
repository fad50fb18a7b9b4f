// fagen_emulate/warp.h — block barriers and warp-collective intrinsics.
//
// Every one of these is a rendezvous: the calling fiber records its operand
// and waits until every thread that must take part has arrived; the last to
// arrive computes all results. The rules are the GPU's, enforced:
// - __syncthreads: every live thread of the block, at the same call site;
//   a thread that exits (or waits elsewhere) while others wait is a fault;
// - __shfl*_sync, __ballot_sync, __syncwarp, ...: exactly the lanes of
//   `mask`, each naming the same mask at the same call site; a lane outside
//   the mask, an exited lane inside it, or a shuffle reading a lane outside
//   it is a fault.
// The trailing file/line parameters are filled in at the kernel's call site.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void sync_threads(Site site);
// __syncthreads_count/_and/_or: the barrier plus a count of nonzero predicates.
FAGEN_EMU_RUNTIME_API int sync_threads_count(int predicate, Site site);
FAGEN_EMU_RUNTIME_API void sync_warp(unsigned mask, Site site);

enum class ShuffleMode : int { index = 0, up = 1, down = 2, butterfly = 3 };
FAGEN_EMU_RUNTIME_API uint64_t shuffle(ShuffleMode mode, unsigned mask, uint64_t value, int lane_operand,
                                      int width, Site site);
FAGEN_EMU_RUNTIME_API unsigned ballot(unsigned mask, int predicate, Site site);
// Lanes of the caller's warp that have not exited (the emulator's activemask).
FAGEN_EMU_RUNTIME_API unsigned live_lanes();

template <class T>
inline T shuffle_value(ShuffleMode mode, unsigned mask, T value, int lane_operand, int width, Site site) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const void*>(&value), sizeof(T));
  bits = shuffle(mode, mask, bits, lane_operand, width, site);
  T result;
  std::memcpy(static_cast<void*>(&result), &bits, sizeof(T));
  return result;
}

}  // namespace fagen_emu

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  fagen_emu::sync_threads({file, line});
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::sync_threads_count(predicate, {file, line});
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::sync_threads_count(predicate != 0, {file, line}) ==
         static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::sync_threads_count(predicate != 0, {file, line}) != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  fagen_emu::sync_warp(mask, {file, line});
}
inline unsigned __activemask() { return fagen_emu::live_lanes(); }

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  return fagen_emu::shuffle_value(fagen_emu::ShuffleMode::index, mask, var, src_lane, width, {file, line});
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::shuffle_value(fagen_emu::ShuffleMode::up, mask, var, static_cast<int>(delta), width,
                                  {file, line});
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::shuffle_value(fagen_emu::ShuffleMode::down, mask, var, static_cast<int>(delta), width,
                                  {file, line});
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fagen_emu::shuffle_value(fagen_emu::ShuffleMode::butterfly, mask, var, lane_mask, width,
                                  {file, line});
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return fagen_emu::ballot(mask, predicate, {file, line});
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return fagen_emu::ballot(mask, predicate, {file, line}) == mask;
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return fagen_emu::ballot(mask, predicate, {file, line}) != 0;
}
