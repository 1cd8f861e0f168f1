#include "checks.h"

#include <ATen/ATen.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace lora_ops {

std::string num(int64_t v) { return std::to_string(v); }

// The one conversion of index values for every backend (the Triton backend receives its tensors from here
// through torch.ops.lora_ops._check_*). int64 values outside the int32 range SATURATE to INT32_MIN/INT32_MAX
// instead of wrapping: every size they are compared with fits int32 (check_int32_extent), so a saturated value
// is skipped or clamped exactly as its true value would be. On the tensor's device, no host sync; int32
// contiguous input costs nothing, int64 pays two elementwise kernels.
at::Tensor kernel_index(const at::Tensor& t) {
  if (t.scalar_type() == at::kInt) return t.contiguous();
  return t.clamp(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()).to(at::kInt).contiguous();
}

namespace {

constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

using lora_ops::num;

// Sizes are SymInts so that the Meta kernels can run these checks on fake tensors with symbolic sizes.
std::string num(const c10::SymInt& v) {
  if (const auto i = v.maybe_as_int()) return std::to_string(*i);
  return v.toSymNodeImplUnowned()->str();
}

template <class Values>
std::string list_str(const Values& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + num(values[i]);
  return out + "]";
}

std::string shape_str(const at::Tensor& t) { return list_str(t.sym_sizes()); }

// A size relation that must hold (TORCH_SYM_CHECK's rule): concrete sizes take the fast path, symbolic ones
// guard on it, or defer it to a runtime assert when they are data-dependent.
bool holds(const c10::SymBool& b) { return b.expect_true(__FILE__, __LINE__); }

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

// `ref` (named ref_name) is the op's reference tensor: y for the ops that write one.
void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                  const char* ref_name = "y") {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device().str(), " but ", ref_name,
                    " is on ", ref.device().str(), "; all tensors must be on one device");
}

// Unit stride in the last dimension (a size-1 dimension has no meaningful stride).
void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  const int64_t d = t.dim() - 1;
  TORCH_CHECK_VALUE(holds(t.sym_size(d).sym_le(1) | t.sym_stride(d).sym_eq(1)), op, ": ", name,
                    " must have unit stride in its last dimension, got strides ", list_str(t.sym_strides()));
}

void check_output_rows(const char* op, const at::Tensor& y) {
  // Rows of y must not overlap, or two rows' updates would race on one element.
  TORCH_CHECK_VALUE(holds(y.sym_size(0).sym_le(1) | y.sym_size(1).sym_eq(0) | y.sym_stride(0).sym_ge(y.sym_size(1))),
                    op, ": y rows overlap in memory (row stride ", num(y.sym_stride(0)), " < ", num(y.sym_size(1)),
                    " columns); pass a tensor whose rows are disjoint");
}

// The tensor an optional holds, or an undefined one.
const at::Tensor& opt_or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// Bytes [lo, hi) of t's storage that t's dimensions from `first` on span, from t's first element (in bytes).
struct ByteSpan {
  int64_t lo, hi;
};
ByteSpan byte_span(const at::Tensor& t, int64_t first, int64_t origin) {
  int64_t lo = origin, hi = origin;
  for (int64_t d = first; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d) * (int64_t)t.element_size();
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi + (int64_t)t.element_size()};
}

// Whether a and b may share a byte of memory: not where their spans of addresses are disjoint, nor where both
// repeat with one outer (row) stride S and their footprints within a period of S are disjoint, e.g. the fold
// route's y = out[:, :N] and h = out[:, N:] (of one [T, N + L*S*R] buffer); otherwise yes (a layout too irregular
// to tell is refused rather than risked). By address, not by storage: two storages over one memory (numpy views,
// torch.frombuffer, DLPack) are compared as well. The tensors are on one device (checked before).
bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return false;
  const auto a0 = (int64_t)reinterpret_cast<intptr_t>(a.const_data_ptr());
  const auto b0 = (int64_t)reinterpret_cast<intptr_t>(b.const_data_ptr());
  const ByteSpan sa = byte_span(a, 0, a0), sb = byte_span(b, 0, b0);
  if (sa.hi <= sb.lo || sb.hi <= sa.lo) return false;
  const int64_t period = a.dim() > 0 ? a.stride(0) * (int64_t)a.element_size() : 0;
  if (a.dim() < 2 || b.dim() < 2 || period <= 0 || b.stride(0) * (int64_t)b.element_size() != period) return true;
  // Each row's footprint within one period, as [lo, hi) with 0 <= lo < period (hi may pass period: it wraps).
  auto row = [&](const at::Tensor& t, int64_t origin) {
    ByteSpan r = byte_span(t, 1, origin);
    const int64_t shift = r.lo - ((r.lo % period) + period) % period;
    return ByteSpan{r.lo - shift, r.hi - shift};
  };
  const ByteSpan ra = row(a, a0), rb = row(b, b0);
  if (ra.hi - ra.lo > period || rb.hi - rb.lo > period) return true;  // a row wider than the period
  // Disjoint on the circle of one period: b's footprint, moved by whole periods, misses a's.
  auto misses = [&](const ByteSpan& x, const ByteSpan& y) {
    for (int64_t k = -1; k <= 1; ++k) {
      if (y.lo + k * period < x.hi && x.lo < y.hi + k * period) return false;
    }
    return true;
  };
  return !misses(ra, rb);
}

