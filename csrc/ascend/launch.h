// How a kernel file launches its kernel, and the launch's status (0, or the runtime's error):
// - the AscendC toolchain: aclrtlaunch_<kernel>, which CANN's build (ascendc_library) generates from the kernel's
//   signature and declares in the header it force-includes into the kernel files' host pass; it takes the tiling
//   struct by pointer (the kernel takes it by value; the runtime copies it into the launch's arguments) and returns
//   the ACL status that `<<<>>>` would drop;
// - the CPU model's Launch with g++ (LORA_OPS_ASCEND_CPU_MODEL);
// - a plain call when g++ only type-checks the kernels against asc-devkit's own headers (LORA_OPS_ASCEND_HEADER_CHECK,
//   scripts/check_ascend_headers.py).
// The only place the builds differ on the device side.
#pragma once

#ifdef LORA_OPS_ASCEND_CPU_MODEL
#include "kernel_operator.h"
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, tiling, ...) \
  ((void)(stream), ::AscendC::cpu_model::Launch(type, block_dim, [&] { kernel(__VA_ARGS__, tiling); }), 0u)
#elif defined(LORA_OPS_ASCEND_HEADER_CHECK)
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, tiling, ...) \
  ((void)(type), (void)(block_dim), (void)(stream), kernel(__VA_ARGS__, tiling), 0u)
#else
#define LORA_OPS_ASCEND_LAUNCH(kernel, type, block_dim, stream, tiling, ...)                        \
  [&] {                                                                                             \
    auto tiling_arg = tiling;                                                                       \
    return static_cast<uint32_t>(aclrtlaunch_##kernel(block_dim, stream, __VA_ARGS__, &tiling_arg)); \
  }()
#endif
