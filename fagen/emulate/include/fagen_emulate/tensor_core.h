// fagen_emulate/tensor_core.h — the emulated twins of the PTX wrappers in
// templates/include/fagen/{mma,ldmatrix,cp_async}.cuh. Kernels call the
// wrappers, never these directly.
//
// mma and ldmatrix are warp-collective (.sync.aligned): all 32 lanes of the
// warp must call the same op at the same call site, or the launch fails.
// Fragment layouts are the PTX ISA's; the wrapper headers document them.
//
// cp.async is per thread, as in PTX. The emulated semantics:
// - at issue, the source bytes are read (src_bytes of them; the rest of the
//   16 are zeros) and the 16 destination bytes are overwritten with 0xFF
//   (NaN as float, half or bf16): the data has not landed yet;
// - the data lands in the destination when the issuing thread's
//   cp_async_wait retires its group (wait_group N retires all committed
//   groups but the N most recent; copies not yet committed stay pending);
// - so a read before the matching wait (or, from another thread, before the
//   barrier that follows it) sees NaNs, not stale-but-plausible data.
#pragma once

#include <cstdint>

namespace fagen_emu {

enum class MmaInput : int { f16 = 0, bf16 = 1 };

// D = A * B + C for one m16n8k16 tile, accumulating into `acc` (C in, D out).
// Products are exact and summed in double, then rounded to fp32 once: at
// least as accurate as the tensor core, and bit-identical to it whenever the
// exact sum is representable (e.g. small integers).
FAGEN_EMU_RUNTIME_API void mma_m16n8k16(MmaInput input, float acc[4], const uint32_t a[4], const uint32_t b[2],
                                        Site site);

// ldmatrix.sync.aligned.m8n8.x{count}{.trans}.shared.b16 into regs[0..count).
FAGEN_EMU_RUNTIME_API void ldmatrix(int count, bool transpose, uint32_t* regs, const void* row_address,
                                    Site site);

FAGEN_EMU_RUNTIME_API void cp_async_16(void* shared_dst, const void* global_src, int src_bytes, Site site);
FAGEN_EMU_RUNTIME_API void cp_async_commit(Site site);
FAGEN_EMU_RUNTIME_API void cp_async_wait(int pending_groups, Site site);  // wait_group N
FAGEN_EMU_RUNTIME_API void cp_async_wait_all(Site site);                  // commit + wait_group 0

}  // namespace fagen_emu
