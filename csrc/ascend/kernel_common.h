// Device code shared by the AscendC matmul kernels (sgmv, lora_expand, grouped_gemm): the tile walk over untrusted
// segment metadata, the cube staging path (GM -> L1 (NZ) -> L0A/L0B -> Mmad), the expand stage of sgmv and
// lora_expand, and the vector update of y rows.
//
// A MIX kernel runs one AIC and two AIVs per block. Both walk the same tiles in the same order: the AIC computes an
// output block of tile_rows x n_block floats into one of its two workspace slots and raises kReady[slot]; each AIV
// waits on it, reads its half of the rows, raises kFree[slot] once its reads are done, and adds the block into y.
//
// The cube's two operands share one type. An fp32 left operand (sgmv's h for a float32 y, grouped_gemm's float32
// x with a 16-bit w, lora_expand's float32 h with a 16-bit B) is split by the AIVs into hi = T(v) and
// lo = T(v - hi), each AIV its half of the tile's rows, into the block's split planes in GM (kSplitDone); the AIC
// multiplies both by the same right operand into one fp32 accumulator, so the product keeps ~16 (bf16) or ~22
// (fp16) bits of v instead of T's 8 or 11. sgmv's h is born on the AIC: it goes to the AIVs first, as fp32 in the
// split workspace (kSplitSource).
#pragma once
#include <type_traits>

#include "kernel_operator.h"
#include "tiling.h"

namespace lora_ops::ascend {

using namespace AscendC;

constexpr uint16_t kReadyFlag = 0;  // + slot: AIC -> AIVs, the slot holds a block
constexpr uint16_t kFreeFlag = 2;   // + slot: AIVs -> AIC, the slot was read
constexpr uint16_t kSplitSourceFlag = 4;  // AIC -> AIVs: the fp32 source tile is in the split workspace
constexpr uint16_t kSplitDoneFlag = 5;    // AIVs -> AIC: the hi and lo planes are written
constexpr int64_t kFrac = 16;       // fractal rows

__aicore__ inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }
__aicore__ inline int64_t Max(int64_t a, int64_t b) { return a > b ? a : b; }
__aicore__ inline int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }
__aicore__ inline int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
__aicore__ inline int64_t CeilDiv(int64_t v, int64_t m) { return (v + m - 1) / m; }

// A MIX kernel's two sides: the AI cube core runs kernel.RunCube(), each AI vector core kernel.RunVector().
template <class Kernel>
__aicore__ inline void RunOnCores(Kernel& kernel) {
  if ASCEND_IS_AIC {
    kernel.RunCube();
  }
  if ASCEND_IS_AIV {
    kernel.RunVector();
  }
}

// Kernel<L, T, Y>(t, gm...) on both sides of a MIX kernel.
template <template <typename, typename, typename> class Kernel, typename L, typename T, typename Y, class Tiling,
          class... Gm>
__aicore__ inline void RunKernel(const Tiling& t, Gm... gm) {
  Kernel<L, T, Y> kernel(t, gm...);
  RunOnCores(kernel);
}

// A 16-bit T: L and Y each T or float32.
template <template <typename, typename, typename> class Kernel, typename T, class Tiling, class... Gm>
__aicore__ inline void RunForHalfOperand(const Tiling& t, bool f32_left, bool f32_y, Gm... gm) {
  if (f32_left) {
    f32_y ? RunKernel<Kernel, float, T, float>(t, gm...) : RunKernel<Kernel, float, T, T>(t, gm...);
  } else {
    f32_y ? RunKernel<Kernel, T, T, float>(t, gm...) : RunKernel<Kernel, T, T, T>(t, gm...);
  }
}

// Kernel<L, T, Y> (T: the cube's operand type, L: its left operand's, Y: y's) for the dtypes a matmul with an
// optional hi + lo split takes: a 16-bit T with L and Y each T or float32 (a float32 L enters the cube as hi + lo
// halves of T), else all float32. The dtypes are DTypeCode; gm are the kernel's GM arguments after the tiling.
template <template <typename, typename, typename> class Kernel, class Tiling, class... Gm>
__aicore__ inline void RunForDtypes(const Tiling& t, uint32_t operand_dtype, uint32_t left_dtype, uint32_t y_dtype,
                                    Gm... gm) {
  const bool f32_left = left_dtype == kFloat, f32_y = y_dtype == kFloat;
  if (operand_dtype == kHalf) {
    RunForHalfOperand<Kernel, half>(t, f32_left, f32_y, gm...);
  } else if (operand_dtype == kBf16) {
    RunForHalfOperand<Kernel, bfloat16_t>(t, f32_left, f32_y, gm...);
  } else {
    RunKernel<Kernel, float, float, float>(t, gm...);
  }
}

