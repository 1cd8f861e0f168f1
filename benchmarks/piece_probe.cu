// What a CTA-tiled, cp.async-staged stream of y reaches on this GPU by the shape of its chunks (a standalone probe,
// no lora_ops). grouped_gemm's LoRA expand (K = 16) and the prefill sgmv's expand read and write y [16384, 4096]
// bf16 in chunks of 64 rows x 64 columns (128-byte row pieces), and stay at 74-77% of the copy bandwidth while torch's
// elementwise y.add_ reaches 98% (csrc/cuda/NOTES.md, grouped_gemm sessions 13-27; sgmv prefill sessions 25-29).
// The probe keeps everything of those kernels but the math: 64-row tiles of 2048 columns per CTA (512 CTAs,
// ~4 per SM, all resident), 32 chunks of 8 KB each, a 4-stage cp.async pipeline, one barrier per chunk, 16-byte
// stores. Only the chunk's shape changes, ROWS x COLS = 4096 elements: 64 x 64 (the kernels' shape, 128-byte row
// pieces) to 2 x 2048 (4 KB pieces), walked row block by row block (a row's next piece is the next chunk's) or
// column block by column block. If the long pieces approach y.add_'s rate, the kernels' 26% is DRAM page locality
// and they want a chunk of few rows and many columns (B for the CTA's columns kept in shared memory, so that the
// fewer rows per chunk do not multiply B's reads); if every shape stays near 75%, it is not, and the loss is the
// pipeline's own. Read-only variants (no store) ask the same of the prefill sgmv's shrink, which reads x in 64-row x
// 128-byte pieces. register_stream walks the 64 x 64 and 8 x 512 chunks without shared memory or barriers, to
// tell the staging's cost from the order's. (Until session 48 the rmw kernels' stores compiled to four 4-byte
// stores a piece, against the elementwise baseline's and the kernels' 16-byte ones: store16 now.) The "combine"
// rows add what the expand kernels do between a chunk's landing and its store: the +1 as a pass over the staged
// chunk in the mma accumulators' layout (each warp 16 rows x 64 columns, a lane's pairs in rows g and g + 8, rows
// padded by 16 bytes as the kernels' are), then a second barrier, then the stores from shared memory (session 49:
// grouped_gemm's expand at 32 x 128 reached 81% where the staged stream reached 94%). "combine + w" also stages
// each chunk's w (its 64 columns x 16 ranks of a 1 MB B, 8 groups, from L2 after the first reads) beside y, as
// grouped_gemm's expand does at K = 16: the whole memory traffic of that kernel without its mma.
// Build and run (any sm_80+ GPU): nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/piece_probe.cu -o /tmp/piece_probe
// && /tmp/piece_probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    const cudaError_t err_ = (call);                                                                  \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));            \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace {

