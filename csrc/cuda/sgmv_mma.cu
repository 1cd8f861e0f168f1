// sgmv, prefill regime (many rows per adapter), fp16/bf16 with 16-byte aligned rows: tensor cores.
// One CTA (4 warps x 16 rows; at a 128-wide rank tile 8 warps, two per 16 rows, each with half the ranks in the
// shrink and half the columns in the expand) per tile of 64 positions of one segment and group of slices:
//   shrink: h[64, RT] += X[64, K] A[RT, K]^T with mma.sync m16n8k16 (fp32 accumulators), X rows gathered
//           through token_indices, both tiles streamed by a 3-stage cp.async pipeline (x read once);
//   expand: h stays on chip: the accumulator fragments ARE the A fragments of the next mma (at a 128-wide rank
//           tile the two warps of a row block swap their rank halves through shared memory). For a float32
//           y, h is split hi + lo into two half-precision fragments, so the product keeps ~16 mantissa bits of
//           the float32 intermediate; for a half-precision y one rounding of h (in registers) is below y's own
//           rounding and halves the expand's tensor work. For each 64-column tile, B and the y tile stream in
//           (3 stages), y += h.B^T is written back through shared memory with 16-byte stores (y read and written
//           once).
// Slices of a group share the tile: B rows are placed block-diagonally (zero outside their slice). A batch with
// too few tiles to fill the GPU takes groups of fewer slices (more CTAs; x re-read from L2).
// On Hopper a tile is split over a cluster of C CTAs: each shrinks 1/C of K, the partial h tiles are summed
// in member order through distributed shared memory (reduce-scatter then all-gather: deterministic), and each
// expands 1/C of the columns: x, A, B and y are still read once, with C times the CTAs in flight.
#include <algorithm>

#include "kernels.h"
#include "mma.cuh"
#include "sgmv_tile.cuh"

