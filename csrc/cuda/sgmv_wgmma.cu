// sgmv, prefill regime, on sm_90a's warpgroup MMA (wgmma): the plan of sgmv_mma.cu (one tile of positions of one
// segment and slice group per cluster of C CTAs, K split for the shrink, the partial h summed in member order
// through distributed shared memory, the columns split for the expand), but each CTA is kWG warpgroups (64 of the
// tile's 64 * kWG positions each) whose MMAs read both shrink operands from shared memory and keep only the
// accumulators in registers:
//   shrink: h[64 kWG, RT] += X[64 kWG, 64] A[RT, 64]^T per K step (wgmma SS, fp32), X rows gathered through
//           token_indices;
//   expand: h, scaled and rounded to T once in registers, is the register A operand of y[64 kWG, 64] += h
//           B[64, RT]^T (wgmma RS; the accumulator's layout is the A operand's: no shuffle), y tiles through shared
//           memory.
// Why (csrc/cuda/NOTES.md, sessions 25-28): the mma.sync kernel at rank 128 holds its operand fragments in
// registers, 2 CTAs of 8 warps per SM, and ran 3 waves of its 512 CTAs at T=4096; this CTA (one warpgroup, ~51 KB)
// fits 4 per SM. Measured (H100, session 56): 4-5% faster at rank tiles of 64 and 128, a tie at 16, 8% slower on
// a 3-slice batch split into rank-16 groups: twice the CTAs per SM bought ~5% at rank 128, not the ~2x that the
// wave count predicted. With the one-wave rule (sessions 59-60) 1-20% faster at rank tiles of 64 and 128 from 3072
// positions, slower below: the automatic choice (kWgmmaMinRankTile, kWgmmaMinPositions, kernels.h). y of x's dtype
// only (a float32 y, whose h is split hi + lo, stays on sgmv_mma.cu).
// Tiles of 128 positions (kWG = 2, only at a rank tile of 128, from kWgmmaMinPositions on): the two warpgroups share
// every stage of A and B, so the A and B bytes a CTA stages per position halve (at rank 128 they are twice x's in
// the shrink and as many as y's in the expand), with half the tiles in flight, 2 CTAs an SM. Measured: 2-9% faster
// than one warpgroup from 3072 positions, not the ~20% that the bytes predicted (csrc/cuda/NOTES.md, session 60).
//
// Operands reach shared memory by cp.async (16 bytes a thread, zero-filled outside the tile, the rank or K) into
// the 128-byte-swizzled K-major layouts wgmma reads; each thread fences its copies into the async proxy before the
// barrier that publishes them.
#ifndef NDEBUG
#define NDEBUG  // see grouped_gemm_sm90.cu: CUTLASS's device asserts cost its kernels a stack frame
#endif
#include "kernels.h"
#include "sgmv_tile.cuh"

#if defined(LORA_OPS_GG_SM90)
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#endif

