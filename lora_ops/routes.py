"""Which LoRA route and backend the serving layer uses for a forward of T tokens on a CUDA device: data, not code.

The table (route_tables/<gpu>.json beside this file, one per GPU model measured; the GPU this process sees first
takes its own model's, else the H200's, as the op tables go) is written by the decode-step bench, which times every
route on every regime and keeps the least slow over the regime's ends and mixes (`python -m lora_ops.bench
--decode-step --models all --routes lora_ops/route_tables/<gpu>.json`):

- route "sgmv": the base layer's GEMM, then the fused sgmv op (shrink and expand of the adapters present);
- route "fold": one GEMM against [W; A of every slot] gives y and every used slot's h, then the lora_expand op;
- route "kext": one lora_linear op per layer: a shrink writes each row's h, then one GEMM [x | h]·[W | B]ᵀ (B: every
  slot's, as extra columns of W's rows) that starts while the shrink runs (programmatic dependent launch); h is
  rounded to the activation dtype, as on the fold route. Backend "cuda" only: the op has no Triton kernel (off
  its CUDA kernels' regime, and off CUDA, it runs a composition of torch ops);
- backend "cuda" (the public op: the C++ kernels, which hand the regimes their GPU's op table, lora_ops/op_tables/,
  gives to Triton over to it) or "triton" (the Triton kernel by name).

Regimes are ranges of T, the rows of the layer's input; each entry covers T up to its max_tokens (the last one
has none: every larger T). A table may split them by the pool's max rank R ("ranks": classes up to max_rank, the
last open-ended), since the fold GEMM reads R rows of A per slot and slice: at rank 64 the fastest route differs
from rank 16's (H200, 615d8d8: fold-triton +87% against fold-cuda +112% at 64 tokens). A table with "regimes"
alone holds for every R. Each class is measured on one or more adapter mixes ("mixes": rank and adapter count;
a regime's "us" holds each mix's times): the route chosen is the one whose worst slowdown over the mixes and the
regime's two ends is smallest, since the fastest route changes with the number of adapters present (H200,
057b51d: on a 70B shard at T=32 the kext route ties the fold route with 32 adapters and is 10% slower with one).

The file holds one table per model shape the bench measured ("models"), each with its modules' (K, N) ("modules"),
since the fastest route changes with them (H200, 057b51d: at T=32 with one adapter, the kext route is 5% faster
than the fold route on qwen2-7b and 10% slower on a 70B shard). A pool takes the table of the measured model whose
modules are nearest its own (table_for). The file records the GPU, commit and date of the measurement.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import backends, op_table

TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "route_tables")
PATH = os.path.join(TABLES_DIR, f"{op_table.REFERENCE_GPU}.json")  # the reference GPU's (the issues' GPU)
BACKENDS = ("cuda", "triton")
# Every (route, backend) there is: kext is one op, lora_linear, which has no Triton kernel.
PAIRS = (("sgmv", "cuda"), ("sgmv", "triton"), ("fold", "cuda"), ("fold", "triton"), ("kext", "cuda"))
NAMES = tuple(f"{route}-{backend}" for route, backend in PAIRS)  # as LORA_OPS_ROUTE and the bench name them
# The kext route is a route up to the T lora_linear's sm_90 kernels serve (kLoraLinearMaxTokens in
# csrc/cuda/kernels.h; a test keeps the two equal); past it the op is its composition of torch ops, a fallback
# (llama3-8b at T=128: +539%).
KEXT_MAX_TOKENS = 128


def timed_names(tokens: int) -> Tuple[str, ...]:
    """The routes the bench times (and a table may choose) for a regime measured at `tokens` rows."""
    return tuple(n for n in NAMES if not (n.startswith("kext-") and tokens > KEXT_MAX_TOKENS))
# The upper bounds of the regimes and the T at which the bench measures each one: a step of T tokens takes its
# regime's route, chosen from the times at both ends (a factor of 1.2 to 4 apart), since the fastest route changes
# within a factor of 4 of T (H200, 7f9cdc6: at rank 64 fold-triton led at 256 tokens by 45%, sgmv-cuda at 1024 by
# 25%; 2e50c00: kext led fold-cuda by 10.5% at 64 tokens and trailed it by 50% at 128). 48, 80 and 768 split the
# regimes whose route was more than 5% from the fastest at one end (the ee9ff28 sweeps: 65-96 tokens by up to 11%,
# the 70B shard's 33-64 by 10%, 513-1024 at rank 64 by 12-16%).
REGIME_BOUNDS = (4, 16, 32, 48, 64, 80, 96, 128, 256, 512, 768, 1024, 2048, None)
REGIME_SAMPLES = REGIME_BOUNDS[:-1] + (4096,)
# The sweep then splits, at its middle, a regime whose route is more than SPLIT_ABOVE slower than the fastest at one
# of its two ends where some route is within it at each end alone (the fastest route changes between the ends,
# not between the mixes), its ends at least SPLIT_MIN_TOKENS apart, the worst first, up to SPLIT_MAX_SAMPLES extra
# samples a rank class and model (each costs the class's mixes times every route: ~3 s a mix on an H100). A table
# holds these regimes' bounds besides REGIME_BOUNDS. Issue 12's 5% rule: the fixed bounds left regimes 6.7-12% off
# at one end where the lead changes between them (H100 d32e1d1, H200 a24a444; lora_ops/NOTES.md session 51).
SPLIT_ABOVE = 1.05
SPLIT_MIN_TOKENS = 16
SPLIT_MAX_SAMPLES = 3
# The rank classes (upper bound of the pool's max rank) and the mixes (rank, adapter count) the bench measures each
# at: the decode-step bench's steps (issue 12's four rows: 32 adapters and one at rank 16, 16 at rank 64).
RANK_BOUNDS = (32, None)
CLASS_MIXES = (((16, 32), (16, 1)), ((64, 16),))

_tables: Optional[List[List[dict]]] = None  # each model table's rank classes, each with its regimes
_modules: Optional[List[List[Tuple[int, int]]]] = None  # each model table's modules, (K, N)
_ops: Dict[Tuple[str, str], Callable] = {}


def load(path: str = PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def default_path() -> str:
    """The packaged table the serving layer takes: that of the GPU this process sees first (op_table.path_for, named
    without initialising CUDA), else the reference GPU's. A GPU's route choices differ with its balance of bandwidth
    and launch latency (the H200's table on an H100: one regime 7.4% off its fastest route, csrc/cuda/NOTES.md
    session 50)."""
    return op_table.path_for(op_table.visible_gpu_name(), TABLES_DIR)


def model_tables(table: dict) -> List[dict]:
    """The file's table of each model shape ("models"); a file without them is one table."""
    return table["models"] if "models" in table else [table]


