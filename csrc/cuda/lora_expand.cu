// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// At decode sizes the cost is the chain of dependent memory trips per CTA and how many CTAs run it in series.
// Both forms go to the tensor-core kernels of lora_expand_rows.cu wherever they serve. Otherwise two kernels, by
// the number of positions P (measured on the H200; csrc/cuda/NOTES.md); the rows form they cannot take (no
// seg_indptr: each position's slot is given, no walk) goes to the positions kernel at any P:
// - positions (P <= kPositionsKernelMaxPositions): one CTA per (256 columns of one slice, tile of 4 consecutive
//   positions); 128 threads own 2 columns of the 4 rows each. Two trips: warp 0 loads the tile's rows, walks the
//   segments for their slots and reads the ranks and scales of the first 64 slots, all at once; then every
//   thread issues B, y and h together. Positions are sorted by slot, so a run of rows of one slot loads B once.
//   The grid is sized by positions on the host: no CTA looks for a tile that does not exist.
// - segment tiles (larger P): one CTA per (512 columns of one slice, tile of up to 4 positions of one segment),
//   128 threads of 4 columns sharing the tile's B. The tile walk is one trip and the rows with the rank one more;
//   then B, y and h as above. The grid holds only as many tile rows as fit on the device at once and each CTA
//   loops over its tiles: the positions grid would run several waves of its chain there.
// Both are programmatically dependent launches on sm_90; before their dependency wait they read only when the
// caller says the inputs are ready (`early`: the sgmv's expand after its own shrink), never in the op.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTileRows = 4;
constexpr int kRankChunk = 128;  // rank columns of h staged in shared memory at once
constexpr int kNearSlots = 64;   // slots whose rank and scale the positions kernel loads before its walk
constexpr int64_t kPositionsKernelMaxPositions = 64;
constexpr int kPositionsCols = 2, kTilesCols = 4;  // consecutive columns per thread of each kernel

template <class T>
__device__ __forceinline__ void prefetch_l2(const T* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// A row of a tile: row -1 when it adds nothing (past the positions, a row outside [0, rows), no segment or a
// slot outside [0, L), rank 0).
struct TileRow {
  int32_t row, slot, rank;  // each fits int32 (docs/design.md §2, index values)
  float coef;
};

// The thread's kCols consecutive columns in the CTA's block of kThreads * kCols columns of one slice: the first
// column n0, how many of the kCols lie in the slice (0 past its end), and h's window of that slice. False past
// the last block.
template <int kCols, class TH>
__device__ __forceinline__ bool find_columns(const ExpandParams& p, int64_t* n0, int* cols, const TH** h_slice) {
  int64_t s, first;
  if (!find_slice_block(p, kThreads * kCols, blockIdx.x, &s, &first)) return false;
  *n0 = first + threadIdx.x * kCols;
  *cols = (int)std::max<int64_t>(0, std::min<int64_t>(kCols, p.slice_offsets[s + 1] - *n0));
  *h_slice = static_cast<const TH*>(p.h) + s * p.max_rank;
  return true;
}

// h_s[m][j] for j in [0, jpad): row m's h at rank column j0 + j (its partials summed in split order, scaled by
// its coef), zero past its rank or for no row. `h` points at the slice's window; row_at(m) gives the TileRow.
template <class TH, class RowAt>
__device__ __forceinline__ void fill_h(const ExpandParams& p, const TH* h, RowAt row_at, int j0, int jpad,
                                       float (*h_s)[kRankChunk]) {
  for (int i = threadIdx.x; i < kTileRows * jpad; i += kThreads) {
    const int m = i / jpad, j = i % jpad;
    const TileRow r = row_at(m);
    float v = 0.f;
    if (r.row >= 0 && j0 + j < r.rank) {
      const TH* src = h + r.slot * p.h_slot_stride + r.row * p.h_row_stride + j0 + j;
      for (int64_t split = 0; split < p.h_splits; ++split) v += to_f32(src[split * p.h_split_stride]);
      v *= r.coef;
    }
    h_s[m][j] = v;
  }
}

// Warp-wide: lane r < kRows returns the slot of position p0 + r (-1: no segment covers it, or its slot is
// outside [0, num_slots)). The segment bounds follow the running-maximum rule of warp_find_tile; the walk
// stops at the first step that starts past the tile.
template <int kRows>
__device__ int64_t warp_position_slot(const Segments& seg, int64_t num_slots, int64_t p0) {
  const int lane = threadIdx.x & 31;
  int64_t mine = -1, m_carry = clamped_indptr(seg, 0);
  for (int64_t base = 0; base < seg.num_segments && m_carry < p0 + kRows; base += 32) {
    const int64_t g = base + lane;
    const bool in = g < seg.num_segments;
    const int64_t slot = in ? segment_slot(seg, g, num_slots) : -1;
    const int64_t bound = in ? clamped_indptr(seg, g + 1) : int64_t{0};
    const int64_t m_end = Max{}(m_carry, warp_inclusive_scan(bound, 32, Max{}));
    int64_t m_begin = __shfl_up_sync(kAll, m_end, 1);
    if (lane == 0) m_begin = m_carry;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const unsigned hit = __ballot_sync(kAll, in && m_begin <= p0 + r && p0 + r < m_end);
      const int64_t s = __shfl_sync(kAll, slot, hit ? __ffs(hit) - 1 : 0);
      if (hit && lane == r) mine = s;
    }
    m_carry = __shfl_sync(kAll, m_end, 31);
  }
  return mine;
}

