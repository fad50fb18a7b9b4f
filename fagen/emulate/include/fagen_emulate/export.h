// fagen_emulate/export.h — FAGEN_EXPORT(kernel): the C entry points the Python
// launcher (fagen/emulate/module.py) calls through ctypes.
//
// For `extern "C" __global__ void k(P0, P1, ...)` followed by FAGEN_EXPORT(k)
// the shared library exports:
//   int fagen_launch_k(const fagen_emu::LaunchConfig*, void** args,
//                      char* error, unsigned long error_size);
//     Runs the grid. args[i] points at the value of parameter i (as with
//     cudaLaunchKernel). Returns 0, or nonzero with a message in `error`.
//   const char* fagen_signature_k();
//     The parameter types, comma-separated: "i32", "u32", "i64", "u64",
//     "f32", "f64", ..., and pointers as "p:<pointee>" or "pc:<pointee>"
//     (pointer to const), e.g. "pc:f16,p:f32,i32,i64".
// and registers k so that fagen_emulate_kernels() lists it. Every module also
// exports fagen_emulate_kernels() ("k1,k2") and fagen_emulate_abi_version().
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

namespace fagen_emu {

// Mirrored by ctypes in fagen/emulate/module.py.
struct LaunchConfig {
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shared_mem_bytes;
  int32_t os_threads;  // blocks run in parallel on up to this many OS threads
  int32_t schedule;    // 0: threads of a block run in increasing order; 1: decreasing
};

using KernelThunk = void (*)(void (*kernel)(), void** args);

struct KernelEntry {
  const char* name;
  void (*kernel)();
  KernelThunk thunk;
};

FAGEN_EMU_RUNTIME_API int launch(const KernelEntry& entry, const LaunchConfig* config, void** args,
                                 char* error, unsigned long error_size) noexcept;

template <class... P, std::size_t... I>
inline void call_with_args(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <class... P>
inline void kernel_thunk(void (*kernel)(), void** args) {
  call_with_args(reinterpret_cast<void (*)(P...)>(kernel), args, std::index_sequence_for<P...>{});
}

template <class T> struct ScalarCode { static constexpr const char* value = nullptr; };
#define FAGEN_EMU_SCALAR_CODE(type, code) \
  template <> struct ScalarCode<type> { static constexpr const char* value = code; };
FAGEN_EMU_SCALAR_CODE(bool, "b8")
FAGEN_EMU_SCALAR_CODE(char, "i8")
FAGEN_EMU_SCALAR_CODE(signed char, "i8")
FAGEN_EMU_SCALAR_CODE(unsigned char, "u8")
FAGEN_EMU_SCALAR_CODE(short, "i16")
FAGEN_EMU_SCALAR_CODE(unsigned short, "u16")
FAGEN_EMU_SCALAR_CODE(int, "i32")
FAGEN_EMU_SCALAR_CODE(unsigned int, "u32")
FAGEN_EMU_SCALAR_CODE(long, "i64")
FAGEN_EMU_SCALAR_CODE(unsigned long, "u64")
FAGEN_EMU_SCALAR_CODE(long long, "i64")
FAGEN_EMU_SCALAR_CODE(unsigned long long, "u64")
FAGEN_EMU_SCALAR_CODE(float, "f32")
FAGEN_EMU_SCALAR_CODE(double, "f64")
FAGEN_EMU_SCALAR_CODE(__half, "f16")
FAGEN_EMU_SCALAR_CODE(__nv_bfloat16, "bf16")
FAGEN_EMU_SCALAR_CODE(void, "void")
#undef FAGEN_EMU_SCALAR_CODE

// Appends one parameter's code ("?<bytes>" for a type the launcher cannot pass).
// Plain char buffers, not std::string: <string> would add to every kernel build.
template <class T>
inline void append_parameter_code(char* out, std::size_t size) {
  const char* kind = "";
  const char* code = nullptr;
  if constexpr (std::is_pointer<T>::value) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
    kind = std::is_const<std::remove_pointer_t<T>>::value ? "pc:" : "p:";
    code = ScalarCode<Pointee>::value ? ScalarCode<Pointee>::value : "any";  // struct/vector: any dtype
  } else {
    code = ScalarCode<std::remove_cv_t<T>>::value;
  }
  const std::size_t used = std::strlen(out);
  if (code) {
    std::snprintf(out + used, size - used, "%s%s%s", used ? "," : "", kind, code);
  } else {
    std::snprintf(out + used, size - used, "%s?%zu", used ? "," : "", sizeof(T));
  }
}

template <class... P>
inline const char* kernel_signature(void (*)(P...)) {
  static char signature[1024] = "";
  if (signature[0] == '\0') (append_parameter_code<P>(signature, sizeof signature), ...);
  return signature;
}

template <class... P>
inline KernelEntry kernel_entry(const char* name, void (*kernel)(P...)) {
  return KernelEntry{name, reinterpret_cast<void (*)()>(kernel), &kernel_thunk<P...>};
}

// This module's kernels, comma-separated (this inline function and its
// static are hidden, so each kernel module has its own list).
inline char* module_kernel_list() {
  static char list[8192] = "";
  return list;
}

struct KernelRegistration {
  explicit KernelRegistration(const char* name) {
    char* list = module_kernel_list();
    const std::size_t used = std::strlen(list);
    std::snprintf(list + used, 8192 - used, "%s%s", used ? "," : "", name);
  }
};

}  // namespace fagen_emu

#define FAGEN_EMU_API extern "C" __attribute__((visibility("default")))

#ifndef FAGEN_EMU_BUILDING_RUNTIME
// Defined once per kernel module: a generated source includes the prelude,
// hence this header, exactly once.
FAGEN_EMU_API const char* fagen_emulate_kernels() { return ::fagen_emu::module_kernel_list(); }
FAGEN_EMU_API int fagen_emulate_abi_version() { return 1; }
#endif

#define FAGEN_EXPORT(kernel)                                                                            \
  FAGEN_EMU_API int fagen_launch_##kernel(const ::fagen_emu::LaunchConfig* config, void** args,         \
                                          char* error, unsigned long error_size) {                      \
    return ::fagen_emu::launch(::fagen_emu::kernel_entry(#kernel, &kernel), config, args, error,        \
                               error_size);                                                             \
  }                                                                                                     \
  FAGEN_EMU_API const char* fagen_signature_##kernel() { return ::fagen_emu::kernel_signature(&kernel); } \
  static const ::fagen_emu::KernelRegistration fagen_registration_##kernel{#kernel};
