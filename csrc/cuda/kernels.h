// Plain-C++ launch functions of the CUDA kernels (implemented in the .cu files, called by registration.cpp).
#pragma once
#include <cuda_runtime.h>

#include "../common/params.h"

namespace lora_ops::cuda {

// Which SgmvParams tensors allow 16-byte vector accesses (aligned base, 16-byte multiple strides).
struct Vec16Access {
  bool x, a, b, y;
};

// Decode-regime sgmv without clusters (sm_80): one cooperative launch, shrink (split over rank rows and K)
// -> grid barrier -> expand.
struct SimtPlan {
  int64_t k_splits, k_chunk;      // shrink K split (deterministic: partials reduced in order by the expand)
  int64_t max_tiles;              // upper bound on tiles of 8 positions
  int64_t shrink_units, expand_units;
  int grid;
  Vec16Access vec;
};
SimtPlan plan_sgmv_simt(const SgmvParams& p, int num_sms);
size_t sgmv_simt_workspace_floats(const SgmvParams& p, const SimtPlan& plan);
// The expand stages the tile's rank vectors (8 rows x S*R floats) in shared memory: S*R is bounded.
int64_t sgmv_simt_max_rank_columns();
cudaError_t launch_sgmv_simt(const SgmvParams& p, const SimtPlan& plan, float* workspace, cudaStream_t stream);

// Decode-regime sgmv from sm_90 on: one cluster of `cluster` CTAs per tile of 8 positions, no grid barrier.
struct ClusterPlan {
  int64_t max_tiles;   // upper bound on tiles of 8 positions
  int64_t cluster;     // CTAs per tile: K split for the shrink, column split for the expand
  int64_t stage_rows;  // A rows per shared-memory stage (16 or 32)
  int64_t buffers;     // stages in flight (1 or 2)
  int64_t staged_rank; // B rank columns staged in shared memory per column pass (a multiple of 8)
  Vec16Access vec;
};
// False when the GPU has no clusters or the shapes do not fit the kernel's shared memory.
bool plan_sgmv_cluster(const SgmvParams& p, int num_sms, int cc_major, ClusterPlan* plan);
cudaError_t launch_sgmv_cluster(const SgmvParams& p, const ClusterPlan& plan, cudaStream_t stream);

// Prefill-regime sgmv on tensor cores (fp16/bf16, 16-byte aligned rows): one CTA per 64-position tile and
// slice group; shrink and expand in one kernel, the intermediate in registers.
bool sgmv_mma_supported(const SgmvParams& p);
cudaError_t launch_sgmv_mma(const SgmvParams& p, int num_sms, int cc_major, cudaStream_t stream);

// grouped_gemm, K loop over tiles of positions x columns of one group, on tensor cores (fp16/bf16 w) or FMA
// (fp32 w); any alignment. `narrow`: 64-row tiles holding every column of an N <= kGroupedGemmNarrowMaxN problem
// (a LoRA shrink streams x once; larger N takes several column tiles); otherwise 128 x 128 tiles.
constexpr int kGroupedGemmNarrowMaxN = 128;
cudaError_t launch_grouped_gemm_tile(const GroupedGemmParams& p, bool narrow, cudaStream_t stream);

// grouped_gemm with K <= kGroupedGemmExpandMaxK (the LoRA expand): each CTA stages its rows' x once and streams
// w and y through its share of the columns; any alignment.
constexpr int kGroupedGemmExpandMaxK = 128;
cudaError_t launch_grouped_gemm_expand(const GroupedGemmParams& p, int num_sms, cudaStream_t stream);

// The largest num_slots whose histograms fit the kernel's shared memory.
int64_t build_segments_max_slots();
cudaError_t launch_build_segments(const BuildSegmentsParams& p, int cc_major, cudaStream_t stream);

}  // namespace lora_ops::cuda
