// fagen_emulate/tma.h — the emulated twins of templates/include/fagen/tma.cuh: TMA tile copies
// (cp.async.bulk.tensor) of a tensor map (fagen_emulate/tensor_map.h), the bulk reduction
// cp.reduce.async.bulk .add.f32, and the bulk async-groups. Kernels call the wrappers.
//
// The box: a copy starts at signed element coordinates (innermost first) and takes, along each
// dim, ceil(box / element stride) elements c + k * stride (dim 0 has no stride). Elements outside
// the tensor load as zero (or a quiet NaN with the NaN fill) and are skipped by a store; a load of
// a box with no element inside the tensor along some dim is refused (whether the hardware
// completes one is not documented). In shared memory the box is dense, dim 0 fastest, and the
// map's swizzle permutes its 16-byte chunks by the absolute shared address: address bits 4.. (1, 2
// or 3 of them for 32B, 64B, 128B) XOR the bits from 7 up. The dynamic shared memory is 1024-byte
// aligned, as the GPU's window is.
//
// Asynchrony, as late as the PTX ISA allows:
// - a load poisons its destination (0xFF: NaN) at issue and lands when its mbarrier's phase
//   could otherwise complete (all arrivals in, and a thread waits on it): it then reads global
//   memory, writes the box and delivers its bytes (complete_tx). A destination written while the
//   load is in flight is reported at landing;
// - a store or bulk reduction reads its shared source at the bulk wait_group that retires its
//   group (wait_group.read or wait_group), and writes global memory then; a source changed after
//   issue, or a block that exits with a bulk group still reading, is reported.
// `tma_load_box_now` / `tma_store_box_now` move a box at once, for the geometry's unit tests.
#pragma once

#include <fagen_emulate/tensor_map.h>

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void tma_load(void* shared_dst, const EmulatedTensorMap* map, int rank, const int32_t* coords,
                                    void* bar, Site site);
FAGEN_EMU_RUNTIME_API void tma_store(const EmulatedTensorMap* map, int rank, const int32_t* coords,
                                     const void* shared_src, Site site);
FAGEN_EMU_RUNTIME_API void bulk_reduce_add_f32(float* global_dst, const float* shared_src, uint32_t bytes, Site site);
FAGEN_EMU_RUNTIME_API void bulk_commit_group(Site site);
// wait_group N: every committed bulk group of this thread but the N most recent completes.
FAGEN_EMU_RUNTIME_API void bulk_wait_group(int pending_groups, Site site);
// wait_group.read N: the same groups have read their sources (the twin writes their destinations
// then too), but their writes count as done only once a wait_group retires them: a semaphore
// arrive before that is a fault (fagen_emulate/semaphore.h).
FAGEN_EMU_RUNTIME_API void bulk_wait_group_read(int pending_groups, Site site);

FAGEN_EMU_RUNTIME_API void tma_load_box_now(void* shared_dst, const EmulatedTensorMap* map, const int32_t* coords,
                                            Site site);
FAGEN_EMU_RUNTIME_API void tma_store_box_now(const EmulatedTensorMap* map, const int32_t* coords,
                                             const void* shared_src, Site site);

}  // namespace fagen_emu
