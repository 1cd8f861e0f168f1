// What the prefill sgmv kernels (sgmv_mma.cu on mma.sync, sgmv_wgmma.cu on sm_90a's wgmma) share: the tile of
// positions, each thread's sources of X, A and B, the rank tile a launch is built for, and the deterministic sum of
// a cluster's K-partials of h through distributed shared memory.
#pragma once
#include <cooperative_groups.h>
#include <cuda/ptx>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {

constexpr int kTileRows = 64;   // positions of one segment per tile
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kMaxRankTile = 128;  // ranks of all a tile's slices together (with_rank_tile)

// Where one thread's shrink copies come from: the 16-byte chunk column kc of rows r0, r0 + step, ... of the X tile
// (kRows positions) and of A's rank rows, the group's slices one after another, rank_pad rows each.
// A null source (a row outside the tile, past the slot's true rank or the group's slices) is a zero fill.
template <class T, int RT, int kThreads, int kBK, int kRows>
struct ShrinkSources {
  using Rows = Pieces<T, kRows, kBK, kThreads>;
  static_assert(kRows % Rows::kRowStep == 0 && RT % Rows::kRowStep == 0, "X and A rows split evenly");
  static constexpr int kXRows = kRows / Rows::kRowStep, kARows = RT / Rows::kRowStep;
  int kc;
  const T* x[kXRows];
  const T* a[kARows];

  __device__ ShrinkSources(const SgmvParams& p, const int64_t* s_rows, const TileRef& tile, int rank_pad, int64_t s0,
                           int64_t s1) {
    kc = Rows::c();
#pragma unroll
    for (int i = 0; i < kXRows; ++i) {
      const int64_t row = s_rows[Rows::r0() + i * Rows::kRowStep];
      x[i] = row >= 0 ? static_cast<const T*>(p.x) + row * p.x_row_stride + kc : nullptr;
    }
#pragma unroll
    for (int i = 0; i < kARows; ++i) {
      const int rr = Rows::r0() + i * Rows::kRowStep, sl = rr / rank_pad, j = rr % rank_pad;
      a[i] = s0 + sl < s1 && j < tile.size ? static_cast<const T*>(p.lora_a) + tile.slot * p.a_stride0 +
                                                 ((s0 + sl) * p.max_rank + j) * p.a_stride1 + kc
                                           : nullptr;
    }
  }

  // The copies of the K step at k0: row i of X to x_dst(i), of A to a_dst(i) (shared memory), zero past K.
  template <class XDst, class ADst>
  __device__ void load(const SgmvParams& p, int64_t k0, XDst x_dst, ADst a_dst) const {
    const int bytes = (int)std::clamp<int64_t>(p.k - k0 - kc, 0, 8) * 2;
#pragma unroll
    for (int i = 0; i < kXRows; ++i) {
      const bool ok = x[i] && bytes;
      cp_async16(x_dst(i), ok ? x[i] + k0 : p.x, ok ? bytes : 0);
    }
#pragma unroll
    for (int i = 0; i < kARows; ++i) {
      const bool ok = a[i] && bytes;
      cp_async16(a_dst(i), ok ? a[i] + k0 : p.lora_a, ok ? bytes : 0);
    }
  }
};

// Where one thread's expand copies of B come from: the rank chunk j8 (16 bytes) of columns r0, r0 + step, ... of
// each kBN-column step. The chunk belongs to one slice of the group (block-diagonal placement), so it is read only
// for that slice's columns [lo, hi): none when it lies past the slot's true rank or the group's slices.
template <class T, int RT, int kThreads, int kBN>
struct ExpandBSource {
  using Rows = Pieces<T, kBN, RT, kThreads>;
  static_assert(kBN % Rows::kRowStep == 0, "B rows split evenly");
  int j8, bytes;
  int64_t lo, hi;
  const T* src;

