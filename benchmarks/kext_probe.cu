// Issue 12's "expand as extra K blocks" design, as a probe (not part of lora_ops; benchmarks/kext_probe.py drives
// it). Per module, two launches instead of the fold route's GEMM + expand:
//   1. a shrink: h[t, j*L*R + s*R + r] = scale[s] * x[t] . A[s][j*R + r] where s is row t's slot, 0 for every other
//      slot (bf16), letting its dependents launch at its start. Two kinds:
//      - kext_shrink, on CUDA cores: a warp per rank row of a row of x, CTAs of 4 or 32 warps;
//      - kext_hgemm, on tensor cores: a CUTLASS GEMM over A_h (every slot's A rows in h's column order) whose
//        epilogue masks and scales, one CTA per 64 of those rows.
//   2. kext_gemm: y = [x | h_j] . [W | B]^T with W_ext = [W | B of every slot] ([N, K + L*R]; B's column s*R + r
//      holds lora_b[s, n, r]) on CUTLASS's sm_90 ping-pong kernel, launched programmatically: its producer loads
//      x's and W's K blocks at once (x was written before the shrink started) and calls griddepcontrol.wait only
//      before the first h block. The B blocks of slots no row uses (seg_indptr) are not read (see `skipped`).
// Session 27's bound for it (`kext` without a shrink, NOTES.md): llama3-8b T=32/1 +3.6%, the fold route +12.8%.
// What the probe measures: whether the shrink runs under the GEMM's W stream. A GEMM CTA (168 registers x 384
// threads) fits on no SM a shrink CTA holds, so the overlap comes from SMs without shrink CTAs: the probe says how
// much survives.
//
// Build (sm_90a; CUTLASS headers from the nvidia-cutlass wheel, as setup.py finds them):
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
//     -isystem $(python3 -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')/source/include \
//     benchmarks/kext_probe.cu -o build/kext_probe.so
#ifndef NDEBUG
#define NDEBUG
#endif
// CUTLASS's GDC waits stay empty: with them the kernel's producer would wait for the shrink before its x blocks,
// and the overlap this probe measures would silently disappear (KextMainloop::load waits where it should).
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
#error "kext_probe.cu must be built without CUTLASS_ENABLE_GDC_FOR_SM90"
#endif
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace kext {
using namespace cute;

constexpr int kMaxSlices = 4;
constexpr int kMaxSlots = 64;

// A 16-byte load through the non-coherent path that ptxas keeps in program order with the other ones.
__device__ __forceinline__ uint4 load_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One warp per task (t, j, r): it dots row t of x with rank row r of slice j of its slot's A, over all of K, and
// writes that rank of every slot's window (its own the value, the others 0). Each lane keeps kBatch 16-byte chunks
// of x and of A in flight, then does their FMAs: the loads are not predicated (a chunk past the row reads its last
// one again, then counts as zero), and the FMAs depend on all of them (below). Without that, with __ldg, volatile
// asm loads or empty asm fences alike, ptxas issued each pair of loads just before its FMAs, ~2 chunks in flight
// (the SASS of session 29's first two runs). kWarps per CTA: 4 spreads the shrink over every SM, where no GEMM CTA
// (the whole register file) can start beside it (PDL gained 2 points); 32 packs it into few SMs and leaves the
// others to the GEMM's x blocks (session 30: the narrow shrink beat the fold route at T <= 64). Session 29's K split
// over 4 warps and session 30's warp per 4 rank rows sharing x's loads lost on every step (sessions 30-31).
template <int kWarps, int kBatch>
__global__ void __launch_bounds__(kWarps * 32) shrink_kernel(const __nv_bfloat16* x, int64_t x_stride,
                                                            const __nv_bfloat16* lora_a, const int32_t* token_slot,
                                                            const float* scales, __nv_bfloat16* h, int T, int K,
                                                            int S, int R, int L, uint32_t opaque_zero) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int task = blockIdx.x * kWarps + warp;
  const int r = task % R, j = task / R % S, t = task / (R * S);
  if (t >= T) return;
  const int slot = token_slot[t];
  const bool has_slot = slot >= 0 && slot < L;
  const int chunks = K / 8;  // 16-byte chunks of a row
  float sum = 0.f;
  if (has_slot) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + t * x_stride);
    const uint4* ar = reinterpret_cast<const uint4*>(lora_a + ((int64_t)slot * S * R + j * R + r) * K);
    for (int c0 = lane; c0 < chunks; c0 += 32 * kBatch) {
      uint4 xv[kBatch], av[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = min(c0 + 32 * i, chunks - 1);
        xv[i] = load_nc(xr + c);
        av[i] = load_nc(ar + c);
      }
      // Every FMA depends on every load of the batch (x's chunks take `joined & opaque_zero`: an argument, always 0,
      // that the compilers cannot know), so ptxas cannot sink a load between the FMAs. (Session 29's `if (L < 0 &&
      // joined == 1)` let it in the 4-row kernel, which then waited for its first chunk before loading the next;
      // a zero from an asm `mov` is folded by ptxas.)
      uint32_t joined = 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) joined ^= xv[i].x ^ av[i].x;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (c0 + 32 * i >= chunks) xv[i] = make_uint4(0, 0, 0, 0);
        xv[i].x ^= joined & opaque_zero;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv[i]);
        const __nv_bfloat162* ap = reinterpret_cast<const __nv_bfloat162*>(&av[i]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 xf = __bfloat1622float2(xp[e]), af = __bfloat1622float2(ap[e]);
          sum = fmaf(xf.x, af.x, fmaf(xf.y, af.y, sum));
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __nv_bfloat16* row = h + (int64_t)t * S * L * R + (int64_t)j * L * R + r;
  for (int s = lane; s < L; s += 32) row[s * R] = __float2bfloat16(s == slot ? sum * scales[slot] : 0.f);
}

