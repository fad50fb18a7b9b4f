// Switching between fibers and the block scheduler.
//
// On x86-64 a hand-written switch saves the callee-saved registers and the
// SSE/x87 control words on the old stack and swaps stack pointers: a few
// nanoseconds, against ~0.4 us for swapcontext, which makes a signal-mask
// system call on every switch. Elsewhere (or with -DFAGEN_EMU_FORCE_UCONTEXT)
// ucontext is used. Under AddressSanitizer every switch is announced with the
// fiber annotations, so ASan knows which stack is current.
#include "runtime_internal.h"

#include <cstdint>
#include <cstdlib>

#ifdef FAGEN_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifdef FAGEN_EMU_ASM_SWITCH
extern "C" void fagen_emu_switch_stack(void** save_stack_pointer, void* load_stack_pointer);
extern "C" void fagen_emu_fiber_trampoline();

// fagen_emu_switch_stack(save, load): push rbp, rbx, r12-r15 and the MXCSR /
// x87 control words, store rsp in *save, load rsp from `load`, pop the same
// set and return into the other context.
// fagen_emu_fiber_trampoline: a new fiber's first "return" lands here with
// its argument in r12 and its entry function in r13. No unwind info: stack
// traces of a fiber end here, and the zero rbp ends frame-pointer walks.
asm(R"(
    .text
    .globl fagen_emu_switch_stack
    .hidden fagen_emu_switch_stack
    .type fagen_emu_switch_stack, @function
fagen_emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fagen_emu_switch_stack, .-fagen_emu_switch_stack

    .globl fagen_emu_fiber_trampoline
    .hidden fagen_emu_fiber_trampoline
    .type fagen_emu_fiber_trampoline, @function
fagen_emu_fiber_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size fagen_emu_fiber_trampoline, .-fagen_emu_fiber_trampoline
)");
#endif

namespace fagen_emu {

#ifndef FAGEN_EMU_ASM_SWITCH
namespace {
// makecontext passes int arguments only: the entry and its argument travel
// as halves of 64-bit values.
void ucontext_trampoline(unsigned entry_hi, unsigned entry_lo, unsigned arg_hi, unsigned arg_lo) {
  const auto entry = reinterpret_cast<FiberEntry>((static_cast<uintptr_t>(entry_hi) << 32) | entry_lo);
  void* argument = reinterpret_cast<void*>((static_cast<uintptr_t>(arg_hi) << 32) | arg_lo);
  entry(argument);
  std::abort();  // fiber entries never return: they switch away for good
}
}  // namespace
#endif

__attribute__((no_sanitize_address)) void prepare_context(FiberContext& context, char* stack,
                                                          std::size_t stack_size, FiberEntry entry,
                                                          void* argument) {
#ifdef FAGEN_EMU_ASM_SWITCH
  // Initial frame, from the (16-byte aligned) top down: the trampoline as
  // return address, then rbp, rbx, r12 = argument, r13 = entry, r14, r15, and
  // the control words. After `ret` the stack pointer is 16-byte aligned, so
  // the trampoline's call enters `entry` with the ABI's alignment.
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + stack_size) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = reinterpret_cast<uint64_t>(&fagen_emu_fiber_trampoline);
  *--slot = 0;                                      // rbp
  *--slot = 0;                                      // rbx
  *--slot = reinterpret_cast<uint64_t>(argument);   // r12
  *--slot = reinterpret_cast<uint64_t>(entry);      // r13
  *--slot = 0;                                      // r14
  *--slot = 0;                                      // r15
  uint32_t mxcsr = 0;
  uint16_t fpu_control = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_control));
  *--slot = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpu_control) << 32);
  context.stack_pointer = slot;
#else
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = stack_size;
  context.context.uc_link = nullptr;
  const auto entry_bits = reinterpret_cast<uintptr_t>(entry);
  const auto arg_bits = reinterpret_cast<uintptr_t>(argument);
  makecontext(&context.context, reinterpret_cast<void (*)()>(&ucontext_trampoline), 4,
              static_cast<unsigned>(entry_bits >> 32), static_cast<unsigned>(entry_bits),
              static_cast<unsigned>(arg_bits >> 32), static_cast<unsigned>(arg_bits));
#endif
}

void switch_context(FiberContext& from, FiberContext& to, const StackBounds& to_stack, bool from_finished) {
#ifdef FAGEN_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake_stack, to_stack.bottom, to_stack.size);
#else
  (void)to_stack;
  (void)from_finished;
#endif
#ifdef FAGEN_EMU_ASM_SWITCH
  fagen_emu_switch_stack(&from.stack_pointer, to.stack_pointer);
#else
  swapcontext(&from.context, &to.context);
#endif
#ifdef FAGEN_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

StackBounds fiber_started() {
  StackBounds from;
#ifdef FAGEN_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &from.bottom, &from.size);
#endif
  return from;
}

void unpoison_stack(char* stack, std::size_t size) {
#ifdef FAGEN_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(stack, size);
#else
  (void)stack;
  (void)size;
#endif
}

}  // namespace fagen_emu
