// build_segments: stable counting sort of rows by slot in ONE launch (no host sync, fixed-size outputs), with no
// communication between CTAs. The tokens are cut into contiguous chunks, one per CTA (~512 tokens, a multiple of
// the 128-token counting tile, at most kMaxCtas chunks); each CTA on its own:
//   1. counts the bucket of EVERY token into two shared histograms: the tokens before its chunk, and the rest.
//      Every CTA repeats this, but one pass over T int32 (64 KB at T = 16384) with all loads in flight costs less
//      than an exchange between CTAs (a cluster barrier and remote reads, or global flags and a spin). A warp
//      counts a tile of 128 tokens at a time, 4 per lane from one 16-byte load; chunks start on tile edges, so a
//      tile lies wholly before the chunk or not (one histogram per tile, chosen once per warp);
//   2. ranks its own chunk: each placing warp takes a contiguous part, 32 tokens at a time; ballots over the
//      bucket's bits give the lanes with the same bucket, and the warp counts each bucket's tokens;
//   3. per bucket, one thread sums the histograms (the bucket's total, and its tokens in earlier chunks) and turns
//      the warps' counts into offsets; one block scan of the totals gives the bucket starts (equal in every CTA:
//      CTA 0 writes seg_indptr and seg_lora);
//   4. places its tokens at bucket start + tokens of earlier chunks + of earlier warps and batches + rank.
// Chunks are in token order, and warps, batches and lanes place in that order: the sort is stable, and every
// count is an integer sum, so the output is deterministic.
// Bucket num_slots collects rows whose slot is outside [0, num_slots): sorted last, not covered.
#include <algorithm>
#include <map>
#include <mutex>

#include "common.cuh"
#include "kernels.h"

namespace lora_ops::cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int64_t kTokensPerCta = 512;  // one token per thread to place
constexpr int64_t kMaxCtas = 32;        // every CTA reads all T tokens: bounds the repeated reads (2 MB at 16384)
constexpr uint32_t kTile = 128;         // tokens a warp counts at once: 4 per lane, one 16-byte load
constexpr int kTilesInFlight = 8;       // tiles per warp per counting step (T = 16384, 16 warps: one step)

// Shared memory: counts [2][buckets][replicas], warp_cursor [warps][buckets], bucket_start [buckets], rounded up
// to 16 bytes (zeroed 16 bytes at a time).
size_t smem_bytes(int64_t buckets, int replicas, int warps) {
  return ((size_t)buckets * (2 * replicas + warps + 1) * sizeof(int32_t) + 15) / 16 * 16;
}

// A warp's batch of up to 32 consecutive tokens [t0, min(t0 + 32, end)), a token per lane: its bucket, the
// active lanes with the same bucket (one ballot per bucket bit, as CUB's MatchAny), and its rank among them.
struct Batch {
  uint32_t token, bucket;
  bool active;
  unsigned peers;
  int rank;
};

__device__ __forceinline__ Batch rank_batch(const int32_t* token_lora, uint32_t t0, uint32_t end, uint32_t num_slots,
                                            int bucket_bits) {
  const int lane = threadIdx.x & 31;
  Batch s;
  s.token = t0 + lane;
  s.active = s.token < end;
  // A negative slot is a huge unsigned value: min() sends it, like slots >= num_slots, to bucket num_slots.
  s.bucket = s.active ? min((uint32_t)__ldg(&token_lora[s.token]), num_slots) : 0;
  s.peers = __ballot_sync(kAll, s.active);
  for (int bit = 0; bit < bucket_bits; ++bit) {
    const bool set = (s.bucket >> bit) & 1;
    const unsigned ones = __ballot_sync(kAll, set);
    s.peers &= set ? ones : ~ones;
  }
  s.rank = __popc(s.peers & ((1u << lane) - 1));
  return s;
}

