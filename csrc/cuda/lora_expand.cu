// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// At decode the cost is B's bytes plus a chain of dependent trips, so each CTA pays the chain once and then
// streams. Grid: (256-column blocks of one slice, G groups); group g takes the tiles g, g + G, ... (8 positions
// of one segment each) for its columns, G sized so that the grid is about one wave. A CTA:
//   1. lists its tiles in one walk, then reads their rows, ranks and scales in one trip (up to 64 tiles at a
//      time: a window);
//   2. each warp (64 columns, 2 per lane) starts copying B for its first items (an item: one tile's next 32 rank
//      columns) into its own shared-memory stages with cp.async, several items in flight and no register held;
//      weights are never written by the producer, so this happens before grid_dependency_wait (sm_90 PDL);
//   3. after the wait, loads the window's h (summed over splits, scaled) into shared memory, and copies y of the
//      tiles whose last item is in flight into that item's stage, in the same trip;
//   4. each warp then runs through the items on its own (no CTA barrier): wait for the item's stage, FMA for the
//      tile's rows only, and at a tile's last item write y + acc from the staged y; then refill the stage with
//      the item `stages` ahead (B, and y if it ends a tile).
// Each y element belongs to one lane of one CTA: no atomics, deterministic.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 2;                    // consecutive columns per lane
constexpr int kWarpCols = 32 * kCols;
constexpr int kBlockCols = kThreads * kCols;
constexpr int kTileRows = 8;
constexpr int kMaxWindow = 64;              // tiles listed at a time
constexpr int kMaxStages = 8;
constexpr int kHBatch = 8;                 // h elements per thread loaded at once
constexpr int64_t kItemRanks = 32;          // rank columns of B per item (at most)
constexpr int64_t kStageBudget = 60 * 1024;  // shared memory for the 4 warps' stages
constexpr int64_t kHBudget = 8 * 1024;       // shared memory for a window's h (at least one tile's)
constexpr int64_t kMaxRank = 2048;          // one tile's h (8 x R float32, 64 KB) and the stages fit sm_80's shared memory

// Sizes the host chooses per call (shared memory depends on the pool's rank and B's dtype).
struct Plan {
  int units;     // 16-byte units of B per column and item: item_ranks * sizeof(B) / 16
  int stage_bytes;  // one warp's stage: B's units for 64 columns, then y for 8 rows x 64 columns
  int stages;    // items in flight per warp
  int window;    // tiles per window
  int h_stride;  // floats per row of the window's h: max_rank rounded up to 8
  int64_t item_ranks;
};

__device__ __forceinline__ void cp_async_wait_at_most(int pending) {
  switch (pending) {  // wait_group takes an immediate
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

// Asynchronous copy of `bytes` (4 or 8) from global to shared memory.
template <int kBytes>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(gmem), "n"(kBytes));
}

// Copies item (tile, ranks [j0, j0 + item_ranks)) of the warp's 64 columns into `stage`: unit q (ranks
// [q*E, q*E + E), E = 16 / sizeof(TB)) of column c goes to stage[(q * kCols + c % kCols) * 32 + c / kCols], so
// the owner lane c / kCols reads its units at consecutive addresses; lanes copy consecutive units of B (one
// column's units, then the next column's), so the copies coalesce. Ranks past the tile's and columns past the
// slice's end are zero.
template <class TB, bool kVec>
__device__ __forceinline__ void stage_item(uint4* stage, const TB* b_cols, int64_t b_stride1, int64_t ranks,
                                           int64_t cols, const Plan& plan, const TB* any_b) {
  constexpr int kUnit = 16 / sizeof(TB);
  const int lane = threadIdx.x & 31;
  for (int u = lane; u < plan.units * kWarpCols; u += 32) {
    const int c = u / plan.units, q = u - c * plan.units;
    const int64_t valid = c < cols ? std::clamp<int64_t>(ranks - q * kUnit, 0, kUnit) : 0;
    uint4* dst = stage + (q * kCols + c % kCols) * 32 + c / kCols;
    const TB* src = b_cols + c * b_stride1 + q * kUnit;
    if constexpr (kVec) {
      cp_async16(dst, valid > 0 ? src : any_b, (int)(valid * sizeof(TB)));
    } else {
      TB e[kUnit];
      for (int i = 0; i < kUnit; ++i) e[i] = i < valid ? src[i] : from_f32<TB>(0.f);
      *dst = *reinterpret_cast<const uint4*>(e);
    }
  }
}

// Item cursor: tile w of the window, rank columns from j0; tiles of rank 0 have no items.
struct Item {
  int w;
  int64_t j0;
};