namespace lora_ops::cuda {

#if defined(LORA_OPS_GG_SM90)
namespace {

using cute::_64;
using cute::Int;
using cute::Shape;

constexpr int kBK = 64;        // K step of the shrink: one 128-byte swizzle row of X and A
constexpr int kBN = 64;        // columns per expand step
constexpr int kYPad = 8;       // elements of padding per row of the y tile (not read by wgmma)

template <class T>
using CuteType = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cute::bfloat16_t, cute::half_t>;

// kWG warpgroups, each the MMAs of 64 of the tile's 64 * kWG positions; they share every stage of A and B.
template <class T, int RT, int kStages, int kWG>
struct Wgmma {
  static constexpr int kRows = 64 * kWG, kThreads = 128 * kWG;
  using E = CuteType<T>;
  using Major = cute::GMMA::Major;
  using Warpgroups = cute::Layout<Shape<Int<kWG>, cute::_1, cute::_1>>;  // along the positions
  // Stage-indexed K-major layouts: X [kRows, 64], A [RT, 64], B [64 columns, RT].
  using LayoutX =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kRows>, _64, Int<kStages>>{}));
  using LayoutA =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<RT>, _64, Int<kStages>>{}));
  using LayoutB = decltype(cute::tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<Major::K, E, Int<kBN>, Int<RT>>(),
      Shape<Int<kBN>, Int<RT>, Int<kStages>>{}));
  using MmaShrink = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, Shape<_64, Int<RT>, Int<kBK>>, Major::K, Major::K>(), Warpgroups{}));
  using MmaExpand = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<E, E, float, Shape<_64, Int<kBN>, Int<RT>>, Major::K, Major::K>(), Warpgroups{}));

  // Shared memory (elements of T; X, A and B 1024-byte aligned: the swizzle's period, which wgmma's descriptors
  // assume; the y stages, read by plain loads, 16-byte aligned): the shrink's stages, then over the same bytes the
  // cluster sum's receive rows and rounded sums (cluster_async_sum_h) and, after them, the expand's B and y stages.
  static constexpr size_t kX = cute::cosize_v<LayoutX>, kA = cute::cosize_v<LayoutA>;
  static constexpr size_t kB = cute::cosize_v<LayoutB>, kY = (size_t)kStages * kRows * (kBN + kYPad);
  static constexpr size_t shrink_bytes = (kX + kA) * sizeof(T);
  static constexpr size_t expand_bytes = (kB + kY) * sizeof(T);
  static constexpr size_t sum_bytes = async_sum_bytes<kThreads, RT / 8, T>();  // RT / 2 floats a thread
  static constexpr size_t bytes = std::max({shrink_bytes, expand_bytes, sum_bytes}) + 1024;  // + alignment
  static_assert(sum_bytes <= std::max(shrink_bytes, expand_bytes), "the sum's buffers cost no CTA an SM");
  static_assert(kX * sizeof(T) % 1024 == 0 && kB * sizeof(T) % 1024 == 0, "buffers on the swizzle's period");
  // For the launch bounds: what shared memory allows, and at two warpgroups no more than 2 (128 registers).
  static constexpr int ctas_per_sm =
      std::min<int>(kWG == 1 ? 32 : 2, std::max<int>(1, (228 << 10) / (bytes + (1 << 10) + 640)));
};

// The A-operand view of an m64nRk16 accumulator (((2,2,R/8),1,1)) as wgmma RS reads it (((2,2,2),1,R/16)): for
// 16-bit operands the two layouts map each register to the same element, so this is a reshape (CUTLASS's
// mma_traits_sm90_gmma.hpp: CLayout_64xN and ALayout_64x16 agree).
template <class Layout>
__device__ auto accumulator_as_a(Layout acc) {
  auto pairs = cute::logical_divide(cute::get<0, 2>(acc), cute::Tile<cute::_2>{});
  return cute::make_layout(cute::make_layout(cute::get<0, 0>(acc), cute::get<0, 1>(acc), cute::get<0, 0>(pairs)),
                           cute::get<1>(acc),
                           cute::coalesce(cute::make_layout(cute::get<0, 1>(pairs), cute::get<2>(acc))));
}

