// The one place the ops are defined (docs/design.md §1): schemas, Meta kernels, and the Python module that holds
// their fake/autograd registrations. Device kernels register themselves from csrc/<backend>/registration.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

#include "common/checks.h"
#include "common/lora_linear.h"
#include "common/op_table.h"
#include "common/schemas.h"

namespace {

// The Meta kernels run the host argument checks (everything but reading device values), so that fake tensors
// (torch.compile, export) and mixed-device calls routed to Meta raise the same errors as a real call.
// sgmv and grouped_gemm only mutate y: past the checks there is nothing to compute or allocate.
void sgmv_meta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& seg_indptr, const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
               const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
               at::OptionalIntArrayRef slice_offsets, double scale) {
  lora_ops::check_sgmv_host(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                            slice_offsets);
  lora_ops::check_scale("lora_ops::sgmv", "scale", scale);
}

void lora_expand_meta(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                      const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                      double scale) {
  lora_ops::check_lora_expand_host(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                                   slice_offsets);
  lora_ops::check_scale("lora_ops::lora_expand", "scale", scale);
}

void grouped_gemm_meta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                       const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                       const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes,
                       double alpha, bool) {
  lora_ops::check_grouped_gemm_host(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes);
  lora_ops::check_scale("lora_ops::grouped_gemm", "alpha", alpha);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_segments_meta(const at::Tensor& token_lora,
                                                                   int64_t num_slots) {
  lora_ops::check_build_segments_host(token_lora, num_slots);
  const auto opts = token_lora.options().dtype(at::kInt);
  return {at::empty_symint({token_lora.sym_size(0)}, opts), at::empty({num_slots + 1}, opts),
          at::empty({num_slots}, opts)};
}

// lora_linear on fake tensors: the checks, and y [..., N] of x's dtype.
at::Tensor lora_linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                            const at::Tensor& lora_b, const at::Tensor& token_slot,
                            const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                            const std::optional<at::Tensor>& bias) {
  lora_ops::check_lora_linear_host(x, weight, lora_a, lora_b, token_slot, lora_scales, slice_offsets, bias);
  auto sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

std::optional<at::Tensor> if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The host-side contract checks as ops of their own, so that Python backends (Triton) run the very same checks
// as the C++ kernels instead of a copy of them, and receive the index tensors from the one conversion
// (int32, contiguous, int64 saturated; an int32 contiguous input comes back as itself). One device-agnostic
// kernel serves every dispatch key (on Meta it skips the LORA_OPS_DEBUG value checks).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> check_sgmv_op(
    const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
    const at::Tensor& seg_indptr, const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
    const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
    at::OptionalIntArrayRef slice_offsets) {
  auto t = lora_ops::sgmv_index_tensors(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks,
                                        lora_scales, slice_offsets);
  return {t.seg_indptr, t.seg_lora, if_defined(t.token_indices), if_defined(t.lora_ranks)};
}

std::tuple<std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
check_lora_expand_op(
    const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b, const std::optional<at::Tensor>& seg_indptr,
    const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
    const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
    at::OptionalIntArrayRef slice_offsets) {
  auto t = lora_ops::lora_expand_index_tensors(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks,
                                               lora_scales, slice_offsets);
  return {if_defined(t.seg_indptr), t.seg_lora, if_defined(t.token_indices), if_defined(t.lora_ranks)};
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
check_grouped_gemm_op(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& seg_indptr,
                      const at::Tensor& seg_weight, const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes) {
  auto t = lora_ops::grouped_gemm_index_tensors(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes);
  return {t.seg_indptr, t.seg_weight, if_defined(t.token_indices), if_defined(t.n_sizes), if_defined(t.k_sizes)};
}

// fold_linear on every backend but CUDA (and on Meta: fake tensors): the slot windows' checks, then at::linear,
// whose checks and errors it keeps, over every row of weight (only the CUDA kernel skips unused slots' windows).
at::Tensor fold_linear_default(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& seg_indptr, int64_t slot_rows) {
  lora_ops::check_fold_linear_host(weight, seg_indptr, slot_rows);
  return at::linear(x, weight, bias);
}

// fold_linear under autograd: where a gradient is wanted, at::linear itself (its backward, autocast and transforms
// are torch's); otherwise the backend kernel below autograd (on CUDA the CUTLASS GEMM). No autograd node on the
// inference path, so an eager call under no_grad costs what a plain dispatch does.
at::Tensor fold_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& seg_indptr, int64_t slot_rows) {
  const bool bias_grad = bias.has_value() && bias->defined() && bias->requires_grad();
  if (c10::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias_grad)) {
    lora_ops::check_fold_linear_host(weight, seg_indptr, slot_rows);
    return at::linear(x, weight, bias);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("lora_ops::fold_linear", "")
                             .typed<decltype(fold_linear_default)>();
  return op.call(x, weight, bias, seg_indptr, slot_rows);
}

