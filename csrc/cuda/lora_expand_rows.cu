// lora_expand on tensor cores: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T.
// Three kernels, each a warp per unit and 1-2 passes of 128 columns of one slice, one mma.sync m16n8k16 per 16
// columns and 16 ranks (the 16 columns are the mma's M, the ranks its K):
// - rows (the rows form: each position's slot given, no segments): a warp per position, whose h fills all 8 of the
//   mma's N (every column of the result is the row's), so a lane's C fragment holds two adjacent columns of y;
// - runs (the rows form): a warp per 8 consecutive positions as the mma's N (4, the other 4 columns empty, where
//   that grid fits at once), B loaded once per run of one slot;
// - segments (the segment form): a warp per tile of up to 8 positions of one segment (warp_find_tile), one run.
// No shared memory and no barrier. After the programmatic-launch wait a warp's chain is its slot (the segments
// kernel: the walk), then B, h and y at once, then the mma and the store; the rows and runs kernels, launched
// programmatically, load their metadata before the wait and check it in the trip of B, h and y
// (kGuesses). Serves fp16/bf16 B with h of B's dtype, or float32 h (one split) with bf16 B (split into
// bf16 hi + lo, two mma: ~16 bits of h), and aligned rows (mma_kernels_serve); anything else, the decode sgmv's
// split partials among it, goes to lora_expand.cu's kernels. Why: the positions kernel's per-CTA set-up and its
// FFMA stream (bf16 -> float conversion and a select per element) were ~1,000 instructions per warp on gate_up at
// T=32 (csrc/cuda/NOTES.md).
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
constexpr int kRunPositions = 8;           // the mma's N: positions per warp of the segments kernel, up to it of the
                                           // runs kernel (kPositions)

// How the runs kernel overlaps the trips of a warp's runs (expand_runs).
enum class RunsPipeline { None, Copy };

// 4 consecutive 16-bit elements as stored (valid <= 0: none read, zeros); mask4 then zeroes those from element
// `valid` on (keep_bits(valid)). Apart, so that a trip issues every load before its first mask: a mask right after
// its load made each load of a checked trip wait for the one before (ptxas placed it there and gave it the load's
// scoreboard), a chain of ~70 dependent loads a trip at ranks below the trip's or a partial pass (csrc/cuda/NOTES.md
// session 48).
__device__ __forceinline__ uint2 load4(const void* ptr, int valid) {
  return valid > 0 ? *static_cast<const uint2*>(ptr) : make_uint2(0, 0);
}

// The bits of 4 16-bit elements that a mask from element `valid` on keeps (all at valid >= 4, none at valid <= 0):
// worked out once a rank step, for all of its words. Worked out in each word's mask (a branch on valid >= 4 there),
// ptxas rebuilt it per word behind a branch: ~14 instructions a word after the trip's loads landed, ~240 a 16-rank
// step of a pass (csrc/cuda/NOTES.md session 50).
__device__ __forceinline__ uint64_t keep_bits(int valid) {
  const uint64_t some = (uint64_t{1} << (16 * std::clamp(valid, 0, 3))) - 1;  // valid 0: none
  return valid >= 4 ? ~uint64_t{0} : some;
}

