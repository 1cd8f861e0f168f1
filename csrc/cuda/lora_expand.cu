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
// 128-rank chunks, and y is written once. Grid: column blocks fastest, so a tile's blocks start together and
// tiles that do not exist (the bound counts every slot's segment) come last.
//
// lora_expand_mma_kernel (16-bit B, sm_80+; the automatic choice there): the same walk and chain, but the product
// is mma.sync m16n8k16 with y transposed: 16 columns of y (B's rows) by a tile of up to 8 rows of one segment,
// K = 16 ranks; a CTA takes 128 columns (4 warps x 2 m-tiles; 72 registers). A rank-16 tile costs a warp 2 mma
// and 8 B loads for 32 columns, against 128 FMA per thread for 4 columns in the SIMT kernel (ncu of the SIMT
// kernel at gate_up, T=32/32: 127 registers, 4 CTAs per SM, 3.4 waves, one instruction issued every 3.6 cycles
// per scheduler: its instruction count, not DRAM, set the time). h enters the mma in B's type: exactly when h
// has that type and one split, else as a hi + lo pair of two mma (float32 h: ~16 mantissa bits).
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"
#include "mma.cuh"

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

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kWarpTiles = 2;  // m-tiles of 16 columns per warp (4: 128 registers, fewer CTAs per SM)
constexpr int kMmaBlockCols = kMmaWarps * kWarpTiles * 16;
constexpr int kMmaTileRows = 8;  // the mma's N

// Two consecutive elements [k, k + 1] of a B column (zero past `valid`), packed as an mma operand pair.
template <class TB, bool kVec>
__device__ __forceinline__ uint32_t load_b_pair(const TB* ptr, int64_t valid) {
  if (kVec && valid >= 2) return *reinterpret_cast<const uint32_t*>(ptr);
  const TB zero = from_f32<TB>(0.f);
  const TB lo = valid >= 1 ? ptr[0] : zero, hi = valid >= 2 ? ptr[1] : zero;
  return (uint32_t)__builtin_bit_cast(uint16_t, lo) | ((uint32_t)__builtin_bit_cast(uint16_t, hi) << 16);
}

// h[row, k] and h[row, k + 1] summed over the splits in float32; zero for a missing row or past `valid`.
template <class TH>
__device__ __forceinline__ float2 load_h_pair(const TH* h, int64_t row, const ExpandParams& p, int64_t valid) {
  float2 v = {0.f, 0.f};
  if (row < 0) return v;
  const TH* src = h + row * p.h_row_stride;
  for (int64_t split = 0; split < p.h_splits; ++split, src += p.h_split_stride) {
    if (valid >= 1) v.x += to_f32(src[0]);
    if (valid >= 2) v.y += to_f32(src[1]);
  }
  return v;
}

// y^T[columns, rows] += B[slot, columns, :rank] * h[rows, :rank]^T: the mma's M is 16 columns of y (B's rows, the
// A operand), N the tile's 8 rows (h, the B operand), K 16 ranks. Per 16 columns a warp holds B's 512 bytes and
// a 16 x 8 float32 accumulator.
// kVec: B's column pairs allow 4-byte loads (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kMmaThreads) lora_expand_mma_kernel(ExpandParams p, int64_t max_tiles) {
  __shared__ int64_t s_rows[kMmaTileRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int group = lane / 4, quad = lane % 4;  // fragment coordinates of mma.m16n8k16

  int64_t block = blockIdx.x, s = 0;
  for (; s < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + kMmaBlockCols - 1) / kMmaBlockCols;
    if (block < blocks) break;
    block -= blocks;
  }
  if (s == p.num_slices) return;
  const int64_t slice_end = p.slice_offsets[s + 1];
  const int64_t warp_n0 = p.slice_offsets[s] + block * kMmaBlockCols + warp * kWarpTiles * 16;
  TY* y = static_cast<TY*>(p.y);
  // Exact single mma when h is already B's type and has one split; else h = hi + lo, two mma.
  const bool two_terms = !std::is_same_v<TH, TB> || p.h_splits != 1;

  for (int64_t t = blockIdx.y; t < max_tiles; t += gridDim.y) {
    __syncthreads();  // a previous tile's readers of s_rows are done
    TileRef tile;
    if (!block_find_tile<kMmaTileRows>(p.seg, p.num_slots, p.rows, t, &tile, s_rows, p.lora_ranks, p.max_rank)) {
      return;
    }
    const int64_t slot = tile.slot, rank = tile.size;
    if (rank == 0) continue;
    const TB* b_slot = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0;
    // A fragment i of m-tile j: column warp_n0 + 16j + group (+8 for odd i), ranks k0 + 2 quad (+8 for i >= 2).
    uint32_t a_next[kWarpTiles][4];
    auto load_b = [&](int64_t k0) {
#pragma unroll
      for (int j = 0; j < kWarpTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t n = warp_n0 + 16 * j + group + 8 * (i & 1), k = k0 + 2 * quad + 8 * (i >> 1);
          a_next[j][i] = n < slice_end ? load_b_pair<TB, kVec>(b_slot + n * p.b_stride1 + k, rank - k) : 0u;
        }
      }
    };
    load_b(0);  // weights are never written by the producer of h and y: before the wait
    grid_dependency_wait();

    const int64_t h_row = s_rows[group];  // the B operand's column n = group is the tile's row `group`
    const TH* h = static_cast<const TH*>(p.h) + slot * p.h_slot_stride + s * p.max_rank;
    float acc[kWarpTiles][4] = {};
    for (int64_t k0 = 0; k0 < rank; k0 += 16) {
      uint32_t a_cur[kWarpTiles][4];
#pragma unroll
      for (int j = 0; j < kWarpTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a_cur[j][i] = a_next[j][i];
      }
      if (k0 + 16 < rank) load_b(k0 + 16);  // the next rank step's loads overlap this one's mma
      const int64_t k = k0 + 2 * quad;
      uint32_t h_hi[2], h_lo[2];
      split_pack<TB>(load_h_pair(h + k, h_row, p, rank - k), &h_hi[0], &h_lo[0]);
      split_pack<TB>(load_h_pair(h + k + 8, h_row, p, rank - k - 8), &h_hi[1], &h_lo[1]);
#pragma unroll
      for (int j = 0; j < kWarpTiles; ++j) {
        mma16816<TB>(acc[j], a_cur[j], h_hi);
        if (two_terms) mma16816<TB>(acc[j], a_cur[j], h_lo);
      }
    }

    // Accumulator i of m-tile j: column warp_n0 + 16j + group (+8 for i >= 2), tile row 2 quad (+1 for odd i).
    const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
    const int64_t rows[2] = {s_rows[2 * quad], s_rows[2 * quad + 1]};
