// The LoRA expand: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T for the rows of
// every segment (slot l, true rank r_l, coef_l = scale * lora_scales[l]). It serves the lora_expand op (h from
// the base GEMM with every slot's A folded in) and the second step of the decode sgmv (h = the shrink's
// float32 K-split partials, summed here in split order: deterministic).
//
// One CTA per (512 columns of one slice, tile of 4 positions of one segment); each of the 128 threads owns 4
// consecutive columns. At decode sizes the cost is the chain of dependent memory trips times the waves of CTAs,
// so the chain is kept short and the CTAs small: the tile walk (one trip), the rows with the rank (one trip),
// then B's first rank steps of 16 (up to kMaxStages) are copied with cp.async into the thread's own slots of
// shared memory. No registers are held by loads in flight: 80 registers, so 6 CTAs fit an SM instead of 4. All
// of that may overlap the producer of h and y (programmatic dependent launch, sm_90). After grid_dependency_wait,
// y is loaded and h, scaled, goes through shared memory in 128-rank chunks; each step multiplies the oldest
// staged B while the next is in flight, and y is written once. Grid: column blocks fastest, so a tile's blocks
// start together and tiles that do not exist (the bound counts every slot's segment) come last.
#include <algorithm>
#include <cstring>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 4;  // consecutive columns per thread
constexpr int kBlockCols = kThreads * kCols;
constexpr int kTileRows = 4;
constexpr int kStep = 16;  // rank columns of B per staged step
constexpr int kMaxStages = 2;
constexpr int kRankChunk = 128;

// One staged step of B for every thread of the CTA: 16-byte words, thread-minor (word w of thread t at
// w * kThreads + t), so a warp's copies and reads never share a bank.
template <class TB>
struct BStep {
  static constexpr int kRanksPerWord = 16 / sizeof(TB);
  static constexpr int kWordsPerCol = kStep / kRanksPerWord;
  static constexpr size_t kBytes = (size_t)kCols * kWordsPerCol * kThreads * 16;
};

// kCols consecutive y elements of one row; a vector access when kVec (aligned, checked on the host).
template <class TY, bool kVec>
struct YCols {
  static constexpr int kBytes = kCols * sizeof(TY);
  using Vec = std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 8, uint2, uint4>>;
  TY v[kCols];
  __device__ __forceinline__ void load(const TY* src, int cols) {
    if (kVec && cols == kCols) {
      const Vec raw = *reinterpret_cast<const Vec*>(src);
      memcpy(v, &raw, sizeof(raw));
    } else {
      for (int c = 0; c < cols; ++c) v[c] = src[c];
    }
  }
  __device__ __forceinline__ void store(TY* dst, int cols) const {
    if (kVec && cols == kCols) {
      Vec raw;
      memcpy(&raw, v, sizeof(raw));
      *reinterpret_cast<Vec*>(dst) = raw;
    } else {
      for (int c = 0; c < cols; ++c) dst[c] = v[c];
    }
  }
};