def rank_classes(table: dict) -> List[dict]:
    """A model table's rank classes ({"max_rank", "regimes", ...}); a table without them has one for every rank."""
    return table["ranks"] if "ranks" in table else [{"max_rank": None, "regimes": table.get("regimes")}]


def _check_bounds(what: str, bounds: list) -> None:
    if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
        raise ValueError(f"routes table: only the last {what} may be open-ended, got bounds {bounds}")
    finite = bounds[:-1]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in finite):  # NaN would match no T at all
        raise ValueError(f"routes table: {what} bounds must be integers, got {bounds}")
    if any(b < 1 for b in finite) or any(a >= b for a, b in zip(finite, finite[1:])):
        raise ValueError(f"routes table: {what} bounds must increase from 1, got {bounds}")


def validate(table: dict) -> None:
    """Raises ValueError unless each model table's rank classes cover every R >= 1 and each one's regimes every
    T >= 1, in order, with known routes and backends, and, where the file holds several, each says its modules'
    (K, N) (what a pool is matched to)."""
    models = model_tables(table)
    if not models:
        raise ValueError("routes table: no model tables")
    for model in models:
        if len(models) > 1 and not (model.get("modules") and all(
                len(kn) == 2 and all(isinstance(v, int) and v > 0 for v in kn) for kn in model["modules"])):
            raise ValueError(f"routes table: model {model.get('model')!r} needs its modules' [K, N] (\"modules\"): "
                             "a pool takes the table of the nearest modules")
        _validate_classes(rank_classes(model))