at::Tensor check_build_segments_op(const at::Tensor& token_lora, int64_t num_slots) {
  return lora_ops::build_segments_token_lora(token_lora, num_slots);
}

}  // namespace

TORCH_LIBRARY(lora_ops, m) {
  m.set_python_module("lora_ops.ops");
  m.def((std::string("sgmv") + lora_ops::schema::kSgmv).c_str());
  m.def((std::string("grouped_gemm") + lora_ops::schema::kGroupedGemm).c_str());
  // y += h·Bᵀ per row with the row's own slot window of h [T, L, S*R] (the shrink done elsewhere, e.g. folded
  // into the base layer's GEMM).
  m.def((std::string("lora_expand") + lora_ops::schema::kLoraExpand).c_str());
  m.def((std::string("build_segments") + lora_ops::schema::kBuildSegments).c_str());
  // y = x·weightᵀ (+ bias): the fold route's GEMM against [W; A of every slot]. at::linear on every backend; on
  // sm_90 the extension's own cuBLASLt call at 65-128 tokens, and at decode sizes a GEMM that lets the lora_expand
  // launched after it start before it ends (PDL). Unlike the ops above it has a backward: linear's,
  // wherever a gradient is wanted.
  m.def((std::string("fold_linear") + lora_ops::schema::kFoldLinear).c_str());
  // A whole multi-LoRA linear layer, y = x·weightᵀ (+ bias) + each row's delta with h rounded to x's dtype, from
  // the rows' own slots (no segments): on sm_90 at decode sizes a shrink and one K-extended GEMM (the kext route).
  m.def((std::string("lora_linear") + lora_ops::schema::kLoraLinear).c_str());
  // Whether lora_linear's own CUDA kernels serve a layer of these weights up to their token bound (false on every
  // backend but CUDA): the serving layer's kext route is taken only where they do.
  m.def("_lora_linear_kernels_serve(Tensor weight, Tensor lora_a, Tensor lora_b, int[]? slice_offsets=None) -> bool");
  // The Triton kernels of sgmv, lora_expand and grouped_gemm under names of their own (registered for CUDA from
  // Python), so that a caller choosing the backend per regime (lora_ops/routes.py, the CUDA kernels' op table)
  // reaches either one through the dispatcher.
  m.def((std::string("_triton_sgmv") + lora_ops::schema::kSgmv).c_str());
  m.def((std::string("_triton_lora_expand") + lora_ops::schema::kLoraExpand).c_str());
  m.def((std::string("_triton_grouped_gemm") + lora_ops::schema::kGroupedGemm).c_str());
  // Return the index tensors as the kernels read them: (seg_indptr, slots, token_indices, then per-slot sizes).
  m.def(
      "_check_sgmv(Tensor y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor seg_lora, "
      "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
      "int[]? slice_offsets=None) -> (Tensor, Tensor, Tensor?, Tensor?)");
  m.def(
      "_check_lora_expand(Tensor y, Tensor h, Tensor lora_b, Tensor? seg_indptr, Tensor seg_lora, "
      "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
      "int[]? slice_offsets=None) -> (Tensor?, Tensor, Tensor?, Tensor?)");
  m.def(
      "_check_grouped_gemm(Tensor y, Tensor x, Tensor w, Tensor seg_indptr, Tensor seg_weight, "
      "Tensor? token_indices=None, Tensor? n_sizes=None, Tensor? k_sizes=None) -> (Tensor, Tensor, Tensor?, "
      "Tensor?, Tensor?)");
  m.def("_check_build_segments(Tensor token_lora, int num_slots) -> Tensor");
  // The op table the CUDA kernels consult (csrc/common/op_table.h, lora_ops/op_table.py): its setter and its
  // lookup, in every build (host-only), so that both are tested without a GPU.
  m.def("_set_cuda_op_table(str op, str axes, int[] bounds_per_axis, int[] bounds, int[] triton) -> ()",
        &lora_ops::op_table::set_table);
  m.def("_cuda_op_table_choice(str op, int[] values) -> str", &lora_ops::op_table::choice);
}

