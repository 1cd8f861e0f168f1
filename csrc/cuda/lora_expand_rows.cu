// lora_expand on tensor cores: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T.
// Three kernels, each a warp per unit and 1-2 passes of 128 columns of one slice, one mma.sync m16n8k16 per 16
// columns and 16 ranks (the 16 columns are the mma's M, the ranks its K):
// - rows (the rows form: each position's slot given, no segments): a warp per position, whose h fills all 8 of the
//   mma's N (every column of the result is the row's), so a lane's C fragment holds two adjacent columns of y;
// - runs (the rows form): a warp per 8 consecutive positions as the mma's N, B loaded once per run of one slot;
// - segments (the segment form): a warp per tile of up to 8 positions of one segment (warp_find_tile), one run.
// No shared memory and no barrier. After the programmatic-launch wait a warp's chain is its slot (the segments
// kernel: the walk), then B, h and y at once, then the mma and the store; the runs kernel reads its slots before
// the wait and checks them after it (expand_runs_kernel). Serves fp16/bf16 B with h of B's dtype,
// or float32 h (one split) with bf16 B (split into bf16 hi + lo, two mma: ~16 bits of h), and aligned rows
// (mma_kernels_serve); anything else, the decode sgmv's split partials among it, goes to lora_expand.cu's kernels.
// Why: the positions kernel's per-CTA set-up and its FFMA stream (bf16 -> float conversion and a select per
// element) were ~1,000 instructions per warp on gate_up at T=32 (csrc/cuda/NOTES.md).
#include <algorithm>
#include <type_traits>

#include "kernels.h"
#include "mma.cuh"

namespace lora_ops::cuda {
namespace {

constexpr int kWarps = 4;                  // warps per CTA, each on its own positions
constexpr int kTiles = 8;                  // 16-column mma tiles per pass of a warp: 128 columns
constexpr int kPassCols = 16 * kTiles;
constexpr int kMaxPasses = 2;              // passes per CTA, chosen per call (launch_kernel)
constexpr int kRunPositions = 8;           // positions per warp of the runs and segments kernels: the mma's N

// 4 consecutive 16-bit elements, zero from element `valid` on (valid <= 0: none read).
__device__ __forceinline__ uint2 load4(const void* ptr, int valid) {
  if (valid <= 0) return make_uint2(0, 0);
  uint2 v = *static_cast<const uint2*>(ptr);
  if (valid < 4) {
    const uint64_t keep = (uint64_t{1} << (16 * valid)) - 1;
    const uint64_t bits = ((uint64_t)v.y << 32 | v.x) & keep;
    v = make_uint2((uint32_t)bits, (uint32_t)(bits >> 32));
  }
  return v;
}

// One trip's loads: 16 * kSteps rank columns of h and of B's columns 2g, 2g + 1 of every tile of a pass.
template <int kSteps>
struct Trip {
  uint32_t h[kSteps][2];
  uint32_t h_lo[kSteps][2];  // float32 h: what its 16-bit h leaves out (a second mma)
  uint2 b[kSteps][kTiles][2];
};

// 4 consecutive floats, zero from element `valid` on (valid <= 0: none read); one 16-byte load when all are valid
// (float32 h rows are 16-byte aligned: mma_kernels_serve).
__device__ __forceinline__ float4 load_f4(const float* ptr, int valid) {
  if (valid >= 4) return *reinterpret_cast<const float4*>(ptr);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (valid > 0) v.x = ptr[0];
  if (valid > 1) v.y = ptr[1];
  if (valid > 2) v.z = ptr[2];
  return v;
}

// A lane's 4 ranks of float32 h (`valid` of them inside the rank) as the mma's two k-pair words of bf16 (hi) and
// their rounding remainders (lo): ~16 bits of h, below the output's own rounding.
template <class TB>
__device__ __forceinline__ void load_h_hi_lo(const float* h, int valid, uint32_t hi[2], uint32_t lo[2]) {
  const float4 v = load_f4(h, valid);
  split_pack<TB>(make_float2(v.x, v.y), &hi[0], &lo[0]);
  split_pack<TB>(make_float2(v.z, v.w), &hi[1], &lo[1]);
}

// Issues a trip's loads. Lane (g, t) reads ranks j + 4t .. j + 4t + 3 of h and of B's columns 2g and 2g + 1 of
// every tile: the mma's k pairs (2t, 2t+1) and (2t+8, 2t+9) are those ranks, and its rows g and g + 8 those
// columns. Unchecked where the trip lies inside the rank and the slice (uniform over the warp; a rank-16k adapter
// over whole passes), masked elsewhere.
// h_live false: this lane's h is zeros (the runs and segments kernels: its N column is a row outside the run).
template <int kSteps, bool kChecked, class TB, class TH>
__device__ __forceinline__ void load_trip(Trip<kSteps>& trip, const TH* h, bool h_live, const TB* b_lane,
                                          int64_t b_stride1, int j, int rank, int pass_cols, int g, int t) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int jj = j + 16 * u, valid = kChecked ? rank - jj - 4 * t : 4;
    if constexpr (std::is_same_v<TH, float>) {
      load_h_hi_lo<TB>(h + jj + 4 * t, h_live ? valid : 0, trip.h[u], trip.h_lo[u]);
    } else {
      const uint2 hv = load4(h + jj + 4 * t, h_live ? valid : 0);
      trip.h[u][0] = hv.x;
      trip.h[u][1] = hv.y;
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int v = !kChecked || 16 * i + 2 * g < pass_cols ? valid : 0;  // even slice widths: both columns
      const TB* col = b_lane + (int64_t)(16 * i) * b_stride1 + jj;
      trip.b[u][i][0] = load4(col, v);
      trip.b[u][i][1] = load4(col + b_stride1, v);
    }
  }
}

