#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"
#include "rows.h"

namespace lora_ops::cpu {

// Per row block: x rows to float once; each A row converted once and dotted with every row (shrink, h in
// float32); then each B row converted once and applied to every row's h (expand).
void sgmv(const SgmvParams& p) {
  // An empty reduction contributes exactly zero whatever the scales (docs/design.md §2): K = 0 leaves y bitwise
  // unchanged, even with a NaN or infinite scale (0 * NaN would write NaN; -0.0 + 0 would flip a sign bit).
  // N = 0: nothing to write, and nothing to allocate (the scratch below grows with R, which an expanded lora_a
  // can make any size).
  if (p.k == 0 || p.n == 0) return;
  const auto blocks = row_blocks(p.seg, p.rows, p.num_slots);
  const int64_t K = p.k, R = p.max_rank, S = p.num_slices;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> xf(kRowBlock * K), wf(std::max(K, R)), h(kRowBlock * R), yf(kRowBlock * p.n);
    for (int64_t b = first; b < last; ++b) {
      const RowBlock& blk = blocks[b];
      const int64_t rank = slot_size(p.lora_ranks, blk.slot, R);
      if (rank == 0) continue;
      const float coef = p.scale * (p.lora_scales ? p.lora_scales[blk.slot] : 1.f);
      for (int64_t i = 0; i < blk.count; ++i) load_floats(p.x_dtype, p.x, blk.rows[i] * p.x_row_stride, K, &xf[i * K]);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t lo = p.slice_offsets[s], hi = p.slice_offsets[s + 1];
        if (lo == hi) continue;
        for (int64_t j = 0; j < rank; ++j) {
          load_floats(p.x_dtype, p.lora_a, blk.slot * p.a_stride0 + (s * R + j) * p.a_stride1, K, wf.data());
          for (int64_t i = 0; i < blk.count; ++i) h[i * R + j] = dot(&xf[i * K], wf.data(), K);
        }
        const int64_t width = hi - lo;
        for (int64_t i = 0; i < blk.count; ++i) {
          load_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride + lo, width, &yf[i * width]);
        }
        for (int64_t n = lo; n < hi; ++n) {
          load_floats(p.x_dtype, p.lora_b, blk.slot * p.b_stride0 + n * p.b_stride1, rank, wf.data());
          for (int64_t i = 0; i < blk.count; ++i) yf[i * width + n - lo] += coef * dot(&h[i * R], wf.data(), rank);
        }
        for (int64_t i = 0; i < blk.count; ++i) {
          store_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride + lo, width, &yf[i * width]);
        }
      }
    }
  });
}

}  // namespace lora_ops::cpu
