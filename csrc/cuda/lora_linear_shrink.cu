// lora_linear's shrink, the kext route's first launch (the GEMM after it: lora_linear_sm90.cu; a file of its own, so
// that a change here does not recompile the CUTLASS kernels):
//   h[t, j*L*R + s*R + r] = round(scale[s] * x[t] . A[s][j*R + r]) for row t's slot s, zeros in every other slot's
//   window and in every window of a row without a slot (-1 or >= L). It lets its dependents launch at its start.
// A warp per rank row of a row of x, CTAs of 32 warps (packed into few SMs, leaving the others to the GEMM's x
// blocks), over all of K, so each h value is one warp's sum in a fixed order: deterministic. What lost to it
// (csrc/cuda/NOTES.md): CTAs of 4 warps and a warp per 4 rank rows sharing x's loads (session 30), a warp per A row
// and 4 rows of its slot (session 32), and a tensor-core shrink spreading a cluster per (slice, slot, 16 rank rows)
// over every SM (session 35: the GEMM's CTAs then wait for the whole shrink).
// sm_90 only (griddepcontrol); the extension's other archs compile an empty kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

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
  uint32_t opaque_zero;  // always 0, passed from the host so that no compiler can fold it (below)
};

// A 16-byte load through the non-coherent path that ptxas keeps in program order with the other ones.
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

constexpr int kShrinkWarps = 32;  // per CTA
constexpr int kShrinkBatch = 4;   // 16-byte chunks of x and of A in flight per lane (64 registers of loads)
constexpr int kMaxShrinkParts = 8;  // the K-split probe's warps a task, within one CTA
static_assert(kShrinkWarps % kMaxShrinkParts == 0, "a task's parts lie in one CTA");

// ---- the few-slots path (a probe, off by default: LORA_OPS_CUDA_KEXT_SHRINK_FEW=1) ----
// Where the batch's rows use at most kFewMaxSlots distinct slots, the warps' tasks read the same x rows and A rows
// over and over (at one adapter, 48 times each for qkv at T=32: ~25 MB through L2 for 0.6 MB of x and A). There a
// cluster of C CTAs per item (slot u of the batch's distinct ones, slice j, 16 rank rows, 32 of the slot's rows)
// multiplies them on tensor cores: mma.sync m16n8k16, A's 16 rank rows as M, the slot's rows as N; K split over the
// cluster's warps, a 32-column chunk per warp and trip; the warps' parts summed in shared memory and the CTAs' by the
// first one through distributed shared memory, in a fixed order. The other CTAs of the warps' grid only write h's
// zeros (every CTA a share of them).
constexpr int kFewMaxSlots = 4;
constexpr int kFewRows = 32;  // a slot's rows per item: the mma's N, 4 tiles of 8
constexpr int kFewTiles = kFewRows / 8;
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kSlotWords = kLoraLinearMaxTokens / 32;  // token_slot in words of 32 rows, one row per lane
static_assert(kSlotWords == 4, "the row masks below are 4 words");

// The batch's distinct slots (valid ones, in order of first row), as each warp computes them alike: `slot` is this
// lane's rows' slots (row lane + 32 i; -1 where none or past the batch), `count` kFewMaxSlots + 1 where there are more.
struct BatchSlots {
  int slot[kSlotWords];
  int distinct[kFewMaxSlots];
  int count;
};

