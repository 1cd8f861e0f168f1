// build_segments: stable counting sort of rows by slot in ONE block (no host sync, fixed-size outputs).
//   0. when they fit (T <= ~39K), the token slots are copied to shared memory first;
//   1. each warp counts the slots of its contiguous chunk of tokens into its own shared histogram row;
//   2. a block scan over (bucket, warp) in bucket-major order gives every warp its first position per bucket;
//   3. each warp walks its chunk again 32 tokens at a time: __match_any_sync groups equal slots, the
//      lane's rank among earlier equal lanes plus the warp's running cursor is its output position.
// Bucket num_slots collects rows whose slot is outside [0, num_slots): sorted last, not covered.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr size_t kMaxSmem = 160 * 1024;

__global__ void __launch_bounds__(kThreads) build_segments_kernel(BuildSegmentsParams p, int warps_used, bool staged) {
  extern __shared__ int32_t hist[];  // [buckets][warps_used], bucket-major; then the staged token slots
  const int64_t buckets = p.num_slots + 1, T = p.num_tokens;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t chunk = (T + warps_used - 1) / warps_used;
  const int64_t t_begin = std::min<int64_t>(T, warp * chunk), t_end = std::min<int64_t>(T, t_begin + chunk);
  // Both passes below walk the slots 32 at a time per warp; reading them from global memory would expose one
  // load latency per step, so when they fit they are first copied to shared memory with every load in flight.
  int32_t* staged_lora = hist + buckets * warps_used;
  if (staged) {
    constexpr int kBatch = 8;
    for (int64_t base = threadIdx.x; base < T; base += (int64_t)blockDim.x * kBatch) {
      int32_t v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int64_t t = base + (int64_t)i * blockDim.x;
        v[i] = t < T ? p.token_lora[t] : 0;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int64_t t = base + (int64_t)i * blockDim.x;
        if (t < T) staged_lora[t] = v[i];
      }
    }
  }
  const int32_t* token_lora = staged ? staged_lora : p.token_lora;
  auto bucket_of = [&](int64_t t) {
    const int32_t s = token_lora[t];
    return (s >= 0 && s < p.num_slots) ? (int64_t)s : p.num_slots;
  };
  for (int64_t i = threadIdx.x; i < buckets * warps_used; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  if (warp < warps_used) {
    for (int64_t t = t_begin + lane; t < t_end; t += 32) atomicAdd(&hist[bucket_of(t) * warps_used + warp], 1);
  }
  __syncthreads();
  // Exclusive scan of hist in place: each thread scans a contiguous run, then the runs' totals.
  __shared__ int32_t run_total[kThreads];
  const int64_t n = buckets * warps_used, per = (n + blockDim.x - 1) / blockDim.x;
  const int64_t r0 = std::min<int64_t>(n, threadIdx.x * per), r1 = std::min<int64_t>(n, r0 + per);
  int32_t sum = 0;
  for (int64_t i = r0; i < r1; ++i) sum += hist[i];
  run_total[threadIdx.x] = sum;
  __syncthreads();
  for (int d = 1; d < (int)blockDim.x; d <<= 1) {  // Hillis-Steele inclusive scan of the run totals
    const int32_t v = threadIdx.x >= d ? run_total[threadIdx.x - d] : 0;
    __syncthreads();
    run_total[threadIdx.x] += v;
    __syncthreads();
  }
  int32_t running = run_total[threadIdx.x] - sum;
  for (int64_t i = r0; i < r1; ++i) {
    const int32_t c = hist[i];
    hist[i] = running;
    running += c;
  }
  __syncthreads();
  for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {
    p.seg_indptr[b] = hist[b * warps_used];  // warp 0's start of bucket b = start of the bucket
    if (b < p.num_slots) p.seg_lora[b] = (int32_t)b;
  }
  if (warp < warps_used) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += 32) {
      const int64_t t = t0 + lane;
      const bool active = t < t_end;
      const unsigned mask = __ballot_sync(0xffffffffu, active);
      if (active) {
        const int64_t b = bucket_of(t);
        const unsigned peers = __match_any_sync(mask, (long long)b);
        const int leader = __ffs(peers) - 1;
        const int rank = __popc(peers & ((1u << lane) - 1));
        int32_t* cursor = &hist[b * warps_used + warp];
        const int32_t base = *cursor;  // read by all peers before the leader advances it
        __syncwarp(mask);
        if (lane == leader) *cursor = base + __popc(peers);
        p.token_indices[base + rank] = (int32_t)t;
      }
      __syncwarp();
    }
  }
}

}  // namespace

cudaError_t launch_build_segments(const BuildSegmentsParams& p, cudaStream_t stream) {
  const int64_t buckets = p.num_slots + 1;
  // A histogram row per warp; fewer warps when the slot count is large (shared memory <= 160 KB, so that
  // an A100 can run it too).
  const int64_t fit = (int64_t)kMaxSmem / (buckets * (int64_t)sizeof(int32_t));
  if (fit < 1) return cudaErrorInvalidValue;
  const int warps = (int)std::max<int64_t>(1, std::min<int64_t>({32, fit, (p.num_tokens + 31) / 32}));
  size_t smem = buckets * warps * sizeof(int32_t);
  const bool staged = smem + p.num_tokens * sizeof(int32_t) <= kMaxSmem;
  if (staged) smem += p.num_tokens * sizeof(int32_t);
  if (const cudaError_t err = allow_dynamic_smem((const void*)build_segments_kernel, smem); err != cudaSuccess) {
    return err;
  }
  build_segments_kernel<<<1, kThreads, smem, stream>>>(p, warps, staged);
  return cudaGetLastError();
}

}  // namespace lora_ops::cuda
