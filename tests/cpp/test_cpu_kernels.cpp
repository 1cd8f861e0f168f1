// CPU kernels against a plain-loop double reference on small cases, and the segment walk of params.h.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "common/params.h"
#include "test_util.h"

using namespace lora_ops_test;

TEST(CpuSgmv, MatchesNaiveReferenceWithGatherRanksAndSkips) {
  at::manual_seed(0);
  const int64_t T = 7, K = 13, N = 9, L = 3, R = 4;
  auto x = at::randn({T, K}), a = at::randn({L, R, K}), b = at::randn({L, N, R}), y = at::randn({T, N});
  std::vector<int32_t> indptr{0, 3, 5, 7}, slots{2, -1, 0}, idx{6, 0, 3, 1, 2, 5, 4}, ranks{4, 2, 3};
  auto ref = naive_sgmv(y, x, a, b, indptr, slots, idx, ranks, 0.5);
  auto y_before = y.clone();
  call_sgmv(y, x, a, b, i32(indptr), i32(slots), i32(idx), i32(ranks), std::nullopt, std::nullopt, 0.5);
  EXPECT_LT(rel_err(y, ref), 1e-6);
  // rows 1 and 2 are in the slot -1 segment: bitwise untouched
  EXPECT_TRUE(at::equal(y.index({at::indexing::Slice(1, 3)}), y_before.index({at::indexing::Slice(1, 3)})));
}

TEST(CpuSgmv, BFloat16AccumulatesInFloat32) {
  at::manual_seed(1);
  const int64_t T = 5, K = 64, N = 16, L = 1, R = 8;
  auto opt = at::TensorOptions().dtype(at::kBFloat16);
  auto x = at::randn({T, K}).to(at::kBFloat16), a = (at::randn({L, R, K}) / 8).to(at::kBFloat16);
  auto b = at::randn({L, N, R}).to(at::kBFloat16), y = at::zeros({T, N}, opt.dtype(at::kFloat));
  std::vector<int32_t> indptr{0, T}, slots{0}, ranks{R};
  auto ref = naive_sgmv(y, x, a, b, indptr, slots, {}, ranks, 1.0);
  call_sgmv(y, x, a, b, i32(indptr), i32(slots), std::nullopt, std::nullopt, std::nullopt, std::nullopt, 1.0);
  EXPECT_LT(rel_err(y, ref), 1e-5);  // y is float32: only rounding of the float32 accumulation remains
}

TEST(CpuGroupedGemm, OverwriteWithPerGroupSizes) {
  at::manual_seed(2);
  const int64_t T = 6, K = 10, N = 7;
  auto x = at::randn({T, K}), w = at::randn({2, N, K});
  auto y = at::full({T, N}, std::numeric_limits<float>::quiet_NaN());
  call_grouped_gemm(y, x, w, i32({0, 4, 6}), i32({1, 0}), std::nullopt, i32({7, 3}), i32({5, 10}), 2.0, false);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t l = t < 4 ? 1 : 0, n_l = l == 1 ? 3 : 7, k_l = l == 1 ? 10 : 5;
    for (int64_t n = 0; n < N; ++n) {
      const float got = y[t][n].item<float>();
      if (n >= n_l) {
        EXPECT_TRUE(std::isnan(got)) << "column beyond n_l written at " << t << "," << n;
        continue;
      }
      double want = 0;
      for (int64_t k = 0; k < k_l; ++k) want += 2.0 * x[t][k].item<double>() * w[l][n][k].item<double>();
      EXPECT_NEAR(got, want, 1e-4);
    }
  }
}

TEST(CpuBuildSegments, StableCountingSortWithNoLoraLast) {
  auto [idx, indptr, seg] = call_build_segments(i32({2, 0, -1, 2, 9, 0, 1}), 3);
  EXPECT_TRUE(at::equal(idx, i32({1, 5, 6, 0, 3, 2, 4})));
  EXPECT_TRUE(at::equal(indptr, i32({0, 2, 3, 5})));
  EXPECT_TRUE(at::equal(seg, i32({0, 1, 2})));
}

