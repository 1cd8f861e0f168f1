// The one place the ops are defined (docs/design.md §1): schemas, Meta kernels, and the Python module that holds
// their fake/autograd registrations. Device kernels register themselves from csrc/<backend>/registration.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/checks.h"

namespace {

// sgmv and grouped_gemm only mutate y: on Meta there is nothing to compute or allocate.
void sgmv_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
               const std::optional<at::Tensor>&, at::OptionalIntArrayRef, double) {}

void grouped_gemm_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, double, bool) {}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_segments_meta(const at::Tensor& token_lora,
                                                                   int64_t num_slots) {
  const auto opts = token_lora.options().dtype(at::kInt);
  return {at::empty_symint({token_lora.sym_size(0)}, opts), at::empty({num_slots + 1}, opts),
          at::empty({num_slots}, opts)};
}

// The host-side contract checks as ops of their own, so that Python backends (Triton) run the very same
// checks as the C++ kernels instead of a copy of them. They read metadata only (and device values under
// LORA_OPS_DEBUG=1), so one device-agnostic kernel serves every dispatch key.
void check_sgmv_op(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                   const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                   const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                   const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                   double scale) {
  lora_ops::SgmvIndexTensors keep;
  lora_ops::check_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                       slice_offsets, scale, keep);
}

void check_grouped_gemm_op(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                           const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                           const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& n_sizes,
                           const std::optional<at::Tensor>& k_sizes, double alpha, bool accumulate) {
  lora_ops::GroupedGemmIndexTensors keep;
  lora_ops::check_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate,
                               keep);
}

void check_build_segments_op(const at::Tensor& token_lora, int64_t num_slots) {
  lora_ops::check_build_segments_args(token_lora, num_slots);
}

}  // namespace

TORCH_LIBRARY(lora_ops, m) {
  m.set_python_module("lora_ops.ops");
  m.def(
      "sgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor seg_lora, "
      "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
      "int[]? slice_offsets=None, float scale=1.0) -> ()");
  m.def(
      "grouped_gemm(Tensor(a!) y, Tensor x, Tensor w, Tensor seg_indptr, Tensor seg_weight, "
      "Tensor? token_indices=None, Tensor? n_sizes=None, Tensor? k_sizes=None, float alpha=1.0, "
      "bool accumulate=True) -> ()");
  m.def("build_segments(Tensor token_lora, int num_slots) -> (Tensor token_indices, Tensor seg_indptr, "
        "Tensor seg_lora)");
  m.def(
      "_check_sgmv(Tensor y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor seg_lora, "
      "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
      "int[]? slice_offsets=None, float scale=1.0) -> ()");
  m.def(
      "_check_grouped_gemm(Tensor y, Tensor x, Tensor w, Tensor seg_indptr, Tensor seg_weight, "
      "Tensor? token_indices=None, Tensor? n_sizes=None, Tensor? k_sizes=None, float alpha=1.0, "
      "bool accumulate=True) -> ()");
  m.def("_check_build_segments(Tensor token_lora, int num_slots) -> ()");
}

TORCH_LIBRARY_IMPL(lora_ops, CompositeExplicitAutograd, m) {
  m.impl("_check_build_segments", &check_build_segments_op);
  m.impl("_check_sgmv", &check_sgmv_op);
  m.impl("_check_grouped_gemm", &check_grouped_gemm_op);
}

TORCH_LIBRARY_IMPL(lora_ops, Meta, m) {
  m.impl("sgmv", &sgmv_meta);
  m.impl("grouped_gemm", &grouped_gemm_meta);
  m.impl("build_segments", &build_segments_meta);
}