namespace lora_ops::cuda {
namespace {

constexpr int kRowWarps = kTileRows / 16;  // warps along the tile's rows, 16 rows each
constexpr int kBK = 64;
constexpr int kBN = 64;
constexpr int kStages = 3;
constexpr int kPad = 8;  // elements of padding per shared row: conflict-free ldmatrix

// Two adjacent elements, accessed together.
template <class V>
struct alignas(2 * sizeof(V)) Pair {
  V e[2];
};

// Warps across the rank in the shrink and across the columns in the expand. At rank tile 128 two: each warp then
// accumulates half the ranks of its 16 rows (32 floats instead of 64), so the kernel fits 128 registers and 8 warps
// per CTA; with 4 it took 184 registers, 2 CTAs of 4 warps per SM (H200: 93.8 -> 88.1 us at T=4096, rank 128;
// csrc/cuda/NOTES.md, session 25). The float32-y build sits at exactly 128 (its a_hi and a_lo hold 64 registers
// through the expand): check -Xptxas -v after any change.
template <int RT>
constexpr int kColWarps = RT == 128 ? 2 : 1;
template <int RT>
constexpr int kCtaThreads = 32 * kRowWarps * kColWarps<RT>;

template <int RT, class TY>
struct Smem {
  static constexpr int kYPad = 16 / sizeof(TY);
  static constexpr size_t shrink_stage = (size_t)(kTileRows + RT) * (kBK + kPad) * 2;
  static constexpr size_t expand_b = (size_t)kBN * (RT + kPad) * 2;
  static constexpr size_t expand_y = (size_t)kTileRows * (kBN + kYPad) * sizeof(TY);
  static constexpr size_t expand_stage = expand_b + expand_y;
  static constexpr size_t bytes = std::max(kStages * shrink_stage, kStages * expand_stage);
  // The cluster sum's buffers (cluster_async_sum_h: receive rows and sums, as y's type) lie past the expand's first
  // kStages - 1 stages where they fit, so that those stages load while the cluster sums h; at a 128-wide rank tile
  // (where the warps' swap of rank halves needs the buffer too) and at 64 they do not: there the expand loads after
  // the sum.
  static constexpr size_t sum_bytes = async_sum_bytes<kCtaThreads<RT>, RT / kColWarps<RT> / 8, TY>();
  static constexpr bool early_expand = kColWarps<RT> == 1 && (kStages - 1) * expand_stage + sum_bytes <= bytes;
  static constexpr size_t sum_at = early_expand ? (kStages - 1) * expand_stage : 0;
  static_assert(sum_at % 16 == 0 && sum_at + sum_bytes <= bytes, "the sum's float4s");
  // CTAs that fit an SM's shared memory on Hopper (228 KB, 1 KB reserved per CTA, ~0.6 KB static): the register
  // budget is set to allow as many, so registers never bound the occupancy more than shared memory does.
  static constexpr int ctas_per_sm = std::max<int>(1, (228 << 10) / (bytes + (1 << 10) + 640));
};

template <class T, class TY, int RT>
__global__ void __launch_bounds__(kCtaThreads<RT>, (Smem<RT, TY>::ctas_per_sm))
    sgmv_mma_kernel(SgmvParams p, MmaPlan plan) {
  using L = Smem<RT, TY>;
  constexpr int kThreads = kCtaThreads<RT>;
  constexpr int kWarpRanks = RT / kColWarps<RT>;  // of a warp's shrink
  constexpr int kWarpCols = kBN / kColWarps<RT>;  // of a warp's expand, per 64-column tile
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int64_t s_rows[kTileRows];
  TY* y = static_cast<TY*>(p.y);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % kRowWarps, wc = warp / kRowWarps;  // the warp's rows, and its rank / column share
  const int64_t member = blockIdx.x % plan.cluster, unit = blockIdx.x / plan.cluster;
  const int64_t tile_idx = unit / plan.groups, group = unit % plan.groups;
  TileRef tile;
  if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, tile_idx, &tile, s_rows, p.lora_ranks, p.max_rank)) {
    return;
  }
  const int rp = (int)plan.rank_pad;
  if (tile.size == 0) return;  // every member of the cluster sees the same tile: they leave together
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[tile.slot] : 1.f);
  const int64_t s0 = group * plan.slices_per_group, s1 = std::min<int64_t>(p.num_slices, s0 + plan.slices_per_group);

  // ---------------- shrink: h = X A^T ----------------
  const ShrinkSources<T, RT, kThreads, kBK, kTileRows> shrink_src(p, s_rows, tile, rp, s0, s1);
  using KRows = typename decltype(shrink_src)::Rows;
  auto xs = [&](int st) { return reinterpret_cast<T*>(smem + st * L::shrink_stage); };
  auto as = [&](int st) { return xs(st) + kTileRows * (kBK + kPad); };
  auto load_shrink = [&](int st, int64_t k0) {
    T* X = xs(st) + KRows::r0() * (kBK + kPad) + shrink_src.kc;
    T* A = as(st) + KRows::r0() * (kBK + kPad) + shrink_src.kc;
    shrink_src.load(p, k0, [&](int i) { return X + i * KRows::kRowStep * (kBK + kPad); },
                    [&](int i) { return A + i * KRows::kRowStep * (kBK + kPad); });
  };
  float h[kWarpRanks / 8][4] = {};
  int64_t kt_begin, kt_end;
  split_range((p.k + kBK - 1) / kBK, plan.cluster, member, &kt_begin, &kt_end);
  const int k_tiles = (int)(kt_end - kt_begin);  // a member's tiles fit int: 2^31 tiles would be a 2^37-element row
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < k_tiles) load_shrink(st, (kt_begin + st) * kBK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_shrink(next % kStages, (kt_begin + next) * kBK);
    cp_async_commit();
    const T* X = xs(kt % kStages);
    const T* A = as(kt % kStages);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[4];
      ldmatrix_x4(af, X + (wr * 16 + (lane % 16)) * (kBK + kPad) + kk + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < kWarpRanks / 16; ++np) {
        uint32_t bf[4];
        ldmatrix_x4(bf, A + (wc * kWarpRanks + np * 16 + (lane % 8) + (lane / 16) * 8) * (kBK + kPad) + kk +
                            ((lane / 8) % 2) * 8);
        mma16816<T>(h[2 * np], af, &bf[0]);
        mma16816<T>(h[2 * np + 1], af, &bf[2]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the shrink's buffers are drained: the expand's stages may take them

  // ---------------- expand: y += h B^T over the group's columns ----------------
  // Set up here, so that its first stages of B and y (which do not depend on h) can load during the cluster's sum
  // (session 26's trace: the sum took 3.1 us of a CTA's 32.5 at T=4096, rank 16, and the expand then waited for
  // its first loads).
  const int64_t c_begin = p.slice_offsets[s0], c_end = p.slice_offsets[s1];
  const ExpandBSource<T, RT, kThreads, kBN> b_src(p, tile, rp, s0, s1);
  using BRows = typename decltype(b_src)::Rows;
  // y: each thread copies one column chunk (yc) of the tile rows first + i * step, in and out.
  constexpr int kYVec = 16 / sizeof(TY);
  using YRows = Pieces<TY, kTileRows, kBN, kThreads>;
  static_assert(kTileRows % YRows::kRowStep == 0, "y rows split evenly");
  const int yc = YRows::c();
  // Made from the tile's rows at each use, not kept: the expand's registers hold acc, h and the B copy state.
  auto y_row = [&](int i) -> TY* {
    const int64_t row = s_rows[YRows::r0() + i * YRows::kRowStep];
    return row >= 0 ? y + row * p.y_row_stride + yc : nullptr;
  };
  auto bs = [&](int st) { return reinterpret_cast<T*>(smem + st * L::expand_stage); };
  auto ys = [&](int st) { return reinterpret_cast<TY*>(smem + st * L::expand_stage + L::expand_b); };
  auto load_expand = [&](int st, int64_t n0) {
    T* B = bs(st) + BRows::r0() * (RT + kPad) + b_src.j8;
    b_src.load(p, n0, [&](int i) { return B + i * BRows::kRowStep * (RT + kPad); });
    TY* Y = ys(st) + YRows::r0() * (kBN + L::kYPad) + yc;
    const bool in = n0 + yc + kYVec <= c_end;  // see the write-back
#pragma unroll
    for (int i = 0; i < kTileRows / YRows::kRowStep; ++i) {
      TY* row = in ? y_row(i) : nullptr;
      cp_async16(Y + i * YRows::kRowStep * (kBN + L::kYPad), row ? row + n0 : y, row ? 16 : 0);
    }
  };
  int64_t nt_begin, nt_end;
  split_range((c_end - c_begin + kBN - 1) / kBN, plan.cluster, member, &nt_begin, &nt_end);
  const int n_tiles = (int)(nt_end - nt_begin);
  const int64_t n_first = c_begin + nt_begin * kBN;
  auto expand_prologue = [&] {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles) load_expand(st, n_first + st * kBN);
      cp_async_commit();
    }
  };
  if constexpr (L::early_expand) expand_prologue();

  // h (C fragments) -> A fragments for the expand, scaled, split hi + lo (lo only used for a float32 y); over a
  // cluster with a half-precision y the sum's owners scale and round it (h then holds values of T exactly).
  constexpr bool kSplit = std::is_same_v<TY, float>;
  const float h_coef = plan.cluster > 1 ? cluster_async_sum_h<kThreads, kWarpRanks / 8, TY>(
                                              smem + L::sum_at, &h[0][0], coef, (int)member, (int)plan.cluster)
                                        : coef;
  uint32_t h_hi[kWarpRanks / 16][4], h_lo[kWarpRanks / 16][4];
#pragma unroll
  for (int ks = 0; ks < kWarpRanks / 16; ++ks) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* c = h[2 * ks + half];
      split_pack<T>(make_float2(c[0] * h_coef, c[1] * h_coef), &h_hi[ks][2 * half], &h_lo[ks][2 * half]);
      split_pack<T>(make_float2(c[2] * h_coef, c[3] * h_coef), &h_hi[ks][2 * half + 1], &h_lo[ks][2 * half + 1]);
    }
  }
  // With rank shares, the warps of a row block swap theirs through shared memory (free: the shrink's buffers are
  // drained and no peer reads them any more), so that each holds every rank of its 16 rows for the expand.
  uint32_t a_hi[RT / 16][4], a_lo[RT / 16][4];
  if constexpr (kColWarps<RT> == 1) {
#pragma unroll
    for (int ks = 0; ks < RT / 16; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a_hi[ks][j] = h_hi[ks][j];
        if constexpr (kSplit) a_lo[ks][j] = h_lo[ks][j];
      }
    }
  } else {
    constexpr int kWords = kThreads * (kWarpRanks / 16) * 4;  // one array of every warp's fragments
    static_assert(2 * kWords * sizeof(uint32_t) <= L::bytes);
    uint32_t* frags = reinterpret_cast<uint32_t*>(smem);
    // Word j of fragment ks of warp w's lane: lane-contiguous (no bank conflicts).
    auto at = [&](int w, int ks, int j) { return ((w * (kWarpRanks / 16) + ks) * 4 + j) * 32 + lane; };
#pragma unroll
    for (int ks = 0; ks < kWarpRanks / 16; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        frags[at(warp, ks, j)] = h_hi[ks][j];
        if constexpr (kSplit) frags[kWords + at(warp, ks, j)] = h_lo[ks][j];
      }
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < RT / 16; ++ks) {
      const int owner = ks / (kWarpRanks / 16) * kRowWarps + wr;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a_hi[ks][j] = frags[at(owner, ks % (kWarpRanks / 16), j)];
        if constexpr (kSplit) a_lo[ks][j] = frags[kWords + at(owner, ks % (kWarpRanks / 16), j)];
      }
    }
    __syncthreads();  // before the expand's loads reuse the buffer
  }

  if constexpr (!L::early_expand) expand_prologue();
  for (int nt = 0; nt < n_tiles; ++nt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = nt + kStages - 1;
    if (next < n_tiles) load_expand(next % kStages, n_first + (int64_t)next * kBN);
    cp_async_commit();
    const T* B = bs(nt % kStages);
    TY* Y = ys(nt % kStages);
    float acc[kWarpCols / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < RT / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kWarpCols / 16; ++np) {
        uint32_t bf[4];
        ldmatrix_x4(bf, B + (wc * kWarpCols + np * 16 + (lane % 8) + (lane / 16) * 8) * (RT + kPad) + ks * 16 +
                            ((lane / 8) % 2) * 8);
        mma16816<T>(acc[2 * np], a_hi[ks], &bf[0]);
        mma16816<T>(acc[2 * np + 1], a_hi[ks], &bf[2]);
        if constexpr (kSplit) {
          mma16816<T>(acc[2 * np], a_lo[ks], &bf[0]);
          mma16816<T>(acc[2 * np + 1], a_lo[ks], &bf[2]);
        }
      }
    }
    // y tile += acc in shared memory (each element has one owner; a fragment's two adjacent columns are one
    // access), then 16-byte stores of valid chunks.
