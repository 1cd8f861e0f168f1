"""The docs/design.md §5 parity grid: named cases, each a function of (gen, large) returning the token slots and the
problem keyword arguments. `large` adds GPU-sized shapes (K = N = 4096, thousands of rows)."""
import torch

from lora_ops import testing


def _slots(gen, T, adapters, sizes=None):
    return testing.random_token_slots(T, adapters, gen, sizes)


def _grouped_runs(seq):
    """Contiguous token slots from (slot, count) runs: segments without token_indices, incl. bad slots."""
    return torch.tensor([s for s, n in seq for _ in range(n)], dtype=torch.int32)


# name -> (token_lora(gen), make_sgmv kwargs); L (num_slots) defaults to 6
SGMV_CASES = {
    "basic": lambda g: (_slots(g, 37, [0, 1, 2]), dict(K=70, N=50, max_rank=16)),
    "contiguous": lambda g: (_slots(g, 29, [1, 4]).sort().values, dict(K=40, N=33, max_rank=8, gathered=False)),
    "mixed_ranks": lambda g: (_slots(g, 40, [0, 1, 2, 3, 5]), dict(K=48, N=40, max_rank=16, ranks=[1, 16, 0, 7, 3, 9])),
    "rank_256": lambda g: (_slots(g, 20, [0, 2, 3]), dict(K=36, N=30, max_rank=256, ranks=[256, 5, 100, 1, 0, 255])),
    "rank_1": lambda g: (_slots(g, 11, [0, 5]), dict(K=20, N=18, max_rank=1)),
    "slices_gqa": lambda g: (_slots(g, 30, [0, 3]), dict(K=40, N=96, max_rank=8, slice_offsets=[0, 64, 80, 96],
                                                         ranks=[8, 2, 8, 5, 0, 1])),
    "slices_2_unequal": lambda g: (_slots(g, 25, [1, 2]), dict(K=24, N=70, max_rank=4, slice_offsets=[0, 30, 70])),
    "empty_slice": lambda g: (_slots(g, 12, [0]), dict(K=16, N=20, max_rank=4, slice_offsets=[0, 0, 20])),
    "bad_slots": lambda g: (_grouped_runs([(0, 3), (-1, 4), (2, 5), (6, 2), (1, 3), (99, 1), (0, 2)]),
                            dict(K=30, N=26, max_rank=8, gathered=False)),
    "no_lora_rows": lambda g: (_slots(g, 30, [0, -1, 2, 77]), dict(K=30, N=26, max_rank=8)),
    "all_no_lora": lambda g: (torch.full((9,), -1, dtype=torch.int32), dict(K=16, N=16, max_rank=8)),
    "empty_batch": lambda g: (torch.empty(0, dtype=torch.int32), dict(K=32, N=32, max_rank=8)),
    "skewed": lambda g: (_slots(g, 4030, list(range(31)), [4000] + [1] * 30), dict(K=24, N=20, max_rank=8, num_slots=32)),
    "strided_y": lambda g: (_slots(g, 21, [0, 1]), dict(K=32, N=24, max_rank=8, y_col_pad=10)),
    # y a column slice at an even offset (its column pairs stay 4-byte aligned: the CUDA rows kernel takes it) and
    # ranks that end inside a 16-rank step
    "strided_y_even": lambda g: (_slots(g, 21, [0, 1, 3]), dict(K=32, N=40, max_rank=12, y_col_pad=8,
                                                              ranks=[12, 4, 0, 8, 12, 1])),
    "y_float32": lambda g: (_slots(g, 21, [0, 4]), dict(K=32, N=24, max_rank=8, y_dtype=torch.float32)),
    "scale_no_scales": lambda g: (_slots(g, 15, [3]), dict(K=32, N=24, max_rank=8, scales=False, scale=0.37)),
    "scale_and_scales": lambda g: (_slots(g, 24, [0, 2, 5]), dict(K=32, N=24, max_rank=8, scale=0.37)),
    # x, lora_a, lora_b as views into NaN-padded tensors: strides of pool slices (lora_b[:, off:off+N]) and padded
    # rows. pad 8 keeps every row 16-byte aligned (vectorised GPU paths), pad 3 does not.
    "strided_aligned": lambda g: (_slots(g, 26, [0, 1, 4]), dict(K=64, N=48, max_rank=8, pad=8,
                                                                 slice_offsets=[0, 16, 32, 48],
                                                                 ranks=[8, 3, 0, 5, 8, 1])),
    "strided_odd": lambda g: (_slots(g, 23, [1, 2, -1]), dict(K=37, N=29, max_rank=5, pad=3, y_col_pad=7,
                                                              ranks=[5, 2, 5, 1, 0, 4], scale=1.5)),
    # Several K blocks, several column blocks and the column split of the Triton kernel (slices >= 512 wide):
    # test_triton_tiling.py asserts that these shapes keep reaching them.
    "multi_block": lambda g: (_slots(g, 40, [0, 1, 3, 5]), dict(K=300, N=600, max_rank=16, ranks=[16, 3, 0, 9, 16, 1],
                                                                scale=0.5)),
    "multi_block_slices": lambda g: (_slots(g, 30, [0, 2, -1]), dict(K=520, N=640, max_rank=32,
                                                                     slice_offsets=[0, 512, 576, 640],
                                                                     ranks=[32, 7, 17, 0, 1, 32])),
    "multi_block_y_float32": lambda g: (_slots(g, 20, [1, 4]), dict(K=300, N=520, max_rank=16,
                                                                     y_dtype=torch.float32)),
}

