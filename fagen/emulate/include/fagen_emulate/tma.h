// fagen_emulate/tma.h — the TMA twin's box: what one tile copy of a tensor map moves
// (cp.async.bulk.tensor), from fagen's encoding of the map (fagen_emulate/tensor_map.h).
//
// A box starts at signed element coordinates (innermost first) and takes, along each dim,
// ceil(box / element stride) elements c + k * stride (dim 0 has no stride). Elements outside the
// tensor load as zero (or a quiet NaN with the NaN fill) and are skipped by a store. In shared
// memory the box is dense, dim 0 fastest, and the map's swizzle permutes its 16-byte chunks by
// the absolute shared address: address bits 4.. (1, 2 or 3 of them for 32B, 64B, 128B) XOR the
// bits from 7 up. The emulator's dynamic shared memory is 1024-byte aligned, as the GPU's window
// is, so a host address's low ten bits are the shared address's.
//
// The asynchronous copy (issue, land as late as legal, complete_tx on an mbarrier) is built on
// these; `tma_load_box_now` / `tma_store_box_now` move a box at once, for the twin's unit tests.
#pragma once

#include <fagen_emulate/tensor_map.h>

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void tma_load_box_now(void* shared_dst, const EmulatedTensorMap* map, const int32_t* coords,
                                            Site site);
FAGEN_EMU_RUNTIME_API void tma_store_box_now(const EmulatedTensorMap* map, const int32_t* coords,
                                             const void* shared_src, Site site);

}  // namespace fagen_emu