// Shared memory of a CTA: the window's tiles, scales and rows, then each warp's stages, then the window's h.
struct WindowTiles {
  TileRef tiles[kMaxWindow];  // size: the slot's rank
  float coef[kMaxWindow];
  int64_t rows[kMaxWindow][kTileRows];
  int count;
};

// kVec: B allows 16-byte copies (aligned base and strides) and y kCols-element accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads, 3) lora_expand_kernel(ExpandParams p, Plan plan) {
  constexpr int kUnit = 16 / sizeof(TB);
  constexpr int kYBytes = kCols * sizeof(TY);  // a lane's part of one y row
  extern __shared__ uint4 smem[];
  WindowTiles& win = *reinterpret_cast<WindowTiles*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Slice and columns of this CTA's block.
  int64_t block = blockIdx.x, s = 0;
  for (; s < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
    if (block < blocks) break;
    block -= blocks;
  }
  if (s == p.num_slices) return;
  const int64_t warp_n0 = p.slice_offsets[s] + block * kBlockCols + warp * kWarpCols;
  const int64_t warp_cols = std::clamp<int64_t>(p.slice_offsets[s + 1] - warp_n0, 0, kWarpCols);
  const int64_t n0 = warp_n0 + lane * kCols;
  const int cols = (int)std::clamp<int64_t>(warp_cols - lane * kCols, 0, kCols);

  unsigned char* stages = reinterpret_cast<unsigned char*>(smem) + (sizeof(WindowTiles) + 15) / 16 * 16 +
                          (size_t)warp * plan.stages * plan.stage_bytes;
  float* h_s = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(smem) +
                                        (sizeof(WindowTiles) + 15) / 16 * 16 +
                                        (size_t)kWarps * plan.stages * plan.stage_bytes);
  const TB* lora_b = static_cast<const TB*>(p.lora_b);
  const TH* h = static_cast<const TH*>(p.h) + s * p.max_rank;
  TY* y = static_cast<TY*>(p.y);
  const int y_offset = plan.units * kWarpCols * 16;  // y's place in a stage

  for (int64_t k0 = 0;; k0 += plan.window) {
    if (k0 > 0) __syncthreads();  // the previous window's readers are done
    if (warp == 0) {
      const int count = warp_list_tiles(p.seg, p.num_slots, kTileRows, blockIdx.y, gridDim.y, k0, plan.window,
                                        win.tiles);
      if (lane == 0) win.count = count;
    }
    __syncthreads();
    const int count = win.count;
    if (count == 0) return;
    for (int i = tid; i < count * kTileRows; i += kThreads) {
      const int w = i / kTileRows, m = i % kTileRows;
      const int64_t pos = win.tiles[w].begin + m;
      win.rows[w][m] = pos < win.tiles[w].end ? segment_row(p.seg, pos, p.rows) : -1;
    }
    for (int w = tid; w < count; w += kThreads) {
      const int64_t slot = win.tiles[w].slot;
      win.tiles[w].size = slot_size(p.lora_ranks, slot, p.max_rank);
      win.coef[w] = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
    }
    __syncthreads();

    // Items in window order; every cursor below steps through the same sequence.
    auto skip_empty = [&](Item it) {
      while (it.w < count && it.j0 >= win.tiles[it.w].size) it = {it.w + 1, 0};
      return it;
    };
    auto next = [&](Item it) { return skip_empty({it.w, it.j0 + plan.item_ranks}); };
    auto ends_tile = [&](Item it) { return it.j0 + plan.item_ranks >= win.tiles[it.w].size; };
    auto copy_b = [&](Item it, int stage) {
      const TileRef& t = win.tiles[it.w];
      stage_item<TB, kVec>(reinterpret_cast<uint4*>(stages + stage * plan.stage_bytes),
                           lora_b + t.slot * p.b_stride0 + warp_n0 * p.b_stride1 + it.j0, p.b_stride1,
                           std::min(plan.item_ranks, t.size - it.j0), warp_cols, plan, lora_b);
    };
    // y of the tile, staged with its last item: row m of the lane at (m * 32 + lane) * kYBytes.
    auto copy_y = [&](Item it, int stage) {
      unsigned char* dst = stages + stage * plan.stage_bytes + y_offset + lane * kYBytes;
#pragma unroll
      for (int m = 0; m < kTileRows; ++m) {
        const int64_t row = win.rows[it.w][m];
        if (row < 0 || cols == 0) continue;
        const TY* src = y + row * p.y_row_stride + n0;
        TY* d = reinterpret_cast<TY*>(dst + m * 32 * kYBytes);
        if constexpr (kVec) {
          cp_async_small<kYBytes>(d, src);
        } else {
          for (int c = 0; c < cols; ++c) d[c] = src[c];
        }
      }
    };

    const Item first = skip_empty({0, 0});
    Item ahead = first;
    for (int st = 0; st < plan.stages && ahead.w < count; ++st) {
      copy_b(ahead, st);
      ahead = next(ahead);
    }
    grid_dependency_wait();  // h and y come from the previous kernel
    Item staged = first;
    for (int st = 0; st < plan.stages; ++st) {  // one commit group per stage, empty past the last item
      if (staged.w < count) {
        if (ends_tile(staged)) copy_y(staged, st);
        staged = next(staged);
      }
      cp_async_commit();
    }
    // h, scaled: each thread's loads are issued together (a loop of dependent trips cost several µs per CTA).
    const int h_total = count * kTileRows * plan.h_stride;
    for (int i0 = tid; i0 < h_total; i0 += kThreads * kHBatch) {
      const TH* src[kHBatch];  // nullptr: zero (past the rank, an absent row, or past the window)
      float coef[kHBatch], v[kHBatch];
#pragma unroll
      for (int u = 0; u < kHBatch; ++u) {
        const int i = i0 + u * kThreads, r = i / plan.h_stride, j = i - r * plan.h_stride;
        const int w = r / kTileRows, m = r % kTileRows;
        const int64_t row = i < h_total ? win.rows[w][m] : -1;
        const bool in = row >= 0 && j < win.tiles[w].size;
        src[u] = in ? h + row * p.h_row_stride + win.tiles[w].slot * p.h_slot_stride + j : nullptr;
        coef[u] = in ? win.coef[w] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kHBatch; ++u) v[u] = src[u] ? to_f32(*src[u]) : 0.f;
      for (int64_t split = 1; split < p.h_splits; ++split) {  // in split order: deterministic
#pragma unroll
        for (int u = 0; u < kHBatch; ++u) v[u] += src[u] ? to_f32(src[u][split * p.h_split_stride]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kHBatch; ++u) v[u] *= coef[u];
#pragma unroll
      for (int u = 0; u < kHBatch; ++u) {
        if (i0 + u * kThreads < h_total) h_s[i0 + u * kThreads] = v[u];
      }
    }
    __syncthreads();

    float acc[kTileRows][kCols] = {};
    int stage = 0;
    for (Item it = first; it.w < count; it = next(it)) {
      const int w = it.w;
      cp_async_wait_at_most(plan.stages - 1);
      __syncwarp();  // every lane's copies of this stage have landed

      const unsigned char* st_base = stages + stage * plan.stage_bytes;
      const uint4* b_s = reinterpret_cast<const uint4*>(st_base);
      const float* h_w = h_s + w * kTileRows * plan.h_stride + it.j0;
      const int nrows = (int)(win.tiles[w].end - win.tiles[w].begin);
      const int64_t jn = std::min(plan.item_ranks, win.tiles[w].size - it.j0);
      for (int q = 0; q * kUnit < jn; ++q) {
        float b[kCols][kUnit];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const uint4 raw = b_s[(q * kCols + c) * 32 + lane];
          const TB* e = reinterpret_cast<const TB*>(&raw);
#pragma unroll
          for (int i = 0; i < kUnit; ++i) b[c][i] = to_f32(e[i]);
        }
#pragma unroll
        for (int m = 0; m < kTileRows; ++m) {
          if (m >= nrows) break;
          float hv[kUnit];
#pragma unroll
          for (int i = 0; i < kUnit; i += 4) {
            *reinterpret_cast<float4*>(hv + i) =
                *reinterpret_cast<const float4*>(h_w + m * plan.h_stride + q * kUnit + i);
          }
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int i = 0; i < kUnit; ++i) acc[m][c] += hv[i] * b[c][i];
          }
        }
      }
      if (ends_tile(it)) {  // y = y + acc from the staged y, written once
#pragma unroll
        for (int m = 0; m < kTileRows; ++m) {
          const int64_t row = win.rows[w][m];
          if (row >= 0 && cols > 0) {
            const TY* staged_y = reinterpret_cast<const TY*>(st_base + y_offset + (m * 32 + lane) * kYBytes);
            TY out[kCols];
#pragma unroll
            for (int c = 0; c < kCols; ++c) out[c] = from_f32<TY>(to_f32(staged_y[c]) + acc[m][c]);
            TY* dst = y + row * p.y_row_stride + n0;
            if (kVec) {
              using Vec = std::conditional_t<sizeof(TY) == 2, uint32_t, uint2>;
              *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(out);
            } else {
              for (int c = 0; c < cols; ++c) dst[c] = out[c];
            }
          }
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[m][c] = 0.f;
        }
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
      if (ahead.w < count) {
        copy_b(ahead, stage);
        if (ends_tile(ahead)) copy_y(ahead, stage);
        ahead = next(ahead);
      }
      cp_async_commit();
      stage = stage + 1 == plan.stages ? 0 : stage + 1;
    }
    cp_async_wait<0>();  // no copy into this window's stages outlives it
    if (count < plan.window) return;  // that was the last window
  }
}