// CUTLASS's TMA warp-specialized mainloop with a second B operand (h) for the K blocks past x's: see the top.
// kMaskFromTokens: the slot mask from the rows' slots (token_slot, as the shrink reads them) instead of build_segments'
// seg_indptr, so that no seg_indptr that disagrees with token_slot can make the GEMM skip a block h needs (what a
// library op must guarantee); up to kMaxMaskTokens rows.
constexpr int kMaxMaskTokens = 128;

template <class Base, bool kMaskFromTokens = false>
struct KextMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::InternalElementA;
  using typename Base::InternalElementB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kBlockK = size<2>(TileShape{});
  static_assert(size(ClusterShape{}) == 1, "the probe's loads are not multicast");

  struct Arguments {
    ElementA const* ptr_A;  // W_ext [M, K + L*R]
    StrideA dA;
    ElementB const* ptr_B;  // x [N, k_x]
    StrideB dB;
    uint32_t mma_promotion_interval = 4;
    ElementB const* ptr_H;  // h [N, num_slices * L*R]: slice j's L*R columns (L = num_slots, R = rank) at j * L*R
    StrideB dH;
    int k_x = 0, num_slices = 1;
    int slice_end[kMaxSlices] = {};  // W rows where each slice ends (multiples of kBlockM)
    const int32_t* seg_indptr = nullptr;
    int rank = 1, num_slots = 0;
    const int32_t* token_slot = nullptr;  // kMaskFromTokens: [num_tokens]
    int num_tokens = 0;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_B tma_load_h;
    int h_cols = 0, k_x_tiles = 0, slice_h_tiles = 0, num_slices = 1;
    int slice_end[kMaxSlices] = {};
    const int32_t* seg_indptr = nullptr;
    int rank = 1, num_slots = 0;
    const int32_t* token_slot = nullptr;
    int num_tokens = 0;
  };

  // One slice's columns of h, and of W_ext past K: a window of R per slot.
  static int slice_h_cols(Arguments const& args) { return args.num_slots * args.rank; }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Params p;
    Tensor tensor_a = make_tensor(reinterpret_cast<InternalElementA const*>(args.ptr_A),
                                  make_layout(make_shape(M, K, L), args.dA));
    Tensor tensor_x = make_tensor(reinterpret_cast<InternalElementB const*>(args.ptr_B),
                                  make_layout(make_shape(N, args.k_x, L), args.dB));
    Tensor tensor_h = make_tensor(reinterpret_cast<InternalElementB const*>(args.ptr_H),
                                  make_layout(make_shape(N, slice_h_cols(args) * args.num_slices, L), args.dH));
    p.tma_load_a = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, Int<0>{}), TileShape{},
                                        ClusterShape{});
    p.tma_load_b = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_x, SmemLayoutB{}(_, _, Int<0>{}), TileShape{},
                                        ClusterShape{});
    p.tma_load_h = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_h, SmemLayoutB{}(_, _, Int<0>{}), TileShape{},
                                        ClusterShape{});
    p.tma_transaction_bytes = Base::TmaTransactionBytes;
    p.tma_transaction_bytes_mk = Base::TmaTransactionBytesMK;
    p.tma_transaction_bytes_nk = Base::TmaTransactionBytesNK;
    p.h_cols = slice_h_cols(args) * args.num_slices;
    p.k_x_tiles = args.k_x / kBlockK;
    p.slice_h_tiles = slice_h_cols(args) / kBlockK;
    p.num_slices = args.num_slices;
    for (int i = 0; i < kMaxSlices; ++i) p.slice_end[i] = args.slice_end[i];
    p.seg_indptr = args.seg_indptr;
    p.rank = args.rank;
    p.num_slots = args.num_slots;
    p.token_slot = args.token_slot;
    p.num_tokens = args.num_tokens;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    typename Base::Arguments base{args.ptr_A, args.dA, args.ptr_B, args.dB, args.mma_promotion_interval};
    return Base::can_implement(problem_shape, base) && args.k_x > 0 && args.k_x % kBlockK == 0 &&
           slice_h_cols(args) % kBlockK == 0 && K == args.k_x + slice_h_cols(args) && args.num_slices >= 1 &&
           args.num_slices <= kMaxSlices && args.num_slots <= kMaxSlots &&
           args.k_x / kBlockK >= Base::DispatchPolicy::Stages &&  // see skipped(): every stage holds a W tile first
           (kMaskFromTokens ? args.token_slot != nullptr && args.num_tokens <= kMaxMaskTokens
                            : args.seg_indptr != nullptr) &&
           args.rank >= 1;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    Base::prefetch_tma_descriptors(p);
    cute::prefetch_tma_descriptor(p.tma_load_h.get_tma_descriptor());
  }

  // (W tiles, x tiles, h tiles); x's tensor spans the whole K for the kernel's count, its loads stop at k_x.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA = p.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mB = p.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor mH = p.tma_load_h.get_tma_tensor(make_shape(N, p.h_cols, L));
    return cute::make_tuple(local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{}),
                            local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{}),
                            local_tile(mH, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{}));
  }

  // The slots some row uses, from build_segments' seg_indptr (written before the shrink started, so readable before
  // the wait): lane i of the producer warp loads slots i's and i + 32's bounds, a ballot makes the mask. The loads
  // are issued once per CTA, before the x blocks, and balloted after them (a first version had one thread load all
  // 33 entries before every tile's first TMA: five dependent trips per tile, +28% for the GEMM alone at T=32).
  // With kMaskFromTokens, lane i loads rows i, i + 32, ... of token_slot instead, and the warp ORs their slot bits
  // (a slot outside [0, num_slots) marks nothing: the shrink writes such a row's h as zeros).
  struct SlotBounds {
    int32_t lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0;
  };
  struct TokenSlots {
    int32_t slot[kMaxMaskTokens / 32] = {-1, -1, -1, -1};
  };
  using MaskLoads = cute::conditional_t<kMaskFromTokens, TokenSlots, SlotBounds>;
  CUTLASS_DEVICE MaskLoads load_slot_bounds(Params const& p) const {
    MaskLoads b;
    if (have_used_) return b;
    const int lane = threadIdx.x % 32;
    if constexpr (kMaskFromTokens) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kMaxMaskTokens / 32; ++i) {
        if (lane + 32 * i < p.num_tokens) b.slot[i] = __ldg(p.token_slot + lane + 32 * i);
      }
    } else {
      if (lane < p.num_slots) b.lo0 = __ldg(p.seg_indptr + lane), b.hi0 = __ldg(p.seg_indptr + lane + 1);
      if (lane + 32 < p.num_slots) b.lo1 = __ldg(p.seg_indptr + lane + 32), b.hi1 = __ldg(p.seg_indptr + lane + 33);
    }
    return b;
  }
  CUTLASS_DEVICE void settle_used(Params const& p, MaskLoads const& b) {  // warp-wide
    if (have_used_) return;
    if constexpr (kMaskFromTokens) {
      uint64_t bits = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kMaxMaskTokens / 32; ++i) {
        if (b.slot[i] >= 0 && b.slot[i] < p.num_slots) bits |= uint64_t(1) << b.slot[i];
      }
      used_ = uint64_t(__reduce_or_sync(0xffffffffu, uint32_t(bits))) |
              uint64_t(__reduce_or_sync(0xffffffffu, uint32_t(bits >> 32))) << 32;
    } else {
      used_ = uint64_t(__ballot_sync(0xffffffffu, b.hi0 > b.lo0)) |
              uint64_t(__ballot_sync(0xffffffffu, b.hi1 > b.lo1)) << 32;
    }
    have_used_ = true;
  }
  // An h block whose slots no row uses: its W_ext box is not read (the stage's barrier is told those bytes arrived),
  // its h box is (zero there for every row: both shrinks write every slot's window), and CUTLASS's consumer loop
  // multiplies it with whatever W tile the stage held before (weights: finite; can_implement asks for at least as
  // many x blocks as stages, so no stage is read before a W tile was written to it). Two variants that read neither box
  // measured slower, even with every slot used (NOTES.md, session 30): a consumer loop of our own that released such
  // stages without an MMA, and both boxes placed past the tensors' ends for TMA to zero-fill.
  CUTLASS_DEVICE bool skipped(Params const& p, int kt) const {
    const int first = (kt - p.k_x_tiles) * kBlockK / p.rank, last = ((kt - p.k_x_tiles + 1) * kBlockK - 1) / p.rank;
    const uint64_t window = (last >= 63 ? ~uint64_t(0) : (uint64_t(2) << last) - 1) & ~((uint64_t(1) << first) - 1);
    return (used_ & window) == 0;
  }

  template <class TensorA, class TensorB, class TensorH, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorH> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator, int k_tile_count, int, uint32_t, TensorStorage& shared_tensors) {
    const MaskLoads bounds = load_slot_bounds(p);
    const bool elected = cute::elect_one_sync();
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto tma_a = p.tma_load_a.get_slice(0);
    auto tma_b = p.tma_load_b.get_slice(0);
    auto tma_h = p.tma_load_h.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = tma_b.partition_D(sB);
    Tensor tHgH = tma_h.partition_S(get<2>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tHsH = tma_h.partition_D(sB);

    const int row0 = int(m_coord) * kBlockM;
    int slice = 0;
    while (slice + 1 < p.num_slices && row0 >= p.slice_end[slice]) ++slice;
    const int h_tile0 = slice * p.slice_h_tiles;

    auto issue = [&](int kt, bool h_block, bool w_needed) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      if (w_needed) copy(p.tma_load_a.with(*barrier, 0), tAgA(_, _, _, kt), tAsA(_, _, _, stage));
      else cutlass::arch::ClusterTransactionBarrier::complete_transaction(barrier, 0, Base::TmaTransactionBytesMK);
      if (!h_block) {
        copy(p.tma_load_b.with(*barrier, 0), tBgB(_, _, _, kt), tBsB(_, _, _, stage));
      } else {
        copy(p.tma_load_h.with(*barrier, 0), tHgH(_, _, _, h_tile0 + kt - p.k_x_tiles), tHsH(_, _, _, stage));
      }
      ++smem_pipe_write;
    };
    const int x_tiles = k_tile_count < p.k_x_tiles ? k_tile_count : p.k_x_tiles;
    if (elected) {
      for (int kt = 0; kt < x_tiles; ++kt) issue(kt, false, true);
    }
    __syncwarp();
    settle_used(p, bounds);
    if (!elected) return;
    if (x_tiles < k_tile_count) asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int kt = x_tiles; kt < k_tile_count; ++kt) issue(kt, true, !skipped(p, kt));
  }


 private:
  uint64_t used_ = 0;  // the slots some row uses, once per CTA
  bool have_used_ = false;
};

