// The TMA twin's box geometry (tma_box.cpp), shared by the immediate copies of its unit tests and
// the asynchronous ones (tma.cpp). Internal to the runtime.
#pragma once

#include "runtime_internal.h"

#include <fagen_emulate/tensor_map.h>

#include <functional>

namespace fagen_emu {

// A box's element counts per dim and its bytes in shared memory.
struct BoxShape {
  int rank = 0;
  uint32_t counts[kTensorMapMaxRank] = {};
  std::size_t elements = 1;
  std::size_t bytes = 0;
};

// Faults on a map the twin cannot read (not fagen's encoding, a bad rank).
BoxShape box_shape(const EmulatedTensorMap& map, Site site);
// Faults on a shared-memory box that is misaligned, past the launch's dynamic shared memory, or
// narrower than its swizzle span.
void check_shared_box(const void* shared, const EmulatedTensorMap& map, const BoxShape& shape, const char* what,
                      Site site);
// Faults on a load whose box lies wholly outside the tensor along some dim: the PTX ISA and the
// driver document the zero fill of a box's elements outside the bounds, not whether a box with
// none inside is filled and its bytes counted (if not, its mbarrier's phase never completes).
void check_box_meets_tensor(const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                            const char* what, Site site);
// Reads the box from global memory into shared memory at `shared_dst`, swizzled.
void copy_box_in(void* shared_dst, const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                 Site site);
// The dense (unswizzled) bytes of the box that sits swizzled at `shared_src`.
void unswizzle_box(const void* shared_src, const EmulatedTensorMap& map, const BoxShape& shape, unsigned char* dense);
// Hands each element of a dense box that lies inside the tensor to `write(global, element)`.
using BoxElementWrite = std::function<void(unsigned char* global, const unsigned char* element)>;
void copy_box_out(const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                  const unsigned char* dense, Site site, const BoxElementWrite& write);

}  // namespace fagen_emu
