"""The op bench: sgmv, lora_expand, grouped_gemm and build_segments on every available backend against baselines
(docs/design.md §6): a PyTorch per-adapter (per-group) loop, gather+bmm, and torch._grouped_mm where present, and
for sgmv lora_ops.grouped_gemm twice (the two-kernel composition the fused sgmv must beat) and on CUDA vLLM's Triton
LoRA ops where its peer is built (lora_ops.bench.peers).

Every implementation is checked against the float64 oracle on the first and last input sets before it is timed,
and on CUDA so is one replay of the graph that is timed; a wrong or crashing implementation of lora_ops (or a
wrong baseline) is a failure that makes the bench exit non-zero. On CUDA each case is timed as CUDA-graph replay
and eagerly, rotating among input sets whose calls together touch at least twice the L2 (each layer of a real
model has its own activations and weights, so they are not L2-resident; the segment metadata, built once per step
for all layers, is shared), at least 20 of them (one per call of a replay) unless a memory budget (a quarter of
the device memory free to the bench) holds fewer: a case the budget keeps under twice the L2 is logged, and every
record says its sets and rotated_bytes (sets × the bytes one call touches). Each is reported as µs, GB/s and % of the
memory roofline: minimum bytes (x read, the true-rank rows of the adapters present, y read and written) over the
device-to-device copy bandwidth measured in the same run. grouped_gemm also reports TFLOP/s (2·T·N·K), against
torch._grouped_mm (bf16 only: its other dtypes are recorded as unavailable, with torch's error), which is checked
storing its output into y and, where grouped_gemm only stores (y = output), timed alone on an output of its own
(whose replay is not checked).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import lora_ops
from lora_ops import backends, op_table, reference, routes, testing

from . import peers
from .names import FORCED_PREFILL, OURS
from .timing import MIN_CALLS, cuda_runner, time_cpu, time_cuda, time_interleaved


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    adapters: int
    rank: int
    K: int = 4096
    N: int = 4096
    slices: int = 1
    pool_rank: Optional[int] = None  # pool's max rank R (default: rank)
    pool_slots: int = 32
    slice_widths: Optional[Tuple[int, ...]] = None  # default: N split evenly (fused QKV names its GQA widths)

    def __post_init__(self):
        if self.slice_widths is not None and (len(self.slice_widths) != self.slices
                                              or sum(self.slice_widths) != self.N):
            raise ValueError(f"Case: slice_widths {self.slice_widths} must be {self.slices} widths summing to N")

    @property
    def R(self):
        return self.pool_rank or self.rank

    @property
    def offsets(self) -> List[int]:
        """slice_offsets: [0, ..., N]."""
        widths = self.slice_widths or [self.N // self.slices] * (self.slices - 1) + [
            self.N - (self.slices - 1) * (self.N // self.slices)]
        return [sum(widths[:s]) for s in range(self.slices)] + [self.N]

    @property
    def ranks_passed(self) -> bool:
        """Whether the ops get lora_ranks: only where an adapter's rank is below the pool's."""
        return self.rank != self.R


# Fused QKV of a Llama-3-8B-like layer: 32 query heads and 8 key/value heads of 128 (GQA).
QKV_WIDTHS = (4096, 1024, 1024)

# The decode and prefill target tables (H200, bf16, K = N = 4096, 32-slot pool, one slice), then the decode
# step's own module shapes, true-rank cost, fused QKV, wider layers and rank 128.
GPU_CASES = [Case(1, 1, 16), Case(16, 4, 16), Case(64, 16, 16), Case(256, 32, 16), Case(256, 32, 64),
             Case(4096, 4, 16), Case(16384, 8, 16), Case(16384, 8, 64),
             Case(32, 8, 16, K=14336, N=4096), Case(32, 8, 16, K=4096, N=28672, slices=2),  # down_proj, gate_up
             Case(256, 32, 8, pool_rank=8), Case(256, 32, 8, pool_rank=64),                 # true-rank cost
             Case(64, 16, 16, K=4096, N=6144, slices=3, slice_widths=QKV_WIDTHS),                 # fused QKV
             Case(1024, 8, 16, K=4096, N=6144, slices=3, slice_widths=QKV_WIDTHS),
             Case(32, 8, 32, K=8192, N=8192), Case(32, 8, 16, K=16384, N=16384), Case(4096, 8, 128)]
CPU_CASES = [Case(1, 1, 16, K=1024, N=1024), Case(8, 4, 16, K=1024, N=1024), Case(32, 8, 16, K=1024, N=1024),
             Case(8, 4, 8, K=1024, N=1024, pool_rank=64)]


def parse_sgmv_cases(text: str) -> List[Case]:
    """--sgmv-cases: comma-separated T/ADAPTERS/RANK[/SLICES] (K = N = 4096 for one slice; 3 slices are the fused QKV
    of QKV_WIDTHS, N = 6144), e.g. 2048/8/128,3072/8/128,1024/8/16/3."""
    cases = []
    for item in text.split(","):
        fields = item.strip().split("/")
        if len(fields) not in (3, 4) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"{item!r}: expected T/ADAPTERS/RANK[/SLICES] of positive integers")
        T, adapters, rank, slices = (int(f) for f in fields + ["1"] * (4 - len(fields)))
        if slices not in (1, 3):
            raise ValueError(f"{item!r}: SLICES is 1 or 3 (the fused QKV)")
        case = (Case(T, adapters, rank) if slices == 1 else
                Case(T, adapters, rank, K=4096, N=sum(QKV_WIDTHS), slices=3, slice_widths=QKV_WIDTHS))
        if adapters > case.pool_slots:
            raise ValueError(f"{item!r}: at most {case.pool_slots} adapters (the pool's slots)")
        cases.append(case)
    return cases


class Problem:
    """One input set of a case on a device: pool, batch, segments, and the baselines' host-side metadata.

    Sets made with `like=` share its batch composition and segment tensors, as every layer of a model shares the
    step's one build_segments output, while their activations and adapter weights are their own."""

    def __init__(self, case: Case, dtype, device, seed, like: Optional["Problem"] = None):
        if like is None:
            gen = torch.Generator().manual_seed(seed)
            slots = torch.randperm(case.pool_slots, generator=gen)[:case.adapters].tolist()
            token_lora = testing.random_token_slots(case.T, slots, gen)
        else:
            slots, token_lora = like.slots, like.token_lora.cpu()
        offsets = case.offsets
        # As the serving layer calls the ops: no ranks while every adapter has the pool's rank (op_table's
        # true_ranks axis tells the two calls apart)
        ranks = [case.rank] * case.pool_slots if case.ranks_passed else None
        # drawn on the device: a small case rotates among hundreds of sets
        values = torch.Generator(device).manual_seed(seed)
        self.p = testing.make_sgmv(token_lora, num_slots=case.pool_slots, K=case.K, N=case.N, max_rank=case.R,
                                   dtype=dtype, device=device, gen=values, ranks=ranks, scales=True,
                                   slice_offsets=offsets if case.slices > 1 else None)
        self.slots = slots
        if like is not None:
            self.token_lora, self.rows_by_slot = like.token_lora, like.rows_by_slot
            self.p.token_indices, self.p.seg_indptr, self.p.seg_lora = \
                like.p.token_indices, like.p.seg_indptr, like.p.seg_lora
            self.p.lora_ranks, self.p.lora_scales = like.p.lora_ranks, like.p.lora_scales
        else:
            self.token_lora = token_lora.to(device)
            seg = lora_ops.build_segments(self.token_lora, case.pool_slots)
            self.p.token_indices, self.p.seg_indptr, self.p.seg_lora = seg
            self.rows_by_slot = [(s, (token_lora == s).nonzero().flatten().to(device)) for s in slots]
        self.offsets = offsets
        self.case = case
        self.peer = {}  # the peers' (and gg_composed's) own layouts and metadata of this set, made on their first
        # (eager) call

    def args(self, y):
        return self.p.args(y)

    def touched_bytes(self) -> int:
        """The bytes one call reads or writes, each once: x, the true-rank rows of the adapters present (every
        case has a row per adapter), y. The shared metadata is left out: a model's layers keep it L2-hot too."""
        c, p = self.case, self.p
        e = p.x.element_size()
        return c.T * c.K * e + c.adapters * c.rank * (c.slices * c.K + c.N) * e + c.T * c.N * p.y.element_size()

    def min_bytes(self) -> int:
        """The bytes one call must move: the touched bytes, y both read and written."""
        return self.touched_bytes() + self.case.T * self.case.N * self.p.y.element_size()

    def allocated_bytes(self) -> int:
        """Device bytes a set holds of its own (the whole pool), with the copy of y that its timing writes."""
        p = self.p
        return _storage_bytes(p.x, p.lora_a, p.lora_b, p.y) + _storage_bytes(p.y)


