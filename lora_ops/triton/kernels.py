"""Triton kernels for sgmv, grouped_gemm and build_segments (docs/design.md §2).

Index-based addressing only (offsets from each pool's base pointer, never loaded pointers), so every kernel also
runs under TRITON_INTERPRET=1. Device metadata is untrusted: indptr is clamped, bad slots/rows are masked out.
"""
import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _locate_tile(indptr_ptr, slot_ptr, idx_ptr, tile, num_segments, num_slots, positions, num_rows,
                 HAS_IDX: tl.constexpr, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """Tile number `tile` of the walk over all segments (BLOCK_M positions each; segments with a bad slot or no
    positions have none): its slot (-1 when there are fewer tiles) and its rows. Per-slot sizes (rank, n_l) are
    not consulted, which keeps the walk one dependent load deep; the caller leaves a tile whose size is 0. The program grid is the
    bound min(P, P/BLOCK_M + G) on the tile count, so no program is launched per (slot, row block) pair.

    Segment bounds follow the running-maximum rule (docs/design.md §2, csrc/common/params.h): m_i = max over j <= i of
    clamp(indptr[j], 0, P), segment g covers [m_g, m_{g+1}). Segments are then disjoint whatever indptr holds,
    which is what makes the grid bound hold. The maximum runs across SCAN chunks through `bound`."""
    found_slot = -1
    found_first = 0
    found_begin = 0
    found_end = 0
    count = 0
    bound = tl.minimum(tl.maximum(tl.load(indptr_ptr), 0), positions)  # m_0, then m at the chunk's start
    for g0 in range(0, num_segments, SCAN):
        gg = g0 + tl.arange(0, SCAN)
        gmask = gg < num_segments
        lo = tl.minimum(tl.maximum(tl.load(indptr_ptr + gg, mask=gmask, other=0), 0), positions)
        hi = tl.minimum(tl.maximum(tl.load(indptr_ptr + gg + 1, mask=gmask, other=0), 0), positions)
        begin = tl.maximum(tl.associative_scan(lo, 0, _max_combine), bound)  # m_g
        end = tl.maximum(tl.associative_scan(hi, 0, _max_combine), begin)  # m_{g+1}
        slot = tl.load(slot_ptr + gg, mask=gmask, other=-1)
        ok = gmask & (slot >= 0) & (slot < num_slots)
        tiles = tl.where(ok, (end - begin + BLOCK_M - 1) // BLOCK_M, 0)
        incl = tl.cumsum(tiles, axis=0) + count
        hit = (tiles > 0) & (incl - tiles <= tile) & (tile < incl)
        # At most one segment of the whole walk holds the tile: max-reductions pick its values.
        found_slot = tl.maximum(found_slot, tl.max(tl.where(hit, slot, -1), axis=0))
        found_first = tl.maximum(found_first, tl.max(tl.where(hit, incl - tiles, 0), axis=0))
        found_begin = tl.maximum(found_begin, tl.max(tl.where(hit, begin, 0), axis=0))
        found_end = tl.maximum(found_end, tl.max(tl.where(hit, end, 0), axis=0))
        count += tl.sum(tiles, axis=0)
        bound = tl.maximum(bound, tl.max(end, axis=0))
    pos = found_begin.to(tl.int64) + (tile - found_first).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pmask = (pos < found_end) & (found_slot >= 0)
    if HAS_IDX:
        rows = tl.load(idx_ptr + pos, mask=pmask, other=-1)
    else:
        rows = pos
    rmask = pmask & (rows >= 0) & (rows < num_rows)
    return found_slot, tl.where(rmask, rows, 0).to(tl.int64), rmask


@triton.jit
def _dot_f32_lhs(a_f32, b, IEEE: tl.constexpr):
    """a (float32) · b (b's dtype) with float32 accuracy: exact for fp32 (ieee), hi/lo split for fp16/bf16."""
    if IEEE:
        return tl.dot(a_f32, b.to(tl.float32), input_precision="ieee")
    hi = a_f32.to(b.dtype)
    lo = (a_f32 - hi.to(tl.float32)).to(b.dtype)
    return tl.dot(hi, b) + tl.dot(lo, b)


@triton.jit
def _pick(s, o0, o1, o2, o3, o4, o5, o6, o7, o8):
    """o_s for a run-time slice index s (slice offsets travel as scalars: no device copy, graph-safe)."""
    v = tl.where(s == 0, o0, o8)
    v = tl.where(s == 1, o1, v)
    v = tl.where(s == 2, o2, v)
    v = tl.where(s == 3, o3, v)
    v = tl.where(s == 4, o4, v)
    v = tl.where(s == 5, o5, v)
    v = tl.where(s == 6, o6, v)
    return tl.where(s == 7, o7, v)


@triton.jit
def _program_tile(indptr_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr, num_segments, num_slots, positions, num_rows,
                  R, scales_stride, scale, o0, o1, o2, o3, o4, o5, o6, o7, o8,
                  HAS_IDX: tl.constexpr, HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr, N_SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """What program (tile = program_id 0, slice s x column split = program_id 1) of sgmv or lora_expand does: its
    slot (-1: no tile), rows and row mask, the slot's rank and coefficient (scale · lora_scales[slot]), and the
    columns [n_begin, n_end) of slice s that its split covers (whole BLOCK_N blocks)."""
    s = tl.program_id(1) // N_SPLITS
    split = tl.program_id(1) % N_SPLITS
    slot, rows, rmask = _locate_tile(indptr_ptr, slot_ptr, idx_ptr, tl.program_id(0), num_segments, num_slots,
                                     positions, num_rows, HAS_IDX, BLOCK_M, SCAN)
    has_tile = slot >= 0  # no load of the per-slot tensors without a slot: they may be empty
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot, mask=has_tile, other=0), 0), R)
    else:
        rank = R
    coef = scale
    if HAS_SCALES:  # expanded or strided scales
        coef = coef * tl.load(scales_ptr + slot.to(tl.int64) * scales_stride, mask=has_tile, other=1.0)
    n_begin, n_end = _split_columns(s, split, o0, o1, o2, o3, o4, o5, o6, o7, o8, N_SPLITS, BLOCK_N)
    return slot, rows, rmask, rank, coef, n_begin, n_end


