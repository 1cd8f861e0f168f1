#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <cstdlib>
#include <unordered_set>

namespace lora_ops {
namespace {

// Messages format numbers with std::to_string and never stream them: on the H200 image (torch 2.11) an
// ostream number insertion made from this library crashed the process instead of raising.
std::string num(int64_t v) { return std::to_string(v); }

std::string list_str(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

std::string shape_str(const at::Tensor& t) { return list_str(t.sizes()); }

DType to_dtype(at::ScalarType s) {
  switch (s) {
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: return DType::F32;
  }
}

bool is_float_type(at::ScalarType s) { return s == at::kHalf || s == at::kBFloat16 || s == at::kFloat; }

void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_float_type(t.scalar_type()), op, ": ", name,
                   " must be float16, bfloat16 or float32, got ", t.scalar_type());
}

void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", num(dim), "-D ", layout, ", got shape ",
                    shape_str(t));
}

void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& y) {
  TORCH_CHECK_VALUE(t.device() == y.device(), op, ": ", name, " is on ", t.device().str(),
                    " but y is on ", y.device().str(), "; all tensors must be on one device");
}

// Unit stride in the last dimension (a size-1 dimension has no meaningful stride).
void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  const int64_t d = t.dim() - 1;
  TORCH_CHECK_VALUE(t.size(d) <= 1 || t.stride(d) == 1, op, ": ", name,
                    " must have unit stride in its last dimension, got strides ", list_str(t.strides()));
}

void check_output_rows(const char* op, const at::Tensor& y) {
  // Rows of y must not overlap, or two rows' updates would race on one element.
  TORCH_CHECK_VALUE(y.size(0) <= 1 || y.size(1) == 0 || y.stride(0) >= y.size(1), op,
                    ": y rows overlap in memory (row stride ", num(y.stride(0)), " < ", num(y.size(1)),
                    " columns); pass a tensor whose rows are disjoint");
}

// 1-D index tensor of an int type and a given length (-1: any); returned as contiguous int32.
at::Tensor index_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& y,
                        int64_t expected_len, const char* len_what) {
  check_device(op, name, t, y);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(expected_len < 0 || t.size(0) == expected_len, op, ": ", name, " must have ",
                    num(expected_len), " entries (", len_what, "), got ", num(t.size(0)));
  return t.scalar_type() == at::kInt ? t.contiguous() : t.to(at::kInt).contiguous();
}

Segments check_segments(const char* op, const char* slot_name, const at::Tensor& y,
                        const at::Tensor& seg_indptr, const at::Tensor& seg_slot,
                        const std::optional<at::Tensor>& token_indices, at::Tensor& indptr_out,
                        at::Tensor& slot_out, at::Tensor& idx_out) {
  indptr_out = index_tensor(op, "seg_indptr", seg_indptr, y, -1, "");
  TORCH_CHECK_VALUE(indptr_out.size(0) >= 1, op, ": seg_indptr must have num_segments + 1 >= 1 entries, got 0");
  const int64_t num_segments = indptr_out.size(0) - 1;
  slot_out = index_tensor(op, slot_name, seg_slot, y, num_segments, "one per segment: len(seg_indptr) - 1");
  Segments seg{};
  seg.indptr = indptr_out.data_ptr<int32_t>();
  seg.slot = slot_out.data_ptr<int32_t>();
  seg.num_segments = num_segments;
  seg.positions = y.size(0);
  if (token_indices.has_value()) {
    idx_out = index_tensor(op, "token_indices", *token_indices, y, -1, "");
    seg.token_indices = idx_out.data_ptr<int32_t>();
    seg.positions = idx_out.size(0);
  }
  return seg;
}

}  // namespace