template <class TB, bool kHiLo, int kSteps>
__device__ __forceinline__ void mma_trip(const Trip<kSteps>& trip, float (&acc)[kTiles][4]) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const uint32_t a[4] = {trip.b[u][i][0].x, trip.b[u][i][1].x, trip.b[u][i][0].y, trip.b[u][i][1].y};
      mma16816<TB>(acc[i], a, trip.h[u]);
      if constexpr (kHiLo) mma16816<TB>(acc[i], a, trip.h_lo[u]);
    }
  }
}

// acc += h[:rank] . B[the pass's columns, :rank]^T (b_lane: this lane's first B element of the pass), in trips
// of 16 * kSteps ranks, all of a trip's loads issued before its mma.
template <class TB, class TH, int kSteps>
__device__ __forceinline__ void mma_ranks(float (&acc)[kTiles][4], const TH* h, bool h_live, const TB* b_lane,
                                          int64_t b_stride1, int rank, int pass_cols, int g, int t) {
  constexpr int kTripRanks = 16 * kSteps;
  for (int j = 0; j < rank; j += kTripRanks) {
    Trip<kSteps> trip;
    if (pass_cols >= kPassCols && j + kTripRanks <= rank) {
      load_trip<kSteps, false>(trip, h, h_live, b_lane, b_stride1, j, rank, pass_cols, g, t);
    } else {
      load_trip<kSteps, true>(trip, h, h_live, b_lane, b_stride1, j, rank, pass_cols, g, t);
    }
    mma_trip<TB, std::is_same_v<TH, float>>(trip, acc);
  }
}

// The rows form's metadata of one position: its row and slot (-1 where outside their ranges) and, where both are
// in range, the slot's rank and coefficient (rank 0: nothing to add).
struct RowMeta {
  int64_t row = -1, slot = -1;
  int rank = 0;
  float coef = 0.f;
};

// The metadata is read through L2 only (ld.global.cg): the runs kernel guesses it before the programmatic-launch
// wait, while the kernel before it may still write it, and reads it again after the wait; a stale line left in L1
// by the guess would pass that check.
__device__ __forceinline__ int64_t position_slot(const ExpandParams& p, int64_t pos) {
  const int64_t l = __ldcg(p.seg.slot + pos);
  return l >= 0 && l < p.num_slots ? l : -1;
}

