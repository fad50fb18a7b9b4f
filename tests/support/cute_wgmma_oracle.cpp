// CuTe's own reading of wgmma's operands and fragments, printed for
// tests/emulate/test_emulate_wgmma_cute.py (compiled for the host with g++ against the headers
// of the nvidia-cutlass wheel; nothing of it ships with fagen). Output, one record a line:
//   desc <start> <lbo> <sbo> <base> <type> <bits>   GmmaDescriptor's bitfield -> 64 bits
//   swz <bits> <address> <swizzled>                 Swizzle<bits, 4, 3>::apply
//   tile <name> <rows> <kmajor> <type> <slice> <desc> <start> <bytes> then <rows * K> byte offsets
//       (element (mn, k) at mn * K + k, swizzle included, from a 1024-aligned buffer):
//       CuTe's canonical smem layout for a rows x K operand (fp16, K = 16, or e4m3, K = 32;
//       <bytes> per element), k-slice <slice> of the atom, and make_gmma_desc's descriptor of it
//       (start address 0: no shared window on the host)
//   acc <n> <thread> <value> <row> <col>             CLayout_64xN
//   afrag <bytes> <thread> <value> <row> <col>       ALayout_64x16 (16-bit), ALayout_64x32 (8-bit)
#include <cstdio>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

using namespace cute;

alignas(1024) static half_t buffer[256 * 128];

void descriptors() {
  const unsigned cases[][5] = {{0x400, 16, 1024, 0, 1}, {0x3fff0, 0x3fff0, 16, 7, 2}, {0x1230, 2048, 128, 3, 3},
                               {0x10, 128, 256, 0, 0}, {0x8000, 0x40, 0x800, 5, 1}, {0xffff0, 0x7fff0, 0x12340, 1, 3}};
  for (const auto& c : cases) {
    GmmaDescriptor desc;
    desc.bitfield.start_address_ = static_cast<uint16_t>(c[0] >> 4);
    desc.bitfield.leading_byte_offset_ = static_cast<uint16_t>(c[1] >> 4);
    desc.bitfield.stride_byte_offset_ = static_cast<uint16_t>(c[2] >> 4);
    desc.bitfield.base_offset_ = static_cast<uint8_t>(c[3]);
    desc.bitfield.layout_type_ = static_cast<uint8_t>(c[4]);
    std::printf("desc %u %u %u %u %u %llu\n", c[0], c[1], c[2], c[3], c[4],
                static_cast<unsigned long long>(desc.desc_));
  }
}

template <int B>
void swizzles() {
  for (int address = 0; address < 4096; address += 16) {
    std::printf("swz %d %d %d\n", B, address, int(Swizzle<B, 4, 3>::apply(address)));
  }
}

template <GMMA::Major kMajor, class Atom, int kRows, int kCols, class T = half_t>
void tile(const char* name) {
  constexpr int kK = 32 / sizeof(T);  // K of one wgmma: 32 bytes
  auto* elements = reinterpret_cast<T*>(buffer);
  auto tensor = make_tensor(make_smem_ptr(elements), tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kCols>>{}));
  for (int slice = 0; slice < kCols / kK; ++slice) {
    auto operand = local_tile(tensor, Shape<Int<kRows>, Int<kK>>{}, make_coord(0, slice));
    const GmmaDescriptor desc = GMMA::make_gmma_desc<kMajor>(operand);
    const auto* base = reinterpret_cast<const char*>(buffer);
    std::printf("tile %s %d %d %d %d %llu %ld %d", name, kRows, kMajor == GMMA::Major::K ? 1 : 0,
                int(desc.bitfield.layout_type_), slice, static_cast<unsigned long long>(desc.desc_),
                static_cast<long>(reinterpret_cast<const char*>(raw_pointer_cast(operand.data())) - base),
                int(sizeof(T)));
    for (int mn = 0; mn < kRows; ++mn)
      for (int k = 0; k < kK; ++k)
        std::printf(" %ld", static_cast<long>(reinterpret_cast<const char*>(&operand(mn, k)) - base));
    std::printf("\n");
  }
}

