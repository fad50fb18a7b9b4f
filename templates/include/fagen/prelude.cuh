// fagen/prelude.cuh — the first include of every generated kernel source.
//
// Under NVRTC it pulls in the CUDA half/bfloat16 types. Under FAGEN_EMULATE
// (the host C++ compiler, see fagen/emulate/) it pulls in the SIMT emulator's
// runtime instead, which provides the same names on the CPU.
//
// FAGEN_EXPORT(kernel) follows each kernel entry: on the GPU it is empty; in
// the emulator it defines the host launch shim for that kernel.
#pragma once

#ifdef FAGEN_EMULATE
#include <fagen_emulate/runtime.h>
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define FAGEN_EXPORT(kernel)
#endif