template <typename T>
constexpr int64_t C0 = 32 / sizeof(T);  // elements per 32-byte fractal row

// A size from a per-slot table clamped to [0, full]; `full` without a table (docs/design.md §2).
__aicore__ inline int64_t SlotSize(GM_ADDR table, bool present, int64_t slot, int64_t full) {
  if (!present) return full;
  GlobalTensor<int32_t> t;
  t.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(table));
  return Clamp(t.GetValue(slot), 0, full);
}

// The tiles of one block: segments with a slot in [0, L), cut into tiles of tile_rows positions, dealt round-robin
// to the blocks. seg_indptr is clamped to [0, positions] and made non-decreasing by a running maximum; rows outside
// [0, T) are dropped. Every core of a block walks the same tiles.
class TileWalk {
 public:
  __aicore__ inline TileWalk(GM_ADDR seg_indptr, GM_ADDR seg_slot, GM_ADDR token_indices, const SegmentShape& seg,
                             int64_t block, int64_t num_blocks, int64_t tile_rows)
      : seg_(seg), block_(block), num_blocks_(num_blocks), tile_rows_(tile_rows) {
    indptr_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(seg_indptr));
    slots_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(seg_slot));
    if (seg.gathered) token_indices_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(token_indices));
    seg_end_ = Clamp(indptr_.GetValue(0), 0, seg.positions);
    pos_ = seg_end_;
  }

  // Moves to this block's next tile with at least one valid row: fills slot, count and rows[0, count).
  __aicore__ inline bool Next() {
    for (;;) {
      if (slot >= 0 && pos_ < seg_end_) {
        const int64_t first = pos_, last = Min(pos_ + tile_rows_, seg_end_);
        pos_ = last;
        if (tile_index_++ % num_blocks_ != block_) continue;
        count = 0;
        for (int64_t p = first; p < last; ++p) {
          const int64_t row = seg_.gathered ? int64_t(token_indices_.GetValue(p)) : p;
          if (row >= 0 && row < seg_.rows) rows[count++] = static_cast<int32_t>(row);
        }
        if (count > 0) return true;
        continue;
      }
      if (segment_ + 1 >= seg_.num_segments) return false;
      ++segment_;
      pos_ = seg_end_;
      seg_end_ = Max(seg_end_, Clamp(indptr_.GetValue(segment_ + 1), 0, seg_.positions));
      const int64_t s = slots_.GetValue(segment_);
      slot = (s >= 0 && s < seg_.num_slots) ? s : -1;
    }
  }

  int64_t slot = -1;
  int32_t count = 0;
  int32_t rows[kMaxTileRows];

 private:
  SegmentShape seg_;
  int64_t block_, num_blocks_, tile_rows_;
  GlobalTensor<int32_t> indptr_, slots_, token_indices_;
  int64_t segment_ = -1, seg_end_ = 0, pos_ = 0, tile_index_ = 0;
};

// The AIC's staging buffers and the moves between them. NZ layouts in L1 keep `tile_rows` (x, the intermediate) or
// round16(rows) (weights) rows per 16-column group; Mmad reads L0A as Zz and L0B as Zn.
template <typename T>
class Cube {
 public:
  // k_chunk 0: no left operand is staged from GM rows (LoadRows unused; lora_expand keeps its h in L1 itself).
  __aicore__ inline void Init(TPipe& pipe, int64_t tile_rows, int64_t k_chunk) {
    tile_rows_ = tile_rows;
    if (k_chunk > 0) pipe.InitBuffer(x_l1_, 2, tile_rows * k_chunk * sizeof(T));
    pipe.InitBuffer(w_l1_, 2, kL0BStage);
    pipe.InitBuffer(a_l0_, 2, kL0AStage);
    pipe.InitBuffer(b_l0_, 2, kL0BStage);
    pipe.InitBuffer(c_l0_, 2, kL0CStage);
    // Rows past a tile's last row and columns past a weight's last row still enter the cube as fractal padding:
    // keep them finite (stale L1 could hold NaN patterns, which Mmad must not be fed).
    if (k_chunk > 0) ZeroQueue(x_l1_, tile_rows * k_chunk);
    ZeroQueue(w_l1_, kL0BStage / sizeof(T));
    PipeBarrier<PIPE_MTE2>();
  }