__device__ __forceinline__ uint2 mask4(uint2 v, uint64_t keep) {
  return make_uint2(v.x & (uint32_t)keep, v.y & (uint32_t)(keep >> 32));
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

// A lane's 4 ranks of float32 h as load_trip leaves them (the floats' bits in hi[0], hi[1], lo[0], lo[1]), split in
// place into the mma's two k-pair words of bf16 (hi) and their rounding remainders (lo): ~16 bits of h, below the
// output's own rounding. Apart from the load, as the masks are (load4): split at once, h's load held back the
// trip's B loads behind it.
template <class TB>
__device__ __forceinline__ void split_h(uint32_t hi[2], uint32_t lo[2]) {
  const float4 v = make_float4(__uint_as_float(hi[0]), __uint_as_float(hi[1]), __uint_as_float(lo[0]),
                               __uint_as_float(lo[1]));
  split_pack<TB>(make_float2(v.x, v.y), &hi[0], &lo[0]);
  split_pack<TB>(make_float2(v.z, v.w), &hi[1], &lo[1]);
}

// Issues a trip's loads. Lane (g, t) reads ranks j + 4t .. j + 4t + 3 of h and of B's columns 2g and 2g + 1 of
// every tile: the mma's k pairs (2t, 2t+1) and (2t+8, 2t+9) are those ranks, and its rows g and g + 8 those
// columns. Unchecked where the trip lies inside the rank and the slice (uniform over the warp; a rank-16k adapter
// over whole passes), masked elsewhere: every load first, then the masks (load4).
// h_live false: this lane's h is zeros (the runs and segments kernels: its N column is a row outside the run).
template <int kSteps, bool kChecked, class TB, class TH>
__device__ __forceinline__ void load_trip(Trip<kSteps>& trip, const TH* h, bool h_live, const TB* b_lane,
                                          int64_t b_stride1, int j, int rank, int pass_cols, int g, int t) {
  // The ranks of step u this lane reads inside the rank (>= 4: all), and of tile i's columns (none past the pass;
  // even slice widths: both columns).
  auto valid_at = [&](int u) { return kChecked ? rank - (j + 16 * u) - 4 * t : 4; };
  auto tile_valid = [&](int u, int i) { return !kChecked || 16 * i + 2 * g < pass_cols ? valid_at(u) : 0; };
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int jj = j + 16 * u;
    if constexpr (std::is_same_v<TH, float>) {  // split after the trip's loads (split_h)
      const float4 hv = load_f4(h + jj + 4 * t, h_live ? valid_at(u) : 0);
      trip.h[u][0] = __float_as_uint(hv.x);
      trip.h[u][1] = __float_as_uint(hv.y);
      trip.h_lo[u][0] = __float_as_uint(hv.z);
      trip.h_lo[u][1] = __float_as_uint(hv.w);
    } else {
      const uint2 hv = load4(h + jj + 4 * t, h_live ? valid_at(u) : 0);
      trip.h[u][0] = hv.x;
      trip.h[u][1] = hv.y;
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const TB* col = b_lane + (int64_t)(16 * i) * b_stride1 + jj;
      trip.b[u][i][0] = load4(col, tile_valid(u, i));
      trip.b[u][i][1] = load4(col + b_stride1, tile_valid(u, i));
    }
  }
  if constexpr (std::is_same_v<TH, float>) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) split_h<TB>(trip.h[u], trip.h_lo[u]);
  }
  if constexpr (kChecked) {  // by the rank only: what the column check or h_live left unread is zeros already
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const uint64_t keep = keep_bits(valid_at(u));
      if constexpr (!std::is_same_v<TH, float>) {  // float32 h: load_f4 read none past the rank
        const uint2 hv = mask4(make_uint2(trip.h[u][0], trip.h[u][1]), keep);
        trip.h[u][0] = hv.x;
        trip.h[u][1] = hv.y;
      }
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        trip.b[u][i][0] = mask4(trip.b[u][i][0], keep);
        trip.b[u][i][1] = mask4(trip.b[u][i][1], keep);
      }
    }
  }
}

