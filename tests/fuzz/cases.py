"""Random calls of the ops, one per case seed, and the judgement of one call on one backend.

A case is fully determined by its seed (random.Random for the structure, torch.Generator for the data) and the
device, so any case can be rebuilt anywhere from the seed printed in a report. It draws shapes (zeros included),
dtypes, strides (x/y row strides, y as a column slice of a wider tensor, weights as slices of a pool or expanded,
strided or expanded lora_scales, lora_expand's h with any strides in its first two dims, zero included, or
sharing y's storage as the folded GEMM output), metadata from valid to garbage (every index tensor int32 or int64,
sometimes a strided view, values up to ±2^40, reversed and overlapping seg_indptr ranges), and in a share of the
cases one invalid host argument, whose error must name it. lora_expand's h and lora_b hold NaN wherever the
oracle does not read them.

Outcomes of one call (docs/design.md §2): OK (matches the float64 oracle within the dtype's tolerance, every element of y
the oracle leaves alone bitwise unchanged, the rest of y's storage and every other argument's storage too),
ERROR (an expected error that names the argument, every argument's storage bitwise unchanged), FAIL (anything
else: a wrong result, a missed or unexpected error, an error that names no argument, a changed input or a change
left by a failed call). CRASH and HANG are decided by the parent process (run.py).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from lora_ops import reference, testing

OPS = ("sgmv", "lora_expand", "grouped_gemm", "build_segments", "fold_linear")
OP_WEIGHTS = (4, 4, 3, 1, 2)
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


@dataclasses.dataclass
class Case:
    seed: int
    device: str
    op: str
    kwargs: dict
    dtype: torch.dtype = torch.float32  # tolerance class: the weights' dtype
    error_names: Tuple[str, ...] = ()  # a host error naming one of these is expected; () = valid call
    debug_clean: bool = True  # no value that LORA_OPS_DEBUG=1 rejects
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def fp32_only(self) -> bool:
        return all(t.dtype == torch.float32 for t in self.kwargs.values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point())

    def describe(self) -> str:
        """The call in one line: dtype, shape, strides when not contiguous, device when not the case's."""
        parts = []
        for k, v in self.kwargs.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k}={str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                             + ("" if v.is_contiguous() else f"@{list(v.stride())}")
                             + ("" if v.device.type == self.device else f"({v.device.type})"))
            elif v is not None:
                parts.append(f"{k}={v}")
        return f"{self.op}(" + ", ".join(parts) + ")" + (f" [{'; '.join(self.notes)}]" if self.notes else "")


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


