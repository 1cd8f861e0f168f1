// Device helpers shared by the CUDA kernels: element types, conversions, vector loads, and the tile walk
// over segments. Torch-free (docs/design.md §4).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "../common/dispatch.h"
#include "../common/params.h"
#include "kernels.h"

namespace lora_ops::cuda {

template <DType D> struct ElemOf;
template <> struct ElemOf<DType::F16> { using type = __half; };
template <> struct ElemOf<DType::BF16> { using type = __nv_bfloat16; };
template <> struct ElemOf<DType::F32> { using type = float; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Eight consecutive elements as floats. `vec`: the address is 16-byte aligned and all 8 are in bounds, so
// one (half types) or two (float) 16-byte loads; otherwise element loads up to `valid`, zeros after.
template <class T>
__device__ __forceinline__ void load8(const T* ptr, bool vec, int64_t valid, float out[8]) {
  if (vec && valid >= 8) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = to_f32(e[i]);
    } else {
      const float4 lo = *reinterpret_cast<const float4*>(ptr);
      const float4 hi = *reinterpret_cast<const float4*>(ptr + 4);
      out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
      out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = i < valid ? to_f32(ptr[i]) : 0.f;
}

// Eight consecutive elements kept in their storage type, so that a loop can issue all its loads before it
// converts and uses any (the loads then overlap instead of each waiting for the previous one's use).
template <class T>
struct alignas(16) Raw8 {
  T v[8];
};

// Loads `valid` (<= 8) elements, zero after; one or two 16-byte loads when `vec` and all 8 are valid.
template <class T>
__device__ __forceinline__ void load_raw8(const T* ptr, bool vec, int64_t valid, Raw8<T>& out) {
  if (vec && valid >= 8) {
    const uint4* src = reinterpret_cast<const uint4*>(ptr);
    uint4* dst = reinterpret_cast<uint4*>(out.v);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(Raw8<T>) / 16); ++i) dst[i] = src[i];
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) out.v[i] = i < valid ? ptr[i] : from_f32<T>(0.f);
}

// Asynchronous 16-byte global -> shared copy; `bytes` < 16 zero-fills the rest (0: nothing is read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The range [begin, end) of `total` items that member `rank` of `parts` takes.
__host__ __device__ __forceinline__ void split_range(int64_t total, int64_t parts, int64_t rank, int64_t* begin,
                                                     int64_t* end) {
  const int64_t per = (total + parts - 1) / parts;
  *begin = std::min<int64_t>(total, rank * per);
  *end = std::min<int64_t>(total, *begin + per);
}

// The pointer and the byte strides allow 16-byte vector accesses.
inline bool aligned16(const void* ptr, std::initializer_list<int64_t> byte_strides) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16) return false;
  for (int64_t s : byte_strides) {
    if (s % 16) return false;
  }
  return true;
}

inline Vec16Access vec16_access(const SgmvParams& p) {
  const int64_t es = dtype_size(p.x_dtype);
  return {aligned16(p.x, {p.x_row_stride * es}), aligned16(p.lora_a, {p.a_stride0 * es, p.a_stride1 * es}),
          aligned16(p.lora_b, {p.b_stride0 * es, p.b_stride1 * es}),
          aligned16(p.y, {p.y_row_stride * dtype_size(p.y_dtype)})};
}

// Lets `kernel` take more than 48 KB of dynamic shared memory: raised once per (device, kernel) to the
// device's opt-in maximum less the kernel's static shared memory, not on every launch.
inline cudaError_t allow_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  static std::mutex mutex;
  static std::set<std::pair<int, const void*>> raised;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  if (raised.count({device, kernel})) return cudaSuccess;
  int optin = 0;
  cudaFuncAttributes attrs;
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - (int)attrs.sharedSizeBytes);
  }
  if (err == cudaSuccess) raised.insert({device, kernel});
  return err;
}

// Inclusive prefix sum of v over `width` consecutive lanes (a power of two <= 32; all lanes take part).
template <class V>
__device__ __forceinline__ V warp_inclusive_scan(V v, int width = 32) {
  const int lane = threadIdx.x & (width - 1);
  for (int d = 1; d < width; d <<= 1) {
    const V u = __shfl_up_sync(0xffffffffu, v, d, width);
    if (lane >= d) v += u;
  }
  return v;
}

