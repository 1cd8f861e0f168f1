// grouped_gemm with a short reduction (K <= 128: the LoRA expand, k_l = rank): y streams at memory speed.
// One CTA per (tile of 64 positions of one segment, share of the group's columns). It stages its rows' x
// (64 x KT, KT = K rounded up to 16) once, then streams 64-column chunks of w and y through a cp.async pipeline:
// per chunk, 4 warps of 16 rows x 64 columns multiply on tensor cores (fp32 x split hi + lo; FMA for fp32 w),
// combine with the staged y tile in shared memory and write it back with 16-byte stores. y is read and written
// once, w is read once per tile of 64 rows (from L2 after the first). The per-chunk work is kept short (x's
// fragments in registers up to 32 ranks, the y rows' addresses once per tile, pairs in the epilogue): the H200
// ran the kernel issue-bound (csrc/cuda/NOTES.md, session 19).
#include <algorithm>

#include "common.cuh"
#include "grouped_gemm.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

using namespace gg;

constexpr int kThreads = 128;  // 4 warps x 16 rows
constexpr int kBM = 64, kBN = 64;
constexpr int kNI = kBN / 8;
constexpr int kCtasPerSm = 4;  // the grid aims at this many CTAs per SM before it splits columns further

template <class TX, class TW, class TY, int KT>
struct Layout {
  static constexpr int XS = KT + kPad, WS = KT + kPad, YS = kBN + kPad;  // shared row strides (elements)
  static constexpr size_t x_bytes = (size_t)kBM * XS * sizeof(TX);
  static constexpr size_t w_bytes = (size_t)kBN * WS * sizeof(TW), y_bytes = (size_t)kBM * YS * sizeof(TY);
  static constexpr size_t stage_bytes = w_bytes + y_bytes;
  // 4 stages: three chunks of w and y in flight per CTA (session 19's ncu: the kernel waits on memory at 61% of
  // DRAM with two ahead; at K = 16, bf16 y: 55 KB, 4 CTAs per SM instead of 5, 20% more bytes in flight per SM).
  // Measured on the H200: the LoRA expand 88.5 -> 86.9 us, far less than the bytes in flight predicted (NOTES.md).
  static constexpr int kStages = (int)std::min<size_t>(4, (kSmemBudget - x_bytes) / stage_bytes);
  static constexpr size_t bytes = x_bytes + kStages * stage_bytes;
  static_assert(kStages >= 2, "two chunks must fit");
  static __device__ TX* xs(unsigned char* smem) { return reinterpret_cast<TX*>(smem); }
  static __device__ TW* ws(unsigned char* smem, int st) {
    return reinterpret_cast<TW*>(smem + x_bytes + st * stage_bytes);
  }
  static __device__ TY* ys(unsigned char* smem, int st) {
    return reinterpret_cast<TY*>(smem + x_bytes + st * stage_bytes + w_bytes);
  }
};

struct ExpandPlan {
  int64_t units;     // tiles (upper bound) x column splits
  int64_t n_splits;  // CTAs sharing one tile's column chunks
  Access vec;
};

