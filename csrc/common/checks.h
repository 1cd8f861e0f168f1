// Host-side argument checks shared by every backend (docs/design.md §2 "Safety"). Each check fails with a
// c10::Error / ValueError naming the argument, the value seen and what was expected, then the
// launcher receives a fully filled params struct.
//
// Three layers, each calling the one before:
//   check_*_host       host-visible properties only (dtypes, devices, dims, sizes, strides, slice_offsets, index
//                      tensor types and lengths). Reads no tensor data, accepts symbolic sizes: the Meta kernels
//                      run it, so fake tensors (torch.compile, export) see the same argument errors.
//   *_index_tensors    the index tensors in the kernels' form (int32, contiguous; int64 saturated) and, with
//                      LORA_OPS_DEBUG=1, the original device values validated. torch.ops.lora_ops._check_*
//                      returns these to the Triton backend.
//   check_*            the params struct for the C++ kernels.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "params.h"

namespace lora_ops {

// Numbers, and lists of them, for error messages: std::to_string, never an ostream insertion (on the H200 image,
// torch 2.11, streaming a 64-bit number from this library crashed the process or garbled the message).
std::string num(int64_t v);
std::string num_list(at::IntArrayRef values);

// An index tensor as the kernels read it: int32, contiguous; int64 values saturate to the int32 range (one
// conversion for every op and backend).
at::Tensor kernel_index(const at::Tensor& t);

// Index tensors as the kernels read them (int32, contiguous), and lora_scales made contiguous.
struct SgmvIndexTensors {
  at::Tensor seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales;
};
struct GroupedGemmIndexTensors {
  at::Tensor seg_indptr, seg_weight, token_indices, n_sizes, k_sizes;
};

void check_sgmv_host(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                     const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                     const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets);

// lora_expand: y [T, N], h [T, L, S*R] (every slot's window of each row; any strides in dims 0 and 1),
// lora_b [L, N, R]. Its index tensors are sgmv's, and seg_indptr may be absent (the rows form: position p is a
// segment of its own, seg_lora [P] holds each position's slot).
void check_lora_expand_host(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                            const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                            const std::optional<at::Tensor>& token_indices,
                            const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
                            at::OptionalIntArrayRef slice_offsets);

void check_grouped_gemm_host(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                             const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                             const std::optional<at::Tensor>& token_indices,
                             const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes);

void check_build_segments_host(const at::Tensor& token_lora, int64_t num_slots);

// fold_linear's slot windows: with seg_indptr (1-D int32 or int64 on weight's device, num_slots + 1 >= 1 entries)
// weight is 2-D, slot_rows >= 1 and its last num_slots * slot_rows rows are the slots' windows; without it,
// slot_rows is 0. (x, weight and bias are at::linear's to check.)
void check_fold_linear_host(const at::Tensor& weight, const std::optional<at::Tensor>& seg_indptr,
                            int64_t slot_rows);

// lora_a [L, S*R, K] and lora_b [L, N, R] (3-D) against K and N (k_what / n_what: where they come from) and the
// slices (sgmv, lora_linear, lora_linear's kernels-serve query); returns S.
int64_t check_adapter_shapes_host(const char* op, const at::Tensor& lora_a, const at::Tensor& lora_b,
                                  const c10::SymInt& K, const c10::SymInt& N, const char* k_what, const char* n_what,
                                  at::OptionalIntArrayRef slice_offsets);

// lora_linear: x [..., K] (T rows), weight [N, K], lora_a [L, S*R, K], lora_b [L, N, R] (x's dtype, unit last
// stride), token_slot [T] int32/int64, lora_scales [L] float32, slice_offsets of N, bias [N] (x's dtype). Returns
// the number of slices S. With LORA_OPS_DEBUG=1 (and real tensors), a slot >= L raises (negative ones mean no LoRA).
int64_t check_lora_linear_host(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                               const at::Tensor& lora_b, const at::Tensor& token_slot,
                               const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                               const std::optional<at::Tensor>& bias);

// lora_scales is not converted (left undefined in the result): the Triton kernel reads it through its stride.
SgmvIndexTensors sgmv_index_tensors(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                                    const at::Tensor& lora_b, const at::Tensor& seg_indptr,
                                    const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
                                    const std::optional<at::Tensor>& lora_ranks,
                                    const std::optional<at::Tensor>& lora_scales,
                                    at::OptionalIntArrayRef slice_offsets);

SgmvIndexTensors lora_expand_index_tensors(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                                           const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                                           const std::optional<at::Tensor>& token_indices,
                                           const std::optional<at::Tensor>& lora_ranks,
                                           const std::optional<at::Tensor>& lora_scales,
                                           at::OptionalIntArrayRef slice_offsets);

GroupedGemmIndexTensors grouped_gemm_index_tensors(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                                   const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                                   const std::optional<at::Tensor>& token_indices,
                                                   const std::optional<at::Tensor>& n_sizes,
                                                   const std::optional<at::Tensor>& k_sizes);

// token_lora as the kernels read it (int32, contiguous; int64 saturated).
at::Tensor build_segments_token_lora(const at::Tensor& token_lora, int64_t num_slots);

// The rows form's seg_indptr [0, 1, ..., P] materialized into `keep`, for kernels that read it from memory
// (Ascend); keep.seg_indptr as it is when given.
at::Tensor with_indptr(const at::Tensor& y, SgmvIndexTensors& keep);

// scale (sgmv, lora_expand) or alpha (grouped_gemm) as the kernels take it: float32. A finite value beyond
// float32's range would make every delta inf where the float64 result is finite: a ValueError naming it.
float check_scale(const char* op, const char* name, double value);

// The returned params point into `keep`'s tensors; keep them alive until the kernel is enqueued.
SgmvParams check_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales,
                      at::OptionalIntArrayRef slice_offsets, double scale, SgmvIndexTensors& keep);

ExpandParams check_lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                               const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                               const std::optional<at::Tensor>& token_indices,
                               const std::optional<at::Tensor>& lora_ranks,
                               const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                               double scale, SgmvIndexTensors& keep);

GroupedGemmParams check_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                     const std::optional<at::Tensor>& token_indices,
                                     const std::optional<at::Tensor>& n_sizes,
                                     const std::optional<at::Tensor>& k_sizes, double alpha,
                                     bool accumulate, GroupedGemmIndexTensors& keep);

// Checks the input and allocates the three outputs (token_indices, seg_indptr, seg_lora).
BuildSegmentsParams check_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                         at::Tensor& token_indices, at::Tensor& seg_indptr,
                                         at::Tensor& seg_lora, at::Tensor& token_lora_i32);

// LORA_OPS_DEBUG=1: read device metadata back (syncs) and raise on any value the kernels would skip or clamp.
bool debug_checks_enabled();

}  // namespace lora_ops
