// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// The work is (tile, column block) items: tiles of kTileRows positions of one segment, blocks of kBlockCols
// columns over all slices. At decode sizes a CTA's cost is its chain of dependent memory trips, and a grid sized
// by the tile bound (every pool slot's segment) is mostly empty tiles, so:
//   - the grid is one wave of resident CTAs, and each CTA takes an even share of the items of the tiles that
//     exist (the walk counts them: one trip), tile-major, so it finds one or two tiles (one trip for the rows
//     and the rank each) and streams a run of their column blocks;
//   - per tile, h (scaled, every slice) goes to shared memory once, after grid_dependency_wait;
//   - the stream is a per-thread cp.async pipeline of kStages (column block, rank step) units: each of the
//     256 threads owns kCols consecutive columns, copies its B (kStep rank columns) and, for a block's last
//     step, its y into its own slots of the stage, and multiplies the oldest unit while the newer ones are in
//     flight. Nothing is shared between threads there, so the stream has no barrier. y is written once per
//     block (ranks above kRankChunk take one pass over y per chunk of h).
// Operands not 16-byte aligned (or y not kCols-aligned) take the same pipeline with element copies.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 2;  // consecutive columns per thread
constexpr int kBlockCols = kThreads * kCols;
constexpr int kTileRows = 4;
constexpr int kStep = 16;        // rank columns of B per pipeline unit
constexpr int kRankChunk = 128;  // ranks of h staged per pass
constexpr int kStages = 3;

// One thread's slots of a pipeline stage, stored thread-minor (a warp's accesses never share a bank): B as 16-byte
// words (kStep ranks of each of its kCols columns), then y (kCols elements of each tile row).
template <class TB, class TY>
struct Stage {
  static constexpr int kRanksPerWord = 16 / sizeof(TB);
  static constexpr int kWordsPerCol = kStep / kRanksPerWord;
  static constexpr int kBWords = kCols * kWordsPerCol;
  static constexpr int kYBytes = kCols * sizeof(TY);
  using YWord = std::conditional_t<kYBytes == 4, uint32_t, uint2>;
  static constexpr size_t kBytes = (size_t)kThreads * (kBWords * 16 + kTileRows * kYBytes);

  uint4* b;
  YWord* y;
  __device__ __forceinline__ Stage(char* base) : b(reinterpret_cast<uint4*>(base)),
                                                 y(reinterpret_cast<YWord*>(base + kThreads * kBWords * 16)) {}
};

template <int kBytes>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem, int bytes) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(kBytes), "r"(bytes));
}

