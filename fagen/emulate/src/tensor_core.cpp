// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 and
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16, as warp rendezvous.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type" and "ldmatrix"); g = lane >> 2, t = lane % 4, and a
// 32-bit register holds two 16-bit elements, the lower-indexed one in the
// low half:
//   A (16x16): reg i holds A[g + 8*(i%2)][2t + 8*(i/2) + {0,1}]
//   B (16x8):  reg j holds B[2t + 8*j + {0,1}][g]
//   C/D (16x8 fp32): c[e] is C[g + 8*(e/2)][2t + e%2]
//   ldmatrix: lane 8k+r gives row r of matrix k; reg k of lane l holds
//     M_k[l/4][2(l%4) + {0,1}], or M_k[2(l%4) + {0,1}][l/4] with .trans.
#include "runtime_internal.h"

#include <cstring>

namespace fagen_emu {
namespace {

struct MmaOperands {
  const uint32_t* a;
  const uint32_t* b;
};

const char kMmaF16[] = "mma.m16n8k16.f16";
const char kMmaBf16[] = "mma.m16n8k16.bf16";

template <MmaInput kInput>
double decode(uint32_t bits16) {
  if (kInput == MmaInput::f16) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  return bit_cast<float>(bits16 << 16);  // bf16 is the high half of an fp32
}

// The return address of the ldmatrix call being completed: the last lane's, which is
// the site every lane called it from.
__thread const void* ldmatrix_caller = nullptr;

template <MmaInput kInput>
void compute_mma(WarpRendezvous& w) {
  count_mma();
  double a[16][16], b[16][8], c[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& operands = *static_cast<const MmaOperands*>(w.in[lane]);
    const float* acc = static_cast<const float*>(w.out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
      a[row][col] = decode<kInput>(operands.a[i] & 0xffffu);
      a[row][col + 1] = decode<kInput>(operands.a[i] >> 16);
    }
    for (int j = 0; j < 2; ++j) {
      const int k = 2 * t + 8 * j;
      b[k][g] = decode<kInput>(operands.b[j] & 0xffffu);
      b[k + 1][g] = decode<kInput>(operands.b[j] >> 16);
    }
    for (int e = 0; e < 4; ++e) c[g + 8 * (e / 2)][2 * t + e % 2] = acc[e];
  }
  float d[16][8];
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) {
      double sum = c[m][n];
      for (int k = 0; k < 16; ++k) sum += a[m][k] * b[k][n];
      d[m][n] = static_cast<float>(sum);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* acc = static_cast<float*>(w.out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; ++e) acc[e] = d[g + 8 * (e / 2)][2 * t + e % 2];
  }
}

template <int kCount, bool kTranspose>
struct LdmatrixOp {
  static const char name[];

  static void compute(WarpRendezvous& w) {
    uint16_t m[kCount][8][8];
    const void* rows[kCount * 8];
    const bool instrumented = instrumenting();
    const SiteCode site = instrumented ? call_site(ldmatrix_caller, w.site) : 0;
    for (int k = 0; k < kCount; ++k) {
      for (int r = 0; r < 8; ++r) {
        const int lane = 8 * k + r;
        const void* row = *static_cast<const void* const*>(w.in[lane]);
        if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
          fail(w.site, "%s: lane %d's row address %p is not 16-byte aligned", name, lane, row);
        }
        check_dynamic_shared_range(row, 16, name, w.site);
        if (instrumented) {
          // Lane 8k+r's row is read on its behalf: racecheck attributes it to that lane.
          const Fiber& self = *current_fiber;
          shared_access(thread_ref(self.block->fibers[self.coords.warp * 32 + static_cast<unsigned>(lane)]), row,
                        16, /*write=*/false, site);
        }
        rows[lane] = row;
        std::memcpy(m[k][r], row, 16);
      }
    }
    if (instrumented) count_ldmatrix(rows, kCount);
    for (int lane = 0; lane < 32; ++lane) {
      uint32_t* regs = static_cast<uint32_t*>(w.out[lane]);
      const int row = lane / 4, col = 2 * (lane % 4);
      for (int k = 0; k < kCount; ++k) {
        const uint32_t lo = kTranspose ? m[k][col][row] : m[k][row][col];
        const uint32_t hi = kTranspose ? m[k][col + 1][row] : m[k][row][col + 1];
        regs[k] = lo | (hi << 16);
      }
    }
  }
};

template <> const char LdmatrixOp<1, false>::name[] = "ldmatrix.x1";
template <> const char LdmatrixOp<2, false>::name[] = "ldmatrix.x2";
template <> const char LdmatrixOp<4, false>::name[] = "ldmatrix.x4";
template <> const char LdmatrixOp<1, true>::name[] = "ldmatrix.x1.trans";
template <> const char LdmatrixOp<2, true>::name[] = "ldmatrix.x2.trans";
template <> const char LdmatrixOp<4, true>::name[] = "ldmatrix.x4.trans";

template <int kCount, bool kTranspose>
void run_ldmatrix(uint32_t* regs, const void* row_address, Site site) {
  using Op = LdmatrixOp<kCount, kTranspose>;
  warp_collective(Op::name, 0xffffffffu, &row_address, regs, &Op::compute, site);
}

}  // namespace

void mma_m16n8k16(MmaInput input, float acc[4], const uint32_t a[4], const uint32_t b[2], Site site) {
  const MmaOperands operands{a, b};
  if (input == MmaInput::f16) {
    warp_collective(kMmaF16, 0xffffffffu, &operands, acc, &compute_mma<MmaInput::f16>, site);
  } else {
    warp_collective(kMmaBf16, 0xffffffffu, &operands, acc, &compute_mma<MmaInput::bf16>, site);
  }
}

void ldmatrix(int count, bool transpose, uint32_t* regs, const void* row_address, Site site) {
  ldmatrix_caller = __builtin_return_address(0);
  switch (count * 2 + (transpose ? 1 : 0)) {
    case 2: return run_ldmatrix<1, false>(regs, row_address, site);
    case 3: return run_ldmatrix<1, true>(regs, row_address, site);
    case 4: return run_ldmatrix<2, false>(regs, row_address, site);
    case 5: return run_ldmatrix<2, true>(regs, row_address, site);
    case 8: return run_ldmatrix<4, false>(regs, row_address, site);
    case 9: return run_ldmatrix<4, true>(regs, row_address, site);
    default: fail(site, "ldmatrix with %d matrices: only x1, x2 and x4 exist", count);
  }
}

}  // namespace fagen_emu
