// CUDA dispatch key: the op table (which regimes go to Triton), argument checks (csrc/common), regime choice,
// workspace, launch.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>

#include "../common/checks.h"
#include "../common/lora_linear.h"
#include "../common/op_table.h"
#include "kernels.h"

namespace lora_ops {
namespace {

// Device attributes the launch plans need, read once per device.
int device_attribute(cudaDeviceAttr attr, int device) {
  constexpr int kCachedDevices = 64;
  // atomic: calls from several threads read and fill it (relaxed: every thread writes the same value)
  static std::atomic<int> cached[3][kCachedDevices] = {};
  const int which = attr == cudaDevAttrMultiProcessorCount ? 0 : attr == cudaDevAttrComputeCapabilityMajor ? 1 : 2;
  TORCH_INTERNAL_ASSERT(which < 2 || attr == cudaDevAttrComputeCapabilityMinor);
  const bool cacheable = device >= 0 && device < kCachedDevices;
  // stored plus one, so that 0 means "not read yet" (a minor version of 0 is a valid value)
  const int stored = cacheable ? cached[which][device].load(std::memory_order_relaxed) : 0;
  if (stored != 0) return stored - 1;
  int read = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&read, attr, device));
  if (cacheable) cached[which][device].store(read + 1, std::memory_order_relaxed);
  return read;
}

// ---- the op table (csrc/common/op_table.h): a call in a regime it gives to Triton is redispatched to
// lora_ops::_triton_<op>'s CUDA kernel (registered from Python). The lookup reads host-known sizes only: no Python,
// no device read, so capture and torch.compile are unaffected.
using op_table::Op;
using op_table::triton_twin;

// The table's axes from host-visible sizes only. A tensor of the wrong rank reads as 0 here; the checks of
// whichever backend runs then raise the contract's error.
int64_t size_or_zero(const at::Tensor& t, int64_t dim) { return t.dim() > dim ? t.size(dim) : 0; }
int64_t positions_of(const at::Tensor& y, const std::optional<at::Tensor>& token_indices) {
  return token_indices.has_value() ? token_indices->numel() : size_or_zero(y, 0);
}
int64_t slices_of(at::OptionalIntArrayRef slice_offsets) {
  return slice_offsets.has_value() ? static_cast<int64_t>(slice_offsets->size()) - 1 : 1;
}
// The table was measured on fp16/bf16 weights; fp32 stays on the C++ kernels.
bool table_dtype(const at::Tensor& weights) {
  return weights.scalar_type() == at::kHalf || weights.scalar_type() == at::kBFloat16;
}

// The Triton twin's CUDA kernel is reached with kCudaKeys, below every dispatch layer already passed on the way here.
const c10::DispatchKeySet kCudaKeys(c10::DispatchKey::CUDA);

// The kernel a LORA_OPS_CUDA_*_KERNEL variable prefers: Auto (the enum's first value) when it is unset, empty
// or "auto", else the value after Auto at the position of its name in `names`; any other value is an error.
// Read on every call, so that a test can set the variable within one process (a getenv is ~0.1 us).
template <class Kernel>
Kernel preferred_kernel(const char* variable, std::initializer_list<const char*> names) {
  const char* v = std::getenv(variable);
  if (v == nullptr || *v == 0 || !std::strcmp(v, "auto")) return Kernel{};
  std::string expected = "auto";
  int i = 1;
  for (const char* name : names) {
    if (!std::strcmp(v, name)) return static_cast<Kernel>(i);
    expected += (i == (int)names.size() ? " or " : ", ") + std::string(name);
    ++i;
  }
  TORCH_CHECK_VALUE(false, variable, " = '", v, "': expected ", expected);
}

