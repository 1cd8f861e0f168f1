// at::linear, with a bias that cuBLASLt's epilogue was measured to add off tolerance added after the product.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lora_ops {

// True where a bias comes with x, weight or the bias, or a row of x, weight or y, not 16-byte aligned (or x not
// contiguous). There ATen's addmm, which adds the bias in cuBLASLt's epilogue, put 5.9% of a bf16 [96, 2568]
// product's outputs 2-3 ulps off the float64 one, aligned 0% (H100, torch 2.11 + CUDA 13.0; fold_linear_lt with an
// unaligned bias: 9.9%; csrc/cuda/NOTES.md, sessions 44-45): a kernel that reduces split-K partial sums in bf16,
// which torch's allow_bf16_reduced_precision_reduction lets the heuristic pick, or a misread bias (not yet told
// apart). Any device's tensors (the rule is the addresses' and sizes'); any bias of N values in its last dimension
// ([N], [1, N]) counts, and one at::linear would refuse (another dtype, device or length) answers false: at::linear's
// error stands.
bool unaligned_for_bias_epilogue(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// at::linear(x, weight, bias), except on CUDA where unaligned_for_bias_epilogue: at::linear(x, weight), then the
// bias added (one rounding more, in y's dtype; every output within it of the float64 sum, where that measured off).
at::Tensor safe_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace lora_ops