constexpr int kRows = 16384, kCols = 4096;  // y, bf16
constexpr int kTileRows = 64, kTileCols = 2048;
constexpr int kThreads = 128;
constexpr int kChunkElems = 4096;  // 8 KB of bf16 per chunk, whatever its shape
constexpr int kStages = 4;
constexpr int kPieces = kChunkElems * 2 / 16 / kThreads;  // 16-byte pieces per thread and chunk

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One 16-byte store (ptxas otherwise split some into four 4-byte stores where the sum's registers were not adjacent).
__device__ __forceinline__ void store16(__nv_bfloat16* ptr, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A 16-byte piece of 8 bf16 elements, each plus one.
__device__ __forceinline__ uint4 plus_one(uint4 v) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  const __nv_bfloat162 one = __floats2bfloat162_rn(1.f, 1.f);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __hadd2(h[e], one);
  return v;
}

// The CTA's tile: kTileRows rows from row0, kTileCols columns from col0; chunk c of it, ROWS x COLS, in row-block
// order (kRowMajor: the chunks of one row block, left to right, then the next block) or column-block order.
template <int ROWS, bool kRowMajor>
struct Walk {
  static constexpr int COLS = kChunkElems / ROWS;
  static constexpr int kRowBlocks = kTileRows / ROWS, kColBlocks = kTileCols / COLS;
  static constexpr int kChunks = kRowBlocks * kColBlocks;
  static constexpr int kRowPieces = COLS / 8;  // 16-byte pieces in one row of a chunk
  static __device__ int64_t row(int c) {  // chunk c's first row and column in y
    const int rb = kRowMajor ? c / kColBlocks : c % kRowBlocks;
    return (int64_t)(blockIdx.x / (kCols / kTileCols)) * kTileRows + rb * ROWS;
  }
  static __device__ int col(int c) {
    return blockIdx.x % (kCols / kTileCols) * kTileCols + (kRowMajor ? c % kColBlocks : c / kRowBlocks) * COLS;
  }
  static __device__ __nv_bfloat16* piece(__nv_bfloat16* y, int c, int j) {  // this thread's piece j of chunk c
    const int p = threadIdx.x + j * kThreads;
    return y + (row(c) + p / kRowPieces) * kCols + col(c) + (p % kRowPieces) * 8;
  }
};

// kWrite: y += 1 written back (the expand); else the chunk is summed into a checksum (the shrink's reads).
// kCombine (with kWrite): the +1 in shared memory, in the accumulators' layout, behind a barrier (see the top);
// kWithW: each chunk's w staged too (w: kGroups x kCols x kWRanks, read, not used).
constexpr int kWRanks = 16, kGroups = 8;
template <int ROWS, bool kRowMajor, bool kWrite, bool kCombine = false, bool kWithW = false>
__global__ void __launch_bounds__(kThreads) chunk_stream(__nv_bfloat16* y, float* checksum, const __nv_bfloat16* w) {
  using W = Walk<ROWS, kRowMajor>;
  constexpr int COLS = W::COLS, kChunks = W::kChunks, kRowPieces = W::kRowPieces;
  constexpr int kStride = kCombine ? COLS + 8 : COLS;  // a staged row (elements)
  static_assert(!kCombine || (kWrite && ROWS % 16 == 0 && COLS % 64 == 0), "warp tiles of 16 x 64");
  __shared__ __align__(16) __nv_bfloat16 stage[kStages][ROWS * kStride];
  constexpr int kWPieces = kWithW ? COLS * kWRanks / 8 : 0;  // 16-byte pieces of a chunk's w
  __shared__ __align__(16) __nv_bfloat16 wstage[kStages][kWithW ? COLS * kWRanks : 8];
  auto staged = [&](int c, int j) {  // this thread's piece j of chunk c, in shared memory
    const int p = threadIdx.x + j * kThreads;
    return &stage[c % kStages][p / kRowPieces * kStride + p % kRowPieces * 8];
  };
  auto piece_at = [&](int c, int j) { return W::piece(y, c, j); };
  auto load = [&](int c) {
#pragma unroll
    for (int j = 0; j < kPieces; ++j) cp_async16(staged(c, j), piece_at(c, j));
    if constexpr (kWithW) {
      const __nv_bfloat16* wc = w + ((int64_t)(blockIdx.x % kGroups) * kCols + W::col(c)) * kWRanks;
      for (int p = threadIdx.x; p < kWPieces; p += kThreads) cp_async16(&wstage[c % kStages][p * 8], wc + p * 8);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    load(s);
    cp_async_commit();
  }
  float sum = 0.f;
  for (int c = 0; c < kChunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c landed for every thread; chunk c - 1's stage is free
    if (c + kStages - 1 < kChunks) load(c + kStages - 1);
    cp_async_commit();
    if constexpr (kCombine) {  // the warp's 16 x 64 of the chunk, in m16n8 accumulator pairs
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
      __nv_bfloat16* band = &stage[c % kStages][warp % (ROWS / 16) * 16 * kStride + warp / (ROWS / 16) * 64];
      const __nv_bfloat162 one = __floats2bfloat162_rn(1.f, 1.f);
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          auto* pair = reinterpret_cast<__nv_bfloat162*>(band + (g + 8 * h) * kStride + ni * 8 + 2 * t);
          *pair = __hadd2(*pair, one);
        }
      }
      __syncthreads();  // the chunk's pairs are written; its pieces go out whole
    }
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      uint4 v = *reinterpret_cast<const uint4*>(staged(c, j));
      if constexpr (kCombine) {
        store16(piece_at(c, j), v);
      } else if constexpr (kWrite) {
        store16(piece_at(c, j), plus_one(v));
      } else {
        sum += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
      }
    }
  }
  cp_async_wait<0>();
  if (!kWrite && sum == 1234.5f) checksum[blockIdx.x] = sum;  // keeps the reads; never true for the fill below
}