  // Rows rows[0, count) (rows 0, 1, ... when rows is null) of a [*, row_stride] GM matrix, columns
  // [k0, k0 + k_len), into L0A as the left operand.
  __aicore__ inline LocalTensor<T> LoadRows(const GlobalTensor<T>& gm, const int32_t* rows, int32_t count,
                                            int64_t row_stride, int64_t k0, int64_t k_len) {
    LocalTensor<T> l1 = x_l1_.template AllocTensor<T>();
    GatherToL1(l1, gm[k0], rows, count, row_stride, k_len);
    x_l1_.EnQue(l1);
    l1 = x_l1_.template DeQue<T>();
    LocalTensor<T> a = ToLeft(l1, 0, CeilDiv(count, kFrac), CeilDiv(k_len, C0<T>));
    x_l1_.FreeTensor(l1);
    return a;
  }

  // Rows rows[0, count) (rows 0, 1, ... when rows is null) of a [*, row_stride] GM matrix, columns [0, cols), into
  // an L1 tensor as NZ with tile_rows rows per column group (rows past count keep what they held; columns past cols
  // up to the next C0 are zeroed). One DMA per run of consecutive rows (a segment's positions mostly are: one DMA
  // for a prefill tile instead of one a row), one a row where the stride is not a DMA's source stride (Nd2Nz's
  // srcDValue: cols to 65535 elements), so any row stride.
  __aicore__ inline void GatherToL1(const LocalTensor<T>& l1, const GlobalTensor<T>& gm, const int32_t* rows,
                                    int32_t count, int64_t row_stride, int64_t cols) {
    const bool runs = row_stride >= cols && row_stride <= kNd2NzMaxStride;
    for (int32_t i = 0, run = 1; i < count; i += run) {
      const int64_t first = rows != nullptr ? rows[i] : i;
      run = 1;
      while (runs && i + run < count && (rows == nullptr || rows[i + run] == first + run)) ++run;
      DataCopy(l1[i * C0<T>], gm[first * row_stride],
               Nd2NzParams{1, static_cast<uint16_t>(run), static_cast<uint16_t>(cols), 0,
                           static_cast<uint16_t>(runs ? row_stride : cols), static_cast<uint16_t>(tile_rows_), 1, 0});
    }
  }

  // Rows [0, count) of a [*, row_stride] GM matrix, columns [0, cols), into an L1 tensor as NZ with tile_rows rows
  // per column group (one DMA; rows past count keep what they held).
  __aicore__ inline void CopyToL1(const LocalTensor<T>& l1, const GlobalTensor<T>& gm, int32_t count,
                                  int64_t row_stride, int64_t cols) {
    DataCopy(l1, gm,
             Nd2NzParams{1, static_cast<uint16_t>(count), static_cast<uint16_t>(cols), 0,
                         static_cast<uint16_t>(row_stride), static_cast<uint16_t>(tile_rows_), 1, 0});
  }

  // An NZ matrix in L1 with tile_rows rows per column group, from its column col0 (a multiple of C0) on.
  __aicore__ inline LocalTensor<T> NzColumns(const LocalTensor<T>& l1, int64_t col0) const {
    return l1[col0 / C0<T> * tile_rows_ * C0<T>];
  }

  // Columns [col0, col0 + k_len) of an NZ matrix held in L1 with tile_rows rows per column group, into L0A.
  __aicore__ inline LocalTensor<T> LoadLeftFromL1(const LocalTensor<T>& l1, int64_t col0, int32_t count,
                                                  int64_t k_len) {
    return ToLeft(l1, col0, CeilDiv(count, kFrac), CeilDiv(k_len, C0<T>));
  }

  // Rows [row0, row0 + n_rows) of a GM matrix with row_stride, columns [k0, k0 + k_len), into L0B as the right
  // operand of x * W^T (W in nn.Linear layout: its rows are the output columns).
  __aicore__ inline LocalTensor<T> LoadWeight(const GlobalTensor<T>& gm, int64_t row0, int64_t n_rows,
                                              int64_t row_stride, int64_t k0, int64_t k_len) {
    const int64_t n_pad = RoundUp(n_rows, kFrac);
    LocalTensor<T> l1 = w_l1_.template AllocTensor<T>();
    DataCopy(l1, gm[row0 * row_stride + k0],
             Nd2NzParams{1, static_cast<uint16_t>(n_rows), static_cast<uint16_t>(k_len), 0,
                         static_cast<uint16_t>(n_rows > 1 ? row_stride : k_len), static_cast<uint16_t>(n_pad), 1, 0});
    w_l1_.EnQue(l1);
    l1 = w_l1_.template DeQue<T>();
    LocalTensor<T> b = b_l0_.template AllocTensor<T>();
    // W's NZ fractals (n, k) are already B = W^T's Zn fractals, in the same order: a plain fractal copy.
    const int64_t n_frac = n_pad / kFrac, k_frac = CeilDiv(k_len, C0<T>);
    for (int64_t kb = 0; kb < k_frac; ++kb) {
      LoadData(b[kb * n_frac * kFracElems], l1[kb * n_frac * kFracElems],
               LoadData2DParams{0, static_cast<uint8_t>(n_frac), 1, 0, 0, false, 0});
    }
    b_l0_.EnQue(b);
    w_l1_.FreeTensor(l1);
    return b_l0_.template DeQue<T>();
  }

