// The Ascend kernels and host path (csrc/ascend: launcher -> plan -> kernels) run on the CPU model of the AscendC
// API, against a float64 reference written from docs/design.md §2 (seg_indptr clamped to [0, P] and made non-decreasing by
// a running maximum; an empty reduction contributes exactly zero). Grids over shapes, ranks, slices, dtypes, K/N
// tails, garbage metadata and core counts, including the inputs that break vllm-ascend's kernels (rank 128,
// rank 24, hidden 4095).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "ascend/launcher.h"
#include "test_util.h"

using lora_ops::ascend::Device;
using lora_ops::ascend::Target;
using lora_ops_test::i32;

namespace {

Device model_device(uint32_t cores) { return Device{Target{cores}, nullptr}; }

// lora_ops.testing.tolerance: by the dtype that rounds the result. A float32 output of half-precision inputs is
// bounded by the fp32 accumulation alone (5e-5), which an intermediate rounded to 16 bits fails.
double tolerance(at::ScalarType inputs, at::ScalarType output) {
  if (output == at::kFloat) return inputs == at::kFloat ? 1e-5 : 5e-5;
  return output == at::kHalf ? 2e-3 : 1e-2;
}

// Positions of segment g under the docs/design.md §2 rules: [m_g, m_g+1), m_i = max_{j <= i} clamp(indptr[j], 0, P).
std::vector<std::pair<int64_t, int64_t>> segment_ranges(const std::vector<int32_t>& indptr, int64_t positions) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t m = std::clamp<int64_t>(indptr[0], 0, positions);
  for (size_t g = 0; g + 1 < indptr.size(); ++g) {
    const int64_t next = std::max(m, std::clamp<int64_t>(indptr[g + 1], 0, positions));
    out.emplace_back(m, next);
    m = next;
  }
  return out;
}

struct Meta {
  std::vector<int32_t> indptr, slots, idx;  // idx empty: positions are rows
};

// Valid rows of every segment with a slot in [0, L): (slot, rows).
std::vector<std::pair<int64_t, std::vector<int64_t>>> segment_rows(const Meta& m, int64_t rows, int64_t L) {
  const int64_t positions = m.idx.empty() ? rows : int64_t(m.idx.size());
  std::vector<std::pair<int64_t, std::vector<int64_t>>> out;
  const auto ranges = segment_ranges(m.indptr, positions);
  for (size_t g = 0; g < ranges.size(); ++g) {
    if (m.slots[g] < 0 || m.slots[g] >= L) continue;
    std::vector<int64_t> r;
    for (int64_t p = ranges[g].first; p < ranges[g].second; ++p) {
      const int64_t t = m.idx.empty() ? p : m.idx[p];
      if (t >= 0 && t < rows) r.push_back(t);
    }
    out.emplace_back(m.slots[g], r);
  }
  return out;
}

at::Tensor rows_of(const std::vector<int64_t>& rows) {
  return at::tensor(at::ArrayRef<int64_t>(rows), at::TensorOptions().dtype(at::kLong));
}

at::Tensor ref_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const Meta& m,
                    const std::vector<int32_t>& ranks, const std::vector<float>& scales,
                    const std::vector<int64_t>& offsets, double scale) {
  at::Tensor out = y.to(at::kDouble).clone();
  const int64_t L = a.size(0), S = int64_t(offsets.size()) - 1, R = a.size(1) / S;
  const at::Tensor xd = x.to(at::kDouble), ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  for (const auto& [slot, rows] : segment_rows(m, x.size(0), L)) {
    const int64_t r = ranks.empty() ? R : std::clamp<int64_t>(ranks[slot], 0, R);
    if (r == 0 || rows.empty() || x.size(1) == 0) continue;
    const double coef = scale * (scales.empty() ? 1.0 : scales[slot]);
    const at::Tensor idx = rows_of(rows), xr = xd.index_select(0, idx);
    for (int64_t s = 0; s < S; ++s) {
      if (offsets[s] == offsets[s + 1]) continue;
      const at::Tensor h = xr.matmul(ad[slot].narrow(0, s * R, r).t());
      const at::Tensor b_s = bd[slot].narrow(0, offsets[s], offsets[s + 1] - offsets[s]).narrow(1, 0, r);
      const at::Tensor delta = h.matmul(b_s.t());
      at::Tensor cols = out.narrow(1, offsets[s], offsets[s + 1] - offsets[s]);
      cols.index_copy_(0, idx, cols.index_select(0, idx) + coef * delta);
    }
  }
  return out;
}

