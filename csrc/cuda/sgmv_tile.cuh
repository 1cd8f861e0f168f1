// What the prefill sgmv kernels (sgmv_mma.cu on mma.sync, sgmv_wgmma.cu on sm_90a's wgmma) share: the tile of
// positions, and the deterministic sum of a cluster's K-partials of h through distributed shared memory.
#pragma once
#include <cooperative_groups.h>

#include "common.cuh"

namespace lora_ops::cuda {

constexpr int kTileRows = 64;   // positions of one segment per tile
constexpr int kMaxCluster = 8;  // the portable cluster size

// Sums the cluster's K-partials of h in member order (bitwise what a plain loop over the members gives), in place:
// each of the CTA's kThreads threads holds kVecs float4s of its own fragments (h, 4 * kVecs floats), and `part`
// (shared memory, kThreads * kVecs float4s, free for the call) is where they cross. Member m sums the m-th 1/C of
// the fragments over every peer and keeps the sum in place (no peer reads that part of m's buffer), then each
// member fetches every sum from its owner: 2 tiles of h cross DSMEM per CTA instead of C, as float4s in fragment
// order (thread-contiguous: no bank conflicts; per-element loads from rows RT floats apart were 8-way conflicted,
// C tiles per CTA: csrc/cuda/NOTES.md, session 25). Every thread of every member calls it.
template <int kThreads, int kVecs>
__device__ inline void cluster_sum_h(float4* part, float* h, int64_t member, int64_t members) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int kFrags = kThreads * kVecs;
  static_assert(kFrags % kMaxCluster == 0, "every cluster size splits the fragments evenly");
  const int tid = threadIdx.x;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    part[v * kThreads + tid] = make_float4(h[4 * v], h[4 * v + 1], h[4 * v + 2], h[4 * v + 3]);
  }
  cluster.sync();
  const int share = kFrags / (int)members;
  for (int f = (int)member * share + tid; f < ((int)member + 1) * share; f += kThreads) {
    float4 got[kMaxCluster];
#pragma unroll
    for (int m = 0; m < kMaxCluster; ++m) {  // all loads in flight before the first add
      if (m < members) got[m] = cluster.map_shared_rank(part, (unsigned)m)[f];
    }
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int m = 0; m < kMaxCluster; ++m) {
      if (m < members) sum = make_float4(sum.x + got[m].x, sum.y + got[m].y, sum.z + got[m].z, sum.w + got[m].w);
    }
    part[f] = sum;
  }
  cluster.sync();
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int f = v * kThreads + tid;
    const float4 s = cluster.map_shared_rank(part, (unsigned)(f / share))[f];
    h[4 * v] = s.x, h[4 * v + 1] = s.y, h[4 * v + 2] = s.z, h[4 * v + 3] = s.w;
  }
  cluster.sync();  // no member reuses its shared memory while a peer may still read it
#else
  __trap();  // clusters exist from sm_90 on; the host never plans one below
#endif
}

}  // namespace lora_ops::cuda