// LORA_OPS_CUDA_SGMV_KERNEL=mma|split|wgmma prefers one sgmv kernel where it can take the input (tests use it to
// cover the kernel the automatic choice does not pick on their shapes; mma: mma.sync's prefill kernel; wgmma: the
// prefill kernel on sm_90a's warpgroup MMA, else mma); unset or "auto": by regime (on sm_90a the prefill takes the
// wgmma kernel from rank tiles of kWgmmaMinRankTile and kWgmmaMinPositions positions on).
enum class SgmvKernel { Auto, Mma, Split, Wgmma };
SgmvKernel preferred_sgmv_kernel() {
  return preferred_kernel<SgmvKernel>("LORA_OPS_CUDA_SGMV_KERNEL", {"mma", "split", "wgmma"});
}

// LORA_OPS_CUDA_SGMV_CLUSTER=1..8 gives the prefill kernels that many CTAs a cluster on sm_90, as given (tests use it
// to sum h over every member count, which the one-wave rule picks by the GPU's resident counts); unset or "auto":
// the plan's size, narrowed to one wave.
int forced_sgmv_cluster() {
  return preferred_kernel<int>("LORA_OPS_CUDA_SGMV_CLUSTER", {"1", "2", "3", "4", "5", "6", "7", "8"});
}

// LORA_OPS_CUDA_SGMV_WGMMA_ROWS=64|128 gives the wgmma prefill kernel at a rank tile of 128 tiles of that many
// positions (128: two warpgroups; tests use it to cover both below and above the automatic choice's bound); unset or
// "auto": 128 from kWgmmaMinPositions on.
int forced_wgmma_rows() {
  return 64 * preferred_kernel<int>("LORA_OPS_CUDA_SGMV_WGMMA_ROWS", {"64", "128"});
}

// LORA_OPS_CUDA_EXPAND_KERNEL=positions|tiles|rows|runs|segments likewise prefers one expand kernel (lora_expand and
// the decode sgmv's second step; rows, runs: the rows form's tensor-core kernels, segments: the segment form's,
// where they serve, else the automatic choice); unset or "auto": the tensor-core kernels where they serve (the
// segments kernel given segments; given rows, the runs kernel where it pays, else the rows kernel), else by the
// number of positions.
cuda::ExpandKernel preferred_expand_kernel() {
  return preferred_kernel<cuda::ExpandKernel>("LORA_OPS_CUDA_EXPAND_KERNEL",
                                              {"positions", "tiles", "rows", "runs", "segments"});
}

// Positions above which the tensor-core kernel takes over (64-row tiles amortise A and B over many rows).
constexpr int64_t kMmaMinPositions = 1024;

// The expand step of a decode sgmv: h is the shrink's float32 partials [splits][rows][S*R], one window per row.
ExpandParams expand_of_shrink(const SgmvParams& p, const cuda::ShrinkPlan& plan, const float* partials) {
  ExpandParams e{};
  e.y = p.y;
  e.h = partials;
  e.lora_b = p.lora_b;
  e.y_row_stride = p.y_row_stride;
  e.h_row_stride = p.num_slices * p.max_rank;
  e.h_slot_stride = 0;
  e.h_split_stride = p.rows * p.num_slices * p.max_rank;
  e.h_splits = plan.splits;
  e.b_stride0 = p.b_stride0;
  e.b_stride1 = p.b_stride1;
  e.b_dtype = p.x_dtype;
  e.h_dtype = DType::F32;
  e.y_dtype = p.y_dtype;
  e.seg = p.seg;
  e.lora_ranks = p.lora_ranks;
  e.lora_scales = p.lora_scales;
  e.rows = p.rows;
  e.n = p.n;
  e.num_slots = p.num_slots;
  e.max_rank = p.max_rank;
  e.num_slices = p.num_slices;
  for (int64_t s = 0; s <= p.num_slices; ++s) e.slice_offsets[s] = p.slice_offsets[s];
  e.scale = p.scale;
  return e;
}

