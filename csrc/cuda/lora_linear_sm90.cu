// lora_linear on sm_90a at decode sizes (the kext route): a whole multi-LoRA linear layer in two launches,
//   1. a shrink (lora_linear_shrink.cu): h[t, j*L*R + s*R + r] = round(scale[s] * x[t] . A[s][j*R + r]) where s is
//      row t's slot, zeros in every other slot's window; it lets its dependents launch at its start;
//   2. one GEMM y = [x | h_j] . [W | B]^T on CUTLASS's sm_90 warp-specialized kernel (TMA + wgmma; ping-pong on
//      64-row W tiles, cooperative on the 128-row one, KextGemm), B = b_cols [N, L*R]
//      (lora_b's [L, N, R] viewed with each row's slots side by side: column s*R + r holds lora_b[s, n, r]),
//      launched programmatically: its producer loads x's and W's K blocks at once (x was written before the shrink
//      started) and waits for the shrink (griddepcontrol.wait) only before its first h block. The B blocks (64
//      columns: 64 / R slots) of which no slot is used by a row are not read.
// Why this shape (csrc/cuda/NOTES.md, sessions 26-31): at decode the LoRA cost is the number of dependent launches
// and the bytes read. The fold route's GEMM + expand read every used slot's A in the GEMM and B in a second kernel
// that waits for the whole GEMM; here the expand is K blocks of the base GEMM, and the shrink runs under the GEMM's
// W stream. H200, llama3-8b decode steps (the probe it came from, one call): T=32/1 adapter +9.8% against the
// fold route's +12.7%, T=32/32 +18.1 against +23.2, T=64/32 +20.8 against +34.8.
// The GEMM: no split-K, deterministic.
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's device asserts cost the kernels an ABI call and spills (grouped_gemm_sm90.cu)
#endif
// CUTLASS's own GDC waits stay empty (no CUTLASS_ENABLE_GDC_FOR_SM90 here, unlike fold_linear_sm90.cu): with them
// the producer would wait for the shrink before its x blocks, and the overlap would silently disappear.
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
#error "lora_linear_sm90.cu must be built without CUTLASS_ENABLE_GDC_FOR_SM90"
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "common.cuh"
#include "kernels.h"

#if defined(LORA_OPS_GG_SM90)
#include "cutlass_run.cuh"
#endif

namespace lora_ops::cuda {

constexpr int kKextMaxSlices = 4;
constexpr int kKextMaxSlots = 64;  // the slot mask's bits

// Whether each of `count` slices ends (ends[0..count)) on a multiple of `rows`: a W tile of that many rows then lies
// in one slice, whose h it takes (KextMainloop::load).
template <class I>
bool slices_end_on(const I* ends, int64_t count, int rows) {
  for (int64_t s = 0; s < count; ++s) {
    if (ends[s] % rows != 0) return false;
  }
  return true;
}

#if defined(LORA_OPS_GG_SM90)
namespace {

using namespace cute;

// What the K-extended GEMM adds to CUTLASS's mainloop arguments (once, in Arguments and Params alike).
template <class ElementA, class StrideA, class ElementB, class StrideB>
struct KextExtension {
  ElementA const* b_cols;  // [M, L*R]: the W rows' B of every slot
  StrideA d_b_cols;
  ElementB const* h;  // [N, S*L*R]: slice j's L*R columns at j*L*R
  StrideB d_h;
  int k_x = 0, num_slices = 1, rank = 1, num_slots = 0, num_tokens = 0;
  int slice_end[kKextMaxSlices] = {};  // W rows where each slice ends (multiples of the tile's rows)
  const int32_t* token_slot = nullptr;  // [num_tokens]: the slot mask's source (the shrink's too)
};

// CUTLASS's TMA warp-specialized mainloop whose K blocks past x's come from two other tensors: h (the B operand)
// and b_cols (the A operand). Only the producer (load) differs; the consumers multiply whatever the stages hold.
template <class Base>
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
  using Extension = KextExtension<ElementA, StrideA, ElementB, StrideB>;
  static constexpr int kBlockM = size<0>(TileShape{});
  static constexpr int kBlockK = size<2>(TileShape{});
  static_assert(size(ClusterShape{}) == 1, "the loads are not multicast");

