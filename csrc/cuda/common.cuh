// Device helpers shared by the CUDA kernels: element types, conversions, vector loads, and the tile walk
// over segments. Torch-free (docs/design.md §4).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "../common/dispatch.h"
#include "../common/params.h"
#include "kernels.h"

namespace lora_ops::cuda {

constexpr unsigned kAll = 0xffffffffu;  // every lane of a warp (the *_sync intrinsics' mask)

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

// A thread's 16-byte pieces of a ROWS x COLS tile of T staged by THREADS threads: piece j is row row(j) = r0() + j *
// kRowStep, columns [c(), c() + kElems); rows past the tile (where kRowStep does not divide ROWS) have no piece.
// Staging a tile through its pieces, with the rows' addresses worked out once per tile, costs a few instructions a
// piece; stage_tile and store_tile (grouped_gemm.cuh) work out each piece's row, column and bounds per call (~70
// instructions a piece, most of an issue-bound kernel's work: csrc/cuda/NOTES.md, grouped_gemm, session 19).
template <class T, int ROWS, int COLS, int THREADS>
struct Pieces {
  static constexpr int kElems = 16 / sizeof(T), kChunks = COLS / kElems, kRowStep = THREADS / kChunks;
  static constexpr int kCount = (ROWS + kRowStep - 1) / kRowStep;
  static constexpr bool kExact = ROWS % kRowStep == 0;  // every thread has kCount pieces
  static_assert(COLS % kElems == 0 && THREADS % kChunks == 0, "pieces tile the tile's columns");
  static __device__ __forceinline__ int r0() { return threadIdx.x / kChunks; }
  static __device__ __forceinline__ int c() { return threadIdx.x % kChunks * kElems; }
  static __device__ __forceinline__ int row(int j) { return r0() + j * kRowStep; }
  static __device__ __forceinline__ bool in_tile(int j) { return kExact || row(j) < ROWS; }
};

// The range [begin, end) of `total` items that member `rank` of `parts` takes.
__host__ __device__ __forceinline__ void split_range(int64_t total, int64_t parts, int64_t rank, int64_t* begin,
                                                     int64_t* end) {
  const int64_t per = (total + parts - 1) / parts;
  *begin = std::min<int64_t>(total, rank * per);
  *end = std::min<int64_t>(total, *begin + per);
}

// The pointer and the byte strides allow `bytes`-byte vector accesses.
inline bool aligned(const void* ptr, std::initializer_list<int64_t> byte_strides, int64_t bytes = 16) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes) return false;
  for (int64_t s : byte_strides) {
    if (s % bytes) return false;
  }
  return true;
}

// The expand kernels' column blocks: blocks of block_cols columns over all slices in order, none across a slice
// end. How many there are (host) ...
inline int64_t slice_column_blocks(const ExpandParams& p, int64_t block_cols) {
  int64_t blocks = 0;
  for (int64_t s = 0; s < p.num_slices; ++s) {
    blocks += (p.slice_offsets[s + 1] - p.slice_offsets[s] + block_cols - 1) / block_cols;
  }
  return blocks;
}

// ... and block `block`'s slice and first column (device); false past the last block.
__device__ __forceinline__ bool find_slice_block(const ExpandParams& p, int64_t block_cols, int64_t block,
                                                 int64_t* slice, int64_t* first_col) {
  for (int64_t s = 0; s < p.num_slices; ++s) {
    const int64_t blocks = (p.slice_offsets[s + 1] - p.slice_offsets[s] + block_cols - 1) / block_cols;
    if (block < blocks) {
      *slice = s;
      *first_col = p.slice_offsets[s] + block * block_cols;
      return true;
    }
    block -= blocks;
  }
  return false;
}

// kCols consecutive y elements of one row; one vector access when kVec (aligned, checked on the host).
template <class TY, int kCols, bool kVec>
struct YCols {
  TY v[kCols];
  static constexpr int kBytes = sizeof(TY) * kCols;
  using Vec = std::conditional_t<kBytes == 4, unsigned, std::conditional_t<kBytes == 8, uint2, uint4>>;
  static_assert(sizeof(Vec) == kBytes);
  __device__ __forceinline__ void load(const TY* src, int cols) {
    if (kVec && cols == kCols) {
      *reinterpret_cast<Vec*>(v) = *reinterpret_cast<const Vec*>(src);
    } else {
      for (int c = 0; c < cols; ++c) v[c] = src[c];
    }
  }
  __device__ __forceinline__ void store(TY* dst, int cols) const {
    if (kVec && cols == kCols) {
      *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(v);
    } else {
      for (int c = 0; c < cols; ++c) dst[c] = v[c];
    }
  }
};

