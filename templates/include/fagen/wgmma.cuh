// fagen/wgmma.cuh — warpgroup tensor-core products (sm_90a), one warpgroup of 128 threads:
//   wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}   N = 8, 16, ..., 256
//   wgmma.mma_async.sync.aligned.m64nNk32.f32.{e4m3,e5m2}.{e4m3,e5m2} (wgmma_ss_fp8 / _rs_fp8)
//   wgmma.fence.sync.aligned;  wgmma.commit_group.sync.aligned;  wgmma.wait_group.sync.aligned N;
//
// D (64 x N, fp32) = A (64 x 16) * B (16 x N) + (scale_d ? D : 0), A and B negated by the
// immediates kScaleA / kScaleB = -1. A comes from shared memory (a descriptor, see
// fagen/smem_desc.cuh) or from registers; B from shared memory. kTransA / kTransB = 0 read the
// operand K-major, 1 MN-major (the ISA's imm-trans-a / imm-trans-b; fp16 and bf16 allow both).
// All 128 threads of a warpgroup (warps 4i..4i+3) call each of these together, at one call site.
//
// Fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for wgmma .m64nNk16).
// Thread t of the warpgroup: warp w = t / 32 owns rows 16w..16w+15; g = (t % 32) / 4, q = t % 4:
//   d[i], i < N/2:  D[16w + g + 8 * ((i / 2) % 2)][8 * (i / 4) + 2q + i % 2]
//     (mma.m16n8k16's C layout, repeated over the N/8 column blocks)
//   a[r], r < 4 (A from registers, two 16-bit elements, lower k in the low half):
//                   A[16w + g + 8 * (r % 2)][8 * (r / 2) + 2q + {0, 1}]   (mma.m16n8k16's A layout)
//
// Asynchrony: a wgmma is issued, not done. Its accumulators (and A registers) must not be touched
// until a wait_group retires the group it was committed in; the shared-memory operands must not
// change until then. A wgmma_fence() must come before the first wgmma and between any register
// write to an accumulator (or A fragment) and the next wgmma that uses it; wgmmas of one shape
// chained on one accumulator need none between them.
//
// Emulated twin: fagen_emu::wgmma_ss / wgmma_rs / wgmma_fence / wgmma_commit / wgmma_wait
// (fagen/emulate/src/wgmma.cpp): a warpgroup rendezvous that poisons the accumulators with NaN at
// issue, reads the shared operands at issue and again at the retiring wait (a fault if they
// changed), computes D there and faults on a missing fence. Exact products summed in double,
// rounded to fp32 once.
#pragma once

#include <fagen/prelude.cuh>
#include <fagen/smem_desc.cuh>

