// Grid launch: blocks spread over a pool of OS threads, one block per OS
// thread at a time (block_residency.cpp hands them out); the per-block shared
// memory; the module's C entry points.
#include "runtime_internal.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <thread>

#ifdef FAGEN_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// The dynamic shared memory every kernel declares as
// `extern __shared__ __align__(16) unsigned char smem[];`, which under the
// emulator is `extern thread_local ... smem[]`: one buffer per OS thread,
// shared by all kernel modules. 1024-byte aligned, as the GPU's dynamic window is: swizzled
// layouts (TMA, wgmma descriptors) permute by the absolute address's bits 4-9.
FAGEN_EMU_RUNTIME_API thread_local __attribute__((aligned(1024))) unsigned char
    smem[fagen_emu::kMaxDynamicSharedBytes];

namespace fagen_emu {
namespace {

constexpr int kMaxOsThreads = 256;

// A fixed set of OS threads, started on demand and kept for the process's
// life (never joined: the pool is leaked on purpose, so no destructor runs
// at exit while a thread waits).
class ThreadPool {
 public:
  // Runs task(0) on the calling thread and task(1..helpers) on pool threads.
  void run(int helpers, const std::function<void(int)>& task) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { serve(index); });
      threads_.back().detach();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      active_ = helpers;
      remaining_ = helpers;
      generation_ += 1;
    }
    wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return remaining_ == 0; });
    task_ = nullptr;
  }

 private:
  void serve(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= active_) continue;
        task = task_;
      }
      (*task)(index + 1);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--remaining_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0;
  int remaining_ = 0;
};

struct Runtime {
  std::mutex launch_mutex;  // one launch at a time, whichever module it is in
  ThreadPool pool;
  std::vector<std::unique_ptr<Worker>> workers;
};

Runtime* runtime_instance = nullptr;  // leaked on purpose: see ThreadPool

// A forked child has none of the pool's threads (and maybe a held mutex):
// it starts over with a fresh runtime.
void start_over_after_fork() { runtime_instance = new Runtime(); }

Runtime& runtime() {
  static const bool initialised = [] {
    runtime_instance = new Runtime();
    pthread_atfork(nullptr, nullptr, &start_over_after_fork);
    return true;
  }();
  (void)initialised;
  return *runtime_instance;
}

std::size_t default_stack_size() {
  std::size_t kib = 256;
#ifdef FAGEN_EMU_ASAN
  kib = 1024;  // ASan's redzones make every frame larger
#endif
  if (const char* text = std::getenv("FAGEN_EMULATE_STACK_KB")) {
    const long value = std::strtol(text, nullptr, 10);
    if (value >= 16) kib = static_cast<std::size_t>(value);
  }
  return kib * 1024;
}

// This module's PT_TLS: its size, and where this OS thread's copy lives.
struct TlsImage {
  void* data = nullptr;
  std::size_t size = 0;
};

struct TlsSearch {
  uintptr_t code_address;  // a function of the module sought
  TlsImage image;
};

// The dynamic linker's TLS accessor (x86-64 and AArch64 glibc): allocates a
// module's TLS block for this thread if need be.
struct TlsIndex {
  unsigned long module;
  unsigned long offset;
};
extern "C" void* __tls_get_addr(TlsIndex* index);

int find_tls_image(struct dl_phdr_info* info, std::size_t, void* argument) {
  auto* search = static_cast<TlsSearch*>(argument);
  bool found = false;
  std::size_t tls_size = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& header = info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + header.p_vaddr;
    if (header.p_type == PT_LOAD && search->code_address >= start && search->code_address < start + header.p_memsz)
      found = true;
    if (header.p_type == PT_TLS) tls_size = header.p_memsz;
  }
  if (!found) return 0;
  search->image.size = tls_size;
  search->image.data = info->dlpi_tls_data;
  if (!search->image.data && tls_size && info->dlpi_tls_modid) {
    TlsIndex index{static_cast<unsigned long>(info->dlpi_tls_modid), 0};
    search->image.data = __tls_get_addr(&index);
  }
  return 1;
}