#pragma unroll
    for (int t8 = 0; t8 < kWarpCols / 8; ++t8) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wr * 16 + lane / 4 + half * 8, c = wc * kWarpCols + t8 * 8 + (lane % 4) * 2;
        Pair<TY>* dst = reinterpret_cast<Pair<TY>*>(Y + r * (kBN + L::kYPad) + c);
        Pair<TY> v = *dst;
        v.e[0] = from_f32<TY>(to_f32(v.e[0]) + acc[t8][2 * half]);
        v.e[1] = from_f32<TY>(to_f32(v.e[1]) + acc[t8][2 * half + 1]);
        *dst = v;
      }
    }
    __syncthreads();
    // Slices start and end on multiples of 8 columns (sgmv_mma_supported): a chunk is all in or all out.
    const int64_t n0 = n_first + (int64_t)nt * kBN;
    if (n0 + yc + kYVec > c_end) continue;
    const TY* src = Y + YRows::r0() * (kBN + L::kYPad) + yc;
#pragma unroll
    for (int i = 0; i < kTileRows / YRows::kRowStep; ++i) {
      if (TY* row = y_row(i)) {
        const TY* chunk = src + i * YRows::kRowStep * (kBN + L::kYPad);
        *reinterpret_cast<uint4*>(row + n0) = *reinterpret_cast<const uint4*>(chunk);
      }
    }
  }
  if (plan.cluster > 1) cluster_async_sum_done();
}

