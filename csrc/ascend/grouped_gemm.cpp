// grouped_gemm on the cube unit (docs/design.md §2): for each tile of up to tile_rows rows of one segment (group l),
//   AIC:  acc = x[rows, :k_l] . w[l, block, :k_l]^T in fp32, per block of n_block of the first n_l columns,
//         -> workspace slot;
//   AIVs: y[rows, block] = (accumulate ? y : 0) + alpha * acc, rounded once to y's dtype.
// An empty reduction (k_l = 0) contributes exactly zero: y is left alone, or zeroed when accumulate is false.
#include "kernel_common.h"
#include "kernels.h"
#include "launch.h"

namespace lora_ops::ascend {
namespace {

template <typename T, typename Y>
class GroupedGemmKernel {
 public:
  __aicore__ inline GroupedGemmKernel(const GroupedGemmTiling& t, GM_ADDR y, GM_ADDR x, GM_ADDR w,
                                      GM_ADDR seg_indptr, GM_ADDR seg_weight, GM_ADDR token_indices,
                                      GM_ADDR n_sizes, GM_ADDR k_sizes, GM_ADDR workspace)
      : t_(t), y_(y), indptr_(seg_indptr), slots_(seg_weight), token_indices_(token_indices), n_sizes_(n_sizes),
        k_sizes_(k_sizes), workspace_(workspace) {
    x_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(x));
    w_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(w));
  }

  __aicore__ inline void RunCube() {
    const int64_t block = GetBlockIdx();
    TPipe pipe;
    Cube<T> cube;
    cube.Init(pipe, t_.tiles.tile_rows, t_.tiles.k_chunk);
    SlotWriter slots(workspace_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t n_l = SlotSize(n_sizes_, t_.has_n_sizes, walk.slot, t_.n);
      const int64_t k_l = SlotSize(k_sizes_, t_.has_k_sizes, walk.slot, t_.k);
      if (n_l == 0 || k_l == 0) continue;  // nothing to compute (the AIVs zero y themselves when asked to)
      const int64_t m_pad = RoundUp(walk.count, kFrac);
      const GlobalTensor<T> w = w_[walk.slot * t_.w_stride0];
      for (int64_t n0 = 0; n0 < n_l; n0 += t_.tiles.n_block) {
        const int64_t n = Min(t_.tiles.n_block, n_l - n0);
        LocalTensor<float> acc = cube.AllocAcc();
        for (int64_t k0 = 0; k0 < k_l; k0 += t_.tiles.k_chunk) {
          const int64_t k_len = Min(t_.tiles.k_chunk, k_l - k0);
          LocalTensor<T> xa = cube.LoadRows(x_, walk.rows, walk.count, t_.x_row_stride, k0, k_len);
          LocalTensor<T> wb = cube.LoadWeight(w, n0, n, t_.w_stride1, k0, k_len);
          cube.Mmad(acc, xa, wb, m_pad, n, k_len, k0 > 0);
          cube.FreeLeft(xa);
          cube.FreeRight(wb);
        }
        acc = cube.Finish(acc);
        slots.Write(acc, walk.count, m_pad, n);
        cube.FreeAcc(acc);
      }
    }
    slots.Drain();
  }

  __aicore__ inline void RunVector() {
    const int64_t block = GetBlockIdx() / GetSubBlockNum();
    TPipe pipe;
    RowUpdater<Y> rows;
    rows.Init(pipe, workspace_, y_, t_.y_row_stride, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t n_l = SlotSize(n_sizes_, t_.has_n_sizes, walk.slot, t_.n);
      const int64_t k_l = SlotSize(k_sizes_, t_.has_k_sizes, walk.slot, t_.k);
      if (n_l == 0 || (k_l == 0 && t_.accumulate)) continue;
      for (int64_t n0 = 0; n0 < n_l; n0 += t_.tiles.n_block) {
        const int64_t n = Min(t_.tiles.n_block, n_l - n0);
        if (k_l == 0) {
          rows.Zero(walk.rows, walk.count, n0, n);
        } else {
          rows.Apply(walk.rows, walk.count, n0, n, t_.alpha, t_.accumulate);
        }
      }
    }
  }

 private:
  const GroupedGemmTiling& t_;
  // GM_ADDR is a pointer macro: one declarator each.
  GM_ADDR y_;
  GM_ADDR indptr_;
  GM_ADDR slots_;
  GM_ADDR token_indices_;
  GM_ADDR n_sizes_;
  GM_ADDR k_sizes_;
  GM_ADDR workspace_;
  GlobalTensor<T> x_, w_;
};

template <typename T, typename Y>
__aicore__ inline void RunGroupedGemm(const GroupedGemmTiling& t, GM_ADDR y, GM_ADDR x, GM_ADDR w,
                                      GM_ADDR seg_indptr, GM_ADDR seg_weight, GM_ADDR token_indices, GM_ADDR n_sizes,
                                      GM_ADDR k_sizes, GM_ADDR workspace) {
  GroupedGemmKernel<T, Y> kernel(t, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, workspace);
  if ASCEND_IS_AIC {
    kernel.RunCube();
  }
  if ASCEND_IS_AIV {
    kernel.RunVector();
  }
}

}  // namespace
}  // namespace lora_ops::ascend

extern "C" __global__ __aicore__ void lora_ops_grouped_gemm(GM_ADDR y, GM_ADDR x, GM_ADDR w, GM_ADDR seg_indptr,
                                                            GM_ADDR seg_weight, GM_ADDR token_indices,
                                                            GM_ADDR n_sizes, GM_ADDR k_sizes, GM_ADDR workspace,
                                                            lora_ops::ascend::GroupedGemmTiling tiling) {
  using namespace lora_ops::ascend;
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  const bool f32_y = tiling.y_dtype == kFloat;
  if (tiling.x_dtype == kHalf) {
    f32_y ? RunGroupedGemm<half, float>(tiling, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes,
                                        workspace)
          : RunGroupedGemm<half, half>(tiling, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes,
                                       workspace);
  } else if (tiling.x_dtype == kBf16) {
    f32_y ? RunGroupedGemm<bfloat16_t, float>(tiling, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes,
                                              k_sizes, workspace)
          : RunGroupedGemm<bfloat16_t, bfloat16_t>(tiling, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes,
                                                   k_sizes, workspace);
  } else {
    RunGroupedGemm<float, float>(tiling, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, workspace);
  }
}

namespace lora_ops::ascend {

void launch_grouped_gemm(const GroupedGemmTiling& tiling, const GroupedGemmBuffers& b, void* stream) {
  auto gm = [](const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); };
  LORA_OPS_ASCEND_LAUNCH(lora_ops_grouped_gemm, KERNEL_TYPE_MIX_AIC_1_2, tiling.tiles.block_dim, stream, gm(b.y),
                         gm(b.x), gm(b.w), gm(b.seg_indptr), gm(b.seg_weight), gm(b.token_indices), gm(b.n_sizes),
                         gm(b.k_sizes), gm(b.workspace), tiling);
}

}  // namespace lora_ops::ascend
