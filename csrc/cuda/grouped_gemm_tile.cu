// grouped_gemm, general shapes and the LoRA shrink: one CTA per tile of BM positions of one segment x BN columns,
// a K loop staged by a 3- or 4-stage cp.async pipeline (element loads where rows are not 16-byte aligned), rows
// gathered through token_indices, warp tiles on mma.sync m16n8k16 (fp16/bf16 w; fp32 x split hi + lo) or FMA
// (fp32 w). The epilogue stages the y tile in the pipeline's shared memory and writes it back with 16-byte stores.
//   wide:   128 x 128 tiles, 8 warps of 64 x 32 (general GEMMs);
//   narrow: 64 x BN tiles with BN = N rounded up to 16..128, 4 warps of 16 x BN: a LoRA shrink (N = rank) reads
//           each x row once and keeps all its columns' accumulators in registers, streaming x at memory speed;
//           up to BN = 32 with aligned rows, x and w are staged through each thread's pieces (kPieces), 256 bytes
//           of K a step.
#include <algorithm>

#include "common.cuh"
#include "grouped_gemm.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

using namespace gg;

// BK_BYTES: the K step's bytes of the wider of x and w (64: 32 halves; 128: 64 halves, 32 floats; 256: 128 halves).
// MIN_CTAS: CTAs per SM the register allocation must allow (__launch_bounds__). STAGES: the cp.async pipeline's.
template <int BM_, int BN_, int BK_BYTES_, int WARPS_M_, int WARPS_N_, int MIN_CTAS_, int STAGES_ = 4>
struct Shape {
  static constexpr int BM = BM_, BN = BN_, BK_BYTES = BK_BYTES_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
  static constexpr int MIN_CTAS = MIN_CTAS_, STAGES = STAGES_;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tiles are whole m16 x (2 x n8) fragments");
};
using WideShape = Shape<128, 128, 64, 2, 4, 2>;
using WideShapeFma = Shape<128, 128, 64, 2, 4, 1>;  // fp32 w: FMA operands need more registers (no spills)
template <int BN>
using NarrowShape = Shape<64, BN, 128, 4, 1, BN <= 64 ? 4 : 3>;
// The narrow tiles staged through pieces (BN <= 32): 256-byte K steps, 3 stages (about the bytes in flight of 4
// stages of 128, half the barriers and twice each row's contiguous bytes a step).
template <int BN>
using NarrowPiecesShape = Shape<64, BN, 256, 4, 1, 4, 3>;

template <class TX, class TW, class TY, class S>
struct Layout {
  static constexpr int kStages = S::STAGES;
  static constexpr int BK = S::BK_BYTES / (int)std::max(sizeof(TX), sizeof(TW));
  static constexpr int XS = BK + kPad, WS = BK + kPad, YS = S::BN + kPad;  // shared row strides (elements)
  static constexpr size_t x_bytes = (size_t)S::BM * XS * sizeof(TX), w_bytes = (size_t)S::BN * WS * sizeof(TW);
  static constexpr size_t stage_bytes = x_bytes + w_bytes;
  static constexpr size_t bytes = std::max(kStages * stage_bytes, (size_t)S::BM * YS * sizeof(TY));
  static_assert(BK % 16 == 0 && bytes <= kSmemBudget, "tile does not fit");
  static __device__ TX* xs(unsigned char* smem, int st) { return reinterpret_cast<TX*>(smem + st * stage_bytes); }
  static __device__ TW* ws(unsigned char* smem, int st) {
    return reinterpret_cast<TW*>(smem + st * stage_bytes + x_bytes);
  }
};

struct Empty {};

struct TilePlan {
  int64_t units;      // tiles (upper bound) x column tiles
  int64_t col_tiles;  // ceil(N / BN)
  Access vec;
};

