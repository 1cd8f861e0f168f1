#include <ATen/Parallel.h>

#include "kernels.h"
#include "rows.h"

namespace lora_ops::cpu {

// Per row block: x rows to float once, each w row [n, :k_l] converted once and dotted with every row.
void grouped_gemm(const GroupedGemmParams& p) {
  const auto blocks = row_blocks(p.seg, p.rows, p.num_groups);
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> xf(kRowBlock * p.k), wf(p.k), yf(kRowBlock * p.n);
    for (int64_t b = first; b < last; ++b) {
      const RowBlock& blk = blocks[b];
      const int64_t n_l = slot_size(p.n_sizes, blk.slot, p.n);
      const int64_t k_l = slot_size(p.k_sizes, blk.slot, p.k);
      // An empty reduction (k_l = 0) contributes exactly zero whatever alpha is (docs/design.md §2): the covered
      // columns become (accumulate ? y : 0), so with accumulate y is left bitwise unchanged.
      if (n_l == 0 || (k_l == 0 && p.accumulate)) continue;
      for (int64_t i = 0; i < blk.count; ++i) {
        load_floats(p.x_dtype, p.x, blk.rows[i] * p.x_row_stride, k_l, &xf[i * k_l]);
        if (p.accumulate) {
          load_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride, n_l, &yf[i * n_l]);
        } else {
          std::fill_n(&yf[i * n_l], n_l, 0.f);
        }
      }
      for (int64_t n = 0; n < n_l && k_l > 0; ++n) {
        load_floats(p.w_dtype, p.w, blk.slot * p.w_stride0 + n * p.w_stride1, k_l, wf.data());
        for (int64_t i = 0; i < blk.count; ++i) yf[i * n_l + n] += p.alpha * dot(&xf[i * k_l], wf.data(), k_l);
      }
      for (int64_t i = 0; i < blk.count; ++i) {
        store_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride, n_l, &yf[i * n_l]);
      }
    }
  });
}

}  // namespace lora_ops::cpu