@triton.jit
def _split_columns(s, split, o0, o1, o2, o3, o4, o5, o6, o7, o8, N_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The columns [n_begin, n_end) of slice s that column split `split` covers (whole BLOCK_N blocks)."""
    lo = _pick(s, o0, o1, o2, o3, o4, o5, o6, o7, o8)
    hi = _pick(s + 1, o0, o1, o2, o3, o4, o5, o6, o7, o8)
    chunk = tl.cdiv(tl.cdiv(hi - lo, N_SPLITS), BLOCK_N) * BLOCK_N
    n_begin = lo + split * chunk
    return n_begin, tl.minimum(n_begin + chunk, hi)


@triton.jit
def _expand_into_y(h, y_ptr, b_ptr, slot, rows, rmask, rank, n_begin, n_end, y_stride, b_s0, b_s1,
                   IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rows, n_begin:n_end] += h · B[slot, n_begin:n_end, :rank]ᵀ, h [BLOCK_M, BLOCK_R] float32 (scaled, zero
    past the rank), float32-accurate in every dtype; y read and written once."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    b_base = b_ptr + slot.to(tl.int64) * b_s0 + offs_r[:, None]
    for n0 in range(n_begin, n_end, BLOCK_N):
        nn = n0 + offs_n
        nmask = nn < n_end
        bt = tl.load(b_base + nn.to(tl.int64)[None, :] * b_s1, mask=(offs_r < rank)[:, None] & nmask[None, :],
                     other=0.0)
        delta = _dot_f32_lhs(h, bt, IEEE)
        y_ptrs = y_ptr + rows[:, None] * y_stride + nn[None, :]
        ymask = rmask[:, None] & nmask[None, :]
        yt = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (yt + delta).to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def sgmv_kernel(y_ptr, x_ptr, a_ptr, b_ptr, indptr_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr,
                num_rows, K, num_slots, R, positions, num_segments, y_stride, x_stride, a_s0, a_s1, b_s0, b_s1,
                scales_stride, scale,
                o0, o1, o2, o3, o4, o5, o6, o7, o8,
                HAS_IDX: tl.constexpr, HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr, IEEE: tl.constexpr,
                N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """Program (tile of BLOCK_M positions of one segment, slice s x column split): shrink the tile's rows into
    h [BLOCK_M, rank] in float32 registers, then expand h into its share of the slice's columns of y."""
    s = tl.program_id(1) // N_SPLITS
    slot, rows, rmask, rank, coef, n_begin, n_end = _program_tile(
        indptr_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr, num_segments, num_slots, positions, num_rows, R,
        scales_stride, scale, o0, o1, o2, o3, o4, o5, o6, o7, o8, HAS_IDX, HAS_RANKS, HAS_SCALES, N_SPLITS, BLOCK_M,
        BLOCK_N, SCAN)
    if (slot < 0) | (rank == 0) | (n_begin >= n_end):
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * a_s0 + (s * R + offs_r).to(tl.int64)[None, :] * a_s1
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_base + kk[:, None], mask=kmask[:, None] & (offs_r < rank)[None, :], other=0.0)
        if IEEE:
            h += tl.dot(xt, at, input_precision="ieee")
        else:
            h += tl.dot(xt, at)
    _expand_into_y(h * coef, y_ptr, b_ptr, slot, rows, rmask, rank, n_begin, n_end, y_stride, b_s0, b_s1, IEEE,
                   BLOCK_R, BLOCK_N)


