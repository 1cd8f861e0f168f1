// A decode GEMM of our own (y = x . W^T, T <= 128 rows, bf16), built by decode_gemm_probe.py beside cuBLAS: the
// base a LoRA epilogue would ride on (csrc/cuda/NOTES.md, issue 12, session 15). Swapped operands: W's rows are the
// mma's M, x's rows its N, so a CTA owns BM = 16 x MT x WARPS rows of W (MT mma tiles per warp, sharing each x
// fragment) and TT tokens. A cluster of S CTAs splits K;
// the S partial tiles are summed in rank order through distributed shared memory (deterministic), no workspace.
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

namespace cg = cooperative_groups;

namespace {

constexpr int kBK = 64;  // k elements per stage: 128-byte rows, 8 chunks of 16 bytes, XOR-swizzled by row
constexpr int kStages = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ int swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int WARPS, int MT, int TT>
__global__ void __launch_bounds__(WARPS * 32) decode_gemm_kernel(const __nv_bfloat16* __restrict__ x,
                                                                 const __nv_bfloat16* __restrict__ w,
                                                                 __nv_bfloat16* __restrict__ y, int T, int N, int K,
                                                                 int k_per_split) {
  constexpr int kThreads = WARPS * 32, BM = WARPS * 16 * MT;
  constexpr int kWStage = BM * 128, kXStage = TT * 128;  // bytes
  extern __shared__ __align__(128) uint8_t smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int split = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  const int n0 = blockIdx.y * BM, t0 = blockIdx.z * TT;
  const int k_begin = split * k_per_split, k_end = min(K, k_begin + k_per_split);
  const int steps = max(0, (k_end - k_begin) / kBK);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  auto load_stage = [&](int step) {
    uint8_t* ws = smem + (step % kStages) * (kWStage + kXStage);
    uint8_t* xs = ws + kWStage;
    const int k0 = k_begin + step * kBK;
    for (int i = threadIdx.x; i < BM * 8; i += kThreads) {
      const int row = i / 8, chunk = i % 8, n = n0 + row;
      cp_async16(smem_addr(ws + swizzled(row, chunk)), w + (n < N ? (int64_t)n * K + k0 + chunk * 8 : 0), n < N);
    }
    for (int i = threadIdx.x; i < TT * 8; i += kThreads) {
      const int row = i / 8, chunk = i % 8, t = t0 + row;
      cp_async16(smem_addr(xs + swizzled(row, chunk)), x + (t < T ? (int64_t)t * K + k0 + chunk * 8 : 0), t < T);
    }
  };

  float acc[MT][TT / 8][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_stage(s);
    asm volatile("cp.async.commit_group;\n");
  }
  for (int step = 0; step < steps; ++step) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    if (step + kStages - 1 < steps) load_stage(step + kStages - 1);
    asm volatile("cp.async.commit_group;\n");
    const uint8_t* ws = smem + (step % kStages) * (kWStage + kXStage);
    const uint8_t* xs = ws + kWStage;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        ldsm_x4(smem_addr(ws + swizzled((warp * MT + mi) * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                        kk * 2 + lane / 16)),
                a[mi]);
#pragma unroll
      for (int j = 0; j < TT / 16; ++j) {
        uint32_t b[4];
        ldsm_x4(smem_addr(xs + swizzled(j * 16 + (lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2)), b);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_bf16(acc[mi][2 * j], a[mi], b[0], b[1]);
          mma_bf16(acc[mi][2 * j + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n");
  __syncthreads();
  // This CTA's partial tile, [TT][BM] fp32 (rows of W contiguous, as y's columns are), in its own shared memory;
  // then each rank sums a slice of rows over the cluster's ranks in rank order.
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int j = 0; j < TT / 8; ++j) {
      const int row = (warp * MT + mi) * 16 + lane / 4, col = j * 8 + (lane % 4) * 2;
      part[col * BM + row] = acc[mi][j][0];
      part[(col + 1) * BM + row] = acc[mi][j][1];
      part[col * BM + row + 8] = acc[mi][j][2];
      part[(col + 1) * BM + row + 8] = acc[mi][j][3];
    }
  cluster.sync();
  const int rows_per_rank = (BM + splits - 1) / splits;
  const int r_begin = split * rows_per_rank, r_end = min(BM, r_begin + rows_per_rank);
  for (int i = threadIdx.x; i < (r_end - r_begin) * TT; i += kThreads) {
    const int t = i / (r_end - r_begin), row = r_begin + i % (r_end - r_begin);
    if (t0 + t >= T || n0 + row >= N) continue;
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) sum += cluster.map_shared_rank(part, s)[t * BM + row];
    y[(int64_t)(t0 + t) * N + n0 + row] = __float2bfloat16(sum);
  }
  cluster.sync();
}

template <int WARPS, int MT, int TT>
void launch(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y, int splits) {
  const int T = x.size(0), K = x.size(1), N = w.size(0);
  constexpr int BM = WARPS * 16 * MT;
  const int smem = std::max(kStages * (BM + TT) * 128, BM * TT * 4);
  auto kernel = decode_gemm_kernel<WARPS, MT, TT>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int k_chunks = K / kBK, per = (k_chunks + splits - 1) / splits;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(splits, (N + BM - 1) / BM, (T + TT - 1) / TT);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = splits;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
                                    reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()),
                                    reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), T, N, K, per * kBK));
}

}  // namespace

// y = x . w^T; x [T, K], w [N, K] bf16 contiguous, K % 64 == 0; splits = cluster size (1..8) along K.
torch::Tensor decode_gemm(torch::Tensor x, torch::Tensor w, int64_t splits, int64_t warps, int64_t m_tiles,
                          int64_t tokens_per_tile) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
              w.scalar_type() == at::kBFloat16 && x.size(1) == w.size(1) && x.size(1) % kBK == 0);
  TORCH_CHECK(splits >= 1 && splits <= 8);
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  const int s = static_cast<int>(splits);
#define LORA_PROBE_CASE(WP, MTV, TTV) \
  if (warps == WP && m_tiles == MTV && tokens_per_tile == TTV) return launch<WP, MTV, TTV>(x, w, y, s), y;
  LORA_PROBE_CASE(4, 1, 32) LORA_PROBE_CASE(4, 1, 64) LORA_PROBE_CASE(4, 1, 128)
  LORA_PROBE_CASE(8, 1, 32) LORA_PROBE_CASE(8, 1, 64) LORA_PROBE_CASE(8, 1, 128)
  LORA_PROBE_CASE(4, 2, 32) LORA_PROBE_CASE(4, 2, 64) LORA_PROBE_CASE(8, 2, 32) LORA_PROBE_CASE(8, 2, 64)
#undef LORA_PROBE_CASE
  TORCH_CHECK(false, "no instantiation for this warps / m_tiles / tokens_per_tile");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_gemm", &decode_gemm); }