// y, written in place, must not share memory with what the op reads, or one part's writes would feed another's
// reads: a silently wrong, order-dependent answer (the CPU's blocks, the GPU's column tiles and slice groups). Real
// tensors only: a Meta or fake tensor has no memory, and the real call checks again.
void check_output_disjoint(const char* op, const at::Tensor& y,
                           std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  if (y.is_meta()) return;
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK_VALUE(!t->defined() || !may_share_memory(y, *t), op, ": y shares memory with ", name,
                      "; the output must not overlap an input");
  }
}

// Index values live on the device as int32 (saturated from int64, see kernel_index). A size they are compared
// with must fit int32 too, or a saturated INT32_MAX could land inside it. Symbolic sizes are left to the real
// call, which runs this same check on concrete sizes.
void check_int32_extent(const char* op, const char* what, const c10::SymInt& size) {
  const auto v = size.maybe_as_int();
  TORCH_CHECK_VALUE(!v || *v <= kInt32Max, op, ": ", what, " = ", num(*v),
                    " exceeds the int32 index range of the metadata (max 2147483647)");
}

// 1-D index tensor of an int type and a given length (nullopt: any).
void check_index_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& y,
                        const std::optional<c10::SymInt>& expected_len, const char* len_what,
                        const char* y_name = "y") {
  check_device(op, name, t, y, y_name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(!expected_len || holds(t.sym_size(0).sym_eq(*expected_len)), op, ": ", name, " must have ",
                    num(*expected_len), " entries (", len_what, "), got ", num(t.sym_size(0)));
}


// seg_indptr [G+1], the per-segment slots [G], token_indices [P] (any P). Without seg_indptr (lora_expand's rows
// form) position p is segment p: the slots are [P], P = len(token_indices) or the number of rows.
void check_segments_host(const char* op, const char* rows_what, const char* slot_name, const at::Tensor& y,
                         const c10::SymInt& rows, const std::optional<at::Tensor>& seg_indptr,
                         const at::Tensor& seg_slot, const std::optional<at::Tensor>& token_indices) {
  check_int32_extent(op, rows_what, rows);
  if (token_indices.has_value()) {
    check_index_tensor(op, "token_indices", *token_indices, y, std::nullopt, "");
    check_int32_extent(op, "len(token_indices)", token_indices->sym_size(0));
  }
  if (!seg_indptr.has_value()) {
    const c10::SymInt positions = token_indices.has_value() ? token_indices->sym_size(0) : rows;
    check_index_tensor(op, slot_name, seg_slot, y, positions,
                       token_indices.has_value() ? "one per position without seg_indptr: len(token_indices)"
                                                 : "one per row without seg_indptr: y.size(0)");
    return;
  }
  check_index_tensor(op, "seg_indptr", *seg_indptr, y, std::nullopt, "");
  TORCH_CHECK_VALUE(holds(seg_indptr->sym_size(0).sym_ge(1)), op,
                    ": seg_indptr must have num_segments + 1 >= 1 entries, got 0");
  check_int32_extent(op, "len(seg_indptr)", seg_indptr->sym_size(0));
  check_index_tensor(op, slot_name, seg_slot, y, seg_indptr->sym_size(0) - 1, "one per segment: len(seg_indptr) - 1");
}

std::vector<int64_t> values_on_host(const at::Tensor& t) {
  const auto host = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

// LORA_OPS_DEBUG=1: the ORIGINAL values (before the int32 conversion), read back with a sync. Raises on any
// value the kernels would skip or clamp, a non-monotone seg_indptr included, and on a row named twice.
void debug_validate_segments(const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_slot,
                             const std::optional<at::Tensor>& token_indices, int64_t rows, int64_t num_slots,
                             const char* slot_name) {
  const auto sl = values_on_host(seg_slot);
  const auto idx = token_indices.has_value() ? values_on_host(*token_indices) : std::vector<int64_t>{};
  const int64_t positions = token_indices.has_value() ? static_cast<int64_t>(idx.size()) : rows;
  std::vector<int64_t> ip;
  if (seg_indptr.has_value()) {
    ip = values_on_host(*seg_indptr);
  } else {  // the rows form: position g is segment g
    for (size_t g = 0; g <= sl.size(); ++g) ip.push_back(static_cast<int64_t>(g));
  }
  TORCH_CHECK_VALUE(ip[0] >= 0 && ip[0] <= positions, "LORA_OPS_DEBUG: seg_indptr[0] = ", num(ip[0]),
                    " is outside [0, ", num(positions), "]");  // checked on its own: there may be no segment
  std::unordered_set<int64_t> seen;
  for (size_t g = 0; g < sl.size(); ++g) {
    TORCH_CHECK_VALUE(ip[g] >= 0 && ip[g] <= ip[g + 1] && ip[g + 1] <= positions,
                      "LORA_OPS_DEBUG: seg_indptr[", num(g), ":", num(g + 2), "] = [", num(ip[g]), ", ",
                      num(ip[g + 1]), "] is not a non-decreasing range inside [0, ", num(positions), "]");
    TORCH_CHECK_VALUE(sl[g] < num_slots, "LORA_OPS_DEBUG: ", slot_name, "[", num(g), "] = ", num(sl[g]),
                      " is not below the number of slots ", num(num_slots), " (use -1 for no LoRA)");
    if (sl[g] < 0) continue;
    for (int64_t p = ip[g]; p < ip[g + 1]; ++p) {
      const int64_t t = token_indices.has_value() ? idx[p] : p;
      TORCH_CHECK_VALUE(t >= 0 && t < rows, "LORA_OPS_DEBUG: token_indices[", num(p), "] = ", num(t),
                        " is outside [0, ", num(rows), ")");
      TORCH_CHECK_VALUE(seen.insert(t).second, "LORA_OPS_DEBUG: row ", num(t),
                        " appears in more than one segment position");
    }
  }
}

// LORA_OPS_DEBUG=1: per-slot sizes (lora_ranks, n_sizes, k_sizes) inside [0, full], original values.
void debug_validate_sizes(const char* name, const std::optional<at::Tensor>& sizes, const char* full_name,
                          int64_t full) {
  if (!sizes.has_value()) return;
  const auto v = values_on_host(*sizes);
  for (size_t l = 0; l < v.size(); ++l) {
    TORCH_CHECK_VALUE(v[l] >= 0 && v[l] <= full, "LORA_OPS_DEBUG: ", name, "[", num(l), "] = ", num(v[l]),
                      " is outside [0, ", full_name, " = ", num(full), "]");
  }
}

bool debug_checks_apply(const at::Tensor& y) { return debug_checks_enabled() && !y.is_meta(); }

int64_t num_slices(at::OptionalIntArrayRef slice_offsets) {
  return slice_offsets.has_value() ? static_cast<int64_t>(slice_offsets->size()) - 1 : 1;
}

// slice_offsets of y's N columns (sgmv, lora_expand); returns the number of slices S.
int64_t check_slices_host(const char* op, at::OptionalIntArrayRef slice_offsets, const c10::SymInt& N) {
  const int64_t S = num_slices(slice_offsets);
  TORCH_CHECK_VALUE(S >= 1 && S <= kMaxSlices, op, ": slice_offsets must have 2 to ", num(kMaxSlices + 1),
                    " entries, got ", num(S + 1));
  if (slice_offsets.has_value()) {
    const auto offsets = *slice_offsets;
    TORCH_CHECK_VALUE(offsets.front() == 0 && holds(N.sym_eq(offsets.back())), op,
                      ": slice_offsets must start at 0 and end at N = ", num(N), ", got ", list_str(offsets));
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK_VALUE(offsets[s] <= offsets[s + 1], op, ": slice_offsets must be non-decreasing, got ",
                        list_str(offsets));
    }
  }
  return S;
}

// The segments over T rows and the per-slot tensors of L adapter slots of max rank R (sgmv, lora_expand);
// t_what / l_what / r_what say where T, L and R come from.
void check_slot_tensors_host(const char* op, const at::Tensor& y, const c10::SymInt& T, const c10::SymInt& L,
                             const c10::SymInt& R, const char* t_what, const char* l_what, const char* r_what,
                             const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                             const std::optional<at::Tensor>& token_indices,
                             const std::optional<at::Tensor>& lora_ranks,
                             const std::optional<at::Tensor>& lora_scales) {
  check_segments_host(op, t_what, "seg_lora", y, T, seg_indptr, seg_lora, token_indices);
  check_int32_extent(op, l_what, L);
  if (lora_ranks.has_value()) {
    check_index_tensor(op, "lora_ranks", *lora_ranks, y, L, (std::string("one per slot: ") + l_what).c_str());
    check_int32_extent(op, r_what, R);
  }
  if (lora_scales.has_value()) {
    check_device(op, "lora_scales", *lora_scales, y);
    TORCH_CHECK_TYPE(lora_scales->scalar_type() == at::kFloat, op, ": lora_scales must be float32, got ",
                     lora_scales->scalar_type());
    TORCH_CHECK_VALUE(lora_scales->dim() == 1 && holds(lora_scales->sym_size(0).sym_eq(L)), op,
                      ": lora_scales must be 1-D with L = ", num(L), " entries, got shape ", shape_str(*lora_scales));
  }
}

// The index tensors of sgmv and lora_expand in the kernels' form; with LORA_OPS_DEBUG=1 their original values
// validated first (rows T, L slots, max rank R).
SgmvIndexTensors slot_index_tensors(const at::Tensor& y, int64_t T, int64_t L, int64_t R,
                                    const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                                    const std::optional<at::Tensor>& token_indices,
                                    const std::optional<at::Tensor>& lora_ranks) {
  if (debug_checks_apply(y)) {
    debug_validate_segments(seg_indptr, seg_lora, token_indices, T, L, "seg_lora");
    debug_validate_sizes("lora_ranks", lora_ranks, "R", R);
  }
  SgmvIndexTensors out;
  if (seg_indptr.has_value()) out.seg_indptr = kernel_index(*seg_indptr);
  out.seg_lora = kernel_index(seg_lora);
  if (token_indices.has_value()) out.token_indices = kernel_index(*token_indices);
  if (lora_ranks.has_value()) out.lora_ranks = kernel_index(*lora_ranks);
  return out;
}

// Segments and per-slot pointers of `keep` into the params of a sgmv or lora_expand call over T rows.
void fill_slot_params(const SgmvIndexTensors& keep, int64_t T, Segments* seg, const int32_t** ranks,
                      const float** scales) {
  seg->indptr = keep.seg_indptr.defined() ? keep.seg_indptr.data_ptr<int32_t>() : nullptr;
  seg->slot = keep.seg_lora.data_ptr<int32_t>();
  seg->num_segments = keep.seg_lora.size(0);
  seg->positions = T;
  if (keep.token_indices.defined()) {
    seg->token_indices = keep.token_indices.data_ptr<int32_t>();
    seg->positions = keep.token_indices.size(0);
  }
  if (keep.lora_ranks.defined()) *ranks = keep.lora_ranks.data_ptr<int32_t>();
  if (keep.lora_scales.defined()) *scales = keep.lora_scales.data_ptr<float>();
}

}  // namespace