// The trip of ranks [j, j + 16 * kSteps): unchecked where it lies inside the rank and the pass is whole.
template <int kSteps, class TB, class TH>
__device__ __forceinline__ Trip<kSteps> trip_at(const TH* h, bool h_live, const TB* b_lane, int64_t b_stride1, int j,
                                                int rank, int pass_cols, int g, int t) {
  Trip<kSteps> trip;
  if (pass_cols >= kPassCols && j + 16 * kSteps <= rank) {
    load_trip<kSteps, false>(trip, h, h_live, b_lane, b_stride1, j, rank, pass_cols, g, t);
  } else {
    load_trip<kSteps, true>(trip, h, h_live, b_lane, b_stride1, j, rank, pass_cols, g, t);
  }
  return trip;
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

// What a caller of mma_ranks with nothing to do between the first trip's loads and its mma passes.
struct NoHook {};  // never called: mma_ranks tests for it by type

// acc += h[:rank] . B[the pass's columns, :rank]^T (b_lane: this lane's first B element of the pass), in trips
// of 16 * kSteps ranks, all of a trip's loads issued before its mma. loaded() runs between the first trip's loads
// and its mma, that trip then apart from the loop (inside it, ptxas hoisted loop-invariant work of loaded() above
// the loads); without a hook, one loop (the first trip apart cost the runs and segments kernels spills).
template <class TB, class TH, int kSteps, class Loaded = NoHook>
__device__ __forceinline__ void mma_ranks(float (&acc)[kTiles][4], const TH* h, bool h_live, const TB* b_lane,
                                          int64_t b_stride1, int rank, int pass_cols, int g, int t,
                                          Loaded&& loaded = {}) {
  constexpr int kTripRanks = 16 * kSteps;
  constexpr bool kHooked = !std::is_same_v<std::decay_t<Loaded>, NoHook>;
  auto trip_from = [&](int j) { return trip_at<kSteps>(h, h_live, b_lane, b_stride1, j, rank, pass_cols, g, t); };
  int j = 0;
  if constexpr (kHooked) {  // its one caller (expand_position) has rank > 0
    const Trip<kSteps> first = trip_from(0);
    loaded();
    mma_trip<TB, std::is_same_v<TH, float>>(first, acc);
    j = kTripRanks;
  }
  for (; j < rank; j += kTripRanks) mma_trip<TB, std::is_same_v<TH, float>>(trip_from(j), acc);
}

// The rows form's metadata of one position as loaded: token_indices[pos] (pos without them), seg.slot[pos], and
// the rank and scale of a slot (max_rank and 1 where not given or where the slot is out of range).
struct RawMeta {
  int32_t index = -1;  // token_indices[pos] (unused without them: the row is pos)
  int32_t slot = -1, rank = 0;
  float scale = 0.f;
};

// The slot of r, or -1 outside [0, num_slots).
__device__ __forceinline__ int64_t valid_slot(const ExpandParams& p, const RawMeta& r) {
  return r.slot >= 0 && r.slot < p.num_slots ? r.slot : -1;
}

// Loads through L2 only (ld.global.cg): the rows and runs kernels guess the metadata before the programmatic-launch
// wait, while the kernel before them may still write it, and load it again after the wait; a stale line left in L1
// by the guess would pass that check.
__device__ __forceinline__ void load_slot_meta(const ExpandParams& p, int64_t slot, RawMeta* r) {
  r->rank = (int32_t)p.max_rank;
  r->scale = 1.f;
  if (slot < 0) return;
  if (p.lora_ranks) r->rank = __ldcg(p.lora_ranks + slot);
  if (p.lora_scales) r->scale = __ldcg(p.lora_scales + slot);
}

// Position pos's token index and slot (the rank and scale not yet loaded).
__device__ __forceinline__ RawMeta load_position_meta(const ExpandParams& p, int64_t pos) {
  RawMeta r;
  if (p.seg.token_indices) r.index = __ldcg(p.seg.token_indices + pos);
  r.slot = __ldcg(p.seg.slot + pos);
  return r;
}

// Position pos's metadata with the rank and scale of slot `at`: one trip (no load waits for another's value).
__device__ __forceinline__ RawMeta load_meta_at(const ExpandParams& p, int64_t pos, int64_t at) {
  RawMeta r = load_position_meta(p, pos);
  load_slot_meta(p, at, &r);
  return r;
}

// Position pos's metadata: its slot, then that slot's rank and scale (two dependent trips).
__device__ __forceinline__ RawMeta read_meta(const ExpandParams& p, int64_t pos) {
  RawMeta r = load_position_meta(p, pos);
  load_slot_meta(p, valid_slot(p, r), &r);
  return r;
}

// What the kernels use: the row and slot (-1 outside their ranges) and, where both are in range, the slot's rank
// (clamped to max_rank) and coefficient (rank 0: nothing to add).
struct RowMeta {
  int64_t row = -1, slot = -1;
  int rank = 0;
  float coef = 0.f;
};

// Position pos's RowMeta from its raw metadata. The kernels derive a guess before the wait: derived after it, the
// derivation's wait for the guess's loads would also wait for the check's, issued since on the same scoreboard.
__device__ __forceinline__ RowMeta derive(const ExpandParams& p, const RawMeta& r, int64_t pos) {
  RowMeta m;
  const int64_t t = p.seg.token_indices ? (int64_t)r.index : pos;
  m.row = t >= 0 && t < p.rows ? t : -1;
  m.slot = valid_slot(p, r);
  // Selects, not a branch: every path consumes the loads here (a path that skipped them left a later write of
  // their registers waiting on a scoreboard that the check's loads share).
  m.rank = m.row >= 0 && m.slot >= 0 ? (int)clamp_index(r.rank, 0, p.max_rank) : 0;
  m.coef = m.rank > 0 ? p.scale * r.scale : 0.f;
  return m;
}

// m in registers of its own before the wait: ptxas gives the guess's loads and the check's one scoreboard, so a
// first use of a guessed value after the wait (e.g. the row in y's address) would wait for the check's loads too,
// before y's are issued. A shuffle is a use that no copy elision removes (an empty asm is not: the loaded register
// itself satisfies it). From lane `src`: the rows kernel's lanes all guess the same position, and take one guess.
__device__ __forceinline__ void settle(RowMeta& m, int src) {
  m.row = __shfl_sync(kAll, m.row, src);
  m.slot = __shfl_sync(kAll, m.slot, src);
  m.rank = __shfl_sync(kAll, m.rank, src);
  m.coef = __shfl_sync(kAll, m.coef, src);
}

// Whether `check`, position pos's metadata loaded after the wait at the slot of the guess m, gives m again: then
// m is the metadata (the same row and slot, so that slot's rank and scale); bit for bit (a NaN scale is the same
// NaN). The empty asm keeps everything that consumes the check's loads where this is called: after the loads of
// y, h and B are issued (hoisted above them, it cost the guess its gain).
__device__ __forceinline__ bool confirmed(const ExpandParams& p, const RowMeta& m, RawMeta check, int64_t pos) {
  asm volatile("" : "+r"(check.index), "+r"(check.slot), "+r"(check.rank), "+f"(check.scale) : : "memory");
  const RowMeta c = derive(p, check, pos);
  return c.row == m.row && c.slot == m.slot && c.rank == m.rank &&
         __float_as_uint(c.coef) == __float_as_uint(m.coef);
}

// Position pos (metadata m) over the columns [n0, n1) of slice `slice`, by one warp: passes of 128 columns, each
// in trips of 16 * kSteps ranks (all of a trip's loads issued before its mma). `checking`: m was guessed before
// the wait and `check` loaded after it; they are compared once the first trip's loads are issued, and where they
// differ the warp returns false before its first store, having written nothing.
template <class TB, class TH, class TY, int kSteps>
__device__ __forceinline__ bool expand_position(const ExpandParams& p, int64_t pos, const RowMeta& m,
                                                const RawMeta& check, bool checking, int slice, int n0, int n1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (m.rank == 0) return !checking || __all_sync(kAll, confirmed(p, m, check, pos));
  const int64_t row = m.row, slot = m.slot;
  const int rank = m.rank;
  const float coef = m.coef;
  const TH* h = static_cast<const TH*>(p.h) + row * p.h_row_stride + slot * p.h_slot_stride + slice * p.max_rank;
  const TB* b = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0;
  TY* y = static_cast<TY*>(p.y) + row * p.y_row_stride;
#pragma unroll
  for (int i = 0; i < kMaxPasses; ++i) {  // unrolled: the check of the first is then no loop's invariant
    const int pass = n0 + i * kPassCols;
    if (pass >= n1) break;
    // The y pairs this lane adds to (tile t, + 4k), loaded first: they do not wait for B. Even columns and
    // aligned rows (checked on the host): one access each.
    YCols<TY, 2, true> y_pairs[kTiles / 4];
#pragma unroll
    for (int quad = 0; quad < kTiles / 4; ++quad) {
      const int col = pass + 16 * (4 * quad + t) + 2 * g;
      if (col < n1) y_pairs[quad].load(y + col, 2);
    }
    float acc[kTiles][4] = {};
    bool stale = false;
    mma_ranks<TB, TH, kSteps>(acc, h, true, b + (int64_t)(pass + 2 * g) * p.b_stride1 + 4 * t, p.b_stride1, rank,
                              n1 - pass, g, t, [&] {
                                if (checking && i == 0) stale = !__all_sync(kAll, confirmed(p, m, check, pos));
                              });
    if (stale) return false;  // before the first store
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
  return true;
}

// Up to 8 rows over the columns [n0, n1) of slice `slice`, by one warp: the rows are the mma's N, lane i < 8
// holding N column i's row, slot, rank (0: nothing to add) and coefficient, and the warp loads a slot's B once for
// the run of its rows among them. Lane (g, t) then reads h of N column g and adds to rows 2t, 2t + 1 (its C
// fragment's columns). A run's product is added to its own rows only, so nothing of one slot's B (a NaN, an inf)
// reaches the rows of another slot through their zero h. `checking` (warp-uniform): each lane's guess was loaded
// before the wait and its check after it; where a lane's differ, the warp returns false before its first store,
// having written nothing.
// kPipeline (RunsPipeline): where every run of the warp's rows fits one trip, Copy issues the next run's trip before
// this run's mma, so that a warp of n >= 2 runs waits n - 1 trips for its B instead of n (the llama3-8b decode step
// at 64-96 tokens and 32 adapters -2.2 to -3.4 points, NOTES.md session 37); its second trip in registers needs 3
// CTAs per SM. (Two trip buffers in turn, ~n / 2 trips at 200 registers and 2 CTAs per SM, measured no better:
// NOTES.md session 38.)
template <class TB, class TH, class TY, int kSteps, RunsPipeline kPipeline>
__device__ __forceinline__ bool expand_runs(const ExpandParams& p, int64_t pos, const RowMeta& m,
                                            const RawMeta& check, bool checking, int slice, int n0, int n1) {
  constexpr int kTripRanks = 16 * kSteps;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t slot = m.slot;
  const int rank = m.rank;
  const float coef = m.coef;
  const unsigned live = __ballot_sync(kAll, lane < kRunPositions && rank > 0);
  if (live == 0) return !checking || __all_sync(kAll, confirmed(p, m, check, pos));
  // The launch takes the pipelined kernels at max_rank <= 16 only; checked here too, so that they stay right alone.
  const bool one_trip_runs = kPipeline != RunsPipeline::None && __all_sync(kAll, rank <= kTripRanks);
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
    // The next run among `todo`: its slot, rank and rows (lanes), taken out of `todo`.
    struct Run {
      int64_t slot;
      int rank;
      unsigned rows;
    };
    auto take_run = [&](unsigned& todo) {
      const int lead = __ffs(todo) - 1;
      Run run{__shfl_sync(kAll, slot, lead), __shfl_sync(kAll, rank, lead), 0u};
      run.rows = __ballot_sync(kAll, (todo >> lane & 1) && slot == run.slot);
      todo &= ~run.rows;
      return run;
    };
    const TB* b_pass = static_cast<const TB*>(p.lora_b) + (int64_t)(pass + 2 * g) * p.b_stride1 + 4 * t;
    // acc's run into its rows' y: false where the guess was stale (before the warp's first store).
    auto add_run = [&](const Run& run, const float (&acc)[kTiles][4]) {
      if (checking) {  // the first run: before any store
        if (!__all_sync(kAll, confirmed(p, m, check, pos))) return false;
        checking = false;
      }
      // C fragment: elements 0, 2 are row 2t's columns 2g, 2g + 1; elements 1, 3 row 2t + 1's. A row is in one
      // run, so its y is written once. The coefficients are shuffled here, not before the loads: their load
      // (lora_scales) need not finish before the trip's are issued.
      const float y_coef[2] = {__shfl_sync(kAll, coef, 2 * t), __shfl_sync(kAll, coef, 2 * t + 1)};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!(run.rows >> (2 * t + r) & 1)) continue;
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const int col = pass + 16 * i + 2 * g;
          if (col >= n1) continue;
          y_pairs[r][i].v[0] = from_f32<TY>(to_f32(y_pairs[r][i].v[0]) + y_coef[r] * acc[i][r]);
          y_pairs[r][i].v[1] = from_f32<TY>(to_f32(y_pairs[r][i].v[1]) + y_coef[r] * acc[i][r + 2]);
          y_pairs[r][i].store(y[r] + col, 2);
        }
      }
      return true;
    };
    unsigned todo = live;
    if (one_trip_runs) {
      auto load_run = [&](const Run& run) {
        return trip_at<kSteps>(h_lane + run.slot * p.h_slot_stride, (run.rows >> g & 1) != 0,
                               b_pass + run.slot * p.b_stride0, p.b_stride1, 0, run.rank, n1 - pass, g, t);
      };
      Run run = take_run(todo);
      Trip<kSteps> trip = load_run(run);
      for (;;) {
        const bool more = todo != 0;  // warp-uniform
        Run next = run;
        Trip<kSteps> next_trip = trip;
        if (more) {
          next = take_run(todo);
          next_trip = load_run(next);
        }
        float acc[kTiles][4] = {};
        mma_trip<TB, std::is_same_v<TH, float>>(trip, acc);
        if (!add_run(run, acc)) return false;
        if (!more) break;
        run = next;
        trip = next_trip;
      }
      continue;
    }
    while (todo != 0) {
      const Run run = take_run(todo);
      float acc[kTiles][4] = {};
      mma_ranks<TB, TH, kSteps>(acc, h_lane + run.slot * p.h_slot_stride, (run.rows >> g & 1) != 0,
                                b_pass + run.slot * p.b_stride0, p.b_stride1, run.rank, n1 - pass, g, t);
      if (!add_run(run, acc)) return false;
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
  // The row, rank and scale loaded together, none behind a test of another: the rank and scale need only the
  // walk's slot (in range), and the row is loaded at a position inside the tile (begin < end) for every lane. Behind
  // the row's test each waited for the load before it, row -> rank -> scale: three round trips before the trip's.
  const int64_t row = segment_row(p.seg, std::min<int64_t>(ref.begin + lane, ref.end - 1), p.rows);
  const int rank = (int)slot_size(p.lora_ranks, ref.slot, p.max_rank);
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[ref.slot] : 1.f);
  RowMeta m;
  m.row = ref.begin + lane < ref.end ? row : -1;
  m.slot = ref.slot;
  m.rank = m.row >= 0 ? rank : 0;
  m.coef = coef;
  expand_runs<TB, TH, TY, kSteps, RunsPipeline::None>(p, 0, m, RawMeta{}, /*checking=*/false, slice, n0, n1);
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
// A warp takes one position (rows kernel), kPositions (runs kernel: 4 or kRunPositions) or a tile of up to
// kRunPositions positions of one segment (segments kernel).
//
// The rows and runs kernels, where they are launched programmatically (kGuesses), load their first positions'
// metadata before the wait: after a kernel that lets its dependents start early (fold_linear's GEMM), its two
// dependent trips (slot, then rank and scale) overlap that kernel's end instead of following it. The op cannot know
// what the previous kernel writes: after the wait the same metadata is loaded again at the guessed slot in one trip
// and compared before the first store; a warp whose guess was stale redoes its positions from metadata loaded after
// the wait. In the rows kernel's SASS that trip is issued with the loads of y, h and B; the runs kernel's loads of y
// still wait for it (NOTES.md, session 24).
//
// kGuesses: launch_lora_expand_mma's rule for a programmatic launch (one rank step, sm_90 on). Elsewhere the launch
// is not programmatic, the wait returns at once, and a guess would only add its check.
template <int kSteps>
__device__ constexpr bool kGuesses =
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    kSteps == 1;
#else
    false;