// grouped_gemm's LoRA expand (K <= 128: y[t, :N] += alpha * x[t, :k_l] * w[l, :, :k_l]^T) as a lora_expand: x is
// every group's h window (slot stride 0), w is B, each group's k_l its rank, alpha the scale.
ExpandParams expand_of_grouped_gemm(const GroupedGemmParams& p) {
  ExpandParams e{};
  e.y = p.y;
  e.h = p.x;
  e.lora_b = p.w;
  e.y_row_stride = p.y_row_stride;
  e.h_row_stride = p.x_row_stride;
  e.h_slot_stride = 0;
  e.h_split_stride = 0;
  e.h_splits = 1;
  e.b_stride0 = p.w_stride0;
  e.b_stride1 = p.w_stride1;
  e.b_dtype = p.w_dtype;
  e.h_dtype = p.x_dtype;
  e.y_dtype = p.y_dtype;
  e.seg = p.seg;
  e.lora_ranks = p.k_sizes;
  e.lora_scales = nullptr;
  e.rows = p.rows;
  e.n = p.n;
  e.num_slots = p.num_groups;
  e.max_rank = p.k;
  e.num_slices = 1;
  e.slice_offsets[0] = 0;
  e.slice_offsets[1] = p.n;
  e.scale = p.alpha;
  return e;
}

void sgmv_cuda(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
               const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
               const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets, double scale) {
  const c10::cuda::CUDAGuard guard(y.device());
  // A forced C++ kernel (the sgmv's or its expand's) bypasses the op table.
  const SgmvKernel preferred = preferred_sgmv_kernel();
  const cuda::ExpandKernel expand_kernel = preferred_expand_kernel();
  if (preferred == SgmvKernel::Auto && expand_kernel == cuda::ExpandKernel::Auto && table_dtype(lora_b) &&
      op_table::says_triton(Op::Sgmv, {positions_of(y, token_indices), size_or_zero(lora_b, 2),
                                       slices_of(slice_offsets), op_table::true_ranks_axis(lora_ranks.has_value())})) {
    triton_twin<Op::Sgmv>().redispatch(kCudaKeys, y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices,
                                       lora_ranks, lora_scales, slice_offsets, scale);
    return;
  }
  SgmvIndexTensors keep;
  const auto p = check_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                            slice_offsets, scale, keep);
  // An empty reduction (K = 0) contributes exactly zero whatever the scales: nothing to launch.
  if (p.rows == 0 || p.k == 0 || p.seg.num_segments == 0 || p.max_rank == 0 || p.n == 0 || p.seg.positions == 0) {
    return;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = y.get_device();
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  const int cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  if (cuda::sgmv_mma_supported(p) && (preferred == SgmvKernel::Mma || preferred == SgmvKernel::Wgmma ||
                                      (preferred == SgmvKernel::Auto && p.seg.positions >= kMmaMinPositions))) {
    const bool wgmma_runs =
        cuda::sgmv_wgmma_supported(p, cc_major, device_attribute(cudaDevAttrComputeCapabilityMinor, device));
    cuda::SgmvPrefillChoice choice;
    choice.wgmma = !wgmma_runs || preferred == SgmvKernel::Mma ? cuda::WgmmaUse::Never
                   : preferred == SgmvKernel::Wgmma            ? cuda::WgmmaUse::Always
                                                               : cuda::WgmmaUse::Auto;
    choice.wgmma_rows = forced_wgmma_rows();
    choice.cluster = forced_sgmv_cluster();
    C10_CUDA_CHECK(cuda::launch_sgmv_mma(p, sms, cc_major, choice, stream));
    return;
  }
  const auto plan = cuda::plan_sgmv_shrink(p, sms);
  const auto partials = at::empty({plan.splits * p.rows * p.num_slices * p.max_rank}, y.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::launch_sgmv_shrink(p, plan, partials.data_ptr<float>(), stream));
  C10_CUDA_CHECK(cuda::launch_lora_expand(expand_of_shrink(p, plan, partials.data_ptr<float>()),
                                          expand_kernel, /*inputs_ready=*/true, cc_major, stream));
}

