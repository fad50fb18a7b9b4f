// Layout self-tests for the PTX wrappers and warp intrinsics. The same source
// runs in the emulator (tests/emulate/test_emulate_layouts.py) and, in the tests
// marked `gpu`, on a real GPU, against the same Python expectations: the
// first GPU run tells whether the emulator and the hardware agree.
//
// Fragments are loaded here straight from global memory by the documented
// formulas (fagen/mma.cuh, fagen/ldmatrix.cuh), not through ldmatrix, so a
// wrong formula in the docs shows up as a mismatch with torch's matmul.
#include <fagen/prelude.cuh>
#include <fagen/cp_async.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/mma.cuh>

namespace {

__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

__device__ __forceinline__ void mma_tile(float acc[4], const uint32_t a[4], const uint32_t b[2], __half) {
  fagen::mma_m16n8k16_f16(acc, a, b);
}
__device__ __forceinline__ void mma_tile(float acc[4], const uint32_t a[4], const uint32_t b[2],
                                         __nv_bfloat16) {
  fagen::mma_m16n8k16_bf16(acc, a, b);
}

// One 16x8x16 product per block (one warp): A 16x16 row-major, B 16x8
// row-major (k x n), C and D 16x8 row-major fp32; block b works on tile b.
template <class T>
__device__ void mma_by_layout(const T* A, const T* B, const float* C, float* D) {
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  A += blockIdx.x * 256;
  B += blockIdx.x * 128;
  C += blockIdx.x * 128;
  D += blockIdx.x * 128;
  uint32_t a[4], b[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
    a[i] = bits16(A[row * 16 + col]) | (bits16(A[row * 16 + col + 1]) << 16);
  }
  for (int j = 0; j < 2; ++j) {
    const int k = 2 * t + 8 * j;
    b[j] = bits16(B[k * 8 + g]) | (bits16(B[(k + 1) * 8 + g]) << 16);
  }
  for (int e = 0; e < 4; ++e) acc[e] = C[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2];
  mma_tile(acc, a, b, T());
  for (int e = 0; e < 4; ++e) D[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc[e];
}

// The same product with operands staged in shared memory and loaded by
// ldmatrix, as the attention kernels do: A by x4 (lane address
// &A[lane % 16][8 * (lane / 16)]); B once from a k x n tile with x2.trans
// (V's layout) and once from an n x k tile with plain x2 (K's layout).
template <class T>
__device__ void mma_by_ldmatrix(const T* A, const T* B_kn, const T* B_nk, const float* C, float* D_trans,
                                float* D_plain) {
  __shared__ __align__(16) T a_tile[16 * 24];   // rows padded to 24 elements (48 bytes)
  __shared__ __align__(16) T kn_tile[16 * 8];
  __shared__ __align__(16) T nk_tile[8 * 24];
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 256; i += 32) a_tile[(i / 16) * 24 + i % 16] = A[i];
  for (int i = lane; i < 128; i += 32) kn_tile[i] = B_kn[i];
  for (int i = lane; i < 128; i += 32) nk_tile[(i / 16) * 24 + i % 16] = B_nk[i];
  __syncthreads();
  uint32_t a[4], b_trans[2], b_plain[2];
  fagen::ldmatrix_x4(a, &a_tile[(lane % 16) * 24 + 8 * (lane / 16)]);
  fagen::ldmatrix_x2_trans(b_trans, &kn_tile[(lane % 16) * 8]);
  fagen::ldmatrix_x2(b_plain, &nk_tile[(lane % 8) * 24 + 8 * ((lane / 8) % 2)]);
  float acc_trans[4], acc_plain[4];
  for (int e = 0; e < 4; ++e) acc_trans[e] = acc_plain[e] = C[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2];
  mma_tile(acc_trans, a, b_trans, T());
  mma_tile(acc_plain, a, b_plain, T());
  for (int e = 0; e < 4; ++e) {
    D_trans[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc_trans[e];
    D_plain[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc_plain[e];
  }
}

// Raw registers: lane l's operands are a[4l + i], b[2l + j] and c[4l + e], packed by the
// test from the PTX ISA's fragment tables (tests/support/isa_fragments.py); d[4l + e] are the
// lane's result registers. No layout formula here: the layout lives only in the tables.
template <class T>
__device__ void mma_by_registers(const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  const int lane = threadIdx.x % 32;
  uint32_t a_regs[4], b_regs[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) a_regs[i] = a[4 * lane + i];
  for (int j = 0; j < 2; ++j) b_regs[j] = b[2 * lane + j];
  for (int e = 0; e < 4; ++e) acc[e] = c[4 * lane + e];
  mma_tile(acc, a_regs, b_regs, T());
  for (int e = 0; e < 4; ++e) d[4 * lane + e] = acc[e];
}

}  // namespace

extern "C" __global__ void mma_f16_registers(const unsigned* a, const unsigned* b, const float* c, float* d) {
  mma_by_registers<__half>(a, b, c, d);
}
FAGEN_EXPORT(mma_f16_registers)

extern "C" __global__ void mma_bf16_registers(const unsigned* a, const unsigned* b, const float* c, float* d) {
  mma_by_registers<__nv_bfloat16>(a, b, c, d);
}
FAGEN_EXPORT(mma_bf16_registers)

extern "C" __global__ void mma_f16_layout(const __half* A, const __half* B, const float* C, float* D) {
  mma_by_layout(A, B, C, D);
}
FAGEN_EXPORT(mma_f16_layout)

extern "C" __global__ void mma_bf16_layout(const __nv_bfloat16* A, const __nv_bfloat16* B, const float* C,
                                           float* D) {
  mma_by_layout(A, B, C, D);
}
FAGEN_EXPORT(mma_bf16_layout)

extern "C" __global__ void mma_f16_ldmatrix(const __half* A, const __half* B_kn, const __half* B_nk,
                                            const float* C, float* D_trans, float* D_plain) {
  mma_by_ldmatrix(A, B_kn, B_nk, C, D_trans, D_plain);
}
FAGEN_EXPORT(mma_f16_ldmatrix)

extern "C" __global__ void mma_bf16_ldmatrix(const __nv_bfloat16* A, const __nv_bfloat16* B_kn,
                                             const __nv_bfloat16* B_nk, const float* C, float* D_trans,
                                             float* D_plain) {
  mma_by_ldmatrix(A, B_kn, B_nk, C, D_trans, D_plain);
}
FAGEN_EXPORT(mma_bf16_ldmatrix)

// ldmatrix alone: `rows` is a 32 x 8 table of 16-bit values staged in shared
// memory; lane l passes the address of row perm[l]. out[lane * 4 + k] is
// register k of the lane (registers past `count` stay 0).
extern "C" __global__ void ldmatrix_layout(const short* rows, const int* perm, unsigned* out, int count,
                                           int transpose) {
  __shared__ __align__(16) short table[32 * 8];
  const int lane = threadIdx.x % 32;
  for (int c = 0; c < 8; ++c) table[lane * 8 + c] = rows[lane * 8 + c];
  __syncwarp();
  const void* row = &table[perm[lane] * 8];
  uint32_t r[4] = {0, 0, 0, 0};
  switch (count * 2 + (transpose ? 1 : 0)) {
    case 2: fagen::ldmatrix_x1(r, row); break;
    case 3: fagen::ldmatrix_x1_trans(r, row); break;
    case 4: fagen::ldmatrix_x2(r, row); break;
    case 5: fagen::ldmatrix_x2_trans(r, row); break;
    case 8: fagen::ldmatrix_x4(r, row); break;
    case 9: fagen::ldmatrix_x4_trans(r, row); break;
    default: break;
  }
  for (int k = 0; k < 4; ++k) out[lane * 4 + k] = r[k];
}
FAGEN_EXPORT(ldmatrix_layout)

// Warp intrinsics, one result per (case, thread): out[case * n + tid].
// `value` and `source` hold each thread's input value and source-lane operand.
extern "C" __global__ void warp_shuffles(const int* value, const int* source, int* out) {
  const int n = blockDim.x, tid = threadIdx.x, lane = tid % 32;
  const int v = value[tid];
  const unsigned full = 0xffffffffu;
  int c = 0;
  out[c++ * n + tid] = __shfl_sync(full, v, source[tid]);
  out[c++ * n + tid] = __shfl_sync(full, v, source[tid], 8);
  for (int m = 1; m < 32; m *= 2) out[c++ * n + tid] = __shfl_xor_sync(full, v, m);
  out[c++ * n + tid] = __shfl_xor_sync(full, v, 8, 8);   // lanes 8-15 of a segment read an earlier one
  out[c++ * n + tid] = __shfl_up_sync(full, v, 3);
  out[c++ * n + tid] = __shfl_up_sync(full, v, 3, 16);
  out[c++ * n + tid] = __shfl_down_sync(full, v, 5);
  out[c++ * n + tid] = __shfl_down_sync(full, v, 5, 16);
  out[c++ * n + tid] = static_cast<int>(__ballot_sync(full, v & 1));
  out[c++ * n + tid] = lane < 16 ? __shfl_xor_sync(0x0000ffffu, v, 1) : -1;  // half the warp, its own mask
  const double d = __shfl_xor_sync(full, v + 0.25, 3);                        // 8-byte payload
  out[c++ * n + tid] = static_cast<int>(d * 4.0);
  const __half h = __shfl_sync(full, __int2half_rn(v % 1024), 0);             // 2-byte payload
  out[c++ * n + tid] = static_cast<int>(__half2float(h));
  out[c++ * n + tid] = __any_sync(full, v == 7) + 2 * __all_sync(full, v >= 0);
}
FAGEN_EXPORT(warp_shuffles)

// A block-wide tree reduction with a barrier per level, on 2-D blocks, plus
// each thread's linear id as the runtime sees it.
extern "C" __global__ void block_reduce(const float* x, float* sums, int* linear_ids) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* partial = reinterpret_cast<float*>(smem);
  const int n = blockDim.x * blockDim.y;
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  partial[tid] = x[blockIdx.x * n + tid];
  linear_ids[blockIdx.x * n + tid] = tid;
  __syncthreads();
  for (int stride = n / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) sums[blockIdx.x] = partial[0];
}
FAGEN_EXPORT(block_reduce)

// Shared memory is per block: static and dynamic arrays hold this block's
// values across several barriers while other blocks run.
extern "C" __global__ void block_private(int* out, int rounds) {
  __shared__ int fixed[128];
  extern __shared__ __align__(16) unsigned char smem[];
  int* dynamic = reinterpret_cast<int*>(smem);
  const int tid = threadIdx.x, n = blockDim.x;
  const int mine = static_cast<int>(blockIdx.x) * 1000 + tid;
  fixed[tid] = mine;
  dynamic[tid] = -mine;
  int total = 0;
  for (int r = 0; r < rounds; ++r) {
    __syncthreads();
    total += fixed[(tid + r) % n] + dynamic[(tid + 2 * r) % n];
    __syncthreads();
  }
  out[blockIdx.x * n + tid] = total;
}
FAGEN_EXPORT(block_private)

// cp.async zero fill: thread i copies bytes [16 i, 16 i + 16) of `src`, of
// which only the first `valid` bytes of `src` exist; src-size is clamped so
// that nothing past them is read, the rest lands as zeros.
extern "C" __global__ void cp_async_zero_fill(const unsigned char* src, unsigned char* dst, int valid) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int i = threadIdx.x;
  const int remaining = valid - 16 * i;
  const int bytes = remaining < 0 ? 0 : (remaining > 16 ? 16 : remaining);
  fagen::cp_async_16(smem + 16 * i, bytes > 0 ? src + 16 * i : src, bytes);
  fagen::cp_async_commit();
  fagen::cp_async_wait<0>();
  __syncthreads();
  const int j = (i + 1) % blockDim.x;  // read another thread's chunk: needs the barrier
  for (int b = 0; b < 16; ++b) dst[16 * j + b] = smem[16 * j + b];
}
FAGEN_EXPORT(cp_async_zero_fill)