@triton.jit
def lora_expand_kernel(y_ptr, h_ptr, b_ptr, indptr_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr,
                       num_rows, num_slots, R, positions, num_segments, y_stride, h_s0, h_s1, b_s0, b_s1,
                       scales_stride, scale,
                       o0, o1, o2, o3, o4, o5, o6, o7, o8,
                       HAS_IDX: tl.constexpr, HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr,
                       IEEE: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """Program (tile of BLOCK_M positions of one segment, slice s x column split): the rows' window of h for the
    tile's slot, scaled in float32, expanded into the program's share of the slice's columns of y."""
    s = tl.program_id(1) // N_SPLITS
    slot, rows, rmask, rank, coef, n_begin, n_end = _program_tile(
        indptr_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr, num_segments, num_slots, positions, num_rows, R,
        scales_stride, scale, o0, o1, o2, o3, o4, o5, o6, o7, o8, HAS_IDX, HAS_RANKS, HAS_SCALES, N_SPLITS, BLOCK_M,
        BLOCK_N, SCAN)
    if (slot < 0) | (rank == 0) | (n_begin >= n_end):
        return
    offs_r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + rows[:, None] * h_s0 + slot.to(tl.int64) * h_s1 + (s * R + offs_r)[None, :],
                mask=rmask[:, None] & (offs_r < rank)[None, :], other=0.0).to(tl.float32)
    _expand_into_y(h * coef, y_ptr, b_ptr, slot, rows, rmask, rank, n_begin, n_end, y_stride, b_s0, b_s1, IEEE,
                   BLOCK_R, BLOCK_N)


