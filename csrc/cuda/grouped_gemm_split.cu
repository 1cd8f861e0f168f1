// grouped_gemm with few positions and few columns (the LoRA shrink at decode, e.g. 32 rows, K = 4096, n = 16): the
// tile kernels walk all of K in one CTA per tile, a chain of K / 64 pipeline steps. Here the sgmv's split-K shrink
// (sgmv_shrink.cu: CTAs per tile of 8 positions and K chunk, float32 partials [splits][rows][n]) spreads K over the
// GPU, and this file's kernel sums the partials in split order (deterministic) into y: one warp per position,
// y[row, :n_l] = alpha * sum (+ y with accumulate).
#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kWarps = 4;

template <class TY>
__global__ void __launch_bounds__(32 * kWarps)
    grouped_gemm_split_sum_kernel(GroupedGemmParams p, const float* partials, int64_t splits) {
  grid_dependency_wait();  // the shrink's partials
  const int lane = threadIdx.x & 31;
  TY* y = static_cast<TY*>(p.y);
  const bool has_k = p.k > 0;  // an empty reduction contributes exactly zero, whatever alpha is
  for (int64_t tile = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); tile < p.seg.positions;
       tile += (int64_t)gridDim.x * kWarps) {
    TileRef ref;  // tiles of one position: the covered positions in order
    if (!warp_find_tile(p.seg, p.num_groups, 1, tile, &ref)) break;
    const int64_t row = segment_row(p.seg, ref.begin, p.rows);
    if (row < 0) continue;
    const int64_t n_l = slot_size(p.n_sizes, ref.slot, p.n);
    TY* y_row = y + row * p.y_row_stride;
    for (int64_t j = lane; j < n_l; j += 32) {
      float sum = 0.f;
      for (int64_t s = 0; s < splits; ++s) sum += partials[(s * p.rows + row) * p.n + j];
      float v = has_k ? p.alpha * sum : 0.f;
      if (p.accumulate) v += to_f32(y_row[j]);
      y_row[j] = from_f32<TY>(v);
    }
  }
}

}  // namespace

bool grouped_gemm_split_serves(const GroupedGemmParams& p) {
  return p.n <= kGroupedGemmNarrowMaxN && p.k_sizes == nullptr && p.x_dtype == p.w_dtype;
}

SgmvParams grouped_gemm_as_shrink(const GroupedGemmParams& p) {
  SgmvParams s{};
  s.x = p.x;
  s.lora_a = p.w;  // [L, n, K]: one slice of "rank" n, each group's true rank its n_l
  s.x_row_stride = p.x_row_stride;
  s.a_stride0 = p.w_stride0;
  s.a_stride1 = p.w_stride1;
  s.x_dtype = p.x_dtype;
  s.y_dtype = p.y_dtype;
  s.seg = p.seg;
  s.lora_ranks = p.n_sizes;
  s.rows = p.rows;
  s.k = p.k;
  s.n = p.n;
  s.num_slots = p.num_groups;
  s.max_rank = p.n;
  s.num_slices = 1;
  s.slice_offsets[0] = 0;
  s.slice_offsets[1] = p.n;
  s.scale = 1.f;
  return s;
}

cudaError_t launch_grouped_gemm_split_sum(const GroupedGemmParams& p, const float* partials, int64_t splits,
                                          int cc_major, cudaStream_t stream) {
  const int64_t groups = (p.seg.positions + kWarps - 1) / kWarps;
  if (groups == 0) return cudaSuccess;
  const dim3 grid((unsigned)std::min<int64_t>(groups, 65535));
  return dispatch_dtype(p.y_dtype, [&](auto tag) {
    using TY = typename ElemOf<decltype(tag)::value>::type;
    return launch_pdl(grouped_gemm_split_sum_kernel<TY>, grid, 32 * kWarps, cc_major >= 9, stream, p, partials,
                      splits);
  });
}

}  // namespace lora_ops::cuda