at::Tensor ref_grouped_gemm(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const Meta& m,
                            const std::vector<int32_t>& n_sizes, const std::vector<int32_t>& k_sizes, double alpha,
                            bool accumulate) {
  at::Tensor out = y.to(at::kDouble).clone();
  const int64_t L = w.size(0), N = w.size(1), K = w.size(2);
  const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
  for (const auto& [slot, rows] : segment_rows(m, x.size(0), L)) {
    const int64_t n = n_sizes.empty() ? N : std::clamp<int64_t>(n_sizes[slot], 0, N);
    const int64_t k = k_sizes.empty() ? K : std::clamp<int64_t>(k_sizes[slot], 0, K);
    if (rows.empty() || n == 0) continue;
    const at::Tensor idx = rows_of(rows);
    const at::Tensor w_l = wd[slot].narrow(0, 0, n).narrow(1, 0, k);
    const at::Tensor prod = alpha * xd.index_select(0, idx).narrow(1, 0, k).matmul(w_l.t());
    at::Tensor cols = out.narrow(1, 0, n);
    cols.index_copy_(0, idx, (accumulate ? cols.index_select(0, idx) : at::zeros_like(prod)) + prod);
  }
  return out;
}

// "" when `out` matches `ref`: elements the reference leaves alone are bitwise unchanged, the others carry no NaN
// and their change from `before` is within tolerance(inputs, out's dtype) (as lora_ops.testing does; inputs: the
// weights' dtype).
std::string compare(const at::Tensor& out, const at::Tensor& before, const at::Tensor& ref, at::ScalarType inputs) {
  if (out.numel() == 0) return "";
  const at::Tensor b64 = before.to(at::kDouble);
  const at::Tensor touched = ~((ref == b64) | (ref.isnan() & b64.isnan()));
  const at::Tensor o = out.contiguous(), bc = before.contiguous();
  const at::Tensor same = o.view({-1}).to(at::kDouble).isnan() & bc.view({-1}).to(at::kDouble).isnan();
  const at::Tensor equal_bits =
      (o.view(at::kByte).view({o.numel(), -1}) == bc.view(at::kByte).view({bc.numel(), -1})).all(1);
  if (!(equal_bits | same).masked_select(~touched.view({-1})).all().item<bool>()) {
    return "elements outside the LoRA rows/columns changed";
  }
  if (!touched.any().item<bool>()) return "";
  const at::Tensor got = out.to(at::kDouble).masked_select(touched);
  if (got.isnan().any().item<bool>()) return "written elements are NaN";
  const at::Tensor base = at::where(b64.isnan(), at::zeros_like(b64), b64).masked_select(touched);
  const at::Tensor want = ref.masked_select(touched) - base;
  const double denom = want.norm().item<double>();
  const double err = (got - base - want).norm().item<double>() / (denom > 0 ? denom : 1.0);
  const double tol = tolerance(inputs, out.scalar_type());
  return err <= tol ? "" : "relative error " + std::to_string(err) + " > " + std::to_string(tol);
}

// Token slots with `adapters` spread at random over T tokens (sizes: tokens per adapter, default even).
std::vector<int32_t> random_slots(std::mt19937& gen, int64_t T, const std::vector<int32_t>& adapters,
                                  std::vector<int64_t> sizes = {}) {
  if (sizes.empty()) {
    const int64_t n = int64_t(adapters.size());
    for (int64_t i = 0; i < n; ++i) sizes.push_back(T / n + (i < T % n));
  }
  std::vector<int32_t> slots;
  for (size_t i = 0; i < adapters.size(); ++i) slots.insert(slots.end(), sizes[i], adapters[i]);
  std::shuffle(slots.begin(), slots.end(), gen);
  return slots;
}

// build_segments' layout (gathered) or one segment per run of equal slots (contiguous rows, no token_indices).
Meta segments_for(const std::vector<int32_t>& token_slots, int64_t L, bool gathered) {
  Meta m;
  if (gathered) {
    auto valid = [&](int32_t v) { return v >= 0 && v < L; };
    for (int64_t s = 0; s < L; ++s) {
      m.indptr.push_back(int32_t(m.idx.size()));
      m.slots.push_back(int32_t(s));
      for (size_t t = 0; t < token_slots.size(); ++t) {
        if (token_slots[t] == s) m.idx.push_back(int32_t(t));
      }
    }
    m.indptr.push_back(int32_t(m.idx.size()));
    for (size_t t = 0; t < token_slots.size(); ++t) {
      if (!valid(token_slots[t])) m.idx.push_back(int32_t(t));  // no LoRA: last, in no segment
    }
    return m;
  }
  m.indptr.push_back(0);
  for (size_t t = 0; t < token_slots.size(); ++t) {
    if (t > 0 && token_slots[t] != token_slots[t - 1]) m.indptr.push_back(int32_t(t));
    if (t == 0 || token_slots[t] != token_slots[t - 1]) m.slots.push_back(token_slots[t]);
  }
  if (!token_slots.empty()) m.indptr.push_back(int32_t(token_slots.size()));
  return m;
}

std::optional<at::Tensor> opt_i32(const std::vector<int32_t>& v) {
  return v.empty() ? std::nullopt : std::optional<at::Tensor>(i32(v));
}

struct SgmvCase {
  std::string name;
  std::vector<int32_t> token_slots;
  int64_t K, N, R, L = 6;
  std::vector<int32_t> ranks = {};
  std::vector<int64_t> offsets = {};
  bool gathered = true;
  int64_t y_col_pad = 0;
  Meta meta = {};  // used instead of segments_for(token_slots) when indptr is set
};