template <class T, int RT, int kStages, int kWG>
__global__ void __launch_bounds__((Wgmma<T, RT, kStages, kWG>::kThreads), (Wgmma<T, RT, kStages, kWG>::ctas_per_sm))
    sgmv_wgmma_kernel(SgmvParams p, MmaPlan plan) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using W = Wgmma<T, RT, kStages, kWG>;
  using E = typename W::E;
  constexpr int kRows = W::kRows, kThreads = W::kThreads;
  using namespace cute;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int64_t s_rows[kRows];
  T* smem = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* y = static_cast<T*>(p.y);
  const int tid = threadIdx.x;
  const int64_t member = blockIdx.x % plan.cluster, unit = blockIdx.x / plan.cluster;
  const int64_t tile_idx = unit / plan.groups, group = unit % plan.groups;
  TileRef tile;
  if (!block_find_tile<kRows>(p.seg, p.num_slots, p.rows, tile_idx, &tile, s_rows, p.lora_ranks, p.max_rank)) {
    return;
  }
  const int rp = (int)plan.rank_pad;
  if (tile.size == 0) return;  // every member of the cluster sees the same tile: they leave together
  const float coef = p.scale * (p.lora_scales ? p.lora_scales[tile.slot] : 1.f);
  const int64_t s0 = group * plan.slices_per_group, s1 = std::min<int64_t>(p.num_slices, s0 + plan.slices_per_group);

  // ---------------- shrink: h = X A^T ----------------
  Tensor sX = make_tensor(make_smem_ptr(reinterpret_cast<E*>(smem)), typename W::LayoutX{});
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<E*>(smem + W::kX)), typename W::LayoutA{});
  const ShrinkSources<T, RT, kThreads, kBK, kRows> shrink_src(p, s_rows, tile, rp, s0, s1);
  using KRows = typename decltype(shrink_src)::Rows;
  auto load_shrink = [&](int st, int64_t k0) {
    shrink_src.load(p, k0, [&](int i) { return &sX(KRows::r0() + i * KRows::kRowStep, shrink_src.kc, st); },
                    [&](int i) { return &sA(KRows::r0() + i * KRows::kRowStep, shrink_src.kc, st); });
  };
  // A stage is ready for wgmma once every thread's copies into it have landed and been fenced into the async proxy.
  auto stage_ready = [] {
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  };
  typename W::MmaShrink mma_s;
  auto thr_s = mma_s.get_slice(tid);
  Tensor tXs = thr_s.partition_fragment_A(sX);  // (MMA, 1, kBK / 16, stages) descriptors
  Tensor tAs = thr_s.partition_fragment_B(sA);
  Tensor h = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<RT>>{});  // RT / 2 floats a thread
  // Cleared, not zeroed by the first MMA's scale: a member with no K step (33 steps over 8 members leave the last
  // none) adds zeros to the cluster's sum.
  clear(h);
  int64_t kt_begin, kt_end;
  split_range((p.k + kBK - 1) / kBK, plan.cluster, member, &kt_begin, &kt_end);
  const int k_tiles = (int)(kt_end - kt_begin);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < k_tiles) load_shrink(st, (kt_begin + st) * kBK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    stage_ready();  // and every thread's MMAs of step kt - 1 are done: its stage may be refilled
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_shrink(next % kStages, (kt_begin + next) * kBK);
    cp_async_commit();
    const int st = kt % kStages;
    warpgroup_fence_operand(h);
    warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < kBK / 16; ++kb) gemm(mma_s, tXs(_, _, kb, st), tAs(_, _, kb, st), h);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(h);
  }
  cp_async_wait<0>();
  __syncthreads();  // the shrink's buffers are drained: the sum's buffers and the expand's stages may take them

  // h -> the expand's A operand: scaled, rounded to T once (as sgmv_mma.cu does for a half-precision y); over a
  // cluster the sum's owners round it (h then holds values of T exactly: scaling by 1 and rounding keeps them).
  const float h_coef = plan.cluster > 1 ? cluster_async_sum_h<kThreads, RT / 8, T>(
                                              reinterpret_cast<unsigned char*>(smem), h.data(), coef, (int)member,
                                              (int)plan.cluster)
                                        : coef;
  Tensor h_a = make_tensor<E>(accumulator_as_a(h.layout()));