  // C (+)= A * B over an m x n tile; small tiles need a PIPE_M barrier before accumulating (Mmad docs).
  __aicore__ inline void Mmad(const LocalTensor<float>& c, const LocalTensor<T>& a, const LocalTensor<T>& b, int64_t m,
                              int64_t n, int64_t k, bool accumulate) {
    if (accumulate && (m / 16) * (n / 16) < 10) PipeBarrier<PIPE_M>();
    AscendC::Mmad(c, a, b, MmadParams{static_cast<uint16_t>(m), static_cast<uint16_t>(n), static_cast<uint16_t>(k),
                                      0, false, !accumulate});
  }

  __aicore__ inline void FreeLeft(LocalTensor<T>& a) { a_l0_.FreeTensor(a); }
  __aicore__ inline void FreeRight(LocalTensor<T>& b) { b_l0_.FreeTensor(b); }
  __aicore__ inline LocalTensor<float> AllocAcc() { return c_l0_.template AllocTensor<float>(); }
  // Hands an accumulator from the cube (M) to Fixpipe (FIX).
  __aicore__ inline LocalTensor<float> Finish(LocalTensor<float>& c) {
    c_l0_.EnQue(c);
    return c_l0_.template DeQue<float>();
  }
  __aicore__ inline void FreeAcc(LocalTensor<float>& c) { c_l0_.FreeTensor(c); }

  // elems elements of an L1 tensor = 0 (MTE2; the caller orders later MTE2 writes after it).
  __aicore__ inline void ZeroL1(const LocalTensor<T>& t, int64_t elems) {
    Fill(t, InitConstValueParams<T>{1, static_cast<uint16_t>(elems * sizeof(T) / 32), 0, T(0)});
  }

  static constexpr int64_t kFracElems = 512 / sizeof(T);

 private:
  template <class Q>
  __aicore__ inline void ZeroQueue(Q& que, int64_t elems) {
    LocalTensor<T> t0 = que.template AllocTensor<T>();
    LocalTensor<T> t1 = que.template AllocTensor<T>();
    ZeroL1(t0, elems);
    ZeroL1(t1, elems);
    que.FreeTensor(t0);
    que.FreeTensor(t1);
  }

  // NZ (tile_rows rows per column group) starting at column col0 -> Zz in L0A: one LoadData per 16-row band.
  __aicore__ inline LocalTensor<T> ToLeft(const LocalTensor<T>& l1, int64_t col0, int64_t m_frac, int64_t k_frac) {
    LocalTensor<T> a = a_l0_.template AllocTensor<T>();
    const LocalTensor<T> from = NzColumns(l1, col0);
    for (int64_t mb = 0; mb < m_frac; ++mb) {
      LoadData(a[mb * k_frac * kFracElems], from[mb * kFracElems],
               LoadData2DParams{0, static_cast<uint8_t>(k_frac), static_cast<uint16_t>(tile_rows_ / kFrac), 0, 0,
                                false, 0});
    }
    a_l0_.EnQue(a);
    return a_l0_.template DeQue<T>();
  }

  int64_t tile_rows_ = 0;
  TQue<TPosition::A1, 1> x_l1_;
  TQue<TPosition::B1, 1> w_l1_;
  TQue<TPosition::A2, 1> a_l0_;
  TQue<TPosition::B2, 1> b_l0_;
  TQue<TPosition::CO1, 1> c_l0_;
};

