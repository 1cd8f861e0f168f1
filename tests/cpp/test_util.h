// Shared helpers for the C++ tests: call the ops through the dispatcher and compare with plain-loop references.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace lora_ops_test {

inline void call_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& indptr, const at::Tensor& slots, const std::optional<at::Tensor>& idx,
                      const std::optional<at::Tensor>& ranks, const std::optional<at::Tensor>& scales,
                      std::optional<std::vector<int64_t>> offsets, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lora_ops::sgmv", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                   at::OptionalIntArrayRef, double)>();
  at::OptionalIntArrayRef off = offsets ? at::OptionalIntArrayRef(*offsets) : std::nullopt;
  op.call(y, x, a, b, indptr, slots, idx, ranks, scales, off, scale);
}

inline void call_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& indptr,
                              const at::Tensor& slots, const std::optional<at::Tensor>& idx,
                              const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                              double alpha, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lora_ops::grouped_gemm", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, bool)>();
  op.call(y, x, w, indptr, slots, idx, n_sizes, k_sizes, alpha, accumulate);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_build_segments(const at::Tensor& token_lora, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lora_ops::build_segments", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, int64_t)>();
  return op.call(token_lora, n);
}

inline at::Tensor i32(std::vector<int32_t> v) {
  return at::tensor(at::ArrayRef<int32_t>(v), at::TensorOptions().dtype(at::kInt));
}

// Straightforward double-precision sgmv on CPU tensors with valid metadata (one slice).
inline at::Tensor naive_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                             const std::vector<int32_t>& indptr, const std::vector<int32_t>& slots,
                             const std::vector<int32_t>& idx, const std::vector<int32_t>& ranks, double scale) {
  auto out = y.to(at::kDouble).clone();
  auto xd = x.to(at::kDouble), ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  const int64_t L = a.size(0), K = x.size(1), N = y.size(1);
  for (size_t g = 0; g + 1 < indptr.size(); ++g) {
    const int32_t l = slots[g];
    if (l < 0 || l >= L) continue;
    for (int32_t p = indptr[g]; p < indptr[g + 1]; ++p) {
      const int64_t t = idx.empty() ? p : idx[p];
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int32_t j = 0; j < ranks[l]; ++j) {
          double h = 0;
          for (int64_t k = 0; k < K; ++k) h += xd[t][k].item<double>() * ad[l][j][k].item<double>();
          acc += h * bd[l][n][j].item<double>();
        }
        out[t][n] += scale * acc;
      }
    }
  }
  return out;
}

inline double rel_err(const at::Tensor& out, const at::Tensor& ref) {
  return (out.to(at::kDouble) - ref).norm().item<double>() / ref.norm().item<double>();
}

}  // namespace lora_ops_test