  __device__ ExpandBSource(const SgmvParams& p, const TileRef& tile, int rank_pad, int64_t s0, int64_t s1) {
    j8 = Rows::c();
    const int slice = j8 / rank_pad, j = j8 % rank_pad;
    const bool used = s0 + slice < s1 && j < tile.size;
    lo = used ? p.slice_offsets[s0 + slice] : 0;
    hi = used ? p.slice_offsets[s0 + slice + 1] : 0;
    src = static_cast<const T*>(p.lora_b) + tile.slot * p.b_stride0 + j;
    bytes = (int)std::min<int64_t>(8, tile.size - j) * 2;
  }

  // The copies of the columns [n0, n0 + kBN): row i (column n0 + r0 + i * step) to dst(i) (shared memory).
  template <class Dst>
  __device__ void load(const SgmvParams& p, int64_t n0, Dst dst) const {
#pragma unroll
    for (int i = 0; i < kBN / Rows::kRowStep; ++i) {
      const int64_t n = n0 + Rows::r0() + i * Rows::kRowStep;
      const bool ok = n >= lo && n < hi;
      cp_async16(dst(i), ok ? src + n * p.b_stride1 : p.lora_b, ok ? bytes : 0);
    }
  }
};

// How many clusters of `cluster` CTAs of kKernel (`threads` threads, `smem` bytes of dynamic shared memory, allowed
// already) the current device holds at once, over all its SMs (0 where the query fails, its error cleared), asked
// once per (kernel, device, cluster size).
template <auto kKernel>
int64_t resident_clusters(int threads, size_t smem, int64_t cluster) {
  static std::atomic<int64_t> known[kMaxCluster + 1][64];  // the count + 1: 0 is "not asked yet"
  int64_t value = 0;
  const cudaError_t err = ask_once_per_device(known[std::clamp<int64_t>(cluster, 1, kMaxCluster)],
                                              [&](int, int64_t* count_plus_one) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_launch_config(cluster, threads, cluster, smem, nullptr, &attr);
    int count = 0;
    const cudaError_t query = cudaOccupancyMaxActiveClusters(&count, kKernel, &cfg);
    *count_plus_one = (int64_t)count + 1;
    return query;
  }, &value);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value - 1;
}

// Narrows a plan's clusters, to the widest of at least 2 CTAs whose count holds the batch's whole tiles
// (ceil(P / tile_rows) per slice group) at once, where one does: a second wave of a few clusters costs a whole
// CTA's time, and any size up to 8 launches (cluster_async_sum_h shares any count). Measured on an H100 (session 57,
// T = 4096, 8 adapters, K = N = 4096): rank 128 in clusters of 8 ran 64 working tiles on 31 (mma.sync) or 62
// (wgmma) resident clusters, 90.9 / 89.1 us; in clusters of 2 / 4, one wave, 74.7 / 82.4; rank 64 72.0 / 70.1 ->
// 63.8 / 62.8 in clusters of 4. A plan already at 2 is left alone (T = 16384: one CTA a tile was slower than two
// waves of pairs).
template <auto kKernel>
void fit_one_wave(MmaPlan* plan, int64_t positions, int64_t tile_rows, int threads, size_t smem) {
  if (plan->cluster <= 2) return;
  const int64_t tiles = (positions + tile_rows - 1) / tile_rows * plan->groups;
  for (int64_t cluster = plan->cluster; cluster >= 2; --cluster) {
    if (resident_clusters<kKernel>(threads, smem, cluster) >= tiles) {
      plan->cluster = cluster;
      return;
    }
  }
}

// Launches a prefill kernel, kKernel(p, plan) (`threads` threads, `smem` bytes of dynamic shared memory), over the
// plan's tiles of `tile_rows` positions, its clusters as `choice` fixes them or else narrowed to one wave.
template <auto kKernel>
cudaError_t launch_prefill(const SgmvParams& p, MmaPlan plan, const SgmvPrefillChoice& choice, int64_t tile_rows,
                           int threads, size_t smem, cudaStream_t stream) {
  if (const cudaError_t err = allow_dynamic_smem((const void*)kKernel, smem); err != cudaSuccess) return err;
  plan.max_tiles = max_segment_tiles(p.seg, tile_rows);
  if (choice.cluster == 0) fit_one_wave<kKernel>(&plan, p.seg.positions, tile_rows, threads, smem);
  const int64_t blocks = plan.max_tiles * plan.groups * plan.cluster;
  if (blocks == 0) return cudaSuccess;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch_config(blocks, threads, plan.cluster, smem, stream, &attr);
  return cudaLaunchKernelEx(&cfg, kKernel, p, plan);
}