// Where each thread thinks it is: 12 ints per thread, blocks in x-fastest order.
extern "C" __global__ void thread_coordinates(int* out) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* mine = out + 12 * (block * threads + thread);
  const int values[12] = {(int)blockIdx.x,  (int)blockIdx.y,  (int)blockIdx.z,  (int)threadIdx.x,
                          (int)threadIdx.y, (int)threadIdx.z, (int)blockDim.x,  (int)blockDim.y,
                          (int)blockDim.z,  (int)gridDim.x,   (int)gridDim.y,   (int)gridDim.z};
  for (int i = 0; i < 12; ++i) mine[i] = values[i];
}
FAGEN_EXPORT(thread_coordinates)

// Atomics from every thread of every block, and barrier counts.
extern "C" __global__ void atomics_and_counts(const float* x, float* total, int* count, int* per_block) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(total, x[i]);
  atomicAdd(count, 1);
  atomicMax(count + 1, i);
  const int positives = __syncthreads_count(x[i] > 0.f);
  const int all_positive = __syncthreads_and(x[i] > 0.f);
  const int any_positive = __syncthreads_or(x[i] > 0.f);
  if (threadIdx.x == 0) {
    per_block[3 * blockIdx.x] = positives;
    per_block[3 * blockIdx.x + 1] = all_positive;
    per_block[3 * blockIdx.x + 2] = any_positive;
  }
}
FAGEN_EXPORT(atomics_and_counts)

