// lora_linear's shrink, the kext route's first launch (the GEMM after it: lora_linear_sm90.cu; a file of its own, so
// that a change here does not recompile the CUTLASS kernels):
//   h[t, j*L*R + s*R + r] = round(scale[s] * x[t] . A[s][j*R + r]) for row t's slot s, zeros in every other slot's
//   window and in every window of a row without a slot (-1 or >= L). It lets its dependents launch at its start.
// A warp per rank row of a row of x, CTAs of 32 warps (packed into few SMs, leaving the others to the GEMM's x
// blocks), over all of K, so each h value is one warp's sum in a fixed order: deterministic; where the GEMM leaves
// SMs free (up to 64 tokens), 2-8 warps per rank row, each over a part of K, summed in order. What lost to it
// (csrc/cuda/NOTES.md): CTAs of 4 warps and a warp per 4 rank rows sharing x's loads (session 30), a warp per A row
// and 4 rows of its slot (session 32), a tensor-core shrink spreading a cluster per (slice, slot, 16 rank rows)
// over every SM (session 35: the GEMM's CTAs then wait for the whole shrink), and a tensor-core path inside this
// kernel's grid for batches of at most 4 slots, launched in clusters (session 36: +10 points at one adapter, +3 at
// 32 where it did not run).
// sm_90 only (griddepcontrol); the extension's other archs compile an empty kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

#include "common.cuh"
#include "kernels.h"

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
constexpr int kShrinkBatch = 4;   // 16-byte chunks of x and of A in flight per lane (32 registers of loads)
constexpr int kMaxShrinkParts = 8;  // the K split's warps a task, within one CTA
static_assert(kShrinkWarps % kMaxShrinkParts == 0, "a task's parts lie in one CTA");

// Warp task (t, j, r): x[t] . A[slot][j*R + r] over all of K, written to every slot's window of h[t] (its own the
// scaled value, the others 0). Each lane keeps kShrinkBatch 16-byte chunks of x and of A in flight, then does their
// FMAs: the loads are not predicated (a chunk past the range reads its last one again, then counts as zero), and
// every FMA depends on every load of the batch (x's chunks take `joined & opaque_zero`), so ptxas cannot sink a load
// between the FMAs: without that it issued each pair of loads just before its FMAs, ~2 chunks in flight (NOTES.md,
// session 29).
// kSplit (where the GEMM leaves SMs free: shrink_parts): `parts` consecutive warps of a CTA share a task, each over
// its part of K; the task's first warp sums their parts in order (deterministic) and writes h.
template <class T, bool kSplit>
__global__ void __launch_bounds__(kShrinkWarps * 32) kext_shrink_kernel(const ShrinkArgs a, int parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return;
#else
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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

// The K split: the most parts (a power of two up to kMaxShrinkParts, at least 1024 columns each) whose warps fit the
// SMs the GEMM leaves free at up to 64 tokens (one 64-row W tile per CTA, min(N / 64, SMs) CTAs), else 1. Its
// dependent trips shorten the shrink where the GEMM would wait for h (o and down at T <= 64 on llama3-8b): -0.5 and
// -1.1 points at T=32 with 1 and 32 adapters (NOTES.md session 36).
int shrink_parts(const LoraLinearParams& p) {
  if (p.t > 64 || p.sm_count <= 0) return 1;
  const int64_t ctas = (p.t * p.num_slices * p.rank + kShrinkWarps - 1) / kShrinkWarps;
  const int64_t free_sms = p.sm_count - std::min<int64_t>(p.n / 64, p.sm_count);
  int parts = 1;
  while (parts < kMaxShrinkParts && 2 * parts * ctas <= free_sms && p.k / (2 * parts) >= 1024) parts *= 2;
  return parts;
}

template <class T>
void launch_shrink(const LoraLinearParams& p, const ShrinkArgs& args, cudaStream_t stream) {
  const int parts = shrink_parts(p);
  const unsigned ctas = unsigned((p.t * p.num_slices * p.rank * parts + kShrinkWarps - 1) / kShrinkWarps);
  if (parts == 1) {
    kext_shrink_kernel<T, false><<<ctas, kShrinkWarps * 32, 0, stream>>>(args, 1);
  } else {
    kext_shrink_kernel<T, true><<<ctas, kShrinkWarps * 32, 0, stream>>>(args, parts);
  }
}

}  // namespace

bool kext_shrink_serves(const LoraLinearParams& p) {
  return p.t * p.num_slices * p.rank * kMaxShrinkParts <= INT_MAX;  // the kernel's warp index is an int
}

cudaError_t launch_kext_shrink(const LoraLinearParams& p, cudaStream_t stream) {
  const ShrinkArgs args{p.x, p.lora_a, p.token_slot, p.scales, p.h, p.x_row_stride, p.a_slot_stride,
                        p.a_row_stride, (int)p.t, (int)p.k, (int)p.num_slices, (int)p.rank, (int)p.num_slots,
                        /*opaque_zero=*/0u};
  if (p.dtype == DType::BF16) {
    launch_shrink<__nv_bfloat16>(p, args, stream);
  } else {
    launch_shrink<__half>(p, args, stream);
  }
  return cudaGetLastError();
}

}  // namespace lora_ops::cuda