// Calls f(std::integral_constant<int, RT>{}) with the narrowest rank tile (16, 32, 64, 128) that holds `width`
// ranks: a slice group's slices times the padded rank.
template <class F>
auto with_rank_tile(int64_t width, F&& f) {
  if (width <= 16) return f(std::integral_constant<int, 16>{});
  if (width <= 32) return f(std::integral_constant<int, 32>{});
  if (width <= 64) return f(std::integral_constant<int, 64>{});
  return f(std::integral_constant<int, 128>{});
}

// Shared memory of cluster_async_sum_h: the receive rows ([members][share] float4s, share = ceil(kFrags / members))
// and every fragment's four sums as Out.
template <int kThreads, int kVecs, class Out>
constexpr size_t async_sum_bytes() {
  return (size_t)(kThreads * kVecs + kMaxCluster) * sizeof(float4) + (size_t)kThreads * kVecs * 4 * sizeof(Out);
}

// Sums the cluster's K-partials of h in member order (each of the CTA's kThreads threads holds kVecs float4s of its
// own fragments, h, 4 * kVecs floats), in place, with one cluster barrier and no load across DSMEM. Member m owns
// the m-th 1/C of the fragments. Each member's two mbarriers count the bytes it is to receive; after the barrier
// (every member's shrink has drained and its mbarriers are armed) each thread sends its fragments to their owner's
// receive rows with st.async, which completes the bytes on the owner's first mbarrier; each owner, once its rows
// have landed, sums its share over the rows in member order (0 + p_0 + p_1 + ...: bitwise what a plain loop over the
// members gives) and sends the sums to every member's second mbarrier. No thread waits for an acknowledgment, only
// for the bytes it receives (the pull form this replaces loaded ceil(share / kThreads) + 1 dependent rounds across
// DSMEM between three barriers: ~10.7 us of a rank-128 CTA in clusters of 7, csrc/cuda/NOTES.md, session 62).
// Out = float: the sums as they are; Out = a 16-bit T: scaled by coef and rounded to T by their owner (h then holds
// values of T exactly: a later scaling by 1 and rounding keeps them). Returns the coefficient h still needs: coef
// for Out = float, 1 for a 16-bit Out. `buffer` (shared, 16-byte aligned, free for the call, past anything the
// caller's copies may still write): async_sum_bytes. The relaxed cluster arrive at its end pairs with
// cluster_async_sum_done before the kernel exits (no member leaves while a send to it may be in flight). Every
// thread of every member calls both.
template <int kThreads, int kVecs, class Out>
__device__ inline float cluster_async_sum_h(unsigned char* buffer, float* h, float coef, int member, int members) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace ptx = ::cuda::ptx;
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int kFrags = kThreads * kVecs;
  static_assert(kFrags >= kMaxCluster * (kMaxCluster - 1), "every member's share starts inside the fragments");
  constexpr bool kRound = !std::is_same_v<Out, float>;
  using Sum = std::conditional_t<kRound, uint2, uint4>;  // a fragment's four sums
  __shared__ uint64_t landed[2];  // [0]: this member's share from every member; [1]: every fragment's sums
  const int tid = threadIdx.x, share = (kFrags + members - 1) / members;
  const int own_begin = member * share, own_end = std::min(kFrags, own_begin + share);
  float4* recv = reinterpret_cast<float4*>(buffer);
  Sum* sums = reinterpret_cast<Sum*>(recv + kFrags + kMaxCluster);
  if (tid == 0) {
    ptx::mbarrier_init(&landed[0], 1);
    ptx::mbarrier_init(&landed[1], 1);
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &landed[0],
                                   (uint32_t)((own_end - own_begin) * members * sizeof(float4)));
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &landed[1],
                                   (uint32_t)(kFrags * sizeof(Sum)));
  }
  // A relaxed arrive: with release semantics (cluster.sync()) ptxas puts MEMBAR.ALL.GPU before it, which waits for
  // every memory operation the thread has in flight (the early expand's loads among them) on the sum's critical
  // chain. Nothing needs it: the mbarrier inits are published by their own fence above, and every read of the bytes
  // the other members' sends overwrite (the shrink's stages) has returned before this thread gets here (its MMAs
  // consumed them; the wgmma kernel waited for its MMAs; the cp.async copies were drained before the
  // __syncthreads that ends the shrink).
  ptx::barrier_cluster_arrive(ptx::sem_relaxed);
  ptx::barrier_cluster_wait();
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int f = v * kThreads + tid, owner = f / share;
    const uint32_t part[4] = {__float_as_uint(h[4 * v]), __float_as_uint(h[4 * v + 1]), __float_as_uint(h[4 * v + 2]),
                              __float_as_uint(h[4 * v + 3])};
    ptx::st_async(reinterpret_cast<uint32_t*>(cluster.map_shared_rank(recv + member * share + (f - owner * share),
                                                                       (unsigned)owner)),
                  part, cluster.map_shared_rank(&landed[0], (unsigned)owner));
  }
  while (!ptx::mbarrier_try_wait_parity(ptx::sem_acquire, ptx::scope_cluster, &landed[0], 0u)) {
  }
  for (int f = own_begin + tid; f < own_end; f += kThreads) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int m = 0; m < kMaxCluster; ++m) {
      if (m < members) {
        const float4 part = recv[m * share + (f - own_begin)];
        sum = make_float4(sum.x + part.x, sum.y + part.y, sum.z + part.z, sum.w + part.w);
      }
    }
    uint32_t words[sizeof(Sum) / 4];
    if constexpr (kRound) {
      auto bits = [&](float v) { return (uint32_t)__builtin_bit_cast(uint16_t, from_f32<Out>(v * coef)); };
      words[0] = bits(sum.x) | bits(sum.y) << 16;
      words[1] = bits(sum.z) | bits(sum.w) << 16;
    } else {
      words[0] = __float_as_uint(sum.x), words[1] = __float_as_uint(sum.y);
      words[2] = __float_as_uint(sum.z), words[3] = __float_as_uint(sum.w);
    }