template <int kTokens, bool kMaskFromTokens = false>
struct KextGemm {
  using T = cutlass::bfloat16_t;
  using Tile = Shape<_64, Int<kTokens>, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Mainloop = KextMainloop<BaseMainloop, kMaskFromTokens>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// CUTLASS's host checks, then the launch (programmatic where pdl): 0, or where it failed.
template <class G>
int launch(typename G::Device::Arguments args, int pdl, cudaStream_t stream) {
  using Kernel = typename G::Kernel;
  static cutlass::KernelHardwareInfo hw{};  // device 0's SMs: the probe runs on one GPU
  if (hw.sm_count == 0) hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0);
  args.hw_info = hw;
  if (!Kernel::can_implement(args) || G::Device::get_workspace_size(args) != 0) return 2;
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Kernel::SharedStorageSize) != cudaSuccess) {
    return 3;
  }
  if (G::Device::run(params, stream, nullptr, pdl != 0) != cutlass::Status::kSuccess) return 4;
  return cudaGetLastError() == cudaSuccess ? 0 : 5;
}

template <class G>
int run_gemm(const void* x, int64_t x_stride, const void* h, const void* w_ext, void* y, int T, int N, int K, int S,
             const int* slice_end, const int32_t* seg_indptr, const int32_t* token_slot, int R, int L, int pdl,
             cudaStream_t stream) {
  using Kernel = typename G::Kernel;
  const int LR = L * R;  // W_ext's columns past K, and one slice's of h
  using E = typename G::T;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(N, T, K + LR, 1);
  args.mainloop.ptr_A = static_cast<const E*>(w_ext);
  args.mainloop.dA = typename Kernel::StrideA{int64_t(K + LR), Int<1>{}, int64_t(0)};
  args.mainloop.ptr_B = static_cast<const E*>(x);
  args.mainloop.dB = typename Kernel::StrideB{x_stride, Int<1>{}, int64_t(0)};
  args.mainloop.ptr_H = static_cast<const E*>(h);
  args.mainloop.dH = typename Kernel::StrideB{int64_t(S) * LR, Int<1>{}, int64_t(0)};
  args.mainloop.k_x = K;
  args.mainloop.num_slices = S;
  if (S < 1 || S > kMaxSlices || x_stride % 8 != 0) return 1;  // 16-byte rows for TMA and the shrink's loads
  for (int i = 0; i < S; ++i) args.mainloop.slice_end[i] = slice_end[i];
  args.mainloop.seg_indptr = seg_indptr;
  args.mainloop.rank = R;
  args.mainloop.num_slots = L;
  args.mainloop.token_slot = token_slot;
  args.mainloop.num_tokens = T;
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename Kernel::StrideC{Int<1>{}, int64_t(N), int64_t(0)};
  args.epilogue.ptr_D = static_cast<E*>(y);
  args.epilogue.dD = typename Kernel::StrideD{Int<1>{}, int64_t(N), int64_t(0)};
  for (int i = 0; i < S; ++i) {
    if (slice_end[i] % 64 != 0) return 1;
  }
  return launch<G>(args, pdl, stream);
}

