#include <vector>

#include "kernels.h"

namespace lora_ops::cpu {

// Stable counting sort by slot; tokens with a slot outside [0, num_slots) go last, uncovered.
void build_segments(const BuildSegmentsParams& p) {
  std::vector<int64_t> next(p.num_slots + 1, 0);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t s = p.token_lora[t];
    next[(s >= 0 && s < p.num_slots) ? s : p.num_slots]++;
  }
  int64_t total = 0;
  for (int64_t s = 0; s <= p.num_slots; ++s) {
    const int64_t count = next[s];
    next[s] = total;
    if (s < p.num_slots) {
      p.seg_indptr[s] = static_cast<int32_t>(total);
      p.seg_lora[s] = static_cast<int32_t>(s);
    }
    total += count;
  }
  p.seg_indptr[p.num_slots] = static_cast<int32_t>(next[p.num_slots]);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t s = p.token_lora[t];
    p.token_indices[next[(s >= 0 && s < p.num_slots) ? s : p.num_slots]++] = static_cast<int32_t>(t);
  }
}

}  // namespace lora_ops::cpu