// The AIC side of the workspace hand-off: two slots per block, reused once both AIVs freed them.
class SlotWriter {
 public:
  __aicore__ inline SlotWriter(GM_ADDR workspace, int64_t block, const MatmulTiles& tiles)
      : slot_elems_(int64_t(tiles.tile_rows) * tiles.n_block), n_block_(tiles.n_block) {
    ws_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(workspace) + block * 2 * slot_elems_);
  }

  // Writes rows [0, count) x columns [0, n) of the accumulator (m_pad rows in L0C) and hands them to the AIVs.
  __aicore__ inline void Write(const LocalTensor<float>& c, int32_t count, int64_t m_pad, int64_t n) {
    if (used_[slot_]) CrossCoreWaitFlag(kFreeFlag + slot_);
    used_[slot_] = true;
    Fixpipe(ws_[slot_ * slot_elems_], c,
            FixpipeParamsV220{static_cast<uint16_t>(n), static_cast<uint16_t>(count), static_cast<uint16_t>(m_pad),
                              static_cast<uint32_t>(n_block_), false, QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
    CrossCoreSetFlag<2, PIPE_FIX>(kReadyFlag + slot_);
    slot_ ^= 1;
  }

  // Output columns per slot.
  __aicore__ inline int64_t n_block() const { return n_block_; }

  // Waits for the AIVs' last reads, so that every flag raised is consumed before the kernel ends.
  __aicore__ inline void Drain() {
    for (int s = 0; s < 2; ++s) {
      if (used_[s]) CrossCoreWaitFlag(kFreeFlag + s);
    }
  }

 private:
  GlobalTensor<float> ws_;
  int64_t slot_elems_, n_block_;
  int slot_ = 0;
  bool used_[2] = {false, false};
};

// The AIV side: reads its half of a slot's rows, then updates those rows of y:
// y = (accumulate ? y : 0) + coef * block, in float, rounded once to y's dtype.
template <typename Y>
class RowUpdater {
 public:
  __aicore__ inline void Init(TPipe& pipe, GM_ADDR workspace, GM_ADDR y, int64_t y_row_stride, int64_t block,
                              const MatmulTiles& tiles) {
    slot_elems_ = int64_t(tiles.tile_rows) * tiles.n_block;
    n_block_ = tiles.n_block;
    ws_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(workspace) + block * 2 * slot_elems_);
    y_.SetGlobalBuffer(reinterpret_cast<__gm__ Y*>(y));
    y_row_stride_ = y_row_stride;
    const int64_t half_rows = CeilDiv(tiles.tile_rows, 2);
    pipe.InitBuffer(delta_, 1, half_rows * tiles.n_block * sizeof(float));
    pipe.InitBuffer(y_in_, 1, half_rows * tiles.n_block * sizeof(Y));
    pipe.InitBuffer(y_out_, 1, half_rows * tiles.n_block * sizeof(Y));
    if constexpr (!std::is_same_v<Y, float>) pipe.InitBuffer(acc_, half_rows * tiles.n_block * sizeof(float));
  }

  // This AIV's share of a tile's rows: the first half (rounded up) for sub-block 0, the rest for sub-block 1.
  __aicore__ inline void Share(int32_t count, int32_t& first, int32_t& mine) const {
    const int32_t half = (count + 1) / 2;
    first = GetSubBlockIdx() == 0 ? 0 : half;
    mine = GetSubBlockIdx() == 0 ? half : count - half;
  }

  // Consumes the next slot: rows[first, first + mine) of the tile's block of columns [n0, n0 + n) of y.
  __aicore__ inline void Apply(const int32_t* rows, int32_t count, int64_t n0, int64_t n, float coef,
                               bool accumulate) {
    int32_t first, mine;
    Share(count, first, mine);
    const int64_t pitch = RoundUp(n, kFrac);  // UB row pitch: 32-byte aligned for float and 16-bit rows
    if (accumulate && mine > 0) LoadY(rows + first, mine, n0, n, pitch);  // while the AIC may still compute
    CrossCoreWaitFlag(kReadyFlag + slot_);
    LocalTensor<float> d;
    if (mine > 0) {
      d = delta_.AllocTensor<float>();
      const uint32_t row_bytes = static_cast<uint32_t>(n * sizeof(float));
      DataCopyPad(d, ws_[slot_ * slot_elems_ + first * n_block_],
                  DataCopyExtParams{static_cast<uint16_t>(mine), row_bytes,
                                    static_cast<uint32_t>((n_block_ - n) * sizeof(float)),
                                    static_cast<uint32_t>((pitch - RoundUp(n, 8)) / 8), 0},
                  DataCopyPadExtParams<float>{false, 0, 0, 0.f});
      delta_.EnQue(d);
    }
    CrossCoreSetFlag<2, PIPE_MTE2>(kFreeFlag + slot_);
    slot_ ^= 1;
    if (mine == 0) return;
    d = delta_.DeQue<float>();
    LocalTensor<Y> out = y_out_.AllocTensor<Y>();
    const int32_t elems = static_cast<int32_t>(mine * pitch);
    if constexpr (std::is_same_v<Y, float>) {
      if (accumulate) {
        Muls(d, d, coef, elems);
        LocalTensor<float> y = y_in_.DeQue<float>();
        Add(out, y, d, elems);
        y_in_.FreeTensor(y);
      } else {
        Muls(out, d, coef, elems);
      }
    } else {
      Muls(d, d, coef, elems);
      if (accumulate) {
        LocalTensor<float> acc = acc_.Get<float>();
        LocalTensor<Y> y = y_in_.DeQue<Y>();
        Cast(acc, y, RoundMode::CAST_NONE, elems);
        y_in_.FreeTensor(y);
        Add(acc, acc, d, elems);
        Cast(out, acc, RoundMode::CAST_RINT, elems);
      } else {
        Cast(out, d, RoundMode::CAST_RINT, elems);
      }
    }
    delta_.FreeTensor(d);
    StoreY(out, rows + first, mine, n0, n, pitch);
  }

  // y rows [n0, n0 + n) = 0, without a workspace block (an empty reduction with accumulate = false).
  __aicore__ inline void Zero(const int32_t* rows, int32_t count, int64_t n0, int64_t n) {
    int32_t first, mine;
    Share(count, first, mine);
    if (mine == 0) return;
    const int64_t pitch = RoundUp(n, kFrac);
    LocalTensor<Y> out = y_out_.AllocTensor<Y>();
    Duplicate(out, Y(0.f), static_cast<int32_t>(mine * pitch));
    StoreY(out, rows + first, mine, n0, n, pitch);
  }

 private:
  __aicore__ inline void LoadY(const int32_t* rows, int32_t count, int64_t n0, int64_t n, int64_t pitch) {
    LocalTensor<Y> y = y_in_.AllocTensor<Y>();
    for (int32_t i = 0; i < count; ++i) {
      DataCopyPad(y[i * pitch], y_[rows[i] * y_row_stride_ + n0],
                  DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(Y)), 0, 0, 0},
                  DataCopyPadExtParams<Y>{false, 0, 0, Y(0.f)});
    }
    y_in_.EnQue(y);
  }

  __aicore__ inline void StoreY(LocalTensor<Y>& out, const int32_t* rows, int32_t count, int64_t n0, int64_t n,
                                int64_t pitch) {
    y_out_.EnQue(out);
    out = y_out_.DeQue<Y>();
    for (int32_t i = 0; i < count; ++i) {
      DataCopyPad(y_[rows[i] * y_row_stride_ + n0], out[i * pitch],
                  DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(Y)), 0, 0, 0});
    }
    y_out_.FreeTensor(out);
  }

  GlobalTensor<float> ws_;
  GlobalTensor<Y> y_;
  int64_t slot_elems_ = 0, n_block_ = 0, y_row_stride_ = 0;
  int slot_ = 0;
  TQue<TPosition::VECIN, 1> delta_, y_in_;
  TQue<TPosition::VECOUT, 1> y_out_;
  TBuf<TPosition::VECCALC> acc_;
};

