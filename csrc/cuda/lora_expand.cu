// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// One CTA per (512 columns of one slice, tile of 8 positions of one segment); each of the 128 threads owns 4
// consecutive columns. At decode sizes the cost is the chain of dependent memory trips, so the kernel keeps it
// short: the tile walk (one trip), the rows with the rank (one trip), then B's first 16 rank columns are loaded
// into registers; all of that may overlap the producer of h and y (programmatic dependent launch, sm_90). After
// grid_dependency_wait, y and h are loaded together (one trip); h, scaled, goes through shared memory in
// 128-rank chunks, and y is written once. Grid: column blocks fastest, so a tile's blocks start together, and
// only as many tile rows as fit on the device at once (launch_typed).
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 4;  // consecutive columns per thread
constexpr int kBlockCols = kThreads * kCols;
constexpr int kTileRows = 4;
constexpr int kRankChunk = 128;
constexpr int kFirstSteps = 2;  // rank columns / 8 of B loaded before the wait

template <class T>
__device__ __forceinline__ void prefetch_l2(const T* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// kCols consecutive y elements of one row; a vector access when kVec (aligned, checked on the host).
template <class TY, bool kVec>
struct YCols {
  TY v[kCols];
  __device__ __forceinline__ void load(const TY* src, int cols) {
    using Vec = std::conditional_t<sizeof(TY) == 2, uint2, uint4>;
    if (kVec && cols == kCols) {
      *reinterpret_cast<Vec*>(v) = *reinterpret_cast<const Vec*>(src);
    } else {
      for (int c = 0; c < cols; ++c) v[c] = src[c];
    }
  }
  __device__ __forceinline__ void store(TY* dst, int cols) const {
    using Vec = std::conditional_t<sizeof(TY) == 2, uint2, uint4>;
    if (kVec && cols == kCols) {
      *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(v);
    } else {
      for (int c = 0; c < cols; ++c) dst[c] = v[c];
    }
  }
};

// kVec: B rows allow 16-byte loads and y rows kCols-element accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads) lora_expand_kernel(ExpandParams p, int64_t max_tiles) {
  __shared__ float h_s[kTileRows][kRankChunk];
  __shared__ int64_t s_rows[kTileRows];
  const int tid = threadIdx.x;

  // Slice and first column of this CTA's column block.
  int64_t block = blockIdx.x, s = 0;
  for (; s < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + kBlockCols - 1) / kBlockCols;
    if (block < blocks) break;
    block -= blocks;
  }
  if (s == p.num_slices) return;
  const int64_t n0 = p.slice_offsets[s] + block * kBlockCols + tid * kCols;
  const int cols = (int)std::max<int64_t>(0, std::min<int64_t>(kCols, p.slice_offsets[s + 1] - n0));
  TY* y = static_cast<TY*>(p.y);

  for (int64_t t = blockIdx.y; t < max_tiles; t += gridDim.y) {
    __syncthreads();  // a previous tile's readers of s_rows and h_s are done
    TileRef tile;
    if (!block_find_tile<kTileRows>(p.seg, p.num_slots, p.rows, t, &tile, s_rows, p.lora_ranks, p.max_rank)) return;
    const int64_t slot = tile.slot, rank = tile.size;
    if (rank == 0) continue;
    const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
    const TB* b_cols = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0 + n0 * p.b_stride1;
    // Weights are never written by the producer: B's first rank columns go to registers, the rest to L2, now.
    Raw8<TB> b_first[kCols][kFirstSteps];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int st = 0; st < kFirstSteps; ++st) {
        load_raw8(b_cols + c * p.b_stride1 + st * 8, kVec, c < cols ? rank - st * 8 : 0, b_first[c][st]);
      }
      for (int64_t off = kFirstSteps * 8; c < cols && off < rank; off += 128 / sizeof(TB)) {
        prefetch_l2(b_cols + c * p.b_stride1 + off);
      }
    }
    grid_dependency_wait();

    YCols<TY, kVec> y_rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (s_rows[m] >= 0) y_rows[m].load(y + s_rows[m] * p.y_row_stride + n0, cols);
    }
    float acc[kTileRows][kCols] = {};
    auto fma_step = [&](const float (&b)[kCols][8], int j) {
#pragma unroll
      for (int m = 0; m < kTileRows; ++m) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float hv = h_s[m][j + jj];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[m][c] += hv * b[c][jj];
        }
      }
    };
    const TH* h = static_cast<const TH*>(p.h) + slot * p.h_slot_stride + s * p.max_rank;
    for (int64_t j0 = 0; j0 < rank; j0 += kRankChunk) {
      const int jn = (int)std::min<int64_t>(kRankChunk, rank - j0), jpad = (jn + 7) / 8 * 8;
      if (j0 > 0) __syncthreads();  // the previous chunk's readers of h_s are done
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
      int j = 0;
      if (j0 == 0) {
#pragma unroll
        for (int st = 0; st < kFirstSteps; ++st) {
          if (st * 8 >= jpad) break;
          float b[kCols][8];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) b[c][jj] = to_f32(b_first[c][st].v[jj]);
          }
          fma_step(b, st * 8);
        }
        j = kFirstSteps * 8;
      }
      for (; j < jpad; j += 16) {  // two steps' loads in flight at once
        Raw8<TB> raw[2][kCols];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            load_raw8(b_cols + c * p.b_stride1 + j0 + j + 8 * u, kVec, c < cols ? jn - j - 8 * u : 0, raw[u][c]);
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (j + 8 * u >= jpad) break;
          float b[kCols][8];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) b[c][jj] = to_f32(raw[u][c].v[jj]);
          }
          fma_step(b, j + 8 * u);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (s_rows[m] < 0) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c) y_rows[m].v[c] = from_f32<TY>(to_f32(y_rows[m].v[c]) + acc[m][c]);
      y_rows[m].store(y + s_rows[m] * p.y_row_stride + n0, cols);
    }
  }
}

