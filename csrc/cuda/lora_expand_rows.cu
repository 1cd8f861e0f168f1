// lora_expand's rows form on tensor cores: y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] * B[l, slice s, :r_l]^T
// with each position's slot l given (no segments). One warp per position and 1-4 passes of 64 columns of one
// slice, one mma.sync m16n8k16 per 16 columns and 16 ranks: the 16 columns are the mma's M, the ranks its
// K, and h fills all 8 of its N (every column of the result is the row's), so a lane's C fragment holds two
// adjacent columns of y.
// No shared memory and no barrier: a warp's chain is its slot, then B, h and y at once, then the mma and the store.
// Serves fp16/bf16 B with h of B's dtype and aligned rows (rows_kernel_serves); anything else goes to the
// positions kernel. Why a new kernel: the positions kernel's per-CTA set-up and its FFMA stream (bf16 -> float
// conversion and a select per element) were ~1,000 instructions per warp on gate_up at T=32 (csrc/cuda/NOTES.md).
#include <algorithm>
#include <type_traits>

#include "kernels.h"
#include "mma.cuh"

namespace lora_ops::cuda {
namespace {

constexpr int kWarps = 4;                  // positions per CTA, one per warp
constexpr int kTiles = 4;                  // 16-column mma tiles per pass of a warp: 64 columns
constexpr int kPassCols = 16 * kTiles;
constexpr int kMaxPasses = 4;              // passes per CTA, chosen per call so that the grid is about one wave
constexpr int kMinCtas = 7;                // CTAs per SM: 70 registers, no spills

// 4 consecutive 16-bit elements, zero from element `valid` on (valid <= 0: none read).
__device__ __forceinline__ uint2 load4(const void* ptr, int valid) {
  if (valid <= 0) return make_uint2(0, 0);
  uint2 v = *static_cast<const uint2*>(ptr);
  if (valid < 4) {
    const uint64_t keep = (uint64_t{1} << (16 * valid)) - 1;
    const uint64_t bits = ((uint64_t)v.y << 32 | v.x) & keep;
    v = make_uint2((uint32_t)bits, (uint32_t)(bits >> 32));
  }
  return v;
}

// Block b of block_cols columns over all slices in order: the slice, its first column and end. False past them.
__device__ __forceinline__ bool find_block(const ExpandParams& p, int block_cols, int* slice, int* n0, int* n_end) {
  int block = blockIdx.x;
  for (int s = 0; s < p.num_slices; ++s) {
    const int lo = (int)p.slice_offsets[s], hi = (int)p.slice_offsets[s + 1];
    const int blocks = (hi - lo + block_cols - 1) / block_cols;
    if (block < blocks) {
      *slice = s;
      *n0 = lo + block * block_cols;
      *n_end = hi;
      return true;
    }
    block -= blocks;
  }
  return false;
}

// Two adjacent elements of y, one access each way (col even, rows aligned: checked on the host).
template <class TY>
struct alignas(2 * sizeof(TY)) YPair {
  TY v[2];
};

// Position pos over the columns [n0, n1) of slice `slice`, by one warp.
template <class TB, class TY>
__device__ __forceinline__ void expand_position(const ExpandParams& p, int64_t pos, int slice, int n0, int n1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t row = segment_row(p.seg, pos, p.rows), slot = segment_slot(p.seg, pos, p.num_slots);
  if (row < 0 || slot < 0) return;
  const int rank = (int)slot_size(p.lora_ranks, slot, p.max_rank);
  if (rank == 0) return;
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[slot] : 1.f);
  // Lane (g, t) reads ranks j + 4t .. j + 4t + 3 of h and of B's columns 2g and 2g + 1 of every tile: the mma's
  // k pairs (2t, 2t+1) and (2t+8, 2t+9) are those ranks, and its rows g and g + 8 those columns.
  const TB* h = static_cast<const TB*>(p.h) + row * p.h_row_stride + slot * p.h_slot_stride + slice * p.max_rank;
  const TB* b = static_cast<const TB*>(p.lora_b) + slot * p.b_stride0;
  TY* y = static_cast<TY*>(p.y) + row * p.y_row_stride;
  // The later passes' B to L2 now (a 128-byte line per lane per step), so that they cost an L2 trip, not DRAM.
  for (int64_t off = (int64_t)(n0 + kPassCols) * p.b_stride1 + 64 * lane; off < (int64_t)n1 * p.b_stride1;
       off += 32 * 64) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(b + off));
  }
  const int n_end = n1;
  for (int pass = n0; pass < n1; pass += kPassCols) {
    const TB* b_lane = b + (int64_t)(pass + 2 * g) * p.b_stride1 + 4 * t;
    const int64_t tile_stride = 16 * p.b_stride1;
    const bool full_pass = pass + kPassCols <= n_end;
    // The y pairs this lane adds to (tile t, + 4k), loaded first: they do not wait for B.
    YPair<TY> y_pairs[kTiles / 4];
#pragma unroll
    for (int quad = 0; quad < kTiles / 4; ++quad) {
      const int col = pass + 16 * (4 * quad + t) + 2 * g;
      if (col < n_end) y_pairs[quad] = *reinterpret_cast<const YPair<TY>*>(y + col);
    }
    float acc[kTiles][4] = {};
    // Rank columns [j, j + 16): unchecked loads where the whole step lies inside the rank and the slice (uniform
    // over the warp; every step of a rank-16k adapter over whole 128-column passes), masked ones elsewhere.
    auto step = [&](int j, auto checked) {
      const int valid = checked ? rank - j - 4 * t : 4;
      const uint2 hv = load4(h + j + 4 * t, valid);
      const uint32_t hb[2] = {hv.x, hv.y};
      uint2 bv[kTiles][2];
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int v = !checked || pass + 16 * i + 2 * g < n_end ? valid : 0;  // even slice widths: both columns
        bv[i][0] = load4(b_lane + i * tile_stride + j, v);
        bv[i][1] = load4(b_lane + i * tile_stride + p.b_stride1 + j, v);
      }
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const uint32_t a[4] = {bv[i][0].x, bv[i][1].x, bv[i][0].y, bv[i][1].y};
        mma16816<TB>(acc[i], a, hb);
      }
    };
    for (int j = 0; j < rank; j += 16) {
      if (full_pass && j + 16 <= rank) {
        step(j, std::false_type{});
      } else {
        step(j, std::true_type{});
      }
    }
    // Every lane holds columns 2g, 2g + 1 of every tile (the N copies are equal); lane t stores tile t (+ 4k).
