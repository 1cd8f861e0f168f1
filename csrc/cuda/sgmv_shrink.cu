// sgmv, decode regime, step 1 of 2: the shrink h = x * A_l^T of every tile of 8 positions, split over K.
// CTA (tile, split) dots its K chunk of the tile's x rows with every rank row of the slot's A (all slices) and
// writes float32 partials [split][row][S*R]; step 2, lora_expand.cu, sums them in split order (deterministic),
// applies the scales and adds h * B^T into y. grouped_gemm's decode shrink runs it too (grouped_gemm_split.cu sums
// the partials into y). fp16/bf16 on tensor cores (sgmv_shrink_mma_kernel); fp32 on FMAs: each warp takes 4 A
// rows at a time, each lane covers 8 consecutive K elements of every 256-element step, with all of the step's x
// and A loads in flight at once, and the 8 row sums of an A row are reduced across the warp by a transposing
// butterfly (9 shuffles). Until session 16 the FMA kernel served every dtype: at rank 64 (T=256, 32 adapters) it
// took 31.7 us, instruction-bound (csrc/cuda/NOTES.md).
// The CTA lets the expand launch at once (programmatic dependent launch, sm_90): its tile walk and B prefetch
// overlap this kernel.
#include <algorithm>

#include "kernels.h"
#include "mma.cuh"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 8;
constexpr int kStep = 32 * 8;  // K elements per warp step
constexpr int kRowsPerPass = 4;

// After it, lane L holds the warp sum of v[i] for i = (L >> 4 & 1) * 4 + (L >> 3 & 1) * 2 + (L >> 2 & 1).
__device__ __forceinline__ float warp_reduce8(float v[8], int lane) {
#pragma unroll
  for (int half = 4, bit = 16; half >= 1; half >>= 1, bit >>= 1) {
    const bool upper = lane & bit;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
  }
  float s = v[0];
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  return s;
}

// kVec: x and A rows allow 16-byte loads (checked on the host).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) sgmv_shrink_kernel(SgmvParams p, int64_t max_tiles, int64_t k_chunk,
                                                               float* partials) {
  __shared__ int64_t s_rows[kTileRows];
  allow_dependents_to_launch();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t split = blockIdx.x;
  for (int64_t t = blockIdx.y; t < max_tiles; t += gridDim.y) {
    __syncthreads();  // a previous tile's readers of s_rows are done
    TileRef tile;
    if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, t, &tile, s_rows, p.lora_ranks, p.max_rank)) {
      return;
    }
    const int64_t slot = tile.slot, rank = tile.size;
    const int64_t k0 = split * k_chunk, k1 = std::min(p.k, k0 + k_chunk);
    const T* x = static_cast<const T*>(p.x);
    const T* a_slot = static_cast<const T*>(p.lora_a) + slot * p.a_stride0;
    const int64_t SR = p.num_slices * p.max_rank;
    int64_t rows[kTileRows];
  #pragma unroll
    for (int m = 0; m < kTileRows; ++m) rows[m] = s_rows[m];

    for (int64_t e0 = warp * kRowsPerPass; e0 < p.num_slices * rank; e0 += kWarps * kRowsPerPass) {
      float acc[kRowsPerPass][kTileRows] = {};
      for (int64_t k = k0 + lane * 8; k < k1; k += kStep) {
        Raw8<T> xr[kTileRows], ar[kRowsPerPass];
  #pragma unroll
        for (int m = 0; m < kTileRows; ++m) {
          if (rows[m] >= 0) load_raw8(x + rows[m] * p.x_row_stride + k, kVec, k1 - k, xr[m]);
        }
  #pragma unroll
        for (int i = 0; i < kRowsPerPass; ++i) {
          const int64_t e = e0 + i;
          const int64_t a_row = (e / rank) * p.max_rank + e % rank;
          load_raw8(a_slot + a_row * p.a_stride1 + k, kVec, e < p.num_slices * rank ? k1 - k : 0, ar[i]);
        }
  #pragma unroll
        for (int m = 0; m < kTileRows; ++m) {
          if (rows[m] < 0) continue;
  #pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float xv = to_f32(xr[m].v[j]);
  #pragma unroll
            for (int i = 0; i < kRowsPerPass; ++i) acc[i][m] += xv * to_f32(ar[i].v[j]);
          }
        }
      }
  #pragma unroll
      for (int i = 0; i < kRowsPerPass; ++i) {
        const float sum = warp_reduce8(acc[i], lane);
        const int m = (lane >> 4 & 1) * 4 + (lane >> 3 & 1) * 2 + (lane >> 2 & 1);
        const int64_t e = e0 + i;
        const int64_t row = s_rows[m];  // m depends on the lane: shared memory, not the register copy
        if ((lane & 3) == 0 && row >= 0 && e < p.num_slices * rank) {
          partials[(split * p.rows + row) * SR + (e / rank) * p.max_rank + e % rank] = sum;
        }
      }
    }
  }
}