// Runs one sgmv case on the model (fresh random inputs, seeded by the case) and returns compare()'s verdict.
std::string run_sgmv(const SgmvCase& c, at::ScalarType dtype, at::ScalarType y_dtype, uint32_t cores,
                     bool with_scales = true) {
  at::manual_seed(std::hash<std::string>{}(c.name) & 0xffff);
  const int64_t T = int64_t(c.token_slots.size());
  const std::vector<int64_t> offsets = c.offsets.empty() ? std::vector<int64_t>{0, c.N} : c.offsets;
  const int64_t S = int64_t(offsets.size()) - 1;
  const at::Tensor x = at::randn({T, c.K}).to(dtype);
  const at::Tensor a = (at::randn({c.L, S * c.R, c.K}) / std::sqrt(double(std::max<int64_t>(c.K, 1)))).to(dtype);
  const at::Tensor b = (at::randn({c.L, c.N, c.R}) / std::sqrt(double(c.R))).to(dtype);
  const at::Tensor y_full = at::randn({T, c.N + c.y_col_pad}).to(y_dtype);
  at::Tensor y = y_full.narrow(1, c.y_col_pad / 2, c.N);
  const Meta m = c.meta.indptr.empty() ? segments_for(c.token_slots, c.L, c.gathered) : c.meta;
  std::vector<float> scales;
  if (with_scales) {
    for (int64_t l = 0; l < c.L; ++l) scales.push_back(0.5f + 0.25f * float(l % 5));
  }
  const double scale = 0.75;
  const at::Tensor ref = ref_sgmv(y, x, a, b, m, c.ranks, scales, offsets, scale);
  const at::Tensor before_full = y_full.clone();
  std::optional<at::Tensor> scales_t;
  if (!scales.empty()) scales_t = at::tensor(at::ArrayRef<float>(scales), at::TensorOptions().dtype(at::kFloat));
  lora_ops::ascend::run_sgmv(y, x, a, b, i32(m.indptr), i32(m.slots), opt_i32(m.idx), opt_i32(c.ranks), scales_t,
                             c.offsets.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(c.offsets),
                             scale, model_device(cores));
  // The columns of the wider tensor around y are untouched.
  auto outside = [&](const at::Tensor& t) {
    const int64_t left = c.y_col_pad / 2;
    return at::cat({t.narrow(1, 0, left), t.narrow(1, left + c.N, c.y_col_pad - left)}, 1);
  };
  if (c.y_col_pad > 0 && !at::equal(outside(y_full), outside(before_full))) return "columns outside the y view changed";
  return compare(y, before_full.narrow(1, c.y_col_pad / 2, c.N), ref, dtype);
}

std::vector<SgmvCase> sgmv_grid() {
  std::mt19937 gen(11);
  std::vector<int64_t> skew(31, 1);
  skew[0] = 300;
  std::vector<int32_t> many(31);
  for (int i = 0; i < 31; ++i) many[i] = i;
  return {
      {"basic", random_slots(gen, 37, {0, 1, 2}), 70, 50, 16},
      {"contiguous", [&] { auto s = random_slots(gen, 29, {1, 4}); std::sort(s.begin(), s.end()); return s; }(), 40,
       33, 8, 6, {}, {}, false},
      {"mixed_ranks_with_rank_0", random_slots(gen, 40, {0, 1, 2, 3, 5}), 48, 40, 16, 6, {1, 16, 0, 7, 3, 9}},
      {"rank_128_vllm_expand_divides_by_zero", random_slots(gen, 24, {0, 2}), 256, 192, 128, 3, {128, 5, 77}},
      {"rank_24_not_a_power_of_two", random_slots(gen, 21, {0, 1}), 96, 80, 24, 2},
      {"hidden_4095_unaligned_datacopy", random_slots(gen, 6, {0, 1}), 4095, 4095, 16, 2},
      {"rank_1", random_slots(gen, 11, {0, 5}), 20, 18, 1},
      {"slices_gqa", random_slots(gen, 30, {0, 3}), 40, 96, 8, 6, {8, 2, 8, 5, 0, 1}, {0, 64, 80, 96}},
      {"slices_unequal_wide", random_slots(gen, 25, {1, 2}), 24, 600, 4, 6, {}, {0, 300, 570, 600}},
      {"empty_slice", random_slots(gen, 12, {0}), 16, 20, 4, 6, {}, {0, 0, 20}},
      {"bad_slots_contiguous", std::vector<int32_t>{0, 0, 0, -1, -1, 2, 2, 2, 6, 6, 1, 99, 0, 0}, 30, 26, 8, 6, {},
       {}, false},
      {"no_lora_rows", random_slots(gen, 30, {0, -1, 2, 77}), 30, 26, 8},
      {"skewed_many_tiles", random_slots(gen, 330, many, skew), 24, 20, 8, 32},
      {"prefill_128_row_tiles", random_slots(gen, 300, {0, 1}), 100, 140, 32, 2},
      {"strided_y", random_slots(gen, 21, {0, 1}), 32, 24, 8, 6, {}, {}, true, 10},
  };
}

}  // namespace

