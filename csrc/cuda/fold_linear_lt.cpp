// fold_linear's GEMM on cuBLASLt (kernels.h, fold_linear_lt): y [t, n] = x [t, k] . w [n, k]^T (+ bias [n]).
//
// Why: past the CUTLASS kernel's 64 tokens the fold route's GEMM was at::linear's cuBLAS, whose choice for its
// concatenated shapes streams the narrow layers at 56-75% of the copy bandwidth (NOTES.md, session 41). cuBLASLt's
// heuristic chooses otherwise: an H100 llama3-8b decode step at 80-128 tokens, 32 adapters, was 3.6-4.5 points
// faster with ATen's cuBLASLt (session 43), all of it the down GEMM (K = 14336; session 44). ATen reaches cuBLASLt
// for a product without a bias only through the process's preferred BLAS library, which another thread's matmul
// would see; hence our own handle and descriptors here.
//
// Mapping, as the CUTLASS kernel's: w's rows are the GEMM's M (A = w, column-major [k, n] with its row stride,
// transposed), the tokens its N (B = x, column-major [k, t]), D = y^T (column-major [n, t], ld n). The bias
// epilogue adds bias[m], one value per row of D: per output column of y. Float accumulation, fp16 or bf16 in and out.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels.h"

namespace lora_ops::cuda {
namespace {

// The workspace the heuristic may ask for; the call allocates what the chosen algorithm needs. The limit steers the
// choice: on an H100 (torch 2.11's cuBLASLt, CUBLASLT_WORKSPACE_SIZE) llama3-8b's down GEMM at 80-128 tokens ran in
// 49.2-49.7 us with a limit of 1 or 4 MiB and in cuBLAS's 57-60 us with 32 MiB, cuBLAS's own workspace on sm_90,
// which this call had first (NOTES.md, session 44).
constexpr uint64_t kMaxWorkspaceBytes = 1u << 20;
// The algorithms kept at most: a forced cuBLASLt (LORA_OPS_CUDA_FOLD_BLAS) sees every token count of every module,
// so past this many the cache starts again (each a few hundred bytes; the automatic range holds 64 counts a
// module, times the operands' alignments).
constexpr size_t kMaxKeptAlgorithms = 4096;

void check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "lora_ops.fold_linear: ", what, " failed: ",
              cublasLtGetStatusString(status));
}

// One handle per device, made on its first use and kept for the process (as ATen's pool keeps its own). A handle
// holds no stream or workspace (both are the call's), so threads share it. The first use may come inside a CUDA
// graph capture: the handle is made with the thread's capture mode relaxed, so that nothing it does at creation
// can invalidate the capture.
cublasLtHandle_t handle_for(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& h = handles[device];
  if (h == nullptr) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cublasStatus_t status = cublasLtCreate(&h);
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    check(status, "cublasLtCreate");
  }
  return h;
}

// The largest power of two up to 256 that divides the address: the heuristic's alignment preferences.
uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  return address == 0 ? 256u : static_cast<uint32_t>(std::min<uintptr_t>(address & (~address + 1), 256));
}