namespace fagen {

#ifndef FAGEN_EMULATE
// The inline PTX, one specialisation per N: D's N/2 registers are asm operands %0..%(N/2 - 1),
// the other operands follow (their numbers are the shape line's i0..i8).
template <int N>
struct WgmmaAsm;

// Register lists "%0, %1, ..." and their operands, in blocks of four (one n8 column block).
#define FAGEN_WGMMA_D1 "%0, %1, %2, %3"
#define FAGEN_WGMMA_D2 FAGEN_WGMMA_D1 ", %4, %5, %6, %7"
#define FAGEN_WGMMA_D3 FAGEN_WGMMA_D2 ", %8, %9, %10, %11"
#define FAGEN_WGMMA_D4 FAGEN_WGMMA_D3 ", %12, %13, %14, %15"
#define FAGEN_WGMMA_D5 FAGEN_WGMMA_D4 ", %16, %17, %18, %19"
#define FAGEN_WGMMA_D6 FAGEN_WGMMA_D5 ", %20, %21, %22, %23"
#define FAGEN_WGMMA_D7 FAGEN_WGMMA_D6 ", %24, %25, %26, %27"
#define FAGEN_WGMMA_D8 FAGEN_WGMMA_D7 ", %28, %29, %30, %31"
#define FAGEN_WGMMA_D9 FAGEN_WGMMA_D8 ", %32, %33, %34, %35"
#define FAGEN_WGMMA_D10 FAGEN_WGMMA_D9 ", %36, %37, %38, %39"
#define FAGEN_WGMMA_D11 FAGEN_WGMMA_D10 ", %40, %41, %42, %43"
#define FAGEN_WGMMA_D12 FAGEN_WGMMA_D11 ", %44, %45, %46, %47"
#define FAGEN_WGMMA_D13 FAGEN_WGMMA_D12 ", %48, %49, %50, %51"
#define FAGEN_WGMMA_D14 FAGEN_WGMMA_D13 ", %52, %53, %54, %55"
#define FAGEN_WGMMA_D15 FAGEN_WGMMA_D14 ", %56, %57, %58, %59"
#define FAGEN_WGMMA_D16 FAGEN_WGMMA_D15 ", %60, %61, %62, %63"
#define FAGEN_WGMMA_D17 FAGEN_WGMMA_D16 ", %64, %65, %66, %67"
#define FAGEN_WGMMA_D18 FAGEN_WGMMA_D17 ", %68, %69, %70, %71"
#define FAGEN_WGMMA_D19 FAGEN_WGMMA_D18 ", %72, %73, %74, %75"
#define FAGEN_WGMMA_D20 FAGEN_WGMMA_D19 ", %76, %77, %78, %79"
#define FAGEN_WGMMA_D21 FAGEN_WGMMA_D20 ", %80, %81, %82, %83"
#define FAGEN_WGMMA_D22 FAGEN_WGMMA_D21 ", %84, %85, %86, %87"
#define FAGEN_WGMMA_D23 FAGEN_WGMMA_D22 ", %88, %89, %90, %91"
#define FAGEN_WGMMA_D24 FAGEN_WGMMA_D23 ", %92, %93, %94, %95"
#define FAGEN_WGMMA_D25 FAGEN_WGMMA_D24 ", %96, %97, %98, %99"
#define FAGEN_WGMMA_D26 FAGEN_WGMMA_D25 ", %100, %101, %102, %103"
#define FAGEN_WGMMA_D27 FAGEN_WGMMA_D26 ", %104, %105, %106, %107"
#define FAGEN_WGMMA_D28 FAGEN_WGMMA_D27 ", %108, %109, %110, %111"
#define FAGEN_WGMMA_D29 FAGEN_WGMMA_D28 ", %112, %113, %114, %115"
#define FAGEN_WGMMA_D30 FAGEN_WGMMA_D29 ", %116, %117, %118, %119"
#define FAGEN_WGMMA_D31 FAGEN_WGMMA_D30 ", %120, %121, %122, %123"
#define FAGEN_WGMMA_D32 FAGEN_WGMMA_D31 ", %124, %125, %126, %127"
#define FAGEN_WGMMA_O1(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define FAGEN_WGMMA_O2(d) FAGEN_WGMMA_O1(d), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define FAGEN_WGMMA_O3(d) FAGEN_WGMMA_O2(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define FAGEN_WGMMA_O4(d) FAGEN_WGMMA_O3(d), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define FAGEN_WGMMA_O5(d) FAGEN_WGMMA_O4(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define FAGEN_WGMMA_O6(d) FAGEN_WGMMA_O5(d), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define FAGEN_WGMMA_O7(d) FAGEN_WGMMA_O6(d), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
#define FAGEN_WGMMA_O8(d) FAGEN_WGMMA_O7(d), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FAGEN_WGMMA_O9(d) FAGEN_WGMMA_O8(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define FAGEN_WGMMA_O10(d) FAGEN_WGMMA_O9(d), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define FAGEN_WGMMA_O11(d) FAGEN_WGMMA_O10(d), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43])
#define FAGEN_WGMMA_O12(d) FAGEN_WGMMA_O11(d), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define FAGEN_WGMMA_O13(d) FAGEN_WGMMA_O12(d), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
#define FAGEN_WGMMA_O14(d) FAGEN_WGMMA_O13(d), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
#define FAGEN_WGMMA_O15(d) FAGEN_WGMMA_O14(d), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
#define FAGEN_WGMMA_O16(d) FAGEN_WGMMA_O15(d), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FAGEN_WGMMA_O17(d) FAGEN_WGMMA_O16(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
#define FAGEN_WGMMA_O18(d) FAGEN_WGMMA_O17(d), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
#define FAGEN_WGMMA_O19(d) FAGEN_WGMMA_O18(d), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75])
#define FAGEN_WGMMA_O20(d) FAGEN_WGMMA_O19(d), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define FAGEN_WGMMA_O21(d) FAGEN_WGMMA_O20(d), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83])
#define FAGEN_WGMMA_O22(d) FAGEN_WGMMA_O21(d), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define FAGEN_WGMMA_O23(d) FAGEN_WGMMA_O22(d), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91])
#define FAGEN_WGMMA_O24(d) FAGEN_WGMMA_O23(d), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define FAGEN_WGMMA_O25(d) FAGEN_WGMMA_O24(d), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
#define FAGEN_WGMMA_O26(d) FAGEN_WGMMA_O25(d), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
#define FAGEN_WGMMA_O27(d) FAGEN_WGMMA_O26(d), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107])
#define FAGEN_WGMMA_O28(d) FAGEN_WGMMA_O27(d), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
#define FAGEN_WGMMA_O29(d) FAGEN_WGMMA_O28(d), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115])
#define FAGEN_WGMMA_O30(d) FAGEN_WGMMA_O29(d), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
#define FAGEN_WGMMA_O31(d) FAGEN_WGMMA_O30(d), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123])
#define FAGEN_WGMMA_O32(d) FAGEN_WGMMA_O31(d), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#define FAGEN_WGMMA_SS(N, B, T, i0, i1, i2, i3, i4, i5, i6)                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " i2 ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #T "." #T " {" FAGEN_WGMMA_D##B    \
               "}, " i0 ", " i1 ", p, " i3 ", " i4 ", " i5 ", " i6 ";\n}\n"                         \
               : FAGEN_WGMMA_O##B(d)                                                                \
               : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),  \
                 "n"(kTransB))