TEST(CpuBuildSegments, EmptyInputs) {
  auto [idx, indptr, seg] = call_build_segments(i32({}), 2);
  EXPECT_EQ(idx.numel(), 0);
  EXPECT_TRUE(at::equal(indptr, i32({0, 0, 0})));
}

TEST(SegmentWalk, RunningMaximumMakesSegmentsDisjoint) {
  // indptr [2, 5, 1, 7, 9, 3] over P = 8: m = [2, 5, 5, 7, 8, 8]; segments [2,5), [5,5), [5,7), [7,8), [8,8).
  std::vector<int32_t> indptr{2, 5, 1, 7, 9, 3}, slots{0, 0, 0, 0, 0};
  lora_ops::Segments seg{indptr.data(), slots.data(), nullptr, 5, 8};
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t end = lora_ops::clamped_indptr(seg, 0);
  for (int64_t g = 0; g < seg.num_segments; ++g) {
    const int64_t begin = end;
    end = lora_ops::segment_end(seg, g, begin);
    ranges.emplace_back(begin, end);
  }
  const std::vector<std::pair<int64_t, int64_t>> want{{2, 5}, {5, 5}, {5, 7}, {7, 8}, {8, 8}};
  EXPECT_EQ(ranges, want);
}

TEST(CpuSgmv, OverlappingSegmentsCoverEachRowOnce) {
  // The example: four copies of [0, 3) over invalid rows, then rows 0, 1, 2 one per segment.
  at::manual_seed(3);
  const int64_t K = 8, N = 6, R = 4;
  auto x = at::randn({3, K}), a = at::randn({1, R, K}), b = at::randn({1, N, R}), y = at::randn({3, N});
  std::vector<int32_t> indptr{0, 3, 0, 3, 0, 3, 0, 3, 3, 4, 5, 6}, slots(11, 0), idx{-1, -1, -1, 0, 1, 2};
  auto ref = naive_sgmv(y, x, a, b, {0, 3}, {0}, {}, {R}, 1.0);  // each row once
  call_sgmv(y, x, a, b, i32(indptr), i32(slots), i32(idx), std::nullopt, std::nullopt, std::nullopt, 1.0);
  EXPECT_LT(rel_err(y, ref), 1e-6);
  // Overlapping ranges over valid rows: [0, 3) then [0, 3) again (empty: below the running maximum).
  auto y2 = at::randn({3, N});
  auto ref2 = naive_sgmv(y2, x, a, b, {0, 3}, {0}, {}, {R}, 1.0);
  call_sgmv(y2, x, a, b, i32({0, 3, 0, 3}), i32({0, 0, 0}), std::nullopt, std::nullopt, std::nullopt, std::nullopt, 1.0);
  EXPECT_LT(rel_err(y2, ref2), 1e-6);
}

TEST(CpuSgmv, EmptyReductionLeavesYBitwise) {
  auto y = at::randn({4, 6});
  y.index_put_({0, 0}, -0.0);
  const auto before = y.clone();
  auto scales = at::full({2}, std::numeric_limits<float>::quiet_NaN());
  call_sgmv(y, at::zeros({4, 0}), at::zeros({2, 4, 0}), at::randn({2, 6, 4}), i32({0, 4}), i32({1}), std::nullopt,
            std::nullopt, scales, std::nullopt, 1.0);
  EXPECT_EQ(std::memcmp(y.data_ptr(), before.data_ptr(), y.nbytes()), 0);
}

TEST(CpuGroupedGemm, EmptyReductionIsZeroWhateverAlpha) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool accumulate : {true, false}) {
    auto y = at::randn({4, 6});
    y.index_put_({1, 1}, -0.0);
    auto want = y.clone();
    if (!accumulate) want.index_put_({at::indexing::Slice(0, 3), at::indexing::Slice(0, 2)}, 0.f);
    call_grouped_gemm(y, at::randn({4, 5}), at::randn({2, 6, 5}), i32({0, 3}), i32({1}), std::nullopt, i32({6, 2}),
                      i32({5, 0}), nan, accumulate);
    EXPECT_EQ(std::memcmp(y.data_ptr(), want.data_ptr(), y.nbytes()), 0) << "accumulate = " << accumulate;
  }
}