// Launch configuration of `blocks` CTAs of `threads` in clusters of `cluster` (no cluster attribute for 1).
inline cudaLaunchConfig_t cluster_launch_config(int64_t blocks, int threads, int64_t cluster, size_t smem,
                                                cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = (unsigned)cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cluster > 1 ? 1 : 0;
  return cfg;
}

// Whether clusters of `cluster` CTAs of `kernel` (`threads` each, `smem` dynamic shared memory) can be resident,
// raising the attributes that needs (large shared memory, clusters over 8). Cached per device and shape.
inline bool cluster_fits(const void* kernel, int threads, int64_t cluster, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int64_t, size_t>, bool> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const auto key = std::make_tuple(device, kernel, threads, cluster, smem);
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  bool fits = allow_dynamic_smem(kernel, smem) == cudaSuccess;
  if (fits && cluster > 8) {
    fits = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  }
  if (fits) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_launch_config(cluster, threads, cluster, smem, nullptr, &attr);
    int clusters = 0;
    fits = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
  }
  if (!fits) cudaGetLastError();  // a refused attribute or query is an answer here, not a sticky error
  known[key] = fits;
  return fits;
}

// One tile: up to `tile_rows` consecutive positions of one segment with a valid slot and nonzero rank.
struct Tile {
  int64_t segment, slot, rank, begin, end;  // positions [begin, end)
  float coef;                               // scale * lora_scales[slot]
};

// Number of tiles of segment g (0 when its slot is invalid, its rank is 0 or it is empty).
__device__ __forceinline__ int64_t segment_tiles(const Segments& seg, int64_t g, int64_t num_slots,
                                                 const int32_t* ranks, int64_t max_rank, int64_t tile_rows) {
  const int64_t slot = segment_slot(seg, g, num_slots);
  if (slot < 0 || slot_size(ranks, slot, max_rank) == 0) return 0;
  int64_t begin, end;
  segment_range(seg, g, &begin, &end);
  return (end - begin + tile_rows - 1) / tile_rows;
}

// Finds tile number `tile` of the walk over all segments in order (block-wide: every thread must call it
// with the same arguments). Returns false when there are fewer tiles. The walk scans segments blockDim.x at
// a time and stops at the chunk that holds the tile, so it costs O(G / blockDim) block scans.
__device__ inline bool locate_tile(const Segments& seg, int64_t num_slots, const int32_t* ranks,
                            const float* scales, float scale, int64_t max_rank, int64_t tile_rows,
                            int64_t tile, Tile* out) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t found_segment, found_first;
  __shared__ int64_t carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();  // a previous call's readers of found_* are done
  if (threadIdx.x == 0) {
    found_segment = -1;
    carry = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < seg.num_segments; base += blockDim.x) {
    const int64_t g = base + threadIdx.x;
    const int64_t n = g < seg.num_segments ? segment_tiles(seg, g, num_slots, ranks, max_rank, tile_rows) : 0;
    const int64_t incl = warp_inclusive_scan(n);  // across the block: warp shuffles, then warp totals
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int64_t before = carry;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    const int64_t first = before + incl - n;  // this segment's first tile number
    if (n > 0 && tile >= first && tile < first + n) {
      found_segment = g;
      found_first = first;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < warps; ++w) carry += warp_sums[w];
    }
    __syncthreads();
    if (found_segment >= 0 || carry > tile) break;
  }
  const int64_t g = found_segment;
  if (g < 0) return false;
  const int64_t slot = seg.slot[g];
  int64_t begin, end;
  segment_range(seg, g, &begin, &end);
  out->segment = g;
  out->slot = slot;
  out->rank = slot_size(ranks, slot, max_rank);
  out->begin = begin + (tile - found_first) * tile_rows;
  out->end = std::min<int64_t>(out->begin + tile_rows, end);
  out->coef = scale * (scales ? scales[slot] : 1.f);
  return true;
}

}  // namespace lora_ops::cuda