#define FAGEN_WGMMA_RS(N, B, T, i0, i1, i2, i3, i4, i5, i6, i7, i8)                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " i5 ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #T "." #T " {" FAGEN_WGMMA_D##B    \
               "}, {" i0 ", " i1 ", " i2 ", " i3 "}, " i4 ", p, " i6 ", " i7 ", " i8 ";\n}\n"       \
               : FAGEN_WGMMA_O##B(d)                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kScaleA), \
                 "n"(kScaleB), "n"(kTransB))
#define FAGEN_WGMMA_SS8(N, B, TA, TB, i0, i1, i2, i3, i4)                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " i2 ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." #TA "." #TB " {" FAGEN_WGMMA_D##B  \
               "}, " i0 ", " i1 ", p, " i3 ", " i4 ";\n}\n"                                         \
               : FAGEN_WGMMA_O##B(d)                                                                \
               : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kScaleA), "n"(kScaleB))
#define FAGEN_WGMMA_RS8(N, B, TA, TB, i0, i1, i2, i3, i4, i5, i6, i7)                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " i5 ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." #TA "." #TB " {" FAGEN_WGMMA_D##B  \
               "}, {" i0 ", " i1 ", " i2 ", " i3 "}, " i4 ", p, " i6 ", " i7 ";\n}\n"               \
               : FAGEN_WGMMA_O##B(d)                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kScaleA), \
                 "n"(kScaleB))