#endif

template <class TB, class TH, class TY, int kSteps>
__global__ void __launch_bounds__(32 * kWarps, kSteps == 1 ? 4 : 3)
    expand_rows_kernel(ExpandParams p, int passes) {
  int slice, n0, n1;
  if (!cta_columns(p, passes, &slice, &n0, &n1)) return;
  const int64_t stride = (int64_t)gridDim.y * kWarps;
  int64_t pos = (int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5);
  auto meta = [&] { return pos < p.seg.positions ? derive(p, read_meta(p, pos), pos) : RowMeta{}; };
  if constexpr (kGuesses<kSteps>) {
    RowMeta m = meta();
    settle(m, 0);
    grid_dependency_wait();
    if (pos >= p.seg.positions) return;
    // The first position apart, so that no other path merges in before its check's loads (a merge made ptxas
    // wait for them before the loads of y); the loop below is the rest, and a redo of a stale first.
    if (expand_position<TB, TH, TY, kSteps>(p, pos, m, load_meta_at(p, pos, m.slot), /*checking=*/true, slice, n0,
                                            n1)) {
      pos += stride;
    }
  } else {
    grid_dependency_wait();
  }
  for (; pos < p.seg.positions; pos += stride) {
    expand_position<TB, TH, TY, kSteps>(p, pos, meta(), RawMeta{}, /*checking=*/false, slice, n0, n1);
  }
}