// Position pos's metadata with the rank and coefficient of slot `at` (-1: none).
__device__ __forceinline__ RowMeta row_meta_at(const ExpandParams& p, int64_t pos, int64_t at) {
  RowMeta m;
  const int64_t t = p.seg.token_indices ? __ldcg(p.seg.token_indices + pos) : pos;
  m.row = t >= 0 && t < p.rows ? t : -1;
  m.slot = position_slot(p, pos);
  if (m.row >= 0 && m.slot >= 0 && at >= 0) {
    m.rank = p.lora_ranks ? (int)clamp_index(__ldcg(p.lora_ranks + at), 0, p.max_rank) : (int)p.max_rank;
    m.coef = m.rank > 0 ? p.scale * (p.lora_scales ? __ldcg(p.lora_scales + at) : 1.f) : 0.f;
  }
  return m;
}

// Position pos's metadata: the row and slot, then the rank and scale (loaded only where the row and slot are in
// range, so the rank's load waits for theirs, and the scale's for the rank's: three dependent trips as compiled).
__device__ __forceinline__ RowMeta read_row_meta(const ExpandParams& p, int64_t pos) {
  return row_meta_at(p, pos, position_slot(p, pos));
}

// Whether a guess (read before the wait) is what `check` read after it: the same row and slot, and at that slot
// the same rank and coefficient (bits: a NaN scale is the same NaN). Called after the trip's loads are issued:
// `check` passes through an empty asm, so the compiler cannot hoist the compare (which waits for the check's
// loads) above them, which the rows kernel's SASS showed.
__device__ __forceinline__ bool confirmed(const RowMeta& guess, RowMeta check) {
  asm volatile("" : "+l"(check.row), "+l"(check.slot), "+r"(check.rank), "+f"(check.coef));
  return guess.row == check.row && guess.slot == check.slot && guess.rank == check.rank &&
         __float_as_uint(guess.coef) == __float_as_uint(check.coef);
}

// Position pos over the columns [n0, n1) of slice `slice`, by one warp: passes of 128 columns, each in trips of
// 16 * kSteps ranks (all of a trip's loads issued before its mma).
template <class TB, class TH, class TY, int kSteps>
__device__ __forceinline__ void expand_position(const ExpandParams& p, int64_t pos, int slice, int n0, int n1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t row = segment_row(p.seg, pos, p.rows), slot = segment_slot(p.seg, pos, p.num_slots);
  if (row < 0 || slot < 0) return;
  const int rank = (int)slot_size(p.lora_ranks, slot, p.max_rank);
  if (rank == 0) return;
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
  const TH* h = static_cast<const TH*>(p.h) + row * p.h_row_stride + slot * p.h_slot_stride + slice * p.max_rank;
  const TB* b = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0;
  TY* y = static_cast<TY*>(p.y) + row * p.y_row_stride;
  for (int pass = n0; pass < n1; pass += kPassCols) {
    // The y pairs this lane adds to (tile t, + 4k), loaded first: they do not wait for B. Even columns and
    // aligned rows (checked on the host): one access each.
    YCols<TY, 2, true> y_pairs[kTiles / 4];
#pragma unroll
    for (int quad = 0; quad < kTiles / 4; ++quad) {
      const int col = pass + 16 * (4 * quad + t) + 2 * g;
      if (col < n1) y_pairs[quad].load(y + col, 2);
    }
    float acc[kTiles][4] = {};
    mma_ranks<TB, TH, kSteps>(acc, h, true, b + (int64_t)(pass + 2 * g) * p.b_stride1 + 4 * t, p.b_stride1, rank,
                              n1 - pass, g, t);
    // Every lane holds columns 2g, 2g + 1 of every tile (the N copies are equal); lane t stores tile t (+ 4k).
#pragma unroll
    for (int quad = 0; quad < kTiles / 4; ++quad) {
      float lo = acc[4 * quad][0], hi = acc[4 * quad][2];
#pragma unroll
      for (int k = 1; k < 4; ++k) {
        lo = t == k ? acc[4 * quad + k][0] : lo;
        hi = t == k ? acc[4 * quad + k][2] : hi;
      }
      const int col = pass + 16 * (4 * quad + t) + 2 * g;
      if (col < n1) {
        y_pairs[quad].v[0] = from_f32<TY>(to_f32(y_pairs[quad].v[0]) + coef * lo);
        y_pairs[quad].v[1] = from_f32<TY>(to_f32(y_pairs[quad].v[1]) + coef * hi);
        y_pairs[quad].store(y + col, 2);
      }
    }
  }
}

