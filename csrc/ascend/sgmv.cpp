// sgmv on the cube unit (docs/design.md §2): for each tile of up to tile_rows rows of one segment (slot l, rank r),
//   AIC:  h = x[rows] . A[l, s*R : s*R + r]^T for every slice s, accumulated in fp32 in L0C and kept in L1 for the
//         expand, whose operands are x's dtype: for a half-precision y rounded once to x's dtype (below y's own
//         rounding), for a float32 y from 16-bit x as hi + lo halves (split by the AIVs, kernel_common.h), so that
//         h keeps ~2x x's precision; for a float32 x as fp32, through a per-block tile in GM (arch 2201's Fixpipe
//         cannot write fp32 into L1 in the cube's layout); then the expand lora_expand shares (kernel_common.h
//         ExpandStage): for every slice and block of its columns, delta = h_s . B[l, block, :r]^T in fp32 (one
//         Mmad per half) -> workspace slot;
//   AIVs: y[rows, block] += scale * lora_scales[l] * delta, in fp32, rounded once to y's dtype.
// Only the true rank is read and computed. Every slice is handled in the one launch.
#include <type_traits>

#include "kernel_common.h"
#include "kernels.h"
#include "launch.h"

namespace lora_ops::ascend {
namespace {

template <typename T, typename Y>
class SgmvKernel {
  // A float32 x: h stays fp32 (the cube takes fp32 operands), stored by Fixpipe to GM and copied back into L1.
  static constexpr bool kF32 = std::is_same_v<T, float>;
  // A float32 y from 16-bit x takes h as hi + lo halves, made by the AIVs from h in GM.
  static constexpr bool kSplit = std::is_same_v<Y, float> && !kF32;
  // h leaves L0C as fp32 rows in the block's source tile of the split workspace; its L1 copy is then written by
  // MTE2. Else Fixpipe rounds it into L1 itself.
  static constexpr bool kHViaGm = kSplit || kF32;
  static constexpr int kParts = kSplit ? 2 : 1;
  using Stage = ExpandStage<T, kParts, kHViaGm ? HardEvent::MTE2_MTE1 : HardEvent::FIX_MTE1>;

