// CPU dispatch key: check arguments (csrc/common), then run the CPU kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "kernels.h"

namespace lora_ops {
namespace {

void sgmv_cpu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
              const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
              const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
              double scale) {
  SgmvIndexTensors keep;
  const auto p = check_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                            slice_offsets, scale, keep);
  cpu::sgmv(p);
}

void lora_expand_cpu(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                     const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                     const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                     double scale) {
  SgmvIndexTensors keep;
  const auto p = check_lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                                   slice_offsets, scale, keep);
  cpu::lora_expand(p);
}

void grouped_gemm_cpu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                      const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                      double alpha, bool accumulate) {
  GroupedGemmIndexTensors keep;
  const auto p = check_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha,
                                    accumulate, keep);
  cpu::grouped_gemm(p);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_segments_cpu(const at::Tensor& token_lora, int64_t num_slots) {
  at::Tensor token_indices, seg_indptr, seg_lora, token_lora_i32;
  const auto p = check_build_segments(token_lora, num_slots, token_indices, seg_indptr, seg_lora, token_lora_i32);
  cpu::build_segments(p);
  return {token_indices, seg_indptr, seg_lora};
}

}  // namespace
}  // namespace lora_ops

TORCH_LIBRARY_IMPL(lora_ops, CPU, m) {
  m.impl("sgmv", &lora_ops::sgmv_cpu);
  m.impl("lora_expand", &lora_ops::lora_expand_cpu);
  m.impl("grouped_gemm", &lora_ops::grouped_gemm_cpu);
  m.impl("build_segments", &lora_ops::build_segments_cpu);
}