template <class W>
__device__ __forceinline__ W select_word(const W (&v)[kSlotWords], int i) {
  return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

__device__ __forceinline__ BatchSlots batch_slots(const int32_t* token_slot, int t_count, int num_slots, int lane) {
  BatchSlots b;
  uint32_t left[kSlotWords];
#pragma unroll
  for (int i = 0; i < kSlotWords; ++i) {
    const int t = lane + 32 * i;
    const int s = t < t_count ? token_slot[t] : -1;
    b.slot[i] = s >= 0 && s < num_slots ? s : -1;
    left[i] = __ballot_sync(kAll, b.slot[i] >= 0);
  }
  b.count = 0;
#pragma unroll
  for (int n = 0; n <= kFewMaxSlots; ++n) {  // the next slot: the first row's not yet counted
    const int w = left[0] ? 0 : left[1] ? 1 : left[2] ? 2 : left[3] ? 3 : -1;
    if (w < 0) break;
    const int s = __shfl_sync(kAll, select_word(b.slot, w), __ffs(select_word(left, w)) - 1);
    if (n < kFewMaxSlots) b.distinct[n] = s;
    b.count = n + 1;
#pragma unroll
    for (int i = 0; i < kSlotWords; ++i) left[i] &= ~__ballot_sync(kAll, b.slot[i] == s);
  }
  return b;
}

// The row of the n-th set bit of a row mask (rows ascending), -1 past the last.
__device__ __forceinline__ int nth_row(const uint32_t (&mask)[kSlotWords], int n) {
#pragma unroll
  for (int i = 0; i < kSlotWords; ++i) {
    const int count = __popc(mask[i]);
    if (n < count) return 32 * i + (int)__fns(mask[i], 0, n + 1);
    n -= count;
  }
  return -1;
}

// A barrier over the cluster's CTAs (the CTA alone where there is no cluster), ordering each CTA's shared-memory
// writes before it with the others' reads after it. PTX, not cooperative_groups (its calls cost an ABI call's spills).
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

// Items per distinct slot: slices x rank blocks x row groups.
__device__ __host__ __forceinline__ int few_items_per_slot(int t, int num_slices, int rank) {
  return num_slices * ((rank + 15) / 16) * ((t + kFewRows - 1) / kFewRows);
}

// The few-slots path for CTA blockIdx.x of a grid in clusters of `cluster` (kShrinkWarps warps each). Lane (g, q)
// of a warp reads, per 32-column chunk, columns 8q .. 8q + 7 of A's rank rows g and g + 8 and of x's row for mma
// column g of each tile: the mma's k pairs (2q, 2q + 1) and (2q + 8, 2q + 9) of the chunk's first 16-column step
// are columns 8q .. 8q + 3, of its second 8q + 4 .. 8q + 7 (K permuted alike on both operands: the sum is unchanged).
template <class T, int kWarps>
__device__ __forceinline__ void few_slots_shrink(const ShrinkArgs& a, const BatchSlots& b, int cluster) {
  __shared__ float warp_part[kWarps / 2][16 * kFewRows];
  __shared__ float cta_part[16 * kFewRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int item = blockIdx.x / cluster, member = blockIdx.x % cluster;
  const int per_slot = few_items_per_slot(a.t, a.num_slices, a.rank);
  const int groups = (a.t + kFewRows - 1) / kFewRows, rank_blocks = (a.rank + 15) / 16;
  const int LR = a.num_slots * a.rank;
  const int64_t h_row = int64_t(a.num_slices) * LR;
  T* h = static_cast<T*>(a.h);
  if (item < b.count * per_slot) {
    const int u = item / per_slot, group = item % groups, rb = item / groups % rank_blocks,
              j = item / (groups * rank_blocks) % a.num_slices;
    const int s = u == 0 ? b.distinct[0] : u == 1 ? b.distinct[1] : u == 2 ? b.distinct[2] : b.distinct[3];
    uint32_t mask[kSlotWords];  // the batch's rows whose slot is s
    int rows = 0;
#pragma unroll
    for (int i = 0; i < kSlotWords; ++i) {
      mask[i] = __ballot_sync(kAll, b.slot[i] == s);
      rows += __popc(mask[i]);
    }
    if (rows > group * kFewRows) {  // alike in the cluster's CTAs: all or none of them reach its barriers
      const T* x_rows[kFewTiles];
      bool x_live[kFewTiles];
#pragma unroll
      for (int i = 0; i < kFewTiles; ++i) {
        const int row = nth_row(mask, group * kFewRows + 8 * i + g);
        x_live[i] = row >= 0;
        x_rows[i] = static_cast<const T*>(a.x) + int64_t(max(row, 0)) * a.x_stride;
      }
      const T* a_rows[2];
      bool a_live[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = rb * 16 + g + 8 * i;
        a_live[i] = r < a.rank;
        a_rows[i] = static_cast<const T*>(a.lora_a) + s * a.a_slot_stride + int64_t(j * a.rank + min(r, a.rank - 1)) *
                                                                                 a.a_row_stride;
      }
      float acc[kFewTiles][4] = {};
      for (int chunk = member * kWarps + warp; chunk < a.k / 32; chunk += cluster * kWarps) {
        const int col = chunk * 32 + 8 * q;
        uint4 av[2], xv[kFewTiles];
#pragma unroll
        for (int i = 0; i < 2; ++i) av[i] = a_live[i] ? load_nc(a_rows[i] + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < kFewTiles; ++i) xv[i] = x_live[i] ? load_nc(x_rows[i] + col) : make_uint4(0, 0, 0, 0);
        const uint32_t a_lo[4] = {av[0].x, av[1].x, av[0].y, av[1].y}, a_hi[4] = {av[0].z, av[1].z, av[0].w, av[1].w};
#pragma unroll
        for (int i = 0; i < kFewTiles; ++i) {
          const uint32_t b_lo[2] = {xv[i].x, xv[i].y}, b_hi[2] = {xv[i].z, xv[i].w};
          mma16816<T>(acc[i], a_lo, b_lo);
          mma16816<T>(acc[i], a_hi, b_hi);
        }
      }
      // acc[i]: rank rows g (0, 1) and g + 8 (2, 3), the item's rows 8i + 2q and + 1. The warps' parts summed in a
      // fixed order: warp w + kWarps / 2 into warp w's, then the kWarps / 2 sums.
      const int half = kWarps / 2;
      for (int round = 0; round < 2; ++round) {
        if ((round == 0) == (warp >= half)) {
          float* part = warp_part[warp % half];
#pragma unroll
          for (int i = 0; i < kFewTiles; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int at = (g + 8 * (e / 2)) * kFewRows + 8 * i + 2 * q + e % 2;
              part[at] = round == 0 ? acc[i][e] : part[at] + acc[i][e];
            }
          }
        }
        __syncthreads();
      }
      for (int e = threadIdx.x; e < 16 * kFewRows; e += kWarps * 32) {
        float sum = 0.f;
#pragma unroll 4
        for (int w = 0; w < half; ++w) sum += warp_part[w][e];
        cta_part[e] = sum;
      }
      cluster_barrier(cluster);  // every CTA's part is in its shared memory
      if (member == 0) {
        const float scale = a.scales[s];
        for (int e = threadIdx.x; e < 16 * kFewRows; e += kWarps * 32) {
          const int r = rb * 16 + e / kFewRows, row = nth_row(mask, group * kFewRows + e % kFewRows);
          float sum = cta_part[e];
          for (int other = 1; other < cluster; ++other) sum += cluster_load(&cta_part[e], other);
          if (row >= 0 && r < a.rank) h[row * h_row + int64_t(j) * LR + s * a.rank + r] = from_f32<T>(sum * scale);
        }
      }
      cluster_barrier(cluster);  // the parts were read: the CTAs may exit
    }
  }
  // The zeros: every window of a row but its own slot's (written above), a share per CTA. A warp's lanes take
  // consecutive elements, each its row's slot from the lane holding it.
  const int64_t total = int64_t(a.t) * h_row;
  for (int64_t base = (int64_t(blockIdx.x) * kWarps + warp) * 32; base < total; base += int64_t(gridDim.x) * kWarps * 32) {
    const int64_t e = base + lane;
    const int t = int(min(e, total - 1) / h_row), s = int(min(e, total - 1) % LR / a.rank);
    const int own = select_word<int>({__shfl_sync(kAll, b.slot[0], t % 32), __shfl_sync(kAll, b.slot[1], t % 32),
                                 __shfl_sync(kAll, b.slot[2], t % 32), __shfl_sync(kAll, b.slot[3], t % 32)},
                                t / 32);
    if (e < total && s != own) h[e] = from_f32<T>(0.f);
  }
}

// Warp task (t, j, r): x[t] . A[slot][j*R + r] over all of K, written to every slot's window of h[t] (its own the
// scaled value, the others 0). Each lane keeps kShrinkBatch 16-byte chunks of x and of A in flight, then does their
// FMAs: the loads are not predicated (a chunk past the range reads its last one again, then counts as zero), and
// every FMA depends on every load of the batch (x's chunks take `joined & opaque_zero`), so ptxas cannot sink a load
// between the FMAs: without that it issued each pair of loads just before its FMAs, ~2 chunks in flight (NOTES.md,
// session 29).
// kSplit (a probe, off by default: LORA_OPS_CUDA_KEXT_SHRINK_KSPLIT=1): `parts` consecutive warps of a CTA share a
// task, each over its part of K; the task's first warp sums their parts in order (deterministic) and writes h.
// kFew (a probe, off by default): the few-slots path above where the batch has at most kFewMaxSlots distinct slots
// and the grid (in clusters of `cluster` CTAs) holds their items.
template <class T, bool kSplit, bool kFew>
__global__ void __launch_bounds__(kShrinkWarps * 32) kext_shrink_kernel(const ShrinkArgs a, int parts, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return;
#else
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kFew) {
    const BatchSlots b = batch_slots(a.token_slot, a.t, a.num_slots, lane);
    if (b.count <= kFewMaxSlots &&
        int64_t(b.count) * few_items_per_slot(a.t, a.num_slices, a.rank) * cluster <= gridDim.x) {
      few_slots_shrink<T, kShrinkWarps>(a, b, cluster);
      return;
    }
  }
  const int unit = blockIdx.x * kShrinkWarps + warp;
  const int task = kSplit ? unit / parts : unit, part = kSplit ? unit % parts : 0;
  const int r = task % a.rank, j = task / a.rank % a.num_slices, t = task / (a.rank * a.num_slices);
  if (!kSplit && t >= a.t) return;  // the split kernel's warps all reach its barrier
  const int slot = t < a.t ? a.token_slot[t] : -1;
  const bool has_slot = slot >= 0 && slot < a.num_slots;
  const int chunks = a.k / 8;  // 16-byte chunks of a row
  const int per_part = kSplit ? (chunks + parts - 1) / parts : chunks;
  const int begin = part * per_part, end = min(chunks, begin + per_part);
  float sum = 0.f;
  if (has_slot) {
    const uint4* xr = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + t * a.x_stride);
    const uint4* ar = reinterpret_cast<const uint4*>(static_cast<const T*>(a.lora_a) + slot * a.a_slot_stride +
                                                     int64_t(j * a.rank + r) * a.a_row_stride);
    for (int c0 = begin + lane; c0 < end; c0 += 32 * kShrinkBatch) {
      uint4 xv[kShrinkBatch], av[kShrinkBatch];
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) {
        const int c = min(c0 + 32 * i, end - 1);
        xv[i] = load_nc(xr + c);
        av[i] = load_nc(ar + c);
      }
      uint32_t joined = 0;
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) joined ^= xv[i].x ^ av[i].x;
#pragma unroll
      for (int i = 0; i < kShrinkBatch; ++i) {
        if (c0 + 32 * i >= end) xv[i] = make_uint4(0, 0, 0, 0);
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
  if constexpr (kSplit) {
    __shared__ float part_sum[kShrinkWarps];
    if (lane == 0) part_sum[warp] = sum;
    __syncthreads();
    if (part != 0 || t >= a.t) return;
    sum = 0.f;
    for (int i = 0; i < parts; ++i) sum += part_sum[warp + i];
  }
  const int LR = a.num_slots * a.rank;
  const float scale = has_slot ? a.scales[slot] : 0.f;  // loaded once, not after each store to h
  T* row = static_cast<T*>(a.h) + int64_t(t) * a.num_slices * LR + int64_t(j) * LR + r;
  for (int s = lane; s < a.num_slots; s += 32) row[s * a.rank] = from_f32<T>(s == slot ? sum * scale : 0.f);
#endif
}

