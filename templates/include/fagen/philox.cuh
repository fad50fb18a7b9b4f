// fagen/philox.cuh — Philox4x32-10 and fagen's dropout counter layout.
//
// Philox4x32-10 exactly as in Random123 (Salmon, Moraes, Dror, Shaw,
// "Parallel random numbers: as easy as 1, 2, 3", SC 2011); it reproduces
// Random123's published known-answer vectors (tests/test_philox.py checks
// them, and checks this header bit for bit against fagen.reference.philox).
//
// The header compiles three ways: as device code under NVRTC or nvcc
// (__CUDACC_RTC__ / __CUDACC__), and as plain host C++ (the emulator under
// FAGEN_EMULATE, and the host tests). It includes nothing, because NVRTC
// ships no C++ standard headers.
//
// Dropout counter layout
// ----------------------
// The keep decision for element (b, h, i, j) of the (B, H, Nq, Nk) score
// matrix is a function of (seed, offset, b, h, i, j) only (and of H, fixed for
// a launch), never of block sizes or the warp layout:
//
//   key     = (seed & 0xffffffff, seed >> 32)            64-bit seed
//   counter = (c0, c1, c2, c3) with
//     c0 = j >> 1                                        key column pair
//     c1 = ((i >> 4) << 3) | (i & 7)                     row, with bit 3 removed
//     c2 = b * H + h                                     (batch, head)
//     c3 = offset                                        32-bit offset
//   word    = ((i >> 3) & 1) * 2 + (j & 1)               which output word
//   keep    = philox4x32_10(counter, key)[word] < threshold
//   threshold = floor((1 - p) * 2^32), computed once on the host
//               (fagen.reference.dropout_threshold) and passed in as a uint32.
//
// Why this shape: rows i and i + 8 (i & 8 == 0) share c1 and columns j, j + 1
// (j even) share c0, so one Philox call yields the four elements
// (i, j), (i, j+1), (i+8, j), (i+8, j+1) as words 0, 1, 2, 3. Those are exactly
// the four fp32 accumulators one thread holds in a 16x8 mma.sync C fragment
// (c0, c1 at row lane/4, cols 2*(lane%4) + {0,1}; c2, c3 at row lane/4 + 8).
#pragma once

#ifndef FAGEN_HOST_DEVICE
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FAGEN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FAGEN_HOST_DEVICE inline
#endif
#endif

namespace fagen {

// Four 32-bit words: a Philox counter, or a Philox output.
struct PhiloxWords {
  unsigned int w[4];
};

// The two-word Philox key.
struct PhiloxKey {
  unsigned int w[2];
};

// Random123's constants: round multipliers and Weyl key increments
// (the golden ratio and sqrt(3) - 1, as 32-bit fractions).
constexpr unsigned int kPhiloxM0 = 0xD2511F53u;
constexpr unsigned int kPhiloxM1 = 0xCD9E8D57u;
constexpr unsigned int kPhiloxW0 = 0x9E3779B9u;
constexpr unsigned int kPhiloxW1 = 0xBB67AE85u;

// High 32 bits of a 32x32-bit product (the low half is the plain product).
FAGEN_HOST_DEVICE unsigned int philox_mulhi(unsigned int a, unsigned int b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
}

// One Philox S-P round.
FAGEN_HOST_DEVICE PhiloxWords philox4x32_round(PhiloxWords ctr, PhiloxKey key) {
  const unsigned int hi0 = philox_mulhi(kPhiloxM0, ctr.w[0]);
  const unsigned int lo0 = kPhiloxM0 * ctr.w[0];
  const unsigned int hi1 = philox_mulhi(kPhiloxM1, ctr.w[2]);
  const unsigned int lo1 = kPhiloxM1 * ctr.w[2];
  PhiloxWords out;
  out.w[0] = hi1 ^ ctr.w[1] ^ key.w[0];
  out.w[1] = lo1;
  out.w[2] = hi0 ^ ctr.w[3] ^ key.w[1];
  out.w[3] = lo0;
  return out;
}

FAGEN_HOST_DEVICE PhiloxKey philox4x32_bumpkey(PhiloxKey key) {
  key.w[0] += kPhiloxW0;  // wraps mod 2^32 by design
  key.w[1] += kPhiloxW1;
  return key;
}

// Philox4x32-10: ten rounds, the key bumped between consecutive rounds.
FAGEN_HOST_DEVICE PhiloxWords philox4x32_10(PhiloxWords ctr, PhiloxKey key) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::count_philox_call();  // the emulator's counters (`fagen profile`); nothing on the GPU
#endif
  ctr = philox4x32_round(ctr, key);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 1; r < 10; ++r) {
    key = philox4x32_bumpkey(key);
    ctr = philox4x32_round(ctr, key);
  }
  return ctr;
}

// The dropout key for a 64-bit seed.
FAGEN_HOST_DEVICE PhiloxKey dropout_key(unsigned long long seed) {
  PhiloxKey key;
  key.w[0] = static_cast<unsigned int>(seed & 0xffffffffull);
  key.w[1] = static_cast<unsigned int>(seed >> 32);
  return key;
}

// The counter of the element group containing (b, h, i, j); see the layout above.
FAGEN_HOST_DEVICE PhiloxWords dropout_counter(unsigned int b, unsigned int h, unsigned int num_heads,
                                              unsigned int i, unsigned int j, unsigned int offset) {
  PhiloxWords ctr;
  ctr.w[0] = j >> 1;
  ctr.w[1] = ((i >> 4) << 3) | (i & 7u);
  ctr.w[2] = b * num_heads + h;
  ctr.w[3] = offset;
  return ctr;
}

// Which of the group's four words decides element (i, j).
FAGEN_HOST_DEVICE unsigned int dropout_word_index(unsigned int i, unsigned int j) {
  return ((i >> 3) & 1u) * 2u + (j & 1u);
}

// The four words of the group containing (b, h, i, j): elements (i0, j0),
// (i0, j0+1), (i0+8, j0), (i0+8, j0+1), where j0 = j & ~1 and i0 = i & ~8.
FAGEN_HOST_DEVICE PhiloxWords dropout_words(unsigned long long seed, unsigned int offset,
                                            unsigned int b, unsigned int h, unsigned int num_heads,
                                            unsigned int i, unsigned int j) {
  return philox4x32_10(dropout_counter(b, h, num_heads, i, j, offset), dropout_key(seed));
}

// Keep decision for one element; kernels use dropout_words once per fragment instead.
FAGEN_HOST_DEVICE bool dropout_keep(unsigned long long seed, unsigned int offset, unsigned int b,
                                    unsigned int h, unsigned int num_heads, unsigned int i,
                                    unsigned int j, unsigned int threshold) {
  const PhiloxWords words = dropout_words(seed, offset, b, h, num_heads, i, j);
  // Select the word without indexing the array by a run-time value, which
  // would put `words` in local memory (a stack frame) on the GPU.
  const unsigned int index = dropout_word_index(i, j);
  const unsigned int word = index < 2 ? (index == 0 ? words.w[0] : words.w[1])
                                      : (index == 2 ? words.w[2] : words.w[3]);
  return word < threshold;
}

}  // namespace fagen