// lora_a [L, S*R, K] and lora_b [L, N, R] against K and N (k_what / n_what: where they come from) and the slices
// (sgmv, lora_linear); returns S.
int64_t check_adapter_shapes_host(const char* op, const at::Tensor& lora_a, const at::Tensor& lora_b,
                                  const c10::SymInt& K, const c10::SymInt& N, const char* k_what, const char* n_what,
                                  at::OptionalIntArrayRef slice_offsets) {
  const c10::SymInt L = lora_a.sym_size(0);
  TORCH_CHECK_VALUE(holds(lora_a.sym_size(2).sym_eq(K)), op, ": lora_a must be [L, S*R, K] with K = ", k_what, " = ",
                    num(K), ", got shape ", shape_str(lora_a));
  TORCH_CHECK_VALUE(holds(lora_b.sym_size(0).sym_eq(L)), op, ": lora_b must have L = lora_a.size(0) = ", num(L),
                    " slots, got shape ", shape_str(lora_b));
  TORCH_CHECK_VALUE(holds(lora_b.sym_size(1).sym_eq(N)), op, ": lora_b must be [L, N, R] with N = ", n_what, " = ",
                    num(N), ", got shape ", shape_str(lora_b));
  const int64_t S = check_slices_host(op, slice_offsets, N);
  TORCH_CHECK_VALUE(holds((lora_a.sym_size(1) % S).sym_eq(0)), op, ": lora_a.size(1) = ", num(lora_a.sym_size(1)),
                    " must be S*R for S = ", num(S), " slices");
  const c10::SymInt R = lora_a.sym_size(1) / S;
  TORCH_CHECK_VALUE(holds(lora_b.sym_size(2).sym_eq(R)), op,
                    ": lora_b must be [L, N, R] with R = lora_a.size(1) / S = ", num(R), ", got shape ",
                    shape_str(lora_b));
  return S;
}

