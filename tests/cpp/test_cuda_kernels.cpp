// CUDA kernels against the CPU kernels (themselves tested against a naive reference). Skipped without a GPU.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "test_util.h"

using namespace lora_ops_test;

namespace {
bool have_cuda_kernels() {
  return torch::cuda::is_available() &&
         c10::Dispatcher::singleton().findSchemaOrThrow("lora_ops::sgmv", "").hasKernelForDispatchKey(
             c10::DispatchKey::CUDA);
}
}  // namespace

TEST(CudaSgmv, MatchesCpuOnGatheredMixedRanks) {
  if (!have_cuda_kernels()) GTEST_SKIP() << "no CUDA device or CUDA kernels not compiled";
  at::manual_seed(0);
  const int64_t T = 50, K = 200, N = 130, L = 4, R = 16;
  auto x = at::randn({T, K}).to(at::kBFloat16), a = (at::randn({L, R, K}) / 14).to(at::kBFloat16);
  auto b = (at::randn({L, N, R}) / 4).to(at::kBFloat16), y = at::randn({T, N}).to(at::kBFloat16);
  auto token_lora = at::randint(-1, L, {T}, at::TensorOptions().dtype(at::kInt));
  auto [idx, indptr, seg] = call_build_segments(token_lora, L);
  auto ranks = i32({16, 3, 0, 9});
  auto y_cpu = y.to(at::kFloat), y_gpu = y.cuda();
  call_sgmv(y_cpu, x.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat), indptr, seg, idx, ranks, std::nullopt,
            std::nullopt, 1.0);
  call_sgmv(y_gpu, x.cuda(), a.cuda(), b.cuda(), indptr.cuda(), seg.cuda(), idx.cuda(), ranks.cuda(), std::nullopt,
            std::nullopt, 1.0);
  EXPECT_LT(rel_err(y_gpu.cpu().to(at::kFloat) - y.to(at::kFloat), (y_cpu - y.to(at::kFloat)).to(at::kDouble)), 1e-2);
}

TEST(CudaBuildSegments, MatchesCpu) {
  if (!have_cuda_kernels()) GTEST_SKIP() << "no CUDA device or CUDA kernels not compiled";
  auto token_lora = at::randint(-2, 40, {5000}, at::TensorOptions().dtype(at::kInt));
  auto [ci, cp, cs] = call_build_segments(token_lora, 37);
  auto [gi, gp, gs] = call_build_segments(token_lora.cuda(), 37);
  EXPECT_TRUE(at::equal(ci, gi.cpu()));
  EXPECT_TRUE(at::equal(cp, gp.cpu()));
  EXPECT_TRUE(at::equal(cs, gs.cpu()));
}

// Both grouped_gemm paths (skinny K = 16 expand, general 128 x 128 tiles) against the CPU kernel.
TEST(CudaGroupedGemm, MatchesCpuOnGatheredSizes) {
  if (!have_cuda_kernels()) GTEST_SKIP() << "no CUDA device or CUDA kernels not compiled";
  at::manual_seed(1);
  const int64_t T = 300, L = 4;
  for (const int64_t K : {16, 200}) {
    const int64_t N = 130;
    auto x = at::randn({T, K}).to(at::kBFloat16), w = (at::randn({L, N, K}) / 14).to(at::kBFloat16);
    auto y = at::randn({T, N});  // float32: a bf16 y's own rounding would swamp the product's error
    auto token_lora = at::randint(-1, L, {T}, at::TensorOptions().dtype(at::kInt));
    auto [idx, indptr, seg] = call_build_segments(token_lora, L);
    auto n_sizes = i32({130, 3, 0, 64}), k_sizes = i32({(int32_t)K, 5, 9, 0});
    for (const bool accumulate : {true, false}) {
      auto y_cpu = y.clone(), y_gpu = y.cuda();
      call_grouped_gemm(y_cpu, x.to(at::kFloat), w.to(at::kFloat), indptr, seg, idx, n_sizes, k_sizes, 0.5, accumulate);
      call_grouped_gemm(y_gpu, x.cuda(), w.cuda(), indptr.cuda(), seg.cuda(), idx.cuda(), n_sizes.cuda(),
                        k_sizes.cuda(), 0.5, accumulate);
      const auto before = y;
      EXPECT_LT(rel_err(y_gpu.cpu() - before, (y_cpu - before).to(at::kDouble)), 5e-5) << "K = " << K;
    }
  }
}