void lora_expand_cuda(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                      const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                      double scale) {
  const c10::cuda::CUDAGuard guard(y.device());
  // A forced C++ kernel bypasses the op table, and so does the rows form: the table's regimes were measured on
  // segments, and the rows kernel beat Triton's rows kernel on all 6 of the op bench's lora_expand cases (H200,
  // 615d8d8).
  const cuda::ExpandKernel preferred = preferred_expand_kernel();
  if (preferred == cuda::ExpandKernel::Auto && seg_indptr.has_value() && table_dtype(lora_b) &&
      op_table::says_triton(Op::LoraExpand, {positions_of(y, token_indices), size_or_zero(lora_b, 2),
                                             slices_of(slice_offsets),
                                             op_table::true_ranks_axis(lora_ranks.has_value())})) {
    triton_twin<Op::LoraExpand>().redispatch(kCudaKeys, y, h, lora_b, seg_indptr, seg_lora, token_indices,
                                             lora_ranks, lora_scales, slice_offsets, scale);
    return;
  }
  SgmvIndexTensors keep;
  const auto p = check_lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                                   slice_offsets, scale, keep);
  if (p.rows == 0 || p.seg.num_segments == 0 || p.max_rank == 0 || p.n == 0 || p.seg.positions == 0) return;
  C10_CUDA_CHECK(cuda::launch_lora_expand(p, preferred, /*inputs_ready=*/false,
                                          device_attribute(cudaDevAttrComputeCapabilityMajor, y.get_device()),
                                          c10::cuda::getCurrentCUDAStream()));
}

// LORA_OPS_CUDA_GG_KERNEL=mma|skinny forces one grouped_gemm path for every input (tests use it to cover both
// over the whole grid); =sm90, =split and =lora take the sm_90a CUTLASS kernel, the split-K shrink or lora_expand's
// tensor-core kernels wherever they can serve the input (whatever the sizes) and the automatic choice elsewhere;
// unset or "auto": by shape.
enum class GroupedGemmKernel { Auto, Mma, Skinny, Sm90, Split, Lora };
GroupedGemmKernel preferred_grouped_gemm_kernel() {
  return preferred_kernel<GroupedGemmKernel>("LORA_OPS_CUDA_GG_KERNEL", {"mma", "skinny", "sm90", "split", "lora"});
}