#pragma unroll
    for (int m = 0; m < kMaxCluster; ++m) {
      if (m < members) {
        ptx::st_async(reinterpret_cast<uint32_t*>(cluster.map_shared_rank(sums + f, (unsigned)m)), words,
                      cluster.map_shared_rank(&landed[1], (unsigned)m));
      }
    }
  }
  while (!ptx::mbarrier_try_wait_parity(ptx::sem_acquire, ptx::scope_cluster, &landed[1], 0u)) {
  }
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const Sum r = sums[v * kThreads + tid];
    if constexpr (kRound) {
      auto value = [](uint32_t b) { return to_f32(__builtin_bit_cast(Out, (uint16_t)b)); };
      h[4 * v] = value(r.x & 0xffff), h[4 * v + 1] = value(r.x >> 16);
      h[4 * v + 2] = value(r.y & 0xffff), h[4 * v + 3] = value(r.y >> 16);
    } else {
      h[4 * v] = __uint_as_float(r.x), h[4 * v + 1] = __uint_as_float(r.y);
      h[4 * v + 2] = __uint_as_float(r.z), h[4 * v + 3] = __uint_as_float(r.w);
    }
  }
  __syncthreads();  // every thread has its sums before the caller's copies reuse the buffer
  ptx::barrier_cluster_arrive(ptx::sem_relaxed);
  return kRound ? 1.f : coef;
#else
  __trap();  // clusters exist from sm_90 on; the host never plans one below
  return coef;
#endif
}

// The end of cluster_async_sum_h's cluster barrier: every member has received all it was sent.
__device__ inline void cluster_async_sum_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::barrier_cluster_wait();
#endif
}

}  // namespace lora_ops::cuda