// One block's part of the split workspace: for a 16-bit T, the hi and lo planes (tile_rows x split_ld of T each),
// then the fp32 source tile (tile_rows x split_ld floats; sgmv only). An fp32 T is never split: the block holds the
// source tile alone (sgmv's fp32 h on its way from L0C back into L1), and hi and lo are not used.
template <typename T>
struct SplitPlanes {
  static constexpr int64_t kPlanes = sizeof(T) == 2 ? 2 : 0;

  __aicore__ inline SplitPlanes(GM_ADDR split, int64_t block, const MatmulTiles& tiles) : ld(tiles.split_ld) {
    const int64_t plane = int64_t(tiles.tile_rows) * ld;  // 16-bit elements
    __gm__ uint16_t* base = reinterpret_cast<__gm__ uint16_t*>(split) + block * tiles.split_block_elems;
    hi.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(base));
    lo.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(base + plane));
    source.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(base + kPlanes * plane));
  }
  // The planes from column c0 on (the source tile is not moved).
  __aicore__ inline SplitPlanes Columns(int64_t c0) const {
    SplitPlanes shifted = *this;
    shifted.hi = hi[c0];
    shifted.lo = lo[c0];
    return shifted;
  }
  int64_t ld;
  GlobalTensor<T> hi, lo;
  GlobalTensor<float> source;
};

// The AIV side of the split: rows of an fp32 GM matrix -> hi = T(v), lo = T(v - float(hi)) in the split planes.
// v - float(hi) is exact in fp32, so hi + lo is v to ~2x T's precision. An fp16 hi overflows beyond 65504 (as in
// the CUDA and Triton kernels); bf16 has fp32's range.
template <typename T>
class HiLoSplitter {
 public:
  __aicore__ inline void Init(TPipe& pipe) {
    pipe.InitBuffer(in_, 1, kSplitElems * sizeof(float));
    pipe.InitBuffer(hi_, 1, kSplitElems * sizeof(T));
    pipe.InitBuffer(lo_, 1, kSplitElems * sizeof(T));
    pipe.InitBuffer(wide_, kSplitElems * sizeof(float));
  }

