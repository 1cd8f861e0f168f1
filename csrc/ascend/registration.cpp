// PrivateUse1 dispatch key (torch_npu's "npu"): the Ascend launchers on the current NPU stream.
//
// The CPU-model build compiles this same file against stand-ins for torch_npu and ACL (cpu_model/standin) and
// registers the kernels as test ops instead: LORA_OPS_ASCEND_LIBRARY / LORA_OPS_ASCEND_DISPATCH_KEY select
// lora_ops_ascend_model / CPU (model_ops.cpp defines their schemas).
#include <acl/acl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>

#include <array>
#include <mutex>

#include "launcher.h"

#ifndef LORA_OPS_ASCEND_LIBRARY
#define LORA_OPS_ASCEND_LIBRARY lora_ops
#define LORA_OPS_ASCEND_DISPATCH_KEY PrivateUse1
#endif

namespace lora_ops::ascend {
namespace {

// AI cores (AICs) of a device, read once per device.
uint32_t ai_cores(int device) {
  static std::array<int64_t, 64> cached{};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  int64_t& cores = cached.at(static_cast<size_t>(device) & 63);
  if (cores == 0) {
    const aclError err = aclGetDeviceCapability(static_cast<uint32_t>(device), ACL_DEVICE_INFO_AI_CORE_NUM, &cores);
    TORCH_CHECK(err == ACL_SUCCESS && cores > 0, "lora_ops: aclGetDeviceCapability(AI_CORE_NUM) failed on device " +
                                                     std::to_string(device) + " (error " + std::to_string(err) + ")");
  }
  return static_cast<uint32_t>(cores);
}

// Not named device_of: at::device_of(const Tensor&), which torch_npu's headers bring in, would make every call
// ambiguous (argument-dependent lookup finds both).
Device launch_device(const at::Tensor& t) {
  const int index = t.device().has_index() ? t.device().index() : 0;
  return Device{Target{ai_cores(index)}, c10_npu::getCurrentNPUStream(index).stream()};
}

void sgmv_npu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& seg_indptr, const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
              const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
              at::OptionalIntArrayRef slice_offsets, double scale) {
  const c10::DeviceGuard guard(y.device());
  run_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets, scale,
           launch_device(y));
}

void lora_expand_npu(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                     const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices,
                     const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
                     at::OptionalIntArrayRef slice_offsets, double scale) {
  const c10::DeviceGuard guard(y.device());
  run_lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets, scale,
                  launch_device(y));
}

void grouped_gemm_npu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                      const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                      double alpha, bool accumulate) {
  const c10::DeviceGuard guard(y.device());
  run_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate,
                   launch_device(y));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_segments_npu(const at::Tensor& token_lora, int64_t num_slots) {
  const c10::DeviceGuard guard(token_lora.device());
  return run_build_segments(token_lora, num_slots, launch_device(token_lora));
}

}  // namespace
}  // namespace lora_ops::ascend

TORCH_LIBRARY_IMPL(LORA_OPS_ASCEND_LIBRARY, LORA_OPS_ASCEND_DISPATCH_KEY, m) {
  m.impl("sgmv", &lora_ops::ascend::sgmv_npu);
  m.impl("lora_expand", &lora_ops::ascend::lora_expand_npu);
  m.impl("grouped_gemm", &lora_ops::ascend::grouped_gemm_npu);
  m.impl("build_segments", &lora_ops::ascend::build_segments_npu);
}