  struct Arguments {
    ElementA const* ptr_A;  // W [M, k_x]
    StrideA dA;
    ElementB const* ptr_B;  // x [N, k_x]
    StrideB dB;
    uint32_t mma_promotion_interval = 4;
    Extension ext;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_b_cols;
    typename Base::Params::TMA_B tma_load_h;
    Extension ext;
    int k_x_tiles = 0, slice_h_tiles = 0;
  };

  CUTLASS_HOST_DEVICE static int slice_h_cols(Extension const& e) { return e.num_slots * e.rank; }  // one slice's L*R

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    const Extension& e = args.ext;
    Params p;
    auto tensor = [&](auto const* ptr, int rows, int cols, auto stride) {
      return make_tensor(ptr, make_layout(make_shape(rows, cols, L), stride));
    };
    const auto* w = reinterpret_cast<InternalElementA const*>(args.ptr_A);
    const auto* b_cols = reinterpret_cast<InternalElementA const*>(e.b_cols);
    const auto* x = reinterpret_cast<InternalElementB const*>(args.ptr_B);
    const auto* h = reinterpret_cast<InternalElementB const*>(e.h);
    p.tma_load_a = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor(w, M, e.k_x, args.dA), SmemLayoutA{}(_, _, Int<0>{}),
                                        TileShape{}, ClusterShape{});
    p.tma_load_b_cols = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor(b_cols, M, slice_h_cols(e), e.d_b_cols),
                                             SmemLayoutA{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
    p.tma_load_b = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor(x, N, e.k_x, args.dB), SmemLayoutB{}(_, _, Int<0>{}),
                                        TileShape{}, ClusterShape{});
    p.tma_load_h = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor(h, N, slice_h_cols(e) * e.num_slices, e.d_h),
                                        SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
    p.tma_transaction_bytes = Base::TmaTransactionBytes;
    p.tma_transaction_bytes_mk = Base::TmaTransactionBytesMK;
    p.tma_transaction_bytes_nk = Base::TmaTransactionBytesNK;
    p.ext = e;
    p.k_x_tiles = e.k_x / kBlockK;
    p.slice_h_tiles = slice_h_cols(e) / kBlockK;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    const Extension& e = args.ext;
    typename Base::Arguments base{args.ptr_A, args.dA, args.ptr_B, args.dB, args.mma_promotion_interval};
    return Base::can_implement(problem_shape, base) && e.k_x > 0 && e.k_x % kBlockK == 0 &&
           slice_h_cols(e) % kBlockK == 0 && K == e.k_x + slice_h_cols(e) && e.num_slices >= 1 &&
           e.num_slices <= kKextMaxSlices && e.num_slots >= 1 && e.num_slots <= kKextMaxSlots && e.rank >= 1 &&
           e.k_x / kBlockK >= Base::DispatchPolicy::Stages &&  // see skipped(): every stage holds a W tile first
           e.num_tokens == N && N <= 32 * kSlotWords &&  // every row in the slot mask
           slices_end_on(e.slice_end, e.num_slices, kBlockM);
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    Base::prefetch_tma_descriptors(p);
    prefetch_tma_descriptor(p.tma_load_b_cols.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_load_h.get_tma_descriptor());
  }

  // (W tiles, x tiles, h tiles, B tiles). W's spans the whole K (x's and h's blocks), though its loads stop at x's
  // end: CUTLASS's kernel counts the K blocks of every tile from it.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    const int h_cols = slice_h_cols(p.ext);
    Tensor mW = p.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mX = p.tma_load_b.get_tma_tensor(make_shape(N, p.ext.k_x, L));
    Tensor mH = p.tma_load_h.get_tma_tensor(make_shape(N, h_cols * p.ext.num_slices, L));
    Tensor mB = p.tma_load_b_cols.get_tma_tensor(make_shape(M, h_cols, L));
    return make_tuple(local_tile(mW, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{}),
                      local_tile(mX, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{}),
                      local_tile(mH, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{}),
                      local_tile(mB, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{}));
  }

  // The slots some row uses, from the rows' own slots (token_slot, as the shrink reads them, so no other metadata
  // can make the GEMM skip a block h needs): lane i of the producer warp loads rows i, i + 32, ... once per CTA,
  // before the x blocks, and the warp ORs their slot bits after them (a slot outside [0, L) marks nothing: the
  // shrink writes such a row's h as zeros). The probe's one-thread version, loading before every tile's first TMA,
  // cost 28% of the GEMM alone (NOTES.md, session 27).
  // Rows per lane: 2 up to the 64-token tile (as measured in session 31: the producer's code there is unchanged
  // since), 4 for the 128-token one.
  static constexpr int kSlotWords = size<1>(TileShape{}) > 64 ? 4 : 2;
  static_assert(size<1>(TileShape{}) <= 32 * kSlotWords, "the slot mask's rows per lane");
  struct TokenSlots {
    int32_t slot[kSlotWords];
  };
  CUTLASS_DEVICE TokenSlots load_token_slots(Params const& p) const {
    TokenSlots b;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlotWords; ++i) b.slot[i] = -1;
    if (have_used_) return b;
    const int lane = threadIdx.x % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlotWords; ++i) {
      if (lane + 32 * i < p.ext.num_tokens) b.slot[i] = __ldg(p.ext.token_slot + lane + 32 * i);
    }
    return b;
  }
  CUTLASS_DEVICE void settle_used(Params const& p, TokenSlots const& b) {  // warp-wide
    if (have_used_) return;
    uint64_t bits = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlotWords; ++i) {
      if (b.slot[i] >= 0 && b.slot[i] < p.ext.num_slots) bits |= uint64_t(1) << b.slot[i];
    }
    used_ = uint64_t(__reduce_or_sync(0xffffffffu, uint32_t(bits))) |
            uint64_t(__reduce_or_sync(0xffffffffu, uint32_t(bits >> 32))) << 32;
    have_used_ = true;
  }
  // An h block whose slots no row uses: its B box is not read (the stage's barrier is told those bytes arrived),
  // its h box is (zero there for every row), and CUTLASS's consumer loop multiplies it with whatever W tile the
  // stage held before (weights: finite; can_implement asks for at least as many x blocks as stages, so no stage is
  // read before a W tile was written to it). Reading neither box measured slower (NOTES.md, session 30).
  CUTLASS_DEVICE bool skipped(Params const& p, int kt) const {
    const int rank = p.ext.rank, first = (kt - p.k_x_tiles) * kBlockK / rank;
    const int last = ((kt - p.k_x_tiles + 1) * kBlockK - 1) / rank;
    const uint64_t window = (last >= 63 ? ~uint64_t(0) : (uint64_t(2) << last) - 1) & ~((uint64_t(1) << first) - 1);
    return (used_ & window) == 0;
  }

  template <class TensorW, class TensorX, class TensorH, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorW, TensorX, TensorH, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator, int k_tile_count, int, uint32_t,
                           TensorStorage& shared_tensors) {
    const TokenSlots slots = load_token_slots(p);
    const bool elected = elect_one_sync();
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto tma_w = p.tma_load_a.get_slice(0);
    auto tma_x = p.tma_load_b.get_slice(0);
    auto tma_h = p.tma_load_h.get_slice(0);
    auto tma_b = p.tma_load_b_cols.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tWgW = tma_w.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tWsA = tma_w.partition_D(sA);
    Tensor tXgX = tma_x.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tXsB = tma_x.partition_D(sB);
    Tensor tHgH = tma_h.partition_S(get<2>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tHsB = tma_h.partition_D(sB);
    Tensor tBgB = tma_b.partition_S(get<3>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tBsA = tma_b.partition_D(sA);

    const int row0 = int(m_coord) * kBlockM;
    int slice = 0;
    while (slice + 1 < p.ext.num_slices && row0 >= p.ext.slice_end[slice]) ++slice;
    const int h_tile0 = slice * p.slice_h_tiles;

    auto issue = [&](int kt, bool h_block, bool b_needed) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      if (!h_block) {
        copy(p.tma_load_a.with(*barrier, 0), tWgW(_, _, _, kt), tWsA(_, _, _, stage));
        copy(p.tma_load_b.with(*barrier, 0), tXgX(_, _, _, kt), tXsB(_, _, _, stage));
      } else {
        const int kb = kt - p.k_x_tiles;
        if (b_needed) copy(p.tma_load_b_cols.with(*barrier, 0), tBgB(_, _, _, kb), tBsA(_, _, _, stage));
        else cutlass::arch::ClusterTransactionBarrier::complete_transaction(barrier, 0, Base::TmaTransactionBytesMK);
        copy(p.tma_load_h.with(*barrier, 0), tHgH(_, _, _, h_tile0 + kb), tHsB(_, _, _, stage));
      }
      ++smem_pipe_write;
    };
    const int x_tiles = k_tile_count < p.k_x_tiles ? k_tile_count : p.k_x_tiles;
    if (elected) {
      for (int kt = 0; kt < x_tiles; ++kt) issue(kt, false, true);
    }
    __syncwarp();
    settle_used(p, slots);
    if (!elected) return;
    if (x_tiles < k_tile_count) asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int kt = x_tiles; kt < k_tile_count; ++kt) issue(kt, true, !skipped(p, kt));
  }

 private:
  uint64_t used_ = 0;  // the slots some row uses, once per CTA
  bool have_used_ = false;
};

