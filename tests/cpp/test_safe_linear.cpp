// safe_linear's rule (csrc/common/safe_linear.cpp): which calls keep their bias out of cuBLASLt's epilogue. The
// rule reads addresses, sizes and strides only, so CPU tensors test it; the CUDA product is tests/test_fold_linear.py's
// and tests/test_lora_linear.py's.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/safe_linear.h"

namespace {

// n elements of dtype starting `offset` elements past a fresh (aligned) allocation
at::Tensor at_offset(int64_t n, int64_t offset, at::ScalarType dtype = at::kBFloat16) {
  return at::randn({n + offset}).to(dtype).narrow(0, offset, n);
}

}  // namespace

TEST(SafeLinear, AlignedOperandsKeepTheEpilogue) {
  const at::Tensor x = at_offset(4 * 16, 0).view({4, 16}), w = at_offset(24 * 16, 0).view({24, 16});
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(24, 0)));
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(24, 8)));  // 16 bytes on: still aligned
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x.view({2, 2, 16}), w, at_offset(24, 0)));
}

TEST(SafeLinear, AnOperandOrRowOff16MisreadsTheBias) {
  const at::Tensor x = at_offset(4 * 16, 0).view({4, 16}), w = at_offset(24 * 16, 0).view({24, 16});
  const at::Tensor b = at_offset(24, 0);
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(24, 1)));                    // bias 2 bytes off
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(24, 1).view({1, 24})));       // broadcast, too
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(at_offset(4 * 16, 1).view({4, 16}), w, b));  // x 2 bytes off
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(x, at_offset(24 * 16, 3).view({24, 16}), b));  // w 6 bytes off
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(at_offset(4 * 12, 0).view({4, 12}),  // rows of 24 bytes
                                               at_offset(24 * 12, 0).view({24, 12}), b));
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(x, at_offset(20 * 16, 0).view({20, 16}),  // y's rows 40 bytes
                                               at_offset(20, 0)));
  EXPECT_TRUE(  // w's rows 40 bytes apart
      lora_ops::unaligned_for_bias_epilogue(x, at_offset(24 * 20, 0).view({24, 20}).narrow(1, 0, 16), b));
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(at_offset(4 * 20, 0).view({4, 20}).narrow(1, 0, 16), w, b));
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(at_offset(16 * 4, 0).view({16, 4}).t(), w, b));  // column-major
  // float32: 4 elements to 16 bytes
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(at_offset(4 * 12, 0, at::kFloat).view({4, 12}),
                                                at_offset(24 * 12, 0, at::kFloat).view({24, 12}),
                                                at_offset(24, 4, at::kFloat)));
  EXPECT_TRUE(lora_ops::unaligned_for_bias_epilogue(at_offset(4 * 12, 0, at::kFloat).view({4, 12}),
                                               at_offset(24 * 12, 0, at::kFloat).view({24, 12}),
                                               at_offset(24, 2, at::kFloat)));
}

TEST(SafeLinear, ABiasLinearWouldRefuseIsLinearsToRefuse) {
  const at::Tensor x = at_offset(4 * 16, 1).view({4, 16}), w = at_offset(24 * 16, 0).view({24, 16});
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(24, 1, at::kFloat)));  // another dtype
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(23, 1)));              // another length
  EXPECT_FALSE(lora_ops::unaligned_for_bias_epilogue(x, w, at_offset(48, 0).view({2, 24})));  // 2 x N values
  EXPECT_THROW(lora_ops::safe_linear(x, w, at_offset(24, 1, at::kFloat)), c10::Error);
}

TEST(SafeLinear, OffTheGpuItIsAtLinear) {
  // the outputs off tolerance were cuBLASLt's: elsewhere the bias stays in at::linear, bitwise
  const at::Tensor x = at_offset(4 * 16, 1).view({4, 16}), w = at_offset(24 * 16, 0).view({24, 16});
  const at::Tensor b = at_offset(24, 1);
  ASSERT_TRUE(lora_ops::unaligned_for_bias_epilogue(x, w, b));
  EXPECT_TRUE(at::equal(lora_ops::safe_linear(x, w, b), at::linear(x, w, b)));
  EXPECT_TRUE(at::equal(lora_ops::safe_linear(x, w, std::nullopt), at::linear(x, w)));
  EXPECT_TRUE(at::equal(lora_ops::safe_linear(x, w, b.view({1, 24})), at::linear(x, w, b.view({1, 24}))));
}
