// The shared argument checks (csrc/common/checks.cpp): error type and message per failure class.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

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
  EXPECT_THROW(lora_ops::check_build_segments_args(i32({0, 1}), -3), c10::ValueError);
}
