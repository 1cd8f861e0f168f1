// sgmv, decode regime (few rows per adapter), any dtype and any alignment: ONE cooperative launch.
//   shrink: unit = (tile of <= 8 positions, slice, 4 rank rows, K chunk); 128 threads stream A's rank rows
//           and the tile's x rows in 16-byte vectors, reduce in a fixed order, write float32 partials.
//   grid barrier (cooperative_groups; the launch is a valid CUDA-graph node).
//   expand: unit = (tile, 256 columns); partials summed over K chunks in order (deterministic) into shared
//           memory, each thread applies B rows of 2 columns to every row of the tile and updates y.
// Each adapter's A and B are read once per call; the grid is sized by the tile bound min(P, P/8 + G).
// Serves GPUs without thread-block clusters (sm_80); sgmv_cluster.cu is the decode kernel from sm_90 on.
#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTileRows = 8;
constexpr int kRankRows = 4;
constexpr int kColsPerThread = 2;
constexpr int kColsPerUnit = kThreads * kColsPerThread;

template <class T, class TY>
__global__ void __launch_bounds__(kThreads) sgmv_simt_kernel(SgmvParams p, SimtPlan plan, float* ws) {
  extern __shared__ float h_tile[];  // [k_splits][kTileRows][S * R] partials of the expand unit's tile
  __shared__ float partial[kThreads / 32][kTileRows * kRankRows];
  const T* x = static_cast<const T*>(p.x);
  const T* lora_a = static_cast<const T*>(p.lora_a);
  const T* lora_b = static_cast<const T*>(p.lora_b);
  TY* y = static_cast<TY*>(p.y);
  const int64_t R = p.max_rank, S = p.num_slices, SR = S * R, P = p.seg.positions;
  const int64_t rank_chunks = (R + kRankRows - 1) / kRankRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // ---- shrink ----
  for (int64_t u = blockIdx.x; u < plan.shrink_units; u += gridDim.x) {
    const int64_t tile_idx = u / (S * rank_chunks * plan.k_splits);
    int64_t rem = u % (S * rank_chunks * plan.k_splits);
    const int64_t s = rem / (rank_chunks * plan.k_splits);
    rem %= rank_chunks * plan.k_splits;
    const int64_t j0 = (rem / plan.k_splits) * kRankRows, kc = rem % plan.k_splits;
    Tile tile;
    if (!locate_tile(p.seg, p.num_slots, p.lora_ranks, p.lora_scales, p.scale, R, kTileRows, tile_idx, &tile)) continue;
    if (j0 >= tile.rank) continue;
    const int64_t nj = std::min<int64_t>(kRankRows, tile.rank - j0);
    int64_t rows[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      rows[r] = tile.begin + r < tile.end ? segment_row(p.seg, tile.begin + r, p.rows) : -1;
    }
    float acc[kTileRows][kRankRows] = {};
    const int64_t k_begin = kc * plan.k_chunk, k_end = min(p.k, k_begin + plan.k_chunk);
    const T* a_rows = lora_a + tile.slot * p.a_stride0 + (s * R + j0) * p.a_stride1;
    for (int64_t k = k_begin + threadIdx.x * 8; k < k_end; k += kThreads * 8) {
      const int64_t valid = std::min<int64_t>(8, k_end - k);
      Raw8<T> a_raw[kRankRows], x_raw[kTileRows];
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) load_raw8(a_rows + j * p.a_stride1 + k, plan.vec.a, j < nj ? valid : 0, a_raw[j]);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        load_raw8(x + std::max<int64_t>(rows[r], 0) * p.x_row_stride + k, plan.vec.x, rows[r] >= 0 ? valid : 0,
                  x_raw[r]);
      }
      float a[kRankRows][8];
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) a[j][e] = to_f32(a_raw[j].v[e]);
      }
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xv = to_f32(x_raw[r].v[e]);
#pragma unroll
          for (int j = 0; j < kRankRows; ++j) acc[r][j] = fmaf(xv, a[j][e], acc[r][j]);
        }
      }
    }
    // Fixed-order block reduction: butterfly within warps, then warps in order.
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) {
        float v = acc[r][j];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        if (lane == 0) partial[warp][r * kRankRows + j] = v;
      }
    }
    __syncthreads();
    if (threadIdx.x < kTileRows * kRankRows) {
      const int r = threadIdx.x / kRankRows, j = threadIdx.x % kRankRows;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) v += partial[w][threadIdx.x];
      if (tile.begin + r < tile.end && j < nj) ws[(kc * P + tile.begin + r) * SR + s * R + j0 + j] = v;
    }
    __syncthreads();
  }

  const int64_t col_chunks = (p.n + kColsPerUnit - 1) / kColsPerUnit;
  cooperative_groups::this_grid().sync();

  // ---- expand ----
  for (int64_t u = blockIdx.x; u < plan.expand_units; u += gridDim.x) {
    const int64_t tile_idx = u / col_chunks, n0 = (u % col_chunks) * kColsPerUnit;
    Tile tile;
    if (!locate_tile(p.seg, p.num_slots, p.lora_ranks, p.lora_scales, p.scale, R, kTileRows, tile_idx, &tile)) continue;
    const int64_t nrows = tile.end - tile.begin, rank = tile.rank, width = S * rank;
    // All partials of the tile in one round of independent loads, then summed over K chunks in order.
    const int64_t entries = nrows * width;
    for (int64_t i = threadIdx.x; i < entries * plan.k_splits; i += kThreads) {
      const int64_t kc = i / entries, e = i % entries, r = e / width, sj = e % width;
      h_tile[kc * kTileRows * SR + r * SR + (sj / rank) * R + sj % rank] =
          ws[(kc * P + tile.begin + r) * SR + (sj / rank) * R + sj % rank];
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < entries; i += kThreads) {
      const int64_t off = (i / width) * SR + ((i % width) / rank) * R + (i % width) % rank;
      float v = h_tile[off];
      for (int64_t kc = 1; kc < plan.k_splits; ++kc) v += h_tile[kc * kTileRows * SR + off];
      h_tile[off] = v * tile.coef;
    }
    __syncthreads();
    int64_t rows[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) rows[r] = r < nrows ? segment_row(p.seg, tile.begin + r, p.rows) : -1;
    // Issue every y load of the unit before any arithmetic or store (no load waits behind a store).
    float acc[kColsPerThread][kTileRows];
    int64_t cols[kColsPerThread], slice[kColsPerThread];
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      const int64_t n = n0 + threadIdx.x * kColsPerThread + c;
      cols[c] = n < p.n ? n : -1;
      int64_t s = 0;
      while (s + 1 < S && n >= p.slice_offsets[s + 1]) ++s;
      slice[c] = s;
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        acc[c][r] = (rows[r] >= 0 && cols[c] >= 0) ? to_f32(y[rows[r] * p.y_row_stride + n]) : 0.f;
      }
    }
    for (int64_t j = 0; j < rank; j += 8) {
      float b[kColsPerThread][8];
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        if (cols[c] >= 0) {
          load8(lora_b + tile.slot * p.b_stride0 + cols[c] * p.b_stride1 + j, plan.vec.b, rank - j, b[c]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) b[c][e] = 0.f;
        }
      }
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) {
          const float* h = h_tile + r * SR + slice[c] * R + j;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (j + e < rank) acc[c][r] = fmaf(h[e], b[c][e], acc[c][r]);
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (rows[r] >= 0 && cols[c] >= 0) y[rows[r] * p.y_row_stride + cols[c]] = from_f32<TY>(acc[c][r]);
      }
    }
    __syncthreads();  // h_tile is rewritten by the next unit
  }
}

