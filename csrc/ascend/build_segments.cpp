// build_segments on one AIV (docs/design.md §2): a stable counting sort of the tokens by slot. Tokens with a slot
// outside [0, num_slots) go last, uncovered by any segment. Outputs have fixed sizes: token_indices [T],
// seg_indptr [num_slots + 1], seg_lora [num_slots] = arange.
//
// The histogram and the running offsets live in UB (the host bounds num_slots by its size). token_indices is
// written one window of positions at a time: each pass re-reads the slots and places the tokens that land in the
// window. Scalar reads and writes of UB are ordered against the vector and DMA pipes by the compiler.
#include "kernel_common.h"
#include "kernels.h"
#include "launch.h"

namespace lora_ops::ascend {
namespace {

class BuildSegmentsKernel {
 public:
  __aicore__ inline BuildSegmentsKernel(const BuildSegmentsTiling& t, GM_ADDR token_lora, GM_ADDR token_indices,
                                        GM_ADDR seg_indptr, GM_ADDR seg_lora)
      : t_(t) {
    token_lora_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(token_lora));
    token_indices_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(token_indices));
    seg_indptr_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(seg_indptr));
    seg_lora_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(seg_lora));
  }

  __aicore__ inline void Run() {
    TPipe pipe;
    const int64_t bins = t_.num_slots + 1;  // the last bin counts the tokens without a LoRA
    pipe.InitBuffer(counts_buf_, bins * sizeof(int32_t));
    pipe.InitBuffer(next_buf_, bins * sizeof(int32_t));
    pipe.InitBuffer(chunk_buf_, t_.chunk * sizeof(int32_t));
    pipe.InitBuffer(window_buf_, t_.window * sizeof(int32_t));
    counts_ = counts_buf_.Get<int32_t>();
    next_ = next_buf_.Get<int32_t>();
    chunk_ = chunk_buf_.Get<int32_t>();
    LocalTensor<int32_t> window = window_buf_.Get<int32_t>();
    Duplicate(counts_, int32_t(0), static_cast<int32_t>(bins));
    for (int64_t t0 = 0; t0 < t_.num_tokens; t0 += t_.chunk) {
      const int64_t len = LoadChunk(t0);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t bin = Bin(chunk_.GetValue(i));
        counts_.SetValue(bin, counts_.GetValue(bin) + 1);
      }
    }
    Offsets();
    // seg_indptr[s] = tokens before slot s; seg_indptr[num_slots] = tokens with a valid slot.
    DataCopyPad(seg_indptr_, next_, DataCopyExtParams{1, static_cast<uint32_t>(bins * sizeof(int32_t)), 0, 0, 0});
    for (int64_t s0 = 0; s0 < t_.num_slots; s0 += t_.window) {
      const int64_t len = Min(t_.window, t_.num_slots - s0);
      for (int64_t i = 0; i < len; ++i) window.SetValue(i, static_cast<int32_t>(s0 + i));
      DataCopyPad(seg_lora_[s0], window, DataCopyExtParams{1, static_cast<uint32_t>(len * sizeof(int32_t)), 0, 0, 0});
    }
    for (int64_t w0 = 0; w0 < t_.num_tokens; w0 += t_.window) {
      const int64_t w_len = Min(t_.window, t_.num_tokens - w0);
      if (w0 > 0) Offsets();
      for (int64_t t0 = 0; t0 < t_.num_tokens; t0 += t_.chunk) {
        const int64_t len = LoadChunk(t0);
        for (int64_t i = 0; i < len; ++i) {
          const int64_t bin = Bin(chunk_.GetValue(i));
          const int64_t pos = next_.GetValue(bin);
          next_.SetValue(bin, static_cast<int32_t>(pos + 1));
          if (pos >= w0 && pos < w0 + w_len) window.SetValue(pos - w0, static_cast<int32_t>(t0 + i));
        }
      }
      DataCopyPad(token_indices_[w0], window,
                  DataCopyExtParams{1, static_cast<uint32_t>(w_len * sizeof(int32_t)), 0, 0, 0});
    }
  }

 private:
  // Tokens [t0, t0 + chunk) into UB; returns how many there are.
  __aicore__ inline int64_t LoadChunk(int64_t t0) {
    const int64_t len = Min(t_.chunk, t_.num_tokens - t0);
    DataCopyPad(chunk_, token_lora_[t0], DataCopyExtParams{1, static_cast<uint32_t>(len * sizeof(int32_t)), 0, 0, 0},
                DataCopyPadExtParams<int32_t>{false, 0, 0, 0});
    return len;
  }

  // A token's bin: its slot, or num_slots when the slot is outside [0, num_slots).
  __aicore__ inline int64_t Bin(int64_t slot) const {
    return (slot >= 0 && slot < t_.num_slots) ? slot : t_.num_slots;
  }

  // next[s] = tokens in bins before s (an exclusive prefix sum of the counts).
  __aicore__ inline void Offsets() {
    int32_t total = 0;
    for (int64_t s = 0; s <= t_.num_slots; ++s) {
      const int32_t c = counts_.GetValue(s);
      next_.SetValue(s, total);
      total += c;
    }
  }

  const BuildSegmentsTiling& t_;
  GlobalTensor<int32_t> token_lora_, token_indices_, seg_indptr_, seg_lora_;
  TBuf<TPosition::VECCALC> counts_buf_, next_buf_;
  TBuf<TPosition::VECIN> chunk_buf_;
  TBuf<TPosition::VECOUT> window_buf_;
  LocalTensor<int32_t> counts_, next_, chunk_;
};

}  // namespace
}  // namespace lora_ops::ascend

extern "C" __global__ __aicore__ void lora_ops_build_segments(GM_ADDR token_lora, GM_ADDR token_indices,
                                                              GM_ADDR seg_indptr, GM_ADDR seg_lora,
                                                              LoraOpsBuildSegmentsTiling tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  lora_ops::ascend::BuildSegmentsKernel kernel(tiling, token_lora, token_indices, seg_indptr, seg_lora);
  kernel.Run();
}

namespace lora_ops::ascend {

uint32_t launch_build_segments(const BuildSegmentsTiling& tiling, const BuildSegmentsBuffers& b, void* stream) {
  auto gm = [](const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); };
  return LORA_OPS_ASCEND_LAUNCH(lora_ops_build_segments, KERNEL_TYPE_AIV_ONLY, 1, stream, tiling, gm(b.token_lora),
                                gm(b.token_indices), gm(b.seg_indptr), gm(b.seg_lora));
}

}  // namespace lora_ops::ascend