#define FAGEN_WGMMA_SHAPE(N, B, i0, i1, i2, i3, i4, i5, i6, i7, i8)                                 \
  template <>                                                                                       \
  struct WgmmaAsm<N> {                                                                              \
    template <int kScaleA, int kScaleB, int kTransA, int kTransB, bool kBf16>                       \
    static __device__ __forceinline__ void ss(float* d, uint64_t a_desc, uint64_t b_desc, int scale_d) { \
      if (kBf16) {                                                                                  \
        FAGEN_WGMMA_SS(N, B, bf16, i0, i1, i2, i3, i4, i5, i6);                                     \
      } else {                                                                                      \
        FAGEN_WGMMA_SS(N, B, f16, i0, i1, i2, i3, i4, i5, i6);                                      \
      }                                                                                             \
    }                                                                                               \
    template <int kScaleA, int kScaleB, int kTransB, bool kBf16>                                    \
    static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b_desc, int scale_d) { \
      if (kBf16) {                                                                                  \
        FAGEN_WGMMA_RS(N, B, bf16, i0, i1, i2, i3, i4, i5, i6, i7, i8);                             \
      } else {                                                                                      \
        FAGEN_WGMMA_RS(N, B, f16, i0, i1, i2, i3, i4, i5, i6, i7, i8);                              \
      }                                                                                             \
    }                                                                                               \
    template <int kScaleA, int kScaleB, bool kAE5M2, bool kBE5M2>                                   \
    static __device__ __forceinline__ void ss8(float* d, uint64_t a_desc, uint64_t b_desc, int scale_d) { \
      if (kAE5M2 && kBE5M2) {                                                                       \
        FAGEN_WGMMA_SS8(N, B, e5m2, e5m2, i0, i1, i2, i3, i4);                                      \
      } else if (kAE5M2) {                                                                          \
        FAGEN_WGMMA_SS8(N, B, e5m2, e4m3, i0, i1, i2, i3, i4);                                      \
      } else if (kBE5M2) {                                                                          \
        FAGEN_WGMMA_SS8(N, B, e4m3, e5m2, i0, i1, i2, i3, i4);                                      \
      } else {                                                                                      \
        FAGEN_WGMMA_SS8(N, B, e4m3, e4m3, i0, i1, i2, i3, i4);                                      \
      }                                                                                             \
    }                                                                                               \
    template <int kScaleA, int kScaleB, bool kAE5M2, bool kBE5M2>                                   \
    static __device__ __forceinline__ void rs8(float* d, const uint32_t* a, uint64_t b_desc, int scale_d) { \
      if (kAE5M2 && kBE5M2) {                                                                       \
        FAGEN_WGMMA_RS8(N, B, e5m2, e5m2, i0, i1, i2, i3, i4, i5, i6, i7);                          \
      } else if (kAE5M2) {                                                                          \
        FAGEN_WGMMA_RS8(N, B, e5m2, e4m3, i0, i1, i2, i3, i4, i5, i6, i7);                          \
      } else if (kBE5M2) {                                                                          \
        FAGEN_WGMMA_RS8(N, B, e4m3, e5m2, i0, i1, i2, i3, i4, i5, i6, i7);                          \
      } else {                                                                                      \
        FAGEN_WGMMA_RS8(N, B, e4m3, e4m3, i0, i1, i2, i3, i4, i5, i6, i7);                          \
      }                                                                                             \
    }                                                                                               \
  };

