#include <ATen/Parallel.h>

#include "kernels.h"
#include "rows.h"

namespace lora_ops::cpu {

// Per row block and slice: each row's h window to float once; each B row converted once and applied to every row
// of the block, the slot's coefficient times the dot (as sgmv and the CUDA kernels: an infinite scale times a
// zero h would make NaN where coef times the dot is an inf of the dot's sign).
void lora_expand(const ExpandParams& p) {
  const auto blocks = row_blocks(p.seg, p.rows, p.num_slots);
  const int64_t R = p.max_rank;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> h(kRowBlock * R), bf(R), yf(kRowBlock * p.n);
    for (int64_t b = first; b < last; ++b) {
      const RowBlock& blk = blocks[b];
      const int64_t rank = slot_size(p.lora_ranks, blk.slot, R);
      if (rank == 0) continue;
      const float coef = p.scale * (p.lora_scales ? p.lora_scales[blk.slot] : 1.f);
      for (int64_t s = 0; s < p.num_slices; ++s) {
        const int64_t lo = p.slice_offsets[s], hi = p.slice_offsets[s + 1], width = hi - lo;
        if (width == 0) continue;
        for (int64_t i = 0; i < blk.count; ++i) {
          load_floats(p.h_dtype, p.h, blk.rows[i] * p.h_row_stride + blk.slot * p.h_slot_stride + s * R, rank,
                      &h[i * R]);
          load_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride + lo, width, &yf[i * width]);
        }
        for (int64_t n = lo; n < hi; ++n) {
          load_floats(p.b_dtype, p.lora_b, blk.slot * p.b_stride0 + n * p.b_stride1, rank, bf.data());
          for (int64_t i = 0; i < blk.count; ++i) yf[i * width + n - lo] += coef * dot(&h[i * R], bf.data(), rank);
        }
        for (int64_t i = 0; i < blk.count; ++i) {
          store_floats(p.y_dtype, p.y, blk.rows[i] * p.y_row_stride + lo, width, &yf[i * width]);
        }
      }
    }
  });
}

}  // namespace lora_ops::cpu