void grouped_gemm_cuda(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                       const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                       const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                       double alpha, bool accumulate) {
  const c10::cuda::CUDAGuard guard(y.device());
  const GroupedGemmKernel preferred = preferred_grouped_gemm_kernel();  // a forced C++ kernel bypasses the table
  if (preferred == GroupedGemmKernel::Auto && table_dtype(w) &&
      op_table::says_triton(Op::GroupedGemm, {positions_of(y, token_indices), size_or_zero(w, 1),
                                              size_or_zero(w, 2)})) {
    triton_twin<Op::GroupedGemm>().redispatch(kCudaKeys, y, x, w, seg_indptr, seg_weight, token_indices, n_sizes,
                                              k_sizes, alpha, accumulate);
    return;
  }
  GroupedGemmIndexTensors keep;
  const auto p = check_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha,
                                    accumulate, keep);
  if (p.rows == 0 || p.seg.num_segments == 0 || p.num_groups == 0 || p.n == 0 || p.seg.positions == 0) return;
  if (p.k == 0 && p.accumulate) return;  // every reduction is empty: y stays as it is
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = y.get_device();
  // Large groups on sm_90: TMA + wgmma (CUTLASS). Its workspace: the per-group problem arrays the prep kernel
  // fills on the device, and CUTLASS's per-SM tensor maps, from the caching allocator on this stream.
  if ((preferred == GroupedGemmKernel::Sm90 ||
       (preferred == GroupedGemmKernel::Auto && cuda::grouped_gemm_sm90_preferred(p))) &&
      cuda::grouped_gemm_sm90_supported(p, device_attribute(cudaDevAttrComputeCapabilityMajor, device),
                                        device_attribute(cudaDevAttrComputeCapabilityMinor, device))) {
    const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
    const auto workspace = at::empty({static_cast<int64_t>(cuda::grouped_gemm_sm90_workspace_bytes(p, sms))},
                                     y.options().dtype(at::kByte));
    C10_CUDA_CHECK(cuda::launch_grouped_gemm_sm90(p, workspace.data_ptr(), sms, stream));
    return;
  }
  // A forced sm90 or split the kernel cannot take falls back to the automatic choice.
  const bool automatic = preferred == GroupedGemmKernel::Auto || preferred == GroupedGemmKernel::Sm90 ||
                         preferred == GroupedGemmKernel::Split || preferred == GroupedGemmKernel::Lora;
  // Few positions and few columns (the LoRA shrink at decode): K split over the GPU, then the partials summed.
  // Automatic only where K does split (one chunk would be two launches for the narrow tiles' one) and the partials,
  // sized by y's rows, stay small. The plan is made only for a call the split path may take.
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  if (cuda::grouped_gemm_split_serves(p) &&
      (preferred == GroupedGemmKernel::Split ||
       (automatic && p.seg.positions <= cuda::kGroupedGemmSplitMaxPositions &&
        p.rows <= cuda::kGroupedGemmSplitMaxPositions && p.k > cuda::kGroupedGemmExpandMaxK))) {
    const SgmvParams shrink = cuda::grouped_gemm_as_shrink(p);
    const auto plan = cuda::plan_sgmv_shrink(shrink, sms);
    if (preferred == GroupedGemmKernel::Split || plan.splits >= 2) {
      const auto partials = at::empty({plan.splits * p.rows * p.n}, y.options().dtype(at::kFloat));
      C10_CUDA_CHECK(cuda::launch_sgmv_shrink(shrink, plan, partials.data_ptr<float>(), stream));
      C10_CUDA_CHECK(cuda::launch_grouped_gemm_split_sum(
          p, partials.data_ptr<float>(), plan.splits, device_attribute(cudaDevAttrComputeCapabilityMajor, device),
          stream));
      return;
    }
  }
  // The LoRA expand at decode size (y +=, every group's N): lora_expand's tensor-core segments kernel, a warp per
  // 8 positions of one group (the staging kernel below makes a 64-row tile of each group's few rows: 17.0 us for
  // 32 single rows, H200).
  if (p.k <= cuda::kGroupedGemmExpandMaxK && p.accumulate && p.n_sizes == nullptr &&
      (preferred == GroupedGemmKernel::Lora ||
       (automatic && p.seg.positions <= cuda::kGroupedGemmSplitMaxPositions))) {
    const ExpandParams e = expand_of_grouped_gemm(p);
    if (cuda::mma_kernels_serve(e)) {
      C10_CUDA_CHECK(cuda::launch_lora_expand(e, cuda::ExpandKernel::Segments, /*inputs_ready=*/false,
                                              device_attribute(cudaDevAttrComputeCapabilityMajor, device), stream));
      return;
    }
  }
  // A short K (LoRA expand) or few columns (LoRA shrink) is memory-bound: the skinny paths stream it.
  const bool skinny = preferred == GroupedGemmKernel::Skinny ||
                      (automatic &&
                       (p.k <= cuda::kGroupedGemmExpandMaxK || p.n <= cuda::kGroupedGemmNarrowMaxN));
  if (skinny && p.k <= cuda::kGroupedGemmExpandMaxK) {
    C10_CUDA_CHECK(cuda::launch_grouped_gemm_expand(p, sms, stream));
    return;
  }
  C10_CUDA_CHECK(cuda::launch_grouped_gemm_tile(p, /*narrow=*/skinny, stream));
}

// LORA_OPS_CUDA_LINEAR_KERNEL=cutlass|cublas: fold_linear on the sm_90a CUTLASS kernels wherever they serve (any
// number of tokens), or never on them (at::linear, or cuBLASLt where LORA_OPS_CUDA_FOLD_BLAS=cublaslt forces it); unset
// or "auto": the CUTLASS kernels up to kFoldLinearMaxTokens tokens where they serve, LORA_OPS_CUDA_FOLD_BLAS's
// library elsewhere (and with a bias: the fold route's bias_cat is rare, e.g. Qwen2's qkv, and cuBLAS and cuBLASLt
// add it in their epilogue).
enum class FoldLinearKernel { Auto, Cutlass, Cublas };
// LORA_OPS_CUDA_FOLD_BLAS=cublaslt|cublas: fold_linear's calls that the CUTLASS kernel does not take on cuBLASLt
// (cuda::fold_linear_lt) wherever it serves them (fp16/bf16, x contiguous, a bias of x's dtype, every operand and
// row 16-byte aligned), or always on at::linear; unset or "auto": cuBLASLt where it was measured to win, past
// kFoldLinearMaxTokens up to kFoldLinearLtMaxTokens tokens on a 9.x device, at::linear elsewhere.
enum class FoldBlas { Auto, Cublaslt, Cublas };