def _validate_classes(classes: List[dict]) -> None:
    if not classes:
        raise ValueError("routes table: no rank classes")
    _check_bounds("rank class", [c.get("max_rank") for c in classes])
    for c in classes:
        regimes = c.get("regimes")
        if not regimes:
            raise ValueError("routes table: no regimes")
        _check_bounds("regime", [r.get("max_tokens") for r in regimes])
        for r in regimes:
            if (r.get("route"), r.get("backend")) not in PAIRS:
                raise ValueError(f"routes table: unknown route/backend in {r} (known: {', '.join(NAMES)})")
            if r["route"] == "kext" and (r["max_tokens"] is None or r["max_tokens"] > KEXT_MAX_TOKENS):
                raise ValueError(f"routes table: the kext route serves up to {KEXT_MAX_TOKENS} tokens, not {r}")
            if not isinstance(r.get("us", []), list):
                raise ValueError(f"routes table: a regime's \"us\" is a list of each mix's times, got {r}")
            if not all(isinstance(us, dict) and all(_is_time(t) for t in us.values()) for us in r.get("us", [])):
                # a NaN would make every slowdown NaN in least_worst, and the first name win (the kext fallback)
                raise ValueError(f"routes table: a regime's times must be positive finite µs, got {r}")
            if r["route"] == "kext" and not all(_other_timed(us) for us in r.get("us") or [{}]):
                raise ValueError(f"routes table: a kext regime needs the times of another route (its fallback where "
                                 f"lora_linear's kernels do not serve a module) in each mix's \"us\": {r}")


def _is_time(t) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf


def _other_timed(us: Dict[str, float]) -> Dict[str, float]:
    """The routes other than kext in one mix's times, {name: us}."""
    return {name: t for name, t in us.items() if name in NAMES and not name.startswith("kext")}


def least_worst(samples: List[Dict[str, float]], names) -> Tuple[str, float]:
    """Of `names`, the route whose worst slowdown against the fastest of `names` timed in each sample ({route: us};
    other entries, e.g. the base or a route that serves only the regime below, set no pace) is smallest, the faster
    in the last sample on a tie; with that slowdown (1.0: the fastest in every sample)."""
    fastest = [min(t for n, t in s.items() if n in names) for s in samples]
    worst = {n: max(s.get(n, math.inf) / f for s, f in zip(samples, fastest)) for n in names}
    best = min(names, key=lambda n: (worst[n], samples[-1].get(n, math.inf)))
    return best, worst[best]


def _with_fallbacks(classes: List[dict]) -> List[dict]:
    """Each kext regime with its "fallback" (route, backend): of the other routes timed at its two ends (its own
    sample and the regime below's, as the bench chooses a regime's route), the one least slow over their mixes
    (least_worst). Worked out once, at load: pick() runs inside torch.compile's traced forwards."""
    for c in classes:
        below: List[dict] = []
        for r in c["regimes"]:
            if r["route"] == "kext":
                others = [_other_timed(us) for us in below + r["us"]]
                r["fallback"] = tuple(least_worst(others, list(others[-1]))[0].split("-"))
            below = r.get("us") or []
    return classes


def _distance(modules: List[Tuple[int, int]], measured: List[Tuple[int, int]]) -> float:
    """How far a pool's modules are from a measured model's: each module's nearest measured (K, N), in octaves of
    K plus octaves of N, summed over the modules."""
    return sum(min(abs(math.log2(k / mk)) + abs(math.log2(n / mn)) for mk, mn in measured) for k, n in modules)


def table_for(modules: List[Tuple[int, int]]) -> int:
    """The index of the model table whose modules are nearest these (K, N) (the first on a tie: the file lists the
    serving layer's main shape, llama3-8b, first)."""
    _load()
    if len(_modules) == 1 or not modules:
        return 0
    return min(range(len(_modules)), key=lambda i: (_distance(modules, _modules[i]), i))


class NearestTable:
    """table_for of a pool's modules, asked once per installed table: an index kept across install() could name
    another model's table, or none. Asked at construction, so that a compiled forward finds it answered (a first
    answer inside the trace would change what the trace guards on: a recompile)."""

    def __init__(self, modules: List[Tuple[int, int]]):
        self.modules = modules
        self._index = table_for(modules)  # loads the table: _tables is set from here on
        self._of_tables = _tables

    def index(self) -> int:
        if self._of_tables is not _tables:
            self._index = table_for(self.modules)
            self._of_tables = _tables
        return self._index


def describe(table: dict) -> List[str]:
    """One line per model table and rank class: each route over the token ranges it takes (python -m lora_ops.info)."""
    lines = []
    for model in model_tables(table):
        for c in rank_classes(model):
            spans, low = [], 1
            for r in c["regimes"]:
                name, high = f"{r['route']}-{r['backend']}", r["max_tokens"]
                if spans and spans[-1][0] == name:
                    spans[-1][2] = high
                else:
                    spans.append([name, low, high])
                low = (high or 0) + 1
            rank = f"R <= {c['max_rank']}" if c["max_rank"] is not None else "larger R"
            ranges = ", ".join(f"{n} {a}-{b}" if b is not None else f"{n} {a}+" for n, a, b in spans)
            lines.append(f"{model.get('model', 'any model')}, {rank}: {ranges} tokens")
    return lines