// Up to 8 rows over the columns [n0, n1) of slice `slice`, by one warp: the rows are the mma's N, lane i < 8
// holding N column i's row, slot, rank (0: nothing to add) and coefficient, and the warp loads a slot's B once for
// the run of its rows among them. Lane (g, t) then reads h of N column g and adds to rows 2t, 2t + 1 (its C
// fragment's columns). A run's product is added to its own rows only, so nothing of one slot's B (a NaN, an inf)
// reaches the rows of another slot through their zero h. `checking` (warp-uniform): m is a guess and `check` this
// lane's m read again after the wait; where a lane's differs, the warp returns false before its first store,
// having written nothing.
template <class TB, class TH, class TY, int kSteps>
__device__ __forceinline__ bool expand_runs(const ExpandParams& p, const RowMeta& m, const RowMeta& check,
                                            bool checking, int slice, int n0, int n1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t slot = m.slot;
  const int rank = m.rank;
  const float coef = m.coef;
  const unsigned live = __ballot_sync(kAll, lane < kRunPositions && rank > 0);
  if (live == 0) return !checking || __all_sync(kAll, confirmed(m, check));
  const int64_t row = rank > 0 ? m.row : 0;  // pointers below are formed from row 0 where nothing is read or written
  const int64_t h_row = __shfl_sync(kAll, row, g);
  const int64_t y_row[2] = {__shfl_sync(kAll, row, 2 * t), __shfl_sync(kAll, row, 2 * t + 1)};
  const bool y_live[2] = {(live >> (2 * t) & 1) != 0, (live >> (2 * t + 1) & 1) != 0};
  const TH* h_lane = static_cast<const TH*>(p.h) + h_row * p.h_row_stride + slice * p.max_rank;
  TY* y[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) y[r] = static_cast<TY*>(p.y) + y_row[r] * p.y_row_stride;
  for (int pass = n0; pass < n1; pass += kPassCols) {
    // This lane's y pairs (columns 2g, 2g + 1 of every tile, rows 2t and 2t + 1), loaded before any B.
    YCols<TY, 2, true> y_pairs[2][kTiles];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int col = pass + 16 * i + 2 * g;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (y_live[r] && col < n1) y_pairs[r][i].load(y[r] + col, 2);
      }
    }
    for (unsigned todo = live; todo != 0;) {
      const int lead = __ffs(todo) - 1;
      const int64_t run_slot = __shfl_sync(kAll, slot, lead);
      const int run_rank = __shfl_sync(kAll, rank, lead);
      const unsigned run = __ballot_sync(kAll, (todo >> lane & 1) && slot == run_slot);
      todo &= ~run;
      float acc[kTiles][4] = {};
      mma_ranks<TB, TH, kSteps>(acc, h_lane + run_slot * p.h_slot_stride, (run >> g & 1) != 0,
                                static_cast<const TB*>(p.lora_b) + run_slot * p.b_stride0 +
                                    (int64_t)(pass + 2 * g) * p.b_stride1 + 4 * t,
                                p.b_stride1, run_rank, n1 - pass, g, t);
      if (checking && !__all_sync(kAll, confirmed(m, check))) return false;  // before this run's stores
      // C fragment: elements 0, 2 are row 2t's columns 2g, 2g + 1; elements 1, 3 row 2t + 1's. A row is in one
      // run, so its y is written once. The coefficients are shuffled here, not before the loads: their load
      // (lora_scales) need not finish before the trip's are issued.
      const float y_coef[2] = {__shfl_sync(kAll, coef, 2 * t), __shfl_sync(kAll, coef, 2 * t + 1)};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!(run >> (2 * t + r) & 1)) continue;
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const int col = pass + 16 * i + 2 * g;
          if (col >= n1) continue;
          y_pairs[r][i].v[0] = from_f32<TY>(to_f32(y_pairs[r][i].v[0]) + y_coef[r] * acc[i][r]);
          y_pairs[r][i].v[1] = from_f32<TY>(to_f32(y_pairs[r][i].v[1]) + y_coef[r] * acc[i][r + 2]);
          y_pairs[r][i].store(y[r] + col, 2);
        }
      }
    }
  }
  return true;
}