MmaPlan make_plan(const SgmvParams& p, int num_sms, int cc_major, int forced_cluster) {
  MmaPlan plan{};
  plan.rank_pad = (p.max_rank + 15) / 16 * 16;
  const int64_t P = p.seg.positions;
  plan.max_tiles = max_segment_tiles(p.seg, kTileRows);
  // Clusters (Hopper) keep >= 4 K tiles of the shrink per member on average.
  const int64_t k_tiles = (p.k + kBK - 1) / kBK;
  auto cluster_fits = [&](int64_t c) { return cc_major >= 9 && c <= kMaxCluster && k_tiles / c >= 4; };
  int64_t widest = 1;
  while (cluster_fits(widest * 2)) widest *= 2;
  // Slices share a rank tile (x is then read once for all of them) unless even the widest clusters would give
  // fewer than two CTAs per SM, counting the tiles of long segments, ceil(P / 64) (the grid bound adds one per
  // segment, most of them empty or short in a prefill batch): a 1024-row fused QKV had 16 tiles, 128 CTAs for
  // 132 SMs. Then groups of fewer slices multiply the CTAs (the groups of a tile run together: x's extra reads
  // hit L2), with the widest clusters.
  const int64_t full_tiles = (P + kTileRows - 1) / kTileRows;
  auto groups_of = [&](int64_t per_group) { return (p.num_slices + per_group - 1) / per_group; };
  plan.slices_per_group = std::max<int64_t>(1, std::min<int64_t>(p.num_slices, kMaxRankTile / plan.rank_pad));
  bool split = false;
  while (plan.slices_per_group > 1 && full_tiles * groups_of(plan.slices_per_group) * widest < 2 * num_sms) {
    plan.slices_per_group = (plan.slices_per_group + 1) / 2;
    split = true;
  }
  plan.groups = groups_of(plan.slices_per_group);
  // Otherwise clusters until about four CTAs per SM.
  plan.cluster = split ? widest : 1;
  while (plan.cluster < widest && plan.max_tiles * plan.groups * plan.cluster < 4 * num_sms) plan.cluster *= 2;
  if (forced_cluster > 0 && cc_major >= 9) plan.cluster = forced_cluster;
  return plan;
}

