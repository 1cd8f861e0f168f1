// Device code shared by the two grouped_gemm kernels (grouped_gemm_tile.cu, grouped_gemm_expand.cu): the warp
// product of one 16-wide K step, staging of tiles into shared memory, and the epilogue through shared memory.
// Torch-free (docs/design.md §4).
//
// Warp tiles use the mma.sync m16n8k16 fragment layout for every dtype: lane (g = lane / 4, t = lane % 4) holds
// acc[mi][ni][e] = C[mi*16 + g + (e/2)*8][ni*8 + 2t + e%2]. fp16/bf16 w runs on tensor cores; an fp32 x with a
// half w is split into hi + lo halves (two mma, ~16 mantissa bits of x kept); fp32 w runs on FMA (exact fp32,
// no tf32), in the same layout, so staging and epilogue are one piece of code for all of them.
#pragma once
#include <type_traits>

#include "mma.cuh"

namespace lora_ops::cuda::gg {

constexpr int kPad = 8;                        // elements of padding per shared row: conflict-free fragment loads
constexpr size_t kSmemBudget = 160 * 1024;     // dynamic shared memory per CTA: fits sm_80's 163 KB opt-in

// Which tensors allow 16-byte accesses (aligned base, 16-byte multiple strides); the others are read and
// written element by element.
struct Access {
  bool x, w, y;
};

inline Access access_of(const GroupedGemmParams& p) {
  const int64_t ex = dtype_size(p.x_dtype), ew = dtype_size(p.w_dtype), ey = dtype_size(p.y_dtype);
  return {aligned(p.x, {p.x_row_stride * ex}), aligned(p.w, {p.w_stride0 * ew, p.w_stride1 * ew}),
          aligned(p.y, {p.y_row_stride * ey})};
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<TX>, TypeTag<TW>, TypeTag<TY>) for the call's dtypes (x and y: w's dtype or fp32).
template <class F>
decltype(auto) dispatch_types(const GroupedGemmParams& p, F&& f) {
  return dispatch_dtype(p.w_dtype, [&](auto wt) {
    using TW = typename ElemOf<decltype(wt)::value>::type;
    if constexpr (std::is_same_v<TW, float>) {
      return f(TypeTag<float>{}, TypeTag<float>{}, TypeTag<float>{});
    } else {
      const bool x32 = p.x_dtype == DType::F32, y32 = p.y_dtype == DType::F32;
      if (x32 && y32) return f(TypeTag<float>{}, TypeTag<TW>{}, TypeTag<float>{});
      if (x32) return f(TypeTag<float>{}, TypeTag<TW>{}, TypeTag<TW>{});
      if (y32) return f(TypeTag<TW>{}, TypeTag<TW>{}, TypeTag<float>{});
      return f(TypeTag<TW>{}, TypeTag<TW>{}, TypeTag<TW>{});
    }
  });
}

// Launches `blocks` CTAs (capped at the grid limit: the kernels loop over their units).
template <class Kernel, class Plan>
cudaError_t launch(Kernel kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream,
                   const GroupedGemmParams& p, const Plan& plan) {
  if (blocks == 0) return cudaSuccess;
  if (const cudaError_t err = allow_dynamic_smem((const void*)kernel, smem); err != cudaSuccess) return err;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_launch_config(std::min<int64_t>(blocks, 0x7fffffff), threads, 1, smem, stream, &attr);
  return cudaLaunchKernelEx(&cfg, kernel, p, plan);
}

// ---------------------------------------------------------------------------------------------------------------
// Warp products

// The A fragments of a 16-wide K step of a warp tile of MI*16 rows of x (half w only): x points at the warp's first
// row and the step's first column in shared memory (row stride xs elements); an fp32 x is split into hi and lo.
template <class TX>
constexpr int kAParts = std::is_same_v<TX, float> ? 2 : 1;

template <class TX, class TW, int MI>
__device__ __forceinline__ void load_a(uint32_t (&a)[MI][kAParts<TX>][4], const TX* x, int xs) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    if constexpr (std::is_same_v<TX, float>) {
      const float* r0 = x + (mi * 16 + g) * xs + 2 * t;
      const float* r1 = r0 + 8 * xs;
      split_pack<TW>(*reinterpret_cast<const float2*>(r0), &a[mi][0][0], &a[mi][1][0]);
      split_pack<TW>(*reinterpret_cast<const float2*>(r1), &a[mi][0][1], &a[mi][1][1]);
      split_pack<TW>(*reinterpret_cast<const float2*>(r0 + 8), &a[mi][0][2], &a[mi][1][2]);
      split_pack<TW>(*reinterpret_cast<const float2*>(r1 + 8), &a[mi][0][3], &a[mi][1][3]);
    } else {
      ldmatrix_x4(a[mi][0], x + (mi * 16 + (lane & 15)) * xs + (lane >> 4) * 8);
    }
  }
}

