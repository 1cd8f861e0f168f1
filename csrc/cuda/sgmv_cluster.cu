// sgmv, decode regime on Hopper (sm_90+), any dtype and alignment: ONE launch, no grid-wide barrier.
// One thread-block cluster of C CTAs per tile of <= 8 positions of one segment:
//   shrink: member m reduces its 1/C of K for every rank row of the tile's adapter. x rows and A rows stream
//           through shared memory in (256-element K chunk, 16 or 32 rank rows) stages, cp.async double-buffered;
//           float32 partials of h[8][S*rank] in shared memory, accumulated stage by stage in a fixed order.
//   cluster barrier; each member sums the C partials in member order through distributed shared memory
//           (deterministic) and applies the scale.
//   expand: member m updates its 1/C of the columns. The y rows and B's first 16 rank columns of its first
//           256-column pass are copied to shared memory (cp.async) before the shrink, so that their latency
//           overlaps it; further rank columns are prefetched to L2.
// Clusters are independent, so the grid (tile bound min(P, P/8 + G) x C) may exceed what is co-resident.
// A and B are read once per tile; x and y once.
#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kThreads = 128;  // at most 128 registers: >= 4 CTAs per SM
constexpr int kTileRows = 8;
constexpr int kChunk = 256;  // K elements per stage
constexpr int kVecs = kChunk / 8;
constexpr int kRankRows = 4;  // rank rows of one thread's accumulators
constexpr int kColsPerThread = 2;
constexpr int kColsPerPass = kThreads * kColsPerThread;
constexpr int64_t kMaxStagedRank = 16;  // B rank columns staged per pass (more cost occupancy: measured)
constexpr int kMaxCluster = 16;
constexpr size_t kMaxSmem = 200 * 1024;