template <class T>
__device__ __forceinline__ void prefetch_l2(const T* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// Column block b (over all slices in order): its slice, this thread's first column and column count.
struct ColumnBlock {
  int64_t n0, slice;
  int cols;
};
__device__ __forceinline__ ColumnBlock column_block(const ExpandParams& p, int64_t b) {
  int64_t s = 0;
  for (; s + 1 < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
    if (b < blocks) break;
    b -= blocks;
  }
  const int64_t n0 = p.slice_offsets[s] + b * kBlockCols + threadIdx.x * kCols;
  return {n0, s, (int)std::max<int64_t>(0, std::min<int64_t>(kCols, p.slice_offsets[s + 1] - n0))};
}

// kVec: B columns allow 16-byte copies and y rows kCols-element copies (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads) lora_expand_kernel(ExpandParams p, int64_t col_blocks, int h_chunk) {
  using St = Stage<TB, TY>;
  extern __shared__ uint4 smem[];
  const int slices = (int)p.num_slices;
  float* h_s = reinterpret_cast<float*>(smem);  // [kTileRows][slices][h_chunk]
  const size_t h_bytes = ((size_t)kTileRows * slices * h_chunk * sizeof(float) + 15) / 16 * 16;
  char* stage_base = reinterpret_cast<char*>(smem) + h_bytes;
  __shared__ int64_t s_rows[kTileRows], s_tiles;
  const int tid = threadIdx.x;
  TY* y = static_cast<TY*>(p.y);

  if (tid < 32) {
    TileRef none;
    int64_t tiles = 0;
    warp_find_tile(p.seg, p.num_slots, kTileRows, INT64_MAX, &none, &tiles);
    if (tid == 0) s_tiles = tiles;
  }
  __syncthreads();
  int64_t item, item_end;
  split_range(s_tiles * col_blocks, gridDim.x, blockIdx.x, &item, &item_end);

  while (item < item_end) {
    const int64_t t = item / col_blocks, b_begin = item % col_blocks;
    const int64_t b_end = std::min<int64_t>(col_blocks, b_begin + (item_end - item));
    item += b_end - b_begin;
    __syncthreads();  // a previous tile's readers of s_rows and h_s are done
    TileRef tile;
    if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, t, &tile, s_rows, p.lora_ranks, p.max_rank)) return;
    const int64_t slot = tile.slot, rank = tile.size;
    if (rank == 0) continue;
    const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
    int64_t rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) rows[m] = s_rows[m];
    const TB* b_slot = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0;
    const TH* h_slot = static_cast<const TH*>(p.h) + slot * p.h_slot_stride;

    for (int64_t j0 = 0; j0 < rank; j0 += kRankChunk) {
      const int jn = (int)std::min<int64_t>(kRankChunk, rank - j0), steps = (jn + kStep - 1) / kStep;
      const int64_t units = (b_end - b_begin) * steps;  // unit u: block b_begin + u / steps, rank step u % steps

      // Copies unit u into stage u % kStages (thread-private slots), as one cp.async group (maybe empty).
      auto issue = [&](int64_t u) {
        if (u < units) {
          const ColumnBlock blk = column_block(p, b_begin + u / steps);
          const int step = (int)(u % steps), ranks_left = jn - step * kStep;
          St st(stage_base + (u % kStages) * St::kBytes);
          const TB* src = b_slot + blk.n0 * p.b_stride1 + j0 + step * kStep;
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int w = 0; w < St::kWordsPerCol; ++w) {
              const int r0 = w * St::kRanksPerWord;
              const int valid = c < blk.cols ? max(0, min(ranks_left - r0, (int)St::kRanksPerWord)) : 0;
              uint4* dst = &st.b[(c * St::kWordsPerCol + w) * kThreads + tid];
              if (kVec) {
                cp_async16(dst, src + c * p.b_stride1 + r0, valid * (int)sizeof(TB));
              } else {
                TB e[St::kRanksPerWord];
#pragma unroll
                for (int i = 0; i < St::kRanksPerWord; ++i) {
                  e[i] = i < valid ? src[c * p.b_stride1 + r0 + i] : from_f32<TB>(0.f);
                }
                memcpy(dst, e, 16);
              }
            }
          }
          if (step == steps - 1) {  // the block's y, read with its last step (the stage that adds into it)
#pragma unroll
            for (int m = 0; m < kTileRows; ++m) {
              if (rows[m] < 0 || blk.cols == 0) continue;
              const TY* ysrc = y + rows[m] * p.y_row_stride + blk.n0;
              typename St::YWord* dst = &st.y[m * kThreads + tid];
              if (kVec) {
                cp_async_small<St::kYBytes>(dst, ysrc, St::kYBytes);
              } else {
                TY e[kCols];
#pragma unroll
                for (int c = 0; c < kCols; ++c) e[c] = c < blk.cols ? ysrc[c] : from_f32<TY>(0.f);
                memcpy(dst, e, St::kYBytes);
              }
            }
          }
        }
        cp_async_commit();
      };

      // Weights are never written by the producer: the first units' B goes to L2 before the wait.
      for (int64_t u = 0; u < std::min<int64_t>(units, kStages - 1); ++u) {
        const ColumnBlock blk = column_block(p, b_begin + u / steps);
        for (int c = 0; c < blk.cols; ++c) prefetch_l2(b_slot + (blk.n0 + c) * p.b_stride1 + j0 + (u % steps) * kStep);
      }
      grid_dependency_wait();
      for (int64_t u = 0; u < kStages - 1; ++u) issue(u);

      if (j0 > 0) __syncthreads();  // the previous pass's readers of h_s are done
      const int padded = steps * kStep;
      for (int i = tid; i < kTileRows * slices * padded; i += kThreads) {
        const int m = i / (slices * padded), s = i / padded % slices, j = i % padded;
        float v = 0.f;  // zero past the rank: B is zero there too, and 0 * stale shared memory could be NaN
        if (s_rows[m] >= 0 && j < jn) {
          const TH* src = h_slot + s_rows[m] * p.h_row_stride + s * p.max_rank + j0 + j;
          for (int64_t split = 0; split < p.h_splits; ++split) v += to_f32(src[split * p.h_split_stride]);
          v *= coef;
        }
        h_s[(m * slices + s) * h_chunk + j] = v;
      }
      __syncthreads();

      float acc[kTileRows][kCols] = {};
      for (int64_t u = 0; u < units; ++u) {
        issue(u + kStages - 1);
        cp_async_wait<kStages - 1>();  // this thread's copies of unit u have landed
        const ColumnBlock blk = column_block(p, b_begin + u / steps);
        const int step = (int)(u % steps);
        St st(stage_base + (u % kStages) * St::kBytes);
        TB b[kCols][kStep];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int w = 0; w < St::kWordsPerCol; ++w) {
            const uint4 word = st.b[(c * St::kWordsPerCol + w) * kThreads + tid];
            memcpy(&b[c][w * St::kRanksPerWord], &word, 16);
          }
        }
        const float* h_step = h_s + blk.slice * h_chunk + step * kStep;
