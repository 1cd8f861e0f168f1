// lora_linear's shrink, the kext route's first launch (the GEMM after it: lora_linear_sm90.cu):
//   h[t, j*L*R + s*R + r] = round(scale[s] * x[t] . A[s][j*R + r]) for row t's slot s, zeros in every other slot's
//   window and in every window of a row without a slot (-1 or >= L). It lets its dependents launch at its start.
// Two kernels (KextShrink), each summing every h value in a fixed order (deterministic):
// - tiles: a cluster of C CTAs per (slice j, slot s, 16 rank rows). mma.sync m16n8k16 with the 16 rank rows of A as
//   its M and the rows of x whose slot is s (a ballot over token_slot) as its N, 32 rows per pass; K is split over
//   the cluster's warps (64 columns a unit, one trip of loads), their partials summed in shared memory, then over
//   the cluster's CTAs through distributed shared memory by its first CTA, which writes the window of h (the slot's
//   rows its values, every other row zeros). A is read once per 32 of a slot's rows and x once per slice and rank
//   block, where the warps kernel reads both once per (row, rank row): at T=128 and 32 adapters ~8x its bytes.
// - warps: a warp per rank row of a row of x over all of K, CTAs of 32 warps (NOTES.md sessions 29-32: CTAs of 4
//   warps, a warp per 4 rank rows sharing x's loads, and a warp per A row and 4 rows of its slot all lost to it).
// sm_90 only (clusters, griddepcontrol); the extension's other archs compile empty kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"
#include "mma.cuh"