// Grid: the column blocks by as many tile rows as fit on the device at once; each CTA loops over tiles t,
// t + gridDim.y, ... The tile bound counts a segment for every slot, and at decode most of its tiles do not
// exist: a grid of the whole bound spent extra waves on CTAs that only found that out (ncu, gate_up at T=32/32:
// 127 registers, 4 CTAs per SM, 1792 CTAs in 3.4 waves).
template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, int64_t col_blocks, int64_t tiles, bool vec, bool pdl,
                         cudaStream_t stream) {
  auto kernel = vec ? lora_expand_kernel<TB, TH, TY, true> : lora_expand_kernel<TB, TH, TY, false>;
  int64_t resident = 0;
  const cudaError_t err = vec ? resident_ctas<lora_expand_kernel<TB, TH, TY, true>>(kThreads, &resident)
                              : resident_ctas<lora_expand_kernel<TB, TH, TY, false>>(kThreads, &resident);
  if (err != cudaSuccess) return err;
  const int64_t tile_rows = std::max<int64_t>(1, resident / col_blocks);
  const dim3 grid((unsigned)col_blocks, (unsigned)std::min<int64_t>({tiles, tile_rows, 65535}));
  return launch_pdl(kernel, grid, kThreads, pdl, stream, p, tiles);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, int64_t col_blocks, int64_t tiles, bool vec, bool pdl,
                     cudaStream_t stream) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, col_blocks, tiles, vec, pdl, stream)
                                   : launch_typed<TB, float, TB>(p, col_blocks, tiles, vec, pdl, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, col_blocks, tiles, vec, pdl, stream)
                                 : launch_typed<TB, TB, TB>(p, col_blocks, tiles, vec, pdl, stream);
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
  if (col_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  // Vector path: 16-byte loads of B rows, kCols-element loads and stores of y (every slice starts on one).
  const int64_t eb = dtype_size(p.b_dtype), y_vec = kCols * dtype_size(p.y_dtype);
  bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
             reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) vec = vec && p.slice_offsets[s] % kCols == 0;
  const bool pdl = cc_major >= 9;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, col_blocks, tiles, vec, pdl, stream);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, col_blocks, tiles, vec, pdl, stream);
    default: return launch_b<float>(p, col_blocks, tiles, vec, pdl, stream);
  }
}

}  // namespace lora_ops::cuda