// K-major atoms are 8 x (W / 2) elements: tiles as wide as an atom along K (16 at least).
template <int kRows>
void k_major_tiles() {
  tile<GMMA::Major::K, GMMA::Layout_K_INTER_Atom<half_t>, kRows, 16>("k-none");
  tile<GMMA::Major::K, GMMA::Layout_K_SW32_Atom<half_t>, kRows, 16>("k-32B");
  tile<GMMA::Major::K, GMMA::Layout_K_SW64_Atom<half_t>, kRows, 32>("k-64B");
  tile<GMMA::Major::K, GMMA::Layout_K_SW128_Atom<half_t>, kRows, 64>("k-128B");
}

// The same for e4m3 (8-bit, K = 32): atoms 8 x W elements.
template <int kRows>
void k_major_tiles_8bit() {
  using T = float_e4m3_t;
  tile<GMMA::Major::K, GMMA::Layout_K_INTER_Atom<T>, kRows, 32, T>("k8-none");
  tile<GMMA::Major::K, GMMA::Layout_K_SW32_Atom<T>, kRows, 32, T>("k8-32B");
  tile<GMMA::Major::K, GMMA::Layout_K_SW64_Atom<T>, kRows, 64, T>("k8-64B");
  tile<GMMA::Major::K, GMMA::Layout_K_SW128_Atom<T>, kRows, 128, T>("k8-128B");
}

// MN-major atoms are (W / 2) x 8 elements: kRows must be a multiple of 64 for all four.
template <int kRows>
void mn_major_tiles() {
  tile<GMMA::Major::MN, GMMA::Layout_MN_INTER_Atom<half_t>, kRows, 16>("mn-none");
  tile<GMMA::Major::MN, GMMA::Layout_MN_SW32_Atom<half_t>, kRows, 16>("mn-32B");
  tile<GMMA::Major::MN, GMMA::Layout_MN_SW64_Atom<half_t>, kRows, 16>("mn-64B");
  tile<GMMA::Major::MN, GMMA::Layout_MN_SW128_Atom<half_t>, kRows, 16>("mn-128B");
}

template <int N>
void accumulator() {
  const auto layout = GMMA::CLayout_64xN<N>{};
  for (int thread = 0; thread < 128; ++thread)
    for (int value = 0; value < N / 2; ++value) {
      const int index = layout(thread, value);  // column-major 64 x N
      std::printf("acc %d %d %d %d %d\n", N, thread, value, index % 64, index / 64);
    }
}

int main() {
  descriptors();
  swizzles<1>();
  swizzles<2>();
  swizzles<3>();
  k_major_tiles<8>();
  k_major_tiles<64>();
  k_major_tiles<256>();
  k_major_tiles<32>();     // the sm90 backward's paired form: S^T's B, a warpgroup's 32 queries
  mn_major_tiles<64>();
  mn_major_tiles<192>();   // ... and its dK's B at d = 192: three 64-column atoms
  mn_major_tiles<256>();
  tile<GMMA::Major::MN, GMMA::Layout_MN_INTER_Atom<half_t>, 8, 16>("mn-none");
  k_major_tiles_8bit<8>();
  k_major_tiles_8bit<64>();
  k_major_tiles_8bit<256>();
  accumulator<8>();
  accumulator<24>();
  accumulator<32>();
  accumulator<64>();
  accumulator<256>();
  const auto a = GMMA::ALayout_64x16{};
  const auto a8 = GMMA::ALayout_64x32{};
  for (int thread = 0; thread < 128; ++thread) {
    for (int value = 0; value < 8; ++value) {
      const int index = a(thread, value);
      std::printf("afrag 2 %d %d %d %d\n", thread, value, index % 64, index / 64);
    }
    for (int value = 0; value < 16; ++value) {
      const int index = a8(thread, value);
      std::printf("afrag 1 %d %d %d %d\n", thread, value, index % 64, index / 64);
    }
  }
  return 0;
}
