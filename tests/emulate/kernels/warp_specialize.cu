// Named barriers, elect.sync, setmaxnreg and fence.proxy.async for
// tests/emulate/test_emulate_warp_specialize.py: kernels that use them right, and
// kernels that each break one of their rules.
#include <fagen/prelude.cuh>
#include <fagen/elect.cuh>
#include <fagen/named_barrier.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/warpgroup_control.cuh>

// 128 threads. Warps 0-1 fill a 64-float tile and bar.arrive on `full_id`; warps
// 2-3 bar.sync on it, read the tile and bar.arrive on `empty_id`, which the
// fillers bar.sync on before the next round. y[r][t] = 2 * x[r][t].
// `sync0` ends with bar.sync 0, 128 where a kernel would call __syncthreads.
extern "C" __global__ void named_handoff(const float* x, float* y, int rounds, int full_id, int empty_id,
                                         int sync0) {
  __shared__ float tile[64];
  const int t = threadIdx.x;
  for (int r = 0; r < rounds; ++r) {
    if (t < 64) {
      if (r > 0) fagen::named_barrier_sync(empty_id, 128);
      tile[t] = x[r * 64 + t];
      fagen::named_barrier_arrive(full_id, 128);
    } else {
      fagen::named_barrier_sync(full_id, 128);
      y[r * 64 + t - 64] = 2.f * tile[t - 64];
      if (r + 1 < rounds) fagen::named_barrier_arrive(empty_id, 128);
    }
  }
  if (sync0) {
    fagen::named_barrier_sync(0, 128);
  } else {
    __syncthreads();
  }
  if (t < 64) tile[t] = -1.f;
  __syncthreads();
}
FAGEN_EXPORT(named_handoff)