at::Tensor fold_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& seg_indptr, int64_t slot_rows) {
  check_fold_linear_host(weight, seg_indptr, slot_rows);
  const auto preferred =
      preferred_kernel<FoldLinearKernel>("LORA_OPS_CUDA_LINEAR_KERNEL", {"cutlass", "cublas"});
  const auto blas = preferred_kernel<FoldBlas>("LORA_OPS_CUDA_FOLD_BLAS", {"cublaslt", "cublas"});
  const bool has_bias = bias.has_value() && bias->defined();
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  if (!half || x.dim() < 1 || weight.dim() != 2 || x.scalar_type() != weight.scalar_type() ||
      x.device() != weight.device() || x.size(-1) != weight.size(1) || !x.is_contiguous() || weight.stride(1) != 1 ||
      weight.stride(0) < weight.size(1) || (preferred == FoldLinearKernel::Cublas && blas != FoldBlas::Cublaslt)) {
    return at::linear(x, weight, bias);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  const int64_t k = weight.size(1), n = weight.size(0), t = k > 0 ? x.numel() / k : 0;
  const int cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  cuda::FoldLinearParams p{x.data_ptr(), weight.data_ptr(), nullptr, t, n, k, k, weight.stride(0),
                           x.scalar_type() == at::kHalf ? DType::F16 : DType::BF16};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor y;  // made once a kernel takes the call (at::linear makes its own)
  if (!has_bias && preferred != FoldLinearKernel::Cublas &&
      (preferred == FoldLinearKernel::Cutlass || t <= cuda::kFoldLinearMaxTokens) &&
      cuda::fold_linear_sm90_supported(p, cc_major, device_attribute(cudaDevAttrComputeCapabilityMinor, device))) {
    // int32 as the kernel reads it, converted only here: the other paths compute every row
    const at::Tensor slots_indptr = seg_indptr.has_value() ? kernel_index(*seg_indptr) : at::Tensor();
    if (slots_indptr.defined()) {
      p.seg_indptr = slots_indptr.data_ptr<int32_t>();
      p.num_slots = slots_indptr.size(0) - 1;
      p.slot_rows = slot_rows;
    }
    y = at::empty(sizes, x.options());
    p.y = y.data_ptr();
    const cudaError_t err = cuda::launch_fold_linear_sm90(p, stream);
    if (err != cudaErrorNotSupported) {
      C10_CUDA_CHECK(err);
      return y;
    }
    p.seg_indptr = nullptr, p.num_slots = 0, p.slot_rows = 0;
  }
  const bool bias_served = !has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                                         bias->scalar_type() == x.scalar_type() && bias->device() == x.device());
  const bool lt_measured = cc_major == 9 && t > cuda::kFoldLinearMaxTokens && t <= cuda::kFoldLinearLtMaxTokens;
  if (t > 0 && n > 0 && k > 0 && bias_served &&
      (blas == FoldBlas::Cublaslt || (blas == FoldBlas::Auto && lt_measured))) {
    if (!y.defined()) y = at::empty(sizes, x.options());
    p.y = y.data_ptr();
    if (cuda::fold_linear_lt(p, has_bias ? bias->data_ptr() : nullptr, device, stream)) return y;
  }
  return at::linear(x, weight, bias);
}

