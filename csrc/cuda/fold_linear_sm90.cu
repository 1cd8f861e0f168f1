// fold_linear on sm_90a: the fold route's GEMM y = x . W^T (W = [base weight; A of every slot]) at decode sizes,
// on a CUTLASS 3.x warp-specialized kernel (TMA + wgmma, persistent CTAs) built with CUTLASS_ENABLE_GDC_FOR_SM90:
// each CTA triggers its programmatic dependents after its last mainloop, so the lora_expand launched next (with
// programmatic stream serialization, waiting before it reads h) is resident and past its set-up when the GEMM
// ends. cuBLAS's kernels do not trigger early, so after them the expand's launch and set-up are serial
// (csrc/cuda/NOTES.md, session 18: a llama3-8b decode step at T=32, 32 adapters +26.6% -> +24.1% with this kernel).
//
// Mapping, as cuBLAS's kernels for these shapes: W's rows are the GEMM's M (A = W [N, K], K-major), the tokens its
// N (B = x [T, K], K-major), D = y^T (y [T, N] contiguous is D column-major). Tiles: 64 W rows x 32 tokens,
// ping-pong (the probe's fastest at 32 tokens), 64 x 16 up to 16 tokens (the 32-token tile made a llama3-8b step's
// fold GEMMs at rank 64, 4 tokens, 10% slower than cuBLAS's, the 16-token one 2%; the step at rank 16, 4 tokens:
// +23.4% with cuBLAS, +21.4% with it; NOTES.md session 19), and 64 x 64 past 32 (W read once per 64 tokens;
// automatic up to 64, beyond only where forced with LORA_OPS_CUDA_LINEAR_KERNEL=cutlass: each 64-token column of
// tiles reads W again). Clusters of 2 along M (x multicast to both CTAs), or of one CTA (dispatch). No split-K
// (CUTLASS 4.2's stream-K scheduler does not compile with GDC), so the sum over K is one CTA's, in order:
// deterministic. fp16 and bf16, float accumulation.
//
// Given the step's seg_indptr, the kernel skips the slots no row uses: their A rows are most of what the fold route
// reads beyond the base weight when few adapters are present (llama3-8b, 1 adapter in a 32-slot pool: 9.5% of the
// base step's bytes, against 0.6% for the one adapter). CUTLASS's persistent scheduler walks the tiles as before;
// SlotSkippingScheduler passes over the clusters of tiles whose rows all lie in unused slots' windows, so the CTAs
// read nothing of them, and those columns of y are left unwritten (H200, that step at T=32: +22.4 -> +17.5%, with
// every slot used unchanged; NOTES.md session 20).
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's device asserts cost the kernels an ABI call and spills (grouped_gemm_sm90.cu)
#endif
#define CUTLASS_ENABLE_GDC_FOR_SM90
#include "common.cuh"
#include "kernels.h"

#if defined(LORA_OPS_GG_SM90)
#include "cutlass_run.cuh"
#endif

#include <climits>

#if defined(LORA_OPS_GG_SM90)
namespace lora_ops::cuda::fold {

// W's rows past base_rows: num_slots windows of slot_rows rows, slot s's unused where seg_indptr[s + 1] <=
// seg_indptr[s] (build_segments' seg_indptr: no row on slot s). A null seg_indptr: every row is used.
struct SlotWindows {
  const int32_t* seg_indptr = nullptr;
  int32_t base_rows = 0, slot_rows = 1, num_slots = 0;
};

struct SlotSkipping {};  // the scheduler's tag for GemmUniversal

// CUTLASS's persistent data-parallel scheduler (PersistentTileSchedulerSm90) over the tiles some row needs: each
// CTA walks its linear tile indices as the base does (a grid's stride apart) and passes over those whose cluster's
// W rows all lie in unused slots' windows. Every role of the ping-pong kernel (the producer, both consumers, which
// take every other tile, and the epilogue) walks the same sequence, so their pipeline states stay in step; the
// CTAs of a cluster judge a tile by the cluster's rows, so they agree (the multicast of x needs that).
//
// Which tiles are needed is worked out once, at construction, for the CTA's first 32 tiles (a decode step's GEMMs
// give a CTA at most ~4; later ones are all computed): lane j of each warp works out the j-th tile and loads its
// two seg_indptr entries; a ballot marks at once the tiles that stop the walk without those loads (a base-weight
// tile, or the end), and a second ballot gathers the loads only when the walk first reaches a slot-window tile, by
// which time they have landed behind the base tiles' work. Advancing is then bit arithmetic, as cheap as the base
// scheduler's add. (Judging each tile as it came cost a tile-index decomposition per step in every role, five per
// tile in each consumer, most in the is_last_tile walk before its epilogue, and 2.3x the kernel's instructions:
// llama3-8b's fold GEMMs at T=32 took 4326 us per step against 4152 with the base scheduler, with or without
// slots; NOTES.md session 21.) The ballots need every lane of the warp: the kernel calls the scheduler in
// warp-uniform code only. The loads happen before any griddepcontrol.wait: safe because the GEMM is launched
// without programmatic stream serialization (run_cutlass), so whatever wrote seg_indptr has finished when it
// starts.
template <class TileShape, class ClusterShape>
class SlotSkippingScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kClusterTiles = cute::size<0>(ClusterShape{});
  static constexpr int kClusterRows = kClusterTiles * cute::size<0>(TileShape{});
  static constexpr uint32_t kJudged = 32;  // the tiles judged: a warp's lanes, one tile each