// Warp 0 fills tile[0, kTileRows) for the positions p0...: rows, the walk, and the ranks and scales of slots
// below kNearSlots are independent loads issued together (one trip); a farther slot's rank and scale cost one
// more.
__device__ __forceinline__ void warp_resolve_tile(const ExpandParams& p, int64_t p0, TileRow* tile) {
  const int lane = threadIdx.x & 31;
  const int64_t row = lane < kTileRows && p0 + lane < p.seg.positions ? segment_row(p.seg, p0 + lane, p.rows) : -1;
  int64_t near_rank[2] = {0, 0};
  float near_scale[2] = {1.f, 1.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t l = lane + 32 * h;
    if (l < p.num_slots) {
      near_rank[h] = slot_size(p.lora_ranks, l, p.max_rank);
      if (p.lora_scales) near_scale[h] = p.lora_scales[l];
    }
  }
  // The rows form (no indptr) names each position's slot: no walk.
  const int64_t slot = !p.seg.indptr ? (lane < kTileRows && p0 + lane < p.seg.positions
                                            ? segment_slot(p.seg, p0 + lane, p.num_slots) : int64_t{-1})
                                     : warp_position_slot<kTileRows>(p.seg, p.num_slots, p0);
  const int src = (int)(slot & 31);
  const int64_t rank_lo = __shfl_sync(kAll, near_rank[0], src), rank_hi = __shfl_sync(kAll, near_rank[1], src);
  const float scale_lo = __shfl_sync(kAll, near_scale[0], src), scale_hi = __shfl_sync(kAll, near_scale[1], src);
  if (lane >= kTileRows) return;
  int64_t rank = 0;
  float scale = 1.f;
  if (slot >= kNearSlots) {
    rank = slot_size(p.lora_ranks, slot, p.max_rank);
    if (p.lora_scales) scale = p.lora_scales[slot];
  } else if (slot >= 0) {
    rank = slot < 32 ? rank_lo : rank_hi;
    scale = slot < 32 ? scale_lo : scale_hi;
  }
  tile[lane] = {(int32_t)(row >= 0 && rank > 0 ? row : -1), (int32_t)slot, (int32_t)rank, p.scale * scale};
}