// Tile `tile` of the walk over the segments (the segments kernel): up to 8 positions of one segment, so one run,
// and the warp loads its slot's B once per pass. False when there are fewer tiles.
template <class TB, class TH, class TY, int kSteps>
__device__ __forceinline__ bool expand_segment_tile(const ExpandParams& p, int64_t tile, int slice, int n0, int n1) {
  const int lane = threadIdx.x & 31;
  TileRef ref;
  if (!warp_find_tile(p.seg, p.num_slots, kRunPositions, tile, &ref)) return false;
  RowMeta m;
  m.row = ref.begin + lane < ref.end ? segment_row(p.seg, ref.begin + lane, p.rows) : -1;
  m.slot = ref.slot;
  m.rank = m.row >= 0 ? (int)slot_size(p.lora_ranks, ref.slot, p.max_rank) : 0;
  m.coef = p.scale * (p.lora_scales ? p.lora_scales[ref.slot] : 1.f);
  expand_runs<TB, TH, TY, kSteps>(p, m, m, /*checking=*/false, slice, n0, n1);
  return true;
}

// The CTA's slice and columns [n0, n1): blockIdx.x names a block of `passes` passes of one slice (false: past
// the last). The kernel waits for the previous one (grid_dependency_wait) once it returns true: every thread
// that goes on, so that the grid never ends before that kernel.
__device__ __forceinline__ bool cta_columns(const ExpandParams& p, int passes, int* slice, int* n0, int* n1) {
  int64_t s, first;
  if (!find_slice_block(p, passes * kPassCols, blockIdx.x, &s, &first)) return false;
  // Columns fit int here (mma_kernels_serve: N <= INT32_MAX / 2).
  *slice = (int)s;
  *n0 = (int)first;
  *n1 = (int)std::min<int64_t>(first + passes * kPassCols, p.slice_offsets[s + 1]);
  return true;
}

// Grid: (column blocks of `passes` passes, groups of kWarps warps); CTAs loop over groups past the grid's limit.
// A warp takes one position (rows kernel), kRunPositions (runs kernel) or a tile of up to kRunPositions positions
// of one segment (segments kernel).
//
// The runs kernel, where it is launched programmatically (one rank step, sm_90 on: launch_lora_expand_mma; elsewhere
// the wait is empty and a guess would only add its check), guesses its first positions' metadata before the wait:
// after a kernel that lets its dependents start early (fold_linear's GEMM), the guess's dependent trips overlap that
// kernel's end instead of following it. The op cannot know what the previous kernel writes, so the guess is read
// again after the wait (as compiled, the check's loads still come in dependent trips before y, h and B: one trip
// is the next step, csrc/cuda/NOTES.md session 23) and compared before the first store; a warp whose guess was
// stale redoes its positions from the metadata read then (H200, a llama3-8b decode step at T=64, 32 adapters:
// +38.0 -> +35.6%). The rows kernel, one position per warp, gained nothing from it as it stood.
template <class TB, class TH, class TY, int kSteps>
__global__ void __launch_bounds__(32 * kWarps, kSteps == 1 ? 4 : 3) expand_rows_kernel(ExpandParams p, int passes) {
  int slice, n0, n1;
  if (!cta_columns(p, passes, &slice, &n0, &n1)) return;
  grid_dependency_wait();  // the op cannot know what wrote its inputs
  for (int64_t pos = (int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5); pos < p.seg.positions;
       pos += (int64_t)gridDim.y * kWarps) {
    expand_position<TB, TH, TY, kSteps>(p, pos, slice, n0, n1);
  }
}

// CTAs per SM of the runs and segments kernels: 4 at one rank step with a 16-bit y (128 registers), so that
// gate_up's 448 CTAs at T=128 run in one wave instead of 1.13 (H200, 9f31ff2 -> this: the runs kernel at T=1024
// 11.67 -> 9.10 us, the segments kernel 13.08 -> 10.02, the llama3-8b decode step at T=128/32 +28.6 -> +26.7%).
// The rows kernel stays at 4: at 5 (96 registers) it was slower at T=32 (gate_up 11.47 -> 11.94).
template <class TY, int kSteps>
constexpr int kRunsCtasPerSm = kSteps == 1 ? (sizeof(TY) == 2 ? 4 : 3) : 2;