// h = x . A_h^T on tensor cores, masked and scaled in the epilogue (the shrink of `kext-tc`). A_h holds every
// slot's A rows in h's column order (slice-major: row j*L*R + s*R + r is A[s][j*R + r]), so h [T, S*L*R] is the
// GEMM's D, column-major: M = A_h's rows, N = tokens. Its epilogue keeps an element only where the token's slot is
// the row's and scales it there: h[t, m] = row_slot[m] == token_slot[t] ? scale[m] * acc : 0.
template <class T>
struct MaskScale {
  CUTLASS_HOST_DEVICE T operator()(T acc, T row_slot, T token_slot, T scale) const {
    return row_slot == token_slot ? acc * scale : T(0);
  }
};
template <class T, int N>
struct MaskScale<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& acc,
                                                      cutlass::Array<T, N> const& row_slot,
                                                      cutlass::Array<T, N> const& token_slot,
                                                      cutlass::Array<T, N> const& scale) const {
    cutlass::Array<T, N> out;
    MaskScale<T> op;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = op(acc[i], row_slot[i], token_slot[i], scale[i]);
    return out;
  }
};

// CUTLASS's mainloop, with the launch of the dependent GEMM allowed from the first load: the kext GEMM's CTAs then
// start on the SMs the h tiles leave free and stream x . W while h is computed.
template <class Base>
struct TriggeringMainloop : Base {
  template <class... Args>
  CUTLASS_DEVICE void load(Args&&... args) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    Base::load(static_cast<Args&&>(args)...);
  }
};

