// grouped_gemm on sm_90a: a CUTLASS 3.x ptr-array grouped GEMM (TMA loads and stores, wgmma, warp-specialized
// persistent CTAs in 2 x 1 clusters) for the large-group case: fp16/bf16 x, w and y, rows of each segment
// contiguous (no token_indices), TMA-aligned tensors, every group the full N x K (no n_sizes/k_sizes), N and K
// positive multiples of 8. Everything else stays on the mma.sync kernels.
//
// The per-group problems live only on the device: a one-warp prep kernel walks the segments (clamped, running
// maximum: docs/design.md §2) and writes CUTLASS's arrays (problem shapes, A/B/D pointers, strides) into the
// workspace; the host passes no problem shapes, so nothing is read back and the call is capturable. A segment
// with an invalid slot or no rows becomes an empty problem (no tiles) whose pointers are the tensors' bases.
// accumulate is the epilogue's beta = 1 reading C = y (same pointers as D); beta = 0 skips the C load entirely.
//
// Two tile configurations, the two that torch._grouped_mm (aten GroupMM.cu) uses on sm_90, so that the kernel
// competes at both of the issue's shapes:
//   cooperative 128 x 256 x 64 (two consumer warpgroups share one tile): groups of >= 128 rows on average, a
//     large N; 128 x 256 halves the operand traffic per flop against 128 x 128, and 64-deep K steps leave room
//     for 4 stages of 48 KB next to the epilogue's shared memory;
//   pingpong 64 x 128 x 128 (two consumer warpgroups alternate tiles, one's epilogue under the other's
//     mainloop): short groups (<= 128 rows on average) or N <= 128, where a 128 x 256 tile would be mostly padding
//     and the epilogue is a large share of each tile's time.
// Both in 2 x 1 clusters: the two CTAs of a cluster take adjacent M tiles of one group and N column, so each w
// tile is fetched from memory once and multicast to both (w is the larger operand per tile).
// NDEBUG before any include: otherwise CUTLASS's device asserts (cute/pointer_flagged.hpp's swizzle-alignment
// check) compile to an __assertfail call in every kernel, and that ABI call costs the pingpong kernels a 32-byte
// stack frame and spills (ptxas: 32 B spill stores, 36 B loads at the 168-register cap). torch builds the same
// kernels in a Release (NDEBUG) build; this file has no asserts of its own.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "common.cuh"
#include "kernels.h"

#if defined(LORA_OPS_GG_SM90)
#include <cutlass/gemm/group_array_problem_shape.hpp>

#include "cutlass_run.cuh"
#endif

#include <climits>