template <class T, class TY>
cudaError_t launch_typed(const SgmvParams& p, const MmaPlan& plan, const SgmvPrefillChoice& choice,
                         cudaStream_t stream) {
  return with_rank_tile(plan.slices_per_group * plan.rank_pad, [&](auto rt) {
    constexpr int RT = decltype(rt)::value;
    return launch_prefill<sgmv_mma_kernel<T, TY, RT>>(p, plan, choice, kTileRows, kCtaThreads<RT>,
                                                      Smem<RT, TY>::bytes, stream);
  });
}

}  // namespace

bool sgmv_mma_supported(const SgmvParams& p) {
  if (p.x_dtype == DType::F32) return false;
  const Vec16Access vec = vec16_access(p);
  if (!vec.x || !vec.a || !vec.b || !vec.y) return false;
  for (int64_t s = 0; s <= p.num_slices; ++s) {
    if (p.slice_offsets[s] % 8) return false;  // 16-byte aligned column starts of every slice
  }
  return (p.max_rank + 15) / 16 * 16 <= kMaxRankTile;
}

cudaError_t launch_sgmv_mma(const SgmvParams& p, int num_sms, int cc_major, const SgmvPrefillChoice& choice,
                            cudaStream_t stream) {
  const MmaPlan plan = make_plan(p, num_sms, cc_major, choice.cluster);
  if (choice.wgmma == WgmmaUse::Always ||
      (choice.wgmma == WgmmaUse::Auto && plan.slices_per_group * plan.rank_pad >= kWgmmaMinRankTile &&
       p.seg.positions >= kWgmmaMinPositions)) {
    return launch_sgmv_wgmma(p, plan, choice, stream);
  }
  if (p.x_dtype == DType::BF16) {
    return p.y_dtype == DType::F32 ? launch_typed<__nv_bfloat16, float>(p, plan, choice, stream)
                                   : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, plan, choice, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<__half, float>(p, plan, choice, stream)
                                 : launch_typed<__half, __half>(p, plan, choice, stream);
}

}  // namespace lora_ops::cuda