SGMV_LARGE_CASES = {
    "decode_4096": lambda g: (_slots(g, 64, list(range(16))), dict(K=4096, N=4096, max_rank=16, num_slots=32)),
    "decode_one_row": lambda g: (_slots(g, 1, [7]), dict(K=4096, N=4096, max_rank=16, num_slots=32)),
    "prefill_4096": lambda g: (_slots(g, 2048, [0, 3, 5, 9]), dict(K=4096, N=4096, max_rank=64, num_slots=16,
                                                                    ranks=[64, 8, 1, 16] * 4)),
    "prefill_qkv_gqa": lambda g: (_slots(g, 1024, [0, 1, 2, -1]), dict(K=2048, N=3072, max_rank=32, num_slots=4,
                                                                        slice_offsets=[0, 2048, 2560, 3072])),
    "odd_sizes_many_rows": lambda g: (_slots(g, 777, [0, 2]), dict(K=1000, N=1030, max_rank=24, num_slots=3)),
    "skewed_4096": lambda g: (_slots(g, 4030, list(range(31)), [4000] + [1] * 30),
                              dict(K=1024, N=1024, max_rank=16, num_slots=32)),
    # Every CUDA expand CTA streams several column blocks (many tiles), ranks over 128 take two passes over y,
    # and an odd slice offset keeps the element (non-vector) path.
    "streamed_rank_200": lambda g: (_slots(g, 2000, [0, 1, 2]), dict(K=256, N=3000, max_rank=200, num_slots=4,
                                                                     slice_offsets=[0, 1500, 2201, 3000],
                                                                     ranks=[200, 130, 17, 0])),
}

# name -> (token_lora(gen), make_grouped_gemm kwargs); num_groups defaults to 5
GG_CASES = {
    "basic": lambda g: (_slots(g, 33, [0, 1, 4]), dict(K=50, N=36)),
    "contiguous": lambda g: (_slots(g, 20, [2, 3]).sort().values, dict(K=20, N=17, gathered=False)),
    "n_k_sizes": lambda g: (_slots(g, 30, [0, 1, 2, 3]), dict(K=40, N=36, n_sizes=[36, 5, 0, 20, 1],
                                                             k_sizes=[40, 7, 3, 0, 40])),
    "overwrite": lambda g: (_slots(g, 30, [0, 2]), dict(K=24, N=20, accumulate=False, alpha=0.5)),
    "overwrite_sizes": lambda g: (_slots(g, 30, [0, 2]), dict(K=24, N=20, accumulate=False, n_sizes=[3, 20, 11, 1, 1])),
    "shrink_f32_out": lambda g: (_slots(g, 25, [0, 1]), dict(K=64, N=16, y_dtype=torch.float32, n_sizes=[16, 4, 8, 8, 8])),
    "expand_f32_in": lambda g: (_slots(g, 25, [0, 1]), dict(K=16, N=48, x_dtype=torch.float32, k_sizes=[16, 4, 8, 8, 8])),
    "bad_slots": lambda g: (_grouped_runs([(0, 3), (-1, 4), (2, 5), (5, 2), (1, 3)]), dict(K=16, N=16, gathered=False)),
    "empty_batch": lambda g: (torch.empty(0, dtype=torch.int32), dict(K=16, N=16)),
    "skewed": lambda g: (_slots(g, 1030, [0, 1, 2, 3], [1000, 10, 10, 10]), dict(K=20, N=18)),
    "alpha_accumulate": lambda g: (_slots(g, 21, [1, 3]), dict(K=24, N=20, alpha=-1.7)),
    "f32_in_f32_out": lambda g: (_slots(g, 25, [0, 2, 4]), dict(K=48, N=40, x_dtype=torch.float32,
                                                               y_dtype=torch.float32, k_sizes=[48, 5, 17, 1, 48])),
    # x and w as views into NaN-padded tensors (padded rows, w a slice of a pool); see SGMV_CASES.
    "strided_aligned": lambda g: (_slots(g, 22, [0, 1, 3]), dict(K=64, N=40, pad=8, n_sizes=[40, 8, 1, 16, 40])),
    "strided_odd": lambda g: (_slots(g, 19, [2, 4, -1]), dict(K=37, N=29, pad=3, alpha=0.75)),
    # Several K blocks and several column blocks of the Triton kernel (test_triton_tiling.py asserts it).
    "multi_block": lambda g: (_slots(g, 40, [0, 2, 3]), dict(K=200, N=300, alpha=0.5)),
    "multi_block_sizes": lambda g: (_slots(g, 36, [0, 1, 2, 3, 4]), dict(K=200, N=300, n_sizes=[300, 129, 0, 77, 1],
                                                                         k_sizes=[200, 65, 3, 130, 200])),
}

GG_LARGE_CASES = {
    "shrink_4096": lambda g: (_slots(g, 2048, [0, 1, 2]), dict(K=4096, N=64, num_groups=4, y_dtype=torch.float32,
                                                              n_sizes=[64, 16, 8, 64])),
    "expand_4096": lambda g: (_slots(g, 2048, [0, 1, 2]), dict(K=64, N=4096, num_groups=4, x_dtype=torch.float32,
                                                              k_sizes=[64, 16, 8, 64])),
    "odd_gemm": lambda g: (_slots(g, 999, [0, 1]), dict(K=1000, N=777, num_groups=2)),
    # the Triton table's LoRA classes past 256 positions (n <= 16: 128-deep K steps; k <= 16: 64-column blocks)
    "shrink_n16": lambda g: (_slots(g, 1500, [0, 1, 2]), dict(K=1000, N=16, num_groups=3, y_dtype=torch.float32,
                                                             n_sizes=[16, 8, 5])),
    "expand_k16": lambda g: (_slots(g, 1500, [0, 1, 2]), dict(K=16, N=1000, num_groups=3, x_dtype=torch.float32,
                                                             k_sizes=[16, 8, 5])),
}
