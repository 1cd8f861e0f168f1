#include "launcher.h"

#include <ATen/ATen.h>

#include "../common/checks.h"
#include "gm_buffers.h"
#include "kernels.h"

namespace lora_ops::ascend {
namespace {

// The plan's error is about an input the kernels cannot take (a dtype, a stride, a size): a ValueError naming it.
template <class Tiling>
void require(const Plan<Tiling>& plan) {
  TORCH_CHECK_VALUE(plan.error.empty(), plan.error);
}

at::Tensor workspace(const at::Tensor& like, uint64_t bytes, at::ScalarType dtype) {
  return at::empty({static_cast<int64_t>(bytes / c10::elementSize(dtype))}, like.options().dtype(dtype));
}

// A launch the NPU runtime refused is an error, never a silent no-op that leaves y as it was.
void check_launch(uint32_t status, const char* kernel) {
  TORCH_CHECK(status == 0, std::string("lora_ops: the NPU runtime refused to launch the ") + kernel +
                               " kernel (ACL error " + std::to_string(status) + ")");
}

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

void declare_segments(const at::Tensor& indptr, const at::Tensor& slot, const at::Tensor& token_indices) {
  declare_gm("seg_indptr", indptr, false);
  declare_gm("segment slots", slot, false);
  declare_gm("token_indices", token_indices, false);
}

}  // namespace

void run_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& seg_indptr, const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
              const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
              at::OptionalIntArrayRef slice_offsets, double scale, const Device& device) {
  SgmvIndexTensors keep;
  const SgmvParams p = check_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                                  slice_offsets, scale, keep);
  const auto plan = plan_sgmv(p, device.target);
  require(plan);
  if (!plan.launch) return;  // no rows, segments, K, N or rank: y is already the result
  const at::Tensor ws = workspace(y, plan.workspace_bytes, at::kFloat);
  const at::Tensor split = workspace(y, plan.split_bytes, x.scalar_type());
  declare_gm("y", y, true);
  declare_gm("x", x, false);
  declare_gm("lora_a", lora_a, false);
  declare_gm("lora_b", lora_b, false);
  declare_segments(keep.seg_indptr, keep.seg_lora, keep.token_indices);
  declare_gm("lora_ranks", keep.lora_ranks, false);
  declare_gm("lora_scales", keep.lora_scales, false);
  declare_gm("workspace", ws, true);
  declare_gm("split workspace", split, true);
  const SgmvBuffers buffers{y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), lora_b.data_ptr(),
                            keep.seg_indptr.data_ptr(), keep.seg_lora.data_ptr(), data_or_null(keep.token_indices),
                            data_or_null(keep.lora_ranks), data_or_null(keep.lora_scales), ws.data_ptr(),
                            split.data_ptr()};
  check_launch(launch_sgmv(plan.tiling, buffers, device.stream), "sgmv");
}

void run_lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                     const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices,
                     const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
                     at::OptionalIntArrayRef slice_offsets, double scale, const Device& device) {
  SgmvIndexTensors keep;
  const ExpandParams p = check_lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks,
                                           lora_scales, slice_offsets, scale, keep);
  const auto plan = plan_lora_expand(p, device.target);
  require(plan);
  if (!plan.launch) return;  // no rows, segments, N or rank: y is already the result
  with_indptr(y, keep);      // the rows form's: the kernel reads seg_indptr from memory
  const at::Tensor ws = workspace(y, plan.workspace_bytes, at::kFloat);
  const at::Tensor split = workspace(y, plan.split_bytes, lora_b.scalar_type());
  declare_gm("y", y, true);  // first: h may be a view beside y in the same rows (the folded base GEMM's output)
  declare_gm("h", h, false);
  declare_gm("lora_b", lora_b, false);
  declare_segments(keep.seg_indptr, keep.seg_lora, keep.token_indices);
  declare_gm("lora_ranks", keep.lora_ranks, false);
  declare_gm("lora_scales", keep.lora_scales, false);
  declare_gm("workspace", ws, true);
  declare_gm("split workspace", split, true);
  const LoraExpandBuffers buffers{y.data_ptr(), h.data_ptr(), lora_b.data_ptr(), keep.seg_indptr.data_ptr(),
                                  keep.seg_lora.data_ptr(), data_or_null(keep.token_indices),
                                  data_or_null(keep.lora_ranks), data_or_null(keep.lora_scales), ws.data_ptr(),
                                  split.data_ptr()};
  check_launch(launch_lora_expand(plan.tiling, buffers, device.stream), "lora_expand");
}

void run_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                      const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                      double alpha, bool accumulate, const Device& device) {
  GroupedGemmIndexTensors keep;
  const GroupedGemmParams p = check_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes,
                                                 alpha, accumulate, keep);
  const auto plan = plan_grouped_gemm(p, device.target);
  require(plan);
  if (!plan.launch) return;  // no rows, segments or columns, or K = 0 added to y: y is already the result
  const at::Tensor ws = workspace(y, plan.workspace_bytes, at::kFloat);
  const at::Tensor split = workspace(y, plan.split_bytes, w.scalar_type());
  declare_gm("y", y, true);
  declare_gm("x", x, false);
  declare_gm("w", w, false);
  declare_segments(keep.seg_indptr, keep.seg_weight, keep.token_indices);
  declare_gm("n_sizes", keep.n_sizes, false);
  declare_gm("k_sizes", keep.k_sizes, false);
  declare_gm("workspace", ws, true);
  declare_gm("split workspace", split, true);
  const GroupedGemmBuffers buffers{y.data_ptr(), x.data_ptr(), w.data_ptr(), keep.seg_indptr.data_ptr(),
                                   keep.seg_weight.data_ptr(), data_or_null(keep.token_indices),
                                   data_or_null(keep.n_sizes), data_or_null(keep.k_sizes), ws.data_ptr(),
                                   split.data_ptr()};
  check_launch(launch_grouped_gemm(plan.tiling, buffers, device.stream), "grouped_gemm");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                                                  const Device& device) {
  at::Tensor token_indices, seg_indptr, seg_lora, token_lora_i32;
  const BuildSegmentsParams p =
      check_build_segments(token_lora, num_slots, token_indices, seg_indptr, seg_lora, token_lora_i32);
  const auto plan = plan_build_segments(p, device.target);
  require(plan);
  declare_gm("token_lora", token_lora_i32, false);
  declare_gm("token_indices", token_indices, true);
  declare_gm("seg_indptr", seg_indptr, true);
  declare_gm("seg_lora", seg_lora, true);
  const BuildSegmentsBuffers buffers{token_lora_i32.data_ptr(), token_indices.data_ptr(), seg_indptr.data_ptr(),
                                     seg_lora.data_ptr()};
  check_launch(launch_build_segments(plan.tiling, buffers, device.stream), "build_segments");
  return {token_indices, seg_indptr, seg_lora};
}

}  // namespace lora_ops::ascend