FAGEN_WGMMA_SHAPE(8, 1, "%4", "%5", "%6", "%7", "%8", "%9", "%10", "%11", "%12")
FAGEN_WGMMA_SHAPE(16, 2, "%8", "%9", "%10", "%11", "%12", "%13", "%14", "%15", "%16")
FAGEN_WGMMA_SHAPE(24, 3, "%12", "%13", "%14", "%15", "%16", "%17", "%18", "%19", "%20")
FAGEN_WGMMA_SHAPE(32, 4, "%16", "%17", "%18", "%19", "%20", "%21", "%22", "%23", "%24")
FAGEN_WGMMA_SHAPE(40, 5, "%20", "%21", "%22", "%23", "%24", "%25", "%26", "%27", "%28")
FAGEN_WGMMA_SHAPE(48, 6, "%24", "%25", "%26", "%27", "%28", "%29", "%30", "%31", "%32")
FAGEN_WGMMA_SHAPE(56, 7, "%28", "%29", "%30", "%31", "%32", "%33", "%34", "%35", "%36")
FAGEN_WGMMA_SHAPE(64, 8, "%32", "%33", "%34", "%35", "%36", "%37", "%38", "%39", "%40")
FAGEN_WGMMA_SHAPE(72, 9, "%36", "%37", "%38", "%39", "%40", "%41", "%42", "%43", "%44")
FAGEN_WGMMA_SHAPE(80, 10, "%40", "%41", "%42", "%43", "%44", "%45", "%46", "%47", "%48")
FAGEN_WGMMA_SHAPE(88, 11, "%44", "%45", "%46", "%47", "%48", "%49", "%50", "%51", "%52")
FAGEN_WGMMA_SHAPE(96, 12, "%48", "%49", "%50", "%51", "%52", "%53", "%54", "%55", "%56")
FAGEN_WGMMA_SHAPE(104, 13, "%52", "%53", "%54", "%55", "%56", "%57", "%58", "%59", "%60")
FAGEN_WGMMA_SHAPE(112, 14, "%56", "%57", "%58", "%59", "%60", "%61", "%62", "%63", "%64")
FAGEN_WGMMA_SHAPE(120, 15, "%60", "%61", "%62", "%63", "%64", "%65", "%66", "%67", "%68")
FAGEN_WGMMA_SHAPE(128, 16, "%64", "%65", "%66", "%67", "%68", "%69", "%70", "%71", "%72")
FAGEN_WGMMA_SHAPE(136, 17, "%68", "%69", "%70", "%71", "%72", "%73", "%74", "%75", "%76")
FAGEN_WGMMA_SHAPE(144, 18, "%72", "%73", "%74", "%75", "%76", "%77", "%78", "%79", "%80")
FAGEN_WGMMA_SHAPE(152, 19, "%76", "%77", "%78", "%79", "%80", "%81", "%82", "%83", "%84")
FAGEN_WGMMA_SHAPE(160, 20, "%80", "%81", "%82", "%83", "%84", "%85", "%86", "%87", "%88")
FAGEN_WGMMA_SHAPE(168, 21, "%84", "%85", "%86", "%87", "%88", "%89", "%90", "%91", "%92")
FAGEN_WGMMA_SHAPE(176, 22, "%88", "%89", "%90", "%91", "%92", "%93", "%94", "%95", "%96")
FAGEN_WGMMA_SHAPE(184, 23, "%92", "%93", "%94", "%95", "%96", "%97", "%98", "%99", "%100")
FAGEN_WGMMA_SHAPE(192, 24, "%96", "%97", "%98", "%99", "%100", "%101", "%102", "%103", "%104")
FAGEN_WGMMA_SHAPE(200, 25, "%100", "%101", "%102", "%103", "%104", "%105", "%106", "%107", "%108")
FAGEN_WGMMA_SHAPE(208, 26, "%104", "%105", "%106", "%107", "%108", "%109", "%110", "%111", "%112")
FAGEN_WGMMA_SHAPE(216, 27, "%108", "%109", "%110", "%111", "%112", "%113", "%114", "%115", "%116")
FAGEN_WGMMA_SHAPE(224, 28, "%112", "%113", "%114", "%115", "%116", "%117", "%118", "%119", "%120")
FAGEN_WGMMA_SHAPE(232, 29, "%116", "%117", "%118", "%119", "%120", "%121", "%122", "%123", "%124")
FAGEN_WGMMA_SHAPE(240, 30, "%120", "%121", "%122", "%123", "%124", "%125", "%126", "%127", "%128")
FAGEN_WGMMA_SHAPE(248, 31, "%124", "%125", "%126", "%127", "%128", "%129", "%130", "%131", "%132")
FAGEN_WGMMA_SHAPE(256, 32, "%128", "%129", "%130", "%131", "%132", "%133", "%134", "%135", "%136")

#undef FAGEN_WGMMA_SHAPE
#undef FAGEN_WGMMA_RS8
#undef FAGEN_WGMMA_SS8
#undef FAGEN_WGMMA_RS
#undef FAGEN_WGMMA_SS

#endif  // !FAGEN_EMULATE

template <int N, int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_check_immediates() {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma .m64nNk16: N is a multiple of 8 in [8, 256]");
  static_assert((kScaleA == 1 || kScaleA == -1) && (kScaleB == 1 || kScaleB == -1), "imm-scale is 1 or -1");
  static_assert((kTransA == 0 || kTransA == 1) && (kTransB == 0 || kTransB == 1), "imm-trans is 0 or 1");
}

// A and B from shared memory. d: this thread's N/2 accumulators; scale_d = 0 overwrites them.
template <int N, bool kBf16, int kTransA = 0, int kTransB = 0, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc,
                                         int scale_d FAGEN_CALL_SITE_PARAMS) {
  wgmma_check_immediates<N, kScaleA, kScaleB, kTransA, kTransB>();
#ifdef FAGEN_EMULATE
  constexpr auto type = kBf16 ? ::fagen_emu::WgmmaInput::bf16 : ::fagen_emu::WgmmaInput::f16;
  ::fagen_emu::wgmma_ss(type, type, N, d, a_desc, b_desc, scale_d, kScaleA, kScaleB, kTransA, kTransB,
                        FAGEN_CALL_SITE);
#else
  WgmmaAsm<N>::template ss<kScaleA, kScaleB, kTransA, kTransB, kBf16>(d, a_desc, b_desc, scale_d);
#endif
}

