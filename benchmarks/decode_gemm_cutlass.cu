// The decode GEMM y = x . W^T (bf16, T <= 128 tokens) on CUTLASS 3.x's sm_90 warp-specialized kernels (TMA +
// wgmma, persistent CTAs), shaped like cuBLAS's nvjet kernels for these sizes (csrc/cuda/NOTES.md, session 15):
// W's rows as the GEMM's M (A = W [N, K], K-major), the tokens as its N (B = x [T, K], K-major), D = y^T (y [T, N]
// row-major is D column-major), tiles 64-128 W rows x 32-128 tokens, clusters of 2 along M (x multicast to both
// CTAs), split-K with CUTLASS's deterministic (turnstile) reduction where the tiles alone do not fill the GPU.
// Built with -DCUTLASS_ENABLE_GDC_FOR_SM90 its kernels let a programmatically dependent kernel (lora_expand's)
// launch before their epilogue (decode_gemm_probe.py --step). The LoRA-in-epilogue variants measured in session 16
// (an EVT node, the fold in one launch, a grouped fold; all 1.2-2x the plain GEMM) were removed after their
// measurement; they are at e9389df.
// A plain C ABI, so that decode_gemm_probe.py loads it with ctypes whatever torch the GPU machine has:
//   CUTLASS=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC -I$CUTLASS/include \
//     -o build/decode_gemm_cutlass.so benchmarks/decode_gemm_cutlass.cu
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace dgc {  // named: an anonymous namespace next to cute's collides in nvcc's host stub

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_32;
using cute::_64;
using cute::Int;
using cute::make_shape;
using cute::Shape;
using T = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // elements per 16 bytes

struct Coop {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// One configuration: A = the weight rows (RowMajor), B = x (the ColumnMajor K x N view of [T, K]), D column-major
// (y [T, M] row-major), D = acc (no C).
template <class Tile, class Cluster, class Schedule, class Scheduler>
struct Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, kAlign, T,
      cutlass::layout::ColumnMajor, kAlign, typename Schedule::Epilogue>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign, T,
      cutlass::layout::ColumnMajor, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kStreamK = std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
};

template <class G>
typename G::Device::Arguments arguments(const void* x, const void* w, void* y, int t, int n, int k, int splits) {
  using K = typename G::Kernel;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(n, t, k, 1);  // M = W's rows, N = tokens
  args.mainloop.ptr_A = static_cast<const T*>(w);
  args.mainloop.dA = typename K::StrideA{int64_t(k), Int<1>{}, int64_t(n) * k};
  args.mainloop.ptr_B = static_cast<const T*>(x);
  args.mainloop.dB = typename K::StrideB{int64_t(k), Int<1>{}, int64_t(t) * k};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename K::StrideC{Int<1>{}, int64_t(n), int64_t(n) * t};
  args.epilogue.ptr_D = static_cast<T*>(y);
  args.epilogue.dD = typename K::StrideD{Int<1>{}, int64_t(n), int64_t(n) * t};
  int device = 0;
  cudaGetDevice(&device);
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(device);
  if constexpr (G::kStreamK) {
    using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = splits > 1 ? Mode::SplitK : Mode::DataParallel;
    args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
  }
  return args;
}

// need != nullptr: only the workspace size. Returns 0 or a negative step number.
template <class G>
int run(const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace, size_t bytes,
        cudaStream_t stream, size_t* need) {
  if (!G::kStreamK && splits != 1) return -5;  // no split-K scheduler
  auto args = arguments<G>(x, w, y, t, n, k, splits);
  const size_t want = G::Device::get_workspace_size(args);
  if (need) return *need = want, 0;
  if (want > bytes) return -1;
  typename G::Device op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return -2;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return -3;
  return op.run(stream) == cutlass::Status::kSuccess ? 0 : -4;
}

using Cluster2 = Shape<_2, _1, _1>;
using Cluster1 = Shape<_1, _1, _1>;
// CUTLASS 4.2's stream-K scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its is_last_tile binds a
// const member to a non-const reference): that build's cooperative kernels are data-parallel, one K split only.
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
using SK = cutlass::gemm::PersistentScheduler;
#else
using SK = cutlass::gemm::StreamKScheduler;
#endif
using PS = cutlass::gemm::PersistentScheduler;
using Config0 = Gemm<Shape<_128, _32, _64>, Cluster2, Coop, SK>;
using Config1 = Gemm<Shape<_128, _32, _64>, Cluster1, Coop, SK>;
using Config2 = Gemm<Shape<_64, _32, _64>, Cluster2, Pingpong, PS>;
using Config3 = Gemm<Shape<_128, _64, _64>, Cluster2, Coop, SK>;
using Config4 = Gemm<Shape<_128, _128, _64>, Cluster2, Coop, SK>;
constexpr int kConfigs = 5;

int dispatch(int config, const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace,
             size_t bytes, cudaStream_t stream, size_t* need) {
  switch (config) {
    case 0: return run<Config0>(x, w, y, t, n, k, splits, workspace, bytes, stream, need);
    case 1: return run<Config1>(x, w, y, t, n, k, splits, workspace, bytes, stream, need);
    case 2: return run<Config2>(x, w, y, t, n, k, splits, workspace, bytes, stream, need);
    case 3: return run<Config3>(x, w, y, t, n, k, splits, workspace, bytes, stream, need);
    case 4: return run<Config4>(x, w, y, t, n, k, splits, workspace, bytes, stream, need);
    default: return -9;
  }
}

}  // namespace dgc

extern "C" {
// What each config is, for the probe's report.
const char* dgc_config_name(int config) {
  static const char* names[] = {"coop 128x32 cluster 2", "coop 128x32 cluster 1", "pingpong 64x32 cluster 2",
                                "coop 128x64 cluster 2", "coop 128x128 cluster 2"};
  return config >= 0 && config < dgc::kConfigs ? names[config] : nullptr;
}
int dgc_configs() { return dgc::kConfigs; }
size_t dgc_workspace(int config, int t, int n, int k, int splits) {
  size_t need = 0;
  dgc::dispatch(config, nullptr, nullptr, nullptr, t, n, k, splits, nullptr, 0, nullptr, &need);
  return need;
}
int dgc_run(int config, const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace,
            size_t bytes, void* stream) {
  return dgc::dispatch(config, x, w, y, t, n, k, splits, workspace, bytes, static_cast<cudaStream_t>(stream),
                       nullptr);
}
}