// The same CTA work on tensor cores (fp16/bf16): mma.sync m16n8k16 with 16 A rows (rank rows of every slice) as
// the mma's M, the tile's 8 positions as its N and K in steps of 16. Lane (g, t) loads 8 consecutive K elements
// (one 16-byte load) of A rows g and g + 8 and of position g's x row per 32-element step; the first four feed one
// mma as its k pairs (2t, 2t + 1) and (2t + 8, 2t + 9), the last four the next (K is summed, so any order that A
// and x share is the product). A warp thus holds a 16 x 8 block of h in 4 floats and can keep kLoadSteps steps'
// loads in flight. Where the M blocks do not split evenly over the 4 warps (rank 16: one block; rank 16 or 32 of
// three slices: 3 or 6), the CTA's K chunk is split too, and each block's parts are summed in part order through
// shared memory (deterministic).
constexpr int kMmaSteps = 4;  // 32-element K steps whose loads are issued together

// A lane's 8 elements at offset k of its row (null: a row outside the tile or past the rank, zeros).
template <class T>
__device__ __forceinline__ void load_lane8(const T* row, int64_t k, bool vec, int64_t valid, Raw8<T>& out) {
  load_raw8(row ? row + k : row, vec, row ? valid : 0, out);
}

// K parts per M block: enough that the (block, part) units split evenly over the warps, while their C fragments
// fit kMaxUnits slots of shared memory; else one part (a warp takes whole blocks).
constexpr int kMaxUnits = 16;
__device__ __forceinline__ int shrink_k_parts(int64_t blocks) {
  const int parts = blocks % kWarps == 0 ? 1 : (blocks % 2 == 0 ? 2 : kWarps);
  return blocks * parts <= kMaxUnits ? parts : 1;
}

// h of the units' 16 A rows at the tile's positions (C fragment: acc[0], acc[1] = A row g at positions 2t, 2t + 1;
// acc[2], acc[3] = row g + 8) into the partials.
__device__ __forceinline__ void store_block(const SgmvParams& p, float* partials, int64_t split, int64_t block,
                                            int64_t rank, const int64_t* s_rows, const float acc[4], int g, int t) {
  const int64_t rows_of_a = p.num_slices * rank, SR = p.num_slices * p.max_rank;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t e = block * 16 + g + 8 * (i >> 1), row = s_rows[2 * t + (i & 1)];
    if (e < rows_of_a && row >= 0) partials[(split * p.rows + row) * SR + (e / rank) * p.max_rank + e % rank] = acc[i];
  }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) sgmv_shrink_mma_kernel(SgmvParams p, int64_t max_tiles, int64_t k_chunk,
                                                                   float* partials) {
  __shared__ int64_t s_rows[kTileRows];
  __shared__ float s_units[kMaxUnits][4][32];  // the units' C fragments, when the blocks' K is split
  allow_dependents_to_launch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t split = blockIdx.x;
  for (int64_t tile_index = blockIdx.y; tile_index < max_tiles; tile_index += gridDim.y) {
    __syncthreads();  // a previous tile's readers of s_rows and s_units are done
    TileRef tile;
    if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, tile_index, &tile, s_rows, p.lora_ranks,
                                    p.max_rank)) {
      return;
    }
    const int64_t rank = tile.size, rows_of_a = p.num_slices * rank;
    const int64_t blocks = (rows_of_a + 15) / 16;  // M blocks of 16 A rows
    if (blocks == 0) continue;
    // Units (block, K part), unit u = part * blocks + block, warp w taking units w, w + 4, ...; each part covers
    // whole 32-element steps of the CTA's K chunk.
    const int k_parts = shrink_k_parts(blocks);
    const int64_t k0 = split * k_chunk, k1 = std::min(p.k, k0 + k_chunk);
    const int64_t part_len = ((k1 - k0 + k_parts - 1) / k_parts + 31) / 32 * 32;
    const T* a_slot = static_cast<const T*>(p.lora_a) + tile.slot * p.a_stride0;
    const int64_t x_row = s_rows[g];
    const T* x_lane = x_row >= 0 ? static_cast<const T*>(p.x) + x_row * p.x_row_stride + 8 * t : nullptr;
    for (int64_t unit = warp; unit < blocks * k_parts; unit += kWarps) {
      const int64_t block = unit % blocks, part = unit / blocks;
      // This lane's two A rows of the block (slice-major, each slice's rank rows first): null past the rows.
      const T* a_lane[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t e = block * 16 + g + 8 * half;
        a_lane[half] = e < rows_of_a ? a_slot + ((e / rank) * p.max_rank + e % rank) * p.a_stride1 + 8 * t : nullptr;
      }
      float acc[4] = {};
      const int64_t ka = k0 + part * part_len, kb = std::min(k1, ka + part_len);
      for (int64_t k = ka; k < kb; k += 32 * kMmaSteps) {
        Raw8<T> xr[kMmaSteps], ar[kMmaSteps][2];
#pragma unroll
        for (int u = 0; u < kMmaSteps; ++u) {
          const int64_t kk = k + 32 * u, valid = kb - kk - 8 * t;  // elements of this lane's 8 inside the part
          load_lane8(x_lane, kk, kVec, valid, xr[u]);
#pragma unroll
          for (int half = 0; half < 2; ++half) load_lane8(a_lane[half], kk, kVec, valid, ar[u][half]);
        }
#pragma unroll
        for (int u = 0; u < kMmaSteps; ++u) {
          const uint32_t* xw = reinterpret_cast<const uint32_t*>(xr[u].v);
          const uint32_t* a0 = reinterpret_cast<const uint32_t*>(ar[u][0].v);
          const uint32_t* a1 = reinterpret_cast<const uint32_t*>(ar[u][1].v);
#pragma unroll
          for (int m = 0; m < 2; ++m) {  // elements 4m .. 4m + 3 of the lane's 8: one mma's k pairs
            const uint32_t a[4] = {a0[2 * m], a1[2 * m], a0[2 * m + 1], a1[2 * m + 1]};
            const uint32_t b[2] = {xw[2 * m], xw[2 * m + 1]};
            mma16816<T>(acc, a, b);
          }
        }
      }
      if (k_parts == 1) {
        store_block(p, partials, split, block, rank, s_rows, acc, g, t);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) s_units[unit][i][lane] = acc[i];
      }
    }
    if (k_parts > 1) {  // each block's parts summed in part order
      __syncthreads();
      for (int64_t block = warp; block < blocks; block += kWarps) {
        float sum[4] = {};
        for (int q = 0; q < k_parts; ++q) {
#pragma unroll
          for (int i = 0; i < 4; ++i) sum[i] += s_units[q * blocks + block][i][lane];
        }
        store_block(p, partials, split, block, rank, s_rows, sum, g, t);
      }
    }
  }
}

}  // namespace