// One rule broken per `which` (128 threads): 0 none; 1 a count that is not a
// multiple of 32; 2 warps 2-3 name another count than warps 0-1; 3 warp 3 never
// arrives (deadlock); 4 barrier id 16; 5 warp 0 at barrier 0 with 64 threads, the
// other warps at __syncthreads (barrier 0 with all 128); 6 three warps at a
// barrier for 64 threads; 7 warps 0-1 bar.arrive twice at a barrier for 128.
extern "C" __global__ void named_faults(int* out, int which) {
  const int warp = threadIdx.x / 32;
  switch (which) {
    case 0: fagen::named_barrier_sync(1, 128); break;
    case 1: fagen::named_barrier_sync(1, 48); break;
    case 2: fagen::named_barrier_sync(1, warp < 2 ? 128 : 64); break;
    case 3: if (warp < 3) fagen::named_barrier_sync(1, 128); break;
    case 4: fagen::named_barrier_sync(16, 128); break;
    case 5:
      if (warp == 0) {
        fagen::named_barrier_sync(0, 64);
      } else {
        __syncthreads();
      }
      break;
    case 6: if (warp < 3) fagen::named_barrier_sync(2, 64); break;
    case 7:
      if (warp < 2) {
        fagen::named_barrier_arrive(3, 128);
        fagen::named_barrier_arrive(3, 128);
      } else {
        fagen::named_barrier_sync(3, 128);
      }
      break;
  }
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(named_faults)

// Warps 0 to count/32 - 1 call bar.sync id, count (every warp, when count is not a
// whole number of warps); out[t] = 1 for every thread that gets to the end.
extern "C" __global__ void named_count(int* out, int id, int count) {
  const int warp = threadIdx.x / 32;
  const bool whole_warps = count > 0 && count % 32 == 0;
  if (!whole_warps || warp < count / 32) {
    fagen::named_barrier_sync(static_cast<uint32_t>(id), static_cast<uint32_t>(count));
  }
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(named_count)

// The lanes of `mask` call elect.sync with it; out[lane] = 1 where elected, 0
// where not, -1 for lanes outside the mask.
extern "C" __global__ void elect_lanes(int* out, unsigned mask) {
  const unsigned lane = threadIdx.x % 32;
  out[threadIdx.x] = -1;
  if (mask >> lane & 1u) out[threadIdx.x] = fagen::elect_one_sync(mask) ? 1 : 0;
}
FAGEN_EXPORT(elect_lanes)

// setmaxnreg in a block of blockDim.x threads, one rule broken per `which`:
// 0 none (warpgroup 0 lowers to 24, the others raise to 240, then lower to 232);
// 1 warp 3 skips it; 2 warps 2-3 name another count; 3 .inc to below the current
// count; 4 a count of 20 and 5 of 100 (the twin called directly: the wrapper
// refuses them at compile time); 6 none, but the block has no whole warpgroup; 7 (512 threads)
// warpgroup 0 lowers to 24 and three raise to 240, more than the register file holds.
extern "C" __global__ void setmaxnreg_rules(int* out, int which) {
  const int warp = threadIdx.x / 32;
  if (which == 0 || which == 6) {
    if (warp < 4) {
      fagen::setmaxnreg_dec<24>();
    } else {
      fagen::setmaxnreg_inc<240>();
      fagen::setmaxnreg_dec<232>();
    }
  } else if (which == 1) {
    if (warp != 3) fagen::setmaxnreg_dec<40>();
  } else if (which == 2) {
    if (warp < 2) {
      fagen::setmaxnreg_dec<40>();
    } else {
      fagen::setmaxnreg_dec<32>();
    }
  } else if (which == 3) {
    fagen::setmaxnreg_inc<240>();
    fagen::setmaxnreg_inc<232>();
  } else if (which == 7) {
    if (warp < 4) {
      fagen::setmaxnreg_dec<24>();
    } else {
      fagen::setmaxnreg_inc<240>();
    }
  }
#ifdef FAGEN_EMULATE
  if (which == 4) ::fagen_emu::setmaxnreg_dec(20, {__FILE__, __LINE__});
  if (which == 5) ::fagen_emu::setmaxnreg_inc(100, {__FILE__, __LINE__});
#endif
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(setmaxnreg_rules)

// The twin with a register count known only at run time (the ISA table test; the
// wrapper takes it as a template argument). A no-op on the GPU.
extern "C" __global__ void setmaxnreg_count(int* out, int registers, int raise) {
#ifdef FAGEN_EMULATE
  if (raise) {
    ::fagen_emu::setmaxnreg_inc(static_cast<unsigned>(registers), {__FILE__, __LINE__});
  } else {
    ::fagen_emu::setmaxnreg_dec(static_cast<unsigned>(registers), {__FILE__, __LINE__});
  }
#endif
  out[threadIdx.x] = registers;
}
FAGEN_EXPORT(setmaxnreg_count)

// out[t] = the order in which thread t got past the barrier: the schedule, made visible.
extern "C" __global__ void arrival_order(int* out) {
  __shared__ int next[1];
  if (threadIdx.x == 0) next[0] = 0;
  __syncthreads();
  out[threadIdx.x] = atomicAdd(&next[0], 1);
}
FAGEN_EXPORT(arrival_order)

// Every thread fences twice (counted per launch).
extern "C" __global__ void proxy_fences(int* out) {
  fagen::fence_proxy_async();
  out[threadIdx.x] = 1;
  fagen::fence_proxy_async_shared();
}
FAGEN_EXPORT(proxy_fences)

// 64 threads: warp 0's lanes each bar.arrive on barrier 1 and exit at once (a producer that
// hands over and leaves); warp 1 bar.syncs on it, then writes. Lanes that arrived and exited
// still count for their warp.
extern "C" __global__ void arrive_then_exit(int* out) {
  if (threadIdx.x < 32) {
    fagen::named_barrier_arrive(1, 64);
    return;
  }
  fagen::named_barrier_sync(1, 64);
  out[threadIdx.x - 32] = 1;
}
FAGEN_EXPORT(arrive_then_exit)