std::string num_list(at::IntArrayRef values) { return list_str(values); }

void check_sgmv_host(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                     const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                     const std::optional<at::Tensor>& token_indices, const std::optional<at::Tensor>& lora_ranks,
                     const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets) {
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
                   ": y must be float32 or x's dtype (", x.scalar_type(), "), got ", y.scalar_type());

  const c10::SymInt T = x.sym_size(0), K = x.sym_size(1), N = y.sym_size(1), L = lora_a.sym_size(0);
  TORCH_CHECK_VALUE(holds(y.sym_size(0).sym_eq(T)), op, ": y has ", num(y.sym_size(0)), " rows but x has ", num(T));
  const int64_t S = check_adapter_shapes_host(op, lora_a, lora_b, K, N, "x.size(1)", "y.size(1)", slice_offsets);
  const c10::SymInt R = lora_a.sym_size(1) / S;

  check_unit_last_stride(op, "x", x);
  check_unit_last_stride(op, "y", y);
  check_unit_last_stride(op, "lora_a", lora_a);
  check_unit_last_stride(op, "lora_b", lora_b);
  check_output_rows(op, y);

  check_slot_tensors_host(op, y, T, L, R, "x.size(0)", "lora_a.size(0)", "R = lora_a.size(1) / S", seg_indptr,
                          seg_lora, token_indices, lora_ranks, lora_scales);
}

