// The Ascend launchers: shared argument checks (csrc/common), tiling (plan.cpp), workspace, launch (kernels.h).
// Device-agnostic ATen code: registration.cpp calls them with an NPU's stream and core count, and the CPU-model
// build (LORA_OPS_ASCEND_CPU_MODEL) with CPU tensors.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "plan.h"

namespace lora_ops::ascend {

struct Device {
  Target target;
  void* stream;  // aclrtStream
};

void run_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& seg_indptr, const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
              const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
              at::OptionalIntArrayRef slice_offsets, double scale, const Device& device);

void run_lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                     const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices,
                     const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
                     at::OptionalIntArrayRef slice_offsets, double scale, const Device& device);

void run_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                      const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                      double alpha, bool accumulate, const Device& device);

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                                                  const Device& device);

}  // namespace lora_ops::ascend
