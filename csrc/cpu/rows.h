// Row helpers for the CPU kernels: dtype conversion to/from float32 buffers, a deterministic dot product,
// and the (segment, row-block) work list every CPU kernel parallelises over.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#include "../common/params.h"

namespace lora_ops::cpu {

inline void load_floats(DType d, const void* base, int64_t offset, int64_t n, float* out) {
  switch (d) {
    case DType::F32: std::memcpy(out, static_cast<const float*>(base) + offset, n * sizeof(float)); break;
    case DType::F16: {
      const auto* src = static_cast<const c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::BF16: {
      const auto* src = static_cast<const c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
      break;
    }
  }
}

inline void store_floats(DType d, void* base, int64_t offset, int64_t n, const float* in) {
  switch (d) {
    case DType::F32: std::memcpy(static_cast<float*>(base) + offset, in, n * sizeof(float)); break;
    case DType::F16: {
      auto* dst = static_cast<c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(in[i]);
      break;
    }
    case DType::BF16: {
      auto* dst = static_cast<c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(in[i]);
      break;
    }
  }
}

// Eight independent partial sums: vectorisable without -ffast-math, and a fixed order (deterministic).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += a[k + u] * b[k + u];
  }
  float tail = 0.f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

constexpr int64_t kRowBlock = 16;

// One unit of CPU work: up to kRowBlock valid rows of one segment, all with the same slot.
struct RowBlock {
  int64_t slot;
  int64_t count;
  int64_t rows[kRowBlock];
};

// Valid rows of every segment with a valid slot, in segment order, cut into blocks of kRowBlock. Segments are
// walked in order so that each one's bounds follow the running-maximum rule (params.h segment_end), skipped
// segments included: at most P positions are visited in all.
inline std::vector<RowBlock> row_blocks(const Segments& seg, int64_t rows, int64_t num_slots) {
  std::vector<RowBlock> blocks;
  int64_t end = clamped_indptr(seg, 0);
  for (int64_t g = 0; g < seg.num_segments; ++g) {
    const int64_t begin = end;
    end = segment_end(seg, g, begin);
    const int64_t slot = segment_slot(seg, g, num_slots);
    if (slot < 0) continue;
    RowBlock cur{slot, 0, {}};
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t = segment_row(seg, p, rows);
      if (t < 0) continue;
      cur.rows[cur.count++] = t;
      if (cur.count == kRowBlock) {
        blocks.push_back(cur);
        cur.count = 0;
      }
    }
    if (cur.count > 0) blocks.push_back(cur);
  }
  return blocks;
}

}  // namespace lora_ops::cpu