  // Plane rows [first, first + mine), columns [0, cols): plane row d comes from row src_rows[d] (d when src_rows is
  // null) of src, a matrix with src_row_stride.
  __aicore__ inline void Split(const SplitPlanes<T>& planes, const GlobalTensor<float>& src, const int32_t* src_rows,
                               int64_t src_row_stride, int32_t first, int32_t mine, int64_t cols) {
    const int64_t width = Min(RoundUp(cols, kFrac), kSplitElems);  // UB row pitch: 32-byte aligned T rows
    const int32_t rows_per_pass = static_cast<int32_t>(kSplitElems / width);
    for (int64_t c0 = 0; c0 < cols; c0 += width) {
      const int64_t len = Min(width, cols - c0);
      for (int32_t r0 = first; r0 < first + mine; r0 += rows_per_pass) {
        const int32_t n = static_cast<int32_t>(Min(rows_per_pass, first + mine - r0));
        LocalTensor<float> in = in_.AllocTensor<float>();
        for (int32_t i = 0; i < n; ++i) {
          const int64_t row = src_rows != nullptr ? src_rows[r0 + i] : r0 + i;
          DataCopyPad(in[i * width], src[row * src_row_stride + c0],
                      DataCopyExtParams{1, static_cast<uint32_t>(len * sizeof(float)), 0, 0, 0},
                      DataCopyPadExtParams<float>{false, 0, 0, 0.f});
        }
        in_.EnQue(in);
        in = in_.DeQue<float>();
        const int32_t elems = static_cast<int32_t>(n * width);
        LocalTensor<T> hi = hi_.AllocTensor<T>();
        LocalTensor<T> lo = lo_.AllocTensor<T>();
        LocalTensor<float> wide = wide_.Get<float>();
        Cast(hi, in, RoundMode::CAST_RINT, elems);
        Cast(wide, hi, RoundMode::CAST_NONE, elems);
        Sub(wide, in, wide, elems);
        Cast(lo, wide, RoundMode::CAST_RINT, elems);
        in_.FreeTensor(in);
        Store(hi_, hi, planes.hi, planes.ld, r0, n, c0, len, width);
        Store(lo_, lo, planes.lo, planes.ld, r0, n, c0, len, width);
      }
    }
  }

 private:
  // n rows of len elements (UB pitch width) -> plane rows [r0, r0 + n), columns [c0, c0 + len): one DMA.
  __aicore__ inline void Store(TQue<TPosition::VECOUT, 1>& que, LocalTensor<T>& t, const GlobalTensor<T>& plane,
                               int64_t ld, int32_t r0, int32_t n, int64_t c0, int64_t len, int64_t width) {
    que.EnQue(t);
    t = que.template DeQue<T>();
    DataCopyPad(plane[r0 * ld + c0], t,
                DataCopyExtParams{static_cast<uint16_t>(n), static_cast<uint32_t>(len * sizeof(T)),
                                  static_cast<uint32_t>((width - RoundUp(len, kFrac)) / kFrac),
                                  static_cast<uint32_t>((ld - len) * sizeof(T)), 0});
    que.FreeTensor(t);
  }

  TQue<TPosition::VECIN, 1> in_;
  TQue<TPosition::VECOUT, 1> hi_, lo_;
  TBuf<TPosition::VECCALC> wide_;
};

// The expand of sgmv and lora_expand on the AIC. A tile's h (kParts of T: h itself, or the hi and lo halves of an
// fp32 h) is held in L1 as NZ with tile_rows rows per 16-column group, slice s at columns [s * rank_pad, s *
// rank_pad + rank), rank_pad = round16(rank); the caller writes it between BeginTile and Expand. Then for every
// slice and block of n_block of its columns, delta = h_s . B[block, :rank]^T in fp32, one Mmad per part into the
// same accumulator, goes to a workspace slot. Only the true rank of h and B is read. kHWritten names the pipes that
// write h and read it (FIX_MTE1: Fixpipe rounds it into L1; MTE2_MTE1: it is copied in from GM).
template <typename T, int kParts, HardEvent kHWritten>
class ExpandStage {
  static constexpr bool kCopiedIn = kHWritten == HardEvent::MTE2_MTE1;
  static constexpr HardEvent kHRead = kCopiedIn ? HardEvent::MTE1_MTE2 : HardEvent::MTE1_FIX;

 public:
  __aicore__ inline void Init(TPipe& pipe, Cube<T>& cube, const ExpandTiling& e, int64_t tile_rows) {
    for (int p = 0; p < kParts; ++p) {
      pipe.InitBuffer(h_buf_[p], tile_rows * e.h_cols * sizeof(T));
      h[p] = h_buf_[p].template Get<T>();
      // Copied rows stop at a tile's count, yet the rows past it enter the cube as fractal padding: finite.
      if constexpr (kCopiedIn) cube.ZeroL1(h[p], tile_rows * e.h_cols);
    }
    if constexpr (kCopiedIn) PipeBarrier<PIPE_MTE2>();
    h_written_ = pipe.template AllocEventID<kHWritten>();
    h_read_ = pipe.template AllocEventID<kHRead>();
    SetFlag<kHRead>(h_read_);  // nothing reads h yet
  }

