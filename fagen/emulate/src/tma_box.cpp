// The TMA twin's box (fagen_emulate/tma.h): which global elements a tile copy of a tensor map
// reads or writes, and where they sit in shared memory under the map's swizzle. The copies'
// asynchrony is tma.cpp's.
#include "tma_box.h"

#include <fagen_emulate/tma.h>

#include <cstring>
#include <string>
#include <vector>

namespace fagen_emu {

BoxShape box_shape(const EmulatedTensorMap& map, Site site) {
  if (map.magic != kTensorMapMagic || map.version != kTensorMapVersion) {
    fail(site, "a TMA copy's tensor map is not fagen's emulated encoding (TensorMapSpec.emulated_bytes); "
               "a driver-encoded map cannot be read on the CPU");
  }
  if (map.rank < 1 || map.rank > kTensorMapMaxRank) fail(site, "a tensor map of rank %d", map.rank);
  BoxShape shape;
  shape.rank = map.rank;
  for (int d = 0; d < map.rank; ++d) {
    const uint32_t step = d == 0 ? 1 : map.element_strides[d];
    shape.counts[d] = (map.box_dims[d] + step - 1) / step;
    shape.elements *= shape.counts[d];
  }
  shape.bytes = shape.elements * map.element_bytes;
  return shape;
}

namespace {

// The byte offset of the box element `flat` (dim 0 fastest) from the map's global address, or -1
// when it lies outside the tensor.
int64_t global_offset(const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords, std::size_t flat) {
  int64_t offset = 0;
  for (int d = 0; d < shape.rank; ++d) {
    const int64_t k = static_cast<int64_t>(flat % shape.counts[d]);
    flat /= shape.counts[d];
    const int64_t step = d == 0 ? 1 : map.element_strides[d];
    const int64_t x = static_cast<int64_t>(coords[d]) + k * step;
    if (x < 0 || x >= static_cast<int64_t>(map.global_dims[d])) return -1;
    offset += d == 0 ? x * map.element_bytes : x * static_cast<int64_t>(map.global_strides[d - 1]);
  }
  return offset;
}

// Where a dense box's byte at `offset` from `base` lands under the map's swizzle.
unsigned char* swizzled(unsigned char* base, std::size_t offset, int swizzle) {
  // CUtensorMapSwizzle 1, 2, 3 (32B, 64B, 128B) XOR that many bits.
  const uintptr_t address = reinterpret_cast<uintptr_t>(base) + offset;
  return reinterpret_cast<unsigned char*>(swizzled_shared_address(address, static_cast<unsigned>(swizzle)));
}

}  // namespace

void check_shared_box(const void* shared, const EmulatedTensorMap& map, const BoxShape& shape, const char* what,
                      Site site) {
  if (reinterpret_cast<uintptr_t>(shared) % 128 != 0) {
    fail(site, "%s: the shared-memory box at %p is not 128-byte aligned", what, shared);
  }
  if (map.swizzle != 0 && map.box_dims[0] * map.element_bytes != (16u << map.swizzle)) {
    // The driver allows an inner box narrower than the swizzle span; how the hardware lays its
    // rows out then is not modelled until a GPU run pins it.
    fail(site, "%s: an inner box of %u bytes under a %u-byte swizzle is not modelled", what,
         map.box_dims[0] * map.element_bytes, 16u << map.swizzle);
  }
  check_dynamic_shared_range(shared, shape.bytes, what, site);
}

namespace {

// Whether any element c + k * step (k < count) of a box's dim lies in [0, extent).
bool dim_meets_tensor(int64_t c, int64_t step, int64_t count, int64_t extent) {
  const int64_t first = c >= 0 ? 0 : (-c + step - 1) / step;   // the first k with c + k * step >= 0
  return first < count && c + first * step < extent;
}

}  // namespace

void check_box_meets_tensor(const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                            const char* what, Site site) {
  for (int d = 0; d < shape.rank; ++d) {
    const int64_t step = d == 0 ? 1 : map.element_strides[d];
    const auto extent = static_cast<int64_t>(map.global_dims[d]);
    if (dim_meets_tensor(coords[d], step, shape.counts[d], extent)) continue;
    std::string at;
    for (int i = 0; i < shape.rank; ++i) at += (i ? ", " : "") + std::to_string(coords[i]);
    const int64_t last = coords[d] + (static_cast<int64_t>(shape.counts[d]) - 1) * step;
    fail(site, "%s: the box at coordinates (%s) (innermost first) lies wholly outside the tensor: its dim %d "
               "covers %lld..%lld of 0..%lld. Whether TMA zero-fills such a box and counts its bytes is not "
               "documented; a kernel must not issue it", what, at.c_str(), d, static_cast<long long>(coords[d]),
         static_cast<long long>(last), static_cast<long long>(extent - 1));
  }
}

namespace {

void fill_out_of_bounds(unsigned char* element, const EmulatedTensorMap& map) {
  std::memset(element, 0, map.element_bytes);
  if (map.oob_fill == 0) return;
  // A quiet NaN of the element's width, little-endian: all exponent bits and the top mantissa bit.
  std::memset(element, 0xFF, map.element_bytes);
  element[map.element_bytes - 1] = 0x7F;
}

}  // namespace

void copy_box_in(void* shared_dst, const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                 Site site) {
  auto* base = static_cast<unsigned char*>(shared_dst);
  const auto* global = reinterpret_cast<const unsigned char*>(map.global_address);
  const bool instrumented = instrumenting();
  for (std::size_t flat = 0; flat < shape.elements; ++flat) {
    unsigned char element[8];
    const int64_t offset = global_offset(map, shape, coords, flat);
    if (offset < 0) {
      fill_out_of_bounds(element, map);
    } else {
      if (instrumented) {
        global_access(thread_ref(*current_fiber), global + offset, map.element_bytes, false, false,
                      runtime_site(site));
      }
      std::memcpy(element, global + offset, map.element_bytes);
    }
    for (unsigned b = 0; b < map.element_bytes; ++b) {
      *swizzled(base, flat * map.element_bytes + b, map.swizzle) = element[b];
    }
  }
}

void copy_box_out(const EmulatedTensorMap& map, const BoxShape& shape, const int32_t* coords,
                  const unsigned char* dense, Site site, const BoxElementWrite& write) {
  auto* global = reinterpret_cast<unsigned char*>(map.global_address);
  const bool instrumented = instrumenting();
  for (std::size_t flat = 0; flat < shape.elements; ++flat) {
    const int64_t offset = global_offset(map, shape, coords, flat);
    if (offset < 0) continue;  // a store skips what lies outside the tensor
    if (instrumented) {
      global_access(thread_ref(*current_fiber), global + offset, map.element_bytes, true, false, runtime_site(site));
    }
    write(global + offset, dense + flat * map.element_bytes);
  }
}

void unswizzle_box(const void* shared_src, const EmulatedTensorMap& map, const BoxShape& shape,
                   unsigned char* dense) {
  auto* base = const_cast<unsigned char*>(static_cast<const unsigned char*>(shared_src));
  for (std::size_t i = 0; i < shape.bytes; ++i) dense[i] = *swizzled(base, i, map.swizzle);
}

void tma_load_box_now(void* shared_dst, const EmulatedTensorMap* map, const int32_t* coords, Site site) {
  const BoxShape shape = box_shape(*map, site);
  check_shared_box(shared_dst, *map, shape, "cp.async.bulk.tensor load", site);
  check_box_meets_tensor(*map, shape, coords, "cp.async.bulk.tensor load", site);
  copy_box_in(shared_dst, *map, shape, coords, site);
}

void tma_store_box_now(const EmulatedTensorMap* map, const int32_t* coords, const void* shared_src, Site site) {
  const BoxShape shape = box_shape(*map, site);
  check_shared_box(shared_src, *map, shape, "cp.async.bulk.tensor store", site);
  std::vector<unsigned char> dense(shape.bytes);
  unswizzle_box(shared_src, *map, shape, dense.data());
  const unsigned bytes = map->element_bytes;
  copy_box_out(*map, shape, coords, dense.data(), site,
               [bytes](unsigned char* to, const unsigned char* from) { std::memcpy(to, from, bytes); });
}

}  // namespace fagen_emu