 public:
  struct Arguments : Base::Arguments {
    SlotWindows slots;
  };
  struct Params : Base::Params {
    SlotWindows slots;
  };

  template <class ProblemShapeMNKL, class TileShapeMNK, class ClusterShapeMNK>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShapeMNK tile, ClusterShapeMNK cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(
        problem, tile, cluster, hw_info, args, workspace, epilogue_subtile, ktile_start_alignment_count);
    params.slots = args.slots;
    return params;
  }

  CUTLASS_DEVICE explicit SlotSkippingScheduler(Params const& params) : Base(params), slots_(params.slots) {
    if (slots_.seg_indptr == nullptr) return;
    judge_tiles();
    skip_unused();
  }

  template <class Cluster>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(Cluster) {
    return get_current_work();
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    for (uint32_t i = 0; i < count; ++i) {
      step(1);
      skip_unused();
    }
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    SlotSkippingScheduler next = *this;
    next.advance_to_next_work(count);
    return !next.get_current_work().is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE void step(uint32_t tiles) {
    Base::advance_to_next_work(tiles);
    position_ += tiles;
  }

  // Lane j judges the CTA's j-th tile: stops_ gets the tiles where the walk stops whatever the slots (a
  // base-weight row in the tile's cluster, or no tile: the end), and (lo_, hi_) are the seg_indptr entries of a
  // slot-window tile, hi_ > lo_ iff some row uses one of its slots (seg_indptr ascends, so slots s0..s1 hold rows
  // iff seg_indptr[s1 + 1] > seg_indptr[s0]). The loads are issued here and waited for in skip_unused.
  CUTLASS_DEVICE void judge_tiles() {
    Base ahead = *this;
    ahead.advance_to_next_work(threadIdx.x % kJudged);
    const WorkTileInfo work = ahead.get_current_work();
    const int64_t first = int64_t(work.M_idx / kClusterTiles) * kClusterRows;  // the cluster's first W row
    if (work.is_valid() && first >= slots_.base_rows &&
        first - slots_.base_rows < int64_t(slots_.num_slots) * slots_.slot_rows) {  // else rows past W's
      // first - base_rows < num_slots * slot_rows <= n: int32 from here
      const int32_t offset = static_cast<int32_t>(first - slots_.base_rows);
      const int32_t s0 = offset / slots_.slot_rows;
      const int32_t s1 = cute::min((offset + (kClusterRows - 1)) / slots_.slot_rows, slots_.num_slots - 1);
      lo_ = __ldg(slots_.seg_indptr + s0);
      hi_ = __ldg(slots_.seg_indptr + s1 + 1);
    }
    stops_ = __ballot_sync(0xffffffffu, !work.is_valid() || first < slots_.base_rows);
  }

  // Moves to the first tile at or after the current one where the walk stops: one some row needs, the end, or
  // any past the judged ones.
  CUTLASS_DEVICE void skip_unused() {
    if (slots_.seg_indptr == nullptr || position_ >= kJudged || ((stops_ >> position_) & 1u)) return;
    if (!gathered_) {  // the first slot-window tile: wait for the loads
      stops_ |= __ballot_sync(0xffffffffu, hi_ > lo_);
      gathered_ = true;
    }
    const uint32_t ahead = stops_ >> position_;
    step(ahead != 0 ? __ffs(ahead) - 1 : kJudged - position_);
  }

  SlotWindows slots_;
  uint32_t position_ = 0;  // of the current tile in the CTA's sequence
  uint32_t stops_ = 0;     // bit j: the walk stops at the CTA's j-th tile
  int32_t lo_ = 0, hi_ = 0;
  bool gathered_ = false;
};

}  // namespace lora_ops::cuda::fold

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<lora_ops::cuda::fold::SlotSkipping, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = lora_ops::cuda::fold::SlotSkippingScheduler<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail
#endif  // LORA_OPS_GG_SM90