#ifdef FAGEN_EMU_ASAN
// When a sanitizer report is about to end the (helper) process, name the
// emulated thread that faulted: fagen/emulate/checked.py puts it in the error.
void print_fault_context() {
  const Fiber* fiber = current_fiber;
  if (!fiber) return;
  const BlockRun& block = *fiber->block;
  const uint3 t = fiber->coords.thread_idx;
  std::fprintf(stderr,
               "fagen-emulate-fault-context: kernel %s, block (%u,%u,%u), thread %u (threadIdx (%u,%u,%u))\n",
               block.launch->entry.name, block.block_idx.x, block.block_idx.y, block.block_idx.z,
               fiber->coords.linear, t.x, t.y, t.z);
}

// GCC links UBSan as its own library with its own copy of the sanitizer
// common runtime, so its death callback is registered separately.
struct DeathCallbackRegistration {
  DeathCallbackRegistration() {
    __sanitizer_set_death_callback(&print_fault_context);
    if (void* ubsan = dlopen("libubsan.so.1", RTLD_NOW | RTLD_NOLOAD)) {
      using SetCallback = void (*)(void (*)());
      if (auto set = reinterpret_cast<SetCallback>(dlsym(ubsan, "__sanitizer_set_death_callback"))) {
        set(&print_fault_context);
      }
      dlclose(ubsan);
    }
  }
} death_callback_registration;
#endif

}  // namespace

unsigned char* dynamic_shared_base() { return smem; }

void poison_block_shared_memory(void (*kernel)(), std::size_t dynamic_bytes) {
#ifdef FAGEN_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(smem, kMaxDynamicSharedBytes);
#endif
  std::memset(smem, kGarbageByte, dynamic_bytes);
#ifdef FAGEN_EMU_ASAN
  // Past the launch's size the buffer is out of bounds: ASan reports any access.
  const std::size_t rounded = (dynamic_bytes + 7) & ~std::size_t{7};
  ASAN_POISON_MEMORY_REGION(smem + rounded, kMaxDynamicSharedBytes - rounded);
#endif
  const StaticShared statics = static_shared_of(kernel);
  if (statics.data && statics.size) std::memset(statics.data, kGarbageByte, statics.size);
}

StaticShared static_shared_of(void (*kernel)()) {
  // The kernel module's own thread_local storage is nothing but its static
  // __shared__ arrays.
  TlsSearch search{reinterpret_cast<uintptr_t>(kernel), {}};
  dl_iterate_phdr(&find_tls_image, &search);
  return StaticShared{static_cast<unsigned char*>(search.image.data), search.image.size};
}

void LaunchState::record_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (error.empty()) error = message;
  failed.store(true);
}

namespace {

std::string check_config(const LaunchConfig& c) {
  const uint64_t threads = uint64_t{c.block[0]} * c.block[1] * c.block[2];
  if (c.block[0] == 0 || c.block[1] == 0 || c.block[2] == 0 || threads > kMaxThreadsPerBlock ||
      c.block[2] > 64)
    return "invalid block (" + std::to_string(c.block[0]) + "," + std::to_string(c.block[1]) + "," +
           std::to_string(c.block[2]) + "): at most 1024 threads, blockDim.z <= 64";
  if (c.grid[0] == 0 || c.grid[1] == 0 || c.grid[2] == 0 || c.grid[0] > 0x7fffffffu || c.grid[1] > 65535 ||
      c.grid[2] > 65535)
    return "invalid grid (" + std::to_string(c.grid[0]) + "," + std::to_string(c.grid[1]) + "," +
           std::to_string(c.grid[2]) + ")";
  if (c.block_order != kBlockOrderForward && c.block_order != kBlockOrderReverse)
    return "invalid block order " + std::to_string(c.block_order);
  if (c.block_interleave != kBlockInterleaveParallel && c.block_interleave != kBlockInterleaveSerial)
    return "invalid block interleave " + std::to_string(c.block_interleave);
  if (c.shared_mem_bytes > kMaxDynamicSharedBytes)
    return "dynamic shared memory of " + std::to_string(c.shared_mem_bytes) + " bytes exceeds the " +
           std::to_string(kMaxDynamicSharedBytes) + " bytes a block may have (sm_90)";
  return "";
}

// Racecheck's record of which block stored each byte costs 12 bytes per byte of
// a tensor the kernel writes; past this size a tensor is not checked.
constexpr uint64_t kMaxGlobalShadowBytes = uint64_t{64} << 20;

// The launch's instrumentation: the kernel module's address range (sites are
// offsets into it), the tensors sorted by address, their shadows.
std::unique_ptr<Instrumentation> make_instrumentation(const KernelEntry& entry, const LaunchConfig& config) {
  auto inst = std::make_unique<Instrumentation>();
  inst->flags = config.instrument;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(entry.kernel), &info) && info.dli_fbase) {
    inst->module_base = reinterpret_cast<uintptr_t>(info.dli_fbase);
    inst->module_end = inst->module_base + (uintptr_t{1} << 31);
  }
  for (uint32_t i = 0; i < config.tensor_count; ++i) {
    TensorRange& range = config.tensors[i];
    range.read_bytes = range.written_bytes = range.atomic_bytes = 0;
    range.unique_read_bytes = range.unique_written_bytes = 0;
    if (range.bytes) inst->tensors.push_back(&range);
  }
  std::sort(inst->tensors.begin(), inst->tensors.end(),
            [](const TensorRange* a, const TensorRange* b) { return a->begin < b->begin; });
  if (!inst->tensors.empty()) {
    inst->tensors_begin = inst->tensors.front()->begin;
    for (const TensorRange* range : inst->tensors)
      inst->tensors_end = std::max<uintptr_t>(inst->tensors_end, range->begin + range->bytes);
  }
  for (TensorRange* range : inst->tensors) {
    const bool shadowed = inst->racecheck() && (range->flags & kTensorWritable) && range->bytes <= kMaxGlobalShadowBytes;
    inst->written_by.push_back(shadowed ? std::make_unique<GlobalShadow>(range->bytes) : nullptr);
    inst->read_bytes.push_back(inst->counting() ? std::make_unique<UniqueBytes>(range->bytes) : nullptr);
    inst->written_bytes.push_back(inst->counting() ? std::make_unique<UniqueBytes>(range->bytes) : nullptr);
  }
  return inst;
}