// acc += A . W[NI*8 rows][16]^T on tensor cores, A from load_a, w at the step's first column of the warp's first
// row of w in shared memory (row stride ws elements); K runs along rows of w.
template <class TX, class TW, int MI, int NI>
__device__ __forceinline__ void warp_k16_a(float (&acc)[MI][NI][4], const uint32_t (&a)[MI][kAParts<TX>][4],
                                           const TW* w, int ws) {
  static_assert(NI % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int np = 0; np < NI / 2; ++np) {
    uint32_t r[4];
    ldmatrix_x4(r, w + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ws + ((lane >> 3) & 1) * 8);
    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int part = 0; part < kAParts<TX>; ++part) {
        mma16816<TW>(acc[mi][2 * np], a[mi][part], b0);
        mma16816<TW>(acc[mi][2 * np + 1], a[mi][part], b1);
      }
    }
  }
}

// acc += X[MI*16 rows][16] . W[NI*8 rows][16]^T, one K step of a warp tile. x and w point at the warp's first
// row and the step's first column in shared memory (row strides xs, ws elements); K runs along rows of both.
template <class TX, class TW, int MI, int NI>
__device__ __forceinline__ void warp_k16(float (&acc)[MI][NI][4], const TX* x, int xs, const TW* w, int ws) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (std::is_same_v<TW, float>) {
    static_assert(std::is_same_v<TX, float>, "fp32 w takes fp32 x");
#pragma unroll
    for (int k2 = 0; k2 < 16; k2 += 2) {  // pairs of k: float2 loads keep the x values of all rows in registers
      float2 xv[MI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) xv[mi][h] = *reinterpret_cast<const float2*>(x + (mi * 16 + g + h * 8) * xs + k2);
      }
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float2 wv = *reinterpret_cast<const float2*>(w + (ni * 8 + 2 * t + e) * ws + k2);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float& c = acc[mi][ni][h * 2 + e];
              c = fmaf(xv[mi][h].x, wv.x, c);
              c = fmaf(xv[mi][h].y, wv.y, c);
            }
          }
        }
      }
    }
  } else {
    uint32_t a[MI][kAParts<TX>][4];
    load_a<TX, TW, MI>(a, x, xs);
    warp_k16_a<TX, TW, MI, NI>(acc, a, w, ws);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Staging (global -> shared) and storing (shared -> global)

// One 16-byte shared chunk <- `valid` elements at src, zeros after. vec: src is 16-byte aligned, so one cp.async
// (zero-filling; with valid = 0 it reads nothing); else element loads.
template <class T>
__device__ __forceinline__ void stage_chunk(T* dst, const T* src, int valid, bool vec) {
  if (vec) {
    cp_async16(dst, src, valid * (int)sizeof(T));
    return;
  }
  constexpr int kElems = 16 / sizeof(T);
#pragma unroll
  for (int e = 0; e < kElems; ++e) dst[e] = e < valid ? src[e] : from_f32<T>(0.f);
}

// Shared rows [0, ROWS) x columns [0, COLS) (row stride STRIDE) <- the first `valid_cols` elements of row_ptr(r),
// zeros elsewhere; row_ptr(r) == nullptr: a row of zeros. `safe` is any readable address of the tensor (a
// zero-byte cp.async still names one).
template <class T, int ROWS, int COLS, int STRIDE, int THREADS, class RowPtr>
__device__ __forceinline__ void stage_tile(T* dst, RowPtr row_ptr, int64_t valid_cols, bool vec, const T* safe) {
  constexpr int kElems = 16 / sizeof(T), kChunks = COLS / kElems, kTotal = ROWS * kChunks;
  static_assert(COLS % kElems == 0, "tile rows are whole 16-byte chunks");
#pragma unroll 1  // a rolled loop: unrolled, its per-chunk addresses stay live across the K loop and spill
  for (int i = threadIdx.x; i < kTotal; i += THREADS) {
    const int r = i / kChunks, c = (i % kChunks) * kElems;
    const T* row = row_ptr(r);
    const int valid = row ? (int)clamp_index(valid_cols - c, 0, kElems) : 0;
    stage_chunk(dst + r * STRIDE + c, valid > 0 ? row + c : safe, valid, vec);
  }
}

// row_ptr(r) (nullptr: skip the row) <- shared row r, its first `valid_cols` columns only.
template <class T, int ROWS, int COLS, int STRIDE, int THREADS, class RowPtr>
__device__ __forceinline__ void store_tile(const T* src, RowPtr row_ptr, int64_t valid_cols, bool vec) {
  constexpr int kElems = 16 / sizeof(T), kChunks = COLS / kElems, kTotal = ROWS * kChunks;
#pragma unroll 1
  for (int i = threadIdx.x; i < kTotal; i += THREADS) {
    const int r = i / kChunks, c = (i % kChunks) * kElems;
    T* row = row_ptr(r);
    const int valid = row ? (int)clamp_index(valid_cols - c, 0, kElems) : 0;
    const T* s = src + r * STRIDE + c;
    if (vec && valid == kElems) {
      *reinterpret_cast<uint4*>(row + c) = *reinterpret_cast<const uint4*>(s);
    } else {
      for (int e = 0; e < valid; ++e) row[c + e] = s[e];
    }
  }
}

// An operand tile streamed along K (the x and w tiles of a K loop) through the thread's pieces: the rows' first
// elements are found once per tile (init), each stage adds its K offset. For 16-byte aligned rows only.
template <class T, int ROWS, int COLS, int STRIDE, int THREADS>
struct PieceRows {
  using P = Pieces<T, ROWS, COLS, THREADS>;
  const T* rows[P::kCount];  // nullptr: no row (zeros)

  // row_ptr(r): the first element of tile row r (nullptr: a row of zeros).
  template <class RowPtr>
  __device__ __forceinline__ void init(RowPtr row_ptr) {
#pragma unroll
    for (int j = 0; j < P::kCount; ++j) rows[j] = P::in_tile(j) ? row_ptr(P::row(j)) : nullptr;
  }

  // dst (the stage's tile, row stride STRIDE) <- columns [k0, k0 + COLS) of every row, zeros from column k0 +
  // valid_cols on and in rows without one. `safe`: any readable address (a zero-byte cp.async still names one).
  __device__ __forceinline__ void stage(T* dst, int64_t k0, int64_t valid_cols, const T* safe) const {
    const int bytes = (int)clamp_index(valid_cols - P::c(), 0, P::kElems) * (int)sizeof(T);
#pragma unroll
    for (int j = 0; j < P::kCount; ++j) {
      if (!P::in_tile(j)) continue;
      const bool any = rows[j] != nullptr && bytes > 0;
      cp_async16(dst + P::row(j) * STRIDE + P::c(), any ? rows[j] + k0 + P::c() : safe, any ? bytes : 0);
    }
  }
};

// Pairs of adjacent y elements in shared memory as float2: one 4-byte (8 for float) load or store each.
template <class TY>
using YPair = std::conditional_t<std::is_same_v<TY, float>, float2,
                                 std::conditional_t<std::is_same_v<TY, __half>, __half2, __nv_bfloat162>>;

template <class TY>
__device__ __forceinline__ float2 load_pair(const YPair<TY>* src) {
  if constexpr (std::is_same_v<TY, float>) {
    return *src;
  } else if constexpr (std::is_same_v<TY, __half>) {
    return __half22float2(*src);
  } else {  // bf16 -> float is exact: its bits are the float's upper half
    const uint32_t u = *reinterpret_cast<const uint32_t*>(src);
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
}

template <class TY>
__device__ __forceinline__ void store_pair(YPair<TY>* dst, float2 v) {
  if constexpr (std::is_same_v<TY, float>) {
    *dst = v;
  } else if constexpr (std::is_same_v<TY, __half>) {
    *dst = __float22half2_rn(v);
  } else {
    *dst = __float22bfloat162_rn(v);
  }
}

template <class TY, int MI, int NI, bool kAccumulate>
__device__ __forceinline__ void combine_pairs(TY* ys, int stride, const float (&acc)[MI][NI][4], float a) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        auto* dst = reinterpret_cast<YPair<TY>*>(ys + (mi * 16 + g + h * 8) * stride + ni * 8 + 2 * t);
        const float* c = &acc[mi][ni][2 * h];
        if constexpr (kAccumulate) {
          const float2 old = load_pair<TY>(dst);
          store_pair<TY>(dst, make_float2(fmaf(a, c[0], old.x), fmaf(a, c[1], old.y)));
        } else {
          store_pair<TY>(dst, make_float2(a * c[0], a * c[1]));
        }
      }
    }
  }
}

// The epilogue of a warp tile, in the shared y tile (ys: the warp's first element, row stride `stride`):
// y = (has_k ? alpha * acc : 0) + (accumulate ? y : 0), with one rounding (an fma) before the store's. An empty
// reduction contributes exactly zero, whatever alpha is (its acc is zero: it is multiplied by 1); with accumulate
// the y tile must hold y. Each fragment's two adjacent columns go as one pair.
template <class TY, int MI, int NI>
__device__ __forceinline__ void combine(TY* ys, int stride, const float (&acc)[MI][NI][4], float alpha, bool has_k,
                                        bool accumulate) {
  const float a = has_k ? alpha : 1.f;
  if (accumulate) {
    combine_pairs<TY, MI, NI, true>(ys, stride, acc, a);
  } else {
    combine_pairs<TY, MI, NI, false>(ys, stride, acc, a);
  }
}

}  // namespace lora_ops::cuda::gg
