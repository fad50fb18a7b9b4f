// Warp shuffles, ballot and __syncwarp, as warp rendezvous.
//
// Shuffle source lanes follow the PTX ISA's shfl.sync definition, with the
// CUDA intrinsics' clamp operand: c = ((32 - width) << 8) | 0x1f for idx,
// down and bfly, and (32 - width) << 8 for up. A lane whose computed source
// is outside its segment gets its own value back.
#include "runtime_internal.h"

namespace fagen_emu {
namespace {

struct ShuffleOperand {
  uint64_t value;
  int lane_operand;
  int width;
};

const char kShflIdx[] = "__shfl_sync";
const char kShflUp[] = "__shfl_up_sync";
const char kShflDown[] = "__shfl_down_sync";
const char kShflXor[] = "__shfl_xor_sync";
const char kBallot[] = "__ballot_sync";

const char* shuffle_name(ShuffleMode mode) {
  switch (mode) {
    case ShuffleMode::index: return kShflIdx;
    case ShuffleMode::up: return kShflUp;
    case ShuffleMode::down: return kShflDown;
    case ShuffleMode::butterfly: return kShflXor;
  }
  return kShflIdx;
}

template <ShuffleMode kMode>
void compute_shuffle(WarpRendezvous& w) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(w.mask >> lane & 1u)) continue;
    const auto& operand = *static_cast<const ShuffleOperand*>(w.in[lane]);
    const int segment_mask = (32 - operand.width) & 31;  // c[12:8]
    const int clamp = kMode == ShuffleMode::up ? 0 : 31;  // c[4:0]
    const int min_lane = lane & segment_mask;
    const int max_lane = min_lane | (clamp & ~segment_mask);
    const int b = operand.lane_operand;
    int source = lane;
    bool inside = false;
    switch (kMode) {
      case ShuffleMode::up: source = lane - b; inside = source >= max_lane; break;
      case ShuffleMode::down: source = lane + b; inside = source <= max_lane; break;
      case ShuffleMode::butterfly: source = lane ^ b; inside = source <= max_lane; break;
      case ShuffleMode::index: source = min_lane | (b & 31 & ~segment_mask); inside = source <= max_lane; break;
    }
    if (!inside) source = lane;
    if (!(w.mask >> source & 1u)) {
      fail(w.site, "%s: lane %d reads lane %d, which is not in the mask 0x%08x (undefined on the GPU)",
           shuffle_name(kMode), lane, source, w.mask);
    }
    *static_cast<uint64_t*>(w.out[lane]) = static_cast<const ShuffleOperand*>(w.in[source])->value;
  }
}

void compute_ballot(WarpRendezvous& w) {
  unsigned votes = 0;
  for (unsigned lane = 0; lane < 32; ++lane)
    if ((w.mask >> lane & 1u) && *static_cast<const int*>(w.in[lane]) != 0) votes |= 1u << lane;
  for (unsigned lane = 0; lane < 32; ++lane)
    if (w.mask >> lane & 1u) *static_cast<unsigned*>(w.out[lane]) = votes;
}

void compute_nothing(WarpRendezvous&) {}

}  // namespace

const char kSyncWarpOp[] = "__syncwarp";

uint64_t shuffle(ShuffleMode mode, unsigned mask, uint64_t value, int lane_operand, int width, Site site) {
  const char* op = shuffle_name(mode);
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    fail(site, "%s with width %d: the width must be a power of two in [1, 32]", op, width);
  }
  ShuffleOperand operand{value, lane_operand, width};
  uint64_t result = 0;
  CollectiveCompute compute = nullptr;
  switch (mode) {
    case ShuffleMode::index: compute = &compute_shuffle<ShuffleMode::index>; break;
    case ShuffleMode::up: compute = &compute_shuffle<ShuffleMode::up>; break;
    case ShuffleMode::down: compute = &compute_shuffle<ShuffleMode::down>; break;
    case ShuffleMode::butterfly: compute = &compute_shuffle<ShuffleMode::butterfly>; break;
  }
  warp_collective(op, mask, &operand, &result, compute, site);
  return result;
}

unsigned ballot(unsigned mask, int predicate, Site site) {
  unsigned result = 0;
  warp_collective(kBallot, mask, &predicate, &result, &compute_ballot, site);
  return result;
}

void sync_warp(unsigned mask, Site site) {
  warp_collective(kSyncWarpOp, mask, nullptr, nullptr, &compute_nothing, site);
}

}  // namespace fagen_emu