// kVec: B rows allow 16-byte loads and y rows kCols-element accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads) expand_positions_kernel(ExpandParams p, int64_t tiles, bool early) {
  constexpr int kCols = kPositionsCols;
  __shared__ TileRow s_tile[kTileRows];
  __shared__ float h_s[kTileRows][kRankChunk];
  const int tid = threadIdx.x;
  int64_t n0;
  int cols;
  const TH* h;
  if (!find_columns<kCols>(p, &n0, &cols, &h)) return;
  TY* y = static_cast<TY*>(p.y);

  if (!early) grid_dependency_wait();
  for (int64_t t = blockIdx.y; t < tiles; t += gridDim.y) {
    __syncthreads();  // the previous tile's readers of s_tile and h_s are done
    if (tid < 32) warp_resolve_tile(p, t * kTileRows, s_tile);
    __syncthreads();
    TileRow rows[kTileRows];
    int rank_max = 0;
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      rows[m] = s_tile[m];
      if (rows[m].row >= 0) rank_max = std::max(rank_max, rows[m].rank);
    }
    if (rank_max == 0) continue;
    // Positions are sorted by slot, so a run of rows of one slot loads B once: row m takes row m - 1's when
    // both are real rows of the same slot (bit m of `same`).
    unsigned same = 0;
    const TB* b_cols[kTileRows];
    int b_rank[kTileRows];  // rank columns of B this row loads: 0 for no row, or one taking row m - 1's
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (m > 0 && rows[m].row >= 0 && rows[m - 1].row >= 0 && rows[m].slot == rows[m - 1].slot) same |= 1u << m;
      b_cols[m] = static_cast<const TB*>(p.lora_b) + std::max(rows[m].slot, 0) * p.b_stride0 +
                  n0 * p.b_stride1;
      b_rank[m] = rows[m].row >= 0 && !(same >> m & 1) && cols > 0 ? rows[m].rank : 0;
    }
    // B's rank columns [j, j + 16) of every row and column of the thread (zero past the row's rank).
    Raw8<TB> raw[2][kTileRows][kCols];
    auto load_b = [&](int j) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int m = 0; m < kTileRows; ++m) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            load_raw8(b_cols[m] + c * p.b_stride1 + j + 8 * u, kVec, c < cols ? b_rank[m] - (j + 8 * u) : 0,
                      raw[u][m][c]);
          }
        }
      }
    };
    // The first 16 rank columns go to registers, the rest to L2, before the wait when `early`.
    load_b(0);
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        for (int off = 16; c < cols && off < b_rank[m]; off += 128 / sizeof(TB)) {
          prefetch_l2(b_cols[m] + c * p.b_stride1 + off);
        }
      }
    }
    grid_dependency_wait();

    YCols<TY, kCols, kVec> y_rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (rows[m].row >= 0) y_rows[m].load(y + rows[m].row * p.y_row_stride + n0, cols);
    }
    float acc[kTileRows][kCols] = {};
    // Rank columns [j, j + 8) of step u (h_s column jc); a row of a run takes its predecessor's B (its own
    // loads were skipped).
    auto fma_step = [&](int u, int jc) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          float b = 0.f;
#pragma unroll
          for (int m = 0; m < kTileRows; ++m) {
            b = same >> m & 1 ? b : to_f32(raw[u][m][c].v[jj]);
            acc[m][c] += h_s[m][jc + jj] * b;
          }
        }
      }
    };
    for (int j = 0; j < rank_max; j += 16) {
      const int jc = j % kRankChunk;
      if (jc == 0) {  // the next kRankChunk rank columns of h, to a step of 16
        const int jn = rank_max - j < kRankChunk ? rank_max - j : kRankChunk;
        if (j > 0) __syncthreads();  // the previous chunk's readers of h_s are done
        fill_h(p, h, [&](int m) { return s_tile[m]; }, j, (jn + 15) / 16 * 16, h_s);
        __syncthreads();
      }
      fma_step(0, jc);
      fma_step(1, jc + 8);
      if (j + 16 < rank_max) load_b(j + 16);
    }
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (rows[m].row < 0) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c) y_rows[m].v[c] = from_f32<TY>(to_f32(y_rows[m].v[c]) + acc[m][c]);
      y_rows[m].store(y + rows[m].row * p.y_row_stride + n0, cols);
    }
  }
}