 public:
  __aicore__ inline SgmvKernel(const SgmvTiling& t, GM_ADDR y, GM_ADDR x, GM_ADDR lora_a, GM_ADDR lora_b,
                               GM_ADDR seg_indptr, GM_ADDR seg_lora, GM_ADDR token_indices, GM_ADDR lora_ranks,
                               GM_ADDR lora_scales, GM_ADDR workspace, GM_ADDR split)
      : t_(t), y_(y), indptr_(seg_indptr), slots_(seg_lora), token_indices_(token_indices), ranks_(lora_ranks),
        scales_(lora_scales), workspace_(workspace), split_(split) {
    x_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(x));
    a_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(lora_a));
    b_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(lora_b));
  }

  __aicore__ inline void RunCube() {
    const int64_t block = GetBlockIdx(), tile_rows = t_.tiles.tile_rows;
    TPipe pipe;
    Cube<T> cube;
    cube.Init(pipe, tile_rows, t_.tiles.k_chunk);
    Stage stage;  // the intermediate (h, or its hi and lo halves) in L1, and the expand
    stage.Init(pipe, cube, t_.expand, tile_rows);
    const SplitPlanes<T> planes(split_, block, t_.tiles);
    SlotWriter slots(workspace_, block, t_.tiles);
    // Fixpipe's store of the fp32 h -> MTE2's copy of it back into L1: same core, same GM, two pipes.
    TEventID h_stored = 0;
    if constexpr (kF32) h_stored = pipe.AllocEventID<HardEvent::FIX_MTE2>();
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, tile_rows);
    while (walk.Next()) {
      const int64_t rank = SlotRank(ranks_, t_.expand, walk.slot);
      if (rank == 0) continue;
      const int64_t m_pad = RoundUp(walk.count, kFrac), rank_pad = RoundUp(rank, kFrac);
      const int64_t h_cols = t_.expand.num_slices * rank_pad;
      stage.BeginTile();
      if constexpr (kHViaGm) {
        Shrink(cube, walk, planes.source, a_[walk.slot * t_.a_stride0], rank, rank_pad, m_pad);
      } else {
        Shrink(cube, walk, stage.h[0], a_[walk.slot * t_.a_stride0], rank, rank_pad, m_pad);
      }
      if constexpr (kSplit) {
        CrossCoreSetFlag<2, PIPE_FIX>(kSplitSourceFlag);
        CrossCoreWaitFlag(kSplitDoneFlag);
        cube.CopyToL1(stage.h[0], planes.hi, walk.count, planes.ld, h_cols);
        cube.CopyToL1(stage.h[1], planes.lo, walk.count, planes.ld, h_cols);
      }
      // The next tile's Fixpipe overwrites the source tile only after this copy-in: MTE2 -> MTE1 (the expand's
      // h_written) -> M -> FIX (the accumulator queue) orders it.
      if constexpr (kF32) {
        SetFlag<HardEvent::FIX_MTE2>(h_stored);
        WaitFlag<HardEvent::FIX_MTE2>(h_stored);
        stage.CopyIn(cube, 0, planes.source, walk.count, planes.ld, t_.expand, rank);
      }
      stage.Expand(cube, slots, t_.expand, walk.count, b_[walk.slot * t_.expand.b_stride0], rank);
    }
    stage.Finish(pipe);
    if constexpr (kF32) pipe.ReleaseEventID<HardEvent::FIX_MTE2>(h_stored);
    slots.Drain();
  }

  __aicore__ inline void RunVector() {
    const int64_t block = GetBlockIdx() / GetSubBlockNum();
    TPipe pipe;
    RowUpdater<Y> rows;
    rows.Init(pipe, workspace_, y_, t_.y_row_stride, block, t_.tiles);
    HiLoSplitter<T> splitter;
    if constexpr (kSplit) splitter.Init(pipe);
    const SplitPlanes<T> planes(split_, block, t_.tiles);
    TileWalk walk(indptr_, slots_, token_indices_, t_.seg, block, t_.tiles.block_dim, t_.tiles.tile_rows);
    while (walk.Next()) {
      const int64_t rank = SlotRank(ranks_, t_.expand, walk.slot);
      if (rank == 0) continue;
      if constexpr (kSplit) {
        int32_t first, mine;
        rows.Share(walk.count, first, mine);
        CrossCoreWaitFlag(kSplitSourceFlag);
        splitter.Split(planes, planes.source, nullptr, planes.ld, first, mine,
                       t_.expand.num_slices * RoundUp(rank, kFrac));
        CrossCoreSetFlag<2, PIPE_MTE3>(kSplitDoneFlag);
      }
      ApplyExpand(rows, walk, t_.expand, t_.tiles.n_block, scales_);
    }
  }

 private:
  // h[:, s * rank_pad + j] = x[rows] . A[s * R + j]^T for j < rank, in passes of group_cols columns of L0C, each
  // stored by Fixpipe: rounded to T into L1 (NZ), or as fp32 rows into the block's source tile in GM.
  template <class H>
  __aicore__ inline void Shrink(Cube<T>& cube, const TileWalk& walk, const H& h, const GlobalTensor<T>& a,
                                int64_t rank, int64_t rank_pad, int64_t m_pad) {
    const int64_t h_cols = t_.expand.num_slices * rank_pad;
    for (int64_t c0 = 0; c0 < h_cols; c0 += t_.group_cols) {
      const int64_t c1 = Min(c0 + t_.group_cols, h_cols);
      LocalTensor<float> acc = cube.AllocAcc();
      for (int64_t k0 = 0; k0 < t_.k; k0 += t_.tiles.k_chunk) {
        const int64_t k_len = Min(t_.tiles.k_chunk, t_.k - k0);
        LocalTensor<T> xa = cube.LoadRows(x_, walk.rows, walk.count, t_.x_row_stride, k0, k_len);
        for (int64_t s = c0 / rank_pad; s * rank_pad < c1; ++s) {
          if (t_.expand.slice_offsets[s] == t_.expand.slice_offsets[s + 1]) continue;  // an empty slice needs no h
          const int64_t j0 = Max(c0 - s * rank_pad, 0), j1 = Min(Min(c1 - s * rank_pad, rank_pad), rank);
          for (int64_t p0 = j0; p0 < j1; p0 += t_.part_cols) {
            const int64_t cols = Min(t_.part_cols, j1 - p0);
            LocalTensor<T> wb = cube.LoadWeight(a, s * t_.expand.max_rank + p0, cols, t_.a_stride1, k0, k_len);
            cube.Mmad(acc[(s * rank_pad + p0 - c0) / kFrac * m_pad * kFrac], xa, wb, m_pad, cols, k_len, k0 > 0);
            cube.FreeRight(wb);
          }
        }
        cube.FreeLeft(xa);
      }
      acc = cube.Finish(acc);
      if constexpr (kHViaGm) {
        Fixpipe(h[c0], acc,
                FixpipeParamsV220{static_cast<uint16_t>(c1 - c0), static_cast<uint16_t>(walk.count),
                                  static_cast<uint16_t>(m_pad), static_cast<uint32_t>(t_.tiles.split_ld), false,
                                  QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
      } else {
        constexpr QuantMode_t to_t = std::is_same_v<T, half> ? QuantMode_t::F322F16 : QuantMode_t::F322BF16;
        Fixpipe<T, float, CFG_NZ>(cube.NzColumns(h, c0), acc,
                                  FixpipeParamsV220{static_cast<uint16_t>(c1 - c0), static_cast<uint16_t>(m_pad),
                                                    static_cast<uint16_t>(m_pad),
                                                    static_cast<uint32_t>(t_.tiles.tile_rows), false, to_t, 0, 1, 0,
                                                    0, 0});
      }
      cube.FreeAcc(acc);
    }
  }

  const SgmvTiling& t_;
  // GM_ADDR is a pointer macro: one declarator each.
  GM_ADDR y_;
  GM_ADDR indptr_;
  GM_ADDR slots_;
  GM_ADDR token_indices_;
  GM_ADDR ranks_;
  GM_ADDR scales_;
  GM_ADDR workspace_;
  GM_ADDR split_;
  GlobalTensor<T> x_, a_, b_;
};

template <typename T, typename Y>
__aicore__ inline void RunSgmv(const SgmvTiling& t, GM_ADDR y, GM_ADDR x, GM_ADDR lora_a, GM_ADDR lora_b,
                               GM_ADDR seg_indptr, GM_ADDR seg_lora, GM_ADDR token_indices, GM_ADDR lora_ranks,
                               GM_ADDR lora_scales, GM_ADDR workspace, GM_ADDR split) {
  SgmvKernel<T, Y> kernel(t, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                          workspace, split);
  RunOnCores(kernel);
}

}  // namespace
}  // namespace lora_ops::ascend