TEST(AscendSgmv, ParityGridOverDtypesAndCoreCounts) {
  for (const SgmvCase& c : sgmv_grid()) {
    // float32 x: h stays fp32 (through the block's GM tile back into L1), within the fp32 bound of 1e-5.
    for (auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
      for (uint32_t cores : {1u, 3u, 24u}) {
        EXPECT_EQ(run_sgmv(c, dtype, dtype, cores), "") << c.name << " " << dtype << " cores=" << cores;
      }
      if (dtype != at::kFloat) {
        EXPECT_EQ(run_sgmv(c, dtype, at::kFloat, 5), "") << c.name << " " << dtype << " y=float32";
      }
    }
  }
}

TEST(AscendSgmv, Float32YKeepsTheIntermediateAtRealisticSizes) {
  // h as hi + lo halves: a float32 y is within the fp32-accumulation bound, which h rounded to 16 bits fails
  // (about 2e-4 for fp16, 2e-3 for bf16 at these sizes).
  std::mt19937 gen(21);
  const std::vector<SgmvCase> cases = {
      {"decode_k4096", random_slots(gen, 24, {0, 1, 2, 3}), 4096, 1024, 16, 4},
      {"prefill_k4096_qkv", random_slots(gen, 160, {0, 2, -1}), 4096, 768, 64, 3, {64, 3, 40}, {0, 512, 640, 768}},
  };
  for (const SgmvCase& c : cases) {
    // float32 x keeps h in fp32 throughout: the 1e-5 bound, which h rounded to 16 bits (or split) fails.
    for (auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
      EXPECT_EQ(run_sgmv(c, dtype, at::kFloat, 4), "") << c.name << " " << dtype;
    }
  }
}

TEST(AscendSgmv, PerTokenRoutingWithoutScales) {
  std::mt19937 gen(4);
  SgmvCase c{"bgmv", random_slots(gen, 19, {0, 1, -1, 3}), 24, 20, 8, 4};
  for (int32_t t = 0; t <= 19; ++t) c.meta.indptr.push_back(t);
  c.meta.slots = c.token_slots;
  EXPECT_EQ(run_sgmv(c, at::kHalf, at::kHalf, 4, /*with_scales=*/false), "");
}

TEST(AscendSgmv, GarbageMetadataIsSkippedOrClampedNeverOutOfBounds) {
  // Rows outside [0, T), a decreasing and out-of-range seg_indptr, ranks outside [0, R], slots outside [0, L).
  SgmvCase c{"garbage", std::vector<int32_t>(16, 0), 20, 12, 4, 3, {4, 99, -3}};
  c.meta.idx = {3, -5, 7, 16 + 7, 1, 2, 1 << 30, 9, 0, 4, 5, 6, 8, 10, 11, 12};
  c.meta.indptr = {-4, 3, 1, 9, 1 << 30};
  c.meta.slots = {0, 1, -1, 2};
  EXPECT_EQ(run_sgmv(c, at::kHalf, at::kHalf, 3), "");
  c.meta.slots = {1 << 30, -(1 << 30), 7, 3};
  EXPECT_EQ(run_sgmv(c, at::kBFloat16, at::kFloat, 3), "");
  EXPECT_EQ(run_sgmv(c, at::kFloat, at::kFloat, 3), "");
  // A decreasing indptr makes the later segment empty (running maximum), not a re-read of earlier rows.
  c.meta.indptr = {0, 10, 4, 16, 12};
  c.meta.slots = {0, 1, 0, 1};
  EXPECT_EQ(run_sgmv(c, at::kHalf, at::kFloat, 2), "");
  EXPECT_EQ(run_sgmv(c, at::kFloat, at::kFloat, 2), "");
}

TEST(AscendSgmv, EmptyWorkLeavesYAlone) {
  std::mt19937 gen(2);
  EXPECT_EQ(run_sgmv({"empty_batch", {}, 32, 32, 8}, at::kHalf, at::kHalf, 4), "");
  EXPECT_EQ(run_sgmv({"all_no_lora", std::vector<int32_t>(9, -1), 16, 16, 8}, at::kHalf, at::kHalf, 4), "");
  EXPECT_EQ(run_sgmv({"k_0", random_slots(gen, 8, {0, 1}), 0, 16, 8}, at::kBFloat16, at::kBFloat16, 4), "");
  EXPECT_EQ(run_sgmv({"all_rank_0", random_slots(gen, 8, {0, 1}), 16, 16, 8, 2, {0, 0}}, at::kHalf, at::kHalf, 4), "");
}

