"""Which backend the CUDA kernels of sgmv, lora_expand and grouped_gemm hand each call to, per regime: data measured
by the op bench, not code (docs/design.md §3).

A table is written from the op bench's own graph-replay records (`python -m lora_ops.bench --ops --op-table
lora_ops/op_tables/<gpu>.json`) and records the GPU, commit and date of the measurement. One is packaged per GPU
model measured (op_tables/h200.json, op_tables/h100.json: the model's word of the device name, gpu_word); at import
the table of the GPU the process sees first is installed, or, for a GPU without one, the reference GPU's
(REFERENCE_GPU: the H200, the issues' GPU). The GPU is named without initialising CUDA (which a process that forks
workers must not do at import): through CUDA when torch has already initialised it, else through NVML, the
driver's management library, as the first entry of CUDA_VISIBLE_DEVICES names it, by index or UUID
(visible_gpu_name; NVML numbers the GPUs in PCI order, CUDA by default fastest first: the two agree where every
GPU is of one model). A process with GPUs of several models takes one table for all of them. A results file with
failures, or from a partial run (CPU, --quick, --impls, some ops left out, fp32), or without a case of every op
timed on both backends, makes no table (results_problems). At import, lora_ops hands
the table to the C++ side (csrc/common/op_table.h, in every build); the C++ CUDA kernels look a call up there and
redispatch one in a Triton regime to lora_ops::_triton_<op>, in C++, with no Python on the C++ kernels' path. It
applies to fp16/bf16 weights (the measured dtypes; fp32 stays on the C++ kernels), and not when
LORA_OPS_CUDA_SGMV_KERNEL / LORA_OPS_CUDA_EXPAND_KERNEL / LORA_OPS_CUDA_GG_KERNEL force a C++ kernel.

A regime goes to Triton only when Triton wins there by a margin (TRITON_MARGIN): the C++ kernel's worst slowdown
over the regime's measured cases is at least 1.05× Triton's, so no default is more than 5% slower than the other
backend on a measured case. A closer tie stays on the C++ kernel, which is cheaper to call eagerly (a call routed
to Triton pays a hop into Python, where Triton launches its kernel; graph replay does not) and whose win or loss
by a few percent is within the spread of one measurement.

LORA_OPS_OP_TABLE=off keeps every call on the C++ kernels; LORA_OPS_OP_TABLE=<path> loads that table, whatever the
GPU.

A regime is one class per axis; the classes of an axis are given by inclusive upper bounds, the last class is
open-ended, so the classes of every axis cover all values >= 1 and the cells (row-major over the axes) cover
every call. The axes are what the C++ kernels see on the host, without reading device memory:

- positions: the length of token_indices (else the rows);
- rank: the pool's max rank R (lora_b.shape[2]; the true ranks live on the device);
- slices: len(slice_offsets) - 1;
- true_ranks (sgmv, lora_expand): 1 when the call passes no lora_ranks (every adapter at the pool's rank R: the
  serving layer's calls while its pool holds one rank), 2 when it passes them (any rank up to R: the C++ kernels
  pay each adapter's true rank, Triton's pay R);
- n, k (grouped_gemm): w.shape[1], w.shape[2], the pool's widest group.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "op_tables")
REFERENCE_GPU = "h200"  # the issues' GPU: its table serves a GPU that has none of its own
OPS = ("sgmv", "lora_expand", "grouped_gemm")
BACKENDS = ("cuda", "triton")
# The dtypes the table applies to (the C++ kernels treat both alike); records in others are not used.
DTYPES = ("bfloat16", "float16")
# The C++ sgmv takes its tensor-core kernels from this many positions (csrc/cuda/registration.cpp, kMmaMinPositions).
MMA_MIN_POSITIONS = 1024
# How much smaller Triton's worst slowdown in a regime must be than the C++ kernel's for the regime to go to Triton.
TRITON_MARGIN = 1.05

# Axes of each op's regimes, with the upper bounds of their classes:
# - positions MMA_MIN_POSITIONS - 1: no class mixes two C++ sgmv kernels; 16/64/256: decode batches (as
#   routes.py); 4096: the rank-16 crossover measured on the H200 (CUDA at 4096, Triton at 16384).
# - rank 16/32/64: the measured choice changes with the rank (256 positions: CUDA at 16, closer at 64; 4096 at 128:
#   Triton by 3.6×).
# - slices 1: the tensor-core sgmv loses on fused modules (3 slices, 1024 positions: Triton by 2.6×).
# - true_ranks 1: at 256 positions of a rank-64 pool, Triton wins when every adapter has rank 64 (38.6 against
#   45.6 µs) and the C++ kernel by 2.5× on rank-8 adapters (true-rank cost); only whether ranks are passed tells
#   the two apart on the host.
# - grouped_gemm n/k 128: the C++ kernels' skinny paths (LoRA shrink n <= 128, expand k <= 128) against their tile
#   kernel; positions 256/4096: decode (where the shrink takes the split-K kernels when it can), prefill, long
#   prefill.
_SGMV_AXES = (("positions", (16, 64, 256, MMA_MIN_POSITIONS - 1, 4096)), ("rank", (16, 32, 64)),
              ("slices", (1,)), ("true_ranks", (1,)))
AXES: Dict[str, Tuple[Tuple[str, Tuple[int, ...]], ...]] = {
    "sgmv": _SGMV_AXES,
    "lora_expand": _SGMV_AXES,
    "grouped_gemm": (("positions", (256, 4096)), ("n", (128,)), ("k", (128,))),
}


def record_regime(record: dict) -> Dict[str, int]:
    """The axis values of an op-bench record (every row of the bench's cases is reached through token_indices of
    length T, so positions = T; records from before the bench said whether it passed lora_ranks passed them)."""
    if record["op"] == "grouped_gemm":
        return {"positions": record["T"], "n": record["N"], "k": record["K"]}
    return {"positions": record["T"], "rank": record["pool_rank"], "slices": record["slices"],
            "true_ranks": 2 if record.get("lora_ranks", True) else 1}


def _class_of(bounds: Sequence[int], value: int) -> int:
    """The class of `value` on an axis: the number of upper bounds below it (values below 1 fall in the first)."""
    return bisect.bisect_left(list(bounds), value)


def _cell_index(axes: List[dict], values: Dict[str, int]) -> int:
    index = 0
    for axis in axes:
        index = index * (len(axis["max"]) + 1) + _class_of(axis["max"], values[axis["name"]])
    return index


def _case_key(record: dict) -> tuple:
    # lists (a fused module's slice_widths) as tuples: the key is hashed
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in record.items()
                        if k not in ("backend", "us", "gbps", "tflops", "pct_roofline", "mode")))


def _comparisons(records: List[dict], op: str) -> List[Dict[str, dict]]:
    """The cases of `op` timed on both backends (graph replay, fp16/bf16): per case, backend -> record. Raises
    ValueError for a timing that is not a positive number (no slowdown can be computed from it)."""
    cases: Dict[tuple, Dict[str, dict]] = {}
    for r in records:
        if r["op"] == op and r.get("mode") == "graph" and r.get("dtype") in DTYPES and r["backend"] in BACKENDS:
            us = r.get("us")
            if isinstance(us, bool) or not isinstance(us, (int, float)) or not us > 0:
                raise ValueError(f"op table: {op} {r['backend']} record {_case_fields(r)} has a timing of {us!r} µs")
            cases.setdefault(_case_key(r), {})[r["backend"]] = r
    return [by for by in cases.values() if all(b in by for b in BACKENDS)]


def build(records: Iterable[dict], meta: dict) -> dict:
    """The table from op-bench records: per op and regime, over the cases measured in that regime with both
    backends (graph replay, fp16/bf16), each backend's worst slowdown against the faster one; the regime goes to
    Triton when the C++ kernel's worst slowdown is at least TRITON_MARGIN times Triton's, else it stays on the C++
    kernel. A regime without such a case keeps the C++ kernel and says it was not measured."""
    ops = {}
    records = list(records)
    for op in OPS:
        axes = [{"name": name, "max": list(bounds)} for name, bounds in AXES[op]]
        by_cell: Dict[int, List[Dict[str, dict]]] = {}
        for by in _comparisons(records, op):
            by_cell.setdefault(_cell_index(axes, record_regime(by["cuda"])), []).append(by)
        cells = []
        for index, classes in enumerate(itertools.product(*(range(len(a["max"]) + 1) for a in axes))):
            cell = {a["name"]: _class_range(a["max"], c) for a, c in zip(axes, classes)}
            measured = by_cell.get(index, [])
            if measured:
                worst = {b: max(by[b]["us"] / min(by[o]["us"] for o in BACKENDS) for by in measured) for b in BACKENDS}
                cell["backend"] = "triton" if worst["cuda"] >= TRITON_MARGIN * worst["triton"] else "cuda"
                cell["measured"] = True
                cell["cases"] = [dict(_case_fields(by["cuda"]), us={b: by[b]["us"] for b in BACKENDS})
                                 for by in measured]
            else:
                cell["backend"] = "cuda"
                cell["measured"] = False
            cells.append(cell)
        ops[op] = {"axes": axes, "cells": cells}
    table = dict(meta, mode="graph", dtypes=list(DTYPES), triton_margin=TRITON_MARGIN, ops=ops)
    validate(table)
    return table


def run_problems(settings: dict) -> List[str]:
    """Why an op-bench run with these settings (the bench's `op_bench` entry of a results file: device, quick,
    min_tokens, impls, op_kinds, dtype, sgmv_cases) cannot make a table; empty when it can."""
    problems = []
    if torch.device(settings["device"]).type != "cuda":
        problems.append(f"the device is {settings['device']}, not a CUDA GPU")
    if settings["quick"]:
        problems.append("--quick times only the first few cases")
    if settings.get("min_tokens"):  # absent from results files written before the option
        problems.append(f"--min-tokens {settings['min_tokens']} times only the longer cases")
    if settings["impls"]:
        problems.append(f"--impls {','.join(settings['impls'])} times only some implementations")
    if settings.get("sgmv_cases"):  # absent from results files written before the option
        problems.append(f"--sgmv-cases {settings['sgmv_cases']} times other sgmv cases than the table's")
    missing = [op for op in OPS if op not in settings["op_kinds"]]
    if missing:
        problems.append(f"--op-kinds leaves out {','.join(missing)}")
    if settings["dtype"] not in DTYPES:
        problems.append(f"--dtype {settings['dtype']}: the table applies to {' and '.join(DTYPES)}")
    return problems


def results_problems(result: dict) -> List[str]:
    """Why a results file (python -m lora_ops.bench --out) cannot make a table: its run's settings (run_problems),
    a CPU run, failures of the run, or an op without a case timed on both backends; empty when it can. (Results
    files written before the bench stored `op_bench` and `failures` are judged by their device and records.)"""
    if "op_bench" in result:
        problems = run_problems(result["op_bench"])
    else:
        problems = ["the results come from a CPU run"] if result.get("gpu") == "cpu" else []
    failures = result.get("failures") or []
    if failures:
        problems.append(f"the run had {len(failures)} failure(s), the first: {failures[0]}")
    for op in OPS:
        if not _comparisons(result["records"], op):
            problems.append(f"no {op} case was timed on both {' and '.join(BACKENDS)} (graph replay, "
                            f"{' or '.join(DTYPES)})")
    return problems


def write(path: str, result: dict, meta: dict) -> dict:
    """Builds the table from a bench run's results (its records, and what results_problems checks) and writes it
    to `path` (the bench's --op-table, and `python -m lora_ops.bench.report RESULTS.json --op-table PATH`).
    Raises ValueError, writing nothing, when the results cannot make a table."""
    problems = results_problems(result)
    if problems:
        raise ValueError("op table not written: " + "; ".join(problems))
    table = build(result["records"], meta)
    with open(path, "w") as f:
        f.write(_dumps(table))
    return table


def _dumps(table: dict) -> str:
    """JSON with one line per regime, so that a diff of two measurements reads regime by regime."""
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in table.items() if k != "ops"] + [' "ops": {']
    for i, (op, spec) in enumerate(table["ops"].items()):
        cells = spec["cells"]
        lines += [f"  {json.dumps(op)}: {{", f'   "axes": {json.dumps(spec["axes"])},', '   "cells": [']
        lines += [f"    {json.dumps(c)}" + ("," if j + 1 < len(cells) else "") for j, c in enumerate(cells)]
        lines += ["   ]", "  }" + ("," if i + 1 < len(table["ops"]) else "")]
    return "\n".join(lines + [" }", "}", ""])


def _class_range(bounds: Sequence[int], c: int) -> List[Optional[int]]:
    return [1 if c == 0 else bounds[c - 1] + 1, bounds[c] if c < len(bounds) else None]


def _case_fields(record: dict) -> dict:
    keep = ("T", "adapters", "rank", "pool_rank", "lora_ranks", "K", "N", "slices", "slice_widths", "groups", "shape",
            "dtype", "x_dtype", "y_dtype")
    return {k: record[k] for k in keep if k in record}


def validate(table: dict) -> None:
    """Raises ValueError unless the table says which measurement it came from (gpu, date, git_sha), has every op
    with its axes, each axis' classes cover every value >= 1 (increasing bounds from 1, the last class open), and
    one cell per regime with a known backend and whether it was measured."""
    for key in ("gpu", "date", "git_sha"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise ValueError(f"op table: no {key} (which measurement it came from)")
    ops = table.get("ops") or {}
    for op in OPS:
        spec = ops.get(op)
        if spec is None:
            raise ValueError(f"op table: no entry for {op}")
        axes = spec.get("axes") or []
        names = [a.get("name") for a in axes]
        if names != [name for name, _ in AXES[op]]:
            raise ValueError(f"op table: {op} axes are {names}, expected {[name for name, _ in AXES[op]]}")
        for a in axes:
            bounds = a.get("max")
            if not isinstance(bounds, list) or any(not isinstance(b, int) or isinstance(b, bool) for b in bounds):
                raise ValueError(f"op table: {op} axis {a['name']}: bounds must be a list of ints, got {bounds}")
            if any(b < 1 for b in bounds) or any(x >= y for x, y in zip(bounds, bounds[1:])):
                raise ValueError(f"op table: {op} axis {a['name']}: bounds must increase from 1, got {bounds}")
        cells = spec.get("cells") or []
        classes = list(itertools.product(*(range(len(a["max"]) + 1) for a in axes)))
        if len(cells) != len(classes):
            raise ValueError(f"op table: {op} has {len(cells)} cells for {len(classes)} regimes")
        for cell, cls in zip(cells, classes):
            for a, c in zip(axes, cls):
                if cell.get(a["name"]) != _class_range(a["max"], c):
                    raise ValueError(f"op table: {op} cell {cell} out of order: expected {a['name']} "
                                     f"{_class_range(a['max'], c)}")
            if cell.get("backend") not in BACKENDS:
                raise ValueError(f"op table: {op} cell {cell}: unknown backend {cell.get('backend')!r}")
            if not isinstance(cell.get("measured"), bool):
                raise ValueError(f"op table: {op} cell {cell}: no 'measured' flag")


def choice(table: dict, op: str, **values: int) -> str:
    """The backend the table gives a call of `op` with these axis values (e.g. positions=, rank=, slices=,
    true_ranks=)."""
    spec = table["ops"][op]
    return spec["cells"][_cell_index(spec["axes"], values)]["backend"]


_BRANDS = ("nvidia", "geforce", "rtx", "tesla", "quadro")  # words before the model's in a device name


def gpu_word(device_name: str) -> str:
    """The model's word of a device name, as the bench's results files and the op tables are named: "NVIDIA H100
    80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" ->
    "4090". Variants of one model (an H100's SXM, PCIe and NVL forms) share the word, and so the table."""
    words = [w for w in device_name.split() if w.lower() not in _BRANDS]
    return words[0].split("-")[0].lower() if words else ""


def path_for(device_name: Optional[str], tables_dir: str = TABLES_DIR) -> str:
    """The packaged table of this GPU's model in tables_dir (the op tables', or routes.TABLES_DIR), else the reference
    GPU's."""
    own = os.path.join(tables_dir, f"{gpu_word(device_name)}.json") if device_name else None
    return own if own and os.path.isfile(own) else os.path.join(tables_dir, f"{REFERENCE_GPU}.json")


def visible_gpu_name() -> Optional[str]:
    """The name of the first GPU this process sees (CUDA's device 0), without initialising CUDA; None where it sees
    none ("" or a negative index first in CUDA_VISIBLE_DEVICES), or where NVML cannot name it."""
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name(0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0].strip() if visible is not None else "0"
    return _nvml_device_name(first) if first and not first.startswith("-") else None


@functools.lru_cache(maxsize=None)
def _nvml_device_name(device: str) -> Optional[str]:
    """NVML's name of the GPU with this index (decimal digits) or UUID ("GPU-…", "MIG-…"); None without an NVIDIA
    driver, or where NVML finds no such GPU. Asked once a process and device: the op table and the route table both
    name the GPU, and each nvmlInit attaches every GPU."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):  # no driver, or an NVML without the entry point
        return None
    try:
        handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
        if device.isascii() and device.isdecimal():
            if int(device) >= 1 << 32:
                return None
            found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(device)), ctypes.byref(handle))
        else:
            found = nvml.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle))
        if found != 0 or nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name))) != 0:
            return None
        return name.value.decode("ascii", "replace")
    except AttributeError:
        return None
    finally:
        nvml.nvmlShutdown()


def load(path: Optional[str] = None) -> dict:
    """The table at `path` (default: the reference GPU's), validated."""
    with open(path or path_for(None)) as f:
        table = json.load(f)
    validate(table)
    return table


# The table the C++ kernels hold now (None: none, every call on the C++ kernels).
installed: Optional[dict] = None


def cuda_kernels_take_tables() -> bool:
    """True when the C++ CUDA kernels are compiled in: they, and only they, consult the table (which every build
    holds, csrc/common/op_table.h)."""
    from . import backends
    return any(backends.cuda_compiled.get(op) for op in OPS)


def install(table: Optional[dict]) -> None:
    """Hands `table` to the C++ kernels (None: clears it), all ops or none: if any op's table is refused (e.g. its
    Triton twin has no CUDA kernel), the ops already set get the previous table back before the error propagates.
    Its Triton regimes need Triton's kernels registered as lora_ops::_triton_<op> (backends.py): without Triton,
    every regime stays on the C++ kernels."""
    global installed
    from . import backends
    if table is not None:
        validate(table)
    usable = table if table is not None and "triton" not in backends.unavailable else None
    done = []
    try:
        for op in OPS:
            _set_cpp_table(op, usable)
            done.append(op)
    except Exception:
        for op in done:
            _set_cpp_table(op, installed)
        raise
    installed = usable


def _set_cpp_table(op: str, table: Optional[dict]) -> None:
    if table is None:
        torch.ops.lora_ops._set_cuda_op_table(op, "", [], [], [])
        return
    spec = table["ops"][op]
    torch.ops.lora_ops._set_cuda_op_table(
        op, ",".join(a["name"] for a in spec["axes"]), [len(a["max"]) for a in spec["axes"]],
        [b for a in spec["axes"] for b in a["max"]], [int(c["backend"] == "triton") for c in spec["cells"]])


def default_path() -> Optional[str]:
    """The table install_default installs: LORA_OPS_OP_TABLE's path, none for "off", else the packaged table of the
    GPU this process sees first (path_for; the GPU is not looked up where no table would be used: without the C++
    CUDA kernels, or without Triton)."""
    from . import backends
    setting = os.environ.get("LORA_OPS_OP_TABLE", "").strip()
    if setting.lower() == "off":
        return None
    used = cuda_kernels_take_tables() and "triton" not in backends.unavailable
    return setting or path_for(visible_gpu_name() if used else None)


def install_default() -> None:
    """At import: default_path's table, or none."""
    path = default_path()
    install(None if path is None else load(path))


@contextlib.contextmanager
def disabled():
    """Every call on the C++ kernels inside the block (the bench times each backend alone)."""
    previous = installed
    install(None)
    try:
        yield
    finally:
        install(previous)


def cuda_choice(op: str, **values: int) -> str:
    """The C++ lookup of the installed table: what a CUDA call of fp16/bf16 `op` with these axis values runs on."""
    return torch.ops.lora_ops._cuda_op_table_choice(op, [values[name] for name, _ in AXES[op]])


def describe(table: dict, op: str) -> str:
    """One line: the regimes the table gives to Triton, and how many regimes were measured."""
    spec = table["ops"][op]
    triton = [" & ".join(f"{a['name']} {_fmt(c[a['name']])}" for a in spec["axes"])
              for c in spec["cells"] if c["backend"] == "triton"]
    measured = sum(c["measured"] for c in spec["cells"])
    where = ("triton where " + "; ".join(triton) + ", cuda elsewhere") if triton else "cuda everywhere"
    return f"{where} ({measured} of {len(spec['cells'])} regimes measured; the others default to cuda)"


def _fmt(r: List[Optional[int]]) -> str:
    lo, hi = r
    return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")