// CTAs per SM of the runs and segments kernels: 4 at one rank step with a 16-bit y (128 registers), so that
// gate_up's 448 CTAs at T=128 run in one wave instead of 1.13 (H200, 9f31ff2 -> this: the runs kernel at T=1024
// 11.67 -> 9.10 us, the segments kernel 13.08 -> 10.02, the llama3-8b decode step at T=128/32 +28.6 -> +26.7%).
// The rows kernel stays at 4: at 5 (96 registers) it was slower at T=32 (gate_up 11.47 -> 11.94). The pipelined
// runs kernel (two trips in registers, 158) takes 3.
template <class TY, int kSteps, RunsPipeline kPipeline = RunsPipeline::None>
constexpr int kRunsCtasPerSm = kSteps == 1 ? (sizeof(TY) == 2 && kPipeline == RunsPipeline::None ? 4 : 3) : 2;

// kPositions: a warp's positions (the mma's N is 8: at 4, its other 4 columns are rows outside every run).
template <class TB, class TH, class TY, int kSteps, RunsPipeline kPipeline, int kPositions = kRunPositions>
__global__ void __launch_bounds__(32 * kWarps, kRunsCtasPerSm<TY, kSteps, kPipeline>)
    expand_runs_kernel(ExpandParams p, int passes) {
  static_assert(kPositions >= 1 && kPositions <= kRunPositions, "a warp's positions are the mma's N columns");
  int slice, n0, n1;
  if (!cta_columns(p, passes, &slice, &n0, &n1)) return;
  // Lane i < kPositions holds position pos0 + i's metadata (none past the positions and on the other lanes).
  const int lane = threadIdx.x & 31;
  const int64_t stride = (int64_t)gridDim.y * kWarps * kPositions;
  int64_t pos0 = ((int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5)) * kPositions;
  auto mine = [&] { return lane < kPositions && pos0 + lane < p.seg.positions; };
  auto lane_meta = [&] { return mine() ? derive(p, read_meta(p, pos0 + lane), pos0 + lane) : RowMeta{}; };
  RowMeta m;
  if constexpr (kGuesses<kSteps>) m = lane_meta();
  grid_dependency_wait();
  if constexpr (!kGuesses<kSteps>) m = lane_meta();
  for (bool checking = kGuesses<kSteps>; pos0 < p.seg.positions; checking = false) {
    // Lanes without a position check nothing: their default check at position -1 gives RowMeta{} again.
    const RawMeta check = checking && mine() ? load_meta_at(p, pos0 + lane, m.slot) : RawMeta{};
    if (expand_runs<TB, TH, TY, kSteps, kPipeline>(p, mine() ? pos0 + lane : -1, m, check, checking, slice,
                                                    n0, n1)) {
      pos0 += stride;
    }
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
cudaError_t passes_of(const ExpandParams& p, int64_t groups, int* passes) {
  int64_t resident = 0;
  const cudaError_t err = resident_ctas<kKernel>(32 * kWarps, &resident);
  if (err != cudaSuccess) return err;
  const int64_t one_pass = slice_column_blocks(p, kPassCols) * groups;
  *passes = (int)std::clamp<int64_t>((one_pass + resident - 1) / resident, 1, kMaxPasses);
  return cudaSuccess;
}

template <auto kKernel>
cudaError_t launch_passes(const ExpandParams& p, int64_t groups, int passes, bool pdl, cudaStream_t stream) {
  const int64_t blocks = slice_column_blocks(p, passes * kPassCols);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)blocks, (unsigned)std::min<int64_t>(groups, 65535));
  return launch_pdl(kKernel, grid, 32 * kWarps, pdl, stream, p, passes);
}