SgmvParams check_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales,
                      at::OptionalIntArrayRef slice_offsets, double scale, SgmvIndexTensors& keep) {
  constexpr const char* op = "lora_ops.sgmv";
  check_dim(op, "y", y, 2, "[T, N]");
  check_dim(op, "x", x, 2, "[T, K]");
  check_dim(op, "lora_a", lora_a, 3, "[L, S*R, K]");
  check_dim(op, "lora_b", lora_b, 3, "[L, N, R]");
  for (auto [name, t] : {std::pair{"x", &x}, {"lora_a", &lora_a}, {"lora_b", &lora_b}}) {
    check_device(op, name, *t, y);
  }
  check_float(op, "x", x);
  TORCH_CHECK_TYPE(lora_a.scalar_type() == x.scalar_type(), op, ": lora_a must have x's dtype ",
                   x.scalar_type(), ", got ", lora_a.scalar_type());
  TORCH_CHECK_TYPE(lora_b.scalar_type() == x.scalar_type(), op, ": lora_b must have x's dtype ",
                   x.scalar_type(), ", got ", lora_b.scalar_type());
  TORCH_CHECK_TYPE(y.scalar_type() == x.scalar_type() || y.scalar_type() == at::kFloat, op,
                   ": y must have x's dtype ", x.scalar_type(), " or float32, got ", y.scalar_type());

  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0);
  TORCH_CHECK_VALUE(y.size(0) == T, op, ": y has ", num(y.size(0)), " rows but x has ", num(T));
  TORCH_CHECK_VALUE(lora_a.size(2) == K, op, ": lora_a must be [L, S*R, K] with K = x.size(1) = ", num(K),
                    ", got shape ", shape_str(lora_a));
  TORCH_CHECK_VALUE(lora_b.size(0) == L, op, ": lora_b must have L = lora_a.size(0) = ", num(L),
                    " slots, got shape ", shape_str(lora_b));
  TORCH_CHECK_VALUE(lora_b.size(1) == N, op, ": lora_b must be [L, N, R] with N = y.size(1) = ", num(N),
                    ", got shape ", shape_str(lora_b));

  std::vector<int64_t> offsets = slice_offsets.has_value()
                                     ? std::vector<int64_t>(slice_offsets->begin(), slice_offsets->end())
                                     : std::vector<int64_t>{0, N};
  const int64_t S = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK_VALUE(S >= 1 && S <= kMaxSlices, op, ": slice_offsets must have 2 to ", num(kMaxSlices + 1),
                    " entries, got ", num((int64_t)offsets.size()));
  TORCH_CHECK_VALUE(offsets.front() == 0 && offsets.back() == N, op,
                    ": slice_offsets must start at 0 and end at N = ", num(N), ", got ", list_str(offsets));
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(offsets[s] <= offsets[s + 1], op, ": slice_offsets must be non-decreasing, got ",
                      list_str(offsets));
  }
  TORCH_CHECK_VALUE(lora_a.size(1) % S == 0, op, ": lora_a.size(1) = ", num(lora_a.size(1)),
                    " must be S*R for S = ", num(S), " slices");
  const int64_t R = lora_a.size(1) / S;
  TORCH_CHECK_VALUE(lora_b.size(2) == R, op, ": lora_b must be [L, N, R] with R = lora_a.size(1) / S = ", num(R),
                    ", got shape ", shape_str(lora_b));

  check_unit_last_stride(op, "x", x);
  check_unit_last_stride(op, "y", y);
  check_unit_last_stride(op, "lora_a", lora_a);
  check_unit_last_stride(op, "lora_b", lora_b);
  check_output_rows(op, y);

  SgmvParams p{};
  p.seg = check_segments(op, "seg_lora", y, seg_indptr, seg_lora, token_indices, keep.seg_indptr,
                         keep.seg_lora, keep.token_indices);
  if (lora_ranks.has_value()) {
    keep.lora_ranks = index_tensor(op, "lora_ranks", *lora_ranks, y, L, "one per slot: lora_a.size(0)");
    p.lora_ranks = keep.lora_ranks.data_ptr<int32_t>();
  }
  if (lora_scales.has_value()) {
    check_device(op, "lora_scales", *lora_scales, y);
    TORCH_CHECK_TYPE(lora_scales->scalar_type() == at::kFloat, op, ": lora_scales must be float32, got ",
                     lora_scales->scalar_type());
    TORCH_CHECK_VALUE(lora_scales->dim() == 1 && lora_scales->size(0) == L, op,
                      ": lora_scales must be 1-D with L = ", num(L), " entries, got shape ", shape_str(*lora_scales));
    keep.lora_scales = lora_scales->contiguous();
    p.lora_scales = keep.lora_scales.data_ptr<float>();
  }
  p.y = y.data_ptr();
  p.x = x.data_ptr();
  p.lora_a = lora_a.data_ptr();
  p.lora_b = lora_b.data_ptr();
  p.y_row_stride = y.stride(0);
  p.x_row_stride = x.stride(0);
  p.a_stride0 = lora_a.stride(0);
  p.a_stride1 = lora_a.stride(1);
  p.b_stride0 = lora_b.stride(0);
  p.b_stride1 = lora_b.stride(1);
  p.x_dtype = to_dtype(x.scalar_type());
  p.y_dtype = to_dtype(y.scalar_type());
  p.rows = T;
  p.k = K;
  p.n = N;
  p.num_slots = L;
  p.max_rank = R;
  p.num_slices = S;
  for (int64_t s = 0; s <= S; ++s) p.slice_offsets[s] = offsets[s];
  p.scale = static_cast<float>(scale);
  if (debug_checks_enabled()) {
    debug_validate_segments(p.seg, keep.seg_indptr, keep.seg_lora, keep.token_indices, T, L, "seg_lora");
    if (keep.lora_ranks.defined()) {
      const auto ranks = keep.lora_ranks.cpu();
      for (int64_t l = 0; l < L; ++l) {
        const int32_t r = ranks.data_ptr<int32_t>()[l];
        TORCH_CHECK_VALUE(r >= 0 && r <= R, "LORA_OPS_DEBUG: lora_ranks[", num(l), "] = ", num(r),
                          " is outside [0, R = ", num(R), "]");
      }
    }
  }
  return p;
}