// lora_linear's kernel parameters on the weights' side (W, A, B, the slices) for x's t contiguous rows at x_ptr,
// when the sm_90a kernels serve them on x's device (cuda::lora_linear_sm90_supported: dtype, sizes, strides,
// alignment, CUTLASS's own checks); nullopt elsewhere. S: the slices, as the checks counted them.
std::optional<cuda::LoraLinearParams> lora_linear_sm90_params(const void* x_ptr, int64_t t, const at::Tensor& weight,
                                                              const at::Tensor& lora_a, const at::Tensor& lora_b,
                                                              at::OptionalIntArrayRef slice_offsets, int64_t S) {
  const int64_t N = weight.size(0), K = weight.size(1), L = lora_a.size(0), R = S > 0 ? lora_a.size(1) / S : 0;
  const auto dtype = weight.scalar_type();
  if ((dtype != at::kHalf && dtype != at::kBFloat16) || L == 0 || R == 0 || (L != 1 && lora_b.stride(0) != R)) {
    return std::nullopt;  // B's [N, L*R] view needs each row's slots side by side
  }
  cuda::LoraLinearParams p{};
  p.x = x_ptr;
  p.w = weight.data_ptr();
  p.lora_a = lora_a.data_ptr();
  p.b_cols = lora_b.data_ptr();
  p.t = t, p.n = N, p.k = K, p.x_row_stride = K, p.w_row_stride = weight.stride(0);
  p.a_slot_stride = lora_a.stride(0), p.a_row_stride = lora_a.stride(1), p.b_row_stride = lora_b.stride(1);
  p.num_slots = L, p.rank = R, p.num_slices = S;
  p.slice_offsets[0] = 0;
  for (int64_t s = 1; s <= S; ++s) p.slice_offsets[s] = slice_offsets.has_value() ? (*slice_offsets)[s] : N;
  p.dtype = dtype == at::kHalf ? DType::F16 : DType::BF16;
  const int device = weight.get_device();
  p.sm_count = device_attribute(cudaDevAttrMultiProcessorCount, device);
  p.tile_65_128 = preferred_kernel<cuda::KextTile>("LORA_OPS_CUDA_KEXT_TILE", {"128x128", "64x128"});
  if (!cuda::lora_linear_sm90_supported(p, device_attribute(cudaDevAttrComputeCapabilityMajor, device),
                                        device_attribute(cudaDevAttrComputeCapabilityMinor, device))) {
    return std::nullopt;
  }
  return p;
}

// lora_linear on the sm_90a kernels (a shrink, then the K-extended GEMM launched programmatically) where they serve:
// up to kLoraLinearMaxTokens rows, contiguous x, lora_b with each row's slots side by side (the adapter pool's
// kext_lora_b); a bias is added after the GEMM. Elsewhere the ATen composition. LORA_OPS_CUDA_LINEAR_KERNEL=cublas
// forces the composition (its GEMMs are ATen's), as it keeps fold_linear off the CUTLASS kernel.
at::Tensor lora_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                            const at::Tensor& lora_b, const at::Tensor& token_slot,
                            const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                            const std::optional<at::Tensor>& bias) {
  const int64_t S = check_lora_linear_host(x, weight, lora_a, lora_b, token_slot, lora_scales, slice_offsets, bias);
  const auto preferred =
      preferred_kernel<FoldLinearKernel>("LORA_OPS_CUDA_LINEAR_KERNEL", {"cutlass", "cublas"});
  if (preferred != FoldLinearKernel::Cublas && x.scalar_type() == weight.scalar_type() && x.is_contiguous()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t T = token_slot.size(0), N = weight.size(0), L = lora_a.size(0), R = lora_a.size(1) / S;
    if (auto p = lora_linear_sm90_params(x.data_ptr(), T, weight, lora_a, lora_b, slice_offsets, S)) {
      const at::Tensor slots = kernel_index(token_slot);
      const at::Tensor scales = lora_scales.has_value() ? lora_scales->contiguous()
                                                        : at::ones({L}, x.options().dtype(at::kFloat));
      const at::Tensor h = at::empty({T, S * L * R}, x.options());
      auto sizes = x.sizes().vec();
      sizes.back() = N;
      const at::Tensor y = at::empty(sizes, x.options());
      p->token_slot = slots.data_ptr<int32_t>();
      p->scales = scales.data_ptr<float>();
      p->h = h.data_ptr();
      p->y = y.data_ptr();
      C10_CUDA_CHECK(cuda::launch_lora_linear_sm90(*p, c10::cuda::getCurrentCUDAStream()));
      if (bias.has_value()) y.add_(*bias);
      return y;
    }
  }
  return lora_linear_composite(x, weight, lora_a, lora_b, token_slot, lora_scales, slice_offsets, bias);
}