TORCH_LIBRARY_IMPL(lora_ops, CompositeExplicitAutograd, m) {
  m.impl("fold_linear", &fold_linear_default);
  m.impl("lora_linear", &lora_ops::lora_linear_composite);
  m.impl("_lora_linear_kernels_serve",
         [](const at::Tensor&, const at::Tensor&, const at::Tensor&, at::OptionalIntArrayRef) { return false; });
  m.impl("_check_build_segments", &check_build_segments_op);
  m.impl("_check_sgmv", &check_sgmv_op);
  m.impl("_check_lora_expand", &check_lora_expand_op);
  m.impl("_check_grouped_gemm", &check_grouped_gemm_op);
}

// The ops that write y, and lora_linear, have no backward: with grad mode on, an input that requires grad is
// refused (a backward would otherwise silently miss the LoRA delta, y's autograd history being left as it was).
// A written y's version moves as after a native in-place op, so that autograd refuses a backward that saved y
// before: in the ADInplaceOrView kernel, as torch's own in-place ops do, since under torch.inference_mode() a
// normal tensor's write skips the Autograd keys but not that one. One pass over the arguments, no allocation:
// every op here writes at most one argument (y).
namespace {
// The argument the op writes (y), or an undefined tensor.
at::Tensor written_argument(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite() && stack[first + i].isTensor()) {
      return stack[first + i].toTensor();
    }
  }
  return {};
}

void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  const bool grad_mode = c10::GradMode::is_enabled();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    TORCH_CHECK(!(grad_mode && v.toTensor().requires_grad()), op.schema().name(), ": ", args[i].name(),
                " requires grad, and the op has no backward; call it under torch.no_grad() or "
                "torch.inference_mode()");
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// Outside inference mode this kernel runs for every call (the key is in the thread's included set), whatever keys
// the arguments carry: an inference-tensor y is refused here, before the kernel writes it (the version bump would
// raise only after the update, and a caller retrying would add the delta twice).
void bump_written_version(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const at::Tensor written = written_argument(op, *stack);
  TORCH_CHECK(!(written.defined() && written.is_inference() && !c10::InferenceMode::is_enabled()),
              op.schema().name(), ": y is an inference tensor (made under torch.inference_mode()): update it inside "
              "inference mode");
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  if (written.defined()) torch::autograd::impl::bump_version(written);
}

constexpr const char* kWritingOps[] = {"sgmv", "lora_expand", "grouped_gemm", "_triton_sgmv", "_triton_lora_expand",
                                       "_triton_grouped_gemm"};
}  // namespace

TORCH_LIBRARY_IMPL(lora_ops, Autograd, m) {
  m.impl("fold_linear", &fold_linear_autograd);
  m.impl("lora_linear", torch::CppFunction::makeFromBoxedFunction<&refuse_grad>());
  for (const char* op : kWritingOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_grad>());
}

TORCH_LIBRARY_IMPL(lora_ops, ADInplaceOrView, m) {
  for (const char* op : kWritingOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written_version>());
}

TORCH_LIBRARY_IMPL(lora_ops, Meta, m) {
  m.impl("sgmv", &sgmv_meta);
  m.impl("lora_linear", &lora_linear_meta);
  m.impl("lora_expand", &lora_expand_meta);
  m.impl("_triton_sgmv", &sgmv_meta);
  m.impl("_triton_lora_expand", &lora_expand_meta);
  m.impl("_triton_grouped_gemm", &grouped_gemm_meta);
  m.impl("grouped_gemm", &grouped_gemm_meta);
  m.impl("build_segments", &build_segments_meta);
}