// Eight elements into shared memory: cp.async when `vec` and all 8 are in bounds; zeros for a null source;
// otherwise element loads up to `valid`, zeros after.
template <class T>
__device__ __forceinline__ void stage8(T* dst, const T* src, bool vec, int64_t valid) {
  if (src != nullptr && vec && valid >= 8) {
#pragma unroll
    for (int i = 0; i < (int)(8 * sizeof(T) / 16); ++i) cp_async16(dst + i * 16 / sizeof(T), src + i * 16 / sizeof(T), 16);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = (src != nullptr && i < valid) ? src[i] : from_f32<T>(0.f);
}

template <class T, class TY>
__global__ void __launch_bounds__(kThreads, 4) sgmv_cluster_kernel(SgmvParams p, ClusterPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int64_t s_rows[kTileRows];
  __shared__ int64_t s_rank;
  __shared__ float s_coef;
  const T* x = static_cast<const T*>(p.x);
  const T* lora_a = static_cast<const T*>(p.lora_a);
  const T* lora_b = static_cast<const T*>(p.lora_b);
  TY* y = static_cast<TY*>(p.y);
  const int tid = threadIdx.x;
  const int64_t R = p.max_rank, SR = p.num_slices * R, C = plan.cluster;
  const int64_t member = blockIdx.x % C;

  // Tiles are counted whatever their slot's rank, so the walk needs no rank load; a rank-0 tile leaves below
  // (every member of the cluster sees the same tile and leaves together).
  Tile tile;
  if (!locate_tile(p.seg, p.num_slots, nullptr, nullptr, 1.f, R, kTileRows, blockIdx.x / C, &tile)) return;
  const int nrows = (int)(tile.end - tile.begin);
  if (tid < kTileRows) s_rows[tid] = tid < nrows ? segment_row(p.seg, tile.begin + tid, p.rows) : -1;
  if (tid == 32) {
    s_rank = slot_size(p.lora_ranks, tile.slot, R);
    s_coef = p.scale * (p.lora_scales ? p.lora_scales[tile.slot] : 1.f);
  }
  __syncthreads();
  const int64_t rank = s_rank, E = p.num_slices * rank;  // h columns, compact: e = slice * rank + j
  if (rank == 0) return;

  T* x_stage = reinterpret_cast<T*>(smem);                                 // [buffers][8][kChunk]
  T* a_stage = x_stage + plan.buffers * kTileRows * kChunk;                // [buffers][stage_rows][kChunk]
  const int b_pitch = (int)plan.staged_rank + 16 / (int)sizeof(T);         // padded: conflict-free rows
  T* b_stage = a_stage + plan.buffers * plan.stage_rows * kChunk;          // [kColsPerPass][b_pitch]
  TY* y_stage = reinterpret_cast<TY*>(b_stage + kColsPerPass * b_pitch);  // [8][kColsPerPass]
  float* part = reinterpret_cast<float*>(y_stage + kTileRows * kColsPerPass);  // [8][SR]
  float* h = part + kTileRows * SR;                                        // [8][SR]

  int64_t v_begin, v_end, n_begin, n_end;
  split_range((p.k + 7) / 8, C, member, &v_begin, &v_end);
  split_range((p.n + 7) / 8, C, member, &n_begin, &n_end);  // columns in groups of 8: 16-byte aligned y chunks
  const int64_t k_begin = v_begin * 8, k_end = std::min<int64_t>(p.k, v_end * 8);
  n_begin *= 8;
  n_end = std::min<int64_t>(p.n, n_end * 8);

  // ---- expand operands of a column pass: y rows and B's first staged_rank rank columns into shared memory.
  // The first pass is issued here, so that its latency overlaps the shrink.
  const T* b_slot = lora_b + tile.slot * p.b_stride0;
  const int64_t staged_rank = std::min<int64_t>(plan.staged_rank, (rank + 7) / 8 * 8);
  auto stage_expand = [&](int64_t n_base) {
    constexpr int kYPiece = 16 / sizeof(TY);
    const int b_pieces = (int)(staged_rank * sizeof(T) / 16);
    for (int i = tid; i < kColsPerPass * b_pieces; i += kThreads) {
      const int64_t n = n_base + i / b_pieces, j = (i % b_pieces) * (16 / sizeof(T));
      const int64_t valid = n < n_end ? std::clamp<int64_t>(rank - j, 0, 16 / sizeof(T)) : 0;
      T* dst = b_stage + (i / b_pieces) * b_pitch + j;
      const T* src = b_slot + n * p.b_stride1 + j;
      if (valid == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      } else if (plan.vec.b) {
        cp_async16(dst, src, (int)(valid * sizeof(T)));
      } else {
        for (int e = 0; e < (int)(16 / sizeof(T)); ++e) dst[e] = e < valid ? src[e] : from_f32<T>(0.f);
      }
    }
    for (int i = tid; i < kTileRows * (kColsPerPass / kYPiece); i += kThreads) {
      const int r = i / (kColsPerPass / kYPiece);
      const int64_t col = (i % (kColsPerPass / kYPiece)) * kYPiece, n = n_base + col, row = s_rows[r];
      const int64_t valid = row >= 0 ? std::clamp<int64_t>(n_end - n, 0, kYPiece) : 0;
      TY* dst = y_stage + r * kColsPerPass + col;
      const TY* src = y + row * p.y_row_stride + n;
      if (valid == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      } else if (plan.vec.y) {
        cp_async16(dst, src, (int)(valid * sizeof(TY)));
      } else {
        for (int e = 0; e < kYPiece; ++e) dst[e] = e < valid ? src[e] : from_f32<TY>(0.f);
      }
    }
    for (int64_t i = tid; i < kColsPerPass && staged_rank < rank; i += kThreads) {  // the rest of B: to L2
      for (int64_t j = staged_rank; n_base + i < n_end && j < rank; j += 128 / sizeof(T)) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(b_slot + (n_base + i) * p.b_stride1 + j));
      }
    }
    cp_async_commit();
  };
  stage_expand(n_begin);

  // ---- shrink ----
  for (int64_t i = tid; i < kTileRows * SR; i += kThreads) part[i] = 0.f;
  const int64_t e_blocks = (E + plan.stage_rows - 1) / plan.stage_rows;
  const int64_t stages = (k_end - k_begin + kChunk - 1) / kChunk * e_blocks;
  const T* a_slot = lora_a + tile.slot * p.a_stride0;
  auto issue_stage = [&](int64_t st) {
    if (st < stages) {
      const int64_t k0 = k_begin + (st / e_blocks) * kChunk, e0 = (st % e_blocks) * plan.stage_rows;
      T* xs = x_stage + (st % plan.buffers) * kTileRows * kChunk;
      T* as = a_stage + (st % plan.buffers) * plan.stage_rows * kChunk;
      for (int64_t i = tid; i < (kTileRows + plan.stage_rows) * kVecs; i += kThreads) {
        const int64_t row = i / kVecs, k = k0 + (i % kVecs) * 8;
        const int64_t valid = std::clamp<int64_t>(k_end - k, 0, 8);
        if (row < kTileRows) {
          const int64_t x_row = s_rows[row];
          stage8(xs + row * kChunk + (k - k0), x_row >= 0 ? x + x_row * p.x_row_stride + k : nullptr, plan.vec.x,
                 valid);
        } else {
          const int e = (int)(e0 + row - kTileRows);  // 32-bit: E <= S * R is small, and 64-bit division is slow
          stage8(as + (row - kTileRows) * kChunk + (k - k0),
                 e < E ? a_slot + ((e / (int)rank) * R + e % (int)rank) * p.a_stride1 + k : nullptr, plan.vec.a,
                 valid);
        }
      }
    }
    cp_async_commit();
  };
  // Thread layout of a stage: groups of kRankRows rank rows, `lanes` consecutive threads per group over K.
  const int groups = (int)plan.stage_rows / kRankRows, lanes = kThreads / groups;
  const int group = tid / lanes, lane = tid % lanes;
  for (int64_t st = 0; st < plan.buffers; ++st) issue_stage(st);
  for (int64_t st = 0; st < stages; ++st) {
    if (plan.buffers == 2) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* xs = x_stage + (st % plan.buffers) * kTileRows * kChunk;
    const T* as = a_stage + (st % plan.buffers) * plan.stage_rows * kChunk + group * kRankRows * kChunk;
    float acc[kTileRows][kRankRows] = {};
#pragma unroll 1
    for (int v = lane; v < kVecs; v += lanes) {
      Raw8<T> a[kRankRows];  // converted at use: fewer live registers
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) a[j] = *reinterpret_cast<const Raw8<T>*>(as + j * kChunk + v * 8);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (r >= nrows) break;
        const Raw8<T> xr = *reinterpret_cast<const Raw8<T>*>(xs + r * kChunk + v * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xv = to_f32(xr.v[e]);
#pragma unroll
          for (int j = 0; j < kRankRows; ++j) acc[r][j] = fmaf(xv, to_f32(a[j].v[e]), acc[r][j]);
        }
      }
    }
    // Fixed-order butterfly over the group's lanes; its first lane adds the stage into the partials.
    const int64_t e0 = (st % e_blocks) * plan.stage_rows + group * kRankRows;
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      if (r >= nrows) break;
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) {
        float v = acc[r][j];
        for (int d = lanes / 2; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        if (lane == 0 && e0 + j < E) part[r * SR + e0 + j] += v;
      }
    }
    __syncthreads();  // the buffer is refilled next
    issue_stage(st + plan.buffers);
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- cluster reduction of the partials, in member order ----
  cg::cluster_group cluster = cg::this_cluster();
  if (C > 1) cluster.sync();
  for (int i = tid; i < nrows * (int)E; i += kThreads) {
    const int off = (i / (int)E) * (int)SR + i % (int)E;
    float v = 0.f;
    for (int64_t m = 0; m < C; ++m) v += (C > 1 ? cluster.map_shared_rank(part, (unsigned)m) : part)[off];
    h[off] = v * s_coef;
  }
  __syncthreads();
  // Peers may still read this member's partials: signal that ours are read, wait for theirs before leaving.
  if (C > 1) asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");

  // ---- expand ----
  for (int64_t n_base = n_begin; n_base < n_end; n_base += kColsPerPass) {
    if (n_base != n_begin) {
      __syncthreads();  // the previous pass's staged operands are consumed
      stage_expand(n_base);
      cp_async_wait<0>();
      __syncthreads();
    }
#pragma unroll 1
    for (int c = 0; c < kColsPerThread; ++c) {
      const int col = c * kThreads + tid;
      const int64_t n = n_base + col;
      if (n >= n_end) continue;
      int64_t s = 0;
      while (s + 1 < p.num_slices && n >= p.slice_offsets[s + 1]) ++s;
      const float* hs = h + s * rank;
      float acc[kTileRows];
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) acc[r] = to_f32(y_stage[r * kColsPerPass + col]);
      for (int64_t j = 0; j < rank; j += 8) {
        float b[8];  // B's rank columns beyond `rank` are zero
        if (j < staged_rank) {
          load8(b_stage + col * b_pitch + j, true, 8, b);
        } else {
          load8(b_slot + n * p.b_stride1 + j, plan.vec.b, rank - j, b);
        }
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) {
          if (r >= nrows) break;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (j + e < rank) acc[r] = fmaf(hs[r * SR + j + e], b[e], acc[r]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = s_rows[r];
        if (row >= 0) y[row * p.y_row_stride + n] = from_f32<TY>(acc[r]);
      }
    }
  }
  if (C > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();  // clusters exist from sm_90 on; the host plans this kernel only there
#endif
}

