"""Timing primitives shared by the op bench and the decode-step bench (docs/design.md §6).

On CUDA a call list is timed as CUDA-graph replay or as eager launches, with device events, after a warm-up;
on the CPU with the wall clock."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch


def copy_bandwidth_tbps(device) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus written."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 20 / (start.elapsed_time(end) * 1e-3) / 1e12


def capture(calls: List[Callable[[], None]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph replaying `calls` in order (captured on a side stream, as torch requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    return g


def time_loop(run: Callable[[], None], min_ms: float = 30.0) -> float:
    """ms per run() (device events), doubling the repetitions until they take at least min_ms."""
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 1
    while True:
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        if ms >= min_ms or reps >= 1 << 14:
            return ms / reps
        reps *= 2 if ms * 4 < min_ms else max(2, int(min_ms / max(ms, 1e-3)) + 1)


def time_interleaved(runs: Dict[str, Callable[[], None]], min_ms: float, rounds: int = 5) -> Dict[str, float]:
    """ms per run of each of `runs`, the median of `rounds` rounds that each time every run in turn (time_loop,
    min_ms / rounds apiece): a drift of the clocks or the temperature during the measurement moves them alike,
    so their ratios hold (the decode step's base, timed once before its routes, moved by 2% between two cases of
    one run: 2 points of overhead)."""
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(time_loop(run, min_ms / rounds))
    return {name: statistics.median(ts) for name, ts in times.items()}


# Calls per timed graph replay or eager loop (fewer input sets are repeated up to it): one launch's overhead,
# spread over many calls.
MIN_CALLS = 20


def cuda_runner(fn_sets: List[Callable[[], None]], graph: bool,
                check: Optional[Callable[[Callable[[], None]], None]] = None) -> Tuple[Callable[[], None], int]:
    """(run, calls): run() replays one CUDA graph of `calls` calls cycling through the input sets, or launches them
    eagerly, after a warm-up; time_loop(run) / calls is then the time of one call.

    check (graph replay): called once with the captured graph's replay, before it is returned, to reset the
    outputs, replay once and compare them with the oracle. Its graph runs each of fn_sets exactly once (none is
    repeated up to MIN_CALLS: 20 accumulations into a bf16 y drift from the oracle by about its tolerance). An
    exception it raises propagates: nothing is timed."""
    if check and not graph:
        raise ValueError("cuda_runner: check needs graph replay")
    calls = fn_sets if check else fn_sets * max(1, MIN_CALLS // len(fn_sets))
    for f in fn_sets * 2:
        f()
    torch.cuda.synchronize()
    if graph:
        run = capture(calls).replay
        if check:
            check(run)
        return run, len(calls)

    def run():
        for f in calls:
            f()
    return run, len(calls)


def time_cuda(fn_sets: List[Callable[[], None]], graph: bool, min_ms: float = 30.0,
              check: Optional[Callable[[Callable[[], None]], None]] = None) -> float:
    """µs per call: mean over calls cycling through the input sets, as graph replay or eager launches
    (cuda_runner, whose check this passes on)."""
    run, calls = cuda_runner(fn_sets, graph, check)
    return time_loop(run, min_ms) * 1e3 / calls


def time_cpu(fn: Callable[[], None], min_s: float = 0.2) -> float:
    """µs per call on the host clock."""
    fn()
    reps, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while elapsed < min_s:
        fn()
        reps += 1
        elapsed = time.perf_counter() - t0
    return elapsed / reps * 1e6


def launch_floor_us(device) -> float:
    """Graph replay of a one-element add: the per-kernel floor that every CUDA row includes."""
    t = torch.zeros(1, device=device)
    return time_cuda([lambda: t.add_(1)], graph=True)
