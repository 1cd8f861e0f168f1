// Test-only ops of the CPU-model build (lora_ops._ascend_model): the schemas of csrc/bindings.cpp under the
// lora_ops_ascend_model namespace. registration.cpp registers the Ascend launchers for them on the CPU key, so
// tests run the Ascend host path and kernels on the model with CPU tensors.
#include <torch/library.h>

#include <string>

#include "../common/schemas.h"

TORCH_LIBRARY(lora_ops_ascend_model, m) {
  m.def((std::string("sgmv") + lora_ops::schema::kSgmv).c_str());
  m.def((std::string("lora_expand") + lora_ops::schema::kLoraExpand).c_str());
  m.def((std::string("grouped_gemm") + lora_ops::schema::kGroupedGemm).c_str());
  m.def((std::string("build_segments") + lora_ops::schema::kBuildSegments).c_str());
}
