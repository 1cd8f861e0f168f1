// The CUTLASS 3.x headers that grouped_gemm_sm90.cu and fold_linear_sm90.cu build their sm_90 GEMMs from (the
// collective builders, GemmUniversal and its device adapter), and one launch of such a GEMM from its host
// arguments: CUTLASS's workspace set-up, its kernel parameters, the dynamic shared memory the kernel asks for, then
// the launch (with its cluster shape). Included only where CUTLASS's headers are (LORA_OPS_GG_SM90).
#pragma once

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
