// lora_expand on the cube unit (docs/design.md §2): for each tile of up to tile_rows rows of one segment (slot l,
// rank r),
//   AIC:  h[rows, l, s*R : s*R + r] of every slice s is copied into L1 (one DMA per row and slice: any strides of
//         h, and never a column past the rank), then sgmv's expand (kernel_common.h ExpandStage): for every slice
//         and block of its columns, delta = h_s . B[l, block, :r]^T in fp32 -> workspace slot. A float32 h with a
//         16-bit B enters the cube as hi + lo halves, split from GM by the AIVs (kernel_common.h), one Mmad each;
//   AIVs: y[rows, block] += scale * lora_scales[l] * delta, in fp32, rounded once to y's dtype.
// A rank-0 slot is skipped by every core (its scale is never read). Every slice is handled in the one launch.
#include <type_traits>

#include "kernel_common.h"
#include "kernels.h"
#include "launch.h"

namespace lora_ops::ascend {
namespace {

// H: h's dtype, T: B's (the cube's operand type), Y: y's. H is T, or float with a 16-bit T (split into hi + lo).
template <typename H, typename T, typename Y>
class LoraExpandKernel {
  static constexpr bool kSplit = std::is_same_v<H, float> && !std::is_same_v<T, float>;
  static constexpr int kParts = kSplit ? 2 : 1;

 public:
  __aicore__ inline LoraExpandKernel(const LoraExpandTiling& t, GM_ADDR y, GM_ADDR h, GM_ADDR lora_b,
                                     GM_ADDR seg_indptr, GM_ADDR seg_lora, GM_ADDR token_indices, GM_ADDR lora_ranks,
                                     GM_ADDR lora_scales, GM_ADDR workspace, GM_ADDR split)
      : t_(t), y_(y), indptr_(seg_indptr), slots_(seg_lora), token_indices_(token_indices), ranks_(lora_ranks),
        scales_(lora_scales), workspace_(workspace), split_(split) {
    h_.SetGlobalBuffer(reinterpret_cast<__gm__ H*>(h));
    b_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(lora_b));
  }

  __aicore__ inline void RunCube() {
    const int64_t block = GetBlockIdx(), tile_rows = t_.tiles.tile_rows;
    const ExpandTiling& e = t_.expand;
    TPipe pipe;
    Cube<T> cube;
    cube.Init(pipe, tile_rows, /*k_chunk=*/0);
    ExpandStage<T, kParts, HardEvent::MTE2_MTE1> stage;
    stage.Init(pipe, cube, e, tile_rows);
    const SplitPlanes<T> planes(split_, block, t_.tiles);
    SlotWriter slots(workspace_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, tile_rows);
    while (walk.Next()) {
      const int64_t rank = SlotRank(ranks_, e, walk.slot);
      if (rank == 0) continue;
      const int64_t rank_pad = RoundUp(rank, kFrac);
      stage.BeginTile();
      if constexpr (kSplit) {
        CrossCoreWaitFlag(kSplitDoneFlag);  // the tile's h as hi and lo planes
        stage.CopyIn(cube, 0, planes.hi, walk.count, planes.ld, e, rank);
        stage.CopyIn(cube, 1, planes.lo, walk.count, planes.ld, e, rank);
      } else {
        for (int64_t s = 0; s < e.num_slices; ++s) {
          if (e.slice_offsets[s] == e.slice_offsets[s + 1]) continue;  // an empty slice needs no h
          cube.GatherToL1(cube.NzColumns(stage.h[0], s * rank_pad), SliceOfH(walk.slot, s), walk.rows, walk.count,
                          t_.h_row_stride, rank);
        }
      }
      stage.Expand(cube, slots, e, walk.count, b_[walk.slot * e.b_stride0], rank);
    }
    stage.Finish(pipe);
    slots.Drain();
  }

  __aicore__ inline void RunVector() {
    const int64_t block = GetBlockIdx() / GetSubBlockNum();
    const ExpandTiling& e = t_.expand;
    TPipe pipe;
    RowUpdater<Y> rows;
    rows.Init(pipe, workspace_, y_, t_.y_row_stride, block, t_.tiles);
    HiLoSplitter<T> splitter;
    if constexpr (kSplit) splitter.Init(pipe);
    const SplitPlanes<T> planes(split_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t rank = SlotRank(ranks_, e, walk.slot);
      if (rank == 0) continue;
      if constexpr (kSplit) {  // this AIV's rows of h, slice by slice, -> the hi and lo planes
        int32_t first, mine;
        rows.Share(walk.count, first, mine);
        for (int64_t s = 0; s < e.num_slices; ++s) {
          if (e.slice_offsets[s] == e.slice_offsets[s + 1]) continue;
          splitter.Split(planes.Columns(s * RoundUp(rank, kFrac)), SliceOfH(walk.slot, s), walk.rows,
                         t_.h_row_stride, first, mine, rank);
        }
        CrossCoreSetFlag<2, PIPE_MTE3>(kSplitDoneFlag);
      }
      ApplyExpand(rows, walk, e, t_.tiles.n_block, scales_);
    }
  }

 private:
  // h[:, slot, s*R:] as a matrix with h's row stride.
  __aicore__ inline GlobalTensor<H> SliceOfH(int64_t slot, int64_t s) const {
    return h_[slot * t_.h_slot_stride + s * t_.expand.max_rank];
  }

  const LoraExpandTiling& t_;
  // GM_ADDR is a pointer macro: one declarator each.
  GM_ADDR y_;
  GM_ADDR indptr_;
  GM_ADDR slots_;
  GM_ADDR token_indices_;
  GM_ADDR ranks_;
  GM_ADDR scales_;
  GM_ADDR workspace_;
  GM_ADDR split_;
  GlobalTensor<H> h_;
  GlobalTensor<T> b_;
};

}  // namespace
}  // namespace lora_ops::ascend

extern "C" __global__ __aicore__ void lora_ops_lora_expand(GM_ADDR y, GM_ADDR h, GM_ADDR lora_b, GM_ADDR seg_indptr,
                                                           GM_ADDR seg_lora, GM_ADDR token_indices,
                                                           GM_ADDR lora_ranks, GM_ADDR lora_scales,
                                                           GM_ADDR workspace, GM_ADDR split,
                                                           LoraOpsLoraExpandTiling tiling) {
  using namespace lora_ops::ascend;
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  RunForDtypes<LoraExpandKernel>(tiling, tiling.b_dtype, tiling.h_dtype, tiling.y_dtype, y, h, lora_b, seg_indptr,
                                 seg_lora, token_indices, lora_ranks, lora_scales, workspace, split);
}

namespace lora_ops::ascend {

uint32_t launch_lora_expand(const LoraExpandTiling& tiling, const LoraExpandBuffers& b, void* stream) {
  auto gm = [](const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); };
  return LORA_OPS_ASCEND_LAUNCH(lora_ops_lora_expand, KERNEL_TYPE_MIX_AIC_1_2, tiling.tiles.block_dim, stream, tiling,
                                gm(b.y), gm(b.h), gm(b.lora_b), gm(b.seg_indptr), gm(b.seg_lora), gm(b.token_indices),
                                gm(b.lora_ranks), gm(b.lora_scales), gm(b.workspace), gm(b.split));
}

}  // namespace lora_ops::ascend
