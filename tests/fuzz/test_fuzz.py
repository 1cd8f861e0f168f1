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


def test_fold_linear_cases_fail_a_wrong_product_and_a_changed_input():
    """The judgement of fold_linear's cases: F.linear passes; a product off by 5% (above every dtype's tolerance),
    a wrong shape and a call that writes into x fail."""
    import torch.nn.functional as F

    from . import cases

    seed = next(s for s in range(10_000) if cases.case_op(s) == "fold_linear"
                and cases.make_case(s, "cpu").kwargs["x"].numel() > 0
                and cases.make_case(s, "cpu").kwargs["weight"].shape[0] > 0)

    def judged(call):
        case = cases.make_case(seed, "cpu")
        return cases.judge(case, lambda: call(**case.kwargs), debug=False)[0]

    def writes_x(x, weight, bias):
        out = F.linear(x, weight, bias)
        x[..., 0] += 1  # any strides
        return out

    assert judged(F.linear) == "OK"
    assert judged(lambda x, weight, bias: F.linear(x, weight, bias) * 1.05) == "FAIL"
    assert judged(lambda x, weight, bias: F.linear(x, weight, bias)[..., 1:]) == "FAIL"
    assert judged(writes_x) == "FAIL"
