// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// One CTA per (tile of 8 positions of one segment, 512 columns of one slice); each of the 128 threads owns 4
// consecutive columns. The tile's scaled h is staged in shared memory in 128-rank chunks; B is read once per
// tile and y once. Launched programmatically dependent on the previous kernel (sm_90): the tile walk and an L2
// prefetch of the CTA's B rows run before grid_dependency_wait, while the producer of h and y still runs.
#include <algorithm>

#include "kernels.h"
#include "common.cuh"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 4;  // consecutive columns per thread
constexpr int kBlockCols = kThreads * kCols;
constexpr int kTileRows = 8;
constexpr int kRankChunk = 128;

template <class T>
__device__ __forceinline__ void prefetch_l2(const T* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// kVec: B rows and y rows allow 16-byte / kCols-element vector accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads) lora_expand_kernel(ExpandParams p) {
  __shared__ float h_s[kTileRows][kRankChunk];
  __shared__ int64_t s_rows[kTileRows];
  const int tid = threadIdx.x;

  // Slice and first column of this CTA's column block.
  int64_t block = blockIdx.y, s = 0;
  for (; s < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
    if (block < blocks) break;
    block -= blocks;
  }
  if (s == p.num_slices) return;
  const int64_t col_end = p.slice_offsets[s + 1];
  const int64_t n0 = p.slice_offsets[s] + block * kBlockCols + tid * kCols;

  TileRef tile;
  if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, blockIdx.x, &tile, s_rows)) return;
  const int64_t slot = tile.slot, rank = slot_size(p.lora_ranks, slot, p.max_rank);
  if (rank == 0) return;
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
  const TB* b_rows = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0 + n0 * p.b_stride1;
  const int cols = (int)std::max<int64_t>(0, std::min<int64_t>(kCols, col_end - n0));
  for (int c = 0; c < cols; ++c) {  // weights: never written by the producer
    for (int64_t off = 0; off < rank; off += 128 / sizeof(TB)) prefetch_l2(b_rows + c * p.b_stride1 + off);
  }
  grid_dependency_wait();

  const TH* h = static_cast<const TH*>(p.h) + slot * p.h_slot_stride + s * p.max_rank;
  float acc[kTileRows][kCols] = {};
  for (int64_t j0 = 0; j0 < rank; j0 += kRankChunk) {
    const int jn = (int)std::min<int64_t>(kRankChunk, rank - j0), jpad = (jn + 7) / 8 * 8;
    for (int i = tid; i < kTileRows * jpad; i += kThreads) {
      const int m = i / jpad, j = i % jpad;
      const int64_t row = s_rows[m];
      float v = 0.f;
      if (row >= 0 && j < jn) {
        const TH* src = h + row * p.h_row_stride + j0 + j;
        for (int64_t split = 0; split < p.h_splits; ++split) v += to_f32(src[split * p.h_split_stride]);
        v *= coef;
      }
      h_s[m][j] = v;
    }
    __syncthreads();
    for (int j = 0; j < jpad; j += 8) {
      float b[kCols][8];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        load8(b_rows + c * p.b_stride1 + j0 + j, kVec, c < cols ? jn - j : 0, b[c]);
      }
#pragma unroll
      for (int m = 0; m < kTileRows; ++m) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float hv = h_s[m][j + jj];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[m][c] += hv * b[c][jj];
        }
      }
    }
    __syncthreads();
  }

  TY* y = static_cast<TY*>(p.y);
  for (int m = 0; m < kTileRows; ++m) {
    const int64_t row = s_rows[m];
    if (row < 0 || cols == 0) continue;
    TY* dst = y + row * p.y_row_stride + n0;
    if (kVec && cols == kCols) {
      using Vec = std::conditional_t<sizeof(TY) == 2, uint2, uint4>;  // kCols elements
      Vec raw = *reinterpret_cast<const Vec*>(dst);
      TY* e = reinterpret_cast<TY*>(&raw);
#pragma unroll
      for (int c = 0; c < kCols; ++c) e[c] = from_f32<TY>(to_f32(e[c]) + acc[m][c]);
      *reinterpret_cast<Vec*>(dst) = raw;
    } else {
      for (int c = 0; c < cols; ++c) dst[c] = from_f32<TY>(to_f32(dst[c]) + acc[m][c]);
    }
  }
}

template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, dim3 grid, bool vec, bool pdl, cudaStream_t stream) {
  return vec ? launch_pdl(lora_expand_kernel<TB, TH, TY, true>, grid, kThreads, pdl, stream, p)
             : launch_pdl(lora_expand_kernel<TB, TH, TY, false>, grid, kThreads, pdl, stream, p);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, dim3 grid, bool vec, bool pdl, cudaStream_t stream) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, grid, vec, pdl, stream)
                                   : launch_typed<TB, float, TB>(p, grid, vec, pdl, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, grid, vec, pdl, stream)
                                 : launch_typed<TB, TB, TB>(p, grid, vec, pdl, stream);
}

}  // namespace

cudaError_t launch_lora_expand(const ExpandParams& p, int cc_major, cudaStream_t stream) {
  const int64_t P = p.seg.positions;
  const int64_t tiles = std::min<int64_t>(P, (P + kTileRows - 1) / kTileRows + p.seg.num_segments);
  int64_t col_blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    col_blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
  }
  if (tiles == 0 || col_blocks == 0 || p.max_rank == 0) return cudaSuccess;
  if (tiles > INT32_MAX || col_blocks > 65535) return cudaErrorInvalidConfiguration;
  // Vector path: 16-byte loads of B rows, kCols-element loads and stores of y (every slice starts on one).
  const int64_t eb = dtype_size(p.b_dtype), y_vec = kCols * dtype_size(p.y_dtype);
  bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
             reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) vec = vec && p.slice_offsets[s] % kCols == 0;
  const dim3 grid((unsigned)tiles, (unsigned)col_blocks);
  const bool pdl = cc_major >= 9;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, grid, vec, pdl, stream);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, grid, vec, pdl, stream);
    default: return launch_b<float>(p, grid, vec, pdl, stream);
  }
}

}  // namespace lora_ops::cuda
