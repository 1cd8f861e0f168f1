// grouped_gemm on the cube unit (docs/design.md §2): for each tile of up to tile_rows rows of one segment (group l),
//   AIC:  acc = x[rows, :k_l] . w[l, block, :k_l]^T in fp32, per block of n_block of the first n_l columns,
//         -> workspace slot; a float32 x with a 16-bit w enters the cube as hi + lo halves in w's dtype, split by
//         the AIVs (kernel_common.h), one Mmad each into the same accumulator;
//   AIVs: y[rows, block] = (accumulate ? y : 0) + alpha * acc, rounded once to y's dtype.
// An empty reduction (k_l = 0) contributes exactly zero: y is left alone, or zeroed when accumulate is false.
#include <type_traits>

#include "kernel_common.h"
#include "kernels.h"
#include "launch.h"

namespace lora_ops::ascend {
namespace {

// X: x's dtype, W: w's (the cube's operand type), Y: y's. X is W, or float with a 16-bit W (split into hi + lo).
template <typename X, typename W, typename Y>
class GroupedGemmKernel {
  static constexpr bool kSplit = std::is_same_v<X, float> && !std::is_same_v<W, float>;
  static constexpr int kParts = kSplit ? 2 : 1;

 public:
  __aicore__ inline GroupedGemmKernel(const GroupedGemmTiling& t, GM_ADDR y, GM_ADDR x, GM_ADDR w,
                                      GM_ADDR seg_indptr, GM_ADDR seg_weight, GM_ADDR token_indices,
                                      GM_ADDR n_sizes, GM_ADDR k_sizes, GM_ADDR workspace, GM_ADDR split)
      : t_(t), y_(y), indptr_(seg_indptr), slots_(seg_weight), token_indices_(token_indices), n_sizes_(n_sizes),
        k_sizes_(k_sizes), workspace_(workspace), split_(split) {
    x_.SetGlobalBuffer(reinterpret_cast<__gm__ X*>(x));
    w_.SetGlobalBuffer(reinterpret_cast<__gm__ W*>(w));
  }

  __aicore__ inline void RunCube() {
    const int64_t block = GetBlockIdx();
    TPipe pipe;
    Cube<W> cube;
    cube.Init(pipe, t_.tiles.tile_rows, t_.tiles.k_chunk);
    const SplitPlanes<W> planes(split_, block, t_.tiles);
    SlotWriter slots(workspace_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t n_l = SlotSize(n_sizes_, t_.has_n_sizes, walk.slot, t_.n);
      const int64_t k_l = SlotSize(k_sizes_, t_.has_k_sizes, walk.slot, t_.k);
      if (n_l == 0 || k_l == 0) continue;  // nothing to compute (the AIVs zero y themselves when asked to)
      if constexpr (kSplit) CrossCoreWaitFlag(kSplitDoneFlag);  // the tile's x as hi and lo planes
      const int64_t m_pad = RoundUp(walk.count, kFrac);
      const GlobalTensor<W> w = w_[walk.slot * t_.w_stride0];
      for (int64_t n0 = 0; n0 < n_l; n0 += t_.tiles.n_block) {
        const int64_t n = Min(t_.tiles.n_block, n_l - n0);
        LocalTensor<float> acc = cube.AllocAcc();
        for (int64_t k0 = 0; k0 < k_l; k0 += t_.tiles.k_chunk) {
          const int64_t k_len = Min(t_.tiles.k_chunk, k_l - k0);
          LocalTensor<W> wb = cube.LoadWeight(w, n0, n, t_.w_stride1, k0, k_len);
          for (int p = 0; p < kParts; ++p) {
            LocalTensor<W> xa;
            if constexpr (kSplit) {
              xa = cube.LoadRows(p == 0 ? planes.hi : planes.lo, nullptr, walk.count, planes.ld, k0, k_len);
            } else {
              xa = cube.LoadRows(x_, walk.rows, walk.count, t_.x_row_stride, k0, k_len);
            }
            cube.Mmad(acc, xa, wb, m_pad, n, k_len, k0 > 0 || p > 0);
            cube.FreeLeft(xa);
          }
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
    HiLoSplitter<W> splitter;
    if constexpr (kSplit) splitter.Init(pipe);
    const SplitPlanes<W> planes(split_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t n_l = SlotSize(n_sizes_, t_.has_n_sizes, walk.slot, t_.n);
      const int64_t k_l = SlotSize(k_sizes_, t_.has_k_sizes, walk.slot, t_.k);
      if (n_l == 0 || (k_l == 0 && t_.accumulate)) continue;
      if constexpr (kSplit) {
        if (k_l > 0) {  // a tile the AIC computes: x[rows, :k_l] -> hi and lo planes
          int32_t first, mine;
          rows.Share(walk.count, first, mine);
          splitter.Split(planes, x_, walk.rows, t_.x_row_stride, first, mine, k_l);
          CrossCoreSetFlag<2, PIPE_MTE3>(kSplitDoneFlag);
        }
      }
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
  GM_ADDR split_;
  GlobalTensor<X> x_;
  GlobalTensor<W> w_;
};

}  // namespace
}  // namespace lora_ops::ascend

extern "C" __global__ __aicore__ void lora_ops_grouped_gemm(GM_ADDR y, GM_ADDR x, GM_ADDR w, GM_ADDR seg_indptr,
                                                            GM_ADDR seg_weight, GM_ADDR token_indices,
                                                            GM_ADDR n_sizes, GM_ADDR k_sizes, GM_ADDR workspace,
                                                            GM_ADDR split,
                                                            LoraOpsGroupedGemmTiling tiling) {
  using namespace lora_ops::ascend;
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  RunForDtypes<GroupedGemmKernel>(tiling, tiling.w_dtype, tiling.x_dtype, tiling.y_dtype, y, x, w, seg_indptr,
                                  seg_weight, token_indices, n_sizes, k_sizes, workspace, split);
}

namespace lora_ops::ascend {

uint32_t launch_grouped_gemm(const GroupedGemmTiling& tiling, const GroupedGemmBuffers& b, void* stream) {
  auto gm = [](const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); };
  return LORA_OPS_ASCEND_LAUNCH(lora_ops_grouped_gemm, KERNEL_TYPE_MIX_AIC_1_2, tiling.tiles.block_dim, stream, tiling,
                                gm(b.y), gm(b.x), gm(b.w), gm(b.seg_indptr), gm(b.seg_weight), gm(b.token_indices),
                                gm(b.n_sizes), gm(b.k_sizes), gm(b.workspace), gm(b.split));
}

}  // namespace lora_ops::ascend