// kVec: B rows allow 16-byte loads and y rows kCols-element accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads) expand_tiles_kernel(ExpandParams p, int64_t max_tiles, bool early) {
  constexpr int kCols = kTilesCols;
  constexpr int kFirstSteps = 2;  // rank columns / 8 of B loaded before the wait
  __shared__ float h_s[kTileRows][kRankChunk];
  __shared__ int64_t s_rows[kTileRows];
  int64_t n0;
  int cols;
  const TH* h;
  if (!find_columns<kCols>(p, &n0, &cols, &h)) return;
  TY* y = static_cast<TY*>(p.y);

  if (!early) grid_dependency_wait();
  for (int64_t t = blockIdx.y; t < max_tiles; t += gridDim.y) {
    __syncthreads();  // a previous tile's readers of s_rows and h_s are done
    TileRef tile;
    if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, t, &tile, s_rows, p.lora_ranks, p.max_rank)) return;
    const int64_t slot = tile.slot, rank = tile.size;
    if (rank == 0) continue;
    const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
    const TB* b_cols = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0 + n0 * p.b_stride1;
    // B's first rank columns go to registers, the rest to L2, before the wait when `early`.
    Raw8<TB> b_first[kCols][kFirstSteps];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int st = 0; st < kFirstSteps; ++st) {
        load_raw8(b_cols + c * p.b_stride1 + st * 8, kVec, c < cols ? rank - st * 8 : 0, b_first[c][st]);
      }
      for (int64_t off = kFirstSteps * 8; c < cols && off < rank; off += 128 / sizeof(TB)) {
        prefetch_l2(b_cols + c * p.b_stride1 + off);
      }
    }
    grid_dependency_wait();

    YCols<TY, kCols, kVec> y_rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (s_rows[m] >= 0) y_rows[m].load(y + s_rows[m] * p.y_row_stride + n0, cols);
    }
    float acc[kTileRows][kCols] = {};
    auto fma_step = [&](const float (&b)[kCols][8], int j) {
#pragma unroll
      for (int m = 0; m < kTileRows; ++m) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float hv = h_s[m][j + jj];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[m][c] += hv * b[c][jj];
        }
      }
    };
    for (int64_t j0 = 0; j0 < rank; j0 += kRankChunk) {
      const int jn = (int)std::min<int64_t>(kRankChunk, rank - j0), jpad = (jn + 7) / 8 * 8;
      if (j0 > 0) __syncthreads();  // the previous chunk's readers of h_s are done
      fill_h(p, h, [&](int m) { return TileRow{(int32_t)s_rows[m], (int32_t)slot, (int32_t)rank, coef}; },
             (int)j0, jpad, h_s);
      __syncthreads();
      int j = 0;
      if (j0 == 0) {
#pragma unroll
        for (int st = 0; st < kFirstSteps; ++st) {
          if (st * 8 >= jpad) break;
          float b[kCols][8];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) b[c][jj] = to_f32(b_first[c][st].v[jj]);
          }
          fma_step(b, st * 8);
        }
        j = kFirstSteps * 8;
      }
      for (; j < jpad; j += 16) {  // two steps' loads in flight at once
        Raw8<TB> raw[2][kCols];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            load_raw8(b_cols + c * p.b_stride1 + j0 + j + 8 * u, kVec, c < cols ? jn - j - 8 * u : 0, raw[u][c]);
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (j + 8 * u >= jpad) break;
          float b[kCols][8];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) b[c][jj] = to_f32(raw[u][c].v[jj]);
          }
          fma_step(b, j + 8 * u);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (s_rows[m] < 0) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c) y_rows[m].v[c] = from_f32<TY>(to_f32(y_rows[m].v[c]) + acc[m][c]);
      y_rows[m].store(y + s_rows[m] * p.y_row_stride + n0, cols);
    }
  }
}

// How one call launches: the kernel, its column blocks (counted once per call), the vector path, PDL.
struct ExpandLaunch {
  bool positions, vec, pdl, early;
  int64_t col_blocks;
  cudaStream_t stream;
};

// Grid: the column blocks by the position tiles (capped at the grid's limit; CTAs then loop).
template <class TB, class TH, class TY>
cudaError_t launch_positions(const ExpandParams& p, const ExpandLaunch& l) {
  const int64_t tiles = (p.seg.positions + kTileRows - 1) / kTileRows;
  const dim3 grid((unsigned)l.col_blocks, (unsigned)std::min<int64_t>(tiles, 65535));
  auto kernel = l.vec ? expand_positions_kernel<TB, TH, TY, true> : expand_positions_kernel<TB, TH, TY, false>;
  return launch_pdl(kernel, grid, kThreads, l.pdl, l.stream, p, tiles, l.early);
}