// A from registers (a[4], the layout above), B from shared memory.
template <int N, bool kBf16, int kTransB = 0, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc,
                                         int scale_d FAGEN_CALL_SITE_PARAMS) {
  wgmma_check_immediates<N, kScaleA, kScaleB, 0, kTransB>();
#ifdef FAGEN_EMULATE
  constexpr auto type = kBf16 ? ::fagen_emu::WgmmaInput::bf16 : ::fagen_emu::WgmmaInput::f16;
  ::fagen_emu::wgmma_rs(type, type, N, d, a, b_desc, scale_d, kScaleA, kScaleB, kTransB, FAGEN_CALL_SITE);
#else
  WgmmaAsm<N>::template rs<kScaleA, kScaleB, kTransB, kBf16>(d, a, b_desc, scale_d);
#endif
}

// 8-bit inputs, .m64nNk32 (K = 32 bytes as for 16-bit K = 16): kAE5M2 / kBE5M2 pick e5m2 over
// e4m3 for A / B. K-major operands only (no imm-trans for 8-bit types). From registers, a[r]
// holds A[16w + g + 8 * (r % 2)][16 * (r / 2) + 4q + {0, 1, 2, 3}], the lowest k in the low byte.
template <int N, bool kAE5M2, bool kBE5M2, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_ss_fp8(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc,
                                             int scale_d FAGEN_CALL_SITE_PARAMS) {
  wgmma_check_immediates<N, kScaleA, kScaleB, 0, 0>();
#ifdef FAGEN_EMULATE
  using ::fagen_emu::WgmmaInput;
  ::fagen_emu::wgmma_ss(kAE5M2 ? WgmmaInput::e5m2 : WgmmaInput::e4m3, kBE5M2 ? WgmmaInput::e5m2 : WgmmaInput::e4m3,
                        N, d, a_desc, b_desc, scale_d, kScaleA, kScaleB, 0, 0, FAGEN_CALL_SITE);
#else
  WgmmaAsm<N>::template ss8<kScaleA, kScaleB, kAE5M2, kBE5M2>(d, a_desc, b_desc, scale_d);
#endif
}

template <int N, bool kAE5M2, bool kBE5M2, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_rs_fp8(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc,
                                             int scale_d FAGEN_CALL_SITE_PARAMS) {
  wgmma_check_immediates<N, kScaleA, kScaleB, 0, 0>();
#ifdef FAGEN_EMULATE
  using ::fagen_emu::WgmmaInput;
  ::fagen_emu::wgmma_rs(kAE5M2 ? WgmmaInput::e5m2 : WgmmaInput::e4m3, kBE5M2 ? WgmmaInput::e5m2 : WgmmaInput::e4m3,
                        N, d, a, b_desc, scale_d, kScaleA, kScaleB, 0, FAGEN_CALL_SITE);
#else
  WgmmaAsm<N>::template rs8<kScaleA, kScaleB, kAE5M2, kBE5M2>(d, a, b_desc, scale_d);
#endif
}

// Orders this thread's earlier accesses to accumulator and A registers before the next wgmma.
// (Shared-memory writes by threads, read by a wgmma, also need fence.proxy.async on the GPU.)
__device__ __forceinline__ void wgmma_fence(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::wgmma_fence(FAGEN_CALL_SITE);
#else
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// Closes a group: every wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::wgmma_commit(FAGEN_CALL_SITE);
#else
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most N committed groups are in flight; their accumulators are then readable.
// Pin the accumulators with wgmma_fence_operands() around it, so that the compiler does not
// move their reads above the wait.
template <int N>
__device__ __forceinline__ void wgmma_wait(FAGEN_CALL_SITE_PARAMS_FIRST) {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes a count in [0, 7]");
#ifdef FAGEN_EMULATE
  ::fagen_emu::wgmma_wait(N, FAGEN_CALL_SITE);
#else
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// An empty asm that reads and writes each accumulator register: no access to them moves across it.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N / 2]) {
#ifndef FAGEN_EMULATE
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// The A fragments of wgmma_rs, pinned as the accumulators are: the compiler neither moves their
// writes across the wait nor gives their registers to other values while a group still reads them
// (the PTX ISA leaves touching them before the retiring wait undefined).
template <int K>
__device__ __forceinline__ void wgmma_fence_fragments(uint32_t (&a)[K][4]) {
#ifndef FAGEN_EMULATE
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[k][r])::"memory");
  }
#endif
}

}  // namespace fagen