// Tiles of 64 W rows x kTokens tokens x 64 K, ping-pong, clusters of one CTA: the probe's (W read once per CTA
// column of tiles). kWide: 128 W rows, cooperative (65-128 tokens, wide_tile). At 128 tokens the 64-row tile reads
// x from L2 twice per W byte: with 705 MB of L2 reads for gate_up's 235 MB of W it ran at L2's pace (~7 TB/s, 98 us
// per layer against cuBLAS's 71 with 256-row tiles; NOTES.md session 34).
template <class T, int kTokens, bool kWide = false>
struct KextGemm {
  using Tile = Shape<Int<kWide ? 128 : 64>, Int<kTokens>, _64>;
  using Collectives = DecodeCollectives<T, Tile, Shape<_1, _1, _1>, kWide>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                      KextMainloop<typename Collectives::Mainloop>,
                                                      typename Collectives::Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Whether 65-128 tokens take the 128-row tile (KextTile): slice bounds on 128 rows (a W tile lies in one slice),
// and preferred, or (Auto) a 128-row W tile per SM or more.
bool wide_tile(const LoraLinearParams& p) {
  if (!slices_end_on(p.slice_offsets + 1, p.num_slices, 128)) return false;
  return p.tile_65_128 == KextTile::Rows128 ||
         (p.tile_65_128 == KextTile::Auto && p.sm_count > 0 && p.n >= 128 * p.sm_count);
}

template <class G>
typename G::Device::Arguments kext_arguments(const LoraLinearParams& p) {
  using K = typename G::Kernel;
  using T = typename K::ElementA;
  const int LR = static_cast<int>(p.num_slots * p.rank);
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape((int)p.n, (int)p.t, (int)(p.k + LR), 1);  // M = W's rows, N = tokens
  args.mainloop.ptr_A = static_cast<const T*>(p.w);
  args.mainloop.dA = typename K::StrideA{p.w_row_stride, Int<1>{}, int64_t{0}};
  args.mainloop.ptr_B = static_cast<const T*>(p.x);
  args.mainloop.dB = typename K::StrideB{p.x_row_stride, Int<1>{}, int64_t{0}};
  auto& e = args.mainloop.ext;
  e.b_cols = static_cast<const T*>(p.b_cols);
  e.d_b_cols = typename K::StrideA{p.b_row_stride, Int<1>{}, int64_t{0}};
  e.h = static_cast<const T*>(p.h);
  e.d_h = typename K::StrideB{int64_t(p.num_slices) * LR, Int<1>{}, int64_t{0}};
  e.k_x = (int)p.k;
  e.num_slices = (int)p.num_slices;
  e.rank = (int)p.rank;
  e.num_slots = (int)p.num_slots;
  e.num_tokens = (int)p.t;
  for (int s = 0; s < p.num_slices; ++s) e.slice_end[s] = (int)p.slice_offsets[s + 1];
  e.token_slot = p.token_slot;
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename K::StrideC{Int<1>{}, p.n, int64_t{0}};
  args.epilogue.ptr_D = static_cast<T*>(p.y);
  args.epilogue.dD = typename K::StrideD{Int<1>{}, p.n, int64_t{0}};
  args.hw_info = cached_hardware_info<K>();
  return args;
}

constexpr int tile_tokens(int i) { return static_cast<int>(kLoraLinearTileTokens[i]); }
static_assert(sizeof(kLoraLinearTileTokens) / sizeof(kLoraLinearTileTokens[0]) == 4, "kext_dispatch's four tiles");

template <class F>
decltype(auto) kext_dispatch(const LoraLinearParams& p, F&& f) {
  auto by_tokens = [&](auto element) {
    using T = decltype(element);
    if (p.t <= tile_tokens(0)) return f(KextGemm<T, tile_tokens(0)>{});
    if (p.t <= tile_tokens(1)) return f(KextGemm<T, tile_tokens(1)>{});
    if (p.t <= tile_tokens(2)) return f(KextGemm<T, tile_tokens(2)>{});
    if (wide_tile(p)) return f(KextGemm<T, tile_tokens(3), true>{});
    return f(KextGemm<T, tile_tokens(3)>{});
  };
  return p.dtype == DType::BF16 ? by_tokens(cutlass::bfloat16_t{}) : by_tokens(cutlass::half_t{});
}

}  // namespace
#endif  // LORA_OPS_GG_SM90