namespace lora_ops::cuda {
namespace {

struct ShrinkArgs {
  const void* x;
  const void* lora_a;
  const int32_t* token_slot;
  const float* scales;
  void* h;
  int64_t x_stride, a_slot_stride, a_row_stride;
  int t, k, num_slices, rank, num_slots;
  uint32_t opaque_zero;  // always 0, passed from the host so that no compiler can fold it (the warps kernel)
};

// A 16-byte load through the non-coherent path that ptxas keeps in program order with the other ones (and with
// the mma.sync, also volatile asm: a batch's loads are all issued before its first mma).
__device__ __forceinline__ uint4 load_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <class T>
__device__ __forceinline__ float2 to_float2(uint32_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

// ---- tiles ----

constexpr int kTileWarps = 8;            // per CTA
constexpr int kPassRows = 32;            // a slot's rows per pass: the mma's N, 4 tiles of 8
constexpr int kPassTiles = kPassRows / 8;
constexpr int kUnitCols = 64;            // K columns of a warp's unit: two 32-column chunks
constexpr int kMaxCluster = 8;           // the portable cluster size
constexpr int kMaskWords = (kLoraLinearMaxTokens + 31) / 32;
static_assert(kMaskWords == 4, "the row mask is one word per lane's row of token_slot, 4 of them");

// The row of the n-th set bit of the batch's row mask (rows in ascending order), -1 past the last.
__device__ __forceinline__ int nth_row(const uint32_t (&mask)[kMaskWords], int n) {
#pragma unroll
  for (int i = 0; i < kMaskWords; ++i) {
    const int count = __popc(mask[i]);
    if (n < count) return 32 * i + (int)__fns(mask[i], 0, n + 1);
    n -= count;
  }
  return -1;
}

// Whether row t's bit is set (a select, not an index: the mask stays in registers).
__device__ __forceinline__ bool row_has_slot(const uint32_t (&mask)[kMaskWords], int t) {
  const uint32_t word = t < 32 ? mask[0] : t < 64 ? mask[1] : t < 96 ? mask[2] : mask[3];
  return word >> (t % 32) & 1u;
}

// The cluster's CTAs, or the CTA alone (a launch without clusters): a barrier over them, which orders each CTA's
// shared-memory writes before it with the others' reads after it. PTX, not cooperative_groups (its calls cost the
// kernel an ABI call's spills).
__device__ __forceinline__ void cluster_barrier(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    return;
  }
#endif
  __syncthreads();
}

// The float at `local` (this CTA's shared memory) in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float cluster_load(const float* local, int rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t own = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(own), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// CTA (c, task) of a grid of `cluster` x tasks CTAs, task = (j * L + s) * rank_blocks + rb. Lane (g, q) of a warp
// reads, per 32-column chunk, 8 columns 8q .. 8q + 7 of A's rank rows g and g + 8 and of x's row for mma column g of
// each tile: the mma's k pairs (2q, 2q + 1) and (2q + 8, 2q + 9) of the chunk's first 16-column step are columns
// 8q .. 8q + 3, of its second 8q + 4 .. 8q + 7 (a permutation of K on both operands, so the sum is unchanged).
template <class T>
__global__ void __launch_bounds__(kTileWarps * 32, 2) kext_shrink_tiles_kernel(const ShrinkArgs a, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return;
#else
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  __shared__ float warp_part[kTileWarps][16 * kPassRows];
  __shared__ float cta_part[16 * kPassRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int c = blockIdx.x % cluster, task = blockIdx.x / cluster;
  const int rank_blocks = (a.rank + 15) / 16;
  const int rb = task % rank_blocks, s = task / rank_blocks % a.num_slots, j = task / (rank_blocks * a.num_slots);

  uint32_t mask[kMaskWords];  // the batch's rows whose slot is s
  int rows = 0;
#pragma unroll
  for (int i = 0; i < kMaskWords; ++i) {
    const int t = lane + 32 * i;
    mask[i] = __ballot_sync(kAll, t < a.t && a.token_slot[t] == s);
    rows += __popc(mask[i]);
  }
  if (rows == 0 && c != 0) return;  // nothing to sum; the first CTA writes the window's zeros

  const T* x = static_cast<const T*>(a.x);
  const T* a_rows[2];
  bool a_live[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rb * 16 + g + 8 * i;
    a_live[i] = r < a.rank;
    a_rows[i] = static_cast<const T*>(a.lora_a) + s * a.a_slot_stride + int64_t(j * a.rank + r) * a.a_row_stride;
  }
  const int units = a.k / kUnitCols, warps = cluster * kTileWarps, first_unit = c * kTileWarps + warp;
  const int passes = (rows + kPassRows - 1) / kPassRows;
  T* h = static_cast<T*>(a.h);
  const int64_t h_row = int64_t(a.num_slices) * a.num_slots * a.rank;
  const int64_t h_window = int64_t(j) * a.num_slots * a.rank + s * a.rank + rb * 16;
  for (int pass = 0; pass < passes; ++pass) {
    const T* x_rows[kPassTiles];
    bool x_live[kPassTiles];
#pragma unroll
    for (int i = 0; i < kPassTiles; ++i) {
      const int row = nth_row(mask, pass * kPassRows + 8 * i + g);
      x_live[i] = row >= 0;
      x_rows[i] = x + int64_t(max(row, 0)) * a.x_stride;
    }
    float acc[kPassTiles][4] = {};
    for (int unit = first_unit; unit < units; unit += warps) {
      uint4 av[2][2], xv[2][kPassTiles];  // [chunk][rank row g, g + 8], [chunk][tile]
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        const int col = unit * kUnitCols + 32 * ch + 8 * q;
#pragma unroll
        for (int i = 0; i < 2; ++i) av[ch][i] = a_live[i] ? load_nc(a_rows[i] + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < kPassTiles; ++i) xv[ch][i] = x_live[i] ? load_nc(x_rows[i] + col) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        const uint32_t a_lo[4] = {av[ch][0].x, av[ch][1].x, av[ch][0].y, av[ch][1].y};
        const uint32_t a_hi[4] = {av[ch][0].z, av[ch][1].z, av[ch][0].w, av[ch][1].w};
#pragma unroll
        for (int i = 0; i < kPassTiles; ++i) {
          const uint32_t b_lo[2] = {xv[ch][i].x, xv[ch][i].y}, b_hi[2] = {xv[ch][i].z, xv[ch][i].w};
          mma16816<T>(acc[i], a_lo, b_lo);
          mma16816<T>(acc[i], a_hi, b_hi);
        }
      }
    }
    // acc[i]: rank rows g (0, 1) and g + 8 (2, 3), columns 8i + 2q and + 1 of the pass.
#pragma unroll
    for (int i = 0; i < kPassTiles; ++i) {
      float* part = warp_part[warp];
      const int col = 8 * i + 2 * q;
      part[g * kPassRows + col] = acc[i][0];
      part[g * kPassRows + col + 1] = acc[i][1];
      part[(g + 8) * kPassRows + col] = acc[i][2];
      part[(g + 8) * kPassRows + col + 1] = acc[i][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * kPassRows; e += kTileWarps * 32) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kTileWarps; ++w) sum += warp_part[w][e];
      cta_part[e] = sum;
    }
    cluster_barrier(cluster);  // every CTA's part is in its shared memory
    if (c == 0) {
      const float scale = a.scales[s];
      for (int e = threadIdx.x; e < 16 * kPassRows; e += kTileWarps * 32) {
        const int r = e / kPassRows, row = nth_row(mask, pass * kPassRows + e % kPassRows);
        float sum = cta_part[e];
        for (int other = 1; other < cluster; ++other) sum += cluster_load(&cta_part[e], other);
        if (row >= 0 && rb * 16 + r < a.rank) h[row * h_row + h_window + r] = from_f32<T>(sum * scale);
      }
    }
    cluster_barrier(cluster);  // the parts were read: the next pass may write them, and the CTAs may exit
  }
  if (c == 0) {  // the window's zeros: every row whose slot is not s
    for (int e = threadIdx.x; e < a.t * 16; e += kTileWarps * 32) {
      const int t = e / 16, r = e % 16;
      if (!row_has_slot(mask, t) && rb * 16 + r < a.rank) h[t * h_row + h_window + r] = from_f32<T>(0.f);
    }
  }
#endif
}

// The cluster's size: two units of 64 columns per warp where K allows, at most the portable 8 CTAs.
int tiles_cluster(int64_t k) {
  const int64_t units = k / kUnitCols;
  return (int)std::clamp<int64_t>((units + 2 * kTileWarps - 1) / (2 * kTileWarps), 1, kMaxCluster);
}

// ---- warps ----

constexpr int kShrinkWarps = 32;  // per CTA
constexpr int kShrinkBatch = 4;   // 16-byte chunks of x and of A in flight per lane (64 registers of loads)

// Warp task (t, j, r): x[t] . A[slot][j*R + r] over all of K, written to every slot's window of h[t] (its own the
// scaled value, the others 0). Each lane keeps kShrinkBatch 16-byte chunks of x and of A in flight, then does their
// FMAs: the loads are not predicated (a chunk past the row reads its last one again, then counts as zero), and every
// FMA depends on every load of the batch (x's chunks take `joined & opaque_zero`), so ptxas cannot sink a load
// between the FMAs: without that it issued each pair of loads just before its FMAs, ~2 chunks in flight (NOTES.md,
// session 29).
template <class T>
__global__ void __launch_bounds__(kShrinkWarps * 32) kext_shrink_warps_kernel(const ShrinkArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return;
#else
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int task = blockIdx.x * kShrinkWarps + warp;
  const int r = task % a.rank, j = task / a.rank % a.num_slices, t = task / (a.rank * a.num_slices);
  if (t >= a.t) return;
  const int slot = a.token_slot[t];
  const bool has_slot = slot >= 0 && slot < a.num_slots;
  const int chunks = a.k / 8;  // 16-byte chunks of a row
  float sum = 0.f;
  if (has_slot) {
    const uint4* xr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + t * a.x_stride);
    const uint4* ar = reinterpret_cast<const uint4*>(static_cast<const T*>(a.lora_a) + slot * a.a_slot_stride +
                                                     int64_t(j * a.rank + r) * a.a_row_stride);
    for (int c0 = lane; c0 < chunks; c0 += 32 * kShrinkBatch) {
      uint4 xv[kShrinkBatch], av[kShrinkBatch];
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) {
        const int c = min(c0 + 32 * i, chunks - 1);
        xv[i] = load_nc(xr + c);
        av[i] = load_nc(ar + c);
      }
      uint32_t joined = 0;
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) joined ^= xv[i].x ^ av[i].x;
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) {
        if (c0 + 32 * i >= chunks) xv[i] = make_uint4(0, 0, 0, 0);
        xv[i].x ^= joined & a.opaque_zero;
      }
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) {
        const uint32_t xw[4] = {xv[i].x, xv[i].y, xv[i].z, xv[i].w}, aw[4] = {av[i].x, av[i].y, av[i].z, av[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 xf = to_float2<T>(xw[e]), af = to_float2<T>(aw[e]);
          sum = fmaf(xf.x, af.x, fmaf(xf.y, af.y, sum));
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(kAll, sum, o);
  const int LR = a.num_slots * a.rank;
  const float scale = has_slot ? a.scales[slot] : 0.f;  // loaded once, not after each store to h
  T* row = static_cast<T*>(a.h) + int64_t(t) * a.num_slices * LR + int64_t(j) * LR + r;
  for (int s = lane; s < a.num_slots; s += 32) row[s * a.rank] = from_f32<T>(s == slot ? sum * scale : 0.f);
#endif
}

template <class T>
cudaError_t launch_shrink(const LoraLinearParams& p, const ShrinkArgs& args, cudaStream_t stream) {
  if (kext_shrink_choice(p) == KextShrink::Warps) {
    const int64_t warps = p.t * p.num_slices * p.rank;
    kext_shrink_warps_kernel<T><<<unsigned((warps + kShrinkWarps - 1) / kShrinkWarps), kShrinkWarps * 32, 0,
                                  stream>>>(args);
    return cudaGetLastError();
  }
  const int cluster = tiles_cluster(p.k);
  const int64_t tasks = p.num_slices * p.num_slots * ((p.rank + 15) / 16);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch_config(tasks * cluster, kTileWarps * 32, cluster, 0, stream, &attr);
  return cudaLaunchKernelEx(&cfg, kext_shrink_tiles_kernel<T>, args, cluster);
}

}  // namespace

KextShrink kext_shrink_choice(const LoraLinearParams& p) {
  // TODO(measure): the rule comes from the decode step's A/B.
  return p.shrink == KextShrink::Auto ? KextShrink::Tiles : p.shrink;
}

bool kext_shrink_serves(const LoraLinearParams& p) {
  return p.t >= 1 && p.t <= kLoraLinearMaxTokens && p.k % kUnitCols == 0 && p.rank >= 1 && p.num_slots >= 1 &&
         p.t * p.num_slices * p.rank <= INT_MAX &&  // the warps kernel's warp index is an int
         p.num_slices * p.num_slots * ((p.rank + 15) / 16) * kMaxCluster <= INT_MAX;
}

cudaError_t launch_kext_shrink(const LoraLinearParams& p, cudaStream_t stream) {
  const ShrinkArgs args{p.x, p.lora_a, p.token_slot, p.scales, p.h, p.x_row_stride, p.a_slot_stride,
                        p.a_row_stride, (int)p.t, (int)p.k, (int)p.num_slices, (int)p.rank, (int)p.num_slots,
                        /*opaque_zero=*/0u};
  return p.dtype == DType::BF16 ? launch_shrink<__nv_bfloat16>(p, args, stream)
                                : launch_shrink<__half>(p, args, stream);
}

}  // namespace lora_ops::cuda
