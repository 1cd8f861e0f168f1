"""Which LoRA route and backend the serving layer uses for a forward of T tokens on a CUDA device: data, not code.

The table (routes.json beside this file) is written by the decode-step bench, which times every route on every
regime and keeps the fastest (`python -m lora_ops.bench --decode-step --routes lora_ops/routes.json`):

- route "sgmv": the base layer's GEMM, then the fused sgmv op (shrink and expand of the adapters present);
- route "fold": one GEMM against [W; A of every slot] gives y and every used slot's h, then the lora_expand op;
- route "kext": one lora_linear op per layer: a shrink writes each row's h, then one GEMM [x | h]·[W | B]ᵀ (B: every
  slot's, as extra columns of W's rows) that starts while the shrink runs (programmatic dependent launch); h is
  rounded to the activation dtype, as on the fold route. Backend "cuda" only: the op has no Triton kernel (off
  its CUDA kernels' regime, and off CUDA, it runs a composition of torch ops);
- backend "cuda" (the public op: the C++ kernels, which hand the regimes lora_ops/op_table.json gives to Triton
  over to it) or "triton" (the Triton kernel by name).

Regimes are ranges of T, the rows of the layer's input; each entry covers T up to its max_tokens (the last one
has none: every larger T). A table may split them by the pool's max rank R ("ranks": classes up to max_rank, the
last open-ended), since the fold GEMM reads R rows of A per slot and slice: at rank 64 the fastest route differs
from rank 16's (H200, 615d8d8: fold-triton +87% against fold-cuda +112% at 64 tokens). A table with "regimes"
alone holds for every R. The file records the GPU, commit and date of the measurement.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "routes.json")
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
# regime's route, chosen from the times at both ends (a factor of 2 to 4 apart), since the fastest route changes
# within a factor of 4 of T (H200, 7f9cdc6: at rank 64 fold-triton led at 256 tokens by 45%, sgmv-cuda at 1024 by
# 25%).
REGIME_BOUNDS = (4, 16, 32, 64, 128, 256, 512, 1024, 2048, None)
REGIME_SAMPLES = (4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The rank classes (upper bound of the pool's max rank) and the rank and adapter count the bench measures each at:
# the decode-step bench's two adapter mixes.
RANK_BOUNDS = (32, None)
RANK_SAMPLES = ((16, 32), (64, 16))

_table: Optional[List[dict]] = None  # the rank classes, each with its regimes
_ops: Dict[Tuple[str, str], Callable] = {}


def load(path: str = PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def rank_classes(table: dict) -> List[dict]:
    """The table's rank classes ({"max_rank", "regimes", ...}); a table without them has one for every rank."""
    return table["ranks"] if "ranks" in table else [{"max_rank": None, "regimes": table.get("regimes")}]


def _check_bounds(what: str, bounds: list) -> None:
    if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
        raise ValueError(f"routes table: only the last {what} may be open-ended, got bounds {bounds}")
    finite = bounds[:-1]
    if any(b < 1 for b in finite) or any(a >= b for a, b in zip(finite, finite[1:])):
        raise ValueError(f"routes table: {what} bounds must increase from 1, got {bounds}")


def validate(table: dict) -> None:
    """Raises ValueError unless the rank classes cover every R >= 1 and each one's regimes every T >= 1, in order,
    with known routes and backends."""
    classes = rank_classes(table)
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
            if r["route"] == "kext" and not _other_timed(r):
                raise ValueError(f"routes table: a kext regime needs the times of another route (its fallback where "
                                 f"lora_linear's kernels do not serve a module), in \"us\": {r}")


def _other_timed(regime: dict) -> Dict[str, float]:
    """The regime's timed routes other than kext, {name: us}."""
    return {name: us for name, us in regime.get("us", {}).items() if name in NAMES and not name.startswith("kext")}


def _with_fallbacks(classes: List[dict]) -> List[dict]:
    """Each kext regime with its "fallback" (route, backend): the fastest other route timed there. Worked out once,
    at load: pick() runs inside torch.compile's traced forwards."""
    for c in classes:
        for r in c["regimes"]:
            if r["route"] == "kext":
                timed = _other_timed(r)
                r["fallback"] = tuple(min(timed, key=timed.get).split("-"))
    return classes


def pick(tokens: int, device_type: str = "cuda", max_rank: int = 16,
         kext_serves: bool = True) -> Tuple[str, str]:
    """(route, backend) for a forward of `tokens` rows on a device of this type, with a pool of this max rank: the
    table's choice on CUDA, the sgmv route elsewhere. Where the table chooses kext but its kernels do not serve the
    module (`kext_serves`: another GPU, dtype or shape), the fastest other route the table timed at that regime.
    LORA_OPS_ROUTE=<route>-<backend> (e.g. fold-triton, kext-cuda) forces one on any device, for tests and
    comparisons."""
    forced = os.environ.get("LORA_OPS_ROUTE")
    if forced:
        route, _, backend = forced.partition("-")
        if (route, backend) not in PAIRS:
            raise ValueError(f"LORA_OPS_ROUTE={forced!r}: expected <route>-<backend>, one of {', '.join(NAMES)}")
    elif device_type == "cuda":
        regimes = next(c["regimes"] for c in _classes() if c["max_rank"] is None or max_rank <= c["max_rank"])
        regime = next(r for r in regimes if r["max_tokens"] is None or tokens <= r["max_tokens"])
        route, backend = regime["route"], regime["backend"]
        if route == "kext" and not kext_serves:
            route, backend = regime["fallback"]
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
    _classes()
    for kind in ("sgmv", "lora_expand"):
        for backend in BACKENDS:
            op(kind, backend)


def _classes() -> List[dict]:
    global _table
    if _table is None:
        table = load()
        validate(table)
        _table = _with_fallbacks(rank_classes(table))
    return _table


def op(kind: str, backend: str) -> Callable:
    """The op that runs `kind` ("sgmv" or "lora_expand") on `backend`: lora_ops::_triton_<kind> for "triton" when
    Triton is available; otherwise the public op, whose dispatch serves the tensors' device (on CUDA: the C++
    kernels, or Triton where they are not built or LORA_OPS_BACKEND=triton). Resolved once per pair: every layer
    of every step asks."""
    key = (kind, backend)
    if key not in _ops:
        from . import backends
        name = f"_triton_{kind}" if backend == "triton" and "triton" not in backends.unavailable else kind
        _ops[key] = getattr(torch.ops.lora_ops, name).default
    return _ops[key]