ShrinkPlan plan_sgmv_shrink(const SgmvParams& p, int num_sms) {
  ShrinkPlan plan{};
  plan.max_tiles = max_segment_tiles(p.seg, kTileRows);
  // About four CTAs per SM: split K while the tiles alone do not fill the GPU, whole 256-element steps each.
  const int64_t steps = std::max<int64_t>(1, (p.k + kStep - 1) / kStep);
  const int64_t want = std::clamp<int64_t>((4 * num_sms + plan.max_tiles - 1) / std::max<int64_t>(plan.max_tiles, 1),
                                           1, steps);
  plan.k_chunk = (steps + want - 1) / want * kStep;
  plan.splits = std::max<int64_t>(1, (p.k + plan.k_chunk - 1) / plan.k_chunk);
  return plan;
}

cudaError_t launch_sgmv_shrink(const SgmvParams& p, const ShrinkPlan& plan, float* partials, cudaStream_t stream) {
  if (plan.max_tiles == 0) return cudaSuccess;
  if (plan.splits > INT32_MAX) return cudaErrorInvalidConfiguration;
  const int64_t es = dtype_size(p.x_dtype);
  const bool vec = aligned(p.x, {p.x_row_stride * es}) && aligned(p.lora_a, {p.a_stride0 * es, p.a_stride1 * es});
  auto launch = [&](auto tag) {
    using T = typename ElemOf<decltype(tag)::value>::type;
    auto kernel = [&] {
      if constexpr (std::is_same_v<T, float>) return vec ? sgmv_shrink_kernel<T, true> : sgmv_shrink_kernel<T, false>;
      else return vec ? sgmv_shrink_mma_kernel<T, true> : sgmv_shrink_mma_kernel<T, false>;  // tensor cores
    }();
    // Splits fastest: a tile's CTAs start together, and tiles that do not exist come last.
    const dim3 grid((unsigned)plan.splits, (unsigned)std::min<int64_t>(plan.max_tiles, 65535));
    kernel<<<grid, kThreads, 0, stream>>>(p, plan.max_tiles, plan.k_chunk, partials);
    return cudaGetLastError();
  };
  return dispatch_dtype(p.x_dtype, launch);
}

}  // namespace lora_ops::cuda