template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, const Plan& plan, dim3 grid, size_t smem, bool vec, bool pdl,
                         cudaStream_t stream) {
  auto kernel = vec ? lora_expand_kernel<TB, TH, TY, true> : lora_expand_kernel<TB, TH, TY, false>;
  const cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  return launch_pdl(kernel, grid, kThreads, smem, pdl, stream, p, plan);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, const Plan& plan, dim3 grid, size_t smem, bool vec, bool pdl,
                     cudaStream_t stream) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, plan, grid, smem, vec, pdl, stream)
                                   : launch_typed<TB, float, TB>(p, plan, grid, smem, vec, pdl, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, plan, grid, smem, vec, pdl, stream)
                                 : launch_typed<TB, TB, TB>(p, plan, grid, smem, vec, pdl, stream);
}

}  // namespace

int64_t lora_expand_max_rank() { return kMaxRank; }

cudaError_t launch_lora_expand(const ExpandParams& p, int num_sms, int cc_major, cudaStream_t stream) {
  const int64_t P = p.seg.positions;
  const int64_t tiles = std::min<int64_t>(P, (P + kTileRows - 1) / kTileRows + p.seg.num_segments);
  int64_t col_blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    col_blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
  }
  if (tiles == 0 || col_blocks == 0 || p.max_rank == 0) return cudaSuccess;
  if (col_blocks > INT32_MAX || p.max_rank > kMaxRank) return cudaErrorInvalidValue;

  const int64_t eb = dtype_size(p.b_dtype);
  Plan plan;
  plan.h_stride = (int)((p.max_rank + 7) / 8 * 8);
  plan.item_ranks = std::min<int64_t>(kItemRanks, plan.h_stride);
  plan.units = (int)(plan.item_ranks * eb / 16);
  plan.stage_bytes = (int)(plan.units * kWarpCols * 16 + kTileRows * kWarpCols * dtype_size(p.y_dtype));
  const int64_t cta_stage_bytes = (int64_t)kWarps * plan.stage_bytes;
  plan.stages = (int)std::clamp<int64_t>(kStageBudget / cta_stage_bytes, 1, kMaxStages);
  const int64_t tile_h_bytes = (int64_t)kTileRows * plan.h_stride * 4;
  plan.window = (int)std::clamp<int64_t>(kHBudget / tile_h_bytes, 1, kMaxWindow);
  const size_t smem = (sizeof(WindowTiles) + 15) / 16 * 16 + (size_t)(plan.stages * cta_stage_bytes +
                                                                       plan.window * tile_h_bytes);

  // About one wave: as many groups per column block as the SMs hold CTAs of this size (floor: a partial second
  // wave costs a whole chain), at most one per tile. Shared memory per SM: 228 KB from sm_90, 164 KB on sm_80;
  // registers (<= 128 per thread) allow 4 CTAs.
  const int64_t smem_per_sm = (cc_major >= 9 ? 228 : 164) * 1024;
  const int64_t per_sm = std::clamp<int64_t>(smem_per_sm / (int64_t)(smem + 1024), 1, 4);
  const int64_t groups = std::clamp<int64_t>(num_sms * per_sm / col_blocks, 1, std::min<int64_t>(tiles, 65535));

  // Vector path: 16-byte copies of B, kCols-element accesses of y (every slice starts on one).
  const int64_t y_vec = kCols * dtype_size(p.y_dtype);
  bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
             reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) vec = vec && p.slice_offsets[s] % kCols == 0;
  const dim3 grid((unsigned)col_blocks, (unsigned)groups);
  const bool pdl = cc_major >= 9;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, plan, grid, smem, vec, pdl, stream);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, plan, grid, smem, vec, pdl, stream);
    default: return launch_b<float>(p, plan, grid, smem, vec, pdl, stream);
  }
}

}  // namespace lora_ops::cuda