// kPieces (launched only where x and w have 16-byte aligned rows): their K tiles are staged through the thread's
// pieces (PieceRows: row addresses once per tile) instead of stage_tile (each piece's row and bounds per stage).
template <class TX, class TW, class TY, class S, bool kPieces>
__global__ void __launch_bounds__(S::kThreads, S::MIN_CTAS)
    grouped_gemm_tile_kernel(GroupedGemmParams p, TilePlan plan) {
  using L = Layout<TX, TW, TY, S>;
  using XRows = PieceRows<TX, S::BM, L::BK, L::XS, S::kThreads>;
  using WRows = PieceRows<TW, S::BN, L::BK, L::WS, S::kThreads>;
  constexpr int MI = S::WM / 16, NI = S::WN / 8, kStages = L::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int64_t s_rows[S::BM];
  const TX* x = static_cast<const TX*>(p.x);
  const TW* w = static_cast<const TW*>(p.w);
  TY* y = static_cast<TY*>(p.y);
  const int warp = threadIdx.x >> 5, wm = warp % S::WARPS_M, wn = warp / S::WARPS_M;

  for (int64_t unit = blockIdx.x; unit < plan.units; unit += gridDim.x) {
    __syncthreads();  // the previous unit's readers of s_rows and of the shared tiles are done
    TileRef tile;  // later units never have a tile either
    if (!block_find_tile<S::BM>(p.seg, p.num_groups, p.rows, unit / plan.col_tiles, &tile, s_rows, p.n_sizes, p.n)) break;
    const int64_t n_l = tile.size, k_l = slot_size(p.k_sizes, tile.slot, p.k);
    const int64_t n0 = unit % plan.col_tiles * S::BN;
    if (n0 >= n_l || (k_l == 0 && p.accumulate)) continue;  // nothing to write

    const TW* w_slot = w + tile.slot * p.w_stride0;
    // The pieces' row addresses (kPieces; an empty struct otherwise: the other kernels hold no registers for it).
    [[maybe_unused]] std::conditional_t<kPieces, XRows, Empty> x_rows;
    [[maybe_unused]] std::conditional_t<kPieces, WRows, Empty> w_rows;
    if constexpr (kPieces) {
      x_rows.init([&](int r) -> const TX* { return s_rows[r] >= 0 ? x + s_rows[r] * p.x_row_stride : nullptr; });
      w_rows.init([&](int i) -> const TW* { return n0 + i < n_l ? w_slot + (n0 + i) * p.w_stride1 : nullptr; });
    }
    auto load_stage = [&](int st, int64_t k0) {
      if constexpr (kPieces) {
        x_rows.stage(L::xs(smem, st), k0, k_l - k0, x);
        w_rows.stage(L::ws(smem, st), k0, k_l - k0, w);
        return;
      }
      stage_tile<TX, S::BM, L::BK, L::XS, S::kThreads>(
          L::xs(smem, st),
          [&](int r) -> const TX* { return s_rows[r] >= 0 ? x + s_rows[r] * p.x_row_stride + k0 : nullptr; },
          k_l - k0, plan.vec.x, x);
      stage_tile<TW, S::BN, L::BK, L::WS, S::kThreads>(
          L::ws(smem, st),
          [&](int i) -> const TW* { return n0 + i < n_l ? w_slot + (n0 + i) * p.w_stride1 + k0 : nullptr; },
          k_l - k0, plan.vec.w, w);
    };
    float acc[MI][NI][4] = {};
    const int64_t k_tiles = (k_l + L::BK - 1) / L::BK;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < k_tiles) load_stage(st, st * L::BK);
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // stage kt has landed for every thread; stage kt - 1 is no longer read
      const int64_t next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next * L::BK);
      cp_async_commit();
      const TX* xs = L::xs(smem, kt % kStages) + wm * S::WM * L::XS;
      const TW* ws = L::ws(smem, kt % kStages) + wn * S::WN * L::WS;
#pragma unroll
      for (int kk = 0; kk < L::BK; kk += 16) warp_k16<TX, TW, MI, NI>(acc, xs + kk, L::XS, ws + kk, L::WS);
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory becomes the y tile

    TY* ys = reinterpret_cast<TY*>(smem);
    auto y_row = [&](int r) -> TY* { return s_rows[r] >= 0 ? y + s_rows[r] * p.y_row_stride + n0 : nullptr; };
    if (p.accumulate) {
      stage_tile<TY, S::BM, S::BN, L::YS, S::kThreads>(ys, y_row, n_l - n0, plan.vec.y, y);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    combine<TY, MI, NI>(ys + wm * S::WM * L::YS + wn * S::WN, L::YS, acc, p.alpha, k_l > 0, p.accumulate);
    __syncthreads();
    store_tile<TY, S::BM, S::BN, L::YS, S::kThreads>(ys, y_row, n_l - n0, plan.vec.y);
  }
}

template <class TX, class TW, class TY, class S, bool kPieces = false>
cudaError_t launch_shape(const GroupedGemmParams& p, const Access& vec, cudaStream_t stream) {
  TilePlan plan{};
  plan.col_tiles = (p.n + S::BN - 1) / S::BN;
  plan.units = max_segment_tiles(p.seg, S::BM) * plan.col_tiles;
  plan.vec = vec;
  return launch(grouped_gemm_tile_kernel<TX, TW, TY, S, kPieces>, plan.units, S::kThreads,
                Layout<TX, TW, TY, S>::bytes, stream, p, plan);
}

// Pieces where x and w have 16-byte aligned rows, up to 32 columns (LoRA ranks up to 32): from 64 on, their row
// addresses spill at the register cap of NarrowShape's CTAs per SM (ptxas, sm_80 and sm_90a). H200, the LoRA
// shrink (8 x 2048 rows, K = 4096, n = 16, fp32 y): 72.8 -> 42.8 us; at 8 x 512 rows 67.5 -> 23.1; then 256-byte
// steps, H100: 52.8 -> 51.1 us (NOTES.md, sessions 39 and 63).
template <class TX, class TW, class TY, int BN>
cudaError_t launch_narrow(const GroupedGemmParams& p, const Access& vec, cudaStream_t stream) {
  if constexpr (BN <= 32) {
    if (vec.x && vec.w) return launch_shape<TX, TW, TY, NarrowPiecesShape<BN>, true>(p, vec, stream);
  }
  return launch_shape<TX, TW, TY, NarrowShape<BN>, false>(p, vec, stream);
}

}  // namespace

cudaError_t launch_grouped_gemm_tile(const GroupedGemmParams& p, bool narrow, cudaStream_t stream) {
  const Access vec = access_of(p);
  return dispatch_types(p, [&](auto xt, auto wt, auto yt) {
    using TX = typename decltype(xt)::type;
    using TW = typename decltype(wt)::type;
    using TY = typename decltype(yt)::type;
    if (!narrow) {
      if constexpr (std::is_same_v<TW, float>) {
        return launch_shape<TX, TW, TY, WideShapeFma>(p, vec, stream);
      } else {
        return launch_shape<TX, TW, TY, WideShape>(p, vec, stream);
      }
    }
    if (p.n <= 16) return launch_narrow<TX, TW, TY, 16>(p, vec, stream);
    if (p.n <= 32) return launch_narrow<TX, TW, TY, 32>(p, vec, stream);
    if (p.n <= 64) return launch_narrow<TX, TW, TY, 64>(p, vec, stream);
    return launch_narrow<TX, TW, TY, kGroupedGemmNarrowMaxN>(p, vec, stream);
  });
}

}  // namespace lora_ops::cuda