TEST(AscendSgmv, DeterministicRunToRun) {
  std::mt19937 gen(9);
  const auto slots = random_slots(gen, 50, {0, 1, 2});
  const Meta m = segments_for(slots, 3, true);
  at::manual_seed(3);
  const at::Tensor x = at::randn({50, 64}).to(at::kBFloat16), a = at::randn({3, 16, 64}).to(at::kBFloat16);
  const at::Tensor b = at::randn({3, 48, 16}).to(at::kBFloat16), y0 = at::randn({50, 48}).to(at::kBFloat16);
  std::vector<at::Tensor> outs;
  for (int i = 0; i < 2; ++i) {
    at::Tensor y = y0.clone();
    lora_ops::ascend::run_sgmv(y, x, a, b, i32(m.indptr), i32(m.slots), i32(m.idx), std::nullopt, std::nullopt,
                               std::nullopt, 1.0, model_device(7));
    outs.push_back(y);
  }
  EXPECT_TRUE(at::equal(outs[0].view(at::kShort), outs[1].view(at::kShort)));
}

namespace {

// The message of the ValueError f throws, "" when it throws none.
std::string value_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::ValueError& e) {
    return e.msg();
  }
  return "";
}

}  // namespace

TEST(AscendSgmv, UnsupportedInputsFailWithAClearError) {
  const auto& error = value_error;
  const at::Tensor idx = i32({0, 1}), slots = i32({0});
  // A float32 h of S*R = 8192 columns needs 16 x 8192 x 4 bytes of L1 (512 KiB) before any staging buffer.
  const std::string f32_rank = error([&] {
    at::Tensor y = at::zeros({2, 8});
    lora_ops::ascend::run_sgmv(y, at::randn({2, 8}), at::zeros({1, 8192, 8}), at::zeros({1, 8, 8192}), i32({0, 2}),
                               slots, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 1.0, model_device(2));
  });
  EXPECT_NE(f32_rank.find("S*R = 8192 intermediate columns"), std::string::npos) << f32_rank;
  EXPECT_NE(f32_rank.find("float32) do not fit in L1"), std::string::npos) << f32_rank;
  const std::string huge_rank = error([&] {
    at::Tensor y = at::zeros({2, 8}, at::kHalf);
    lora_ops::ascend::run_sgmv(y, at::randn({2, 8}).to(at::kHalf), at::zeros({1, 16384, 8}, at::kHalf),
                               at::zeros({1, 8, 16384}, at::kHalf), i32({0, 2}), slots, std::nullopt, std::nullopt,
                               std::nullopt, std::nullopt, 1.0, model_device(2));
  });
  EXPECT_NE(huge_rank.find("do not fit in L1"), std::string::npos) << huge_rank;
}

// ------------------------------------------------------------------------------------------------ lora_expand

namespace {

at::Tensor ref_lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& b, const Meta& m,
                           const std::vector<int32_t>& ranks, const std::vector<float>& scales,
                           const std::vector<int64_t>& offsets, double scale) {
  at::Tensor out = y.to(at::kDouble).clone();
  const int64_t L = b.size(0), R = b.size(2), S = int64_t(offsets.size()) - 1;
  const at::Tensor hd = h.to(at::kDouble), bd = b.to(at::kDouble);
  for (const auto& [slot, rows] : segment_rows(m, y.size(0), L)) {
    const int64_t r = ranks.empty() ? R : std::clamp<int64_t>(ranks[slot], 0, R);
    if (r == 0 || rows.empty()) continue;
    const double coef = scale * (scales.empty() ? 1.0 : scales[slot]);
    const at::Tensor idx = rows_of(rows), h_l = hd.index_select(0, idx).select(1, slot);
    for (int64_t s = 0; s < S; ++s) {
      if (offsets[s] == offsets[s + 1]) continue;
      const at::Tensor b_s = bd[slot].narrow(0, offsets[s], offsets[s + 1] - offsets[s]).narrow(1, 0, r);
      const at::Tensor delta = h_l.narrow(1, s * R, r).matmul(b_s.t());
      at::Tensor cols = out.narrow(1, offsets[s], offsets[s + 1] - offsets[s]);
      cols.index_copy_(0, idx, cols.index_select(0, idx) + coef * delta);
    }
  }
  return out;
}

// How h [T, L, S*R] is laid out: its own tensor, a view with padded rows and slots in a NaN-filled pool, or one
// window per row broadcast over the slots (slot stride 0).
enum class HLayout { kDense, kPooled, kBroadcast };

