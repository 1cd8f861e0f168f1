#include "safe_linear.h"

#include <cstdint>

namespace lora_ops {

bool unaligned_for_bias_epilogue(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  // a bias at::linear broadcasts ([N], [1, N], ...): ATen's addmm fuses any whose squeeze is 1-D
  if (x.dim() < 1 || weight.dim() != 2 || bias.dim() < 1 || bias.size(-1) != weight.size(0) ||
      bias.numel() != weight.size(0) || x.size(-1) != weight.size(1) || bias.scalar_type() != x.scalar_type() ||
      weight.scalar_type() != x.scalar_type() || bias.device() != x.device() || weight.device() != x.device()) {
    return false;
  }
  const auto off_16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0; };
  const int64_t row_elements = 16 / x.element_size();
  return !x.is_contiguous() || off_16(x) || off_16(weight) || off_16(bias) || x.size(-1) % row_elements != 0 ||
         weight.stride(0) % row_elements != 0 || weight.size(0) % row_elements != 0;
}

at::Tensor safe_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (x.is_cuda() && bias.has_value() && bias->defined() && unaligned_for_bias_epilogue(x, weight, *bias)) {
    at::Tensor product = at::linear(x, weight);
    return bias->dim() == 1 ? product.add_(*bias) : at::add(product, *bias);  // at::linear's broadcast shape
  }
  return at::linear(x, weight, bias);
}

}  // namespace lora_ops