GroupedGemmParams check_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                     const std::optional<at::Tensor>& token_indices,
                                     const std::optional<at::Tensor>& n_sizes,
                                     const std::optional<at::Tensor>& k_sizes, double alpha,
                                     bool accumulate, GroupedGemmIndexTensors& keep) {
  constexpr const char* op = "lora_ops.grouped_gemm";
  check_dim(op, "y", y, 2, "[T, N]");
  check_dim(op, "x", x, 2, "[T, K]");
  check_dim(op, "w", w, 3, "[L, N, K]");
  check_device(op, "x", x, y);
  check_device(op, "w", w, y);
  check_float(op, "w", w);
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type() || x.scalar_type() == at::kFloat, op,
                   ": x must have w's dtype ", w.scalar_type(), " or float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(y.scalar_type() == w.scalar_type() || y.scalar_type() == at::kFloat, op,
                   ": y must have w's dtype ", w.scalar_type(), " or float32, got ", y.scalar_type());
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = w.size(0);
  TORCH_CHECK_VALUE(y.size(0) == T, op, ": y has ", num(y.size(0)), " rows but x has ", num(T));
  TORCH_CHECK_VALUE(w.size(1) == N && w.size(2) == K, op, ": w must be [L, N, K] with N = y.size(1) = ", num(N),
                    " and K = x.size(1) = ", num(K), ", got shape ", shape_str(w));
  check_unit_last_stride(op, "x", x);
  check_unit_last_stride(op, "y", y);
  check_unit_last_stride(op, "w", w);
  check_output_rows(op, y);

  GroupedGemmParams p{};
  p.seg = check_segments(op, "seg_weight", y, seg_indptr, seg_weight, token_indices, keep.seg_indptr,
                         keep.seg_weight, keep.token_indices);
  if (n_sizes.has_value()) {
    keep.n_sizes = index_tensor(op, "n_sizes", *n_sizes, y, L, "one per group: w.size(0)");
    p.n_sizes = keep.n_sizes.data_ptr<int32_t>();
  }
  if (k_sizes.has_value()) {
    keep.k_sizes = index_tensor(op, "k_sizes", *k_sizes, y, L, "one per group: w.size(0)");
    p.k_sizes = keep.k_sizes.data_ptr<int32_t>();
  }
  p.y = y.data_ptr();
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.y_row_stride = y.stride(0);
  p.x_row_stride = x.stride(0);
  p.w_stride0 = w.stride(0);
  p.w_stride1 = w.stride(1);
  p.x_dtype = to_dtype(x.scalar_type());
  p.w_dtype = to_dtype(w.scalar_type());
  p.y_dtype = to_dtype(y.scalar_type());
  p.rows = T;
  p.k = K;
  p.n = N;
  p.num_groups = L;
  p.alpha = static_cast<float>(alpha);
  p.accumulate = accumulate;
  if (debug_checks_enabled()) {
    debug_validate_segments(p.seg, keep.seg_indptr, keep.seg_weight, keep.token_indices, T, L, "seg_weight");
  }
  return p;
}