template <class TB, class TH, class TY, int kSteps>
__global__ void __launch_bounds__(32 * kWarps, kRunsCtasPerSm<TY, kSteps>)
    expand_runs_kernel(ExpandParams p, int passes) {
  int slice, n0, n1;
  if (!cta_columns(p, passes, &slice, &n0, &n1)) return;
  // Lane i < 8 holds position pos0 + i's metadata (none past the positions and on the other lanes).
  const int lane = threadIdx.x & 31;
  const int64_t stride = (int64_t)gridDim.y * kWarps * kRunPositions;
  int64_t pos0 = ((int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5)) * kRunPositions;
  auto mine = [&] { return lane < kRunPositions && pos0 + lane < p.seg.positions; };
  auto lane_meta = [&] { return mine() ? read_row_meta(p, pos0 + lane) : RowMeta{}; };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kGuess = kSteps == 1;  // launched programmatically (launch_lora_expand_mma)
#else
  constexpr bool kGuess = false;
#endif
  RowMeta m;
  if constexpr (kGuess) m = lane_meta();
  grid_dependency_wait();
  if constexpr (!kGuess) m = lane_meta();
  for (bool checking = kGuess; pos0 < p.seg.positions; checking = false) {
    const RowMeta check = checking && mine() ? row_meta_at(p, pos0 + lane, m.slot) : m;
    if (expand_runs<TB, TH, TY, kSteps>(p, m, check, checking, slice, n0, n1)) pos0 += stride;
    m = lane_meta();
  }
}

template <class TB, class TH, class TY, int kSteps>
__global__ void __launch_bounds__(32 * kWarps, kRunsCtasPerSm<TY, kSteps>)
    expand_segments_kernel(ExpandParams p, int passes) {
  int slice, n0, n1;
  if (!cta_columns(p, passes, &slice, &n0, &n1)) return;
  grid_dependency_wait();  // the walk over the segments is too long a chain to guess
  const int64_t tiles = max_segment_tiles(p.seg, kRunPositions);
  for (int64_t tile = (int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5); tile < tiles;
       tile += (int64_t)gridDim.y * kWarps) {
    if (!expand_segment_tile<TB, TH, TY, kSteps>(p, tile, slice, n0, n1)) break;
  }
}

// Passes per CTA: one where the grid of one-pass CTAs fits the device at once (each warp then makes one trip for
// its B), two where it would run several waves. Measured on the H200 (csrc/cuda/NOTES.md): a fixed two passes left
// o at T=32 (128 CTAs) with two serial trips per warp; up to four passes of 64 columns, with the later passes' B
// prefetched to L2, made gate_up at T=32 slower (13.1 against 11.6 us); so did up to eight passes with the next
// trip's loads in registers before this trip's mma (3 CTAs per SM for their registers: o at T=128 5.35 -> 6.14 us).
template <auto kKernel>
cudaError_t launch_kernel(const ExpandParams& p, int64_t groups, bool pdl, cudaStream_t stream) {
  int64_t resident = 0;
  const cudaError_t err = resident_ctas<kKernel>(32 * kWarps, &resident);
  if (err != cudaSuccess) return err;
  const int64_t one_pass = slice_column_blocks(p, kPassCols) * groups;
  const int passes = (int)std::clamp<int64_t>((one_pass + resident - 1) / resident, 1, kMaxPasses);
  const int64_t blocks = slice_column_blocks(p, passes * kPassCols);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)blocks, (unsigned)std::min<int64_t>(groups, 65535));
  return launch_pdl(kKernel, grid, 32 * kWarps, pdl, stream, p, passes);
}

// Two rank steps per trip from rank 32: one trip per 32 ranks instead of 16, for fewer CTAs per SM (rows kernel 3
// instead of 4, runs and segments kernels 2 instead of 4, or 3 with a float32 y: kRunsCtasPerSm; measured on the
// H200: the runs kernel at rank 64 9.28 -> 8.49 us).
bool two_rank_steps(const ExpandParams& p) { return p.max_rank >= 32; }