// The expand stages every K chunk's partials of its tile: [k_splits][kTileRows][S * R] floats.
constexpr int64_t kMaxKSplits = 8;
constexpr size_t kMaxSmem = 200 * 1024;
size_t expand_smem_bytes(const SgmvParams& p, int64_t k_splits) {
  return sizeof(float) * k_splits * kTileRows * p.num_slices * p.max_rank;
}

template <class F>
decltype(auto) with_kernel(const SgmvParams& p, F&& f) {
  return dispatch_dtype(p.x_dtype, [&](auto xt) {
    using T = typename ElemOf<decltype(xt)::value>::type;
    return p.y_dtype == DType::F32 ? f(sgmv_simt_kernel<T, float>) : f(sgmv_simt_kernel<T, T>);
  });
}

template <class Kernel>
cudaError_t launch_kernel(Kernel kernel, const SgmvParams& p, const SimtPlan& plan, float* ws, cudaStream_t stream) {
  const size_t smem = expand_smem_bytes(p, plan.k_splits);
  if (const cudaError_t err = allow_dynamic_smem((const void*)kernel, smem); err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(plan.grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p, plan, ws);
}

// Co-resident blocks per SM (the cooperative launch's limit), cached per kernel and shared-memory size.
int blocks_per_sm(const SgmvParams& p, size_t smem) {
  return with_kernel(p, [&](auto kernel) {
    static thread_local const void* last_kernel = nullptr;
    static thread_local size_t last_smem = 0;
    static thread_local int last_blocks = 0;
    if (last_kernel != (const void*)kernel || last_smem != smem) {
      allow_dynamic_smem((const void*)kernel, smem);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&last_blocks, kernel, kThreads, smem);
      last_kernel = (const void*)kernel;
      last_smem = smem;
    }
    return last_blocks;
  });
}

}  // namespace

