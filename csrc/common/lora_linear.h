// lora_linear composed of ATen ops: its definition on every backend (CPU, and CUDA where the sm_90a kernels do not
// serve the call), with h rounded to x's dtype as the kernels round it.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lora_ops {

at::Tensor lora_linear_composite(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                                 const at::Tensor& lora_b, const at::Tensor& token_slot,
                                 const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                                 const std::optional<at::Tensor>& bias);

}  // namespace lora_ops