SgmvIndexTensors sgmv_index_tensors(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                                    const at::Tensor& lora_b, const at::Tensor& seg_indptr,
                                    const at::Tensor& seg_lora, const std::optional<at::Tensor>& token_indices,
                                    const std::optional<at::Tensor>& lora_ranks,
                                    const std::optional<at::Tensor>& lora_scales,
                                    at::OptionalIntArrayRef slice_offsets) {
  check_sgmv_host(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets);
  check_output_disjoint("lora_ops.sgmv", y,
                        {{"x", &x}, {"lora_a", &lora_a}, {"lora_b", &lora_b}, {"seg_indptr", &seg_indptr},
                         {"seg_lora", &seg_lora}, {"token_indices", &opt_or_undefined(token_indices)},
                         {"lora_ranks", &opt_or_undefined(lora_ranks)}, {"lora_scales", &opt_or_undefined(lora_scales)}});
  return slot_index_tensors(y, x.size(0), lora_a.size(0), lora_a.size(1) / num_slices(slice_offsets), seg_indptr,
                            seg_lora, token_indices, lora_ranks);
}

float check_scale(const char* op, const char* name, double value) {
  const float f = static_cast<float>(value);
  if (std::isfinite(value) && !std::isfinite(f)) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", value);
    TORCH_CHECK_VALUE(false, op, ": ", name, " = ", text, " is beyond float32's range (the kernels multiply in "
                      "float32)");
  }
  return f;
}

SgmvParams check_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& seg_indptr, const at::Tensor& seg_lora,
                      const std::optional<at::Tensor>& token_indices,
                      const std::optional<at::Tensor>& lora_ranks,
                      const std::optional<at::Tensor>& lora_scales,
                      at::OptionalIntArrayRef slice_offsets, double scale, SgmvIndexTensors& keep) {
  keep = sgmv_index_tensors(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                            slice_offsets);
  const int64_t T = x.size(0), S = num_slices(slice_offsets);
  if (lora_scales.has_value()) keep.lora_scales = lora_scales->contiguous();
  SgmvParams p{};
  fill_slot_params(keep, T, &p.seg, &p.lora_ranks, &p.lora_scales);
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
  p.k = x.size(1);
  p.n = y.size(1);
  p.num_slots = lora_a.size(0);
  p.max_rank = lora_a.size(1) / S;
  p.num_slices = S;
  for (int64_t s = 0; s <= S; ++s) p.slice_offsets[s] = slice_offsets.has_value() ? (*slice_offsets)[s] : (s ? p.n : 0);
  p.scale = check_scale("lora_ops::sgmv", "scale", scale);
  return p;
}

void check_lora_expand_host(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                            const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                            const std::optional<at::Tensor>& token_indices,
                            const std::optional<at::Tensor>& lora_ranks, const std::optional<at::Tensor>& lora_scales,
                            at::OptionalIntArrayRef slice_offsets) {
  constexpr const char* op = "lora_ops.lora_expand";
  check_dim(op, "y", y, 2, "[T, N]");
  check_dim(op, "h", h, 3, "[T, L, S*R]");
  check_dim(op, "lora_b", lora_b, 3, "[L, N, R]");
  check_device(op, "h", h, y);
  check_device(op, "lora_b", lora_b, y);
  check_float(op, "lora_b", lora_b);
  TORCH_CHECK_TYPE(h.scalar_type() == lora_b.scalar_type() || h.scalar_type() == at::kFloat, op,
                   ": h must be float32 or lora_b's dtype (", lora_b.scalar_type(), "), got ", h.scalar_type());
  TORCH_CHECK_TYPE(y.scalar_type() == lora_b.scalar_type() || y.scalar_type() == at::kFloat, op,
                   ": y must be float32 or lora_b's dtype (", lora_b.scalar_type(), "), got ", y.scalar_type());
  const c10::SymInt T = y.sym_size(0), N = y.sym_size(1), L = lora_b.sym_size(0), R = lora_b.sym_size(2);
  TORCH_CHECK_VALUE(holds(lora_b.sym_size(1).sym_eq(N)), op, ": lora_b must be [L, N, R] with N = y.size(1) = ",
                    num(N), ", got shape ", shape_str(lora_b));
  const int64_t S = check_slices_host(op, slice_offsets, N);
  if (const auto r = R.maybe_as_int()) {  // S*R below must not wrap (an N = 0 lora_b may have any R)
    TORCH_CHECK_VALUE(*r <= std::numeric_limits<int64_t>::max() / S, op, ": lora_b's rank R = ", num(*r),
                      " times S = ", num(S), " slices overflows int64");
  }
  TORCH_CHECK_VALUE(holds(h.sym_size(0).sym_eq(T) & h.sym_size(1).sym_eq(L) & h.sym_size(2).sym_eq(R * S)), op,
                    ": h must be [T, L, S*R] with T = y.size(0) = ", num(T), ", L = lora_b.size(0) = ", num(L),
                    " and S*R = ", num(R * S), ", got shape ", shape_str(h));
  check_unit_last_stride(op, "y", y);
  check_unit_last_stride(op, "h", h);
  check_unit_last_stride(op, "lora_b", lora_b);
  check_output_rows(op, y);
  check_slot_tensors_host(op, y, T, L, R, "y.size(0)", "lora_b.size(0)", "R = lora_b.size(2)", seg_indptr,
                          seg_lora, token_indices, lora_ranks, lora_scales);
}

