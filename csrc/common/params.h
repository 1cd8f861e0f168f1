// Plain-C++ descriptions of one op call, shared by every backend's kernels. No torch headers here:
// CUDA kernel files include this and must stay cheap to compile (docs/design.md §4).
#pragma once
#include <cstdint>

namespace lora_ops {

enum class DType : int { F16 = 0, BF16 = 1, F32 = 2 };
constexpr int64_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

constexpr int kMaxSlices = 8;

// Segment metadata as it lives on the device. All values are untrusted (docs/design.md §2 Safety): kernels make
// indptr a clamped running maximum (segment_end below), skip slots outside [0, num_slots) and rows outside
// [0, rows). Index tensors given as int64 arrive here saturated to int32 (checks.cpp index_tensor).
struct Segments {
  const int32_t* indptr;         // [num_segments + 1], or nullptr: position p is segment p (lora_expand's rows form)
  const int32_t* slot;           // [num_segments]
  const int32_t* token_indices;  // [positions] or nullptr (then position p is row p)
  int64_t num_segments;
  int64_t positions;             // length of token_indices, else the number of rows
};

struct SgmvParams {
  void* y;
  const void* x;
  const void* lora_a;  // [L, S*R, K]
  const void* lora_b;  // [L, N, R]
  int64_t y_row_stride, x_row_stride;
  int64_t a_stride0, a_stride1, b_stride0, b_stride1;
  DType x_dtype, y_dtype;  // weights share x's dtype
  Segments seg;
  const int32_t* lora_ranks;  // [L] or nullptr (every slot has rank R)
  const float* lora_scales;   // [L] or nullptr (every slot has scale 1)
  int64_t rows, k, n, num_slots, max_rank, num_slices;
  int64_t slice_offsets[kMaxSlices + 1];
  float scale;
};

struct GroupedGemmParams {
  void* y;
  const void* x;
  const void* w;  // [L, N, K]
  int64_t y_row_stride, x_row_stride, w_stride0, w_stride1;
  DType x_dtype, w_dtype, y_dtype;
  Segments seg;
  const int32_t* n_sizes;  // [L] or nullptr
  const int32_t* k_sizes;  // [L] or nullptr
  int64_t rows, k, n, num_groups;
  float alpha;
  bool accumulate;
};

// lora_expand (and the second step of the CUDA decode sgmv): y[t, slice s] += coef_l * h_t,l[s*R : s*R + r_l] *
// B[l, slice s, :r_l]^T. h is read at h + t*h_row_stride + l*h_slot_stride, summed over h_splits partials
// h_split_stride apart (in split order: deterministic); the public op has one split.
struct ExpandParams {
  void* y;
  const void* h;
  const void* lora_b;  // [L, N, R]
  int64_t y_row_stride, h_row_stride, h_slot_stride, h_split_stride, b_stride0, b_stride1;
  DType b_dtype, h_dtype, y_dtype;
  Segments seg;
  const int32_t* lora_ranks;  // [L] or nullptr
  const float* lora_scales;   // [L] or nullptr
  int64_t rows, n, num_slots, max_rank, num_slices, h_splits;
  int64_t slice_offsets[kMaxSlices + 1];
  float scale;
};

struct BuildSegmentsParams {
  const int32_t* token_lora;  // [T]
  int32_t* token_indices;     // [T]
  int32_t* seg_indptr;        // [num_slots + 1]
  int32_t* seg_lora;          // [num_slots]
  int64_t num_tokens, num_slots;
};

}  // namespace lora_ops

// Segment walking with the docs/design.md §2 safety rules, shared by the CPU and CUDA kernels.
#if defined(__CUDACC__)
#define LORA_OPS_HD __host__ __device__ __forceinline__
#else
#define LORA_OPS_HD inline
#endif

namespace lora_ops {

LORA_OPS_HD int64_t clamp_index(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Segment bounds (docs/design.md §2): m_i = max over j <= i of clamp(indptr[j], 0, positions), and segment g covers
// positions [m_g, m_{g+1}). The running maximum makes segments disjoint whatever indptr holds (reversed or
// overlapping ranges are empty or cut), so the tiles of all segments fit the bound min(P, ceil(P/BM) + G) and
// the work of every backend is bounded by P + G. Computing m_g needs every earlier entry: walk the segments
// in order (segment_end) or scan the clamped entries with a running maximum (clamped_indptr). Without indptr
// (the rows form: one segment per position, num_segments = positions) entry i is i.
LORA_OPS_HD int64_t clamped_indptr(const Segments& s, int64_t i) {
  return clamp_index(s.indptr ? s.indptr[i] : i, 0, s.positions);
}

// m_{g+1}, given m_g (m_0 = clamped_indptr(s, 0)): segment g covers [m_g, segment_end(s, g, m_g)).
LORA_OPS_HD int64_t segment_end(const Segments& s, int64_t g, int64_t segment_begin) {
  const int64_t bound = clamped_indptr(s, g + 1);
  return bound > segment_begin ? bound : segment_begin;
}

// Row of position p, or -1 when token_indices names a row outside [0, rows).
LORA_OPS_HD int64_t segment_row(const Segments& s, int64_t p, int64_t rows) {
  const int64_t t = s.token_indices ? s.token_indices[p] : p;
  return (t >= 0 && t < rows) ? t : -1;
}

// Slot of segment g, or -1 when it is outside [0, num_slots).
LORA_OPS_HD int64_t segment_slot(const Segments& s, int64_t g, int64_t num_slots) {
  const int64_t l = s.slot[g];
  return (l >= 0 && l < num_slots) ? l : -1;
}

// A per-slot size (rank, n_l, k_l) clamped to [0, full]; `full` when no per-slot sizes are given.
LORA_OPS_HD int64_t slot_size(const int32_t* sizes, int64_t slot, int64_t full) {
  return sizes ? clamp_index(sizes[slot], 0, full) : full;
}

}  // namespace lora_ops