void report_counters(Instrumentation& inst, const LaunchConfig& config) {
  if (!inst.counting()) return;
  if (config.counters) *config.counters = inst.totals;
  for (std::size_t i = 0; i < inst.tensors.size(); ++i) {
    inst.tensors[i]->unique_read_bytes = inst.read_bytes[i]->count();
    inst.tensors[i]->unique_written_bytes = inst.written_bytes[i]->count();
  }
}

void copy_message(const std::string& message, char* error, unsigned long error_size) {
  if (!error || error_size == 0) return;
  const std::size_t n = std::min<std::size_t>(message.size(), error_size - 1);
  std::memcpy(error, message.data(), n);
  error[n] = '\0';
}

}  // namespace

int launch(const KernelEntry& entry, const LaunchConfig* config, void** args, char* error,
           unsigned long error_size) noexcept {
  try {
    Runtime& m = runtime();
    std::lock_guard<std::mutex> lock(m.launch_mutex);
    const std::string invalid = check_config(*config);
    if (!invalid.empty()) {
      copy_message(std::string(entry.name) + ": " + invalid, error, error_size);
      return 1;
    }
    LaunchState state;
    state.entry = entry;
    state.args = args;
    state.config = *config;
    state.total_blocks = uint64_t{config->grid[0]} * config->grid[1] * config->grid[2];
    state.stack_size = default_stack_size();
    if (config->instrument) state.instrumentation = make_instrumentation(entry, *config);
    const int os_threads = static_cast<int>(std::clamp<int64_t>(
        std::min<int64_t>(config->os_threads, static_cast<int64_t>(state.total_blocks)), 1, kMaxOsThreads));
    while (static_cast<int>(m.workers.size()) < os_threads) m.workers.push_back(std::make_unique<Worker>());
    start_residency(state, os_threads);

    m.pool.run(os_threads - 1, [&](int index) {
      Worker& worker = *m.workers[static_cast<std::size_t>(index)];
      worker.index = index;
      try {
        run_blocks(worker, state);  // block_residency.cpp: parallel or serial, parking on semaphores
      } catch (const std::exception& exception) {
        state.record_error(std::string(entry.name) + ": emulator error: " + exception.what());
      }
    });
    if (state.failed.load()) {
      copy_message(state.error, error, error_size);
      return 1;
    }
    if (state.instrumentation) report_counters(*state.instrumentation, *config);
    return 0;
  } catch (const std::exception& exception) {
    copy_message(std::string(entry.name) + ": emulator error: " + exception.what(), error, error_size);
    return 1;
  }
}

}  // namespace fagen_emu