  // Before writing h: the previous tile's expand has read it.
  __aicore__ inline void BeginTile() { WaitFlag<kHRead>(h_read_); }

  // Part p of h from rows [0, count) of a GM matrix with row_stride that holds it at the L1 columns (slice s from
  // column s * rank_pad): the true rank of every non-empty slice, one ND->NZ DMA each (zero-filled to the next C0;
  // nothing past the rank is read, so no stale or NaN column can reach the cube).
  __aicore__ inline void CopyIn(Cube<T>& cube, int p, const GlobalTensor<T>& src, int32_t count, int64_t row_stride,
                                const ExpandTiling& e, int64_t rank) {
    const int64_t rank_pad = RoundUp(rank, kFrac);
    for (int64_t s = 0; s < e.num_slices; ++s) {
      if (e.slice_offsets[s] == e.slice_offsets[s + 1]) continue;  // an empty slice needs no h
      cube.CopyToL1(cube.NzColumns(h[p], s * rank_pad), src[s * rank_pad], count, row_stride, rank);
    }
  }

  __aicore__ inline void Expand(Cube<T>& cube, SlotWriter& slots, const ExpandTiling& e, int32_t count,
                                const GlobalTensor<T>& b, int64_t rank) {
    SetFlag<kHWritten>(h_written_);
    WaitFlag<kHWritten>(h_written_);
    const int64_t m_pad = RoundUp(count, kFrac), rank_pad = RoundUp(rank, kFrac);
    for (int64_t s = 0; s < e.num_slices; ++s) {
      const int64_t lo = e.slice_offsets[s], hi = e.slice_offsets[s + 1];
      for (int64_t n0 = lo; n0 < hi; n0 += slots.n_block()) {
        const int64_t n = Min(slots.n_block(), hi - n0);
        LocalTensor<float> acc = cube.AllocAcc();
        for (int64_t r0 = 0; r0 < rank; r0 += e.rank_chunk) {
          const int64_t r_len = Min(e.rank_chunk, rank - r0);
          LocalTensor<T> wb = cube.LoadWeight(b, n0, n, e.b_stride1, r0, r_len);
          for (int p = 0; p < kParts; ++p) {
            LocalTensor<T> ha = cube.LoadLeftFromL1(h[p], s * rank_pad + r0, count, r_len);
            cube.Mmad(acc, ha, wb, m_pad, n, r_len, r0 > 0 || p > 0);
            cube.FreeLeft(ha);
          }
          cube.FreeRight(wb);
        }
        acc = cube.Finish(acc);
        slots.Write(acc, count, m_pad, n);
        cube.FreeAcc(acc);
      }
    }
    SetFlag<kHRead>(h_read_);
  }

  __aicore__ inline void Finish(TPipe& pipe) {
    WaitFlag<kHRead>(h_read_);
    pipe.template ReleaseEventID<kHWritten>(h_written_);
    pipe.template ReleaseEventID<kHRead>(h_read_);
  }

  LocalTensor<T> h[kParts];

 private:
  TBuf<TPosition::A1> h_buf_[kParts];
  TEventID h_written_, h_read_;
};

// A slot's rank: lora_ranks[slot] clamped to [0, R], R without lora_ranks.
__aicore__ inline int64_t SlotRank(GM_ADDR lora_ranks, const ExpandTiling& e, int64_t slot) {
  return SlotSize(lora_ranks, e.has_ranks, slot, e.max_rank);
}

// The AIVs' side of ExpandStage::Expand for one tile of slot `walk.slot`: y[rows, block] += scale *
// lora_scales[slot] * delta for every block, in the order the AIC writes them.
template <typename Y>
__aicore__ inline void ApplyExpand(RowUpdater<Y>& rows, const TileWalk& walk, const ExpandTiling& e,
                                   int64_t n_block, GM_ADDR lora_scales) {
  float coef = e.scale;
  if (e.has_scales) {
    GlobalTensor<float> scales;
    scales.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(lora_scales));
    coef *= scales.GetValue(walk.slot);
  }
  for (int64_t s = 0; s < e.num_slices; ++s) {
    const int64_t lo = e.slice_offsets[s], hi = e.slice_offsets[s + 1];
    for (int64_t n0 = lo; n0 < hi; n0 += n_block) {
      rows.Apply(walk.rows, walk.count, n0, Min(n_block, hi - n0), coef, true);
    }
  }
}

}  // namespace lora_ops::ascend
