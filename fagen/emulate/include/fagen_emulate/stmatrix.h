// fagen_emulate/stmatrix.h — the emulated twin of templates/include/fagen/stmatrix.cuh
// (stmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16, sm_90). Kernels call the wrapper.
//
// Warp-collective, the store counterpart of ldmatrix with the same fragment layout: lane 8k + r
// gives the 16-byte row address of row r of matrix k, and register k of lane l holds elements
// M_k[l / 4][2 (l % 4) + {0, 1}] (with .trans, M_k[2 (l % 4) + {0, 1}][l / 4]), low half first.
#pragma once

#include <cstdint>

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void stmatrix(int count, bool transpose, const uint32_t* regs, void* row_address, Site site);

}  // namespace fagen_emu