// kReplicas copies of each count, lane l adding to copy l % kReplicas: with 32, copy l lies in bank l, so a
// warp's 32 atomic adds never collide whatever the slots. One copy when there are too many buckets for 32.
template <int kReplicas>
__global__ void __launch_bounds__(kMaxThreads) build_segments_kernel(BuildSegmentsParams p, uint32_t chunk,
                                                                     int placing_warps) {
  extern __shared__ __align__(16) int32_t smem[];
  __shared__ int32_t warp_total[32];  // read by lane: 32 whatever the warps (fixes the slot bound's static part)
  // T < 2^31 (checked on the host): token and tile indices, and a chunk's end, fit uint32.
  const uint32_t T = (uint32_t)p.num_tokens, num_slots = (uint32_t)p.num_slots, buckets = num_slots + 1;
  const uint32_t threads = blockDim.x, warps = threads >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bucket_bits = 32 - __clz((int)num_slots);
  int32_t* counts = smem;                                      // [2][buckets][kReplicas]
  int32_t* warp_cursor = counts + 2 * buckets * kReplicas;     // [placing_warps][buckets]
  int32_t* bucket_start = warp_cursor + placing_warps * buckets;  // [buckets]
  // The chunk (a multiple of kTile tokens) and the warp's part of it (whole batches of 32).
  const uint32_t chunk_begin = min(T, blockIdx.x * chunk), chunk_len = min(T - chunk_begin, chunk);
  const uint32_t per_warp = (chunk_len + placing_warps * 32 - 1) / (placing_warps * 32) * 32;
  const uint32_t warp_begin = chunk_begin + min(chunk_len, warp * per_warp);
  const uint32_t warp_end = chunk_begin + min(chunk_len, warp * per_warp + per_warp);

  // 1. Count every token: warp w takes tiles w, w + warps, ...; lane l tokens 4l..4l+3 of a tile. The first
  //    step's loads are in flight while shared memory is zeroed. The last tile may be partial: loads bounded,
  //    its tokens past T add 0.
  const bool vector_loads = (reinterpret_cast<uintptr_t>(p.token_lora) & 15) == 0;
  const uint32_t full_tiles = T / kTile, tiles = (T + kTile - 1) / kTile;
  int4 slot4[kTilesInFlight];
  auto load_step = [&](uint32_t first) {
#pragma unroll
    for (int k = 0; k < kTilesInFlight; ++k) {
      const uint32_t tile = first + k * warps, t = tile * kTile + lane * 4;
      if (tile < full_tiles && vector_loads) {
        slot4[k] = __ldg(reinterpret_cast<const int4*>(p.token_lora + t));
      } else if (tile < tiles) {
        slot4[k].x = t < T ? __ldg(&p.token_lora[t]) : 0;
        slot4[k].y = t + 1 < T ? __ldg(&p.token_lora[t + 1]) : 0;
        slot4[k].z = t + 2 < T ? __ldg(&p.token_lora[t + 2]) : 0;
        slot4[k].w = t + 3 < T ? __ldg(&p.token_lora[t + 3]) : 0;
      }
    }
  };
  load_step(warp);
  int32_t* const counts_before = counts;
  int32_t* const counts_rest = counts + buckets * kReplicas;
  const uint32_t zero_words = buckets * (2 * kReplicas + placing_warps);
  for (uint32_t i = threadIdx.x; i < (zero_words + 3) / 4; i += threads) {
    reinterpret_cast<int4*>(smem)[i] = make_int4(0, 0, 0, 0);
  }
  __syncthreads();
  for (uint32_t first = warp; first < tiles; first += kTilesInFlight * warps) {
    if (first != warp) load_step(first);
#pragma unroll
    for (int k = 0; k < kTilesInFlight; ++k) {
      const uint32_t tile = first + k * warps;
      if (tile >= tiles) break;
      // A negative slot is a huge unsigned value: min() sends it, like slots >= num_slots, to bucket num_slots.
      int32_t* histogram = (tile * kTile < chunk_begin ? counts_before : counts_rest) + lane % kReplicas;
      const int32_t slot[4] = {slot4[k].x, slot4[k].y, slot4[k].z, slot4[k].w};
      if (tile < full_tiles) {
#pragma unroll
        for (int j = 0; j < 4; ++j) atomicAdd(&histogram[min((uint32_t)slot[j], num_slots) * kReplicas], 1);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          atomicAdd(&histogram[min((uint32_t)slot[j], num_slots) * kReplicas], tile * kTile + lane * 4 + j < T);
        }
      }
    }
  }

  // 2. Each placing warp counts its part of the chunk per bucket (its tokens were just read: L1 hits).
  if (warp < (uint32_t)placing_warps) {
    for (uint32_t t0 = warp_begin; t0 < warp_end; t0 += 32) {
      const Batch s = rank_batch(p.token_lora, t0, warp_end, num_slots, bucket_bits);
      if (s.active && s.rank == 0) warp_cursor[warp * buckets + s.bucket] += __popc(s.peers);
      __syncwarp();
    }
  }
  __syncthreads();

  // 3. A contiguous run of buckets per thread. A bucket's copies are read rotated by the bucket, so that
  //    neighbouring threads read distinct banks.
  const uint32_t per = (buckets + threads - 1) / threads;
  const uint32_t b_begin = min(buckets, threadIdx.x * per), b_end = min(buckets, b_begin + per);
  int32_t run = 0;
