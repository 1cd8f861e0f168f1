// Plain-C++ launch functions of the CUDA kernels (implemented in the .cu files, called by registration.cpp).
#pragma once
#include <cuda_runtime.h>

#include "../common/params.h"

namespace lora_ops::cuda {

// Decode-regime sgmv without clusters (sm_80): one cooperative launch, shrink (split over rank rows and K)
// -> grid barrier -> expand.
struct SimtPlan {
  int64_t k_splits, k_chunk;      // shrink K split (deterministic: partials reduced in order by the expand)
  int64_t max_tiles;              // upper bound on tiles of kSimtTileRows positions
  int64_t shrink_units, expand_units;
  int grid;
  bool x_vec, a_vec, b_vec;       // 16-byte vector loads are legal for these tensors
};
SimtPlan plan_sgmv_simt(const SgmvParams& p, int num_sms);
size_t sgmv_simt_workspace_floats(const SgmvParams& p, const SimtPlan& plan);
// The expand stages the tile's rank vectors (8 rows x S*R floats) in shared memory.
bool sgmv_simt_smem_limit_ok(const SgmvParams& p);
cudaError_t launch_sgmv_simt(const SgmvParams& p, const SimtPlan& plan, float* workspace, cudaStream_t stream);

// Decode-regime sgmv from sm_90 on: one cluster of `cluster` CTAs per tile of 8 positions, no grid barrier.
struct ClusterPlan {
  int64_t max_tiles;   // upper bound on tiles of 8 positions
  int64_t cluster;     // CTAs per tile: K split for the shrink, column split for the expand
  int64_t stage_rows;  // A rows per shared-memory stage (16 or 32)
  int64_t buffers;     // stages in flight (1 or 2)
  int64_t staged_rank; // B rank columns staged in shared memory per column pass (a multiple of 8)
  bool x_vec, a_vec, b_vec, y_vec;  // 16-byte copies are legal for these tensors
};
// False when the GPU has no clusters or the shapes do not fit the kernel's shared memory.
bool plan_sgmv_cluster(const SgmvParams& p, int num_sms, int cc_major, ClusterPlan* plan);
cudaError_t launch_sgmv_cluster(const SgmvParams& p, const ClusterPlan& plan, cudaStream_t stream);

// Prefill-regime sgmv on tensor cores (fp16/bf16, 16-byte aligned rows): one CTA per 64-position tile and
// slice group; shrink and expand in one kernel, the intermediate in registers.
bool sgmv_mma_supported(const SgmvParams& p);
cudaError_t launch_sgmv_mma(const SgmvParams& p, int num_sms, int cc_major, cudaStream_t stream);

cudaError_t launch_build_segments(const BuildSegmentsParams& p, int cc_major, cudaStream_t stream);

}  // namespace lora_ops::cuda
