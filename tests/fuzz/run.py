"""The fuzzer's parent process: hands batches of case seeds to a child process (child.py), reads its reports,
and turns a child that dies into CRASH (exit signal or code, and the seed re-run alone to confirm it) and a
child that stops answering into HANG (killed after `timeout` seconds on one call).

Case seeds are run_seed, run_seed + 1, ...: every report names the run seed and each failing case's seed, and
`python -m tests.fuzz --cases SEED --device D --backends B` replays one case.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import lora_ops
import torch

from . import cases, child

OUTCOMES = ("OK", "ERROR", "SKIP", "FAIL", "CRASH", "HANG")
BAD = ("FAIL", "CRASH", "HANG")


@dataclasses.dataclass
class Failure:
    seed: int
    backend: str
    outcome: str
    detail: str
    call: str = ""


@dataclasses.dataclass
class Report:
    seed: int
    device: str
    backends: List[str]
    debug: bool
    counts: Dict[Tuple[str, str, str], int] = dataclasses.field(default_factory=collections.Counter)  # backend, op, outcome
    ops: Dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    failures: List[Failure] = dataclasses.field(default_factory=list)
    cases: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def record(self, seed: int, results: dict) -> None:
        self.cases += 1
        for backend, (outcome, detail, op, *call) in results.items():
            self.counts[backend, op, outcome] += 1
            self.ops[op] += 1
            if outcome in BAD:
                self.failures.append(Failure(seed, backend, outcome, detail, call[0] if call else ""))

    def reproduce(self, f: Failure) -> str:
        return (f"python -m tests.fuzz --cases {f.seed} --device {self.device} --backends {f.backend}"
                + (" --debug" if self.debug else ""))

    def text(self) -> str:
        lines = [f"fuzz: run seed {self.seed}, device {self.device}, backends {','.join(self.backends)}"
                 + (", LORA_OPS_DEBUG=1" if self.debug else "")
                 + f": {self.cases} cases in {self.seconds:.1f} s "
                 + "(" + ", ".join(f"{op} {n}" for op, n in sorted(self.ops.items())) + " calls)"]
        for b in self.backends:
            for op in [None] + sorted(self.ops):  # the backend's total, then per op
                n = {o: sum(v for (b2, op2, o2), v in self.counts.items() if b2 == b and o2 == o and op in (None, op2))
                     for o in OUTCOMES}
                lines.append(f"  {b if op is None else '  ' + op:18s}" + "  ".join(f"{o} {n[o]}" for o in OUTCOMES))
        for f in self.failures[:50]:
            lines.append(f"{f.outcome} case seed {f.seed} on {f.backend}: {f.detail}")
            if f.call:
                lines.append(f"    call: {f.call}")
            lines.append(f"    reproduce: {self.reproduce(f)}")
        if len(self.failures) > 50:
            lines.append(f"... and {len(self.failures) - 50} more")
        return "\n".join(lines)


def _child_command() -> List[str]:
    # This package is `tests.fuzz` (python -m tests.fuzz) or `fuzz` (pytest puts tests/ on sys.path).
    root = Path(__file__).resolve().parents[len(__package__.split("."))]
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); "
                                  f"from {__package__}.child import serve; serve()"]


def _child_env(device: str, debug: bool) -> dict:
    env = dict(os.environ)
    repo = str(Path(lora_ops.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # Triton runs on CPU tensors only under the interpreter
    else:
        env.pop("TRITON_INTERPRET", None)
    if debug:
        env["LORA_OPS_DEBUG"] = "1"
    else:
        env.pop("LORA_OPS_DEBUG", None)
    return env


@dataclasses.dataclass
class _ChildRun:
    done: Dict[int, dict]
    running: Optional[Tuple[int, str]]  # (seed, backend) of the call in progress when the child died or hung
    returncode: int
    hung: bool
    tail: List[str]


def _run_child(seeds: List[int], device: str, backends: List[str], large: bool, debug: bool, timeout: float,
               deadline: float) -> _ChildRun:
    proc = subprocess.Popen(_child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=_child_env(device, debug), text=True)
    job = dict(seeds=seeds, device=device, backends=backends, large=large, debug=debug, deadline=deadline)
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.close()
    done: Dict[int, dict] = {}
    running = None
    tail = collections.deque(maxlen=40)
    hung = False
    answer_by = time.time() + timeout  # the child's start-up (imports) gets one call's time too
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = answer_by - time.time()
            if left <= 0:
                hung = True
                proc.kill()
                break
            if not sel.select(timeout=left):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            if not line.startswith(child.PREFIX):
                tail.append(line.rstrip())
                continue
            rec = json.loads(line[len(child.PREFIX):])
            if "start" in rec:
                running = (rec["start"], rec["backend"])
            elif "done" in rec:
                done[rec["done"]] = rec["results"]
                running = None
            answer_by = time.time() + timeout
    returncode = proc.wait()
    return _ChildRun(done, running, returncode, hung, list(tail))


def _death(run: _ChildRun) -> str:
    if run.hung:
        return "HANG"
    if run.returncode < 0:
        return f"killed by signal {-run.returncode}"
    return f"exit code {run.returncode}"


def fuzz(seed: int, *, seconds: Optional[float] = None, cases: Optional[Iterable[int]] = None, device: str = "cpu",
         backends: Optional[List[str]] = None, large: bool = False, debug: bool = False, timeout: float = 120.0,
         batch: int = 500, log=None) -> Report:
    """Run cases seed, seed + 1, ... for `seconds` (or exactly the case seeds `cases`) on every backend."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fuzz: --device cuda needs a CUDA GPU")
    backends = backends or child.available_backends(device)
    report = Report(seed, device, backends, debug)
    queue = collections.deque(cases if cases is not None else [])
    next_seed = seed
    start = time.time()
    deadline = start + seconds if seconds is not None else float("inf")
    while time.time() < deadline:
        if cases is None:
            while len(queue) < batch:
                queue.append(next_seed)
                next_seed += 1
        if not queue:
            break
        seeds = [queue.popleft() for _ in range(min(batch, len(queue)))]
        run = _run_child(seeds, device, backends, large, debug, timeout, deadline)
        for s in seeds:
            if s in run.done:
                report.record(s, run.done[s])
        unfinished = [s for s in seeds if s not in run.done]
        if run.running is not None:  # died or hung inside a call
            _record_death(report, run, device, large, debug, timeout)
            unfinished.remove(run.running[0])
        elif run.returncode not in (0, 3):  # died between calls, e.g. compute-sanitizer's error exit code
            _record_death_between_calls(report, run, seeds, device, backends, large, debug, timeout)
        if run.returncode != 0 or run.hung:  # 0 with cases left: the time is up
            queue.extendleft(reversed(unfinished))
        if log:
            bad = sum(n for (_, _, o), n in report.counts.items() if o in BAD)
            log(f"fuzz: {report.cases} cases, {len(report.failures)} failures ({bad} bad calls), "
                f"{time.time() - start:.0f} s")
    report.seconds = time.time() - start
    return report