// The same tile walk as chunk_stream's rmw, without shared memory or barriers: each thread keeps its own pieces of
// the next kDepth chunks in registers (loads issued kDepth chunks ahead, 16 * kPieces * kDepth bytes a thread), adds
// one and stores them. Against chunk_stream at the same shape it separates what the staged pipeline costs (the
// cp.async round trip through shared memory, a barrier a chunk) from what the access order costs (session 48: 64 x
// 64 chunks 82.7% of copy, 8 x 512 86%, the elementwise stream 95%; NOTES.md, grouped_gemm).
template <int ROWS, int kDepth>
__global__ void __launch_bounds__(kThreads) register_stream(__nv_bfloat16* y) {
  using W = Walk<ROWS, true>;  // row-block order
  constexpr int kChunks = W::kChunks;
  static_assert(kChunks % kDepth == 0, "the ring turns whole");
  auto piece_at = [&](int c, int j) { return W::piece(y, c, j); };
  uint4 ring[kDepth][kPieces];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) {
#pragma unroll
    for (int j = 0; j < kPieces; ++j) ring[d][j] = *reinterpret_cast<const uint4*>(piece_at(d, j));
  }
  for (int c0 = 0; c0 < kChunks; c0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {  // chunk c0 + d from slot d, then chunk c0 + d + kDepth into it
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        store16(piece_at(c0 + d, j), plus_one(ring[d][j]));
        if (c0 + d + kDepth < kChunks) ring[d][j] = *reinterpret_cast<const uint4*>(piece_at(c0 + d + kDepth, j));
      }
    }
  }
}

// torch's y.add_(1) alike: grid-stride, one 16-byte piece per thread and step (the elementwise baseline).
__global__ void add_one(__nv_bfloat16* y, int64_t pieces) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < pieces; i += (int64_t)gridDim.x * blockDim.x) {
    reinterpret_cast<uint4*>(y)[i] = plus_one(reinterpret_cast<const uint4*>(y)[i]);
  }
}

template <class Launch>
float time_us(Launch&& launch, int iters = 20) {
  for (int i = 0; i < 3; ++i) launch();
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) launch();
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaGetLastError());
  return 1e3f * ms / iters;
}

// Whether one pass of an rmw kernel (launch) over zeros leaves every element of y at exactly 1 (each touched once).
template <class Launch>
bool touches_each_once(__nv_bfloat16* y, Launch&& launch) {
  const size_t n = (size_t)kRows * kCols;
  CHECK(cudaMemset(y, 0, n * 2));
  launch();
  CHECK(cudaDeviceSynchronize());
  uint16_t* host = static_cast<uint16_t*>(std::malloc(n * 2));
  CHECK(cudaMemcpy(host, y, n * 2, cudaMemcpyDeviceToHost));
  bool ok = true;
  for (size_t i = 0; i < n && ok; ++i) ok = host[i] == 0x3f80;  // bf16 1.0
  std::free(host);
  return ok;
}

template <int ROWS, bool kRowMajor, bool kWrite, bool kCombine = false, bool kWithW = false>
void run_shape(__nv_bfloat16* y, float* checksum, double copy_gbs, const __nv_bfloat16* w = nullptr) {
  if (!kRowMajor && (ROWS == kTileRows || kChunkElems / ROWS == kTileCols)) return;  // one order: printed once
  const int ctas = (kRows / kTileRows) * (kCols / kTileCols);
  auto rmw_pass = [&] { chunk_stream<ROWS, kRowMajor, true, kCombine, kWithW><<<ctas, kThreads>>>(y, nullptr, w); };
  if (kWrite && !touches_each_once(y, rmw_pass)) {
    std::printf("%d-row chunks, %s order: not every element written once\n", ROWS, kRowMajor ? "row" : "col");
    std::exit(1);
  }
  const float us =
      time_us([&] { chunk_stream<ROWS, kRowMajor, kWrite, kCombine, kWithW><<<ctas, kThreads>>>(y, checksum, w); });
  const double bytes = (kWrite ? 2.0 : 1.0) * kRows * (double)kCols * 2;
  const double gbs = bytes / us * 1e-3;
  // % of the copy's rate (its read and write bytes together), for the read-only walks too
  std::printf("%-5s %2d x %4d (%4d-byte pieces), %s order%s: %7.1f us  %6.0f GB/s  %5.1f%% of copy\n",
              kWrite ? "rmw" : "read", ROWS, kChunkElems / ROWS, kChunkElems / ROWS * 2,
              kRowMajor ? "row-block" : "col-block", kWithW ? ", combine + w" : kCombine ? ", combine" : "", us, gbs,
              100.0 * gbs / copy_gbs);
}