namespace lora_ops::cuda {

#if defined(LORA_OPS_GG_SM90)
namespace {

using cute::_1;
using cute::_0;
using cute::_2;
using cute::Shape;

// Every operand is K-major or row-major: A = x [rows, K] (RowMajor), B = w[l] [N, K] (CUTLASS's ColumnMajor
// K x N), D = C = y [rows, N] (RowMajor): each has the stride (leading dimension, 1, 0).
using RowStride = cute::Stride<int64_t, _1, _0>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using MNK = ProblemShape::UnderlyingProblemShape;

struct Cooperative {
  using Tile = Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Tile = Shape<cute::_64, cute::_128, cute::_128>;
  using Cluster = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class T, class Config>
struct GroupedGemm {
  static constexpr int kAlign = 16 / sizeof(T);  // elements per 16 bytes: TMA's alignment
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, cutlass::layout::RowMajor*, kAlign, T,
      cutlass::layout::RowMajor*, kAlign, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<T, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor*, kAlign, T,
      cutlass::layout::ColumnMajor*, kAlign, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::MainloopSchedule>::CollectiveOp;
  using Element = T;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, RowStride> &&
                    std::is_same_v<typename Kernel::InternalStrideB, RowStride> &&
                    std::is_same_v<typename Kernel::InternalStrideC, RowStride> &&
                    std::is_same_v<typename Kernel::InternalStrideD, RowStride>,
                "the prep kernel writes (leading dimension, 1, 0) strides");
};

// The device arrays CUTLASS reads (one entry per segment).
struct Arrays {
  MNK* shapes;
  const void** a;
  const void** b;
  void** d;
  RowStride* stride_a;
  RowStride* stride_b;
  RowStride* stride_d;
};

constexpr size_t kArrayAlign = 128;
size_t round_up(size_t v) { return (v + kArrayAlign - 1) / kArrayAlign * kArrayAlign; }

// Lays the arrays out from `base` (nullptr: only sizes them); returns the bytes used.
size_t carve_arrays(int64_t groups, unsigned char* base, Arrays* out) {
  size_t offset = 0;
  auto take = [&](auto*& ptr, size_t bytes) {
    using P = std::remove_reference_t<decltype(ptr)>;
    ptr = base ? reinterpret_cast<P>(base + offset) : nullptr;
    offset += round_up(bytes);
  };
  const size_t g = static_cast<size_t>(groups);
  take(out->shapes, g * sizeof(MNK));
  take(out->a, g * sizeof(void*));
  take(out->b, g * sizeof(void*));
  take(out->d, g * sizeof(void*));
  take(out->stride_a, g * sizeof(RowStride));
  take(out->stride_b, g * sizeof(RowStride));
  take(out->stride_d, g * sizeof(RowStride));
  return offset;
}

// One warp, 32 segments per step: segment g covers [m_g, m_{g+1}) with m the clamped running maximum of
// seg_indptr; its slot is clamped as in every other kernel. Anything invalid or empty becomes the
// empty problem (0, 0, 0) with the tensors' base pointers.
__global__ void grouped_gemm_sm90_prep_kernel(GroupedGemmParams p, Arrays out) {
  const int lane = threadIdx.x;
  const int64_t ex = dtype_size(p.x_dtype), ew = dtype_size(p.w_dtype), ey = dtype_size(p.y_dtype);
  const auto* x = static_cast<const unsigned char*>(p.x);
  const auto* w = static_cast<const unsigned char*>(p.w);
  auto* y = static_cast<unsigned char*>(p.y);
  int64_t m_carry = clamped_indptr(p.seg, 0);
  for (int64_t base = 0; base < p.seg.num_segments; base += 32) {
    const int64_t g = base + lane;
    const bool in = g < p.seg.num_segments;
    const int64_t bound = in ? clamped_indptr(p.seg, g + 1) : int64_t{0};
    const int64_t m_end = Max{}(m_carry, warp_inclusive_scan(bound, 32, Max{}));
    int64_t m_begin = __shfl_up_sync(0xffffffffu, m_end, 1);
    if (lane == 0) m_begin = m_carry;
    if (in) {
      const int64_t slot = segment_slot(p.seg, g, p.num_groups);
      const int64_t rows = m_end - m_begin;
      const bool work = rows > 0 && slot >= 0;
      out.shapes[g] = work ? MNK(static_cast<int>(rows), static_cast<int>(p.n), static_cast<int>(p.k)) : MNK(0, 0, 0);
      out.a[g] = x + (work ? m_begin * p.x_row_stride * ex : 0);
      out.b[g] = w + (work ? slot * p.w_stride0 * ew : 0);
      out.d[g] = y + (work ? m_begin * p.y_row_stride * ey : 0);
      out.stride_a[g] = RowStride(p.x_row_stride, _1{}, _0{});
      out.stride_b[g] = RowStride(p.w_stride1, _1{}, _0{});
      out.stride_d[g] = RowStride(p.y_row_stride, _1{}, _0{});
    }
    m_carry = __shfl_sync(0xffffffffu, m_end, 31);
  }
}

template <class G>
typename G::Kernel::Arguments arguments(const GroupedGemmParams& p, const Arrays& arr, int num_sms) {
  using T = typename G::Element;
  typename G::Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{static_cast<int>(p.seg.num_segments), arr.shapes, nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const T**>(arr.a);
  args.mainloop.dA = arr.stride_a;
  args.mainloop.ptr_B = reinterpret_cast<const T**>(arr.b);
  args.mainloop.dB = arr.stride_b;
  args.epilogue.thread.alpha = p.alpha;
  args.epilogue.thread.beta = p.accumulate ? 1.f : 0.f;  // 0: the epilogue does not read C at all
  args.epilogue.ptr_C = const_cast<const T**>(reinterpret_cast<T**>(arr.d));  // C = D = y
  args.epilogue.dC = arr.stride_d;
  args.epilogue.ptr_D = reinterpret_cast<T**>(arr.d);
  args.epilogue.dD = arr.stride_d;
  args.hw_info.sm_count = num_sms;
  return args;
}

// The configuration for a call (see the top of the file), as torch._grouped_mm picks it.
bool use_pingpong(const GroupedGemmParams& p) {
  return p.seg.positions <= 128 * p.seg.num_segments || p.n <= 128;
}

template <class T>
struct ElementTag {
  using type = T;
};

template <class F>
decltype(auto) dispatch(const GroupedGemmParams& p, F&& f) {
  const bool pingpong = use_pingpong(p);
  auto by_config = [&](auto tag) {
    using T = typename decltype(tag)::type;
    return pingpong ? f(GroupedGemm<T, Pingpong>{}) : f(GroupedGemm<T, Cooperative>{});
  };
  if (p.w_dtype == DType::BF16) return by_config(ElementTag<cutlass::bfloat16_t>{});
  return by_config(ElementTag<cutlass::half_t>{});
}

}  // namespace
#endif  // LORA_OPS_GG_SM90

bool grouped_gemm_sm90_built() {
#if defined(LORA_OPS_GG_SM90)
  return true;
#else
  return false;
#endif
}

bool grouped_gemm_sm90_supported(const GroupedGemmParams& p, int cc_major, int cc_minor) {
  if (!grouped_gemm_sm90_built() || cc_major != 9 || cc_minor != 0) return false;  // sm_90a code runs on 9.0 only
  const bool half = p.w_dtype == DType::F16 || p.w_dtype == DType::BF16;
  if (!half || p.x_dtype != p.w_dtype || p.y_dtype != p.w_dtype || p.seg.token_indices != nullptr) return false;
  // TMA: 16-byte aligned bases and strides; a positive stride along each tiled dimension.
  const int64_t es = dtype_size(p.w_dtype);
  if (p.x_row_stride <= 0 || p.w_stride1 <= 0 || p.y_row_stride <= 0) return false;
  if (!aligned(p.x, {p.x_row_stride * es}) || !aligned(p.w, {p.w_stride0 * es, p.w_stride1 * es}) ||
      !aligned(p.y, {p.y_row_stride * es})) {
    return false;
  }
  // Full-width groups of N and K multiples of 8 only. On the H200, groups with n_l = 129 and n_l = 1
  // (n_sizes) had 7 columns past n_l written: the 16-byte TMA tiles round a group's extent up to 8 elements.
  // Per-group sizes are device data the host cannot check, so any n_sizes or k_sizes goes to the mma kernel, and
  // so does K = 0 (no reduction: y is only zeroed or kept).
  if (p.n_sizes != nullptr || p.k_sizes != nullptr || p.n % 8 != 0 || p.k % 8 != 0 || p.k == 0) return false;
  // CUTLASS's problem shapes and group count are int.
  return p.n <= INT_MAX && p.k <= INT_MAX && p.seg.num_segments <= INT_MAX && p.seg.positions <= INT_MAX;
}

bool grouped_gemm_sm90_preferred(const GroupedGemmParams& p) {
  return p.n >= kGroupedGemmSm90MinNK && p.k >= kGroupedGemmSm90MinNK &&
         p.seg.positions >= kGroupedGemmSm90MinRowsPerGroup * p.seg.num_segments;
}

size_t grouped_gemm_sm90_workspace_bytes(const GroupedGemmParams& p, int num_sms) {
#if defined(LORA_OPS_GG_SM90)
  Arrays none{};
  const size_t arrays = carve_arrays(p.seg.num_segments, nullptr, &none);
  return arrays + dispatch(p, [&](auto gemm) {
           return decltype(gemm)::Device::get_workspace_size(arguments<decltype(gemm)>(p, none, num_sms));
         });
#else
  (void)p;
  (void)num_sms;
  return 0;
#endif
}

cudaError_t launch_grouped_gemm_sm90(const GroupedGemmParams& p, void* workspace, int num_sms, cudaStream_t stream) {
#if defined(LORA_OPS_GG_SM90)
  if (p.seg.num_segments == 0 || p.seg.positions == 0) return cudaSuccess;
  auto* base = static_cast<unsigned char*>(workspace);
  Arrays arr{};
  const size_t arrays_bytes = carve_arrays(p.seg.num_segments, base, &arr);
  grouped_gemm_sm90_prep_kernel<<<1, 32, 0, stream>>>(p, arr);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return dispatch(p, [&](auto gemm) -> cudaError_t {
    using G = decltype(gemm);
    using Kernel = typename G::Kernel;
    auto args = arguments<G>(p, arr, num_sms);
    if (!Kernel::can_implement(args)) return cudaErrorInvalidValue;  // host-side checks (mode, schedule)
    return run_cutlass<G>(args, base + arrays_bytes, stream);
  });
#else
  (void)p;
  (void)workspace;
  (void)num_sms;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace lora_ops::cuda