namespace lora_ops::cuda {

#if defined(LORA_OPS_GG_SM90)
namespace {

using cute::_1;
using cute::_2;
using cute::_32;
using cute::_64;
using cute::Int;
using cute::Shape;

template <class T, int kTokens, int kClusterTiles = 2>
struct FoldGemm {
  using Tile = Shape<_64, Int<kTokens>, _64>;
  using Cluster = Shape<Int<kClusterTiles>, _1, _1>;
  using Collectives = DecodeCollectives<T, Tile, Cluster>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, typename Collectives::Mainloop,
                                                      typename Collectives::Epilogue, fold::SlotSkipping>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Whether the scheduler is given the slots' windows to skip (the step's seg_indptr).
bool skips_slots(const FoldLinearParams& p) { return p.seg_indptr != nullptr && p.num_slots > 0; }

template <class G>
typename G::Device::Arguments arguments(const FoldLinearParams& p) {
  using K = typename G::Kernel;
  using T = typename G::Kernel::ElementA;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = cute::make_shape((int)p.n, (int)p.t, (int)p.k, 1);  // M = W's rows, N = tokens
  args.mainloop.ptr_A = static_cast<const T*>(p.w);
  args.mainloop.dA = typename K::StrideA{p.w_row_stride, Int<1>{}, int64_t{0}};
  args.mainloop.ptr_B = static_cast<const T*>(p.x);
  args.mainloop.dB = typename K::StrideB{p.x_row_stride, Int<1>{}, int64_t{0}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename K::StrideC{Int<1>{}, p.n, int64_t{0}};
  args.epilogue.ptr_D = static_cast<T*>(p.y);
  args.epilogue.dD = typename K::StrideD{Int<1>{}, p.n, int64_t{0}};
  args.hw_info = cached_hardware_info<K>();
  if (skips_slots(p)) {  // then slot_rows <= n / num_slots fits int32
    args.scheduler.slots = {p.seg_indptr, static_cast<int32_t>(p.n - p.num_slots * p.slot_rows),
                            static_cast<int32_t>(p.slot_rows), static_cast<int32_t>(p.num_slots)};
  }
  return args;
}

template <class F>
decltype(auto) dispatch(const FoldLinearParams& p, F&& f) {
  auto by_tokens = [&](auto element) {
    using T = decltype(element);
    if (p.t <= 16) return f(FoldGemm<T, 16>{});
    // Slot windows (S x R rows) of 64 or more: clusters of one CTA, so that an unused slot's
    // window is skipped per 64-row tile, not only where a 128-row cluster holds no used slot. It costs x's
    // multicast, so slot windows narrower than a tile keep clusters of 2 (NOTES.md session 23).
    if (skips_slots(p) && p.slot_rows >= 64) {
      return p.t <= 32 ? f(FoldGemm<T, 32, 1>{}) : f(FoldGemm<T, 64, 1>{});
    }
    return p.t <= 32 ? f(FoldGemm<T, 32>{}) : f(FoldGemm<T, 64>{});
  };
  return p.dtype == DType::BF16 ? by_tokens(cutlass::bfloat16_t{}) : by_tokens(cutlass::half_t{});
}

}  // namespace
#endif  // LORA_OPS_GG_SM90

bool fold_linear_sm90_supported(const FoldLinearParams& p, int cc_major, int cc_minor) {
  if (!grouped_gemm_sm90_built() || cc_major != 9 || cc_minor != 0) return false;  // sm_90a code runs on 9.0 only
  if (p.dtype != DType::F16 && p.dtype != DType::BF16) return false;
  if (p.t <= 0 || p.n <= 0 || p.k <= 0 || p.n % 8 != 0 || p.k % 8 != 0) return false;
  if (p.t > INT_MAX || p.n > INT_MAX / 2 || p.k > INT_MAX) return false;  // n / 2: the scheduler's int32 rows
  return aligned(p.x, {p.x_row_stride * 2}) && aligned(p.w, {p.w_row_stride * 2});
}

cudaError_t launch_fold_linear_sm90(const FoldLinearParams& p, cudaStream_t stream) {
#if defined(LORA_OPS_GG_SM90)
  return dispatch(p, [&](auto gemm) -> cudaError_t {
    using G = decltype(gemm);
    const auto args = arguments<G>(p);
    // CUTLASS's own host checks, and no workspace (the persistent data-parallel schedule needs none)
    if (!G::Kernel::can_implement(args) || G::Device::get_workspace_size(args) != 0) return cudaErrorNotSupported;
    return run_cutlass<G>(args, nullptr, stream);
  });
#else
  (void)p;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace lora_ops::cuda