bool lora_linear_sm90_supported(const LoraLinearParams& p, int cc_major, int cc_minor) {
  if (!grouped_gemm_sm90_built() || cc_major != 9 || cc_minor != 0) return false;  // sm_90a code runs on 9.0 only
  if (p.dtype != DType::F16 && p.dtype != DType::BF16) return false;
  if (p.t < 1 || p.t > kLoraLinearMaxTokens || p.n < 1 || p.k < 64 || p.k % 64 != 0) return false;
  if (p.n > INT_MAX || p.k > INT_MAX / 2 || p.rank < 1) return false;
  if (p.num_slots < 1 || p.num_slots > kKextMaxSlots) return false;
  if ((p.num_slots * p.rank) % 64 != 0 || p.num_slots * p.rank > INT_MAX / 8) return false;
  if (!kext_shrink_serves(p)) return false;
  if (p.num_slices < 1 || p.num_slices > kKextMaxSlices) return false;
  if (!slices_end_on(p.slice_offsets + 1, p.num_slices, 64)) return false;  // the 64-row W tiles
  const int64_t es = 2;
  if (!(aligned(p.x, {p.x_row_stride * es}) && aligned(p.w, {p.w_row_stride * es}) &&
        aligned(p.lora_a, {p.a_slot_stride * es, p.a_row_stride * es}) && aligned(p.b_cols, {p.b_row_stride * es}) &&
        aligned(p.y, {p.n * es}))) {
    return false;
  }
#if defined(LORA_OPS_GG_SM90)
  return kext_dispatch(p, [&](auto gemm) {  // CUTLASS's own checks, and the stages rule, for T's tile
    using G = decltype(gemm);
    const auto args = kext_arguments<G>(p);
    return G::Kernel::can_implement(args) && G::Device::get_workspace_size(args) == 0;
  });
#else
  return false;
#endif
}

cudaError_t launch_lora_linear_sm90(const LoraLinearParams& p, cudaStream_t stream) {
#if defined(LORA_OPS_GG_SM90)
  return kext_dispatch(p, [&](auto gemm) -> cudaError_t {
    using G = decltype(gemm);
    const auto args = kext_arguments<G>(p);  // lora_linear_sm90_supported ran CUTLASS's checks on them
    if (const cudaError_t err = launch_kext_shrink(p, stream); err != cudaSuccess) return err;
    return run_cutlass<G>(args, nullptr, stream, /*programmatic=*/true);
  });
#else
  (void)p;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace lora_ops::cuda