#pragma unroll
    for (int j = 0; j < kWarpTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t n = warp_n0 + 16 * j + group + 8 * (i >> 1), row = rows[i & 1];
        if (row < 0 || n >= slice_end) continue;
        TY* dst = y + row * p.y_row_stride + n;
        *dst = from_f32<TY>(to_f32(*dst) + coef * acc[j][i]);
      }
    }
  }
}

// Grid: the column blocks by as many tile rows as fit on the device at once (each CTA loops over tiles
// t, t + gridDim.y, ...). The tile bound counts a segment for every slot, and at decode most of those tiles do
// not exist: a grid of the whole bound spent extra waves on CTAs that only found that out.
template <class Kernel>
cudaError_t launch_resident(Kernel kernel, int threads, int64_t col_blocks, int64_t tiles, bool pdl,
                            cudaStream_t stream, const ExpandParams& p) {
  if (tiles == 0 || col_blocks == 0) return cudaSuccess;
  if (col_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  int64_t resident = 0;
  if (const cudaError_t err = resident_ctas((const void*)kernel, threads, &resident); err != cudaSuccess) return err;
  const int64_t tile_rows = std::max<int64_t>(1, resident / col_blocks);
  const dim3 grid((unsigned)col_blocks, (unsigned)std::min<int64_t>({tiles, tile_rows, 65535}));
  return launch_pdl(kernel, grid, threads, pdl, stream, p, tiles);
}

int64_t column_blocks(const ExpandParams& p, int64_t block_cols) {
  int64_t blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + block_cols - 1) / block_cols;
  }
  return blocks;
}

// At most min(P, ceil(P / tile_rows) + G) tiles (warp_find_tile).
int64_t tile_bound(const ExpandParams& p, int64_t tile_rows) {
  const int64_t P = p.seg.positions;
  return std::min<int64_t>(P, (P + tile_rows - 1) / tile_rows + p.seg.num_segments);
}

bool slices_start_on(const ExpandParams& p, int64_t multiple) {
  for (int64_t s = 0; s <= p.num_slices; ++s) {
    if (p.slice_offsets[s] % multiple != 0) return false;
  }
  return true;
}

template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, bool mma, bool pdl, cudaStream_t stream) {
  const int64_t eb = dtype_size(p.b_dtype), ey = dtype_size(p.y_dtype);
  const auto y_addr = reinterpret_cast<uintptr_t>(p.y);
  if constexpr (!std::is_same_v<TB, float>) {
    if (mma) {
      // Vector path: 4-byte loads of B's rank pairs (even strides).
      const bool vec = reinterpret_cast<uintptr_t>(p.lora_b) % 4 == 0 && p.b_stride0 % 2 == 0 && p.b_stride1 % 2 == 0;
      return launch_resident(vec ? lora_expand_mma_kernel<TB, TH, TY, true> : lora_expand_mma_kernel<TB, TH, TY, false>,
                             kMmaThreads, column_blocks(p, kMmaBlockCols), tile_bound(p, kMmaTileRows), pdl, stream,
                             p);
    }
  }
  // Vector path: 16-byte loads of B rows, kCols-element loads and stores of y (every slice starts on one).
  const bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) && y_addr % (kCols * ey) == 0 &&
                   p.y_row_stride % kCols == 0 && slices_start_on(p, kCols);
  return launch_resident(vec ? lora_expand_kernel<TB, TH, TY, true> : lora_expand_kernel<TB, TH, TY, false>,
                         kThreads, column_blocks(p, kBlockCols), tile_bound(p, kTileRows), pdl, stream, p);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, bool mma, bool pdl, cudaStream_t stream) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, mma, pdl, stream)
                                   : launch_typed<TB, float, TB>(p, mma, pdl, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, mma, pdl, stream)
                                 : launch_typed<TB, TB, TB>(p, mma, pdl, stream);
}

}  // namespace

bool lora_expand_mma_supported(const ExpandParams& p, int cc_major) {
  if (cc_major < 8) return false;
  if (p.b_dtype == DType::BF16) return true;  // bf16 has float32's range: hi + lo never overflows
  // fp16: only h already in fp16 with one split, which enters the mma exactly (a float32 h could overflow it).
  return p.b_dtype == DType::F16 && p.h_dtype == DType::F16 && p.h_splits == 1;
}

cudaError_t launch_lora_expand(const ExpandParams& p, int cc_major, bool prefer_simt, cudaStream_t stream) {
  if (p.max_rank == 0) return cudaSuccess;
  const bool mma = !prefer_simt && lora_expand_mma_supported(p, cc_major);
  const bool pdl = cc_major >= 9;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, mma, pdl, stream);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, mma, pdl, stream);
    default: return launch_b<float>(p, false, pdl, stream);
  }
}

}  // namespace lora_ops::cuda