// Whether lora_linear's sm_90a kernels serve a layer of these weights at every T from 1 to kLoraLinearMaxTokens
// (one T per token tile, with the W tile that T takes under LORA_OPS_CUDA_KEXT_TILE as it is now; each call checks
// again with the variable as it is then, and runs the composition where its tile does not serve; x contiguous and
// 16-byte aligned, as a fresh allocation is; weight's own address stands in for it): the serving layer asks once
// per module, and takes its kext route only where they run. Tensors the op would refuse answer false.
bool lora_linear_kernels_serve_cuda(const at::Tensor& weight, const at::Tensor& lora_a, const at::Tensor& lora_b,
                                    at::OptionalIntArrayRef slice_offsets) {
  if (weight.dim() != 2 || lora_a.dim() != 3 || lora_b.dim() != 3 || lora_a.scalar_type() != weight.scalar_type() ||
      lora_b.scalar_type() != weight.scalar_type() || weight.stride(1) != 1 || lora_a.stride(2) != 1 ||
      lora_b.stride(2) != 1) {
    return false;
  }
  int64_t S = 0;
  try {  // the op's own shape checks
    S = check_adapter_shapes_host("lora_ops._lora_linear_kernels_serve", lora_a, lora_b, weight.sym_size(1),
                                  weight.sym_size(0), "weight.size(1)", "weight.size(0)", slice_offsets);
  } catch (const c10::Error&) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(weight.device());
  for (const int64_t t : cuda::kLoraLinearTileTokens) {
    if (!lora_linear_sm90_params(weight.data_ptr(), t, weight, lora_a, lora_b, slice_offsets, S)) return false;
  }
  return true;
}

// The kernels and their Triton twins share one signature (the op's schema).
static_assert(std::is_same_v<decltype(sgmv_cuda), op_table::SgmvSignature>);
static_assert(std::is_same_v<decltype(lora_expand_cuda), op_table::LoraExpandSignature>);
static_assert(std::is_same_v<decltype(grouped_gemm_cuda), op_table::GroupedGemmSignature>);

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_segments_cuda(const at::Tensor& token_lora, int64_t num_slots) {
  const c10::cuda::CUDAGuard guard(token_lora.device());
  TORCH_CHECK_VALUE(num_slots <= cuda::build_segments_max_slots(), "lora_ops.build_segments: num_slots = ",
                    std::to_string(num_slots), " exceeds the CUDA kernel's shared-memory histogram (max ",
                    std::to_string(cuda::build_segments_max_slots()), ")");
  at::Tensor token_indices, seg_indptr, seg_lora, token_lora_i32;
  const auto p = check_build_segments(token_lora, num_slots, token_indices, seg_indptr, seg_lora, token_lora_i32);
  C10_CUDA_CHECK(cuda::launch_build_segments(p, c10::cuda::getCurrentCUDAStream()));
  return {token_indices, seg_indptr, seg_lora};
}

}  // namespace
}  // namespace lora_ops

TORCH_LIBRARY_IMPL(lora_ops, CUDA, m) {
  m.impl("sgmv", &lora_ops::sgmv_cuda);
  m.impl("lora_expand", &lora_ops::lora_expand_cuda);
  m.impl("grouped_gemm", &lora_ops::grouped_gemm_cuda);
  m.impl("build_segments", &lora_ops::build_segments_cuda);
  m.impl("fold_linear", &lora_ops::fold_linear_cuda);
  m.impl("lora_linear", &lora_ops::lora_linear_cuda);
  m.impl("_lora_linear_kernels_serve", &lora_ops::lora_linear_kernels_serve_cuda);
}
