// Blocks that take turns on a global semaphore (fagen/semaphore.cuh), as a deterministic
// reduction across blocks does: block b's thread 0 waits until the counter is b's turn while the
// block's other threads wait for it at __syncthreads (the block parks), then every thread adds into
// `acc` with a plain read-modify-write and thread 0 appends b to the log at the counter's value;
// after a barrier thread 0 arrives. Modes: 0 turn b, 1 turn gridDim.x - 1 - b (flipped), 2 no wait.
#include <fagen/prelude.cuh>
#include <fagen/semaphore.cuh>

extern "C" __global__ void ordered_log(int* counter, int* log, float* acc, int mode) {
  __shared__ float staged[64];
  const int b = blockIdx.x, t = threadIdx.x;
  staged[t] = static_cast<float>(b * 100 + t);
  __syncthreads();
  if (t == 0 && mode != 2) fagen::semaphore_wait_eq(counter, mode == 1 ? gridDim.x - 1 - b : b);
  __syncthreads();  // the other threads wait here for thread 0's turn
  acc[t] += staged[(t + 1) % blockDim.x];  // ordered across blocks by the semaphore alone
  if (t == 0) log[*static_cast<volatile int*>(counter)] = b;
  __syncthreads();  // every thread's store before the arrive
  if (t == 0) fagen::semaphore_arrive(counter);
}
FAGEN_EXPORT(ordered_log)

// Block 0 waits for the counter to be 1; block 1 arrives `arrives` times (2: past the value).
extern "C" __global__ void overshoot(int* counter, int arrives) {
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) {
    fagen::semaphore_wait_eq(counter, 1);
  } else {
    for (int i = 0; i < arrives; ++i) fagen::semaphore_arrive(counter);
  }
}
FAGEN_EXPORT(overshoot)
