// stmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 as a warp rendezvous (PTX ISA
// "Warp-level matrix store instruction: stmatrix"): the fragments of ldmatrix, stored. Each
// matrix's rows are written at the addresses its eight lanes give, on their behalf (racecheck
// attributes row r of matrix k to lane 8k + r).
#include "runtime_internal.h"

#include <fagen_emulate/stmatrix.h>

#include <cstring>

namespace fagen_emu {
namespace {

struct StmatrixOperands {
  void* row;
  const uint32_t* regs;
};

// The return address of the stmatrix call being completed, for racecheck's reports.
__thread const void* stmatrix_caller = nullptr;

template <int kCount, bool kTranspose>
struct StmatrixOp {
  static const char name[];

  static void compute(WarpRendezvous& w) {
    uint16_t m[kCount][8][8];
    for (int lane = 0; lane < 32; ++lane) {
      const auto& operands = *static_cast<const StmatrixOperands*>(w.in[lane]);
      const int row = lane / 4, col = 2 * (lane % 4);
      for (int k = 0; k < kCount; ++k) {
        const uint16_t lo = static_cast<uint16_t>(operands.regs[k] & 0xffffu);
        const uint16_t hi = static_cast<uint16_t>(operands.regs[k] >> 16);
        if (kTranspose) {
          m[k][col][row] = lo;
          m[k][col + 1][row] = hi;
        } else {
          m[k][row][col] = lo;
          m[k][row][col + 1] = hi;
        }
      }
    }
    const bool instrumented = instrumenting();
    const SiteCode site = instrumented ? call_site(stmatrix_caller, w.site) : 0;
    const Fiber& self = *current_fiber;
    for (int k = 0; k < kCount; ++k) {
      for (int r = 0; r < 8; ++r) {
        const int lane = 8 * k + r;
        void* row = static_cast<const StmatrixOperands*>(w.in[lane])->row;
        if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
          fail(w.site, "%s: lane %d's row address %p is not 16-byte aligned", name, lane, row);
        }
        check_dynamic_shared_range(row, 16, name, w.site);
        if (instrumented) {
          shared_access(thread_ref(self.block->fibers[self.coords.warp * 32 + static_cast<unsigned>(lane)]), row, 16,
                        /*write=*/true, site);
        }
        std::memcpy(row, m[k][r], 16);
      }
    }
  }
};

template <> const char StmatrixOp<1, false>::name[] = "stmatrix.x1";
template <> const char StmatrixOp<2, false>::name[] = "stmatrix.x2";
template <> const char StmatrixOp<4, false>::name[] = "stmatrix.x4";
template <> const char StmatrixOp<1, true>::name[] = "stmatrix.x1.trans";
template <> const char StmatrixOp<2, true>::name[] = "stmatrix.x2.trans";
template <> const char StmatrixOp<4, true>::name[] = "stmatrix.x4.trans";

template <int kCount, bool kTranspose>
void run(const uint32_t* regs, void* row_address, Site site) {
  using Op = StmatrixOp<kCount, kTranspose>;
  const StmatrixOperands operands{row_address, regs};
  warp_collective(Op::name, 0xffffffffu, &operands, nullptr, &Op::compute, site);
}

}  // namespace

void stmatrix(int count, bool transpose, const uint32_t* regs, void* row_address, Site site) {
  stmatrix_caller = __builtin_return_address(0);
  switch (count * 2 + (transpose ? 1 : 0)) {
    case 2: return run<1, false>(regs, row_address, site);
    case 3: return run<1, true>(regs, row_address, site);
    case 4: return run<2, false>(regs, row_address, site);
    case 5: return run<2, true>(regs, row_address, site);
    case 8: return run<4, false>(regs, row_address, site);
    case 9: return run<4, true>(regs, row_address, site);
    default: fail(site, "stmatrix with %d matrices: only x1, x2 and x4 exist", count);
  }
}

}  // namespace fagen_emu
