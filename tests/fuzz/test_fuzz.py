"""The fuzzer's short run, part of the README's test command: ~40 s of random calls on the CPU backend and on
Triton under the interpreter (on a GPU machine also a run on CUDA tensors). A new run seed each time, printed;
LORA_OPS_FUZZ_SEED=<seed> replays a run and LORA_OPS_FUZZ_SECONDS changes its length."""
import os
import time

import pytest

from .run import fuzz


def _seed() -> int:
    return int(os.environ["LORA_OPS_FUZZ_SEED"]) if "LORA_OPS_FUZZ_SEED" in os.environ else time.time_ns() % 2 ** 40


def _short_run(capsys, device: str, seconds: float, timeout: float):
    report = fuzz(_seed(), seconds=float(os.environ.get("LORA_OPS_FUZZ_SECONDS", seconds)), device=device,
                  timeout=timeout)
    with capsys.disabled():  # the seed is printed whatever the outcome
        print("\n" + report.text().splitlines()[0])
    assert report.ok, report.text()
    assert report.cases >= 10, report.text()


def test_fuzz_short_run(capsys):
    _short_run(capsys, "cpu", seconds=40, timeout=120)


@pytest.mark.gpu
def test_fuzz_short_run_cuda(capsys):
    _short_run(capsys, "cuda", seconds=60, timeout=300)