SgmvIndexTensors lora_expand_index_tensors(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                                           const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                                           const std::optional<at::Tensor>& token_indices,
                                           const std::optional<at::Tensor>& lora_ranks,
                                           const std::optional<at::Tensor>& lora_scales,
                                           at::OptionalIntArrayRef slice_offsets) {
  check_lora_expand_host(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets);
  check_output_disjoint("lora_ops.lora_expand", y,
                        {{"h", &h}, {"lora_b", &lora_b}, {"seg_indptr", &opt_or_undefined(seg_indptr)},
                         {"seg_lora", &seg_lora}, {"token_indices", &opt_or_undefined(token_indices)},
                         {"lora_ranks", &opt_or_undefined(lora_ranks)}, {"lora_scales", &opt_or_undefined(lora_scales)}});
  return slot_index_tensors(y, y.size(0), lora_b.size(0), lora_b.size(2), seg_indptr, seg_lora, token_indices,
                            lora_ranks);
}

at::Tensor with_indptr(const at::Tensor& y, SgmvIndexTensors& keep) {
  if (!keep.seg_indptr.defined()) keep.seg_indptr = at::arange(keep.seg_lora.size(0) + 1, y.options().dtype(at::kInt));
  return keep.seg_indptr;
}

ExpandParams check_lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                               const std::optional<at::Tensor>& seg_indptr, const at::Tensor& seg_lora,
                               const std::optional<at::Tensor>& token_indices,
                               const std::optional<at::Tensor>& lora_ranks,
                               const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                               double scale, SgmvIndexTensors& keep) {
  keep = lora_expand_index_tensors(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                                   slice_offsets);
  if (lora_scales.has_value()) keep.lora_scales = lora_scales->contiguous();
  const int64_t T = y.size(0), S = num_slices(slice_offsets);
  ExpandParams p{};
  fill_slot_params(keep, T, &p.seg, &p.lora_ranks, &p.lora_scales);
  p.y = y.data_ptr();
  p.h = h.data_ptr();
  p.lora_b = lora_b.data_ptr();
  p.y_row_stride = y.stride(0);
  p.h_row_stride = h.stride(0);
  p.h_slot_stride = h.stride(1);
  p.h_split_stride = 0;
  p.h_splits = 1;
  p.b_stride0 = lora_b.stride(0);
  p.b_stride1 = lora_b.stride(1);
  p.b_dtype = to_dtype(lora_b.scalar_type());
  p.h_dtype = to_dtype(h.scalar_type());
  p.y_dtype = to_dtype(y.scalar_type());
  p.rows = T;
  p.n = y.size(1);
  p.num_slots = lora_b.size(0);
  p.max_rank = lora_b.size(2);
  p.num_slices = S;
  for (int64_t s = 0; s <= S; ++s) p.slice_offsets[s] = slice_offsets.has_value() ? (*slice_offsets)[s] : (s ? p.n : 0);
  p.scale = check_scale("lora_ops::lora_expand", "scale", scale);
  return p;
}

void check_grouped_gemm_host(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                             const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                             const std::optional<at::Tensor>& token_indices,
                             const std::optional<at::Tensor>& n_sizes, const std::optional<at::Tensor>& k_sizes) {
  constexpr const char* op = "lora_ops.grouped_gemm";
  check_dim(op, "y", y, 2, "[T, N]");
  check_dim(op, "x", x, 2, "[T, K]");
  check_dim(op, "w", w, 3, "[L, N, K]");
  check_device(op, "x", x, y);
  check_device(op, "w", w, y);
  check_float(op, "w", w);
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type() || x.scalar_type() == at::kFloat, op,
                   ": x must be float32 or w's dtype (", w.scalar_type(), "), got ", x.scalar_type());
  TORCH_CHECK_TYPE(y.scalar_type() == w.scalar_type() || y.scalar_type() == at::kFloat, op,
                   ": y must be float32 or w's dtype (", w.scalar_type(), "), got ", y.scalar_type());
  const c10::SymInt T = x.sym_size(0), K = x.sym_size(1), N = y.sym_size(1), L = w.sym_size(0);
  TORCH_CHECK_VALUE(holds(y.sym_size(0).sym_eq(T)), op, ": y has ", num(y.sym_size(0)), " rows but x has ", num(T));
  TORCH_CHECK_VALUE(holds(w.sym_size(1).sym_eq(N) & w.sym_size(2).sym_eq(K)), op,
                    ": w must be [L, N, K] with N = y.size(1) = ", num(N), " and K = x.size(1) = ", num(K),
                    ", got shape ", shape_str(w));
  check_unit_last_stride(op, "x", x);
  check_unit_last_stride(op, "y", y);
  check_unit_last_stride(op, "w", w);
  check_output_rows(op, y);

  check_segments_host(op, "x.size(0)", "seg_weight", y, T, seg_indptr, seg_weight, token_indices);
  check_int32_extent(op, "w.size(0)", L);
  if (n_sizes.has_value()) {
    check_index_tensor(op, "n_sizes", *n_sizes, y, L, "one per group: w.size(0)");
    check_int32_extent(op, "y.size(1)", N);
  }
  if (k_sizes.has_value()) {
    check_index_tensor(op, "k_sizes", *k_sizes, y, L, "one per group: w.size(0)");
    check_int32_extent(op, "x.size(1)", K);
  }
}

