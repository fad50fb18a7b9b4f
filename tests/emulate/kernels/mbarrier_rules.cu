// mbarrier kernels for tests/emulate/test_emulate_mbarrier.py: a script that one
// thread runs op by op against one barrier (the ISA table test), and small
// kernels that each break one rule of the mbarrier protocol.
#include <fagen/prelude.cuh>
#include <fagen/mbarrier.cuh>

// ops[2i], ops[2i + 1]: an opcode and its operand. After each op the thread
// probes both parities; results[i] = (parity 0 completed) | (parity 1 completed) << 1.
// Opcodes: 0 init(n), 1 arrive, 2 expect_tx(n), 3 complete_tx(n), 4 arrive.expect_tx(n).
extern "C" __global__ void mbarrier_script(const int* ops, int count, int* results) {
  __shared__ __align__(8) uint64_t bar[1];
  for (int i = 0; i < count; ++i) {
    const int op = ops[2 * i];
    const uint32_t operand = static_cast<uint32_t>(ops[2 * i + 1]);
    switch (op) {
      case 0: fagen::mbarrier_init(bar, operand); break;
      case 1: fagen::mbarrier_arrive(bar); break;
      case 2: fagen::mbarrier_expect_tx(bar, operand); break;
      case 3: fagen::mbarrier_complete_tx(bar, operand); break;
      case 4: fagen::mbarrier_arrive_expect_tx(bar, operand); break;
    }
    results[i] = (fagen::mbarrier_try_wait_parity(bar, 0) ? 1 : 0) | (fagen::mbarrier_try_wait_parity(bar, 1) ? 2 : 0);
  }
}
FAGEN_EXPORT(mbarrier_script)

// One protocol error per `which`, in a block of 64 threads; thread 0 owns the
// barrier. out[t] = 1 for every thread that gets to the end.
//   0 none: init, fence, __syncthreads; thread 0 arrives, thread 32 waits.
//   1 thread 32 waits on a barrier nobody initialised.
//   2 thread 0 fences but thread 32 uses the barrier before any __syncthreads.
//   3 thread 0 completes two phases; thread 32, which last saw phase 0, waits for
//     parity 0 (the ABA problem).
//   4 thread 32 waits for a phase nobody completes (deadlock).
//   5 the wait names parity 2.
//   6 the barrier is not 8-byte aligned.
extern "C" __global__ void mbarrier_protocol(int* out, int which) {
  __shared__ __align__(8) uint64_t bars[3];
  uint64_t* bar = which == 1 ? &bars[1] : &bars[0];
  if (threadIdx.x == 0) {
    fagen::mbarrier_init(&bars[0], 1);
    fagen::mbarrier_init_fence();
  }
  if (which != 2) __syncthreads();
  if (threadIdx.x == 0 && which != 4) {
    fagen::mbarrier_arrive(&bars[0]);
    if (which == 3) fagen::mbarrier_arrive(&bars[0]);
  }
  if (which == 2 && threadIdx.x == 32) fagen::mbarrier_arrive(bar);
  if (which == 6 && threadIdx.x == 32) {
    fagen::mbarrier_wait_parity(reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(&bars[2]) + 4), 0);
  }
  if (threadIdx.x == 32) fagen::mbarrier_wait_parity(bar, which == 5 ? 2u : 0u);
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(mbarrier_protocol)
