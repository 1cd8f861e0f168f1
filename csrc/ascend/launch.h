// How a kernel file launches its kernel: `<<<>>>` with the AscendC toolchain, the CPU model's Launch with g++
// (LORA_OPS_ASCEND_CPU_MODEL), a plain call when g++ only type-checks the kernels against asc-devkit's own headers
// (LORA_OPS_ASCEND_HEADER_CHECK, scripts/check_ascend_headers.sh). The only place the builds differ on the device
// side.
#pragma once

#ifdef LORA_OPS_ASCEND_CPU_MODEL
#include "kernel_operator.h"
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, ...) \
  ((void)(stream), ::AscendC::cpu_model::Launch(type, block_dim, [&] { kernel(__VA_ARGS__); }))
#elif defined(LORA_OPS_ASCEND_HEADER_CHECK)
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, ...) \
  ((void)(type), (void)(block_dim), (void)(stream), kernel(__VA_ARGS__))
#else
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, ...) \
  kernel<<<block_dim, nullptr, stream>>>(__VA_ARGS__)
#endif
