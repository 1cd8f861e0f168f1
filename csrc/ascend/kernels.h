// Plain-C++ launch functions of the AscendC kernels (implemented at the end of each kernel file, called by
// launcher.cpp). `stream` is the aclrtStream to enqueue on (unused by the CPU model). Each returns the launch's
// status: 0, or the ACL error of a launch the runtime refused.
#pragma once
#include "tiling.h"

namespace lora_ops::ascend {

struct SgmvBuffers {
  void* y;
  const void *x, *lora_a, *lora_b, *seg_indptr, *seg_lora;
  const void *token_indices, *lora_ranks, *lora_scales;  // nullptr when absent
  void* workspace;  // tiles.block_dim * 2 * tile_rows * n_block floats
  void* split;      // tiles.block_dim * split_block_elems 16-bit elements (float32 y or x), else unused
};
uint32_t launch_sgmv(const SgmvTiling& tiling, const SgmvBuffers& buffers, void* stream);

struct LoraExpandBuffers {
  void* y;
  const void *h, *lora_b, *seg_indptr, *seg_lora;
  const void *token_indices, *lora_ranks, *lora_scales;  // nullptr when absent
  void* workspace;  // tiles.block_dim * 2 * tile_rows * n_block floats
  void* split;      // tiles.block_dim * split_block_elems 16-bit elements (float32 h, 16-bit B), else unused
};
uint32_t launch_lora_expand(const LoraExpandTiling& tiling, const LoraExpandBuffers& buffers, void* stream);

struct GroupedGemmBuffers {
  void* y;
  const void *x, *w, *seg_indptr, *seg_weight;
  const void *token_indices, *n_sizes, *k_sizes;  // nullptr when absent
  void* workspace;
  void* split;  // tiles.block_dim * split_block_elems 16-bit elements (float32 x, 16-bit w), else unused
};
uint32_t launch_grouped_gemm(const GroupedGemmTiling& tiling, const GroupedGemmBuffers& buffers, void* stream);

struct BuildSegmentsBuffers {
  const void* token_lora;
  void *token_indices, *seg_indptr, *seg_lora;
};
uint32_t launch_build_segments(const BuildSegmentsTiling& tiling, const BuildSegmentsBuffers& buffers, void* stream);

}  // namespace lora_ops::ascend