template <int kTokens>
struct HGemm {
  using T = cutlass::bfloat16_t;
  using Tile = Shape<_64, Int<kTokens>, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using RoundStyle = cutlass::FloatRoundStyle;
  static constexpr RoundStyle kRound = RoundStyle::round_to_nearest;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<MaskScale, T, float, kRound>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, float>,     // row_slot[m]
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, int32_t, float>,  // token_slot[t]
      cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, float>>;    // scale[m]
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, TriggeringMainloop<BaseMainloop>,
                                                      Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class G>
int run_hgemm(const void* x, int64_t x_stride, const void* a_h, const float* row_slot, const float* row_scale,
              const int32_t* token_slot, void* h, int T, int K, int M, cudaStream_t stream) {
  using Kernel = typename G::Kernel;
  using E = typename G::T;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(M, T, K, 1);
  args.mainloop.ptr_A = static_cast<const E*>(a_h);
  args.mainloop.dA = typename Kernel::StrideA{int64_t(K), Int<1>{}, int64_t(0)};
  args.mainloop.ptr_B = static_cast<const E*>(x);
  args.mainloop.dB = typename Kernel::StrideB{x_stride, Int<1>{}, int64_t(0)};
  args.epilogue.thread = {{}, {row_slot}, {token_slot}, {row_scale}, {}};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename Kernel::StrideC{Int<1>{}, int64_t(M), int64_t(0)};
  args.epilogue.ptr_D = static_cast<E*>(h);
  args.epilogue.dD = typename Kernel::StrideD{Int<1>{}, int64_t(M), int64_t(0)};
  return launch<G>(args, 0, stream);
}

}  // namespace kext