template <class TB, class TH, class TY>
cudaError_t launch_steps(const ExpandParams& p, ExpandKernel kernel, bool pdl, cudaStream_t stream) {
  const bool two = two_rank_steps(p);
  switch (kernel) {
    case ExpandKernel::Segments: {
      const int64_t groups = (max_segment_tiles(p.seg, kRunPositions) + kWarps - 1) / kWarps;
      return two ? launch_kernel<expand_segments_kernel<TB, TH, TY, 2>>(p, groups, pdl, stream)
                 : launch_kernel<expand_segments_kernel<TB, TH, TY, 1>>(p, groups, pdl, stream);
    }
    case ExpandKernel::Runs: {
      const int64_t groups = (p.seg.positions + kWarps * kRunPositions - 1) / (kWarps * kRunPositions);
      return two ? launch_kernel<expand_runs_kernel<TB, TH, TY, 2>>(p, groups, pdl, stream)
                 : launch_kernel<expand_runs_kernel<TB, TH, TY, 1>>(p, groups, pdl, stream);
    }
    default: {
      const int64_t groups = (p.seg.positions + kWarps - 1) / kWarps;
      return two ? launch_kernel<expand_rows_kernel<TB, TH, TY, 2>>(p, groups, pdl, stream)
                 : launch_kernel<expand_rows_kernel<TB, TH, TY, 1>>(p, groups, pdl, stream);
    }
  }
}

template <class TB, class TH>
cudaError_t launch_typed(const ExpandParams& p, ExpandKernel kernel, bool pdl, cudaStream_t stream) {
  return p.y_dtype == DType::F32 ? launch_steps<TB, TH, float>(p, kernel, pdl, stream)
                                 : launch_steps<TB, TH, TB>(p, kernel, pdl, stream);
}

}  // namespace

bool mma_kernels_serve(const ExpandParams& p) {
  // float32 h goes as bf16 hi + lo, which keep float32's range: fp16's would overflow past 65504 and lose the lo
  // part of small h to subnormals. The decode sgmv's split partials stay on the SIMT kernels: on these kernels its
  // expand was slower at every decode shape (H200, csrc/cuda/NOTES.md session 17).
  const bool h_float = p.h_dtype == DType::F32 && p.b_dtype == DType::BF16;
  if (p.b_dtype == DType::F32 || p.h_splits != 1 || (!h_float && p.h_dtype != p.b_dtype)) return false;
  if (p.max_rank % 4 != 0 || p.max_rank > INT32_MAX / 2 || p.n > INT32_MAX / 2) return false;
  bool ok = aligned(p.lora_b, {p.b_stride0 * 2, p.b_stride1 * 2}, 8) &&
            (h_float ? aligned(p.h, {p.h_row_stride * 4, p.h_slot_stride * 4}, 16)
                     : aligned(p.h, {p.h_row_stride * 2, p.h_slot_stride * 2}, 8));
  const int64_t ey = dtype_size(p.y_dtype);
  ok = ok && reinterpret_cast<uintptr_t>(p.y) % (2 * ey) == 0 && p.y_row_stride % 2 == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) ok = ok && p.slice_offsets[s] % 2 == 0;
  return ok;
}

bool runs_kernel_pays(const ExpandParams& p) {
  return p.seg.token_indices != nullptr && p.seg.positions >= kRunsMinPositionsPerSlot * p.num_slots;
}

cudaError_t launch_lora_expand_mma(const ExpandParams& p, ExpandKernel kernel, int cc_major, cudaStream_t stream) {
  if (p.seg.positions == 0 || slice_column_blocks(p, kPassCols) == 0) return cudaSuccess;
  // Programmatic launch (sm_90) for the one-step kernels only: after the fold route's GEMM, which lets its
  // dependents launch early, the early launch of the two-step kernels made a llama3-8b decode step at rank 64
  // slower (T=32, 16 adapters: +74.3% with it, +64.6% without, as after cuBLAS's GEMM; csrc/cuda/NOTES.md, session
  // 19), while at rank 16 it is the fold route's gain (T=16: +24.1 -> +21.1%).
  const bool pdl = cc_major >= 9 && !two_rank_steps(p);  // expand_runs_kernel's kGuess follows this rule
  if (p.b_dtype == DType::F16) return launch_typed<__half, __half>(p, kernel, pdl, stream);  // float32 h: bf16 B only
  return p.h_dtype == DType::F32 ? launch_typed<__nv_bfloat16, float>(p, kernel, pdl, stream)
                                 : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, kernel, pdl, stream);
}

}  // namespace lora_ops::cuda