#pragma unroll
        for (int j = 0; j < kStep; ++j) {
#pragma unroll
          for (int m = 0; m < kTileRows; ++m) {
            const float hv = h_step[m * slices * h_chunk + j];
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[m][c] += hv * to_f32(b[c][j]);
          }
        }
        if (step == steps - 1) {  // y += acc for the block, acc back to zero
#pragma unroll
          for (int m = 0; m < kTileRows; ++m) {
            if (rows[m] >= 0 && blk.cols > 0) {
              TY e[kCols];
              memcpy(e, &st.y[m * kThreads + tid], St::kYBytes);
#pragma unroll
              for (int c = 0; c < kCols; ++c) e[c] = from_f32<TY>(to_f32(e[c]) + acc[m][c]);
              TY* dst = y + rows[m] * p.y_row_stride + blk.n0;
              if (kVec) {
                typename St::YWord word;
                memcpy(&word, e, St::kYBytes);
                *reinterpret_cast<typename St::YWord*>(dst) = word;
              } else {
                for (int c = 0; c < blk.cols; ++c) dst[c] = e[c];
              }
            }
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[m][c] = 0.f;
          }
        }
      }
    }
  }
}

using KernelFn = void (*)(ExpandParams, int64_t, int);

template <class TB, class TH, class TY>
KernelFn kernel_for(bool vec) {
  return vec ? lora_expand_kernel<TB, TH, TY, true> : lora_expand_kernel<TB, TH, TY, false>;
}

template <class TB>
KernelFn pick_kernel(const ExpandParams& p, bool vec, size_t* stage_bytes) {
  if (p.h_dtype == DType::F32) {
    *stage_bytes = kStages * (p.y_dtype == DType::F32 ? Stage<TB, float>::kBytes : Stage<TB, TB>::kBytes);
    return p.y_dtype == DType::F32 ? kernel_for<TB, float, float>(vec) : kernel_for<TB, float, TB>(vec);
  }
  *stage_bytes = kStages * (p.y_dtype == DType::F32 ? Stage<TB, float>::kBytes : Stage<TB, TB>::kBytes);
  return p.y_dtype == DType::F32 ? kernel_for<TB, TB, float>(vec) : kernel_for<TB, TB, TB>(vec);
}

// CTAs of `kernel` with `smem` bytes of dynamic shared memory resident on the whole device, asked once per
// (device, kernel, smem); raises the kernel's shared-memory limit first.
cudaError_t resident_ctas(KernelFn kernel, size_t smem, int64_t* out) {
  static std::mutex mutex;
  static std::map<std::tuple<int, KernelFn, size_t>, int64_t> known;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = known.find({device, kernel, smem}); it != known.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (err != cudaSuccess) return err;
  if (per_sm == 0) return cudaErrorInvalidConfiguration;
  const std::lock_guard<std::mutex> lock(mutex);
  *out = known[{device, kernel, smem}] = (int64_t)sms * per_sm;
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_lora_expand(const ExpandParams& p, int cc_major, cudaStream_t stream) {
  const int64_t P = p.seg.positions;
  const int64_t tile_bound = std::min<int64_t>(P, (P + kTileRows - 1) / kTileRows + p.seg.num_segments);
  int64_t col_blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    col_blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
  }
  if (tile_bound == 0 || col_blocks == 0 || p.max_rank == 0) return cudaSuccess;
  // Vector path: 16-byte copies of B, kCols-element copies of y (every slice starts on one).
  const int64_t eb = dtype_size(p.b_dtype), y_vec = kCols * dtype_size(p.y_dtype);
  bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
             reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) vec = vec && p.slice_offsets[s] % kCols == 0;
  size_t stage_bytes = 0;
  const KernelFn kernel = p.b_dtype == DType::F16    ? pick_kernel<__half>(p, vec, &stage_bytes)
                          : p.b_dtype == DType::BF16 ? pick_kernel<__nv_bfloat16>(p, vec, &stage_bytes)
                                                     : pick_kernel<float>(p, vec, &stage_bytes);
  const int h_chunk = (int)std::min<int64_t>(kRankChunk, (p.max_rank + kStep - 1) / kStep * kStep);
  const size_t h_bytes = ((size_t)kTileRows * p.num_slices * h_chunk * sizeof(float) + 15) / 16 * 16;
  const size_t smem = h_bytes + stage_bytes;
  int64_t resident = 0;
  if (const cudaError_t err = resident_ctas(kernel, smem, &resident); err != cudaSuccess) return err;
  const int64_t ctas = std::min<int64_t>({resident, tile_bound * col_blocks, INT32_MAX});
  return launch_pdl(kernel, dim3((unsigned)ctas), kThreads, smem, cc_major >= 9, stream, p, col_blocks, h_chunk);
}

}  // namespace lora_ops::cuda