// Grid: the column blocks by as many tile rows as fit on the device at once; each CTA loops over tiles t,
// t + gridDim.y, ... The tile bound counts a segment for every slot, and at decode most of its tiles do not
// exist: a grid of the whole bound spent extra waves on CTAs that only found that out (ncu, gate_up at T=32/32:
// 127 registers, 4 CTAs per SM, 1792 CTAs in 3.4 waves).
template <class TB, class TH, class TY>
cudaError_t launch_tiles(const ExpandParams& p, const ExpandLaunch& l) {
  const int64_t tiles = max_segment_tiles(p.seg, kTileRows);
  auto kernel = l.vec ? expand_tiles_kernel<TB, TH, TY, true> : expand_tiles_kernel<TB, TH, TY, false>;
  int64_t resident = 0;
  const cudaError_t err = l.vec ? resident_ctas<expand_tiles_kernel<TB, TH, TY, true>>(kThreads, &resident)
                                : resident_ctas<expand_tiles_kernel<TB, TH, TY, false>>(kThreads, &resident);
  if (err != cudaSuccess) return err;
  const int64_t tile_rows = std::max<int64_t>(1, resident / l.col_blocks);
  const dim3 grid((unsigned)l.col_blocks, (unsigned)std::min<int64_t>({tiles, tile_rows, 65535}));
  return launch_pdl(kernel, grid, kThreads, l.pdl, l.stream, p, tiles, l.early);
}

template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, const ExpandLaunch& l) {
  return l.positions ? launch_positions<TB, TH, TY>(p, l) : launch_tiles<TB, TH, TY>(p, l);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, const ExpandLaunch& l) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, l) : launch_typed<TB, float, TB>(p, l);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, l) : launch_typed<TB, TB, TB>(p, l);
}

}  // namespace

cudaError_t launch_lora_expand(const ExpandParams& p, ExpandKernel preferred, bool inputs_ready, int cc_major,
                               cudaStream_t stream) {
  if (p.seg.positions == 0 || p.seg.num_segments == 0 || p.max_rank == 0) return cudaSuccess;
  // A preferred tensor-core kernel that cannot serve the call (the rows or runs kernel given segments, the
  // segments kernel given rows) leaves the choice to the automatic rule.
  const bool automatic = preferred != ExpandKernel::Positions && preferred != ExpandKernel::Tiles;
  if (automatic && cc_major >= 8 && mma_kernels_serve(p)) {  // mma.sync m16n8k16 in fp16/bf16: sm_80
    if (p.seg.indptr) return launch_lora_expand_mma(p, ExpandKernel::Segments, cc_major, stream);
    const bool runs = preferred == ExpandKernel::Runs || (preferred != ExpandKernel::Rows && runs_kernel_pays(p));
    return launch_lora_expand_mma(p, runs ? ExpandKernel::Runs : ExpandKernel::Rows, cc_major, stream);
  }
  ExpandLaunch l{};
  // The rows form has a segment per position: the tiles kernel would make a tile of each.
  l.positions = preferred == ExpandKernel::Positions ||
                (automatic && (!p.seg.indptr || p.seg.positions <= kPositionsKernelMaxPositions));
  l.col_blocks = slice_column_blocks(p, kThreads * (l.positions ? kPositionsCols : kTilesCols));
  if (l.col_blocks == 0) return cudaSuccess;
  if (l.col_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  // Vector path: 16-byte loads of B rows, kTilesCols-column (so also kPositionsCols-column) accesses of y (every
  // slice starts on one).
  static_assert(kTilesCols % kPositionsCols == 0);
  const int64_t eb = dtype_size(p.b_dtype), y_vec = kTilesCols * dtype_size(p.y_dtype);
  l.vec = aligned(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
          reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kTilesCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) l.vec = l.vec && p.slice_offsets[s] % kTilesCols == 0;
  l.pdl = cc_major >= 9;
  l.early = l.pdl && inputs_ready;
  l.stream = stream;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, l);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, l);
    default: return launch_b<float>(p, l);
  }
}

}  // namespace lora_ops::cuda