// The probe's K split: the most parts (a power of two up to kMaxShrinkParts, at least 1024 columns each) whose warps
// fit the SMs the GEMM leaves free at up to 64 tokens (one 64-row W tile per CTA, min(N / 64, SMs) CTAs), else 1.
int shrink_parts(const LoraLinearParams& p) {
  if (!p.shrink_ksplit || p.t > 64 || p.sm_count <= 0) return 1;
  const int64_t ctas = (p.t * p.num_slices * p.rank + kShrinkWarps - 1) / kShrinkWarps;
  const int64_t free_sms = p.sm_count - std::min<int64_t>(p.n / 64, p.sm_count);
  int parts = 1;
  while (parts < kMaxShrinkParts && 2 * parts * ctas <= free_sms && p.k / (2 * parts) >= 1024) parts *= 2;
  return parts;
}

// The few-slots probe's cluster: a 32-column chunk per warp where K allows, at most the portable 8 CTAs; 0: off.
int few_cluster(const LoraLinearParams& p) {
  if (!p.shrink_few) return 0;
  int cluster = 1;
  while (cluster < kMaxCluster && cluster * kShrinkWarps * 32 < p.k) cluster *= 2;
  return cluster;
}

template <class T, bool kSplit, bool kFew>
cudaError_t launch(int64_t ctas, const ShrinkArgs& args, int parts, int cluster, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch_config(ctas, kShrinkWarps * 32, cluster, 0, stream, &attr);
  return cudaLaunchKernelEx(&cfg, kext_shrink_kernel<T, kSplit, kFew>, args, parts, cluster);
}

