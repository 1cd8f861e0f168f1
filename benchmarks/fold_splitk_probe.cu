// Probe (issue 12, T = 65-128): can a CUTLASS GEMM of our own, split along K as batches, match cuBLAS on the fold
// route's narrow layers? The structural next step in csrc/cuda/NOTES.md (session 41) needs one that also triggers
// its dependents early; this asks the speed question alone, before any integration.
//
// y = x . W^T for W [N, K] (the base weight with every slot's A rows) and x [T, K], bf16, mapped as fold_linear_sm90
// maps it (W's rows are the GEMM's M, the tokens its N, D = y^T column-major). Split K into S equal parts as the
// batch mode L: batch s reads W[:, s*K/S : (s+1)*K/S] and x likewise (the batch stride is K/S elements) and writes
// an fp32 partial [S][T][N]; a reduce sums the S partials in order (deterministic) into bf16 y. Configurations: 64 W
// rows x 128 tokens (ping-pong, as the kext route's tile) and 128 x 128 (cooperative), clusters of 1 or 2 along W's
// rows (x multicast), any S dividing K/64.
//
// A plain C library (no torch: built here, run by benchmarks/fold_splitk_probe.py through ctypes on the GPU
// machine, timed there against torch.mm, i.e. cuBLAS, in one process):
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
//     -I<cutlass_library>/source/include benchmarks/fold_splitk_probe.cu -o build/probes/fold_splitk_probe.so
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda_bf16.h>

#include <cstdint>

#include "../csrc/cuda/cutlass_run.cuh"  // the production GEMMs' collectives: what is measured is what would be built

namespace {

using T = cutlass::bfloat16_t;

template <int kRows, int kTokens, int kCluster, bool kCooperative>
struct SplitGemm {
  using Collectives = lora_ops::cuda::DecodeCollectives<T, cute::Shape<cute::Int<kRows>, cute::Int<kTokens>, cute::_64>,
                                                        cute::Shape<cute::Int<kCluster>, cute::_1, cute::_1>,
                                                        kCooperative, float>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, typename Collectives::Mainloop,
                                                      typename Collectives::Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// partials [S][T*N] fp32 -> y [T*N] bf16, summed in order; 4 elements a thread.
__global__ void reduce_partials(const float* partials, __nv_bfloat16* y, int64_t elems, int splits) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= elems) return;
  float4 sum = *reinterpret_cast<const float4*>(partials + i);
  for (int s = 1; s < splits; ++s) {
    const float4 p = *reinterpret_cast<const float4*>(partials + s * elems + i);
    sum.x += p.x;
    sum.y += p.y;
    sum.z += p.z;
    sum.w += p.w;
  }
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(y + i);
  out[0] = __floats2bfloat162_rn(sum.x, sum.y);
  out[1] = __floats2bfloat162_rn(sum.z, sum.w);
}

template <class G>
int run_gemm(const void* w, const void* x, void* partials, int n, int t, int k, int splits, cudaStream_t stream) {
  using K = typename G::Kernel;
  const int k_part = k / splits;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  args.problem_shape = cute::make_shape(n, t, k_part, splits);
  args.mainloop.ptr_A = static_cast<const T*>(w);
  args.mainloop.dA = typename K::StrideA{int64_t{k}, cute::Int<1>{}, int64_t{k_part}};
  args.mainloop.ptr_B = static_cast<const T*>(x);
  args.mainloop.dB = typename K::StrideB{int64_t{k}, cute::Int<1>{}, int64_t{k_part}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename K::StrideC{cute::Int<1>{}, int64_t{n}, int64_t{n} * t};
  args.epilogue.ptr_D = static_cast<float*>(partials);
  args.epilogue.dD = typename K::StrideD{cute::Int<1>{}, int64_t{n}, int64_t{n} * t};
  static cutlass::KernelHardwareInfo hw_info = [] {  // an occupancy query: once, on the first (eager) call
    int device = 0;
    cudaGetDevice(&device);
    return cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(device);
  }();
  args.hw_info = hw_info;
  if (!K::can_implement(args)) return 1;
  if (G::Device::get_workspace_size(args) != 0) return 2;
  if (K::initialize_workspace(args, nullptr, stream) != cutlass::Status::kSuccess) return 3;
  auto params = K::to_underlying_arguments(args, nullptr);
  if (cudaFuncSetAttribute(cutlass::device_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           K::SharedStorageSize) != cudaSuccess) {
    return 4;
  }
  if (G::Device::run(params, stream) != cutlass::Status::kSuccess) return 5;
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

}  // namespace

// config: 0 = 64 x 128 ping-pong, cluster 1; 1 = the same, cluster 2; 2 = 128 x 128 cooperative, cluster 1;
// 3 = the same, cluster 2. partials: splits * t * n floats. y: null to skip the reduce (the GEMM alone).
// Returns 0, or where it failed (1 can_implement, 2 a workspace, 3-6 set-up and launch, 7 a bad config or size).
extern "C" int fold_splitk_probe(int config, const void* w, const void* x, void* partials, void* y, int n, int t,
                                 int k, int splits, void* stream) {
  if (splits < 1 || k % (64 * splits) != 0 || n % 8 != 0) return 7;
  const auto s = static_cast<cudaStream_t>(stream);
  int status;
  switch (config) {
    case 0: status = run_gemm<SplitGemm<64, 128, 1, false>>(w, x, partials, n, t, k, splits, s); break;
    case 1: status = run_gemm<SplitGemm<64, 128, 2, false>>(w, x, partials, n, t, k, splits, s); break;
    case 2: status = run_gemm<SplitGemm<128, 128, 1, true>>(w, x, partials, n, t, k, splits, s); break;
    case 3: status = run_gemm<SplitGemm<128, 128, 2, true>>(w, x, partials, n, t, k, splits, s); break;
    default: return 7;
  }
  if (status != 0 || y == nullptr) return status;
  const int64_t elems = static_cast<int64_t>(n) * t;
  const int threads = 256;
  const int64_t blocks = (elems / 4 + threads - 1) / threads;
  reduce_partials<<<static_cast<unsigned>(blocks), threads, 0, s>>>(static_cast<const float*>(partials),
                                                                    static_cast<__nv_bfloat16*>(y), elems, splits);
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}