class _Draw:
    """Random choices for one case (structure from random.Random, tensor data from a torch.Generator)."""

    def __init__(self, seed: int, device: str, large: bool):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        self.device = device
        self.large = large

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def size(self, small: int, large: int) -> int:
        """A dimension: sometimes 0 or 1, usually up to `small`, with `large` now and then in large mode."""
        r = self.rng.random()
        if r < 0.05:
            return 0
        if r < 0.12:
            return 1
        hi = large if self.large and self.rng.random() < 0.3 else small
        return self.rng.randint(1, hi)

    def randn(self, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype).to(self.device)

    def huge(self) -> int:
        return self.rng.choice([-1, 1]) * self.rng.choice(
            [INT32_MAX, 2 ** 31, 2 ** 32, 2 ** 32 + self.rng.randint(0, 8), self.rng.randint(2 ** 31, 2 ** 40)])

    def index_value(self, lo: int, hi: int, garbage: float) -> int:
        """Usually in [lo, hi]; with probability `garbage` just outside it or huge."""
        if not self.chance(garbage):
            return self.rng.randint(lo, hi) if lo <= hi else lo
        if self.chance(0.6):
            return self.rng.choice([lo - 1, hi + 1, lo - self.rng.randint(1, 9), hi + self.rng.randint(1, 9), -1])
        return self.huge()

    def bad_row(self, rows: int) -> int:
        """A row outside [0, rows)."""
        return self.rng.choice([-1, -self.rng.randint(1, 9), rows + self.rng.randint(0, 9), self.huge()])

    def index_tensor(self, values: List[int]) -> torch.Tensor:
        """int32 (values saturated to fit) or int64, sometimes a strided view of a wider tensor."""
        wide = self.chance(0.4)
        dtype = torch.int64 if wide else torch.int32
        if not wide:
            values = [min(max(v, INT32_MIN), INT32_MAX) for v in values]
        if values and self.chance(0.15):
            base = torch.full((2 * len(values),), -7, dtype=dtype)
            base[::2] = torch.tensor(values, dtype=dtype)
            return base.to(self.device)[::2]
        return torch.tensor(values, dtype=dtype).to(self.device)

    def rows_view(self, rows: int, cols: int, dtype, scale=1.0, align: int = 1):
        """A [rows, cols] tensor: plain, a column slice of a wider one, or with a padded row stride; with `align`,
        padding and column offset are multiples of it."""
        pad = _round_up(self.rng.choice([0, 0, 3, 8]), align) if cols > 0 else 0
        base = self.randn(rows, cols + pad, dtype=dtype, scale=scale)
        off = self.rng.randint(0, pad // align) * align
        return base[:, off:off + cols]

    def pool_slice(self, shape, dtype, scale, slice_dim: int, align: int = 1):
        """A weight [shape], sometimes a slice of a larger pool along `slice_dim` (with `align`, the extra size and
        the offset are multiples of it) or expanded along dim 0."""
        if shape[0] > 1 and self.chance(0.1):
            return self.randn(1, *shape[1:], dtype=dtype, scale=scale).expand(*shape)
        extra = _round_up(self.rng.choice([0, 0, 1, 5]), align) if self.chance(0.4) else 0
        big = list(shape)
        big[slice_dim] += extra
        big[0] += self.rng.choice([0, 1])
        pool = self.randn(*big, dtype=dtype, scale=scale)
        off = self.rng.randint(0, extra // align) * align
        index = [slice(0, shape[0])] + [slice(None)] * (len(shape) - 1)
        index[slice_dim] = slice(off, off + shape[slice_dim])
        return pool[tuple(index)]


def _segments(d: _Draw, rows: int, num_slots: int, case: Case) -> Dict[str, Optional[torch.Tensor]]:
    """seg_indptr, slots, token_indices: valid layouts, per-token routing, or garbage (overlapping included)."""
    mode = d.rng.choice(["build", "build", "runs", "per_token", "garbage", "garbage", "overlap"])
    slot_garbage = 0.0 if mode in ("build", "runs") and d.chance(0.5) else 0.2
    slot = lambda: d.index_value(-1, num_slots - 1, slot_garbage)
    idx = None
    if mode in ("build", "runs", "per_token"):
        token_lora = [slot() for _ in range(rows)]
        if mode == "build":
            idx_t, indptr_t, seg_t = reference.build_segments(torch.tensor(token_lora, dtype=torch.int64), num_slots)
            indptr, slots, idx = indptr_t.tolist(), seg_t.tolist(), idx_t.tolist()
        elif mode == "runs":
            indptr, slots = [0], []
            for t, s in enumerate(token_lora):
                if t and s != token_lora[t - 1]:
                    indptr.append(t)
                if t == 0 or s != token_lora[t - 1]:
                    slots.append(s)
            if rows:
                indptr.append(rows)
        else:
            indptr, slots = list(range(rows + 1)), token_lora
    else:
        positions = d.rng.randint(0, 2 * rows + 2) if d.chance(0.7) else rows
        use_idx = d.chance(0.7)
        if use_idx:  # each valid row at most once: a row named twice would be a data race, not a safety case
            free = list(range(rows))
            d.rng.shuffle(free)
            idx = [free.pop() if free and d.chance(0.8) else d.bad_row(rows) for _ in range(positions)]
        else:
            positions = rows
        G = d.rng.randint(0, 12)
        if mode == "overlap":  # copies of [0, P) and of reversed ranges, then a few ordinary ones
            indptr = [0]
            for _ in range(G):
                indptr.append(d.rng.choice([positions, 0, positions // 2, indptr[-1] + d.rng.randint(0, 4)]))
            case.notes.append("overlapping seg_indptr")
        else:
            indptr = [d.index_value(0, positions, 0.3) for _ in range(G + 1)]
            if d.chance(0.5):
                indptr.sort()
        slots = [slot() for _ in range(len(indptr) - 1)]
    case.notes.append(f"segments: {mode}")
    out = {"seg_indptr": d.index_tensor(indptr), "slots": d.index_tensor(slots),
           "token_indices": d.index_tensor(idx) if idx is not None else None}
    case.debug_clean = _debug_clean(out["seg_indptr"], out["slots"], out["token_indices"], rows, num_slots)
    return out


def _rows_form(d: _Draw, rows: int, num_slots: int, case: Case) -> Dict[str, Optional[torch.Tensor]]:
    """lora_expand's rows form (no seg_indptr, each position's slot): the token slots as they are, in build_segments'
    order (the fold route's call: the CUDA runs kernel's input), or positions naming garbage rows and slots."""
    mode = d.rng.choice(["tokens", "sorted", "sorted", "garbage"])
    slot = lambda garbage: d.index_value(-1, num_slots - 1, garbage)
    token_lora = [slot(0.0 if mode != "garbage" and d.chance(0.5) else 0.2) for _ in range(rows)]
    idx = None
    if mode == "tokens":
        slots = token_lora
    elif mode == "sorted":
        idx = reference.build_segments(torch.tensor(token_lora, dtype=torch.int64), num_slots)[0].tolist()
        slots = [token_lora[t] for t in idx]
    else:  # each valid row at most once, as in _segments
        free = list(range(rows))
        d.rng.shuffle(free)
        idx = [free.pop() if free and d.chance(0.8) else d.bad_row(rows) for _ in range(d.rng.randint(0, 2 * rows + 2))]
        slots = [slot(0.2) for _ in idx]
    case.notes.append(f"rows form: {mode}")
    out = {"seg_indptr": None, "slots": d.index_tensor(slots),
           "token_indices": d.index_tensor(idx) if idx is not None else None}
    # the rows form is the per-position segments: position p is segment p
    case.debug_clean = _debug_clean(torch.arange(len(slots) + 1), out["slots"], out["token_indices"], rows, num_slots)
    return out


def _if_indptr(kw: dict, change):
    """change(seg_indptr), or None (no such mutation) in lora_expand's rows form."""
    return change(kw["seg_indptr"]) if kw["seg_indptr"] is not None else None


def _debug_clean(seg_indptr, slots, token_indices, rows, num_slots) -> bool:
    """Whether LORA_OPS_DEBUG=1 accepts this metadata (the rules of csrc/common/checks.cpp debug_validate_*)."""
    ip, sl = seg_indptr.tolist(), slots.tolist()
    idx = token_indices.tolist() if token_indices is not None else None
    positions = len(idx) if idx is not None else rows
    if not 0 <= ip[0] <= positions:  # checked even with no segment after it
        return False
    seen = set()
    for g, s in enumerate(sl):
        if not 0 <= ip[g] <= ip[g + 1] <= positions or s >= num_slots:
            return False
        if s < 0:
            continue
        for p in range(ip[g], ip[g + 1]):
            t = idx[p] if idx is not None else p
            if not 0 <= t < rows or t in seen:
                return False
            seen.add(t)
    return True


def _sizes_tensor(d: _Draw, count: int, full: int, case: Case) -> torch.Tensor:
    values = [d.index_value(0, full, 0.25) for _ in range(count)]
    case.debug_clean &= all(0 <= v <= full for v in values)
    return d.index_tensor(values)


def _float_dtype(d: _Draw) -> torch.dtype:
    return d.rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])


def make_sgmv(d: _Draw, case: Case) -> None:
    big = 4096 if d.large else 48
    T, K, N = d.size(40, 3000), d.size(48, big), d.size(48, big)
    L, R = d.size(6, 64), d.size(16, 128)
    S = d.rng.choice([1, 1, 1, 2, 3])
    dtype = _float_dtype(d)
    y_dtype = torch.float32 if d.chance(0.3) else dtype
    y = d.rows_view(T, N, y_dtype)
    if T > 1 and d.chance(0.08):
        x = d.randn(1, K, dtype=dtype).expand(T, K)
    else:
        x = d.rows_view(T, K, dtype)
    lora_a = d.pool_slice((L, S * R, K), dtype, 1 / max(K, 1) ** 0.5, slice_dim=1)
    lora_b = d.pool_slice((L, N, R), dtype, 1 / max(R, 1) ** 0.5, slice_dim=1)
    offsets = _slice_offsets(d, N, S, align=1)
    seg = _segments(d, T, L, case)
    ranks = _sizes_tensor(d, L, R, case) if d.chance(0.5) else None
    # An empty reduction (K = 0) ignores the scales, NaN included.
    scales = _lora_scales(d, L, nan_first=K == 0) if d.chance(0.6) else None
    scale = d.rng.choice([1.0, 0.5, -2.0]) if K > 0 else d.rng.choice([1.0, float("nan"), float("inf")])
    case.dtype = dtype
    case.kwargs = dict(y=y, x=x, lora_a=lora_a, lora_b=lora_b, seg_indptr=seg["seg_indptr"], seg_lora=seg["slots"],
                       token_indices=seg["token_indices"], lora_ranks=ranks, lora_scales=scales,
                       slice_offsets=offsets, scale=scale)


def _lora_scales(d: _Draw, num_slots: int, nan_first: bool) -> torch.Tensor:
    """lora_scales [L] float32: plain, strided, or one value expanded over the slots; with `nan_first`, half the
    time slot 0's is NaN."""
    values = [d.rng.uniform(0.5, 2.5) for _ in range(num_slots)]
    if nan_first and values and d.chance(0.5):
        values[0] = float("nan")
    layout = d.rng.choice(["plain", "plain", "strided", "expanded"])
    if layout == "strided":
        return torch.tensor([v for v in values for _ in (0, 1)]).to(d.device)[::2]
    if layout == "expanded" and num_slots > 0:
        return torch.tensor(values[:1] + [99.0]).to(d.device)[:1].expand(num_slots)
    return torch.tensor(values).to(d.device)


def _slice_offsets(d: _Draw, N: int, S: int, align: int) -> Optional[List[int]]:
    """slice_offsets of S slices of N columns, cut on multiples of `align` (for S = 1, usually None: the
    default)."""
    if S == 1 and d.chance(0.7):
        return None
    cuts = sorted(d.rng.randint(0, N // align) * align for _ in range(S - 1))
    return [0] + cuts + [N]


H_LAYOUTS = ("plain", "padded", "slot_major", "broadcast_slots", "broadcast_rows", "folded")
MAX_H_ELEMENTS = 2 ** 23  # large mode: keeps h and its float64 copies in the oracle to a few hundred MB


def make_lora_expand(d: _Draw, case: Case) -> None:
    big = 4096 if d.large else 48
    T, N = d.size(40, 3000), d.size(48, big)
    L, R = d.size(6, 64), d.size(16, 256)
    S = d.rng.choice([1, 1, 1, 2, 3])
    if d.large and d.chance(0.03):  # more 4-row tiles than one CUDA grid dimension holds (65535)
        T, N, L, R, S = d.rng.randint(262_200, 300_000), d.size(48, 48), d.rng.randint(1, 2), d.size(8, 8), 1
    while T * L * S * R > MAX_H_ELEMENTS:
        L, T = (L // 2, T) if L > 1 else (L, T // 2)
    # Aligned sizes, offsets and pools: the CUDA kernel's 16-byte vector path (else its scalar one).
    align = 8 if d.chance(0.4) else 1
    N, R = _round_up(N, align), _round_up(R, align)
    dtype = _float_dtype(d)
    h_dtype = torch.float32 if d.chance(0.4) else dtype
    layout = d.rng.choice(H_LAYOUTS)
    case.notes.append(f"h: {layout}" + (", aligned" if align > 1 else ""))
    if layout == "folded":  # the base GEMM's output [T, N + L*S*R]: y and h are its column ranges, either order
        width = L * S * R
        base = d.randn(T, N + width + _round_up(d.rng.choice([0, 0, 3]), align), dtype=h_dtype)
        y_off, h_off = (0, N) if d.chance(0.7) else (width, 0)
        y, h = base[:, y_off:y_off + N], base[:, h_off:h_off + width].view(T, L, S * R)
    else:
        y_dtype = torch.float32 if d.chance(0.3) else dtype
        y = d.rows_view(T, N, y_dtype, align=align)
        if layout == "padded":
            pool = d.randn(T + 1, L + d.rng.randint(0, 2), S * R + d.rng.choice([1, 4]), dtype=h_dtype)
            lo, col = d.rng.randint(0, pool.shape[1] - L), d.rng.randint(0, pool.shape[2] - S * R)
            h = pool[:T, lo:lo + L, col:col + S * R]
        elif layout == "slot_major":
            h = d.randn(L, T, S * R, dtype=h_dtype).transpose(0, 1)
        elif layout == "broadcast_slots":  # one window per row for every slot: slot stride 0
            h = d.randn(T, 1, S * R, dtype=h_dtype).expand(T, L, S * R)
        elif layout == "broadcast_rows":
            h = d.randn(1, L, S * R, dtype=h_dtype).expand(T, L, S * R)
        else:
            h = d.randn(T, L, S * R, dtype=h_dtype)
    lora_b = d.pool_slice((L, N, R), dtype, 1 / max(R, 1) ** 0.5, slice_dim=d.rng.choice([1, 2]), align=align)
    offsets = _slice_offsets(d, N, S, align)
    seg = _rows_form(d, T, L, case) if d.chance(0.35) else _segments(d, T, L, case)
    ranks = _sizes_tensor(d, L, R, case) if d.chance(0.5) else None
    # With R = 0 every slot has rank 0 and is skipped, a NaN scale included (not NaN * 0). An expanded NaN
    # would reach slots with a rank otherwise: tests/test_lora_expand.py covers a NaN on one rank-0 slot.
    scales = _lora_scales(d, L, nan_first=R == 0) if d.chance(0.6) else None
    case.dtype = dtype
    case.kwargs = dict(y=y, h=h, lora_b=lora_b, seg_indptr=seg["seg_indptr"], seg_lora=seg["slots"],
                       token_indices=seg["token_indices"], lora_ranks=ranks, lora_scales=scales,
                       slice_offsets=offsets, scale=d.rng.choice([1.0, 0.5, -2.0]))
    h_read, b_read = _expand_reads(case.kwargs)
    _poison_unread(h, h_read)
    _poison_unread(lora_b, b_read)


def _expand_reads(kw: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masks of the elements of h and lora_b that the oracle reads: each covered row's window of its slot, to the
    slot's rank, and the first rank columns of B for each slot that has rows."""
    h, lora_b = kw["h"], kw["lora_b"]
    T, L, _ = h.shape
    N, R = lora_b.shape[1:]
    S = len(kw["slice_offsets"]) - 1 if kw["slice_offsets"] is not None else 1
    h_read = torch.zeros(h.shape, dtype=torch.bool)
    b_read = torch.zeros(lora_b.shape, dtype=torch.bool)
    ranks = kw["lora_ranks"].tolist() if kw["lora_ranks"] is not None else None
    for slot, rows in reference._segment_rows(kw["seg_indptr"], kw["seg_lora"], kw["token_indices"], T, L):
        rank = R if ranks is None else min(max(ranks[slot], 0), R)
        for s in range(S):
            h_read[rows, slot, s * R:s * R + rank] = True
        b_read[slot, :, :rank] = True
    return h_read, b_read


def _poison_unread(t: torch.Tensor, read: torch.Tensor) -> None:
    """NaN into every element of t's storage that t addresses and the oracle never reads (`read`: bool, t's shape;
    an element that several indices reach, through a zero stride or shared storage, counts as read when one of
    them is read). A kernel that reads past a slot's rank, or another row's or slot's window, then writes NaN;
    a pool allocated with torch.empty may hold NaN there just as well."""
    if t.numel() == 0:
        return
    where = _offsets(t)
    flat = _storage(t)
    unread = torch.zeros(flat.shape, dtype=torch.bool)
    unread[where.reshape(-1)] = True
    unread[where[read]] = False
    flat[unread.to(t.device)] = float("nan")


def _storage(t: torch.Tensor) -> torch.Tensor:
    """All of t's storage as a 1-D tensor of t's dtype (a view: writes go to t's memory)."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset of each element of t (int64, t's shape, on the CPU)."""
    where = torch.tensor(t.storage_offset())
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        where = where + (torch.arange(size) * stride).view([size if i == dim else 1 for i in range(t.dim())])
    return where.expand(t.shape)


def make_grouped_gemm(d: _Draw, case: Case) -> None:
    big = 4096 if d.large else 48
    T, K, N, L = d.size(40, 3000), d.size(48, big), d.size(48, big), d.size(6, 64)
    dtype = _float_dtype(d)
    x_dtype = torch.float32 if d.chance(0.25) else dtype
    y_dtype = torch.float32 if d.chance(0.25) else dtype
    y = d.rows_view(T, N, y_dtype)
    x = d.rows_view(T, K, x_dtype)
    w = d.pool_slice((L, N, K), dtype, 1 / max(K, 1) ** 0.5, slice_dim=d.rng.choice([1, 2]))
    seg = _segments(d, T, L, case)
    n_sizes = _sizes_tensor(d, L, N, case) if d.chance(0.4) else None
    k_sizes = _sizes_tensor(d, L, K, case) if d.chance(0.4) else None
    alpha = d.rng.choice([1.0, 0.5, -1.5]) if K > 0 else d.rng.choice([1.0, float("nan")])
    case.dtype = dtype
    case.kwargs = dict(y=y, x=x, w=w, seg_indptr=seg["seg_indptr"], seg_weight=seg["slots"],
                       token_indices=seg["token_indices"], n_sizes=n_sizes, k_sizes=k_sizes, alpha=alpha,
                       accumulate=d.chance(0.6))


def make_fold_linear(d: _Draw, case: Case) -> None:
    """Mostly decode sizes (the CUDA CUTLASS kernel serves up to 64 tokens with n and k multiples of 8, 16-byte
    aligned rows and no bias; at::linear elsewhere): tokens up to 80 in any leading dims, n and k usually in
    eights, the weight often a row range of a taller one (the fold route's [W; A...]) at any row offset, x
    sometimes a column slice (not contiguous), a bias now and then, and often slot windows (seg_indptr and
    slot_rows: weight's last rows, whose unused slots the CUDA kernel skips), with build_segments' ascending counts
    or garbage values. Every case is valid: fold_linear's errors are F.linear's and the windows' (whose checks
    tests/test_fold_linear.py covers)."""
    big = 4096 if d.large else 64
    T, N, K = d.size(80, 300), d.size(96, big), d.size(96, big)
    if d.chance(0.7):
        N, K = _round_up(N, 8), _round_up(K, 8)
    dtype = _float_dtype(d)
    scale = 1 / max(K, 1) ** 0.5
    x = d.rows_view(T, K, dtype) if d.chance(0.3) else d.randn(T, K, dtype=dtype)
    if T % 2 == 0 and T > 0 and d.chance(0.3):
        x = x.view(2, T // 2, K) if x.is_contiguous() else x
    if d.chance(0.5):  # a row range of a taller weight, as the fold route's [W; A of every slot]
        extra = d.rng.choice([1, 3, 8, 40])
        off = d.rng.randint(0, extra)
        weight = d.randn(N + extra, K, dtype=dtype, scale=scale)[off:off + N]
    else:
        weight = d.pool_slice((N, K), dtype, scale, slice_dim=1)
    bias = d.randn(N, dtype=dtype) if d.chance(0.2) else None
    case.dtype = dtype
    case.kwargs = dict(x=x, weight=weight, bias=bias)
    if d.chance(0.4):
        slot_rows = d.rng.choice([8, 16, 48, 64])
        num_slots = d.rng.randint(0, N // slot_rows)
        if d.chance(0.8):  # build_segments' form: rows per slot, many slots without any
            values = [0]
            for _ in range(num_slots):
                values.append(values[-1] + d.rng.choice([0, 0, 0, 1, 3]))
        else:
            values = [d.index_value(-5, 40, 0.3) for _ in range(num_slots + 1)]
        case.kwargs.update(seg_indptr=d.index_tensor(values), slot_rows=slot_rows)


def make_build_segments(d: _Draw, case: Case) -> None:
    num_slots = d.size(8, 300)
    T = d.size(40, 4000)
    token_lora = d.index_tensor([d.index_value(-1, num_slots - 1, 0.2) for _ in range(T)])
    case.kwargs = dict(token_lora=token_lora, num_slots=num_slots)


# ---- invalid host arguments: (argument names an error may name, mutation or None when not applicable) ----

def _other_half(dtype):
    return torch.bfloat16 if dtype == torch.float16 else torch.float16


def _transposed(t: torch.Tensor) -> Optional[torch.Tensor]:
    """Same shape, last-dim stride != 1 (None when the layout cannot show it: a last-two dim <= 1, or no elements,
    whose transposed copy is already "contiguous")."""
    if t.shape[-1] <= 1 or t.shape[-2] <= 1 or t.numel() == 0:
        return None
    return t.detach().cpu().transpose(-1, -2).contiguous().transpose(-1, -2).to(t.device)


def _mutations(d: _Draw, case: Case) -> List[Tuple[Tuple[str, ...], Callable[[dict], Optional[dict]]]]:
    kw = case.kwargs
    other_dev = "cpu" if d.device != "cpu" else "meta"
    i16 = lambda t: t.to(torch.int16)
    if case.op == "build_segments":
        return [
            (("num_slots",), lambda k: {"num_slots": -1 - d.rng.randint(0, 5)}),
            (("num_slots",), lambda k: {"num_slots": 2 ** 30 + d.rng.randint(0, 5)}),
            (("token_lora",), lambda k: {"token_lora": k["token_lora"].float()}),
            (("token_lora",), lambda k: {"token_lora": k["token_lora"][:, None]}),
        ]
    slot_name = "seg_weight" if case.op == "grouped_gemm" else "seg_lora"
    # lora_expand takes its row count from y and checks it against h; the others check y against x.
    rows_from = "h" if case.op == "lora_expand" else "x"
    common = [
        (("y",), lambda k: {"y": k["y"][:, :, None]}),
        (("y", rows_from), lambda k: {"y": d.randn(k["y"].shape[0] + 1, k["y"].shape[1], dtype=k["y"].dtype)}),
        (("y",), lambda k: _maybe({"y": _transposed(k["y"])})),
        (("y",), lambda k: {"y": d.randn(1, k["y"].shape[1], dtype=k["y"].dtype).expand(k["y"].shape)}
         if k["y"].shape[0] > 1 and k["y"].shape[1] > 0 else None),
        # (lora_expand's rows form has no seg_indptr to break: None skips these)
        (("seg_indptr",), lambda k: _if_indptr(k, lambda t: {"seg_indptr": t.to(other_dev)})),
        (("seg_indptr",), lambda k: _if_indptr(k, lambda t: {"seg_indptr": t.float()})),
        (("seg_indptr",), lambda k: _if_indptr(k, lambda t: {"seg_indptr": t[:, None]})),
        (("seg_indptr",), lambda k: _if_indptr(k, lambda t: {"seg_indptr": t[:0], slot_name: k[slot_name][:0]})),
        ((slot_name,), lambda k: {slot_name: torch.cat([k[slot_name], k[slot_name].new_zeros(1)])}),
        ((slot_name,), lambda k: {slot_name: i16(k[slot_name])}),
        (("token_indices",), lambda k: {"token_indices": torch.zeros(3, device=d.device)}),
        (("token_indices",), lambda k: {"token_indices": torch.zeros(2, 2, dtype=torch.int32, device=d.device)}),
    ]
    if case.op == "lora_expand":
        return common + _expand_mutations(d, kw, other_dev)
    common += [
        (("x",), lambda k: {"x": k["x"].reshape(-1)}),
        (("x",), lambda k: _maybe({"x": _transposed(k["x"])})),
        (("x",), lambda k: {"x": k["x"].to(other_dev)}),
    ]
    if case.op == "sgmv":
        L, SR, K = kw["lora_a"].shape
        N, R = kw["lora_b"].shape[1:]
        dt = kw["x"].dtype
        return common + [
            (("lora_a",), lambda k: {"lora_a": k["lora_a"].flatten(0, 1)}),
            (("lora_b",), lambda k: {"lora_b": k["lora_b"].flatten(0, 1)}),
            (("x",), lambda k: {"x": k["x"].to(torch.float64)}),
            (("x",), lambda k: {"x": k["x"].to(torch.int32)}),
            (("lora_a",), lambda k: {"lora_a": k["lora_a"].to(_other_half(dt))}),
            (("lora_b",), lambda k: {"lora_b": k["lora_b"].to(_other_half(dt))}),
            (("y",), lambda k: {"y": k["y"].to(torch.float64)}),
            (("lora_a",), lambda k: {"lora_a": d.randn(L, SR, K + 1, dtype=dt)}),
            (("lora_b",), lambda k: {"lora_b": d.randn(L + 1, N, R, dtype=dt)}),
            (("lora_b",), lambda k: {"lora_b": d.randn(L, N + 1, R, dtype=dt)}),
            (("lora_b",), lambda k: {"lora_b": d.randn(L, N, R + 1, dtype=dt)}),
            (("lora_a",), lambda k: _maybe({"lora_a": _transposed(k["lora_a"])})),
            (("lora_b",), lambda k: _maybe({"lora_b": _transposed(k["lora_b"])})),
            (("lora_b",), lambda k: {"lora_b": k["lora_b"].to(other_dev)}),
            (("slice_offsets",), lambda k: {"slice_offsets": [0, N + 1]}),
            (("slice_offsets",), lambda k: {"slice_offsets": [1, N]}),
            (("slice_offsets",), lambda k: {"slice_offsets": list(range(10))}),
            (("slice_offsets",), lambda k: {"slice_offsets": [0]}),
            (("slice_offsets", "lora_a"), lambda k: {"slice_offsets": [0, N, N, N, N, N, N, N, N]}
             if SR % 8 else None),
            (("slice_offsets",), lambda k: {"slice_offsets": [0, N, 0, N], "lora_a": d.randn(L, 3, K, dtype=dt),
                                            "lora_b": d.randn(L, N, 1, dtype=dt)} if N > 0 else None),
        ] + _slot_tensor_mutations(d, L, other_dev)
    L, N, K = kw["w"].shape
    dt = kw["w"].dtype
    return common + [
        (("w",), lambda k: {"w": k["w"].flatten(0, 1)}),
        (("w",), lambda k: {"w": torch.ones(L, N, K, dtype=torch.int8, device=d.device)}),
        (("x",), lambda k: {"x": k["x"].to(_other_half(dt) if dt != torch.float32 else torch.float64)}),
        (("y",), lambda k: {"y": k["y"].to(torch.float64)}),
        (("w",), lambda k: {"w": d.randn(L, N + 1, K, dtype=dt)}),
        (("w",), lambda k: {"w": d.randn(L, N, K + 1, dtype=dt)}),
        (("w",), lambda k: _maybe({"w": _transposed(k["w"])})),
        (("w",), lambda k: {"w": k["w"].to(other_dev)}),
        (("n_sizes",), lambda k: {"n_sizes": torch.zeros(L + 1, dtype=torch.int32, device=d.device)}),
        (("k_sizes",), lambda k: {"k_sizes": torch.zeros(L, dtype=torch.float16, device=d.device)}),
    ]


def _slot_tensor_mutations(d: _Draw, L: int, other_dev: str):
    """Wrong lora_ranks / lora_scales (sgmv, lora_expand)."""
    return [
        (("lora_ranks",), lambda k: {"lora_ranks": torch.zeros(L + 1, dtype=torch.int32, device=d.device)}),
        (("lora_ranks",), lambda k: {"lora_ranks": torch.zeros(L, device=d.device)}),
        (("lora_scales",), lambda k: {"lora_scales": torch.ones(L, dtype=torch.float64, device=d.device)}),
        (("lora_scales",), lambda k: {"lora_scales": torch.ones(L + 2, device=d.device)}),
        (("lora_scales",), lambda k: {"lora_scales": torch.ones(L, 1, device=d.device)}),
        (("lora_scales",), lambda k: {"lora_scales": torch.ones(L).to(other_dev)}),
    ]


def _expand_mutations(d: _Draw, kw: dict, other_dev: str):
    """Wrong h, lora_b, slice_offsets and dtypes of lora_expand. A change of lora_b's L or R, or of the number of
    slices, breaks h's shape [T, L, S*R]: the error may name h."""
    T, L, SR = kw["h"].shape
    N, R = kw["lora_b"].shape[1:]
    dt, h_dt = kw["lora_b"].dtype, kw["h"].dtype
    other = _other_half(dt)
    both_fp32 = h_dt == torch.float32 and kw["y"].dtype == torch.float32
    return [
        (("h",), lambda k: {"h": k["h"].flatten(1, 2)}),
        (("h",), lambda k: {"h": k["h"][..., None]}),
        (("h",), lambda k: {"h": d.randn(T + 1, L, SR, dtype=h_dt)}),
        (("h",), lambda k: {"h": d.randn(T, L + 1, SR, dtype=h_dt)}),
        (("h",), lambda k: {"h": d.randn(T, L, SR + 1, dtype=h_dt)}),
        (("h",), lambda k: {"h": k["h"].to(torch.float64)}),
        (("h",), lambda k: {"h": k["h"].to(torch.int32)}),
        (("h",), lambda k: {"h": k["h"].to(other)}),  # neither float32 nor lora_b's dtype
        (("h",), lambda k: {"h": k["h"].to(other_dev)}),
        (("h",), lambda k: _maybe({"h": _transposed(k["h"])})),
        (("h",), lambda k: {"h": d.randn(T, L, 2 * SR, dtype=h_dt)[..., ::2]} if SR > 1 else None),
        (("y",), lambda k: {"y": k["y"].to(torch.float64)}),
        (("y",), lambda k: {"y": k["y"].to(other)}),
        (("lora_b",), lambda k: {"lora_b": k["lora_b"].flatten(0, 1)}),
        (("lora_b",), lambda k: {"lora_b": k["lora_b"].to(torch.float64)}),
        (("lora_b",), lambda k: {"lora_b": k["lora_b"].to(torch.int32)}),
        # h or y no longer float32 or lora_b's dtype (with both in float32, any lora_b dtype is valid)
        (("lora_b", "h", "y"), lambda k: {"lora_b": k["lora_b"].to(other)} if not both_fp32 else None),
        (("lora_b", "h"), lambda k: {"lora_b": d.randn(L + 1, N, R, dtype=dt)}),
        (("lora_b",), lambda k: {"lora_b": d.randn(L, N + 1, R, dtype=dt)}),
        (("lora_b", "h"), lambda k: {"lora_b": d.randn(L, N, R + 1, dtype=dt)}),
        (("lora_b",), lambda k: _maybe({"lora_b": _transposed(k["lora_b"])})),
        (("lora_b",), lambda k: {"lora_b": k["lora_b"].to(other_dev)}),
        (("slice_offsets",), lambda k: {"slice_offsets": [0, N + 1]}),
        (("slice_offsets",), lambda k: {"slice_offsets": [1, N]}),
        (("slice_offsets",), lambda k: {"slice_offsets": list(range(10))}),
        (("slice_offsets",), lambda k: {"slice_offsets": [0]}),
        (("slice_offsets", "h"), lambda k: {"slice_offsets": [0] + [N] * (SR // R + 1)} if R > 0 else None),
        (("slice_offsets",), lambda k: {"slice_offsets": [0, N, 0, N], "h": d.randn(T, L, 3 * R, dtype=h_dt)}
         if N > 0 else None),
    ] + _slot_tensor_mutations(d, L, other_dev)


def _maybe(change: dict) -> Optional[dict]:
    return None if any(v is None for v in change.values()) else change


def _mutate(d: _Draw, case: Case) -> None:
    options = _mutations(d, case)
    d.rng.shuffle(options)
    for names, mutation in options:
        change = mutation(case.kwargs)
        if change is not None:
            case.kwargs.update(change)
            case.error_names = names
            case.notes.append("invalid: " + "/".join(names))
            return


def case_op(seed: int) -> str:
    """The op of case `seed`: the first draw of make_case, without building the case."""
    return random.Random(seed).choices(OPS, weights=OP_WEIGHTS)[0]


def make_case(seed: int, device: str, large: bool = False, invalid_share: float = 0.25) -> Case:
    d = _Draw(seed, device, large)
    op = d.rng.choices(OPS, weights=OP_WEIGHTS)[0]
    case = Case(seed=seed, device=device, op=op, kwargs={})
    {"sgmv": make_sgmv, "lora_expand": make_lora_expand, "grouped_gemm": make_grouped_gemm,
     "build_segments": make_build_segments, "fold_linear": make_fold_linear}[op](d, case)
    if op != "fold_linear" and d.chance(invalid_share):  # fold_linear's errors are F.linear's, not ours
        _mutate(d, case)
    return case


# ---- judging one call ----

def _names_argument(message: str, op: str, names: Tuple[str, ...]) -> bool:
    if not message.startswith(f"lora_ops.{op}: "):
        return False
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", message) for n in names)


def _cpu(v):
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads and -0.0 included), whatever the strides."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# Unit roundoff of the dtype y is stored in, and of the float32 accumulation.
_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _magnitude(case: Case, args: dict) -> torch.Tensor:
    """The oracle's change with every term made non-negative (|x|, |h|, |weights|, |scales|): what the float32
    accumulation's rounding error scales with."""
    mag = {k: v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    mag["y"] = torch.zeros_like(args["y"])
    if case.op == "grouped_gemm":
        mag["alpha"], mag["accumulate"] = abs(mag["alpha"]), True
    else:
        mag["scale"] = abs(mag["scale"])
    return getattr(reference, case.op)(**mag)


def _compare(case: Case, args: dict, out: torch.Tensor, before: torch.Tensor, ref: torch.Tensor) -> str:
    """testing.check_against_reference, with the relative error on the change (out - before) widened by the
    rounding a correct kernel cannot avoid: y's own (storing y in half precision, with |y| much larger than the
    change, alone exceeds the dtype's tolerance on the change) and the float32 accumulation's over its terms
    (K + R, R or K) when they cancel. Fuzzed scales, ranks and sizes make both common; a wrong row, slot or scale
    is far above."""
    problem = testing.check_against_reference(out, before, ref, case.dtype)
    if not problem.startswith("relative error"):
        return problem
    out64, before64, ref = out.cpu().double(), before.cpu().double(), ref.cpu()
    touched = ~((ref == before64) | (ref.isnan() & before64.isnan()))
    change = (ref - torch.where(before64.isnan(), 0, before64))[touched].norm().item()
    if case.op == "sgmv":
        terms = args["x"].shape[1] + args["lora_b"].shape[2]
    elif case.op == "lora_expand":
        terms = args["lora_b"].shape[2]
    else:
        terms = args["x"].shape[1]
    allowed = (testing.TOLERANCE[case.dtype] * change + _ROUNDOFF[out.dtype] * ref[touched].norm().item()
               + terms * _ROUNDOFF[torch.float32] * _magnitude(case, args)[touched].norm().item())
    err = (out64 - ref)[touched].norm().item()
    return "" if err <= allowed else f"{problem}; absolute {err:.3e} > {allowed:.3e} allowing for rounding"


def _specified_columns(args: dict) -> torch.Tensor:
    """The output columns fold_linear must compute: every one without slot windows; with them the base rows' and,
    where seg_indptr ascends within int32 (build_segments' form), the used slots' (seg_indptr[s + 1] >
    seg_indptr[s]); the others are unspecified (the CUDA kernel skips them, garbage only chooses which)."""
    n = args["weight"].shape[0]
    keep = torch.ones(n, dtype=torch.bool)
    if args.get("seg_indptr") is None:
        return keep
    seg, rows = args["seg_indptr"].tolist(), args["slot_rows"]
    base = n - (len(seg) - 1) * rows
    keep[base:] = False
    if all(0 <= a <= b <= INT32_MAX for a, b in zip(seg, seg[1:])):
        for s in range(len(seg) - 1):
            if seg[s + 1] > seg[s]:
                keep[base + s * rows:base + (s + 1) * rows] = True
    return keep


def _compare_linear(case: Case, args: dict, out: torch.Tensor) -> str:
    """fold_linear's output against the float64 product: its shape and dtype, and the relative error within the
    dtype's tolerance widened by the rounding of the output's dtype and of the float32 accumulation over K."""
    ref = reference.fold_linear(args["x"], args["weight"], args["bias"])
    if out.shape != ref.shape or out.dtype != args["x"].dtype:
        return f"output {out.dtype}{list(out.shape)}, expected {args['x'].dtype}{list(ref.shape)}"
    mag = reference.fold_linear(args["x"].abs(), args["weight"].abs(),
                                args["bias"].abs() if args["bias"] is not None else None)
    keep = _specified_columns(args)
    ref, mag, out = ref[..., keep], mag[..., keep], out[..., keep]
    allowed = (testing.TOLERANCE[case.dtype] * ref.norm().item() + _ROUNDOFF[out.dtype] * ref.norm().item()
               + args["x"].shape[-1] * _ROUNDOFF[torch.float32] * mag.norm().item())
    err = (out.cpu().double() - ref).norm().item()
    return "" if err <= allowed else f"absolute error {err:.3e} > {allowed:.3e} against the float64 product"


def _key(v: torch.Tensor) -> Tuple:
    """Which storage v lives in (empty storages all have address 0: one key per dtype and device for them)."""
    return (v.untyped_storage().data_ptr(), v.dtype, v.device)


@dataclasses.dataclass
class _Storage:
    """One memory block the call can reach: the arguments that live in it, a view of all of it, its bytes before."""
    names: List[str]
    live: torch.Tensor
    before: torch.Tensor


def _snapshot(kwargs: dict) -> Dict[Tuple, _Storage]:
    """Every tensor argument's whole storage (not just the elements it shows: padding, a pool's other slots, the
    other columns of a shared GEMM output), one copy per storage."""
    out: Dict[Tuple, _Storage] = {}
    for name, v in kwargs.items():
        if not isinstance(v, torch.Tensor) or v.device.type == "meta":
            continue
        key = _key(v)
        if key in out:
            out[key].names.append(name)
        else:
            live = _storage(v)
            out[key] = _Storage([name], live, live.clone())
    return out


def _before(storages: Dict[Tuple, _Storage], v: torch.Tensor) -> torch.Tensor:
    """v as it was before the call (a view of its storage's copy)."""
    return torch.as_strided(storages[_key(v)].before, v.shape, v.stride(), v.storage_offset())


def judge(case: Case, call: Callable[[], object], debug: bool) -> Tuple[str, str]:
    """Run `call` (the op on one backend) and classify it: ("OK" | "ERROR" | "FAIL", detail)."""
    y = case.kwargs.get("y")
    storages = _snapshot(case.kwargs)
    expect_debug_error = debug and not case.error_names and not case.debug_clean
    try:
        result = call()
    except Exception as exc:  # classified below: every exception is an outcome to judge
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for st in storages.values():
            if not _bitwise_equal(st.live, st.before):
                return "FAIL", f"{'/'.join(st.names)} changed by a call that raised {type(exc).__name__}: {message}"
        if case.error_names:
            if isinstance(exc, (ValueError, TypeError)) and _names_argument(message, case.op, case.error_names):
                return "ERROR", message
            return "FAIL", f"expected an error naming {'/'.join(case.error_names)}, got {type(exc).__name__}: {message}"
        if expect_debug_error and isinstance(exc, ValueError) and message.startswith("LORA_OPS_DEBUG: "):
            return "ERROR", message
        return "FAIL", f"valid call raised {type(exc).__name__}: {message}"
    if case.error_names:
        return "FAIL", f"accepted an invalid {'/'.join(case.error_names)}"
    if expect_debug_error:
        return "FAIL", "LORA_OPS_DEBUG=1 accepted metadata it must reject"
    if case.op == "fold_linear":
        args = {k: _cpu(v) for k, v in case.kwargs.items()}
        problem = _compare_linear(case, args, result)
        if problem:
            return "FAIL", problem
    elif case.op == "build_segments":
        want = reference.build_segments(case.kwargs["token_lora"].cpu(), case.kwargs["num_slots"])
        for name, g, w in zip(("token_indices", "seg_indptr", "seg_lora"), result, want):
            if g.dtype != torch.int32 or g.device != case.kwargs["token_lora"].device or not torch.equal(g.cpu(), w):
                return "FAIL", f"{name} differs from the oracle"
    else:
        # The oracle sees the arguments as they were before the call (h may share y's storage).
        args = {k: _cpu(_before(storages, v)) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
        problem = _compare(case, args, y, args["y"], getattr(reference, case.op)(**args))
        if problem:
            return "FAIL", problem
    y_key = _key(y) if y is not None else None
    for key, st in storages.items():
        if key != y_key:
            if not _bitwise_equal(st.live, st.before):
                return "FAIL", f"{'/'.join(st.names)} changed by the call"
            continue
        outside = torch.ones(st.live.shape, dtype=torch.bool)  # y's own elements were judged above
        outside[_offsets(y).reshape(-1)] = False
        outside = outside.to(st.live.device)
        if not _bitwise_equal(st.live[outside], st.before[outside]):
            held = ", ".join(n for n in st.names if n != "y")
            return "FAIL", "elements of y's storage outside y changed" + (f" (it holds {held} too)" if held else "")
    return "OK", ""