extern "C" {

int kext_shrink(const void* x, int64_t x_stride, const void* lora_a, const int32_t* token_slot, const float* scales,
                void* h, int T, int K, int S, int R, int L, int warps, cudaStream_t stream) {
  if (K % 8 != 0 || T <= 0 || x_stride % 8 != 0) return 1;
  const int64_t tasks = int64_t(T) * S * R;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* ab = static_cast<const __nv_bfloat16*>(lora_a);
  auto* hb = static_cast<__nv_bfloat16*>(h);
  auto launch = [&](auto kernel, int kernel_warps) {
    kernel<<<unsigned((tasks + kernel_warps - 1) / kernel_warps), kernel_warps * 32, 0, stream>>>(
        xb, x_stride, ab, token_slot, scales, hb, T, K, S, R, L, 0u);
  };
  // chunks in flight per lane (kBatch) as the registers allow: 64 per thread in CTAs of 32 warps
  if (warps == 4) launch(kext::shrink_kernel<4, 8>, 4);
  else if (warps == 32) launch(kext::shrink_kernel<32, 4>, 32);
  else return 1;
  return cudaGetLastError() == cudaSuccess ? 0 : 5;
}

// h [T, M] = the masked, scaled x [T, K] . a_h [M, K]^T (run_hgemm), launched in stream order.
int kext_hgemm(const void* x, int64_t x_stride, const void* a_h, const float* row_slot, const float* row_scale,
               const int32_t* token_slot, void* h, int T, int K, int M, cudaStream_t stream) {
  if (x_stride % 8 != 0 || K % 64 != 0 || M % 64 != 0) return 1;
  auto run = [&](auto gemm) {
    return kext::run_hgemm<decltype(gemm)>(x, x_stride, a_h, row_slot, row_scale, token_slot, h, T, K, M, stream);
  };
  if (T <= 16) return run(kext::HGemm<16>{});
  if (T <= 32) return run(kext::HGemm<32>{});
  if (T <= 64) return run(kext::HGemm<64>{});
  if (T <= 128) return run(kext::HGemm<128>{});
  return 6;
}

// y [T, N] = x [T, K] . W_ext[:, :K]^T + h_j . W_ext[:, K:]^T (h_j: the L*R columns of each row's slice j of h).
// The slot mask from token_slot where it is given (KextMainloop's kMaskFromTokens), else from seg_indptr.
int kext_gemm(const void* x, int64_t x_stride, const void* h, const void* w_ext, void* y, int T, int N, int K, int S,
              const int* slice_end, const int32_t* seg_indptr, const int32_t* token_slot, int R, int L, int pdl,
              cudaStream_t stream) {
  auto run = [&](auto gemm) {
    return kext::run_gemm<decltype(gemm)>(x, x_stride, h, w_ext, y, T, N, K, S, slice_end, seg_indptr, token_slot,
                                          R, L, pdl, stream);
  };
  auto by_tokens = [&](auto from_tokens) {
    constexpr bool kFromTokens = decltype(from_tokens)::value;
    if (T <= 16) return run(kext::KextGemm<16, kFromTokens>{});
    if (T <= 32) return run(kext::KextGemm<32, kFromTokens>{});
    if (T <= 64) return run(kext::KextGemm<64, kFromTokens>{});
    // fold_linear's 64 x 128 tile lost to cuBLAS (NOTES, session 22)
    if (T <= 128) return run(kext::KextGemm<128, kFromTokens>{});
    return 6;
  };
  return token_slot ? by_tokens(std::true_type{}) : by_tokens(std::false_type{});
}

}  // extern "C"