// Runs sgmv case c as a lora_expand (h drawn in place of the shrink; K unused) on the model and returns compare()'s
// verdict. h past each slot's rank holds NaN, which only a read past the rank can bring into y.
std::string run_lora_expand(const SgmvCase& c, at::ScalarType dtype, at::ScalarType h_dtype, at::ScalarType y_dtype,
                            uint32_t cores, HLayout layout = HLayout::kDense) {
  at::manual_seed(std::hash<std::string>{}(c.name) & 0xffff);
  const int64_t T = int64_t(c.token_slots.size());
  const std::vector<int64_t> offsets = c.offsets.empty() ? std::vector<int64_t>{0, c.N} : c.offsets;
  const int64_t S = int64_t(offsets.size()) - 1;
  at::Tensor h;
  if (layout == HLayout::kBroadcast) {
    h = at::randn({T, 1, S * c.R}).to(h_dtype).expand({T, c.L, S * c.R});
  } else {
    h = layout == HLayout::kPooled
            ? at::full({T, c.L + 2, S * c.R + 5}, NAN, h_dtype).narrow(1, 1, c.L).narrow(2, 3, S * c.R)
            : at::empty({T, c.L, S * c.R}, h_dtype);
    h.copy_(at::randn({T, c.L, S * c.R}));
    for (size_t l = 0; l < c.ranks.size(); ++l) {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t r = std::clamp<int64_t>(c.ranks[l], 0, c.R);
        h.select(1, int64_t(l)).narrow(1, s * c.R + r, c.R - r).fill_(NAN);
      }
    }
  }
  const at::Tensor b = (at::randn({c.L, c.N, c.R}) / std::sqrt(double(c.R))).to(dtype);
  const at::Tensor y_full = at::randn({T, c.N + c.y_col_pad}).to(y_dtype);
  at::Tensor y = y_full.narrow(1, c.y_col_pad / 2, c.N);
  const Meta m = c.meta.indptr.empty() ? segments_for(c.token_slots, c.L, c.gathered) : c.meta;
  std::vector<float> scales;
  for (int64_t l = 0; l < c.L; ++l) scales.push_back(0.5f + 0.25f * float(l % 5));
  const double scale = 0.75;
  const at::Tensor ref = ref_lora_expand(y, h, b, m, c.ranks, scales, offsets, scale);
  const at::Tensor before_full = y_full.clone();
  lora_ops::ascend::run_lora_expand(
      y, h, b, i32(m.indptr), i32(m.slots), opt_i32(m.idx), opt_i32(c.ranks),
      at::tensor(at::ArrayRef<float>(scales), at::TensorOptions().dtype(at::kFloat)),
      c.offsets.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(c.offsets), scale, model_device(cores));
  const int64_t left = c.y_col_pad / 2;
  if (!at::equal(y_full.narrow(1, 0, left), before_full.narrow(1, 0, left)) ||
      !at::equal(y_full.narrow(1, left + c.N, c.y_col_pad - left),
                 before_full.narrow(1, left + c.N, c.y_col_pad - left))) {
    return "columns outside the y view changed";
  }
  return compare(y, before_full.narrow(1, left, c.N), ref, dtype);
}

}  // namespace

TEST(AscendLoraExpand, ParityGridOverDtypesLayoutsAndCoreCounts) {
  for (const SgmvCase& c : sgmv_grid()) {
    for (auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
      for (uint32_t cores : {1u, 24u}) {
        EXPECT_EQ(run_lora_expand(c, dtype, dtype, dtype, cores), "") << c.name << " " << dtype << " cores=" << cores;
      }
      EXPECT_EQ(run_lora_expand(c, dtype, dtype, at::kFloat, 5, HLayout::kPooled), "")
          << c.name << " " << dtype << " pooled h, y=float32";
      if (dtype != at::kFloat) {
        // A float32 h (e.g. the shrink's fp32 partials) with a 16-bit B: split into hi + lo halves.
        EXPECT_EQ(run_lora_expand(c, dtype, at::kFloat, dtype, 3, HLayout::kBroadcast), "")
            << c.name << " " << dtype << " broadcast float32 h";
      }
    }
  }
}

TEST(AscendLoraExpand, Float32HWithHalfBKeepsItsPrecisionAtRealisticSizes) {
  // A float32 y from a float32 h is within the fp32-accumulation bound (5e-5), which h rounded to 16 bits fails.
  std::mt19937 gen(31);
  const std::vector<SgmvCase> cases = {
      {"decode_n4096", random_slots(gen, 24, {0, 1, 2, 3}), 0, 4096, 16, 4},
      {"prefill_qkv_rank_64", random_slots(gen, 160, {0, 2, -1}), 0, 768, 64, 3, {64, 3, 40}, {0, 512, 640, 768}},
  };
  for (const SgmvCase& c : cases) {
    for (auto dtype : {at::kHalf, at::kBFloat16}) {
      EXPECT_EQ(run_lora_expand(c, dtype, at::kFloat, at::kFloat, 4, HLayout::kPooled), "") << c.name << " " << dtype;
    }
  }
}

TEST(AscendLoraExpand, AHugeRankShrinksTheTileToAMultipleOf16) {
  // One 48-row segment asks for 48-row tiles; S*R = 6000 fits L1 only at 16 or 32 rows (never at 24, which would
  // break the NZ layout).
  EXPECT_EQ(run_lora_expand({"rank_6000", std::vector<int32_t>(48, 0), 0, 20, 6000, 1}, at::kHalf, at::kHalf,
                            at::kFloat, 2),
            "");
}

