"""Random calls of the three ops, one per case seed, and the judgement of one call on one backend.

A case is fully determined by its seed (random.Random for the structure, torch.Generator for the data) and the
device, so any case can be rebuilt anywhere from the seed printed in a report. It draws shapes (zeros included),
dtypes, strides (x/y row strides, y as a column slice of a wider tensor, weights as slices of a pool or expanded,
strided or expanded lora_scales), metadata from valid to garbage (every index tensor int32 or int64, sometimes a
strided view, values up to ±2^40, reversed and overlapping seg_indptr ranges), and in a share of the cases one
invalid host argument, whose error must name it.

Outcomes of one call (docs/design.md §2): OK (matches the float64 oracle within the dtype's tolerance, every element the
oracle leaves alone bitwise unchanged, the rest of y's storage too), ERROR (an expected error that names the
argument, y bitwise unchanged), FAIL (anything else: a wrong result, a missed or unexpected error, an error that
names no argument or left y changed). CRASH and HANG are decided by the parent process (run.py).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from lora_ops import reference, testing

OPS = ("sgmv", "grouped_gemm", "build_segments")
HALF = (torch.float16, torch.bfloat16)
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


@dataclasses.dataclass
class Case:
    seed: int
    device: str
    op: str
    kwargs: dict
    dtype: torch.dtype = torch.float32  # tolerance class: x's dtype (sgmv), w's dtype (grouped_gemm)
    y_base: Optional[torch.Tensor] = None  # the storage y lives in (y may be a column slice of it)
    y_region: Optional[torch.Tensor] = None  # bool mask over y_base: where y is
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

    def rows_view(self, rows: int, cols: int, dtype, scale=1.0):
        """A [rows, cols] tensor: plain, a column slice of a wider one, or with a padded row stride.
        Returns (view, base, region mask over base)."""
        pad = self.rng.choice([0, 0, 3, 8]) if cols > 0 else 0
        base = self.randn(rows, cols + pad, dtype=dtype, scale=scale)
        off = self.rng.randint(0, pad)
        region = torch.zeros(base.shape, dtype=torch.bool, device=self.device)
        region[:, off:off + cols] = True
        return base[:, off:off + cols], base, region

    def pool_slice(self, shape, dtype, scale, slice_dim: int):
        """A weight [shape], sometimes a slice of a larger pool along `slice_dim` or expanded along dim 0."""
        if shape[0] > 1 and self.chance(0.1):
            return self.randn(1, *shape[1:], dtype=dtype, scale=scale).expand(*shape)
        extra = self.rng.choice([0, 0, 1, 5]) if self.chance(0.4) else 0
        big = list(shape)
        big[slice_dim] += extra
        big[0] += self.rng.choice([0, 1])
        pool = self.randn(*big, dtype=dtype, scale=scale)
        off = self.rng.randint(0, extra)
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


def _debug_clean(seg_indptr, slots, token_indices, rows, num_slots) -> bool:
    """Whether LORA_OPS_DEBUG=1 accepts this metadata (the rules of csrc/common/checks.cpp debug_validate_*)."""
    ip, sl = seg_indptr.tolist(), slots.tolist()
    idx = token_indices.tolist() if token_indices is not None else None
    positions = len(idx) if idx is not None else rows
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
    y, case.y_base, case.y_region = d.rows_view(T, N, y_dtype)
    if T > 1 and d.chance(0.08):
        x = d.randn(1, K, dtype=dtype).expand(T, K)
    else:
        x = d.rows_view(T, K, dtype)[0]
    lora_a = d.pool_slice((L, S * R, K), dtype, 1 / max(K, 1) ** 0.5, slice_dim=1)
    lora_b = d.pool_slice((L, N, R), dtype, 1 / max(R, 1) ** 0.5, slice_dim=1)
    offsets = None
    if S > 1 or d.chance(0.3):
        cuts = sorted(d.rng.randint(0, N) for _ in range(S - 1))
        offsets = [0] + cuts + [N]
    seg = _segments(d, T, L, case)
    ranks = _sizes_tensor(d, L, R, case) if d.chance(0.5) else None
    scales = None
    if d.chance(0.6):
        values = [d.rng.uniform(0.5, 2.5) for _ in range(L)]
        if K == 0 and values and d.chance(0.5):  # an empty reduction ignores the scales, NaN included
            values[0] = float("nan")
        layout = d.rng.choice(["plain", "plain", "strided", "expanded"])
        if layout == "strided":
            scales = torch.tensor([v for v in values for _ in (0, 1)]).to(d.device)[::2]
        elif layout == "expanded" and L > 0:
            scales = torch.tensor(values[:1] + [99.0]).to(d.device)[:1].expand(L)
        else:
            scales = torch.tensor(values).to(d.device)
    scale = d.rng.choice([1.0, 0.5, -2.0]) if K > 0 else d.rng.choice([1.0, float("nan"), float("inf")])
    case.dtype = dtype
    case.kwargs = dict(y=y, x=x, lora_a=lora_a, lora_b=lora_b, seg_indptr=seg["seg_indptr"], seg_lora=seg["slots"],
                       token_indices=seg["token_indices"], lora_ranks=ranks, lora_scales=scales,
                       slice_offsets=offsets, scale=scale)


def make_grouped_gemm(d: _Draw, case: Case) -> None:
    big = 4096 if d.large else 48
    T, K, N, L = d.size(40, 3000), d.size(48, big), d.size(48, big), d.size(6, 64)
    dtype = _float_dtype(d)
    x_dtype = torch.float32 if d.chance(0.25) else dtype
    y_dtype = torch.float32 if d.chance(0.25) else dtype
    y, case.y_base, case.y_region = d.rows_view(T, N, y_dtype)
    x = d.rows_view(T, K, x_dtype)[0]
    w = d.pool_slice((L, N, K), dtype, 1 / max(K, 1) ** 0.5, slice_dim=d.rng.choice([1, 2]))
    seg = _segments(d, T, L, case)
    n_sizes = _sizes_tensor(d, L, N, case) if d.chance(0.4) else None
    k_sizes = _sizes_tensor(d, L, K, case) if d.chance(0.4) else None
    alpha = d.rng.choice([1.0, 0.5, -1.5]) if K > 0 else d.rng.choice([1.0, float("nan")])
    case.dtype = dtype
    case.kwargs = dict(y=y, x=x, w=w, seg_indptr=seg["seg_indptr"], seg_weight=seg["slots"],
                       token_indices=seg["token_indices"], n_sizes=n_sizes, k_sizes=k_sizes, alpha=alpha,
                       accumulate=d.chance(0.6))


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
    slot_name = "seg_lora" if case.op == "sgmv" else "seg_weight"
    common = [
        (("y",), lambda k: {"y": k["y"][:, :, None]}),
        (("x",), lambda k: {"x": k["x"].reshape(-1)}),
        (("y", "x"), lambda k: {"y": d.randn(k["y"].shape[0] + 1, k["y"].shape[1], dtype=k["y"].dtype)}),
        (("x",), lambda k: _maybe({"x": _transposed(k["x"])})),
        (("y",), lambda k: _maybe({"y": _transposed(k["y"])})),
        (("y",), lambda k: {"y": d.randn(1, k["y"].shape[1], dtype=k["y"].dtype).expand(k["y"].shape)}
         if k["y"].shape[0] > 1 and k["y"].shape[1] > 0 else None),
        (("x",), lambda k: {"x": k["x"].to(other_dev)}),
        (("seg_indptr",), lambda k: {"seg_indptr": k["seg_indptr"].to(other_dev)}),
        (("seg_indptr",), lambda k: {"seg_indptr": k["seg_indptr"].float()}),
        (("seg_indptr",), lambda k: {"seg_indptr": k["seg_indptr"][:, None]}),
        (("seg_indptr",), lambda k: {"seg_indptr": k["seg_indptr"][:0], slot_name: k[slot_name][:0]}),
        ((slot_name,), lambda k: {slot_name: torch.cat([k[slot_name], k[slot_name].new_zeros(1)])}),
        ((slot_name,), lambda k: {slot_name: i16(k[slot_name])}),
        (("token_indices",), lambda k: {"token_indices": torch.zeros(3, device=d.device)}),
        (("token_indices",), lambda k: {"token_indices": torch.zeros(2, 2, dtype=torch.int32, device=d.device)}),
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
            (("lora_ranks",), lambda k: {"lora_ranks": torch.zeros(L + 1, dtype=torch.int32, device=d.device)}),
            (("lora_ranks",), lambda k: {"lora_ranks": torch.zeros(L, device=d.device)}),
            (("lora_scales",), lambda k: {"lora_scales": torch.ones(L, dtype=torch.float64, device=d.device)}),
            (("lora_scales",), lambda k: {"lora_scales": torch.ones(L + 2, device=d.device)}),
            (("lora_scales",), lambda k: {"lora_scales": torch.ones(L, 1, device=d.device)}),
            (("lora_scales",), lambda k: {"lora_scales": torch.ones(L).to(other_dev)}),
        ]
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


def make_case(seed: int, device: str, large: bool = False, invalid_share: float = 0.25) -> Case:
    d = _Draw(seed, device, large)
    op = d.rng.choices(OPS, weights=[5, 4, 1])[0]
    case = Case(seed=seed, device=device, op=op, kwargs={})
    {"sgmv": make_sgmv, "grouped_gemm": make_grouped_gemm, "build_segments": make_build_segments}[op](d, case)
    if d.chance(invalid_share):
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
    """The oracle's change with every term made non-negative (|x|, |weights|, |scales|): what the float32
    accumulation's rounding error scales with."""
    mag = {k: v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    mag["y"] = torch.zeros_like(args["y"])
    if case.op == "sgmv":
        mag["scale"] = abs(mag["scale"])
    else:
        mag["alpha"], mag["accumulate"] = abs(mag["alpha"]), True
    return getattr(reference, case.op)(**mag)


def _compare(case: Case, args: dict, out: torch.Tensor, before: torch.Tensor, ref: torch.Tensor) -> str:
    """testing.check_against_reference, with the relative error on the change (out - before) widened by the
    rounding a correct kernel cannot avoid: y's own (storing y in half precision, with |y| much larger than the
    change, alone exceeds the dtype's tolerance on the change) and the float32 accumulation's over K + R terms
    when they cancel. Fuzzed scales, ranks and sizes make both common; a wrong row, slot or scale is far above."""
    problem = testing.check_against_reference(out, before, ref, case.dtype)
    if not problem.startswith("relative error"):
        return problem
    out64, before64, ref = out.cpu().double(), before.cpu().double(), ref.cpu()
    touched = ~((ref == before64) | (ref.isnan() & before64.isnan()))
    change = (ref - torch.where(before64.isnan(), 0, before64))[touched].norm().item()
    terms = args["x"].shape[1] + (args["lora_b"].shape[2] if case.op == "sgmv" else 0)
    allowed = (testing.TOLERANCE[case.dtype] * change + _ROUNDOFF[out.dtype] * ref[touched].norm().item()
               + terms * _ROUNDOFF[torch.float32] * _magnitude(case, args)[touched].norm().item())
    err = (out64 - ref)[touched].norm().item()
    return "" if err <= allowed else f"{problem}; absolute {err:.3e} > {allowed:.3e} allowing for rounding"


def judge(case: Case, call: Callable[[], object], debug: bool) -> Tuple[str, str]:
    """Run `call` (the op on one backend) and classify it: ("OK" | "ERROR" | "FAIL", detail)."""
    y = case.kwargs.get("y")
    snapshot = {k: v.clone() for k, v in (("y_base", case.y_base), ("y", y)) if isinstance(v, torch.Tensor)
                and v.device.type != "meta"}
    expect_debug_error = debug and not case.error_names and not case.debug_clean
    try:
        result = call()
    except Exception as exc:  # classified below: every exception is an outcome to judge
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for name, before in snapshot.items():
            after = case.y_base if name == "y_base" else y
            if not _bitwise_equal(after, before):
                return "FAIL", f"{name} changed by a call that raised {type(exc).__name__}: {message}"
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
    if case.op == "build_segments":
        want = reference.build_segments(case.kwargs["token_lora"].cpu(), case.kwargs["num_slots"])
        for name, g, w in zip(("token_indices", "seg_indptr", "seg_lora"), result, want):
            if g.dtype != torch.int32 or g.device != case.kwargs["token_lora"].device or not torch.equal(g.cpu(), w):
                return "FAIL", f"{name} differs from the oracle"
        return "OK", ""
    oracle = getattr(reference, case.op)
    args = {k: _cpu(v) for k, v in case.kwargs.items()}
    args["y"] = snapshot["y"].cpu()
    ref = oracle(**args)
    problem = _compare(case, args, y, snapshot["y"], ref)
    if problem:
        return "FAIL", problem
    outside = ~case.y_region
    if not _bitwise_equal(case.y_base[outside], snapshot["y_base"][outside]):
        return "FAIL", "elements of y's storage outside y changed"
    return "OK", ""