extern "C" __global__ __aicore__ void lora_ops_sgmv(GM_ADDR y, GM_ADDR x, GM_ADDR lora_a, GM_ADDR lora_b,
                                                    GM_ADDR seg_indptr, GM_ADDR seg_lora, GM_ADDR token_indices,
                                                    GM_ADDR lora_ranks, GM_ADDR lora_scales, GM_ADDR workspace,
                                                    GM_ADDR split, LoraOpsSgmvTiling tiling) {
  using namespace lora_ops::ascend;
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  const bool f32_y = tiling.y_dtype == kFloat;
  if (tiling.x_dtype == kFloat) {  // y is float32 too (the contract: y is x's dtype or float32)
    RunSgmv<float, float>(tiling, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                          workspace, split);
  } else if (tiling.x_dtype == kHalf) {
    f32_y ? RunSgmv<half, float>(tiling, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks,
                                 lora_scales, workspace, split)
          : RunSgmv<half, half>(tiling, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks,
                                lora_scales, workspace, split);
  } else {
    f32_y ? RunSgmv<bfloat16_t, float>(tiling, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices,
                                       lora_ranks, lora_scales, workspace, split)
          : RunSgmv<bfloat16_t, bfloat16_t>(tiling, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices,
                                            lora_ranks, lora_scales, workspace, split);
  }
}

namespace lora_ops::ascend {

uint32_t launch_sgmv(const SgmvTiling& tiling, const SgmvBuffers& b, void* stream) {
  auto gm = [](const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); };
  return LORA_OPS_ASCEND_LAUNCH(lora_ops_sgmv, KERNEL_TYPE_MIX_AIC_1_2, tiling.tiles.block_dim, stream, tiling, gm(b.y),
                                gm(b.x), gm(b.lora_a), gm(b.lora_b), gm(b.seg_indptr), gm(b.seg_lora),
                                gm(b.token_indices), gm(b.lora_ranks), gm(b.lora_scales), gm(b.workspace), gm(b.split));
}

}  // namespace lora_ops::ascend