// register_stream at one shape and depth, checked like chunk_stream (every element once) and timed.
template <int ROWS, int kDepth>
void run_register_shape(__nv_bfloat16* y, double copy_gbs) {
  const int ctas = (kRows / kTileRows) * (kCols / kTileCols);
  auto launch = [&] { register_stream<ROWS, kDepth><<<ctas, kThreads>>>(y); };
  if (!touches_each_once(y, launch)) {
    std::printf("register stream %d-row chunks: not every element written once\n", ROWS);
    std::exit(1);
  }
  const float us = time_us(launch);
  const double gbs = 2.0 * kRows * (double)kCols * 2 / us * 1e-3;
  std::printf("rmw   %2d x %4d (%4d-byte pieces), registers, %d ahead: %7.1f us  %6.0f GB/s  %5.1f%% of copy\n", ROWS,
              kChunkElems / ROWS, kChunkElems / ROWS * 2, kDepth, us, gbs, 100.0 * gbs / copy_gbs);
}

template <bool kRowMajor, bool kWrite>
void run_shapes(__nv_bfloat16* y, float* checksum, double copy_gbs) {
  run_shape<64, kRowMajor, kWrite>(y, checksum, copy_gbs);
  run_shape<32, kRowMajor, kWrite>(y, checksum, copy_gbs);
  run_shape<16, kRowMajor, kWrite>(y, checksum, copy_gbs);
  run_shape<8, kRowMajor, kWrite>(y, checksum, copy_gbs);
  run_shape<4, kRowMajor, kWrite>(y, checksum, copy_gbs);
  run_shape<2, kRowMajor, kWrite>(y, checksum, copy_gbs);
}

}  // namespace

int main() {
  const size_t bytes = (size_t)kRows * kCols * 2;
  __nv_bfloat16 *y = nullptr, *other = nullptr, *w = nullptr;
  float* checksum = nullptr;
  CHECK(cudaMalloc(&y, bytes));
  CHECK(cudaMalloc(&other, bytes));
  CHECK(cudaMalloc(&checksum, sizeof(float) * (kRows / kTileRows) * (kCols / kTileCols)));
  CHECK(cudaMemset(y, 0, bytes));
  CHECK(cudaMemset(other, 0, bytes));
  const size_t w_bytes = (size_t)kGroups * kCols * kWRanks * 2;
  CHECK(cudaMalloc(&w, w_bytes));
  CHECK(cudaMemset(w, 0, w_bytes));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const float copy_us = time_us([&] { CHECK(cudaMemcpyAsync(other, y, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * bytes / copy_us * 1e-3;
  std::printf("%s, %d SMs; y %d x %d bf16 (%.0f MB); copy %.1f us = %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, kRows, kCols, bytes / 1e6, copy_us, copy_gbs);
  const int64_t pieces = (int64_t)bytes / 16;
  const float add_us = time_us([&] { add_one<<<prop.multiProcessorCount * 16, 256>>>(y, pieces); });
  std::printf("rmw   elementwise y += 1 (grid-stride):      %7.1f us  %6.0f GB/s  %5.1f%% of copy\n", add_us,
              2.0 * bytes / add_us * 1e-3, 100.0 * (2.0 * bytes / add_us * 1e-3) / copy_gbs);
  run_shapes<true, true>(y, checksum, copy_gbs);
  run_shapes<false, true>(y, checksum, copy_gbs);
  run_shapes<true, false>(y, checksum, copy_gbs);
  run_register_shape<64, 2>(y, copy_gbs);
  run_register_shape<64, 4>(y, copy_gbs);
  run_register_shape<8, 2>(y, copy_gbs);
  run_register_shape<8, 4>(y, copy_gbs);
  run_shape<64, true, true, true>(y, checksum, copy_gbs);
  run_shape<32, true, true, true>(y, checksum, copy_gbs);
  run_shape<16, true, true, true>(y, checksum, copy_gbs);
  run_shape<64, true, true, true, true>(y, checksum, copy_gbs, w);
  CHECK(cudaFree(y));
  CHECK(cudaFree(other));
  CHECK(cudaFree(w));
  CHECK(cudaFree(checksum));
  return 0;
}