size_t smem_bytes(const SgmvParams& p, const ClusterPlan& plan) {
  const size_t es = dtype_size(p.x_dtype), ey = dtype_size(p.y_dtype);
  return plan.buffers * (kTileRows + plan.stage_rows) * kChunk * es + kColsPerPass * (plan.staged_rank * es + 16) +
         kTileRows * kColsPerPass * ey + 2 * kTileRows * p.num_slices * p.max_rank * sizeof(float);
}

template <class F>
decltype(auto) with_kernel(const SgmvParams& p, F&& f) {
  return dispatch_dtype(p.x_dtype, [&](auto xt) {
    using T = typename ElemOf<decltype(xt)::value>::type;
    return p.y_dtype == DType::F32 ? f(sgmv_cluster_kernel<T, float>) : f(sgmv_cluster_kernel<T, T>);
  });
}

}  // namespace

bool plan_sgmv_cluster(const SgmvParams& p, int num_sms, int cc_major, ClusterPlan* out) {
  if (cc_major < 9) return false;
  ClusterPlan plan{};
  const int64_t P = p.seg.positions, SR = p.num_slices * p.max_rank;
  plan.max_tiles = std::min<int64_t>(P, (P + kTileRows - 1) / kTileRows + p.seg.num_segments);
  plan.stage_rows = SR <= 16 ? 16 : 32;
  plan.staged_rank = std::min<int64_t>((p.max_rank + 7) / 8 * 8, kMaxStagedRank);
  plan.vec = vec16_access(p);
  // The largest cluster that keeps >= 128 K elements per member and about 16 CTAs per SM at most.
  for (int64_t c = kMaxCluster; c >= 1; c /= 2) {
    plan.cluster = c;
    if (c > 1 && (plan.max_tiles * c > 16 * num_sms || p.k < 128 * c)) continue;
    const int64_t k_chunks = ((p.k + c - 1) / c + kChunk - 1) / kChunk;
    plan.buffers = k_chunks * ((SR + plan.stage_rows - 1) / plan.stage_rows) > 1 ? 2 : 1;
    const size_t smem = smem_bytes(p, plan);
    if (smem > kMaxSmem) return false;
    if (plan.max_tiles * c > INT32_MAX) return false;
    if (with_kernel(p, [&](auto kernel) { return cluster_fits((const void*)kernel, kThreads, c, smem); })) {
      *out = plan;
      return true;
    }
  }
  return false;
}

cudaError_t launch_sgmv_cluster(const SgmvParams& p, const ClusterPlan& plan, cudaStream_t stream) {
  return with_kernel(p, [&](auto kernel) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_launch_config(plan.max_tiles * plan.cluster, kThreads, plan.cluster,
                                                         smem_bytes(p, plan), stream, &attr);
    return cudaLaunchKernelEx(&cfg, kernel, p, plan);
  });
}

}  // namespace lora_ops::cuda