inline Vec16Access vec16_access(const SgmvParams& p) {
  const int64_t es = dtype_size(p.x_dtype);
  return {aligned(p.x, {p.x_row_stride * es}), aligned(p.lora_a, {p.a_stride0 * es, p.a_stride1 * es}),
          aligned(p.lora_b, {p.b_stride0 * es, p.b_stride1 * es}),
          aligned(p.y, {p.y_row_stride * dtype_size(p.y_dtype)})};
}

// Lets `kernel` take more than 48 KB of shared memory: raised once per (device, kernel) to the device's opt-in
// maximum less the kernel's static shared memory, not on every launch. The 48 KB default counts static and
// dynamic memory together, so a launch with less dynamic memory may still need it: only an empty request skips.
inline cudaError_t allow_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
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

struct Sum {
  template <class V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct Max {
  template <class V> __device__ __forceinline__ V operator()(V a, V b) const { return a > b ? a : b; }
};

// Inclusive scan (prefix sum by default) of v over `width` consecutive lanes (a power of two <= 32; all lanes
// take part).
template <class V, class Combine = Sum>
__device__ __forceinline__ V warp_inclusive_scan(V v, int width = 32, Combine combine = {}) {
  const int lane = threadIdx.x & (width - 1);
  for (int d = 1; d < width; d <<= 1) {
    const V u = __shfl_up_sync(0xffffffffu, v, d, width);
    if (lane >= d) v = combine(v, u);
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

// Up to `tile_rows` consecutive positions [begin, end) of one segment, the segment's slot, and the slot's size
// (rank, n_l, ...) when the lookup was given per-slot sizes.
struct TileRef {
  int64_t slot, begin, end, size;
};

// Tiles of `tile_rows` positions in the walk below, at most: min(P, ceil(P / tile_rows) + G), since a segment adds
// at most one partial tile (the grids of the tile kernels are sized by it).
__host__ __device__ inline int64_t max_segment_tiles(const Segments& seg, int64_t tile_rows) {
  return std::min<int64_t>(seg.positions, (seg.positions + tile_rows - 1) / tile_rows + seg.num_segments);
}

// Tile number `tile` of the walk over all segments in order, `tile_rows` positions each. Warp-wide: all 32
// lanes call it with the same arguments; false when there are fewer tiles.
// Segment g covers positions [m_g, m_{g+1}) with m_i = max_{j <= i} clamp(seg_indptr[j], 0, P): segments never
// overlap whatever the metadata, so the tile count is at most min(P, ceil(P / tile_rows) + G), the grid bound.
// A segment whose slot is outside [0, num_slots) has no tiles. The rank is not consulted (the caller leaves a
// rank-0 tile), which keeps the walk one dependent load deep: 32 segments per step, two loads per lane.
__device__ inline bool warp_find_tile(const Segments& seg, int64_t num_slots, int64_t tile_rows, int64_t tile,
                                      TileRef* out) {
  const int lane = threadIdx.x & 31;
  int64_t tiles_before = 0, m_carry = clamped_indptr(seg, 0);
  for (int64_t base = 0; base < seg.num_segments; base += 32) {
    const int64_t g = base + lane;
    const bool in = g < seg.num_segments;
    const int64_t slot = in ? seg.slot[g] : -1;
    const int64_t bound = in ? clamped_indptr(seg, g + 1) : int64_t{0};
    const int64_t m_end = Max{}(m_carry, warp_inclusive_scan(bound, 32, Max{}));
    int64_t m_begin = __shfl_up_sync(kAll, m_end, 1);
    if (lane == 0) m_begin = m_carry;
    const int64_t n = (in && slot >= 0 && slot < num_slots) ? (m_end - m_begin + tile_rows - 1) / tile_rows : 0;
    const int64_t incl = tiles_before + warp_inclusive_scan(n);
    const unsigned hit = __ballot_sync(kAll, n > 0 && tile >= incl - n && tile < incl);
    if (hit) {
      const int src = __ffs(hit) - 1;
      const int64_t first = __shfl_sync(kAll, incl - n, src);
      out->slot = __shfl_sync(kAll, slot, src);
      out->begin = __shfl_sync(kAll, m_begin, src) + (tile - first) * tile_rows;
      out->end = std::min(out->begin + tile_rows, (int64_t)__shfl_sync(kAll, m_end, src));
      return true;
    }
    tiles_before = __shfl_sync(kAll, incl, 31);
    m_carry = __shfl_sync(kAll, m_end, 31);
  }
  return false;
}

// Block-wide tile lookup: warp 0 walks (warp_find_tile); the tile with its slot's size (slot_size(sizes, slot,
// full)), and its rows in `rows` (shared memory; -1 past the tile's end or for a row outside [0, num_rows)), are
// visible to every thread on return: one round trip for the walk, one for the rows and the size together.
// All of a lane's row loads and the size are issued before the first store to `rows`: a store between them (the
// compiler cannot tell the two pointers apart) made each 32 rows, then the size, a round trip of their own (SASS of
// sgmv_mma, session 62: up to 4 trips at 64 rows and 6 at 128). The decode sgmv got 1-3% faster; the prefill
// kernels did not move (csrc/cuda/NOTES.md, session 62).
// False when there are fewer tiles. Every thread of the block must call it; callers that call it again
// __syncthreads() first (the readers of `rows` and of the previous result are done).
template <int kRows>
__device__ inline bool block_find_tile(const Segments& seg, int64_t num_slots, int64_t num_rows, int64_t tile,
                                       TileRef* out, int64_t* rows, const int32_t* sizes, int64_t full) {
  constexpr int kPerLane = (kRows + 31) / 32;
  __shared__ TileRef s_tile;
  __shared__ bool s_found;
  if (threadIdx.x < 32) {
    TileRef t{};
    const bool found = warp_find_tile(seg, num_slots, kRows, tile, &t);
    if (found && threadIdx.x == 0) t.size = slot_size(sizes, t.slot, full);
    int64_t row[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int r = (int)threadIdx.x + 32 * i;
      row[i] = found && r < kRows && t.begin + r < t.end ? segment_row(seg, t.begin + r, num_rows) : -1;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int r = (int)threadIdx.x + 32 * i;
      if (found && r < kRows) rows[r] = row[i];
    }
    if (threadIdx.x == 0) {
      s_found = found;
      s_tile = t;
    }
  }
  __syncthreads();
  *out = s_tile;
  return s_found;
}

// The current device's value of `query(device, &value)` (> 0), asked once per device (`known`: 64 slots, 0 where
// not asked yet) and kept lock-free: decode launches the expand hundreds of times a step, and a racing first call
// only stores the same value twice. A failed query keeps nothing, and is asked again next time.
template <class Query>
cudaError_t ask_once_per_device(std::atomic<int64_t>* known, Query&& query, int64_t* out) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  std::atomic<int64_t>& slot = known[device & 63];
  int64_t value = slot.load(std::memory_order_relaxed);
  if (value == 0) {
    if ((err = query(device, &value)) != cudaSuccess) return err;
    slot.store(value, std::memory_order_relaxed);
  }
  *out = value;
  return cudaSuccess;
}

// How many CTAs of kKernel (`threads` threads, no dynamic shared memory) the current device holds at once, over
// all its SMs, asked once per (kernel, device).
template <auto kKernel>
cudaError_t resident_ctas(int threads, int64_t* out) {
  static std::atomic<int64_t> per_device[64];
  return ask_once_per_device(per_device, [&](int device, int64_t* value) {
    int per_sm = 0, sms = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, 0);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    *value = std::max<int64_t>(1, (int64_t)per_sm * sms);
    return err;
  }, out);
}

// Programmatic dependent launch (sm_90+): a kernel launched with launch_pdl may start while the previous kernel
// in the stream still runs; it must call grid_dependency_wait() before reading anything that kernel writes.
// Both are no-ops on older GPUs and for kernels launched normally.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents_to_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches kernel<<<grid, threads, 0, stream>>>(args...), programmatically dependent on the previous kernel in
// the stream when `pdl` (sm_90+).
template <class... KArgs, class... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, int threads, bool pdl, cudaStream_t stream,
                       Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace lora_ops::cuda