// The descriptors of one call (made per call: the bias pointer is part of the operation's descriptor, and a
// shared one would be written by concurrent calls), destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;

  Descriptors(const FoldLinearParams& p, const void* bias) {
    const cudaDataType_t type = p.dtype == DType::F16 ? CUDA_R_16F : CUDA_R_16BF;
    check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transposed, sizeof(transposed)),
          "setting TRANSA");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof(plain)), "setting TRANSB");
    if (bias != nullptr) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            "setting the bias epilogue");
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
            "setting the bias");
    }
    check(cublasLtMatrixLayoutCreate(&w, type, p.k, p.n, p.w_row_stride), "cublasLtMatrixLayoutCreate (w)");
    check(cublasLtMatrixLayoutCreate(&x, type, p.k, p.t, p.x_row_stride), "cublasLtMatrixLayoutCreate (x)");
    check(cublasLtMatrixLayoutCreate(&y, type, p.n, p.t, p.n), "cublasLtMatrixLayoutCreate (y)");
  }
  ~Descriptors() {
    if (y) cublasLtMatrixLayoutDestroy(y);
    if (x) cublasLtMatrixLayoutDestroy(x);
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

// Each operand's address alignment (bytes, up to 256): the heuristic's preferences for x, w and y, and the bias
// pointer's own value, which the heuristic reads for it.
struct Alignments {
  uint32_t x, w, y, bias;
};

// The heuristic's first algorithm for a shape and alignments, asked once (~10-50 us of host time a query) and kept (up
// to kMaxKeptAlgorithms); nullopt where it has none. A split K, if it picks one, is reduced in float32 out of place
// (the in-place and output-type schemes sum the parts in y's dtype: more roundings than one GEMM's), in order: the sum
// is deterministic, with no float atomics.
using AlgoKey =
    std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t, uint32_t>;

std::optional<cublasLtMatmulHeuristicResult_t> algorithm_for(cublasLtHandle_t handle, const FoldLinearParams& p,
                                                             const Descriptors& d, int device, bool bias,
                                                             const Alignments& align) {
  static std::mutex mutex;
  static std::map<AlgoKey, std::optional<cublasLtMatmulHeuristicResult_t>> chosen;
  const AlgoKey key{device, static_cast<int>(p.dtype), p.t, p.n, p.k, p.x_row_stride, p.w_row_stride, bias,
                    align.x, align.w, align.y, align.bias};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = chosen.find(key);
  if (found != chosen.end()) return found->second;
  if (chosen.size() >= kMaxKeptAlgorithms) chosen.clear();
  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  struct Release {
    cublasLtMatmulPreference_t p;
    ~Release() { cublasLtMatmulPreferenceDestroy(p); }
  } release{preference};
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &kMaxWorkspaceBytes, sizeof(kMaxWorkspaceBytes)),
        "setting the workspace limit");
  // a split K summed in float32 (or none): a bf16 sum of the parts, which torch lets its own cuBLAS calls pick
  // (allow_bf16_reduced_precision_reduction), put 5.9% of a [96, 2568] product's outputs off tolerance in ATen's
  // addmm with an operand 2 bytes off 16 (H100; benchmarks/bias_epilogue_probe.py)
  const uint32_t float32_reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                            &float32_reduction, sizeof(float32_reduction)),
        "setting the reduction schemes");
  // A is w, B is x, C and D are y
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.w}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.y}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.y}};
  for (const auto& [attribute, bytes] : alignments) {
    check(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)), "setting an alignment");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.w, d.x, d.y, d.y, preference, 1, &result, &found_count);
  std::optional<cublasLtMatmulHeuristicResult_t> algorithm;
  if (status == CUBLAS_STATUS_SUCCESS && found_count > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    algorithm = result;
  } else if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) {
    check(status, "cublasLtMatmulAlgoGetHeuristic");
  }
  return chosen.emplace(key, algorithm).first->second;
}

}  // namespace

bool fold_linear_lt(const FoldLinearParams& p, const void* bias, int device, cudaStream_t stream) {
  const Alignments align{alignment_of(p.x), alignment_of(p.w), alignment_of(p.y), alignment_of(bias)};
  // 16-byte operands and rows only, the kernels measured (an operand off 16 is a rare view: at::linear takes it)
  if (std::min({align.x, align.w, align.y, align.bias}) < 16 || p.x_row_stride % 8 != 0 || p.w_row_stride % 8 != 0 ||
      p.n % 8 != 0) {
    return false;
  }
  const cublasLtHandle_t handle = handle_for(device);
  const Descriptors d(p, bias);
  const auto algorithm = algorithm_for(handle, p, d, device, bias != nullptr, align);
  if (!algorithm) return false;
  // from the caching allocator, in the stream's order (a graph's pool under capture); none where the algorithm
  // needs none (an allocation per decode call otherwise)
  const at::Tensor workspace =
      algorithm->workspaceSize == 0
          ? at::Tensor()
          : at::empty({static_cast<int64_t>(algorithm->workspaceSize)},
                      at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, device)));
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, d.op, &one, p.w, d.w, p.x, d.x, &zero, p.y, d.y, p.y, d.y, &algorithm->algo,
                     workspace.defined() ? workspace.data_ptr() : nullptr, algorithm->workspaceSize, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;  // nothing launched
  check(status, "cublasLtMatmul");
  return true;
}

}  // namespace lora_ops::cuda