template <class TX, class TW, class TY, int KT>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    grouped_gemm_expand_kernel(GroupedGemmParams p, ExpandPlan plan) {
  using L = Layout<TX, TW, TY, KT>;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int64_t s_rows[kBM];
  __shared__ TY* s_y[kBM];  // the tile's rows of y (nullptr: no row)
  const TX* x = static_cast<const TX*>(p.x);
  const TW* w = static_cast<const TW*>(p.w);
  TY* y = static_cast<TY*>(p.y);
  const int warp = threadIdx.x >> 5;

  for (int64_t unit = blockIdx.x; unit < plan.units; unit += gridDim.x) {
    __syncthreads();  // the previous unit's readers of s_rows and of the shared tiles are done
    TileRef tile;  // later units never have a tile either
    if (!block_find_tile<kBM>(p.seg, p.num_groups, p.rows, unit / plan.n_splits, &tile, s_rows, p.n_sizes, p.n)) break;
    const int64_t n_l = tile.size, k_l = slot_size(p.k_sizes, tile.slot, p.k);
    int64_t c_begin, c_end;
    split_range((n_l + kBN - 1) / kBN, plan.n_splits, unit % plan.n_splits, &c_begin, &c_end);
    if (c_begin >= c_end || (k_l == 0 && p.accumulate)) continue;  // nothing to write
    const bool has_k = k_l > 0;

    if (has_k) {  // committed with the first chunk
      stage_tile<TX, kBM, KT, L::XS, kThreads>(
          L::xs(smem), [&](int r) -> const TX* { return s_rows[r] >= 0 ? x + s_rows[r] * p.x_row_stride : nullptr; },
          k_l, plan.vec.x, x);
    }
    const TW* w_slot = w + tile.slot * p.w_stride0;
    if (threadIdx.x < kBM) {
      const int64_t row = s_rows[threadIdx.x];
      s_y[threadIdx.x] = row >= 0 ? y + row * p.y_row_stride : nullptr;
    }
    __syncthreads();
    auto y_row = [&](int64_t n0) { return [&, n0](int r) -> TY* { return s_y[r] ? s_y[r] + n0 : nullptr; }; };
    // Whole chunks of w and y go through the thread's pieces; a chunk the group's last column cuts short, or a
    // tensor without 16-byte rows, through stage_tile/store_tile.
    using WP = Pieces<TW, kBN, KT, kThreads>;
    using YP = Pieces<TY, kBM, kBN, kThreads>;
    static_assert(WP::kExact && YP::kExact, "every thread has its pieces");
    const int w_bytes = (int)clamp_index(k_l - WP::c(), 0, WP::kElems) * (int)sizeof(TW);  // the piece's valid bytes
    // Piece j's row of y (nullptr: no row), and the piece in the shared y tile of stage st.
    auto y_row_of = [&](int j) { return s_y[YP::r0() + j * YP::kRowStep]; };
    auto y_shared = [&](int st, int j) { return L::ys(smem, st) + (YP::r0() + j * YP::kRowStep) * L::YS + YP::c(); };
    auto whole = [&](int64_t n0) { return n0 + kBN <= n_l; };  // the chunk's columns all belong to the group
    auto load_chunk = [&](int st, int64_t n0) {
      if (has_k && whole(n0) && plan.vec.w) {
        const TW* first = w_slot + (n0 + WP::r0()) * p.w_stride1 + WP::c();
#pragma unroll
        for (int j = 0; j < WP::kCount; ++j) {
          cp_async16(L::ws(smem, st) + (WP::r0() + j * WP::kRowStep) * L::WS + WP::c(),
                     w_bytes > 0 ? first + j * WP::kRowStep * p.w_stride1 : w, w_bytes);
        }
      } else if (has_k) {
        stage_tile<TW, kBN, KT, L::WS, kThreads>(
            L::ws(smem, st),
            [&](int i) -> const TW* { return n0 + i < n_l ? w_slot + (n0 + i) * p.w_stride1 : nullptr; }, k_l,
            plan.vec.w, w);
      }
      if (p.accumulate && whole(n0) && plan.vec.y) {
#pragma unroll
        for (int j = 0; j < YP::kCount; ++j) {
          const TY* row = y_row_of(j);
          cp_async16(y_shared(st, j), row ? row + n0 + YP::c() : y, row ? 16 : 0);
        }
      } else if (p.accumulate) {
        stage_tile<TY, kBM, kBN, L::YS, kThreads>(L::ys(smem, st), y_row(n0), n_l - n0, plan.vec.y, y);
      }
    };
    const int64_t chunks = c_end - c_begin;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < chunks) load_chunk(st, (c_begin + st) * kBN);
      cp_async_commit();
    }
    const int k_steps = (int)(k_l + 15) / 16;
    // Up to 32 ranks, the warp's x fragments (split into hi and lo once, for an fp32 x) stay in registers for all
    // of the tile's chunks; above, each chunk loads them again from shared memory.
    constexpr bool kHoistA = !std::is_same_v<TW, float> && KT <= 32;
    uint32_t a[kHoistA ? KT / 16 : 1][1][kAParts<TX>][4];
    for (int64_t i = 0; i < chunks; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // chunk i has landed for every thread; chunk i - 1 is no longer read
      const int64_t next = i + kStages - 1;
      if (next < chunks) load_chunk(next % kStages, (c_begin + next) * kBN);
      cp_async_commit();
      const int st = i % kStages;
      const int64_t n0 = (c_begin + i) * kBN;
      float acc[1][kNI][4] = {};
      if constexpr (kHoistA) {
        if (i == 0) {  // x has landed with the first chunk
#pragma unroll
          for (int ks = 0; ks < KT / 16; ++ks) {
            load_a<TX, TW, 1>(a[ks], L::xs(smem) + warp * 16 * L::XS + ks * 16, L::XS);
          }
        }
      }
#pragma unroll
      for (int ks = 0; ks < KT / 16; ++ks) {
        if (ks < k_steps) {
          if constexpr (kHoistA) {
            warp_k16_a<TX, TW, 1, kNI>(acc, a[ks], L::ws(smem, st) + ks * 16, L::WS);
          } else {
            warp_k16<TX, TW, 1, kNI>(acc, L::xs(smem) + warp * 16 * L::XS + ks * 16, L::XS,
                                     L::ws(smem, st) + ks * 16, L::WS);
          }
        }
      }
      combine<TY, 1, kNI>(L::ys(smem, st) + warp * 16 * L::YS, L::YS, acc, p.alpha, has_k, p.accumulate);
      __syncthreads();
      if (whole(n0) && plan.vec.y) {
#pragma unroll
        for (int j = 0; j < YP::kCount; ++j) {
          TY* row = y_row_of(j);
          if (row) *reinterpret_cast<uint4*>(row + n0 + YP::c()) = *reinterpret_cast<const uint4*>(y_shared(st, j));
        }
      } else {
        store_tile<TY, kBM, kBN, L::YS, kThreads>(L::ys(smem, st), y_row(n0), n_l - n0, plan.vec.y);
      }
    }
    cp_async_wait<0>();
  }
}

