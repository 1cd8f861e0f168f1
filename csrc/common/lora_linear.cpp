#include "lora_linear.h"

#include <vector>

#include "checks.h"

namespace lora_ops {

// y = x . weight^T (+ bias), then per slice each row's delta h . B[slot, slice rows]^T in float32, added to the
// rounded base product and rounded again (without a bias, one rounding more than the kernels' single epilogue; with
// one, the kernels add it after their rounded y, here it is in the base product: at::linear's numbers, under torch's
// reduced-precision-reduction flags, as the base model's own). Both products run over every slot at once, dense
// (T x L*S*R, then T x L*R per output column), not a gather of A's or B's rows per token: h of every slot, each row's
// own window kept, the others zero.
at::Tensor lora_linear_composite(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                                 const at::Tensor& lora_b, const at::Tensor& token_slot,
                                 const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                                 const std::optional<at::Tensor>& bias) {
  const int64_t S = check_lora_linear_host(x, weight, lora_a, lora_b, token_slot, lora_scales, slice_offsets, bias);
  const int64_t K = x.size(-1), N = weight.size(0), L = lora_a.size(0), SR = lora_a.size(1), R = SR / S;
  const int64_t T = token_slot.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::linear(x.reshape({T, K}), weight, bias);
  if (T == 0 || L == 0 || R == 0 || K == 0 || N == 0) return y.reshape(out_sizes);

  const at::Tensor slot = token_slot.to(at::kLong);
  const at::Tensor valid = slot.ge(0).logical_and(slot.lt(L)).unsqueeze(1);  // [T, 1]
  const at::Tensor own = at::where(valid.squeeze(1), slot, 0).view({T, 1, 1});  // a valid slot for every row
  const at::Tensor xf = x.reshape({T, K}).to(at::kFloat);
  at::Tensor h = at::matmul(xf, lora_a.reshape({L * SR, K}).to(at::kFloat).t());  // [T, L*S*R]
  h = h.view({T, L, SR}).gather(1, own.expand({T, 1, SR})).squeeze(1);            // [T, S*R]: the own slot's
  if (lora_scales.has_value()) h = h * lora_scales->index_select(0, own.view({T})).unsqueeze(1);
  h = at::where(valid, h, 0).to(x.scalar_type());  // rounded once, as the kernels round it
  at::Tensor h_slots = at::zeros({T, L, SR}, x.options());
  h_slots.scatter_(1, own.expand({T, 1, SR}), h.unsqueeze(1));  // a row without a slot scatters zeros
  const at::Tensor h_float = h_slots.to(at::kFloat).view({T, L, S, R});
  const at::Tensor b_cols = lora_b.permute({1, 0, 2}).reshape({N, L * R});  // row n: every slot's B, side by side
  std::vector<int64_t> offsets = {0, N};
  if (slice_offsets.has_value()) offsets = slice_offsets->vec();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t lo = offsets[s], width = offsets[s + 1] - offsets[s];
    if (width == 0) continue;
    const at::Tensor delta =
        at::matmul(h_float.select(2, s).reshape({T, L * R}), b_cols.narrow(0, lo, width).to(at::kFloat).t());
    at::Tensor cols = y.narrow(1, lo, width);
    cols.copy_(cols.to(at::kFloat) + delta);
  }
  return y.reshape(out_sizes);
}

}  // namespace lora_ops