def pick(tokens: int, device_type: str = "cuda", max_rank: int = 16,
         kext_serves: bool = True, table: int = 0) -> Tuple[str, str]:
    """(route, backend) for a forward of `tokens` rows on a device of this type, with a pool of this max rank: the
    choice of model table `table` (table_for) on CUDA, the sgmv route elsewhere. Where the table chooses kext but
    its kernels do not serve the module (`kext_serves`: another GPU, dtype or shape), the regime's fallback: the
    other route the table timed there that is least slow over its mixes. A Triton regime without Triton installed
    goes to the same route on backend "cuda" (the public op, as op() would run it anyway).
    LORA_OPS_ROUTE=<route>-<backend> (e.g. fold-triton, kext-cuda) forces one on any device, for tests and
    comparisons."""
    forced = os.environ.get("LORA_OPS_ROUTE")
    if forced:
        route, _, backend = forced.partition("-")
        if (route, backend) not in PAIRS:
            raise ValueError(f"LORA_OPS_ROUTE={forced!r}: expected <route>-<backend>, one of {', '.join(NAMES)}")
    elif device_type == "cuda":
        regimes = next(c["regimes"] for c in _load()[table] if c["max_rank"] is None or max_rank <= c["max_rank"])
        regime = next(r for r in regimes if r["max_tokens"] is None or tokens <= r["max_tokens"])
        route, backend = regime["route"], regime["backend"]
        if route == "kext" and not kext_serves:
            route, backend = regime["fallback"]
        if backend == "triton" and "triton" in backends.unavailable:
            # the public op then runs the regime (op()); its own form of the route is the one to pass it
            # (fold_expand_rows), not Triton's
            backend = "cuda"
    else:
        route, backend = "sgmv", "cuda"
    # Off CUDA, "cuda" stands for the public op, whose dispatch serves the tensors' device.
    return route, backend if device_type == "cuda" else "cuda"


def sorted_slots(token_lora: torch.Tensor, token_indices: torch.Tensor, out: Optional[torch.Tensor] = None):
    """Each position's slot in build_segments' order, token_lora[token_indices]: the seg_lora of the fold route's
    rows form (fold_expand_rows). Once per step, beside build_segments, not per layer."""
    return torch.index_select(token_lora, 0, token_indices, out=out)


def fold_expand_rows(backend: str, sorted_slots, segments: tuple) -> tuple:
    """What the fold route's lora_expand reads (seg_indptr, seg_lora, token_indices). On CUDA its rows form in
    build_segments' order: each position's row through token_indices and its slot in `sorted_slots`
    (token_lora[token_indices], gathered once per step), so no kernel walks segments and the rows of one slot sit
    side by side (the runs kernel reads their B once). On Triton the segments, whose segment tiles were faster than
    its per-row kernel from 64 rows and at rank 64 (H200, decode step)."""
    return tuple(segments) if backend == "triton" else (None, sorted_slots, segments[2])


def preload() -> None:
    """Reads and checks the table, and resolves every route's ops, now: torch.compile cannot trace the file read,
    and a first compiled forward that filled op()'s cache would be guarded on it (a recompile once an eager call
    fills it). MultiLoRALinear calls this when it wraps a layer."""
    _load()
    for kind in ("sgmv", "lora_expand"):
        for backend in BACKENDS:
            op(kind, backend)


def _load() -> List[List[dict]]:
    """Each model table's rank classes, with the kext regimes' fallbacks, read and checked once."""
    if _tables is None:
        install(load(default_path()))
    return _tables


def install(table: dict) -> None:
    """Makes this table (a file's contents) the one pick and table_for read, after checking it."""
    global _tables, _modules
    models = model_tables(table)
    validate({"models": models})
    _modules = [[tuple(kn) for kn in m.get("modules", [])] for m in models]
    _tables = [_with_fallbacks(rank_classes(m)) for m in models]


def op(kind: str, backend: str) -> Callable:
    """The op that runs `kind` ("sgmv" or "lora_expand") on `backend`: lora_ops::_triton_<kind> for "triton" when
    Triton is available; otherwise the public op, whose dispatch serves the tensors' device (on CUDA: the C++
    kernels, or Triton where they are not built or LORA_OPS_BACKEND=triton). Resolved once per pair: every layer
    of every step asks."""
    key = (kind, backend)
    if key not in _ops:
        name = f"_triton_{kind}" if backend == "triton" and "triton" not in backends.unavailable else kind
        _ops[key] = getattr(torch.ops.lora_ops, name).default
    return _ops[key]
