// What the host hands each AscendC kernel by value: the problem (from the lora_ops params structs) and the tile
// sizes chosen by plan.cpp. Plain data, no torch: included by the kernels and by the host.
//
// The structs a kernel takes are global, and each opens with `struct Name {` on a line of its own: CANN's build
// (ascendc_library) finds a kernel's struct parameters by that pattern in the preprocessed source and copies their
// text, and their members' structs', into host code it generates, which includes nothing of ours. A struct in a
// namespace is not found there (its parameter type, `ns::Name`, is then undeclared in the generated code), and an
// array bound must be a literal after preprocessing: a macro, not a constexpr. lora_ops::ascend names them
// without the prefix.
#pragma once
#include <cstdint>

#define LORA_OPS_ASCEND_MAX_SLICES 8  // = lora_ops::kMaxSlices (static_assert in plan.cpp)

// The largest source row stride of one GM -> L1 DMA (Nd2NzParams::srcDValue, in elements; at least 1).
constexpr int64_t kNd2NzMaxStride = 65535;

// Segment metadata shared by the matmul ops (docs/design.md §2): positions, segments, rows, slots.
struct LoraOpsSegmentShape {
  int64_t positions;     // len(token_indices), else the number of rows
  int64_t num_segments;  // len(seg_indptr) - 1
  int64_t rows;          // T
  int64_t num_slots;     // L
  uint32_t gathered;     // token_indices given
};

// MIX kernel geometry common to the matmul ops: tiles of tile_rows positions of one segment, output blocks of
// n_block columns, handed from each AIC to its two AIVs through two workspace slots of tile_rows x n_block floats.
// An fp32 left operand of the cube (sgmv's h for a float32 y, grouped_gemm's float32 x with a 16-bit w,
// lora_expand's float32 h with a 16-bit B) goes through the split workspace: per block, a hi and a lo plane of
// tile_rows x split_ld 16-bit elements, then (sgmv) the fp32 source tile of tile_rows x split_ld floats. sgmv with
// a float32 x has no planes: its block holds the fp32 source tile alone (h from L0C back into L1).
struct LoraOpsMatmulTiles {
  uint32_t block_dim;  // AI cores (one AIC + two AIVs each)
  uint32_t tile_rows;  // positions per tile, a multiple of 16 (<= kMaxTileRows)
  uint32_t k_chunk;    // reduction elements per L0A/L0B load
  uint32_t n_block;    // output columns per L0C tile and workspace slot
  uint32_t split_ld;           // row pitch of the split planes, a multiple of 16; 0 without a split
  uint64_t split_block_elems;  // 16-bit elements of the split workspace per block
};

// The expand stage sgmv and lora_expand share (kernel_common.h ExpandStage): for a tile of rows of slot l,
// y[rows, slice s] += scale * lora_scales[l] * h_s . B[l, slice s, :r_l]^T, h held in L1.
struct LoraOpsExpandTiling {
  int64_t max_rank, num_slices;
  int64_t b_stride0, b_stride1;
  int64_t slice_offsets[LORA_OPS_ASCEND_MAX_SLICES + 1];
  float scale;
  uint32_t has_ranks, has_scales;
  uint32_t rank_chunk;  // rank per L0A/L0B load
  uint32_t h_cols;      // L1 intermediate capacity: num_slices * max_rank rounded up to 16 (= split_ld with a split)
};

struct LoraOpsSgmvTiling {
  LoraOpsSegmentShape seg;
  LoraOpsMatmulTiles tiles;
  LoraOpsExpandTiling expand;
  int64_t k, n;
  int64_t y_row_stride, x_row_stride, a_stride0, a_stride1;
  uint32_t x_dtype, y_dtype;  // DTypeCode; the weights share x's dtype
  uint32_t part_cols;   // shrink: rank columns per L0B load
  uint32_t group_cols;  // shrink: intermediate columns per L0C pass
};

// lora_expand: h [T, L, S*R] read at row * h_row_stride + slot * h_slot_stride (any strides, a zero one included).
struct LoraOpsLoraExpandTiling {
  LoraOpsSegmentShape seg;
  LoraOpsMatmulTiles tiles;
  LoraOpsExpandTiling expand;
  int64_t y_row_stride, h_row_stride, h_slot_stride;
  uint32_t h_dtype, b_dtype, y_dtype;  // DTypeCode; h and y are B's dtype or float32 (a float32 h with a 16-bit B
                                       // enters the cube as hi + lo halves)
};

struct LoraOpsGroupedGemmTiling {
  LoraOpsSegmentShape seg;
  LoraOpsMatmulTiles tiles;
  int64_t k, n;
  int64_t y_row_stride, x_row_stride, w_stride0, w_stride1;
  float alpha;
  uint32_t accumulate;
  uint32_t x_dtype, w_dtype, y_dtype;  // DTypeCode; x is w's dtype or float32 (then split into hi + lo)
  uint32_t has_n_sizes, has_k_sizes;
};

struct LoraOpsBuildSegmentsTiling {
  int64_t num_tokens, num_slots;
  uint32_t chunk;   // tokens read per UB load
  uint32_t window;  // output positions placed per pass over the tokens
};

namespace lora_ops::ascend {

constexpr int kMaxSlices = LORA_OPS_ASCEND_MAX_SLICES;
constexpr int kMaxTileRows = 128;

// Local buffers of NPU arch 2201 (Atlas A2/A3, "910B") as a kernel may use them (asc-devkit, NPU架构版本2201): UB
// and L1 less what the framework reserves. The matmul kernels double-buffer L0A, L0B and L0C (half each). The CPU
// model keeps its own copy as the hardware (cpu_model/model_core.h), so a kernel that outgrows it fails there.
constexpr uint32_t kUbBytes = 192 * 1024 - 256 - 8 * 1024;
constexpr uint32_t kL1Bytes = 512 * 1024 - 256;
constexpr uint32_t kL0AStage = 64 * 1024 / 2;
constexpr uint32_t kL0BStage = 64 * 1024 / 2;
constexpr uint32_t kL0CStage = 128 * 1024 / 2;
// Elements of fp32 an AIV splits into hi + lo halves per pass (kernel_common.h HiLoSplitter).
constexpr uint32_t kSplitElems = 4096;

enum DTypeCode : uint32_t { kHalf = 0, kBf16 = 1, kFloat = 2 };

using SegmentShape = ::LoraOpsSegmentShape;
using MatmulTiles = ::LoraOpsMatmulTiles;
using ExpandTiling = ::LoraOpsExpandTiling;
using SgmvTiling = ::LoraOpsSgmvTiling;
using LoraExpandTiling = ::LoraOpsLoraExpandTiling;
using GroupedGemmTiling = ::LoraOpsGroupedGemmTiling;
using BuildSegmentsTiling = ::LoraOpsBuildSegmentsTiling;

}  // namespace lora_ops::ascend