template <class T>
cudaError_t launch_shrink(const LoraLinearParams& p, const ShrinkArgs& args, cudaStream_t stream) {
  const int parts = shrink_parts(p), cluster = few_cluster(p);
  int64_t ctas = (p.t * p.num_slices * p.rank * parts + kShrinkWarps - 1) / kShrinkWarps;
  if (cluster == 0) {
    return parts == 1 ? launch<T, false, false>(ctas, args, 1, 1, stream)
                      : launch<T, true, false>(ctas, args, parts, 1, stream);
  }
  ctas = (ctas + cluster - 1) / cluster * cluster;  // whole clusters
  return parts == 1 ? launch<T, false, true>(ctas, args, 1, cluster, stream)
                    : launch<T, true, true>(ctas, args, parts, cluster, stream);
}

}  // namespace

bool kext_shrink_serves(const LoraLinearParams& p) {
  return p.t * p.num_slices * p.rank * kMaxShrinkParts <= INT_MAX;  // the kernel's warp index is an int
}

cudaError_t launch_kext_shrink(const LoraLinearParams& p, cudaStream_t stream) {
  const ShrinkArgs args{p.x, p.lora_a, p.token_slot, p.scales, p.h, p.x_row_stride, p.a_slot_stride,
                        p.a_row_stride, (int)p.t, (int)p.k, (int)p.num_slices, (int)p.rank, (int)p.num_slots,
                        /*opaque_zero=*/0u};
  return p.dtype == DType::BF16 ? launch_shrink<__nv_bfloat16>(p, args, stream) : launch_shrink<__half>(p, args, stream);
}

}  // namespace lora_ops::cuda