template <class TX, class TW, class TY, int KT>
cudaError_t launch_kt(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  const int64_t max_tiles = max_segment_tiles(p.seg, kBM);
  const int64_t chunks = (p.n + kBN - 1) / kBN;
  ExpandPlan plan{};
  plan.n_splits = std::clamp<int64_t>((kCtasPerSm * num_sms + max_tiles - 1) / std::max<int64_t>(max_tiles, 1), 1,
                                      std::max<int64_t>(chunks, 1));
  plan.units = max_tiles * plan.n_splits;
  plan.vec = access_of(p);
  return launch(grouped_gemm_expand_kernel<TX, TW, TY, KT>, plan.units, kThreads, Layout<TX, TW, TY, KT>::bytes,
                stream, p, plan);
}

}  // namespace

cudaError_t launch_grouped_gemm_expand(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  return dispatch_types(p, [&](auto xt, auto wt, auto yt) {
    using TX = typename decltype(xt)::type;
    using TW = typename decltype(wt)::type;
    using TY = typename decltype(yt)::type;
    if (p.k <= 16) return launch_kt<TX, TW, TY, 16>(p, num_sms, stream);
    if (p.k <= 32) return launch_kt<TX, TW, TY, 32>(p, num_sms, stream);
    if (p.k <= 64) return launch_kt<TX, TW, TY, 64>(p, num_sms, stream);
    return launch_kt<TX, TW, TY, kGroupedGemmExpandMaxK>(p, num_sms, stream);
  });
}

}  // namespace lora_ops::cuda