GroupedGemmIndexTensors grouped_gemm_index_tensors(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                                   const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                                   const std::optional<at::Tensor>& token_indices,
                                                   const std::optional<at::Tensor>& n_sizes,
                                                   const std::optional<at::Tensor>& k_sizes) {
  check_grouped_gemm_host(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes);
  check_output_disjoint("lora_ops.grouped_gemm", y,
                        {{"x", &x}, {"w", &w}, {"seg_indptr", &seg_indptr}, {"seg_weight", &seg_weight},
                         {"token_indices", &opt_or_undefined(token_indices)}, {"n_sizes", &opt_or_undefined(n_sizes)},
                         {"k_sizes", &opt_or_undefined(k_sizes)}});
  if (debug_checks_apply(y)) {
    debug_validate_segments(seg_indptr, seg_weight, token_indices, x.size(0), w.size(0), "seg_weight");
    debug_validate_sizes("n_sizes", n_sizes, "N", y.size(1));
    debug_validate_sizes("k_sizes", k_sizes, "K", x.size(1));
  }
  GroupedGemmIndexTensors out;
  out.seg_indptr = kernel_index(seg_indptr);
  out.seg_weight = kernel_index(seg_weight);
  if (token_indices.has_value()) out.token_indices = kernel_index(*token_indices);
  if (n_sizes.has_value()) out.n_sizes = kernel_index(*n_sizes);
  if (k_sizes.has_value()) out.k_sizes = kernel_index(*k_sizes);
  return out;
}

GroupedGemmParams check_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& seg_indptr, const at::Tensor& seg_weight,
                                     const std::optional<at::Tensor>& token_indices,
                                     const std::optional<at::Tensor>& n_sizes,
                                     const std::optional<at::Tensor>& k_sizes, double alpha,
                                     bool accumulate, GroupedGemmIndexTensors& keep) {
  keep = grouped_gemm_index_tensors(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes);
  GroupedGemmParams p{};
  p.seg.indptr = keep.seg_indptr.data_ptr<int32_t>();
  p.seg.slot = keep.seg_weight.data_ptr<int32_t>();
  p.seg.num_segments = keep.seg_weight.size(0);
  p.seg.positions = x.size(0);
  if (keep.token_indices.defined()) {
    p.seg.token_indices = keep.token_indices.data_ptr<int32_t>();
    p.seg.positions = keep.token_indices.size(0);
  }
  if (keep.n_sizes.defined()) p.n_sizes = keep.n_sizes.data_ptr<int32_t>();
  if (keep.k_sizes.defined()) p.k_sizes = keep.k_sizes.data_ptr<int32_t>();
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
  p.rows = x.size(0);
  p.k = x.size(1);
  p.n = y.size(1);
  p.num_groups = w.size(0);
  p.alpha = check_scale("lora_ops::grouped_gemm", "alpha", alpha);
  p.accumulate = accumulate;
  return p;
}

void check_build_segments_host(const at::Tensor& token_lora, int64_t num_slots) {
  constexpr const char* op = "lora_ops.build_segments";
  TORCH_CHECK_VALUE(num_slots >= 0, op, ": num_slots must be >= 0, got ", num(num_slots));
  TORCH_CHECK_VALUE(num_slots < (int64_t{1} << 30), op, ": num_slots must be < 2^30, got ", num(num_slots));
  check_index_tensor(op, "token_lora", token_lora, token_lora, std::nullopt, "");
  check_int32_extent(op, "len(token_lora)", token_lora.sym_size(0));
}

at::Tensor build_segments_token_lora(const at::Tensor& token_lora, int64_t num_slots) {
  check_build_segments_host(token_lora, num_slots);
  return kernel_index(token_lora);
}

