// at::linear where cuBLASLt's bias epilogue would read it wrong: the product, then the bias added.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lora_ops {

// True where a bias that ATen's addmm (or fold_linear_lt) would add in cuBLASLt's epilogue comes with x, weight or
// the bias, or a row of x, weight or y, not 16-byte aligned: on CUDA the epilogue then summed 5.9-9.9% of a bf16
// product's outputs wrong (H100, torch 2.11 + CUDA 13.0; csrc/cuda/NOTES.md, sessions 44-45). Any device's tensors
// (the rule is the addresses' and sizes'); a bias at::linear would refuse (another dtype, device or length) answers
// false: at::linear's error stands.
bool bias_epilogue_misreads(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// at::linear(x, weight, bias), except on CUDA where bias_epilogue_misreads: at::linear(x, weight), then the bias
// added (one rounding more, in y's dtype).
at::Tensor safe_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace lora_ops