#pragma unroll 1
  for (uint32_t b = b_begin; b < b_end; ++b) {
    int32_t before = 0, rest = 0;
#pragma unroll
    for (int r = 0; r < kReplicas; ++r) {
      const uint32_t i = b * kReplicas + ((r + b) % kReplicas);
      before += counts[i];
      rest += counts[buckets * kReplicas + i];
    }
    // This chunk's tokens of bucket b follow those of earlier chunks, warp after warp (loads 8 at a time, so
    // that they overlap).
    int32_t cursor = before;
    for (int w0 = 0; w0 < placing_warps; w0 += 8) {
      int32_t warp_count[8];
#pragma unroll
      for (int w = 0; w < 8; ++w) warp_count[w] = w0 + w < placing_warps ? warp_cursor[(w0 + w) * buckets + b] : 0;
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        if (w0 + w < placing_warps) warp_cursor[(w0 + w) * buckets + b] = cursor;
        cursor += warp_count[w];
      }
    }
    bucket_start[b] = before + rest;  // the bucket's total until the scan below
    run += before + rest;
  }
  // Block-wide exclusive scan of the runs: one barrier (each warp sums the totals of the warps before it).
  const int32_t incl = warp_inclusive_scan(run);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int32_t start = __reduce_add_sync(kAll, lane < warp ? warp_total[lane] : 0) + incl - run;
  for (uint32_t b = b_begin; b < b_end; ++b) {
    const int32_t total = bucket_start[b];
    bucket_start[b] = start;
    if (blockIdx.x == 0) {
      p.seg_indptr[b] = start;
      if (b < num_slots) p.seg_lora[b] = (int32_t)b;
    }
    start += total;
  }
  __syncthreads();

  // 4. Place, batch after batch: the warp's cursor per bucket advances by the batch's count.
  if (warp < (uint32_t)placing_warps) {
    for (uint32_t t0 = warp_begin; t0 < warp_end; t0 += 32) {
      const Batch s = rank_batch(p.token_lora, t0, warp_end, num_slots, bucket_bits);
      int32_t* cursor = &warp_cursor[warp * buckets + s.bucket];
      const int32_t base = *cursor;  // read by all peers before the leader advances it
      __syncwarp();
      if (s.active) {
        p.token_indices[bucket_start[s.bucket] + base + s.rank] = (int32_t)s.token;
        if (s.rank == 0) *cursor = base + __popc(s.peers);
      }
      __syncwarp();
    }
  }
}

template <int kReplicas>
cudaError_t launch(const BuildSegmentsParams& p, int ctas, uint32_t chunk, int threads, int placing_warps,
                   size_t smem, cudaStream_t stream) {
  const auto kernel = build_segments_kernel<kReplicas>;
  if (const cudaError_t err = allow_dynamic_smem((const void*)kernel, smem); err != cudaSuccess) return err;
  kernel<<<ctas, threads, smem, stream>>>(p, chunk, placing_warps);
  return cudaGetLastError();
}

// Dynamic shared memory a CTA may take on the current device: the opt-in maximum (227 KB on an H100/H200, 163 KB
// on an A100, 99 KB on sm_86/sm_89) less the kernel's static shared memory; 0 when the device cannot be asked.
// Read once per device.
size_t smem_budget() {
  static std::mutex mutex;
  static std::map<int, size_t> known;
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  cudaFuncAttributes one, replicated;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaFuncGetAttributes(&one, build_segments_kernel<1>) != cudaSuccess ||
      cudaFuncGetAttributes(&replicated, build_segments_kernel<32>) != cudaSuccess) {
    cudaGetLastError();  // no budget is the answer here, not a sticky error
    return 0;
  }
  const size_t fixed = std::max(one.sharedSizeBytes, replicated.sharedSizeBytes);
  return known[device] = optin > (int)fixed ? (optin - fixed) / 16 * 16 : 0;  // whole 16-byte zeroing stores
}

}  // namespace

// On the current device (the caller's device guard).
int64_t build_segments_max_slots() { return (int64_t)(smem_budget() / smem_bytes(1, 1, 1)) - 1; }

cudaError_t launch_build_segments(const BuildSegmentsParams& p, cudaStream_t stream) {
  const size_t budget = smem_budget();
  const int64_t buckets = p.num_slots + 1, T = p.num_tokens;
  // ~kTokensPerCta tokens per CTA, chunks rounded up to whole counting tiles (fewer CTAs than asked, at times).
  const int64_t asked = std::clamp<int64_t>((T + kTokensPerCta - 1) / kTokensPerCta, 1, kMaxCtas);
  const int64_t chunk = std::max<int64_t>((T + asked - 1) / asked + kTile - 1, kTile) / kTile * kTile;
  const int ctas = (int)std::max<int64_t>((T + chunk - 1) / chunk, 1);
  // A thread per token up to 512 (fewer threads: cheaper barriers and zeroing for short batches).
  const int threads = (int)std::clamp<int64_t>((T + 127) / 128 * 128, 128, kMaxThreads);
  const int replicas = smem_bytes(buckets, 32, threads / 32) <= budget ? 32 : 1;
  // A cursor row per placing warp; fewer placing warps when the slots are many.
  const int64_t fit = (int64_t)(budget / sizeof(int32_t)) / buckets - 2 * replicas - 1;
  if (fit < 1) return cudaErrorInvalidValue;
  const int placing_warps = (int)std::min<int64_t>(threads / 32, fit);
  const size_t smem = smem_bytes(buckets, replicas, placing_warps);
  return replicas == 32 ? launch<32>(p, ctas, (uint32_t)chunk, threads, placing_warps, smem, stream)
                        : launch<1>(p, ctas, (uint32_t)chunk, threads, placing_warps, smem, stream);
}

}  // namespace lora_ops::cuda
