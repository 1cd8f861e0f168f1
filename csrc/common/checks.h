// Host-side argument checks shared by every backend (docs/design.md §2 "Safety"). Each check fails with a
// c10::Error / ValueError naming the argument, the value seen and what was expected, then the
// launcher receives a fully filled params struct.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "params.h"

namespace lora_ops {

// Index tensors the op reads: int32, contiguous (int64 is accepted and converted).
struct SgmvIndexTensors {
  at::Tensor seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales;
};
struct GroupedGemmIndexTensors {
  at::Tensor seg_indptr, seg_weight, token_indices, n_sizes, k_sizes;
};

// The returned params point into `keep`'s tensors; keep them alive until the kernel is enqueued.
SgmvParams check_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales,
                      at::OptionalIntArrayRef slice_offsets, double scale, SgmvIndexTensors& keep);

GroupedGemmParams check_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                     const std::optional<at::Tensor>& token_indices,
                                     const std::optional<at::Tensor>& n_sizes,
                                     const std::optional<at::Tensor>& k_sizes, double alpha,
                                     bool accumulate, GroupedGemmIndexTensors& keep);

// Checks token_lora and num_slots; returns token_lora as contiguous int32.
at::Tensor check_build_segments_args(const at::Tensor& token_lora, int64_t num_slots);

// Checks the input and allocates the three outputs (token_indices, seg_indptr, seg_lora).
BuildSegmentsParams check_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                         at::Tensor& token_indices, at::Tensor& seg_indptr,
                                         at::Tensor& seg_lora, at::Tensor& token_lora_i32);

// LORA_OPS_DEBUG=1: read device metadata back (syncs) and raise on any value the kernels would skip.
bool debug_checks_enabled();
void debug_validate_segments(const Segments& seg_host_view, const at::Tensor& seg_indptr,
                             const at::Tensor& seg_slot, const at::Tensor& token_indices, int64_t rows,
                             int64_t num_slots, const char* slot_name);

}  // namespace lora_ops
