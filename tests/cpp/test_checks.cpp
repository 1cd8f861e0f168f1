// The shared argument checks (csrc/common/checks.cpp): error type and message per failure class.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <limits>

#include "common/checks.h"
#include "test_util.h"

using namespace lora_ops_test;

namespace {

struct SgmvArgs {
  at::Tensor y = at::randn({4, 12}), x = at::randn({4, 16}), a = at::randn({3, 4, 16}), b = at::randn({3, 12, 4});
  at::Tensor indptr = i32({0, 2, 4}), slots = i32({0, 2});
  std::optional<std::vector<int64_t>> offsets;
  std::string error() {
    lora_ops::SgmvIndexTensors keep;
    try {
      at::OptionalIntArrayRef off = offsets ? at::OptionalIntArrayRef(*offsets) : std::nullopt;
      lora_ops::check_sgmv(y, x, a, b, indptr, slots, std::nullopt, std::nullopt, std::nullopt, off, 1.0, keep);
    } catch (const c10::Error& e) {
      return e.msg();
    }
    return "";
  }
};

}  // namespace

TEST(Checks, ValidSgmvPassesAndFillsParams) {
  SgmvArgs args;
  args.offsets = std::vector<int64_t>{0, 5, 12};
  args.a = at::randn({3, 8, 16});
  lora_ops::SgmvIndexTensors keep;
  auto p = lora_ops::check_sgmv(args.y, args.x, args.a, args.b, args.indptr, args.slots, std::nullopt, std::nullopt,
                                std::nullopt, at::IntArrayRef(*args.offsets), 2.0, keep);
  EXPECT_EQ(p.num_slices, 2);
  EXPECT_EQ(p.max_rank, 4);
  EXPECT_EQ(p.slice_offsets[1], 5);
  EXPECT_EQ(p.seg.num_segments, 2);
  EXPECT_EQ(p.seg.positions, 4);
  EXPECT_FLOAT_EQ(p.scale, 2.0f);
}

TEST(Checks, SgmvMessagesNameArgumentValueAndExpectation) {
  {
    SgmvArgs args;
    args.a = at::randn({3, 4, 15});
    EXPECT_NE(args.error().find("lora_a must be [L, S*R, K] with K = x.size(1) = 16, got shape [3, 4, 15]"),
              std::string::npos);
  }
  {
    SgmvArgs args;
    args.offsets = std::vector<int64_t>{0, 7, 3, 12};
    args.a = at::randn({3, 12, 16});
    EXPECT_NE(args.error().find("slice_offsets must be non-decreasing"), std::string::npos);
  }
  {
    SgmvArgs args;
    args.x = at::randn({16, 4}).t();
    EXPECT_NE(args.error().find("x must have unit stride in its last dimension"), std::string::npos);
  }
  {
    SgmvArgs args;
    args.slots = i32({0, 1, 2});
    EXPECT_NE(args.error().find("seg_lora must have 2 entries"), std::string::npos);
  }
}

TEST(Checks, DtypeErrorsAreTypeErrors) {
  SgmvArgs args;
  args.b = at::randn({3, 12, 4}).to(at::kHalf);
  lora_ops::SgmvIndexTensors keep;
  EXPECT_THROW(lora_ops::check_sgmv(args.y, args.x, args.a, args.b, args.indptr, args.slots, std::nullopt,
                                    std::nullopt, std::nullopt, std::nullopt, 1.0, keep),
               c10::TypeError);
}

TEST(Checks, BuildSegmentsRejectsNegativeSlots) {
  EXPECT_THROW(lora_ops::check_build_segments_host(i32({0, 1}), -3), c10::ValueError);
}

TEST(Checks, Int64IndexValuesSaturateToInt32) {
  // Values beyond int32 saturate (INT32_MIN / INT32_MAX) instead of wrapping: 2^32 + 2 would wrap to 2.
  SgmvArgs args;
  const auto i64 = [](std::vector<int64_t> v) { return at::tensor(at::ArrayRef<int64_t>(v), at::kLong); };
  const int64_t big = int64_t{1} << 32;
  lora_ops::SgmvIndexTensors keep;
  auto p = lora_ops::check_sgmv(args.y, args.x, args.a, args.b, i64({0, big + 2, 4}), i64({-big, big}),
                                i64({big + 3, -big + 1, 0, 1}), i64({big + 1, 2, -big}), std::nullopt, std::nullopt,
                                1.0, keep);
  const int32_t lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  EXPECT_TRUE(at::equal(keep.seg_indptr, i32({0, hi, 4})));
  EXPECT_TRUE(at::equal(keep.seg_lora, i32({lo, hi})));
  EXPECT_TRUE(at::equal(keep.token_indices, i32({hi, lo, 0, 1})));
  EXPECT_TRUE(at::equal(keep.lora_ranks, i32({hi, 2, lo})));
  EXPECT_EQ(p.seg.indptr, keep.seg_indptr.data_ptr<int32_t>());
  EXPECT_EQ(p.seg.positions, 4);
}

TEST(Checks, Int32ContiguousIndexTensorsAreNotCopied) {
  SgmvArgs args;
  lora_ops::SgmvIndexTensors keep;
  auto p = lora_ops::check_sgmv(args.y, args.x, args.a, args.b, args.indptr, args.slots, std::nullopt, std::nullopt,
                                std::nullopt, std::nullopt, 1.0, keep);
  EXPECT_EQ(p.seg.indptr, args.indptr.data_ptr<int32_t>());
  EXPECT_EQ(p.seg.slot, args.slots.data_ptr<int32_t>());
}

TEST(Checks, HostChecksRunOnMetaTensors) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  auto y = at::empty({4, 12}, meta), x = at::empty({4, 16}, meta), a = at::empty({3, 4, 16}, meta);
  auto indptr = at::empty({3}, meta.dtype(at::kInt)), slots = at::empty({2}, meta.dtype(at::kInt));
  lora_ops::check_sgmv_host(y, x, a, at::empty({3, 12, 4}, meta), indptr, slots, std::nullopt, std::nullopt,
                            std::nullopt, std::nullopt);
  try {
    lora_ops::check_sgmv_host(y, x, a, at::empty({3, 11, 4}, meta), indptr, slots, std::nullopt, std::nullopt,
                              std::nullopt, std::nullopt);
    FAIL() << "a wrong lora_b shape passed on meta";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.msg()).find("lora_b must be [L, N, R] with N = y.size(1) = 12"), std::string::npos);
  }
  EXPECT_THROW(lora_ops::check_grouped_gemm_host(y, x, at::empty({3, 12, 15}, meta), indptr, slots, std::nullopt,
                                                 std::nullopt, std::nullopt),
               c10::ValueError);
}
