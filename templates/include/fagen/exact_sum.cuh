// fagen/exact_sum.cuh — a sum whose result does not depend on the order of its terms: what
// deterministic=True uses for the gradients of captured tensors, which any score may add to
// (a bias table's entry takes the terms of every query and key that read it).
//
// Why exact: float addition is not associative, so float atomics give an order-dependent,
// schedule-dependent sum. A finite float is an integer times a power of two; cut the number
// line into 24-bit digits at fixed places, the lowest weighing 2^-149 (fp32's smallest
// subnormal). A float's 24-bit significand, shifted to its place, spans at most two digits, and
// each digit is an int64 that the terms' pieces are added to by integer atomics. Integer
// addition is associative, so the digits after the last term are the same in every order, and
// so is the float the host reads back from them (fagen/kernels/exact_sum.py, `value`).
// Infinities and NaNs go to a float slot of their own: their float sum (+inf, -inf or NaN) is
// the same in every order too.
//
// Layout: kExactSumWords int64 per summed value: digits 0..11 (digit w weighs 2^(24 w - 149);
// the highest float, 2^104 times a significand, reaches digit 11), then the special slot (a
// float in its low half; little-endian, as every CUDA GPU and the emulator's hosts are). A
// digit takes pieces below 2^24 in magnitude, so 2^39 terms per value sum without overflow.
//
// No inline PTX: integer and float atomicAdd only, so the emulator runs this header as is.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

constexpr int kExactSumDigitBits = 24;
constexpr int kExactSumDigits = 12;
constexpr int kExactSumWords = kExactSumDigits + 1;   // the digits, then the special slot

// words[0 .. kExactSumWords) += value, exactly.
__device__ __forceinline__ void exact_sum_add(long long* words, float value) {
  const unsigned bits = __float_as_uint(value);
  const int biased = (bits >> 23) & 0xff;
  if (biased == 0xff) {   // inf or NaN: the special slot's float sum
    atomicAdd(reinterpret_cast<float*>(words + kExactSumDigits), value);
    return;
  }
  // value = significand * 2^(place - 149); a subnormal's place is 0, as is the smallest normal's.
  // (+-0 adds two zero pieces: no branch, as the callers skip zero terms already.)
  const unsigned significand = (bits & 0x7fffffu) | (biased ? 0x800000u : 0u);
  const int place = biased ? biased - 1 : 0;
  const int digit = place / kExactSumDigitBits, shift = place % kExactSumDigitBits;
  // The significand shifted to its place: the digit's 24 bits, and the rest (below 2^23) in the
  // next; in 32-bit arithmetic, signed by two's complement (sign is 0 or -1).
  const int sign = static_cast<int>(bits) >> 31;
  const int low = (static_cast<int>((significand << shift) & 0xffffffu) ^ sign) - sign;
  const int high = (static_cast<int>(significand >> (kExactSumDigitBits - shift)) ^ sign) - sign;
  // Widened with their sign: an unsigned 64-bit atomic add of a negative piece subtracts it.
  atomicAdd(reinterpret_cast<unsigned long long*>(words + digit), static_cast<unsigned long long>(low));
  atomicAdd(reinterpret_cast<unsigned long long*>(words + digit + 1), static_cast<unsigned long long>(high));
}

}  // namespace fagen