TEST(AscendLoraExpand, GarbageMetadataAndEmptyWork) {
  SgmvCase c{"garbage", std::vector<int32_t>(16, 0), 0, 12, 4, 3, {4, 99, -3}};
  c.meta.idx = {3, -5, 7, 16 + 7, 1, 2, 1 << 30, 9, 0, 4, 5, 6, 8, 10, 11, 12};
  c.meta.indptr = {-4, 3, 1, 9, 1 << 30};
  c.meta.slots = {0, 1, -1, 2};
  EXPECT_EQ(run_lora_expand(c, at::kHalf, at::kHalf, at::kHalf, 3), "");
  c.meta.slots = {1 << 30, -(1 << 30), 7, 3};
  EXPECT_EQ(run_lora_expand(c, at::kBFloat16, at::kFloat, at::kFloat, 3), "");
  std::mt19937 gen(2);
  EXPECT_EQ(run_lora_expand({"empty_batch", {}, 0, 32, 8}, at::kHalf, at::kHalf, at::kHalf, 4), "");
  EXPECT_EQ(run_lora_expand({"all_rank_0", random_slots(gen, 8, {0, 1}), 0, 16, 8, 2, {0, 0}}, at::kHalf, at::kHalf,
                            at::kHalf, 4),
            "");
}

TEST(AscendLoraExpand, UnsupportedInputsFailWithAClearError) {
  const at::Tensor slots = i32({0});
  const std::string huge_rank = value_error([&] {
    at::Tensor y = at::zeros({2, 8}, at::kHalf);
    lora_ops::ascend::run_lora_expand(y, at::zeros({2, 1, 16384}, at::kHalf), at::zeros({1, 8, 16384}, at::kHalf),
                                      i32({0, 2}), slots, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 1.0,
                                      model_device(2));
  });
  EXPECT_NE(huge_rank.find("lora_expand on Ascend: S*R = 16384 columns of h"), std::string::npos) << huge_rank;
  const std::string b_stride = value_error([&] {
    at::Tensor y = at::zeros({2, 8}, at::kHalf);
    const at::Tensor b = at::zeros({1, 8, 70000}, at::kHalf).narrow(2, 0, 4);
    lora_ops::ascend::run_lora_expand(y, at::zeros({2, 1, 4}, at::kHalf), b, i32({0, 2}), slots, std::nullopt,
                                      std::nullopt, std::nullopt, std::nullopt, 1.0, model_device(2));
  });
  EXPECT_NE(b_stride.find("the row stride of lora_b (70000)"), std::string::npos) << b_stride;
}

// ------------------------------------------------------------------------------------------------ grouped_gemm

namespace {

struct GgCase {
  std::string name;
  std::vector<int32_t> token_slots;
  int64_t K, N, L = 5;
  std::vector<int32_t> n_sizes = {}, k_sizes = {};
  double alpha = 1.0;
  bool accumulate = true, gathered = true;
  double x_scale = 1.0;  // magnitude of x
};

// w in `dtype`, x in x_dtype (default: dtype), y in y_dtype.
std::string run_grouped_gemm(const GgCase& c, at::ScalarType dtype, at::ScalarType y_dtype, uint32_t cores,
                             std::optional<at::ScalarType> x_dtype = std::nullopt) {
  at::manual_seed(std::hash<std::string>{}(c.name) & 0xffff);
  const int64_t T = int64_t(c.token_slots.size());
  const at::Tensor x = (at::randn({T, c.K}) * c.x_scale).to(x_dtype.value_or(dtype));
  const at::Tensor w = (at::randn({c.L, c.N, c.K}) / std::sqrt(double(std::max<int64_t>(c.K, 1)))).to(dtype);
  at::Tensor y = at::randn({T, c.N}).to(y_dtype);
  const Meta m = segments_for(c.token_slots, c.L, c.gathered);
  const at::Tensor ref = ref_grouped_gemm(y, x, w, m, c.n_sizes, c.k_sizes, c.alpha, c.accumulate);
  const at::Tensor before = y.clone();
  lora_ops::ascend::run_grouped_gemm(y, x, w, i32(m.indptr), i32(m.slots), opt_i32(m.idx), opt_i32(c.n_sizes),
                                     opt_i32(c.k_sizes), c.alpha, c.accumulate, model_device(cores));
  return compare(y, before, ref, dtype);
}

std::vector<GgCase> grouped_gemm_grid() {
  std::mt19937 gen(13);
  return {
      {"basic", random_slots(gen, 33, {0, 1, 4}), 50, 36},
      {"contiguous", [&] { auto s = random_slots(gen, 20, {2, 3}); std::sort(s.begin(), s.end()); return s; }(), 20,
       17, 5, {}, {}, 1.0, true, false},
      {"n_k_sizes_with_empty_reduction", random_slots(gen, 30, {0, 1, 2, 3}), 40, 36, 5, {36, 5, 0, 20, 1},
       {40, 7, 3, 0, 40}},
      {"overwrite_alpha", random_slots(gen, 30, {0, 2}), 24, 20, 5, {}, {}, 0.5, false},
      {"overwrite_with_empty_reduction", random_slots(gen, 30, {0, 2, 3}), 24, 20, 5, {3, 20, 11, 20, 1},
       {24, 0, 9, 0, 2}, 1.0, false},
      {"shrink_to_rank", random_slots(gen, 25, {0, 1}), 1000, 16, 5, {16, 4, 8, 8, 8}},
      {"expand_wide", random_slots(gen, 25, {0, 1}), 16, 700, 5, {}, {16, 4, 8, 8, 8}},
      {"bad_slots", std::vector<int32_t>{0, 0, 0, -1, -1, -1, -1, 2, 2, 2, 2, 2, 5, 5, 1, 1, 1}, 16, 16, 5, {}, {},
       1.0, true, false},
      {"prefill_128_row_tiles", random_slots(gen, 270, {0, 1}), 96, 80},
  };
}

}  // namespace

