// How a kernel file launches its kernel: `<<<>>>` with the AscendC toolchain, the CPU model's Launch with g++
// (LORA_OPS_ASCEND_CPU_MODEL). The only place the two builds differ on the device side.
#pragma once

#ifdef LORA_OPS_ASCEND_CPU_MODEL
#include "kernel_operator.h"
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, ...) \
  ((void)(stream), ::AscendC::cpu_model::Launch(type, block_dim, [&] { kernel(__VA_ARGS__); }))
#else
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, ...) \
  kernel<<<block_dim, nullptr, stream>>>(__VA_ARGS__)
#endif