// kVec: B columns allow 16-byte copies and y rows kCols-element accesses (checked on the host).
template <class TB, class TH, class TY, bool kVec>
__global__ void __launch_bounds__(kThreads, 6) lora_expand_kernel(ExpandParams p, int64_t max_tiles, int stages) {
  using Step = BStep<TB>;
  constexpr int kPerWord = Step::kRanksPerWord;
  extern __shared__ uint4 b_s[];  // [stages][Step words][kThreads]
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
    const int64_t steps = (rank + kStep - 1) / kStep;

    // Copies rank step j of the thread's columns into stage j % stages, as one cp.async group (maybe empty).
    auto issue = [&](int64_t j) {
      if (j < steps) {
        uint4* stage = b_s + (j % stages) * (Step::kBytes / 16);
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int w = 0; w < Step::kWordsPerCol; ++w) {
            const int64_t r0 = j * kStep + w * Step::kRanksPerWord;
            const int64_t left = rank - r0;
            const int valid = c < cols && left > 0 ? (int)(left < kPerWord ? left : kPerWord) : 0;
            uint4* dst = stage + (c * Step::kWordsPerCol + w) * kThreads + tid;
            const TB* src = b_cols + c * p.b_stride1 + r0;
            if (kVec) {
              cp_async16(dst, src, valid * (int)sizeof(TB));
            } else {
              TB e[Step::kRanksPerWord];
#pragma unroll
              for (int i = 0; i < Step::kRanksPerWord; ++i) e[i] = i < valid ? src[i] : from_f32<TB>(0.f);
              memcpy(dst, e, 16);
            }
          }
        }
      }
      cp_async_commit();
    };
    // Weights are never written by the producer: their first steps are copied before the wait.
    for (int j = 0; j < stages; ++j) issue(j);
    grid_dependency_wait();

    YCols<TY, kVec> y_rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (s_rows[m] >= 0) y_rows[m].load(y + s_rows[m] * p.y_row_stride + n0, cols);
    }
    float acc[kTileRows][kCols] = {};
    const TH* h = static_cast<const TH*>(p.h) + slot * p.h_slot_stride + s * p.max_rank;
    for (int64_t j = 0; j < steps; ++j) {
      const int64_t r = j * kStep, chunk_r = r % kRankChunk;
      if (chunk_r == 0) {  // h for ranks [r, r + kRankChunk), scaled, zero past the rank
        if (r > 0) __syncthreads();  // the previous chunk's readers of h_s are done
        const int jn = (int)std::min<int64_t>(kRankChunk, rank - r), jpad = (jn + kStep - 1) / kStep * kStep;
        for (int i = tid; i < kTileRows * jpad; i += kThreads) {
          const int m = i / jpad, k = i % jpad;
          const int64_t row = s_rows[m];
          float v = 0.f;
          if (row >= 0 && k < jn) {
            const TH* src = h + row * p.h_row_stride + r + k;
            for (int64_t split = 0; split < p.h_splits; ++split) v += to_f32(src[split * p.h_split_stride]);
            v *= coef;
          }
          h_s[m][k] = v;
        }
        __syncthreads();
      }
      if (stages == 2) {
        cp_async_wait<1>();  // this thread's copies of step j have landed (step j + 1 may be in flight)
      } else {
        cp_async_wait<0>();
      }
      const uint4* stage = b_s + (j % stages) * (Step::kBytes / 16);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        TB b[kStep];
#pragma unroll
        for (int w = 0; w < Step::kWordsPerCol; ++w) {
          const uint4 word = stage[(c * Step::kWordsPerCol + w) * kThreads + tid];
          memcpy(&b[w * Step::kRanksPerWord], &word, 16);
        }
#pragma unroll
        for (int k = 0; k < kStep; ++k) {
          const float bv = to_f32(b[k]);
#pragma unroll
          for (int m = 0; m < kTileRows; ++m) acc[m][c] += h_s[m][chunk_r + k] * bv;
        }
      }
      issue(j + stages);  // into the stage this step just read
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

template <class TB, class TH, class TY>
cudaError_t launch_typed(const ExpandParams& p, dim3 grid, int64_t tiles, int stages, bool vec, bool pdl,
                         cudaStream_t stream) {
  const auto kernel = vec ? lora_expand_kernel<TB, TH, TY, true> : lora_expand_kernel<TB, TH, TY, false>;
  const size_t smem = stages * BStep<TB>::kBytes;
  if (const cudaError_t err = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem); err != cudaSuccess) {
    return err;
  }
  return launch_pdl(kernel, grid, kThreads, smem, pdl, stream, p, tiles, stages);
}

template <class TB>
cudaError_t launch_b(const ExpandParams& p, dim3 grid, int64_t tiles, int stages, bool vec, bool pdl,
                     cudaStream_t stream) {
  if (p.h_dtype == DType::F32) {
    return p.y_dtype == DType::F32 ? launch_typed<TB, float, float>(p, grid, tiles, stages, vec, pdl, stream)
                                   : launch_typed<TB, float, TB>(p, grid, tiles, stages, vec, pdl, stream);
  }
  return p.y_dtype == DType::F32 ? launch_typed<TB, TB, float>(p, grid, tiles, stages, vec, pdl, stream)
                                 : launch_typed<TB, TB, TB>(p, grid, tiles, stages, vec, pdl, stream);
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
  // Vector path: 16-byte copies of B, kCols-element loads and stores of y (every slice starts on one).
  const int64_t eb = dtype_size(p.b_dtype), y_vec = kCols * dtype_size(p.y_dtype);
  bool vec = aligned16(p.lora_b, {p.b_stride0 * eb, p.b_stride1 * eb}) &&
             reinterpret_cast<uintptr_t>(p.y) % y_vec == 0 && p.y_row_stride % kCols == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) vec = vec && p.slice_offsets[s] % kCols == 0;
  // One staged step is enough for rank <= 16: the smaller footprint lets more CTAs share an SM.
  const int stages = (int)std::min<int64_t>(kMaxStages, (p.max_rank + kStep - 1) / kStep);
  const dim3 grid((unsigned)col_blocks, (unsigned)std::min<int64_t>(tiles, 65535));
  const bool pdl = cc_major >= 9;
  switch (p.b_dtype) {
    case DType::F16: return launch_b<__half>(p, grid, tiles, stages, vec, pdl, stream);
    case DType::BF16: return launch_b<__nv_bfloat16>(p, grid, tiles, stages, vec, pdl, stream);
    default: return launch_b<float>(p, grid, tiles, stages, vec, pdl, stream);
  }
}

}  // namespace lora_ops::cuda