#pragma unroll
  for (int i = 0; i < size(h); ++i) h_a(i) = E(h(i) * h_coef);

  // ---------------- expand: y += h B^T over the group's columns ----------------
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<E*>(smem)), typename W::LayoutB{});
  T* y_stages = smem + W::kB;
  const int64_t c_begin = p.slice_offsets[s0], c_end = p.slice_offsets[s1];
  const ExpandBSource<T, RT, kThreads, kBN> b_src(p, tile, rp, s0, s1);
  using BRows = typename decltype(b_src)::Rows;
  using YRows = Pieces<T, kRows, kBN, kThreads>;
  static_assert(kRows % YRows::kRowStep == 0, "y rows split evenly");
  const int yc = YRows::c();
  auto y_row = [&](int i) -> T* {
    const int64_t row = s_rows[YRows::r0() + i * YRows::kRowStep];
    return row >= 0 ? y + row * p.y_row_stride + yc : nullptr;
  };
  auto ys = [&](int st) { return y_stages + st * kRows * (kBN + kYPad); };
  auto load_expand = [&](int st, int64_t n0) {
    b_src.load(p, n0, [&](int i) { return &sB(BRows::r0() + i * BRows::kRowStep, b_src.j8, st); });
    T* Y = ys(st) + YRows::r0() * (kBN + kYPad) + yc;
    const bool in = n0 + yc + 8 <= c_end;  // slices end on multiples of 8 columns: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < kRows / YRows::kRowStep; ++i) {
      T* row = in ? y_row(i) : nullptr;
      cp_async16(Y + i * YRows::kRowStep * (kBN + kYPad), row ? row + n0 : y, row ? 16 : 0);
    }
  };
  int64_t nt_begin, nt_end;
  split_range((c_end - c_begin + kBN - 1) / kBN, plan.cluster, member, &nt_begin, &nt_end);
  const int n_tiles = (int)(nt_end - nt_begin);
  const int64_t n_first = c_begin + nt_begin * kBN;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_tiles) load_expand(st, n_first + st * kBN);
    cp_async_commit();
  }
  typename W::MmaExpand mma_e;
  auto thr_e = mma_e.get_slice(tid);
  Tensor tBs = thr_e.partition_fragment_B(sB);  // (MMA, 1, RT / 16, stages) descriptors
  Tensor acc = partition_fragment_C(mma_e, Shape<Int<kRows>, Int<kBN>>{});
  Tensor acc_at = thr_e.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kBN>>{}));  // (row, column) of each
  for (int nt = 0; nt < n_tiles; ++nt) {
    stage_ready();
    const int next = nt + kStages - 1;
    if (next < n_tiles) load_expand(next % kStages, n_first + (int64_t)next * kBN);
    cp_async_commit();
    const int st = nt % kStages;
    mma_e.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(h_a);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < RT / 16; ++kb) {
      gemm(mma_e, h_a(_, _, kb), tBs(_, _, kb, st), acc);
      mma_e.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    // y tile += acc in shared memory (each element has one owner), then 16-byte stores of valid chunks.
    T* Y = ys(st);
#pragma unroll
    for (int i = 0; i < size(acc); ++i) {
      T& e = Y[get<0>(acc_at(i)) * (kBN + kYPad) + get<1>(acc_at(i))];
      e = from_f32<T>(to_f32(e) + acc(i));
    }
    __syncthreads();
    const int64_t n0 = n_first + (int64_t)nt * kBN;
    if (n0 + yc + 8 > c_end) continue;
    const T* src = Y + YRows::r0() * (kBN + kYPad) + yc;
#pragma unroll
    for (int i = 0; i < kRows / YRows::kRowStep; ++i) {
      if (T* row = y_row(i)) {
        const T* chunk = src + i * YRows::kRowStep * (kBN + kYPad);
        *reinterpret_cast<uint4*>(row + n0) = *reinterpret_cast<const uint4*>(chunk);
      }
    }
  }
  if (plan.cluster > 1) cluster_async_sum_done();
#else
  __trap();  // built for sm_90a only; the host launches it only there
#endif
}

template <class T, int RT, int kStages, int kWG>
cudaError_t launch_rt(const SgmvParams& p, const MmaPlan& plan, const SgmvPrefillChoice& choice, cudaStream_t stream) {
  using W = Wgmma<T, RT, kStages, kWG>;
  return launch_prefill<sgmv_wgmma_kernel<T, RT, kStages, kWG>>(p, plan, choice, W::kRows, W::kThreads, W::bytes,
                                                                 stream);
}

template <class T>
cudaError_t launch_typed(const SgmvParams& p, const MmaPlan& plan, int64_t width, const SgmvPrefillChoice& choice,
                         cudaStream_t stream) {
  return with_rank_tile(width, [&](auto rt) {
    constexpr int RT = decltype(rt)::value;
    if constexpr (RT == 128) {
      // 3 stages: two CTAs an SM by registers either way (~103 KB of shared memory each)
      if (choice.wgmma_rows == 0 ? p.seg.positions >= kWgmmaMinPositions : choice.wgmma_rows == 128) {
        return launch_rt<T, RT, 3, 2>(p, plan, choice, stream);
      }
    }
    return launch_rt<T, RT, RT == 128 ? 2 : 3, 1>(p, plan, choice, stream);  // 2 stages at 128: 4 CTAs an SM
  });
}

}  // namespace

bool sgmv_wgmma_supported(const SgmvParams& p, int cc_major, int cc_minor) {
  return cc_major == 9 && cc_minor == 0 && p.y_dtype == p.x_dtype;
}

cudaError_t launch_sgmv_wgmma(const SgmvParams& p, const MmaPlan& plan, const SgmvPrefillChoice& choice,
                              cudaStream_t stream) {
  const int64_t width = plan.slices_per_group * plan.rank_pad;
  return p.x_dtype == DType::BF16 ? launch_typed<__nv_bfloat16>(p, plan, width, choice, stream)
                                  : launch_typed<__half>(p, plan, width, choice, stream);
}

#else

bool sgmv_wgmma_supported(const SgmvParams&, int, int) { return false; }
cudaError_t launch_sgmv_wgmma(const SgmvParams&, const MmaPlan&, const SgmvPrefillChoice&, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace lora_ops::cuda