def _storage_bytes(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


# ---- implementations: each is f(problem, y) -> None, adding the LoRA delta into y ----

def _ours(module, op: str):
    """lora_ops' `op` through `module` (lora_ops.ops: the dispatcher; lora_ops.triton: Triton's kernel)."""
    fn = getattr(module, op)

    def run(pb, y):
        fn(*pb.args(y))
    return run


def _our_implementations(device, op: str) -> Dict[str, Callable]:
    """Every backend of lora_ops that serves `op` on the device (a failure of one of these fails the bench)."""
    if device == "cpu":
        return {"cpu": _ours(lora_ops.ops, op)}
    impls = {}
    if backends.cuda_served_by.get(op) == "cuda":
        impls["cuda"] = _ours(lora_ops.ops, op)
    if "triton" not in backends.unavailable:
        import lora_ops.triton as lt
        impls["triton"] = _ours(lt, op)
    return impls


@contextlib.contextmanager
def environment(variables: Dict[str, str]):
    """`variables` set in os.environ inside the block; each is restored, or removed, after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def forced_prefill(variables: Dict[str, str]) -> Callable:
    """lora_ops.sgmv with `variables` set around each call (FORCED_PREFILL), beside the default. The C++ op reads them
    on every call (a graph keeps the kernel it captured); setting and restoring them costs the eager record a few µs
    of host time."""
    def run(pb: Problem, y):
        with environment(variables):
            lora_ops.sgmv(*pb.args(y))
    return run


def torch_loop(pb: Problem, y):
    """PEFT's mixed batch: per adapter, gather its rows, two matmuls, scatter-add."""
    p = pb.p
    R = pb.case.R
    for slot, rows in pb.rows_by_slot:
        xs = p.x.index_select(0, rows)
        coef = p.lora_scales[slot] * p.scale
        for s in range(len(pb.offsets) - 1):
            lo, hi = pb.offsets[s], pb.offsets[s + 1]
            h = xs @ p.lora_a[slot, s * R: s * R + pb.case.rank].T
            y[:, lo:hi].index_add_(0, rows, ((h @ p.lora_b[slot, lo:hi, :pb.case.rank].T) * coef).to(y.dtype))


def gather_bmm(pb: Problem, y):
    """Per-token weight gather + bmm (the simple BGMV); every row is assumed to have an adapter."""
    p = pb.p
    R = pb.case.R
    slot = pb.token_lora.long()
    coef = (p.lora_scales[slot] * p.scale)[:, None, None]
    for s in range(len(pb.offsets) - 1):
        lo, hi = pb.offsets[s], pb.offsets[s + 1]
        a = p.lora_a[slot, s * R: s * R + pb.case.rank]            # [T, r, K]
        b = p.lora_b[slot, lo:hi, :pb.case.rank]                   # [T, n, r]
        h = torch.bmm(p.x[:, None, :], a.transpose(1, 2))          # [T, 1, r]
        y[:, lo:hi] += torch.bmm((h * coef).to(b.dtype), b.transpose(1, 2))[:, 0].to(y.dtype)


def grouped_mm(pb: Problem, y):
    """torch._grouped_mm shrink + expand over rows sorted by slot (bf16 intermediate), then scatter-add."""
    p = pb.p
    R = pb.case.R
    idx = p.token_indices.long()
    offs = p.seg_indptr[1:]
    xs = p.x.index_select(0, idx)
    coef = (p.lora_scales[pb.token_lora.long()] * p.scale)[idx, None]
    r = pb.case.rank  # the true rank: rows beyond it in a larger pool are not part of the adapter
    for s in range(len(pb.offsets) - 1):
        lo, hi = pb.offsets[s], pb.offsets[s + 1]
        h = torch._grouped_mm(xs, p.lora_a[:, s * R:s * R + r].transpose(1, 2), offs=offs)
        d = torch._grouped_mm(h, p.lora_b[:, lo:hi, :r].transpose(1, 2), offs=offs)
        y[:, lo:hi].index_add_(0, idx, (d * coef).to(y.dtype))


@functools.lru_cache(maxsize=None)
def _serving_op_table() -> Optional[dict]:
    """The op table the serving dispatch installs on this GPU (op_table.install_default; none without Triton), read
    once a process: the op bench runs with it off."""
    path = op_table.default_path() if "triton" not in backends.unavailable else None
    return None if path is None else op_table.load(path)


def gg_halves(table: Optional[dict], T: int, K: int, rank: int, widths: List[int]) -> Tuple[Callable, List[Callable]]:
    """The grouped_gemm of gg_composed's shrink (T rows, K -> rank) and of each slice's expand (rank -> its width),
    on the backend the op table gives its regime, as the serving dispatch would (the op bench runs with the table
    off): Triton's kernel or the C++ one (lora_ops.ops: the CPU's on the CPU, and every one without a table)."""
    if table is None:
        return lora_ops.ops.grouped_gemm, [lora_ops.ops.grouped_gemm] * len(widths)
    import lora_ops.triton as lt
    pick = lambda n, k: lt.grouped_gemm if op_table.choice(table, "grouped_gemm", positions=T, n=n, k=k) == "triton" \
        else lora_ops.ops.grouped_gemm
    return pick(rank, K), [pick(n, rank) for n in widths]


def gg_composed(pb: Problem, y):
    """sgmv as grouped_gemm twice a slice (h through memory in float32, the rows' coefficients multiplied in
    between: grouped_gemm has one alpha), each half on its op-table backend (gg_halves): what the fused sgmv
    kernels, which keep h on chip, gain over the project's own two-kernel composition. At prefill h is ~1% of the
    bytes, so only the second launch and h's round trip separate them. As the bench's cases have them: every row on
    a slot of the pool, every slot of the case's rank."""
    p = pb.p
    R, r = pb.case.R, pb.case.rank  # the true rank: rows beyond it in a larger pool are not part of the adapter
    if "gg_composed" not in pb.peer:  # made on the first call, which is eager (checked before it is timed)
        halves = gg_halves(_serving_op_table() if p.x.is_cuda else None, p.x.shape[0], p.x.shape[1], r,
                           [hi - lo for lo, hi in zip(pb.offsets, pb.offsets[1:])])
        pb.peer["gg_composed"] = (halves, (p.lora_scales[pb.token_lora.long()] * p.scale)[:, None])
    (shrink, expands), coef = pb.peer["gg_composed"]
    for s, expand in enumerate(expands):
        lo, hi = pb.offsets[s], pb.offsets[s + 1]
        h = torch.empty(p.x.shape[0], r, dtype=torch.float32, device=y.device)
        shrink(h, p.x, p.lora_a[:, s * R:s * R + r], p.seg_indptr, p.seg_lora, p.token_indices, accumulate=False)
        h.mul_(coef)
        expand(y[:, lo:hi], h, p.lora_b[:, lo:hi, :r], p.seg_indptr, p.seg_lora, p.token_indices)


def vllm(pb: Problem, y):
    """vLLM's Triton LoRA ops, lora_shrink then lora_expand, in vLLM's layout (lora_ops.bench.peers)."""
    ops = peers.vllm_ops()[0]
    if "vllm" not in pb.peer:
        p = pb.p
        pb.peer["vllm"] = (peers.VllmLayout(p.lora_a, p.lora_b, p.lora_ranks, p.lora_scales, p.scale, pb.offsets),
                           peers.VllmBatch(ops, pb.token_lora, pb.case.pool_slots))
    layout, batch = pb.peer["vllm"]
    peers.add_lora_linear(ops, y, pb.p.x, layout, batch)


def implementations(device) -> Dict[str, Callable]:
    impls = _our_implementations(device, "sgmv")
    if "cuda" in impls:
        impls.update({name: forced_prefill(variables) for name, variables in FORCED_PREFILL.items()
                      if name == "cuda-mma" or backends.sm90_kernels_run()})
    impls["torch_loop"] = torch_loop
    impls["gather_bmm"] = gather_bmm
    impls["gg_composed"] = gg_composed
    if device != "cpu" and hasattr(torch, "_grouped_mm"):
        impls["grouped_mm"] = grouped_mm
    if device != "cpu" and peers.vllm_ops()[0] is not None:
        impls["vllm"] = vllm
    return impls


def host_overhead_us(device, n=2000) -> float:
    """Enqueue cost of one eager lora_ops.sgmv call on a problem too small to keep the GPU busy."""
    pb = Problem(Case(1, 1, 8, K=64, N=64, pool_slots=4), torch.bfloat16, device, seed=0)
    args = pb.p.args()
    for _ in range(100):
        lora_ops.sgmv(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        lora_ops.sgmv(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def n_sets(touched_bytes: int, allocated_bytes: int, l2_bytes: int, budget_bytes: int) -> int:
    """How many input sets a CUDA case rotates among: enough that their calls together touch at least twice the L2
    (a real model's layers each have their own activations and weights), and at least MIN_CALLS (a graph replay
    then runs each set once, so that it can be checked against the oracle), as many of those as fit in the memory
    budget (each set allocates its whole problem), and at least one."""
    wanted = max(MIN_CALLS, -(-2 * l2_bytes // max(touched_bytes, 1)))
    return max(1, min(wanted, budget_bytes // max(allocated_bytes, 1)))


def _input_sets(first, another: Callable[[int], object], l2_bytes, device, log):
    """The sets a case rotates among (on the CPU `first` alone; on CUDA n_sets of them, another(seed) making the
    rest) and the record fields that say what they rotate through: their number, and rotated_bytes, the bytes
    their calls touch together (under twice the L2: partly L2-resident, optimistic µs). The memory budget is a
    quarter of the device memory free to the bench, the caching allocator's idle blocks included (free memory
    alone would shrink after each large case, and the sets would depend on the cases' order)."""
    touched = first.touched_bytes()
    n = 1
    if device != "cpu":
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = (torch.cuda.mem_get_info(device)[0] + idle) // 4
        n = n_sets(touched, first.allocated_bytes(), l2_bytes, budget)
        if n * touched < 2 * l2_bytes:
            log(f"  under 2x the L2: {n} sets touch {n * touched / 2**20:.1f} MiB of {2 * l2_bytes / 2**20:.0f} MiB "
                f"({first.allocated_bytes() / 2**20:.0f} MiB each, budget {budget / 2**30:.1f} GiB): µs optimistic")
    return [first] + [another(seed) for seed in range(2, n + 1)], {"sets": n, "rotated_bytes": n * touched}


class WrongReplay(Exception):
    """A graph replay's output that does not match the float64 oracle."""


def _check_eagerly(fn: Callable, sets: list, y_of: Callable, refs: dict, inputs_dtype) -> str:
    """'' if fn(problem, y) is right on each set in refs (set index -> its oracle), else what is wrong."""
    for i, ref in refs.items():
        before = y_of(sets[i]).clone()
        y = before.clone()
        fn(sets[i], y)
        bad = testing.check_against_reference(y, before, ref, inputs_dtype)
        if bad:
            return f"set {i + 1} of {len(sets)}: {bad}"
    return ""


def _replay_check(sets: list, ys: list, y_of: Callable, refs: dict, inputs_dtype) -> Callable:
    """time_cuda's check: the y of each set in refs (set index -> its oracle) reset, one replay, each compared."""
    def check(replay):
        for i in refs:
            ys[i].copy_(y_of(sets[i]))
        replay()
        for i, ref in refs.items():
            bad = testing.check_against_reference(ys[i], y_of(sets[i]), ref, inputs_dtype)
            if bad:
                raise WrongReplay(f"set {i + 1} of {len(sets)}: {bad}")
    return check


def _measure(op: str, row: dict, impls: Dict[str, Callable], sets: list, y_of: Callable, oracle: Callable,
             inputs_dtype, min_bytes: int, flops: Optional[int], device, copy_tbps, records: List[dict],
             failures: List[str], log, timed_alone: Optional[Dict[str, Callable]] = None) -> None:
    """Checks each implementation on the first and last input sets against the float64 oracle, then times them
    over all sets (graph replay and eager on CUDA), one record per mode; on CUDA one replay of each timed graph is
    checked on the same sets first. `impls` are f(problem, y) -> None writing into y; y_of(problem) is the
    problem's initial y; oracle(problem) its float64 result. A wrong result, eager or replayed, is a failure and
    the implementation is not timed. timed_alone: per implementation, f(problem) to time instead, once its
    f(problem, y) passed the check (a baseline that makes its own output, timed without storing it into y, so
    its replay is not checked; its records say timed_alone=True).

    On CUDA every implementation and mode that passed is timed in turn, round after round (time_interleaved), so
    that a drift of the clocks during the case moves them alike and their ratios hold: timed one after another,
    two implementations 1-3% apart could trade places with the drift (the decode step measured 2%)."""
    timed_alone = timed_alone or {}

    def wrong(name: str, detail: str) -> None:
        """A wrong result: a failure of the run, but for a peer (measured, not trusted), a record saying so."""
        if name in peers.PEERS:
            records.append(dict(op=op, backend=name, mode="graph", us=None, unavailable=f"wrong{detail}", **row))
        else:
            failures.append(f"{op} {name} {row}: WRONG vs the float64 oracle{detail}")
    refs = {i: oracle(sets[i]) for i in sorted({0, len(sets) - 1})}  # two sets: the oracle is slow on big cases
    runners = {}  # (name, mode) -> (run, calls a run makes)
    for name, fn in impls.items():
        try:
            bad = _check_eagerly(fn, sets, y_of, refs, inputs_dtype)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:90]}"
            if name in OURS:
                failures.append(f"{op} {name} {row}: raised {msg}")
            else:
                records.append(dict(op=op, backend=name, mode="graph", us=None, unavailable=msg, **row))
            log(f"  {name:<11} {'FAILED' if name in OURS else 'unavailable'}: {msg}")
            continue
        if bad:
            wrong(name, f": {bad}")
            log(f"  {name:<11} WRONG vs float64 oracle: {bad}; not timed")
            continue
        # partial binds this implementation now: the runners are timed after the loop, where a lambda over the loop's
        # fn would call the last implementation's (every eager record of session 42's interleaved bench did)
        check = None
        if name in timed_alone:
            calls = [functools.partial(timed_alone[name], pb) for pb in sets]
        else:
            ys = [y_of(pb).clone() for pb in sets]
            calls = [functools.partial(fn, pb, yy) for pb, yy in zip(sets, ys)]
            check = _replay_check(sets, ys, y_of, refs, inputs_dtype)
        if device == "cpu":
            runners[name, "eager"] = calls[0], None
            continue
        for mode in ("graph", "eager"):
            graph = mode == "graph"
            try:
                runners[name, mode] = cuda_runner(calls, graph, check=check if graph else None)
            except WrongReplay as exc:
                wrong(name, f" after a graph replay, {exc}")
                log(f"  {name:<11} graph replay WRONG vs float64 oracle, {exc}; not timed")
                break
            except Exception as exc:  # e.g. a baseline that syncs cannot be captured
                if name in OURS:
                    failures.append(f"{op} {name} {row} {mode}: {type(exc).__name__}")
                log(f"  {name:<11} {mode}: not timed ({type(exc).__name__})")
    if device == "cpu":
        us_of = {key: time_cpu(run) for key, (run, _) in runners.items()}
    else:
        ms = time_interleaved({key: run for key, (run, _) in runners.items()}, min_ms=30.0)
        us_of = {key: ms[key] * 1e3 / runners[key][1] for key in runners}
    for name in impls:
        got = []
        for mode in ("graph", "eager"):
            if (name, mode) not in us_of:
                continue
            us = us_of[name, mode]
            gbps = min_bytes / (us * 1e-6) / 1e9
            rec = dict(op=op, backend=name, mode=mode, us=round(us, 3), gbps=round(gbps, 1),
                       pct_roofline=round(100 * gbps / (copy_tbps * 1e3), 1) if copy_tbps else None, **row)
            if flops is not None:
                rec["tflops"] = float(f"{flops / (us * 1e-6) / 1e12:.4g}")  # 4 digits: CPU runs are far below 1
            if name in timed_alone:
                rec["timed_alone"] = True
            records.append(rec)
            got.append(rec)
        if got:
            log("  " + f"{name:<11}" + "  ".join(
                f"{r['mode']} {r['us']:9.2f} us" + (f" {r['tflops']:8.4g} TFLOP/s" if "tflops" in r else "")
                + (f" ({r['pct_roofline']}% roofline)" if r["pct_roofline"] else "") for r in got))


def _widths(case: Case) -> dict:
    """The record's slice widths, where they are not N split evenly."""
    return {"slice_widths": list(case.slice_widths)} if case.slice_widths else {}


def bench_case(case: Case, impls, dtype, device, l2_bytes, copy_tbps, records: List[dict], failures: List[str],
               log) -> None:
    if case.T < op_table.MMA_MIN_POSITIONS:  # forced there, the prefill kernels would run decode batches
        impls = {name: fn for name, fn in impls.items() if name not in FORCED_PREFILL}
    pb0 = Problem(case, dtype, device, seed=1)
    sets, rotation = _input_sets(pb0, lambda seed: Problem(case, dtype, device, seed, like=pb0), l2_bytes, device,
                                 log)
    row = {"T": case.T, "adapters": case.adapters, "rank": case.rank, "pool_rank": case.R,
           "lora_ranks": case.ranks_passed, "K": case.K, "N": case.N, "slices": case.slices, **_widths(case),
           "dtype": str(dtype).replace("torch.", ""), **rotation}
    _measure("sgmv", row, impls, sets, lambda pb: pb.p.y, lambda pb: reference.sgmv(*pb.p.args()), dtype,
             pb0.min_bytes(), None, device, copy_tbps, records, failures, log)
    del sets, pb0
    peers.release()  # the sets' vLLM layouts, which vLLM's pointer caches hold


def bench_build_segments(device, records, failures, log):
    """Each size is checked against the oracle (reference.build_segments) before it is timed."""
    for T in (1, 256, 4096, 16384):
        token_lora = torch.randint(-1, 32, (T,), dtype=torch.int32, device=device)
        fn = lambda: lora_ops.build_segments(token_lora, 32)
        want = reference.build_segments(token_lora.cpu(), 32)
        if not all(torch.equal(g.cpu().long(), w.long()) for g, w in zip(fn(), want)):
            failures.append(f"build_segments T={T}: WRONG vs the oracle")
            log(f"  build_segments T={T:<6} WRONG vs the oracle; not timed")
            continue
        for mode in (["eager"] if device == "cpu" else ["graph", "eager"]):
            us = time_cpu(fn) if device == "cpu" else time_cuda([fn], graph=(mode == "graph"))
            records.append(dict(op="build_segments", backend=backends.cuda_served_by.get("build_segments", "cpu")
                                if device != "cpu" else "cpu", mode=mode, dtype="int32", T=T, adapters=32, rank=0,
                                K=0, N=0, slices=0, us=round(us, 3), pct_roofline=None))
            log(f"  build_segments T={T:<6} {mode:<5} {us:8.2f} us")


# ---- lora_expand: the decode route's expand alone (h from the base GEMM against [W; A of every slot]) ----

# Decode steps of issue 12 (rank 16, 32-slot pool; o/down N = 4096, gate_up 2 × 14336, qkv 4096/1024/1024), then the
# rank-64 row and the fold route's largest regime (the serving layer folds up to 1024 tokens), then true-rank cost:
# adapters below the pool's rank, whose trips the kernels mask.
GPU_EXPAND_CASES = [Case(32, 32, 16), Case(32, 32, 16, N=28672, slices=2),
                    Case(32, 32, 16, N=6144, slices=3, slice_widths=QKV_WIDTHS),
                    Case(128, 32, 16), Case(64, 16, 64), Case(1024, 8, 16),
                    Case(64, 16, 16, pool_rank=64), Case(32, 32, 8, pool_rank=16)]
CPU_EXPAND_CASES = [Case(8, 4, 16, N=1024), Case(32, 8, 16, N=1024, slices=2)]


class ExpandProblem(Problem):
    """A Problem with h [T, L, S·R] (the dtype of the weights): every slot's rank vector for every row, as the fold
    route's GEMM leaves it. K plays no part (the shrink is done elsewhere): the sgmv inputs get K = 16."""

    def __init__(self, case: Case, dtype, device, seed, like: Optional["ExpandProblem"] = None):
        super().__init__(dataclasses.replace(case, K=16), dtype, device, seed, like)
        gen = torch.Generator(device).manual_seed(seed + 7919)
        self.h = torch.randn(case.T, case.pool_slots, case.slices * case.R, generator=gen, device=device).to(dtype)
        self.sorted_slots = routes.sorted_slots(self.token_lora, self.p.token_indices)

    def args(self, y):
        p = self.p
        return (y, self.h, p.lora_b, p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks, p.lora_scales,
                p.slice_offsets, p.scale)

    def touched_bytes(self) -> int:
        """Each row's window of h (its slot's true rank, per slice), the adapters' B, y."""
        c, p = self.case, self.p
        e = p.lora_b.element_size()
        return c.T * c.slices * c.rank * e + c.adapters * c.rank * c.N * e + c.T * c.N * p.y.element_size()

    def allocated_bytes(self) -> int:
        return super().allocated_bytes() + _storage_bytes(self.h)


def expand_torch_loop(pb: ExpandProblem, y):
    """Per adapter and slice: gather its rows' window of h, one matmul with B, scatter-add."""
    p, R, r = pb.p, pb.case.R, pb.case.rank
    for slot, rows in pb.rows_by_slot:
        coef = p.lora_scales[slot] * p.scale
        for s in range(len(pb.offsets) - 1):
            lo, hi = pb.offsets[s], pb.offsets[s + 1]
            h = pb.h.index_select(0, rows)[:, slot, s * R: s * R + r]
            y[:, lo:hi].index_add_(0, rows, ((h @ p.lora_b[slot, lo:hi, :r].T) * coef).to(y.dtype))


def _expand_rows_form(module):
    """lora_expand through `module` in its rows form as the fold route passes it on CUDA (no seg_indptr; positions
    in build_segments' order through token_indices, each with its slot: routes.fold_expand_rows)."""
    def run(pb, y):
        p = pb.p
        module.lora_expand(y, pb.h, p.lora_b, None, pb.sorted_slots, p.token_indices, p.lora_ranks, p.lora_scales,
                           p.slice_offsets, p.scale)
    return run


def expand_implementations(device) -> Dict[str, Callable]:
    impls = _our_implementations(device, "lora_expand")
    for name in list(impls):
        module = lora_ops.ops
        if name == "triton":
            import lora_ops.triton as module
        impls[f"{name}-rows"] = _expand_rows_form(module)
    impls["torch_loop"] = expand_torch_loop
    return impls


def bench_expand_case(case: Case, impls, dtype, device, l2_bytes, copy_tbps, records, failures, log) -> None:
    pb0 = ExpandProblem(case, dtype, device, seed=1)
    sets, rotation = _input_sets(pb0, lambda seed: ExpandProblem(case, dtype, device, seed, like=pb0), l2_bytes,
                                 device, log)
    row = {"T": case.T, "adapters": case.adapters, "rank": case.rank, "pool_rank": case.R,
           "lora_ranks": case.ranks_passed, "N": case.N, "slices": case.slices, **_widths(case),
           "dtype": str(dtype).replace("torch.", ""), **rotation}
    _measure("lora_expand", row, impls, sets, lambda pb: pb.p.y, lambda pb: reference.lora_expand(*pb.args(pb.p.y)),
             dtype, pb0.min_bytes(), None, device, copy_tbps, records, failures, log)


# ---- grouped_gemm: the segmented matmul primitive (issue 13) ----

@dataclasses.dataclass(frozen=True)
class GroupedGemmCase:
    groups: int
    M: int                 # rows per group (the groups' rows are contiguous: no token_indices)
    K: int
    N: int
    dtype: str             # w's dtype
    x_dtype: Optional[str] = None  # default: w's
    y_dtype: Optional[str] = None  # default: w's
    accumulate: bool = False
    shape: str = ""        # what the case stands for

    @property
    def T(self):
        return self.groups * self.M


def _gg_cases(groups, M, K, N, dtypes, **kw):
    return [GroupedGemmCase(groups, M, K, N, d, shape=kw.pop("shape", f"{groups}x{M}x{K}x{N}"), **kw)
            for d in dtypes]


# Issue 13's targets: G×M×K×N against torch._grouped_mm in bf16 and fp16; a LoRA shrink (n = 16, y fp32: the h of
# a rank-16 adapter) and expand (k = 16, x fp32: that h, added into y) over 16384 rows in 8 groups, at their memory
# floors (csrc/cuda/NOTES.md: 32 and 64 µs on the H200). The same two at decode size, 32 groups of one row: the op
# table's regimes up to 256 positions were not measured, and a decode step's shrink through grouped_gemm took
# ~116 µs per linear layer on the H200 (csrc/cuda/NOTES.md, session 14).
GPU_GG_CASES = (_gg_cases(8, 512, 4096, 4096, ("bfloat16", "float16"))
                + _gg_cases(64, 128, 2048, 1408, ("bfloat16", "float16"))
                + [GroupedGemmCase(8, 2048, 4096, 16, "bfloat16", y_dtype="float32", shape="LoRA shrink"),
                   GroupedGemmCase(8, 2048, 16, 4096, "bfloat16", x_dtype="float32", accumulate=True,
                                   shape="LoRA expand"),
                   GroupedGemmCase(32, 1, 4096, 16, "bfloat16", y_dtype="float32", shape="LoRA shrink, decode"),
                   GroupedGemmCase(32, 1, 16, 4096, "bfloat16", x_dtype="float32", accumulate=True,
                                   shape="LoRA expand, decode")])
CPU_GG_CASES = (_gg_cases(4, 64, 256, 256, ("bfloat16", "float32"))
                + [GroupedGemmCase(4, 128, 256, 16, "bfloat16", y_dtype="float32", shape="LoRA shrink"),
                   GroupedGemmCase(4, 128, 16, 256, "bfloat16", x_dtype="float32", accumulate=True,
                                   shape="LoRA expand")])


class GroupedGemmProblem:
    """One input set of a grouped_gemm case: group g owns rows [g·M, (g+1)·M) and weight w[g]."""

    def __init__(self, case: GroupedGemmCase, device, seed):
        gen = torch.Generator(device).manual_seed(seed)
        dt = lambda name: getattr(torch, name) if name else None
        token_groups = torch.arange(case.groups, dtype=torch.int32).repeat_interleave(case.M)
        self.p = testing.make_grouped_gemm(token_groups, num_groups=case.groups, K=case.K, N=case.N,
                                           dtype=dt(case.dtype), device=device, gen=gen, gathered=False,
                                           x_dtype=dt(case.x_dtype), y_dtype=dt(case.y_dtype),
                                           accumulate=case.accumulate)
        self.groups = [(g, g * case.M, (g + 1) * case.M) for g in range(case.groups)]
        self.case = case

    def args(self, y):
        return self.p.args(y)

    def touched_bytes(self) -> int:
        """x, every group's weight, y."""
        c, p = self.case, self.p
        return (c.T * c.K * p.x.element_size() + c.groups * c.N * c.K * p.w.element_size()
                + c.T * c.N * p.y.element_size())

    def min_bytes(self) -> int:
        """The touched bytes, y read as well when accumulating."""
        c = self.case
        return self.touched_bytes() + (c.T * c.N * self.p.y.element_size() if c.accumulate else 0)

    def allocated_bytes(self) -> int:
        """x, w, y and the copy of y that its timing writes."""
        p = self.p
        return _storage_bytes(p.x, p.w, p.y) + _storage_bytes(p.y)

    def flops(self) -> int:
        return 2 * self.case.T * self.case.N * self.case.K


def _store(y, d, p):
    """y = d·alpha, or y += d·alpha when accumulating."""
    if p.accumulate:
        y.add_(d.to(y.dtype), alpha=p.alpha)
    else:
        y.copy_(d if p.alpha == 1 else d * p.alpha)


def gg_torch_loop(pb: GroupedGemmProblem, y):
    """Per group: its rows of x times w[g]ᵀ, in the wider of x's and y's dtypes."""
    p = pb.p
    dtype = torch.promote_types(p.x.dtype, y.dtype)
    for g, lo, hi in pb.groups:
        _store(y[lo:hi], p.x[lo:hi].to(dtype) @ p.w[g].to(dtype).T, p)


def gg_grouped_mm_output(pb: GroupedGemmProblem):
    """torch._grouped_mm over the contiguous groups, into an output of its own in y's dtype."""
    p = pb.p
    return torch._grouped_mm(p.x, p.w.transpose(1, 2), offs=p.seg_indptr[1:], out_dtype=p.y.dtype)


def gg_grouped_mm(pb: GroupedGemmProblem, y):
    """torch._grouped_mm's output stored into y (as grouped_gemm does), for the check against the oracle."""
    _store(y, gg_grouped_mm_output(pb), pb.p)


def gg_implementations(device) -> Dict[str, Callable]:
    impls = _our_implementations(device, "grouped_gemm")
    if device != "cpu" and hasattr(torch, "_grouped_mm"):
        impls["grouped_mm"] = gg_grouped_mm
    impls["torch_loop"] = gg_torch_loop
    return impls


def bench_gg_case(case: GroupedGemmCase, impls, device, l2_bytes, copy_tbps, records, failures, log) -> None:
    pb0 = GroupedGemmProblem(case, device, seed=1)
    sets, rotation = _input_sets(pb0, lambda seed: GroupedGemmProblem(case, device, seed), l2_bytes, device, log)
    row = {"shape": case.shape, "groups": case.groups, "T": case.T, "K": case.K, "N": case.N, "dtype": case.dtype,
           "x_dtype": case.x_dtype or case.dtype, "y_dtype": case.y_dtype or case.dtype,
           "accumulate": case.accumulate, **rotation}
    # torch._grouped_mm makes its own output: unless the case accumulates or scales (y += alpha·output, part of the
    # op), it is timed alone, without the copy into y that its check needs.
    alone = ({"grouped_mm": gg_grouped_mm_output}
             if not case.accumulate and pb0.p.alpha == 1 and "grouped_mm" in impls else None)
    _measure("grouped_gemm", row, impls, sets, lambda pb: pb.p.y, lambda pb: reference.grouped_gemm(*pb.p.args()),
             pb0.p.w.dtype, pb0.min_bytes(), pb0.flops(), device, copy_tbps, records, failures, log, alone)