#pragma unroll
    for (int quad = 0; quad < kTiles / 4; ++quad) {
      float lo = acc[4 * quad][0], hi = acc[4 * quad][2];
#pragma unroll
      for (int k = 1; k < 4; ++k) {
        lo = t == k ? acc[4 * quad + k][0] : lo;
        hi = t == k ? acc[4 * quad + k][2] : hi;
      }
      const int col = pass + 16 * (4 * quad + t) + 2 * g;
      if (col < n_end) {
        YPair<TY> out;
        out.v[0] = from_f32<TY>(to_f32(y_pairs[quad].v[0]) + coef * lo);
        out.v[1] = from_f32<TY>(to_f32(y_pairs[quad].v[1]) + coef * hi);
        *reinterpret_cast<YPair<TY>*>(y + col) = out;
      }
    }
  }
}

// Grid: (column blocks of `passes` passes, position groups of kWarps); CTAs loop over position groups past the
// grid's limit.
template <class TB, class TY>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas) expand_rows_kernel(ExpandParams p, int passes) {
  int slice, n0, n_end;
  if (!find_block(p, passes * kPassCols, &slice, &n0, &n_end)) return;
  grid_dependency_wait();  // the op cannot know what wrote its inputs
  const int n1 = min(n0 + passes * kPassCols, n_end);
  for (int64_t pos = (int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5); pos < p.seg.positions;
       pos += (int64_t)gridDim.y * kWarps) {
    expand_position<TB, TY>(p, pos, slice, n0, n1);
  }
}

// Column blocks of block_cols columns over all slices.
int64_t column_blocks(const ExpandParams& p, int64_t block_cols) {
  int64_t blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + block_cols - 1) / block_cols;
  }
  return blocks;
}

bool aligned8(const void* ptr, std::initializer_list<int64_t> byte_strides) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % 8 == 0;
  for (int64_t s : byte_strides) ok = ok && s % 8 == 0;
  return ok;
}

// Passes per CTA: one where the grid of one-pass CTAs fits the device at once (each warp then makes one trip for
// its B), up to kMaxPasses (later passes' B prefetched to L2) where it would run several waves.
template <auto kKernel>
cudaError_t launch_kernel(const ExpandParams& p, int64_t groups, bool pdl, cudaStream_t stream) {
  int64_t resident = 0;
  const cudaError_t err = resident_ctas<kKernel>(32 * kWarps, &resident);
  if (err != cudaSuccess) return err;
  const int64_t one_pass = column_blocks(p, kPassCols) * groups;
  const int passes = (int)std::clamp<int64_t>((one_pass + resident - 1) / resident, 1, kMaxPasses);
  const int64_t blocks = column_blocks(p, passes * kPassCols);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)blocks, (unsigned)std::min<int64_t>(groups, 65535));
  return launch_pdl(kKernel, grid, 32 * kWarps, pdl, stream, p, passes);
}

template <class TB>
cudaError_t launch_typed(const ExpandParams& p, int64_t groups, bool pdl, cudaStream_t stream) {
  return p.y_dtype == DType::F32 ? launch_kernel<expand_rows_kernel<TB, float>>(p, groups, pdl, stream)
                                 : launch_kernel<expand_rows_kernel<TB, TB>>(p, groups, pdl, stream);
}

}  // namespace

bool rows_kernel_serves(const ExpandParams& p) {
  if (p.seg.indptr != nullptr || p.h_splits != 1 || p.b_dtype == DType::F32 || p.h_dtype != p.b_dtype) return false;
  if (p.max_rank % 4 != 0 || p.n > INT32_MAX / 2) return false;
  bool ok = aligned8(p.lora_b, {p.b_stride0 * 2, p.b_stride1 * 2}) &&
            aligned8(p.h, {p.h_row_stride * 2, p.h_slot_stride * 2});
  const int64_t ey = dtype_size(p.y_dtype);
  ok = ok && reinterpret_cast<uintptr_t>(p.y) % (2 * ey) == 0 && p.y_row_stride % 2 == 0;
  for (int64_t s = 0; s <= p.num_slices; ++s) ok = ok && p.slice_offsets[s] % 2 == 0;
  return ok;
}

cudaError_t launch_lora_expand_rows(const ExpandParams& p, int cc_major, cudaStream_t stream) {
  const int64_t groups = (p.seg.positions + kWarps - 1) / kWarps;
  if (groups == 0 || column_blocks(p, kPassCols) == 0) return cudaSuccess;
  return p.b_dtype == DType::F16 ? launch_typed<__half>(p, groups, cc_major >= 9, stream)
                                 : launch_typed<__nv_bfloat16>(p, groups, cc_major >= 9, stream);
}

}  // namespace lora_ops::cuda