int64_t sgmv_simt_max_rank_columns() { return kMaxSmem / (sizeof(float) * kTileRows); }

SimtPlan plan_sgmv_simt(const SgmvParams& p, int num_sms) {
  SimtPlan plan{};
  const int64_t P = p.seg.positions, R = p.max_rank, S = p.num_slices;
  plan.max_tiles = std::min<int64_t>(P, (P + kTileRows - 1) / kTileRows + p.seg.num_segments);
  const int64_t rank_chunks = (R + kRankRows - 1) / kRankRows;
  // Split K until the shrink has about one unit per SM, keeping >= 512 elements per chunk.
  const int64_t per_split = std::max<int64_t>(1, plan.max_tiles * S * rank_chunks);
  int64_t splits = 1;
  while (splits * 2 <= kMaxKSplits && splits * 2 * per_split <= num_sms && p.k / (splits * 2) >= 512 &&
         expand_smem_bytes(p, splits * 2) <= kMaxSmem) {
    splits *= 2;
  }
  plan.k_splits = splits;
  plan.k_chunk = ((p.k + splits - 1) / splits + 7) / 8 * 8;
  plan.shrink_units = plan.max_tiles * S * rank_chunks * splits;
  plan.expand_units = plan.max_tiles * ((p.n + kColsPerUnit - 1) / kColsPerUnit);
  const int64_t want = std::max(plan.shrink_units, plan.expand_units);
  const int max_blocks_per_sm = std::max(1, blocks_per_sm(p, expand_smem_bytes(p, splits)));
  plan.grid = (int)std::max<int64_t>(1, std::min<int64_t>(want, (int64_t)num_sms * std::min(max_blocks_per_sm, 4)));
  plan.vec = vec16_access(p);
  return plan;
}

size_t sgmv_simt_workspace_floats(const SgmvParams& p, const SimtPlan& plan) {
  return (size_t)plan.k_splits * p.seg.positions * p.num_slices * p.max_rank;
}

cudaError_t launch_sgmv_simt(const SgmvParams& p, const SimtPlan& plan, float* ws, cudaStream_t stream) {
  return with_kernel(p, [&](auto kernel) { return launch_kernel(kernel, p, plan, ws, stream); });
}

}  // namespace lora_ops::cuda
