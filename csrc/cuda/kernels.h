// Plain-C++ launch functions of the CUDA kernels (implemented in the .cu files, called by registration.cpp).
#pragma once
#include <cuda_runtime.h>

#include "../common/params.h"

namespace lora_ops::cuda {

// Which SgmvParams tensors allow 16-byte vector accesses (aligned base, 16-byte multiple strides).
struct Vec16Access {
  bool x, a, b, y;
};

// Decode-regime sgmv: two short kernels. The shrink writes float32 K-split partials of h
// ([splits][rows][S*R]); the expand (launch_lora_expand with h = the partials) sums them in split order (and
// grouped_gemm's decode shrink: launch_grouped_gemm_split_sum).
struct ShrinkPlan {
  int64_t max_tiles;  // upper bound on tiles of 8 positions
  int64_t splits, k_chunk;
};
ShrinkPlan plan_sgmv_shrink(const SgmvParams& p, int num_sms);
cudaError_t launch_sgmv_shrink(const SgmvParams& p, const ShrinkPlan& plan, float* partials, cudaStream_t stream);

// y += h * B^T per segment (the lora_expand op, and step 2 of the decode sgmv). From sm_90 it is launched
// programmatically dependent on the previous kernel in the stream, and reads only after its wait for that kernel,
// unless `inputs_ready`: the previous kernel writes h and y only, and was itself launched in stream order after
// everything else the expand reads (the sgmv's shrink), so the segment lookup and B's loads may overlap it.
// (Under PDL a kernel sees its predecessor's writes only after the wait; the lora_expand op cannot know its
// predecessor.) The tensor-core kernels (lora_expand_rows.cu, below) where they serve; otherwise two kernels
// (lora_expand.cu): one CTA per tile of positions up to 64 positions, per tile of a segment beyond (Auto), or the
// one preferred. The order of the values after Auto is the order LORA_OPS_CUDA_EXPAND_KERNEL names them in.
enum class ExpandKernel { Auto, Positions, Tiles, Rows, Runs, Segments };
cudaError_t launch_lora_expand(const ExpandParams& p, ExpandKernel preferred, bool inputs_ready, int cc_major,
                               cudaStream_t stream);

// lora_expand on tensor cores (lora_expand_rows.cu), no shared memory, no barrier. The rows form: one warp per
// position (the rows kernel), or per 4 or 8 positions that share B within each run of one slot (the runs kernel). The
// segment form: one warp per tile of up to 8 positions of one segment (the segments kernel), which loads its slot's
// B once. They serve fp16/bf16 B with h of B's dtype (8-byte-aligned rows) or bf16 B with float32 h of one split
// (16-byte-aligned rows), ranks in fours (mma_kernels_serve);
// the automatic choice of launch_lora_expand takes the segments kernel for the segment form, and for the rows form
// the runs kernel where runs_kernel_pays, the rows kernel elsewhere.
bool mma_kernels_serve(const ExpandParams& p);
// Positions ordered through token_indices (build_segments' order puts a slot's rows together) and at least
// kRunsMinPositionsPerSlot per pool slot: even with every slot present, a warp's 8 (or 4) positions then span ~4
// runs or fewer (csrc/cuda/NOTES.md). The order is taken on trust: token_indices in another order is served exactly, at up
// to 8 serial runs per warp (forced at 32 positions over 32 slots: the step +42% against the rows kernel's +27%).
constexpr int64_t kRunsMinPositionsPerSlot = 2;
// Below this many positions per pool slot, the runs kernel takes a pool rank of 33-64 in one 64-rank trip a run (not
// two of 32), on 4 positions a warp where that grid fits at once (csrc/cuda/NOTES.md, session 47).
constexpr int64_t kRunsWideTripMaxPositionsPerSlot = 3;
bool runs_kernel_pays(const ExpandParams& p);
cudaError_t launch_lora_expand_mma(const ExpandParams& p, ExpandKernel kernel, int cc_major, cudaStream_t stream);

// Prefill-regime sgmv on tensor cores (fp16/bf16, 16-byte aligned rows): one CTA per tile of positions of one
// segment and slice group (a cluster of CTAs on sm_90, splitting K and the columns); shrink and expand in one
// kernel, the intermediate on chip.
enum class WgmmaUse { Never, Auto, Always };  // Auto: within the measured bounds below
// The automatic choice gives the wgmma kernel the rank tiles (a slice group's slices x padded rank) of 64 and more
// from kWgmmaMinPositions positions on, and there at a rank tile of 128 tiles of 128 positions (two warpgroups
// sharing each A and B stage) instead of 64. Measured on an H100 (sessions 59-60, graph replay, K = N = 4096,
// 8 adapters unless said, us, mma.sync / wgmma in 64-position tiles / in 128):
// - rank 128: T=1024 35.5 / 38.3 / 36.4, T=2048 46.2 / 48.3 / 51.3, T=3072 61.4 / 58.1 / 57.2, T=4096 77.7 / 70.4 /
//   67.6, T=6144 108.6 / 94.5 / 87.1, T=8192 114.2 / 123.9 / 112.7, T=16384 222.0 / 185.7 / 178.5;
// - rank 64: T=1024 27.1 / 29.4, T=2048 36.4 / 36.3, T=4096 59.1 / 58.1, T=16384 178.6 / 168.8 (128-position
//   tiles no faster: only rank tile 128 has them);
// - rank tile 16: T=4096 (4 adapters) 48.4 / 49.1, 3 slices (N = 6144) in rank-16 groups T=1024 29.8 / 32.2.
constexpr int64_t kWgmmaMinRankTile = 64;
constexpr int64_t kWgmmaMinPositions = 3072;
struct SgmvPrefillChoice {
  WgmmaUse wgmma = WgmmaUse::Never;  // which plans take sgmv_wgmma.cu's kernel (Auto, Always: where it runs)
  int wgmma_rows = 0;  // 64 or 128: the wgmma kernel's tile of positions at a rank tile of 128 (narrower: 64);
                       // 0: 128 from kWgmmaMinPositions on
  int cluster = 0;     // 1-8: that many CTAs a cluster on sm_90, as given; 0: the plan's, narrowed to one wave
};
bool sgmv_mma_supported(const SgmvParams& p);
cudaError_t launch_sgmv_mma(const SgmvParams& p, int num_sms, int cc_major, const SgmvPrefillChoice& choice,
                            cudaStream_t stream);

// The prefill sgmv's plan (sgmv_mma.cu's make_plan, in tiles of 64 positions), which both of its kernels take.
struct MmaPlan {
  int64_t rank_pad;          // per-slice rank rounded up to 16
  int64_t slices_per_group;  // slices sharing one rank tile
  int64_t groups, max_tiles;
  int64_t cluster;           // CTAs per (tile, group): K split for the shrink, column split for the expand
};
// sgmv_wgmma.cu, compiled in with grouped_gemm_sm90.cu (LORA_OPS_GG_SM90): a 9.0 device and y of x's dtype, on
// top of sgmv_mma_supported (which the caller has checked).
bool sgmv_wgmma_supported(const SgmvParams& p, int cc_major, int cc_minor);
// The plan's tiles and clusters as `choice` asks (its rows; its cluster, or the plan's narrowed to one wave).
cudaError_t launch_sgmv_wgmma(const SgmvParams& p, const MmaPlan& plan, const SgmvPrefillChoice& choice,
                              cudaStream_t stream);

// grouped_gemm, K loop over tiles of positions x columns of one group, on tensor cores (fp16/bf16 w) or FMA
// (fp32 w); any alignment. `narrow`: 64-row tiles holding every column of an N <= kGroupedGemmNarrowMaxN problem
// (a LoRA shrink streams x once; larger N takes several column tiles; up to N = 32, x and w with 16-byte aligned
// rows are staged through each thread's pieces, their row addresses found once per tile); otherwise 128 x 128 tiles.
constexpr int kGroupedGemmNarrowMaxN = 128;
cudaError_t launch_grouped_gemm_tile(const GroupedGemmParams& p, bool narrow, cudaStream_t stream);

// grouped_gemm with few positions and n <= kGroupedGemmNarrowMaxN (the LoRA shrink at decode), x and w of one
// dtype, no k_sizes (grouped_gemm_split.cu): the sgmv's split-K shrink (launch_sgmv_shrink on
// grouped_gemm_as_shrink(p), float32 partials [splits][rows][n]), then launch_grouped_gemm_split_sum adds them in
// split order into y. Automatic up to kGroupedGemmSplitMaxPositions positions (and rows of y: the partials are
// sized by them) with K > kGroupedGemmExpandMaxK in two or more chunks.
constexpr int64_t kGroupedGemmSplitMaxPositions = 256;
bool grouped_gemm_split_serves(const GroupedGemmParams& p);
SgmvParams grouped_gemm_as_shrink(const GroupedGemmParams& p);
cudaError_t launch_grouped_gemm_split_sum(const GroupedGemmParams& p, const float* partials, int64_t splits,
                                          int cc_major, cudaStream_t stream);

// grouped_gemm with K <= kGroupedGemmExpandMaxK (the LoRA expand): each CTA stages its rows' x once and streams
// w and y through its share of the columns; any alignment.
constexpr int kGroupedGemmExpandMaxK = 128;
cudaError_t launch_grouped_gemm_expand(const GroupedGemmParams& p, int num_sms, cudaStream_t stream);

// grouped_gemm on sm_90a (grouped_gemm_sm90.cu: CUTLASS 3.x ptr-array, TMA + wgmma), compiled in when setup.py
// builds for 9.0a with the nvidia-cutlass headers (LORA_OPS_GG_SM90). It takes only what it serves exactly:
// a 9.0 device, x, w and y all fp16 or all bf16, no token_indices, 16-byte aligned bases and strides, every
// group the full N x K (no n_sizes/k_sizes) with N and K positive multiples of 8.
// Preferred (by the automatic choice) from N, K >= kGroupedGemmSm90MinNK and kGroupedGemmSm90MinRowsPerGroup
// positions per segment on average. The workspace (device arrays of the per-group problems and CUTLASS's
// tensor maps) comes from the caller, grouped_gemm_sm90_workspace_bytes long.
constexpr int64_t kGroupedGemmSm90MinNK = 128;
constexpr int64_t kGroupedGemmSm90MinRowsPerGroup = 64;
bool grouped_gemm_sm90_built();
bool grouped_gemm_sm90_supported(const GroupedGemmParams& p, int cc_major, int cc_minor);
bool grouped_gemm_sm90_preferred(const GroupedGemmParams& p);
size_t grouped_gemm_sm90_workspace_bytes(const GroupedGemmParams& p, int num_sms);
cudaError_t launch_grouped_gemm_sm90(const GroupedGemmParams& p, void* workspace, int num_sms, cudaStream_t stream);

// fold_linear on sm_90a (fold_linear_sm90.cu: CUTLASS 3.x, TMA + wgmma, built with CUTLASS_ENABLE_GDC_FOR_SM90 so
// that the lora_expand launched after it starts before it ends), compiled in with grouped_gemm_sm90.cu: y [t, n]
// (contiguous) = x [t, k] . w [n, k]^T, fp16 or bf16 throughout, rows 16-byte aligned, n and k multiples of 8,
// a 9.0 device, a 64 x 16 ping-pong tile up to 16 tokens, 64 x 32 up to 32, 64 x 64 above. Automatic up to
// kFoldLinearMaxTokens tokens, where it was measured to beat cuBLAS in the fold route (H200: llama3-8b T=32/32
// +26.6 -> +24.1%; H100, one call per pair, 33-64 tokens with the 64 x 64 tile: ten steps -0.1 to -21.5 points,
// e.g. T=64/16 rank 64 +66.8 -> +54.8%, T=40/32 rank 16 +26.4 -> +24.1%; NOTES.md session 22).
// With seg_indptr (int32 [num_slots + 1], build_segments'): w's last num_slots * slot_rows rows are the slots'
// windows, and the kernel may skip those of slots no row uses (their columns of y are then left unwritten).
struct FoldLinearParams {
  const void* x;
  const void* w;
  void* y;
  int64_t t, n, k, x_row_stride, w_row_stride;
  DType dtype;
  const int32_t* seg_indptr = nullptr;
  int64_t num_slots = 0, slot_rows = 0;
};
constexpr int64_t kFoldLinearMaxTokens = 64;
// Supported: the checks above (y is not read). The launch returns cudaErrorNotSupported, launching nothing, where
// CUTLASS's own host checks refuse the call (the caller then runs at::linear).
bool fold_linear_sm90_supported(const FoldLinearParams& p, int cc_major, int cc_minor);
cudaError_t launch_fold_linear_sm90(const FoldLinearParams& p, cudaStream_t stream);
// fold_linear on cuBLASLt (fold_linear_lt.cpp): the same product, p.y [t, n] contiguous, plus bias [n] (x's dtype)
// where not null; fp16 or bf16, every operand (the bias too) and row 16-byte aligned, a split K reduced in float32.
// Automatic past the CUTLASS kernel's tokens up to kFoldLinearLtMaxTokens on 9.x devices, where it was measured to
// beat cuBLAS (H100, llama3-8b at 80-128 tokens; the same kernels with the float32-reduction mask; at 192 it
// lost: NOTES.md, sessions 43-46). Returns false, launching nothing, where an operand is not aligned or cuBLASLt
// has no algorithm for the call (the caller then runs at::linear); a cuBLASLt error raises.
constexpr int64_t kFoldLinearLtMaxTokens = 128;
bool fold_linear_lt(const FoldLinearParams& p, const void* bias, int device, cudaStream_t stream);

// The K-extended GEMM's tile for 65-128 tokens: Auto picks 128 x 128 (cooperative: x read from L2 once per 128 W
// rows) where the layer has a 128-row W tile per SM or more and slice bounds on 128 rows, else 64 x 128 (ping-pong:
// twice the W tiles for the SMs of a narrow layer).
enum class KextTile { Auto, Rows128, Rows64 };  // after Auto, in the order of the variable's names: 128x128, 64x128

// lora_linear (the kext route) on sm_90a: y [t, n] = x . w^T + each row's delta with h rounded to x's dtype, as a
// shrink writing h [t, num_slices * num_slots * rank] and a GEMM over [x | h] . [w | b_cols]^T launched
// programmatically (csrc/cuda/lora_linear_sm90.cu). b_cols [n, num_slots * rank]: lora_b [L, N, R] with each row's
// slots side by side (b_row_stride = lora_b.stride(1), lora_b.stride(0) == rank). y contiguous. Up to
// kLoraLinearMaxTokens rows (kLoraLinearTileTokens: the GEMM's tiles): the slot mask is read from token_slot by one
// warp, up to 4 rows per lane.
struct LoraLinearParams {
  const void* x;
  const void* w;
  const void* lora_a;
  const void* b_cols;
  const int32_t* token_slot;
  const float* scales;
  void* h;
  void* y;
  int64_t t, n, k, x_row_stride, w_row_stride, a_slot_stride, a_row_stride, b_row_stride;
  int64_t num_slots, rank, num_slices;
  int64_t slice_offsets[kMaxSlices + 1];
  DType dtype;
  int64_t sm_count;     // the device's SMs (the 65-128-token tile's rule, the shrink's K split)
  KextTile tile_65_128;  // a preferred 65-128-token tile (LORA_OPS_CUDA_KEXT_TILE), Auto: by that rule
};
constexpr int64_t kLoraLinearMaxTokens = 128;
// The K-extended GEMM's token tiles by the rows each serves (kext_dispatch in lora_linear_sm90.cu), the last up to
// kLoraLinearMaxTokens (64 x 128 or 128 x 128 by KextTile): the kernels serve a layer when they serve it at each
// of these T, with the tile each T then takes.
constexpr int64_t kLoraLinearTileTokens[] = {16, 32, 64, kLoraLinearMaxTokens};
// Supported: fp16/bf16 on sm_90a, K and num_slots * rank multiples of 64 (K >= 64), slice bounds multiples of 64,
// at most 4 slices and 64 slots, 16-byte aligned rows, and CUTLASS's host checks for T's tile (at least as many K
// blocks of x as pipeline stages). The launch requires it (it does not check again: decode calls it per layer).
bool lora_linear_sm90_supported(const LoraLinearParams& p, int cc_major, int cc_minor);
cudaError_t launch_lora_linear_sm90(const LoraLinearParams& p, cudaStream_t stream);
// Its shrink alone (csrc/cuda/lora_linear_shrink.cu, sm_90): the sizes it serves beyond the checks above, its launch.
bool kext_shrink_serves(const LoraLinearParams& p);
cudaError_t launch_kext_shrink(const LoraLinearParams& p, cudaStream_t stream);

// The largest num_slots whose histograms fit the kernel's shared memory. One kernel for sm_80 and sm_90.
int64_t build_segments_max_slots();
cudaError_t launch_build_segments(const BuildSegmentsParams& p, cudaStream_t stream);

}  // namespace lora_ops::cuda