at::Tensor check_build_segments_args(const at::Tensor& token_lora, int64_t num_slots) {
  constexpr const char* op = "lora_ops.build_segments";
  TORCH_CHECK_VALUE(num_slots >= 0, op, ": num_slots must be >= 0, got ", num(num_slots));
  TORCH_CHECK_VALUE(num_slots < (int64_t{1} << 30), op, ": num_slots must be < 2^30, got ", num(num_slots));
  return index_tensor(op, "token_lora", token_lora, token_lora, -1, "");
}

BuildSegmentsParams check_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                         at::Tensor& token_indices, at::Tensor& seg_indptr,
                                         at::Tensor& seg_lora, at::Tensor& token_lora_i32) {
  token_lora_i32 = check_build_segments_args(token_lora, num_slots);
  const auto opts = token_lora.options().dtype(at::kInt);
  token_indices = at::empty({token_lora.size(0)}, opts);
  seg_indptr = at::empty({num_slots + 1}, opts);
  seg_lora = at::empty({num_slots}, opts);
  BuildSegmentsParams p{};
  p.token_lora = token_lora_i32.data_ptr<int32_t>();
  p.token_indices = token_indices.data_ptr<int32_t>();
  p.seg_indptr = seg_indptr.data_ptr<int32_t>();
  p.seg_lora = seg_lora.data_ptr<int32_t>();
  p.num_tokens = token_lora.size(0);
  p.num_slots = num_slots;
  return p;
}

bool debug_checks_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("LORA_OPS_DEBUG");
    return v != nullptr && std::string(v) == "1";
  }();
  return enabled;
}

void debug_validate_segments(const Segments& seg, const at::Tensor& seg_indptr, const at::Tensor& seg_slot,
                             const at::Tensor& token_indices, int64_t rows, int64_t num_slots,
                             const char* slot_name) {
  const auto indptr = seg_indptr.cpu();
  const auto slot = seg_slot.cpu();
  const auto* ip = indptr.data_ptr<int32_t>();
  const auto* sl = slot.data_ptr<int32_t>();
  at::Tensor idx_cpu;
  const int32_t* idx = nullptr;
  if (token_indices.defined()) {
    idx_cpu = token_indices.cpu();
    idx = idx_cpu.data_ptr<int32_t>();
  }
  std::unordered_set<int32_t> seen;
  for (int64_t g = 0; g < seg.num_segments; ++g) {
    TORCH_CHECK_VALUE(ip[g] >= 0 && ip[g] <= ip[g + 1] && ip[g + 1] <= seg.positions,
                      "LORA_OPS_DEBUG: seg_indptr[", num(g), ":", num(g + 2), "] = [", num(ip[g]), ", ",
                      num(ip[g + 1]), "] is not a non-decreasing range inside [0, ", num(seg.positions), "]");
    TORCH_CHECK_VALUE(sl[g] < num_slots, "LORA_OPS_DEBUG: ", slot_name, "[", num(g), "] = ", num(sl[g]),
                      " is not below the number of slots ", num(num_slots), " (use -1 for no LoRA)");
    if (sl[g] < 0) continue;
    for (int64_t p = ip[g]; p < ip[g + 1]; ++p) {
      const int32_t t = idx ? idx[p] : static_cast<int32_t>(p);
      TORCH_CHECK_VALUE(t >= 0 && t < rows, "LORA_OPS_DEBUG: token_indices[", num(p), "] = ", num(t),
                        " is outside [0, ", num(rows), ")");
      TORCH_CHECK_VALUE(seen.insert(t).second, "LORA_OPS_DEBUG: row ", num(t),
                        " appears in more than one segment position");
    }
  }
}

}  // namespace lora_ops
