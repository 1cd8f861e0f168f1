// CPU model of the AscendC API subset the lora_ops kernels use (NPU arch 2201, "910B"). It stands in for CANN's
// kernel_operator.h when the kernels are compiled with g++: same names, same signatures, so the kernel bodies
// compile unchanged. What it checks and what it does not model: csrc/ascend/NOTES.md.
#pragma once
#include <cstdint>

#include "model_core.h"
#include "model_cube.h"
#include "model_pipe.h"
#include "model_tensor.h"
#include "model_types.h"
#include "model_vector.h"

// Kernel qualifiers and address spaces mean nothing on the CPU.
#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// Which core type runs the code: a run-time test in the model, a compile-time one on the device.
#define ASCEND_IS_AIC (::AscendC::cpu_model::Current().type == ::AscendC::cpu_model::CoreType::AIC)
#define ASCEND_IS_AIV (::AscendC::cpu_model::Current().type == ::AscendC::cpu_model::CoreType::AIV)

// On the device this selects the kernel type at compile time; the model checks it against the launch.
#define KERNEL_TASK_TYPE_DEFAULT(value) ::AscendC::cpu_model::CheckKernelType(value)
