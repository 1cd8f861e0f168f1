// build_segments: stable counting sort of rows by slot in ONE launch (no host sync, fixed-size outputs).
// The tokens are cut into contiguous chunks, one per member CTA of a thread-block cluster (up to 16 from
// sm_90 on, about 1024 tokens each; a single CTA without clusters), then one per warp:
//   1. each warp counts its chunk's slots into its own shared histogram row;
//   2. per bucket, each member turns its warps' counts into offsets and sums them; after a cluster barrier
//      every member reads all members' sums through distributed shared memory: a scan over buckets gives
//      the bucket starts, the sums of earlier members its own start inside each bucket;
//   3. each warp walks its chunk again 32 tokens at a time: __match_any_sync groups equal slots, the
//      lane's rank among earlier equal lanes plus the warp's running cursor is its output position.
// Chunks are in token order and members, warps and lanes place in that order: the sort is stable.
// Bucket num_slots collects rows whose slot is outside [0, num_slots): sorted last, not covered.
#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerMember = 1024;
constexpr int kMaxMembers = 16;
constexpr size_t kMaxSmem = 160 * 1024;  // an A100 can run it too

// Exclusive prefix sum of a[0, n) in place (block-wide): each thread sums a contiguous run, the run totals
// are scanned with warp shuffles and one warp's scan of the warp totals (two barriers).
__device__ void block_exclusive_scan(int32_t* a, int64_t n, int32_t* warp_total /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  const int64_t per = (n + blockDim.x - 1) / blockDim.x;
  const int64_t r0 = std::min<int64_t>(n, threadIdx.x * per), r1 = std::min<int64_t>(n, r0 + per);
  int32_t sum = 0;
  for (int64_t i = r0; i < r1; ++i) sum += a[i];
  const int32_t incl = warp_inclusive_scan(sum);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) warp_total[lane] = warp_inclusive_scan(lane < warps ? warp_total[lane] : 0);
  __syncthreads();
  int32_t running = (warp > 0 ? warp_total[warp - 1] : 0) + incl - sum;
  for (int64_t i = r0; i < r1; ++i) {
    const int32_t c = a[i];
    a[i] = running;
    running += c;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) build_segments_kernel(BuildSegmentsParams p, int warps_used,
                                                                    int members) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t warp_total[32];
  const int64_t buckets = p.num_slots + 1, T = p.num_tokens;
  int32_t* hist = smem;                                // [buckets][warps_used], bucket-major
  int32_t* member_sum = hist + buckets * warps_used;  // [buckets] this member's rows per bucket
  int32_t* bucket_start = member_sum + buckets;        // [buckets]
  int32_t* member_start = bucket_start + buckets;      // [buckets] this member's first position per bucket
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int member = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  if (members > 1) member = (int)cg::this_cluster().block_rank();
#endif
  int64_t m_begin, m_end, t_begin, t_end;
  split_range(T, members, member, &m_begin, &m_end);
  split_range(m_end - m_begin, warps_used, warp, &t_begin, &t_end);
  t_begin += m_begin;
  t_end += m_begin;
  auto bucket_of = [&](int64_t t) {
    const int32_t s = p.token_lora[t];
    return (s >= 0 && s < p.num_slots) ? (int64_t)s : p.num_slots;
  };
  for (int64_t i = threadIdx.x; i < buckets * warps_used; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  if (warp < warps_used) {
    for (int64_t t = t_begin + lane; t < t_end; t += 32) atomicAdd(&hist[bucket_of(t) * warps_used + warp], 1);
  }
  __syncthreads();
  for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {  // warp offsets inside the member's bucket
    int32_t running = 0;
    for (int w = 0; w < warps_used; ++w) {
      const int32_t c = hist[b * warps_used + w];
      hist[b * warps_used + w] = running;
      running += c;
    }
    member_sum[b] = running;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (members > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    // One thread per (bucket, member), a bucket's members on `members` consecutive lanes (a power of two):
    // one remote read each, then a scan across those lanes.
    for (int64_t base = 0; base < buckets * members; base += blockDim.x) {  // uniform: every lane shuffles
      const int64_t i = base + threadIdx.x, b = i / members;
      const int m = (int)(i % members);
      const int32_t c = i < buckets * members ? cluster.map_shared_rank(member_sum, (unsigned)m)[b] : 0;
      const int32_t incl = warp_inclusive_scan(c, members);
      const int32_t total = __shfl_sync(0xffffffffu, incl, members - 1, members);
      if (i < buckets * members && m == member) {
        bucket_start[b] = total;
        member_start[b] = incl - c;
      }
    }
    // Peers may still read this member's sums: signal that theirs are read, wait for ours before leaving.
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  } else
#endif
  {
    for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {
      bucket_start[b] = member_sum[b];
      member_start[b] = 0;
    }
  }
  __syncthreads();
  block_exclusive_scan(bucket_start, buckets, warp_total);
  for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {
    const int32_t base = bucket_start[b] + member_start[b];
    for (int w = 0; w < warps_used; ++w) hist[b * warps_used + w] += base;
    if (member == 0) {
      p.seg_indptr[b] = bucket_start[b];
      if (b < p.num_slots) p.seg_lora[b] = (int32_t)b;
    }
  }
  __syncthreads();
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (members > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

size_t smem_bytes(int64_t buckets, int warps) { return (size_t)buckets * (warps + 3) * sizeof(int32_t); }

}  // namespace

int64_t build_segments_max_slots() { return (int64_t)(kMaxSmem / smem_bytes(1, 1)) - 1; }

cudaError_t launch_build_segments(const BuildSegmentsParams& p, int cc_major, cudaStream_t stream) {
  const int64_t buckets = p.num_slots + 1;
  // A histogram row per warp; fewer warps when the slot count is large.
  const int64_t fit = (int64_t)kMaxSmem / (buckets * (int64_t)sizeof(int32_t)) - 3;
  if (fit < 1) return cudaErrorInvalidValue;
  const int warps = (int)std::max<int64_t>(1, std::min<int64_t>({kWarps, fit, (p.num_tokens + 31) / 32}));
  const size_t smem = smem_bytes(buckets, warps);
  if (const cudaError_t err = allow_dynamic_smem((const void*)build_segments_kernel, smem); err != cudaSuccess) {
    return err;
  }
  int members = 1;  // a power of two (the kernel scans across members with lane shuffles)
  while (cc_major >= 9 && members < kMaxMembers && members * kTokensPerMember < p.num_tokens) members *= 2;
  while (members > 1 && !cluster_fits((const void*)build_segments_kernel, kThreads, members, smem)) members /= 2;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch_config(members, kThreads, members, smem, stream, &attr);
  return cudaLaunchKernelEx(&cfg, build_segments_kernel, p, warps, members);
}

}  // namespace lora_ops::cuda