void check_fold_linear_host(const at::Tensor& weight, const std::optional<at::Tensor>& seg_indptr,
                            int64_t slot_rows) {
  constexpr const char* op = "lora_ops.fold_linear";
  if (!seg_indptr.has_value()) {
    TORCH_CHECK_VALUE(slot_rows == 0, op, ": slot_rows = ", num(slot_rows),
                      " without seg_indptr; pass build_segments' seg_indptr with it, or neither");
    return;
  }
  TORCH_CHECK_VALUE(seg_indptr->device() == weight.device(), op, ": seg_indptr is on ", seg_indptr->device().str(),
                    " but weight is on ", weight.device().str(), "; all tensors must be on one device");
  // its dtype and dims (the device, checked against weight's above, against itself here)
  check_index_tensor(op, "seg_indptr", *seg_indptr, *seg_indptr, std::nullopt, "");
  TORCH_CHECK_VALUE(holds(seg_indptr->sym_size(0).sym_ge(1)), op,
                    ": seg_indptr must have num_slots + 1 >= 1 entries, got 0");
  check_int32_extent(op, "len(seg_indptr)", seg_indptr->sym_size(0));
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [rows, in_features] with seg_indptr, got shape ",
                    shape_str(weight));
  TORCH_CHECK_VALUE(slot_rows >= 1, op, ": slot_rows (the rows of weight per slot, S·R) must be >= 1, got ",
                    num(slot_rows));
  // num_slots * slot_rows <= rows, written as a division: slot_rows may be any int64
  TORCH_CHECK_VALUE(holds((seg_indptr->sym_size(0) - 1).sym_le(weight.sym_size(0) / slot_rows)), op,
                    ": seg_indptr's ", num(seg_indptr->sym_size(0) - 1), " slots of slot_rows = ", num(slot_rows),
                    " rows each do not fit weight's ", num(weight.sym_size(0)), " rows");
}

int64_t check_lora_linear_host(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                               const at::Tensor& lora_b, const at::Tensor& token_slot,
                               const std::optional<at::Tensor>& lora_scales, at::OptionalIntArrayRef slice_offsets,
                               const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "lora_ops.lora_linear";
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must be [..., K], got a 0-D tensor");
  check_dim(op, "weight", weight, 2, "[N, K]");
  check_dim(op, "lora_a", lora_a, 3, "[L, S*R, K]");
  check_dim(op, "lora_b", lora_b, 3, "[L, N, R]");
  check_float(op, "x", x);
  for (auto [name, t] : {std::pair{"weight", &weight}, {"lora_a", &lora_a}, {"lora_b", &lora_b}}) {
    check_device(op, name, *t, x, "x");
    TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(),
                     ", got ", t->scalar_type());
    check_unit_last_stride(op, name, *t);
  }
  check_unit_last_stride(op, "x", x);
  const c10::SymInt K = x.sym_size(-1), N = weight.sym_size(0), L = lora_a.sym_size(0);
  TORCH_CHECK_VALUE(holds(weight.sym_size(1).sym_eq(K)), op, ": weight must be [N, K] with K = x.size(-1) = ",
                    num(K), ", got shape ", shape_str(weight));
  const int64_t S =
      check_adapter_shapes_host(op, lora_a, lora_b, K, N, "x.size(-1)", "weight.size(0)", slice_offsets);
  c10::SymInt T = 1;  // x's rows
  for (int64_t d = 0; d + 1 < x.dim(); ++d) T = T * x.sym_size(d);
  check_index_tensor(op, "token_slot", token_slot, x, T, "one per row of x", "x");
  check_int32_extent(op, "lora_a.size(0)", L);  // the slots, compared with int32 token_slot values
  if (lora_scales.has_value()) {
    check_device(op, "lora_scales", *lora_scales, x, "x");
    TORCH_CHECK_TYPE(lora_scales->scalar_type() == at::kFloat, op, ": lora_scales must be float32, got ",
                     lora_scales->scalar_type());
    TORCH_CHECK_VALUE(lora_scales->dim() == 1 && holds(lora_scales->sym_size(0).sym_eq(L)), op,
                      ": lora_scales must be 1-D with L = ", num(L), " entries, got shape ", shape_str(*lora_scales));
  }
  if (bias.has_value()) {
    check_device(op, "bias", *bias, x, "x");
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(),
                     ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && holds(bias->sym_size(0).sym_eq(N)), op, ": bias must be 1-D with N = ",
                      num(N), " entries, got shape ", shape_str(*bias));
  }
  if (debug_checks_apply(x)) {
    const auto slots = values_on_host(token_slot);
    for (size_t t = 0; t < slots.size(); ++t) {
      TORCH_CHECK_VALUE(slots[t] < L.expect_int(), "LORA_OPS_DEBUG: token_slot[", num(t), "] = ", num(slots[t]),
                        " is not below the number of slots ", num(L), " (use -1 for no LoRA)");
    }
  }
  return S;
}

BuildSegmentsParams check_build_segments(const at::Tensor& token_lora, int64_t num_slots,
                                         at::Tensor& token_indices, at::Tensor& seg_indptr,
                                         at::Tensor& seg_lora, at::Tensor& token_lora_i32) {
  token_lora_i32 = build_segments_token_lora(token_lora, num_slots);
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

}  // namespace lora_ops