TEST(AscendGroupedGemm, ParityGridOverDtypesAndCoreCounts) {
  for (const GgCase& c : grouped_gemm_grid()) {
    for (auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
      for (uint32_t cores : {1u, 6u}) {
        EXPECT_EQ(run_grouped_gemm(c, dtype, dtype, cores), "") << c.name << " " << dtype << " cores=" << cores;
      }
      if (dtype != at::kFloat) {
        EXPECT_EQ(run_grouped_gemm(c, dtype, at::kFloat, 3), "") << c.name << " " << dtype << " y=float32";
        // A float32 x (e.g. the intermediate of a shrink) with a 16-bit w: split into hi + lo halves.
        for (auto y_dtype : {dtype, at::kFloat}) {
          EXPECT_EQ(run_grouped_gemm(c, dtype, y_dtype, 3, at::kFloat), "")
              << c.name << " " << dtype << " x=float32 y=" << y_dtype;
        }
      }
    }
  }
}

TEST(AscendGroupedGemm, Float32XWithHalfWeightsAtRealisticSizes) {
  // The LoRA expand of an fp32 intermediate, a long reduction, and x near the top of fp16's range (hi + lo
  // halves; fp16 w overflows beyond 65504, as on CUDA and Triton). x rounded to 16 bits fails these bounds.
  std::mt19937 gen(23);
  const std::vector<GgCase> cases = {
      {"lora_expand_n4096", random_slots(gen, 96, {0, 1, 2}), 64, 4096, 3, {}, {64, 16, 8}},
      {"reduction_k4096", random_slots(gen, 40, {0, 1}), 4096, 64, 2, {64, 16}},
      {"x_near_fp16_max", random_slots(gen, 30, {0, 1}), 300, 72, 2, {}, {}, 0.5, true, true, 8000.0},
  };
  for (const GgCase& c : cases) {
    for (auto dtype : {at::kHalf, at::kBFloat16}) {
      EXPECT_EQ(run_grouped_gemm(c, dtype, at::kFloat, 4, at::kFloat), "") << c.name << " " << dtype;
    }
  }
}

TEST(AscendGroupedGemm, EmptyReductionOverwritesWithZerosAndAccumulatesNothing) {
  std::mt19937 gen(5);
  const auto slots = random_slots(gen, 12, {0, 1});
  EXPECT_EQ(run_grouped_gemm({"k0_overwrite", slots, 0, 24, 2, {}, {}, 1.0, false}, at::kHalf, at::kHalf, 3), "");
  EXPECT_EQ(run_grouped_gemm({"k0_accumulate", slots, 0, 24, 2}, at::kHalf, at::kHalf, 3), "");
}

// ------------------------------------------------------------------------------------------------ build_segments

TEST(AscendBuildSegments, MatchesTheCpuKernel) {
  std::mt19937 gen(17);
  struct Case {
    int64_t T, L;
  };
  for (Case c : {Case{0, 3}, Case{7, 0}, Case{1, 1}, Case{5000, 37}, Case{20000, 5}}) {
    std::uniform_int_distribution<int32_t> slot(-2, int32_t(c.L) + 2);
    std::vector<int32_t> v(c.T);
    for (auto& s : v) s = slot(gen);
    if (c.T > 2) v[0] = 1 << 30, v[1] = -(1 << 30);
    const at::Tensor token_lora = i32(v);
    const auto [idx, indptr, seg] = lora_ops::ascend::run_build_segments(token_lora, c.L, model_device(24));
    const auto [ridx, rindptr, rseg] = lora_ops_test::call_build_segments(token_lora, c.L);
    EXPECT_TRUE(at::equal(idx, ridx)) << c.T << " " << c.L;
    EXPECT_TRUE(at::equal(indptr, rindptr)) << c.T << " " << c.L;
    EXPECT_TRUE(at::equal(seg, rseg)) << c.T << " " << c.L;
  }
}

TEST(AscendBuildSegments, TooManySlotsForTheHistogramIsAClearError) {
  try {
    lora_ops::ascend::run_build_segments(i32({0, 1}), 1 << 20, model_device(1));
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.msg()).find("exceeds what the kernel's two UB histograms hold"), std::string::npos)
        << e.msg();
  }
}
