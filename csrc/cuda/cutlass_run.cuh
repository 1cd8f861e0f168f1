// The CUTLASS 3.x headers that grouped_gemm_sm90.cu, fold_linear_sm90.cu and lora_linear_sm90.cu build their sm_90
// GEMMs from (the collective builders, GemmUniversal and its device adapter), and one launch of such a GEMM from its
// host arguments: CUTLASS's workspace set-up, its kernel parameters, the dynamic shared memory the kernel asks for,
// then the launch (with its cluster shape). Included only where CUTLASS's headers are (LORA_OPS_GG_SM90).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "common.cuh"

namespace lora_ops::cuda {

// The collectives of the decode GEMMs (fold_linear's, lora_linear's): CUTLASS's warp-specialized kernel for
// y^T = W . x^T with W [M, K] row-major (K-major), x [N, K] (the tokens, K-major) and D = y^T column-major (y [N, M]
// contiguous), T (fp16/bf16) in, D (default T) out, float accumulation, TMA loads and stores, as many pipeline
// stages as the shared memory left by the epilogue holds. Ping-pong (two consumer warpgroups on alternate tiles)
// by default; kCooperative: both on one tile of 128 or more W rows, 64 each. (benchmarks/fold_splitk_probe.cu
// takes float D: partial sums of a split K.)
template <class T, class Tile, class Cluster, bool kCooperative = false, class D = T>
struct DecodeCollectives {
  static constexpr int kAlign = 16 / sizeof(T);  // elements per 16 bytes: TMA's alignment
  static constexpr int kAlignD = 16 / sizeof(D);
  using EpilogueSchedule = std::conditional_t<kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using KernelSchedule = std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                            cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, kAlignD, D,
      cutlass::layout::ColumnMajor, kAlignD, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign, T,
      cutlass::layout::ColumnMajor, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
};

// The current device's SMs and the clusters of kernel K that fit at once (an occupancy query: once per device).
template <class K>
cutlass::KernelHardwareInfo cached_hardware_info() {
  static cutlass::KernelHardwareInfo cached[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  cutlass::KernelHardwareInfo& info = cached[device & 63];
  if (info.sm_count == 0) info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(device);
  return info;
}

// G: a configuration with G::Kernel (GemmUniversal) and G::Device (its GemmUniversalAdapter).
// programmatic: launched with programmatic stream serialization, so that it may start before the kernel before it
// ends; the kernel must then wait (griddepcontrol.wait) before it reads that kernel's output (lora_linear's GEMM).
template <class G>
cudaError_t run_cutlass(const typename G::Device::Arguments& args, void* workspace, cudaStream_t stream,
                        bool programmatic = false) {
  using Kernel = typename G::Kernel;
  if (Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  auto params = Kernel::to_underlying_arguments(args, workspace);
  if (const cudaError_t err = allow_dynamic_smem((const void*)cutlass::device_kernel<Kernel>,
                                                 Kernel::SharedStorageSize);
      err != cudaSuccess) {
    return err;
  }
  // fold_linear's GEMM is launched without programmatic stream serialization: its scheduler reads seg_indptr
  // before any griddepcontrol.wait, so the previous kernel must have finished.
  if (G::Device::run(params, stream, nullptr, programmatic) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace lora_ops::cuda