@triton.jit
def lora_expand_rows_kernel(y_ptr, h_ptr, b_ptr, slot_ptr, idx_ptr, ranks_ptr, scales_ptr,
                            num_rows, num_slots, R, y_stride, h_s0, h_s1, b_s0, b_s1, scales_stride, scale,
                            o0, o1, o2, o3, o4, o5, o6, o7, o8,
                            HAS_IDX: tl.constexpr, HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr,
                            N_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (position p, slice s x column split) of lora_expand's rows form: p's row and slot as given (no
    segments to walk), its window of h scaled in float32 and expanded into the program's share of the slice's
    columns, one row at a time (B's rows of a slot shared by several rows come from L2)."""
    p = tl.program_id(0)
    s = tl.program_id(1) // N_SPLITS
    split = tl.program_id(1) % N_SPLITS
    slot = tl.load(slot_ptr + p)
    if HAS_IDX:
        row = tl.load(idx_ptr + p)
    else:
        row = p
    if (slot < 0) | (slot >= num_slots) | (row < 0) | (row >= num_rows):
        return
    rank = R
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot), 0), R)
    coef = scale
    if HAS_SCALES:  # expanded or strided scales
        coef = coef * tl.load(scales_ptr + slot.to(tl.int64) * scales_stride)
    n_begin, n_end = _split_columns(s, split, o0, o1, o2, o3, o4, o5, o6, o7, o8, N_SPLITS, BLOCK_N)
    if (rank == 0) | (n_begin >= n_end):
        return
    offs_r = tl.arange(0, BLOCK_R)
    in_rank = offs_r < rank
    h = tl.load(h_ptr + row.to(tl.int64) * h_s0 + slot.to(tl.int64) * h_s1 + s * R + offs_r, mask=in_rank,
                other=0.0).to(tl.float32) * coef
    b_base = b_ptr + slot.to(tl.int64) * b_s0 + offs_r[None, :]
    y_row = y_ptr + row.to(tl.int64) * y_stride
    for n0 in range(n_begin, n_end, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nmask = nn < n_end
        b = tl.load(b_base + nn.to(tl.int64)[:, None] * b_s1, mask=nmask[:, None] & in_rank[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
        yt = tl.load(y_row + nn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_row + nn, (yt + delta).to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def grouped_gemm_kernel(y_ptr, x_ptr, w_ptr, indptr_ptr, slot_ptr, idx_ptr, n_sizes_ptr, k_sizes_ptr,
                        num_rows, N, K, num_groups, positions, num_segments, y_stride, x_stride, w_s0, w_s1, alpha,
                        HAS_IDX: tl.constexpr, HAS_N: tl.constexpr, HAS_K: tl.constexpr,
                        ACCUMULATE: tl.constexpr, X_F32: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr):
    """Program (tile of BLOCK_M positions of one segment, block of BLOCK_N columns): one output tile."""
    nb = tl.program_id(1)
    slot, rows, rmask = _locate_tile(indptr_ptr, slot_ptr, idx_ptr, tl.program_id(0), num_segments, num_groups,
                                     positions, num_rows, HAS_IDX, BLOCK_M, SCAN)
    if slot < 0:
        return
    n_l = N
    k_l = K
    if HAS_N:
        n_l = tl.minimum(tl.maximum(tl.load(n_sizes_ptr + slot), 0), N)
    if HAS_K:
        k_l = tl.minimum(tl.maximum(tl.load(k_sizes_ptr + slot), 0), K)
    nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = nn < n_l
    if nb * BLOCK_N >= n_l:
        return
    # An empty reduction (k_l = 0) contributes exactly zero whatever alpha is (docs/design.md §2): the covered columns
    # become (accumulate ? y : 0), so with accumulate y is left bitwise unchanged.
    if ACCUMULATE:
        if k_l == 0:
            return
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + slot.to(tl.int64) * w_s0 + nn.to(tl.int64)[None, :] * w_s1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_l, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_l
        xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_base + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if X_F32:
            acc += _dot_f32_lhs(xt, wt, IEEE)
        elif IEEE:
            acc += tl.dot(xt, wt, input_precision="ieee")
        else:
            acc += tl.dot(xt, wt)
    y_ptrs = y_ptr + rows[:, None] * y_stride + nn[None, :]
    ymask = rmask[:, None] & nmask[None, :]
    out = tl.where(k_l > 0, alpha * acc, 0.0)
    if ACCUMULATE:
        out += tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def build_segments_kernel(token_lora_ptr, token_indices_ptr, seg_indptr_ptr, seg_lora_ptr, T, num_slots,
                          BLOCK_T: tl.constexpr):
    """Program s (0..num_slots; num_slots = "no LoRA" bucket): count earlier buckets, then place its tokens in
    order with a running cumsum. No atomics: stable and deterministic."""
    s = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    base = 0
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + offs
        v = tl.load(token_lora_ptr + tt, mask=tt < T, other=0)
        bucket = tl.where((v >= 0) & (v < num_slots), v, num_slots)
        base += tl.sum(((bucket < s) & (tt < T)).to(tl.int32), axis=0)
    if s < num_slots:
        tl.store(seg_indptr_ptr + s, base)
        tl.store(seg_lora_ptr + s, s)
    placed = base
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + offs
        v = tl.load(token_lora_ptr + tt, mask=tt < T, other=0)
        bucket = tl.where((v >= 0) & (v < num_slots), v, num_slots)
        mine = ((bucket == s) & (tt < T)).to(tl.int32)
        dest = placed + tl.cumsum(mine, axis=0) - 1
        tl.store(token_indices_ptr + dest, tt, mask=mine != 0)
        placed += tl.sum(mine, axis=0)
    if s == num_slots:
        tl.store(seg_indptr_ptr + num_slots, base)