def _record_death(report: Report, run: _ChildRun, device, large, debug, timeout) -> None:
    """CRASH or HANG of the call in progress; re-run alone (fresh process) to tell whether it needs no history."""
    seed, backend = run.running
    outcome = "HANG" if run.hung else "CRASH"
    alone = _run_child([seed], device, [backend], large, debug, timeout, float("inf"))
    again = "again when run alone" if alone.running is not None else "not when run alone: depends on earlier cases"
    op = cases.case_op(seed)
    report.counts[backend, op, outcome] += 1
    report.ops[op] += 1
    report.cases += 1
    report.failures.append(Failure(seed, backend, outcome, f"{_death(run)} ({again})" + _tail(run)))


def _record_death_between_calls(report: Report, run: _ChildRun, seeds, device, backends, large, debug,
                                timeout, max_reruns: int = 64) -> None:
    """The child finished its calls, then failed (compute-sanitizer's --error-exitcode, say): the cases whose call
    reported a CUDA error are the culprits; without one, re-run the cases one by one to find which reproduce it."""
    done = [s for s in seeds if s in run.done]
    culprits = [s for s in done if any("CUDA error" in r[1] for r in run.done[s].values())]
    if not culprits:
        done = done[:max_reruns]
        culprits = [s for s in done
                    if _run_child([s], device, backends, large, debug, timeout, float("inf")).returncode]
    detail = f"child {_death(run)} after its calls; " + (
        f"alone, case seed(s) {culprits} reproduce it" if culprits else
        f"no case of seeds {seeds[0]}..{seeds[-1]} reproduces it alone (first {len(done)} tried)")
    report.failures.append(Failure(culprits[0] if culprits else seeds[0], ",".join(backends), "CRASH",
                                   detail + _tail(run)))


def _tail(run: _ChildRun) -> str:
    return ("\n    child output:\n      " + "\n      ".join(run.tail[-15:])) if run.tail else ""