template <auto kKernel>
cudaError_t launch_kernel(const ExpandParams& p, int64_t groups, bool pdl, cudaStream_t stream) {
  int passes = 0;
  const cudaError_t err = passes_of<kKernel>(p, groups, &passes);
  return err != cudaSuccess ? err : launch_passes<kKernel>(p, groups, passes, pdl, stream);
}

// kKernel where its one-pass grid is resident at once (*launched), else nothing.
template <auto kKernel>
cudaError_t launch_if_one_pass(const ExpandParams& p, int64_t groups, bool pdl, cudaStream_t stream, bool* launched) {
  int passes = 0;
  const cudaError_t err = passes_of<kKernel>(p, groups, &passes);
  *launched = err == cudaSuccess && passes == 1;
  return *launched ? launch_passes<kKernel>(p, groups, 1, pdl, stream) : err;
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
      // CTAs of kWarps warps over the positions, `per_warp` of them a warp
      auto groups_of = [&](int per_warp) { return (p.seg.positions + kWarps * per_warp - 1) / (kWarps * per_warp); };
      const int64_t groups = groups_of(kRunPositions);
      if constexpr (sizeof(TY) == 2 && !std::is_same_v<TH, float>) {  // else 3 CTAs per SM spill the second trip
        if (p.max_rank <= 16) {  // every run one trip: the pipelined kernel, where its one-pass grid fits at once,
          // else the unpipelined kernel's 4 CTAs per SM pay (gate_up at 128 tokens: 448 two-pass CTAs in one wave,
          // 1.13 waves at 3 per SM). First on 4 positions a warp where that grid fits: half the runs in a warp's
          // chain, twice the warps (llama3-8b decode step at T=64/32 -3.1 points, T=128/32 -0.3 to -1.0; NOTES.md
          // session 40).
          bool launched = false;
          const cudaError_t err4 = launch_if_one_pass<expand_runs_kernel<TB, TH, TY, 1, RunsPipeline::Copy, 4>>(
              p, groups_of(4), pdl, stream, &launched);
          if (launched || err4 != cudaSuccess) return err4;
          const cudaError_t err = launch_if_one_pass<expand_runs_kernel<TB, TH, TY, 1, RunsPipeline::Copy>>(
              p, groups, pdl, stream, &launched);
          if (launched || err != cudaSuccess) return err;
        } else if (p.max_rank > 32 && p.max_rank <= 64 &&
                   p.seg.positions < kRunsWideTripMaxPositionsPerSlot * p.num_slots) {
          // Few rows a slot: at rank 64 and 16 adapters over 64 tokens a warp's 8 positions span ~2.7 runs of two
          // 32-rank trips each; here one trip a run, on ~1.7 runs where the 4-position grid fits (H200, 10c8576:
          // the decode step at 64/16/64 +58.4 -> +54.3% on llama3-8b, +63.0 -> +58.0% on qwen2-7b; at 96 tokens a
          // tie, at 128 1-2 points slower, hence the bound; 246 registers, 2 CTAs per SM).
          bool launched = false;
          const cudaError_t err = launch_if_one_pass<expand_runs_kernel<TB, TH, TY, 4, RunsPipeline::None, 4>>(
              p, groups_of(4), pdl, stream, &launched);
          if (launched || err != cudaSuccess) return err;
          return launch_kernel<expand_runs_kernel<TB, TH, TY, 4, RunsPipeline::None>>(p, groups, pdl, stream);
        }
      }
      return two ? launch_kernel<expand_runs_kernel<TB, TH, TY, 2, RunsPipeline::None>>(p, groups, pdl, stream)
                 : launch_kernel<expand_runs_kernel<TB, TH, TY, 1, RunsPipeline::None>>(p, groups, pdl, stream);
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
  // 19; again with the 64-rank trip on an H100, session 48: T=64 +48.5 -> +57.3%), while at rank 16 it is the fold
  // route's gain (T=16: +24.1 -> +21.1%). Nor is it where the early CTAs land: held to one a SM by unused shared
  // memory, the early launch still lost (H100, session 51: T=64 +51.5 -> +57.3%).
  const bool pdl = cc_major >= 9 && !two_rank_steps(p);  // the rows and runs kernels' kGuesses follows this rule
  if (p.b_dtype == DType::F16) return launch_typed<__half, __half>(p, kernel, pdl, stream);  // float32 h: bf16 B only
  return p.h_dtype == DType::F32 ? launch_typed<__nv_bfloat16, float>(p, kernel, pdl, stream)
                                 : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, kernel, pdl, stream);
}

}  // namespace lora_ops::cuda