// Conversions with the GPU's rounding, and the math/bit intrinsics kernels use.
extern "C" __global__ void numeric_intrinsics(const float* x, __half* h, __nv_bfloat16* b, float* f, int* bits) {
  const int i = threadIdx.x;
  const float v = x[i];
  h[i] = __float2half_rn(v);
  b[i] = __float2bfloat16_rn(v);
  const __half2 pair = __floats2half2_rn(v, -v);
  float* fo = f + 8 * i;
  fo[0] = __low2float(pair) - 3.0f * __high2float(pair);  // 4 * half(v)
  fo[1] = exp2f(v);
  fo[2] = __expf(v);
  fo[3] = __fdividef(v, 3.0f);
  fo[4] = __frcp_rn(v);
  fo[5] = rsqrtf(fabsf(v) + 1.0f);
  fo[6] = __saturatef(v);
  fo[7] = fmaxf(v, 0.5f) + fminf(v, -0.5f);
  int* bo = bits + 8 * i;
  const unsigned u = __float_as_uint(v);
  bo[0] = __float2int_rn(v * 100.0f);
  bo[1] = __popc(u);
  bo[2] = static_cast<int>(__brev(u));
  bo[3] = static_cast<int>(__byte_perm(u, 0x01234567u, 0x5140u));
  bo[4] = static_cast<int>(__funnelshift_l(u, 0x89abcdefu, 12));
  bo[5] = static_cast<int>(__umulhi(u, 0x9e3779b9u));
  bo[6] = max(i, 7) - min(i, 7);
  bo[7] = __clz(static_cast<int>(u >> (i % 32)));
}
FAGEN_EXPORT(numeric_intrinsics)
