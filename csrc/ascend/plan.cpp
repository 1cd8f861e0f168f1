#include "plan.h"

#include <algorithm>

namespace lora_ops::ascend {

static_assert(kMaxSlices == lora_ops::kMaxSlices, "tiling.h and params.h disagree on the slice limit");

namespace {

constexpr int64_t kMaxMmadDim = 4080;       // Mmad m, n, k <= 4095, kept a multiple of 16

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t round_down(int64_t v, int64_t m) { return v / m * m; }
int64_t ceil_div(int64_t v, int64_t m) { return (v + m - 1) / m; }

// Weight rows are read by one ND->NZ DMA per block of rows, which takes the row stride as srcDValue.
bool nd2nz_stride_ok(int64_t stride) { return stride >= 1 && stride <= kNd2NzMaxStride; }

DTypeCode code(DType d) { return d == DType::F16 ? kHalf : (d == DType::BF16 ? kBf16 : kFloat); }

SegmentShape segment_shape(const Segments& s, int64_t rows, int64_t num_slots) {
  return SegmentShape{s.positions, s.num_segments, rows, num_slots, s.token_indices != nullptr ? 1u : 0u};
}

// Rows per tile: the mean segment length rounded up to a fractal, between 16 and kMaxTileRows. A tile never mixes
// segments, so per-token routing (one row per segment) gets 16-row tiles and prefill gets the largest.
int64_t tile_rows_for(const Segments& s) {
  const int64_t mean = ceil_div(s.positions, std::max<int64_t>(s.num_segments, 1));
  return std::clamp<int64_t>(round_up(mean, 16), 16, kMaxTileRows);
}

// The largest tile for which l1_bytes(tile_rows) (which also sets the sizes that depend on the tile) fits L1: from
// tile_rows_for(s) down by halves, kept multiples of 16, to 16 rows; 0 when none fits.
template <class L1Bytes>
int64_t fit_tile_rows(const Segments& s, L1Bytes l1_bytes) {
  for (int64_t rows = tile_rows_for(s);; rows = std::max<int64_t>(round_down(rows / 2, 16), 16)) {
    if (l1_bytes(rows) <= kL1Bytes) return rows;
    if (rows == 16) return 0;
  }
}

// Tiles of tile_rows positions over all segments are at most G + P / tile_rows: launch no more blocks than that.
uint32_t blocks_for(const Segments& s, int64_t tile_rows, const Target& target) {
  const int64_t tiles = s.num_segments + ceil_div(s.positions, tile_rows);
  return static_cast<uint32_t>(std::clamp<int64_t>(tiles, 1, std::max<uint32_t>(target.ai_cores, 1)));
}

// An output block is at most one L0C stage of floats (tile_rows * n_block <= kL0CStage / 4); an AIV holds half of
// its rows in at most four buffers of 4-byte elements (kernel_common.h RowUpdater), next to the HiLoSplitter's two
// float and two 16-bit buffers of kSplitElems: UB always fits both.
static_assert(kL0CStage / 4 / 2 * 4 * 4 + kSplitElems * (4 + 4 + 2 + 2) <= kUbBytes,
              "RowUpdater and HiLoSplitter buffers exceed UB");

// The split workspace of `tiles` with rows of ld columns, per block (kernel_common.h SplitPlanes): `halves` planes
// of 16-bit elements (hi and lo: 2; an fp32 operand that is not split: 0), plus an fp32 source tile (two planes'
// worth) when the source is made on the AIC.
uint64_t set_split(MatmulTiles& tiles, int64_t ld, int64_t halves, bool with_source) {
  tiles.split_ld = static_cast<uint32_t>(ld);
  tiles.split_block_elems = uint64_t(tiles.tile_rows) * ld * (halves + (with_source ? 2 : 0));
  return uint64_t(tiles.block_dim) * tiles.split_block_elems * 2;
}

// The AIC -> AIV hand-off (kernel_common.h SlotWriter): per block, two slots of tile_rows x n_block floats.
uint64_t slot_workspace_bytes(const MatmulTiles& tiles) {
  return uint64_t(tiles.block_dim) * 2 * tiles.tile_rows * tiles.n_block * sizeof(float);
}

// Output columns of one L0C stage of floats for tiles of tile_rows rows (a multiple of 16, a valid Mmad n).
int64_t l0c_cols(int64_t tile_rows) {
  return std::min<int64_t>(round_down(kL0CStage / (tile_rows * 4), 16), kMaxMmadDim);
}

// The expand stage of sgmv and lora_expand (kernel_common.h ExpandStage) from their params, but for the sizes that
// depend on the tile (set_expand_blocks).
template <class Params>
ExpandTiling expand_of(const Params& p) {
  ExpandTiling e{};
  e.max_rank = p.max_rank;
  e.num_slices = p.num_slices;
  e.b_stride0 = p.b_stride0;
  e.b_stride1 = p.b_stride1;
  std::copy(p.slice_offsets, p.slice_offsets + p.num_slices + 1, e.slice_offsets);
  e.scale = p.scale;
  e.has_ranks = p.lora_ranks != nullptr;
  e.has_scales = p.lora_scales != nullptr;
  e.h_cols = static_cast<uint32_t>(p.num_slices * round_up(p.max_rank, 16));
  return e;
}

// For tiles of tile_rows rows and elem-byte cube operands: n_block output columns per L0C tile and workspace slot
// (at most 256), rank_chunk of the rank per L0A/L0B load.
void set_expand_blocks(MatmulTiles& tiles, ExpandTiling& e, int64_t tile_rows, int64_t elem, int64_t n) {
  tiles.n_block = static_cast<uint32_t>(std::min<int64_t>({l0c_cols(tile_rows), 256, round_up(n, 16)}));
  e.rank_chunk = static_cast<uint32_t>(std::min<int64_t>(
      {round_down(kL0BStage / (tiles.n_block * elem), 16), round_down(kL0AStage / (tile_rows * elem), 16),
       round_up(e.max_rank, 16), kMaxMmadDim}));
}

// The reduction chunk of one L0A load of tile_rows rows (a fractal multiple, at most 256 and the reduction).
int64_t k_chunk_for(int64_t tile_rows, int64_t elem, int64_t k) {
  const int64_t fits = round_down(kL0AStage / (tile_rows * elem), 16);
  return std::clamp<int64_t>(fits, 16, std::min<int64_t>(256, round_up(k, 16)));
}

}  // namespace

Plan<SgmvTiling> plan_sgmv(const SgmvParams& p, const Target& target) {
  Plan<SgmvTiling> plan;
  if (!nd2nz_stride_ok(p.a_stride1) || !nd2nz_stride_ok(p.b_stride1)) {
    plan.error = "lora_ops.sgmv on Ascend: the row strides of lora_a (" + std::to_string(p.a_stride1) +
                 ") and lora_b (" + std::to_string(p.b_stride1) + ") must be in [1, 65535] elements (Nd2Nz)";
    return plan;
  }
  // No row, segment, reduction, column or rank: y is unchanged, nothing to launch.
  if (p.rows == 0 || p.seg.num_segments == 0 || p.seg.positions == 0 || p.k == 0 || p.n == 0 || p.max_rank == 0) {
    return plan;
  }
  const int64_t elem = dtype_size(p.x_dtype);  // the cube's operand type (the weights share x's dtype)
  SgmvTiling& t = plan.tiling;
  t.expand = expand_of(p);
  const int64_t rank_pad = round_up(p.max_rank, 16), h_cols = t.expand.h_cols;
  // A float32 y from 16-bit x keeps h in L1 as hi and lo halves (kernel_common.h), a float32 x keeps it in fp32,
  // else it is rounded once to x's dtype.
  const bool f32 = p.x_dtype == DType::F32;
  const bool split = p.y_dtype == DType::F32 && !f32;
  const int64_t h_parts = split ? 2 : 1;
  const int64_t tile_rows = fit_tile_rows(p.seg, [&](int64_t rows) {
    const int64_t k_chunk = k_chunk_for(rows, elem, p.k);
    t.tiles.k_chunk = static_cast<uint32_t>(k_chunk);
    t.part_cols = static_cast<uint32_t>(std::min<int64_t>(round_down(kL0BStage / (k_chunk * elem), 16), rank_pad));
    t.group_cols = static_cast<uint32_t>(std::min<int64_t>(l0c_cols(rows), h_cols));
    set_expand_blocks(t.tiles, t.expand, rows, elem, p.n);
    return 2 * rows * k_chunk * elem + 2 * int64_t(kL0BStage) + h_parts * rows * h_cols * elem;
  });
  if (tile_rows == 0) {
    plan.error = "lora_ops.sgmv on Ascend: S*R = " + std::to_string(h_cols) +
                 " intermediate columns (slices x rank rounded up to 16" +
                 (split ? ", kept as hi and lo halves for a float32 y" : "") + (f32 ? ", float32" : "") +
                 ") do not fit in L1 even with 16-row tiles";
    return plan;
  }
  t.tiles.tile_rows = static_cast<uint32_t>(tile_rows);
  t.tiles.block_dim = blocks_for(p.seg, tile_rows, target);
  t.seg = segment_shape(p.seg, p.rows, p.num_slots);
  t.k = p.k;
  t.n = p.n;
  t.y_row_stride = p.y_row_stride;
  t.x_row_stride = p.x_row_stride;
  t.a_stride0 = p.a_stride0;
  t.a_stride1 = p.a_stride1;
  t.x_dtype = code(p.x_dtype);
  t.y_dtype = code(p.y_dtype);
  plan.workspace_bytes = slot_workspace_bytes(t.tiles);
  // h in GM on its way back into L1: as fp32 rows for the AIVs to split, or (float32 x) alone.
  if (split) plan.split_bytes = set_split(t.tiles, h_cols, /*halves=*/2, /*with_source=*/true);
  if (f32) plan.split_bytes = set_split(t.tiles, h_cols, /*halves=*/0, /*with_source=*/true);
  plan.launch = true;
  return plan;
}

Plan<LoraExpandTiling> plan_lora_expand(const ExpandParams& p, const Target& target) {
  Plan<LoraExpandTiling> plan;
  if (!nd2nz_stride_ok(p.b_stride1)) {
    plan.error = "lora_ops.lora_expand on Ascend: the row stride of lora_b (" + std::to_string(p.b_stride1) +
                 ") must be in [1, 65535] elements (Nd2Nz)";
    return plan;
  }
  // No row, segment, column or rank: y is unchanged, nothing to launch.
  if (p.rows == 0 || p.seg.num_segments == 0 || p.seg.positions == 0 || p.n == 0 || p.max_rank == 0) return plan;
  const int64_t elem = dtype_size(p.b_dtype);  // the cube's operand type (a float32 h enters as two halves of it)
  // A float32 h with a 16-bit B is held in L1 as hi and lo halves (kernel_common.h).
  const bool split = p.h_dtype == DType::F32 && p.b_dtype != DType::F32;
  const int64_t h_parts = split ? 2 : 1;
  LoraExpandTiling& t = plan.tiling;
  t.expand = expand_of(p);
  const int64_t h_cols = t.expand.h_cols;
  // No x staging: L1 holds the weight stages and h.
  const int64_t tile_rows = fit_tile_rows(p.seg, [&](int64_t rows) {
    set_expand_blocks(t.tiles, t.expand, rows, elem, p.n);
    return 2 * int64_t(kL0BStage) + h_parts * rows * h_cols * elem;
  });
  if (tile_rows == 0) {
    plan.error = "lora_ops.lora_expand on Ascend: S*R = " + std::to_string(h_cols) +
                 " columns of h (slices x rank rounded up to 16" +
                 (split ? ", kept as hi and lo halves for a float32 h" : "") +
                 ") do not fit in L1 even with 16-row tiles";
    return plan;
  }
  t.tiles.tile_rows = static_cast<uint32_t>(tile_rows);
  t.tiles.k_chunk = 0;  // no rows staged through Cube's x buffers: the kernel copies h into L1 itself
  t.tiles.block_dim = blocks_for(p.seg, tile_rows, target);
  t.seg = segment_shape(p.seg, p.rows, p.num_slots);
  t.y_row_stride = p.y_row_stride;
  t.h_row_stride = p.h_row_stride;
  t.h_slot_stride = p.h_slot_stride;
  t.h_dtype = code(p.h_dtype);
  t.b_dtype = code(p.b_dtype);
  t.y_dtype = code(p.y_dtype);
  plan.workspace_bytes = slot_workspace_bytes(t.tiles);
  if (split) plan.split_bytes = set_split(t.tiles, h_cols, /*halves=*/2, /*with_source=*/false);
  plan.launch = true;
  return plan;
}

Plan<GroupedGemmTiling> plan_grouped_gemm(const GroupedGemmParams& p, const Target& target) {
  Plan<GroupedGemmTiling> plan;
  if (!nd2nz_stride_ok(p.w_stride1)) {
    plan.error = "lora_ops.grouped_gemm on Ascend: the row stride of w (" + std::to_string(p.w_stride1) +
                 ") must be in [1, 65535] elements (Nd2Nz)";
    return plan;
  }
  // Nothing to write: no row, segment or column, or an empty reduction added to y (K = 0 with accumulate).
  if (p.rows == 0 || p.seg.num_segments == 0 || p.seg.positions == 0 || p.n == 0 || (p.k == 0 && p.accumulate)) {
    return plan;
  }
  const int64_t elem = dtype_size(p.w_dtype);  // the cube's operand type (a float32 x enters as two halves of it)
  GroupedGemmTiling& t = plan.tiling;
  const int64_t tile_rows = tile_rows_for(p.seg);
  const int64_t k_chunk = k_chunk_for(tile_rows, elem, std::max<int64_t>(p.k, 1));
  t.tiles.tile_rows = static_cast<uint32_t>(tile_rows);
  t.tiles.k_chunk = static_cast<uint32_t>(k_chunk);
  t.tiles.n_block = static_cast<uint32_t>(std::min<int64_t>(
      {round_down(kL0BStage / (k_chunk * elem), 16), l0c_cols(tile_rows), 256, round_up(p.n, 16)}));
  t.tiles.block_dim = blocks_for(p.seg, tile_rows, target);
  t.seg = segment_shape(p.seg, p.rows, p.num_groups);
  t.k = p.k;
  t.n = p.n;
  t.y_row_stride = p.y_row_stride;
  t.x_row_stride = p.x_row_stride;
  t.w_stride0 = p.w_stride0;
  t.w_stride1 = p.w_stride1;
  t.alpha = p.alpha;
  t.accumulate = p.accumulate;
  t.x_dtype = code(p.x_dtype);
  t.w_dtype = code(p.w_dtype);
  t.y_dtype = code(p.y_dtype);
  t.has_n_sizes = p.n_sizes != nullptr;
  t.has_k_sizes = p.k_sizes != nullptr;
  plan.workspace_bytes = slot_workspace_bytes(t.tiles);
  if (p.x_dtype != p.w_dtype) {
    plan.split_bytes = set_split(t.tiles, round_up(p.k, 16), /*halves=*/2, /*with_source=*/false);
  }
  plan.launch = true;
  return plan;
}

Plan<BuildSegmentsTiling> plan_build_segments(const BuildSegmentsParams& p, const Target&) {
  Plan<BuildSegmentsTiling> plan;
  constexpr int64_t chunk = 1024, min_window = 64;
  const int64_t histograms = 2 * round_up((p.num_slots + 1) * 4, 32);
  const int64_t window = round_down((int64_t(kUbBytes) - histograms - chunk * 4) / 4, 8);
  if (window < min_window) {
    plan.error = "lora_ops.build_segments on Ascend: num_slots = " + std::to_string(p.num_slots) +
                 " exceeds what the kernel's two UB histograms hold (max " +
                 std::to_string((kUbBytes - chunk * 4 - min_window * 4) / 8 - 8) + ")";
    return plan;
  }
  plan.tiling.num_tokens = p.num_tokens;
  plan.tiling.num_slots = p.num_slots;
  plan.tiling.chunk = static_cast<uint32_t>(chunk);
  plan.tiling.window = static_cast<uint32_t>(std::min<int64_t>(window, 8192));
  plan.launch = true;  // seg_indptr and seg_lora are always written, even for T = 0
  return plan;
}

}  // namespace lora_ops::ascend
