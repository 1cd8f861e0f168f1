import functools
import glob
import os
import secrets
import zlib

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter (docs/design.md §5); this must precede importing triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lora_ops  # noqa: E402
from lora_ops import backends, op_table  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def gpu_where_present(test):
    """For a test that runs on the GPU where there is one, else on the CPU (Triton's interpreter): marked gpu there,
    so that the GPU suite (pytest -m gpu) runs it, and unmarked here, so that CI's CPU suite does."""
    return pytest.mark.gpu(test) if HAS_CUDA else test

# Under pytest-xdist each worker would start one torch thread per core for the CPU work (the float64 oracle, the
# inputs): n workers x n threads oversubscribe the machine n times over. Each worker takes its share of the cores.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))

# Run-level seed: every case keeps its own fixed seed, offset by this one. CI leaves LORA_OPS_TEST_SEED unset, so
# each run draws new inputs; the summary prints the value, and LORA_OPS_TEST_SEED=<value> replays that run
# (LORA_OPS_TEST_SEED=0: the fixed per-case seeds alone). Exported so that subprocesses of the tests see it.
RUN_SEED = int(os.environ.get("LORA_OPS_TEST_SEED") or secrets.randbelow(1 << 32))
os.environ["LORA_OPS_TEST_SEED"] = str(RUN_SEED)
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit multiplier: nearby run seeds give unrelated case seeds


def case_seed(key) -> int:
    """The seed of one test case: its fixed key (a name or a number) combined with the run seed."""
    base = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
    return (base + RUN_SEED * _GOLDEN) % (1 << 64)


def case_generator(key) -> torch.Generator:
    return torch.Generator().manual_seed(case_seed(key))


def repeat_runs(impl, run, runs=3):
    """run() `runs` times; on the CPU the k-th with k + 1 intra-op threads (the kernels split their row blocks over
    OpenMP threads: the bits must not depend on how many)."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for k in range(runs):
            if impl.device == "cpu":
                torch.set_num_threads(k + 1)
            outs.append(run())
        return outs
    finally:
        torch.set_num_threads(threads)


def misaligned(t):
    """t's values in a tensor whose data starts one element past a 16-byte boundary (same shape, contiguous)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


@pytest.fixture
def full_precision_reduction():
    """torch's own cuBLAS calls (at::linear, addmm) sum a split K's parts in float32 for the test. torch's default
    lets them sum in bf16/fp16 (allow_*_reduced_precision_reduction), which put 5.9% of a bf16 [96, 2568] product's
    outputs past the tests' tolerance (2-3 ulps off the float64 sum) where an operand was 2 bytes off 16, 0% with
    it off (H100, torch 2.11; benchmarks/bias_epilogue_probe.py): for the tests of lora_ops' numbers on such an ATen
    path, not torch's."""
    matmul = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    # torch's own getter: newer torch keeps a (reduced precision, split K) pair, of which the attribute shows one
    before = {name: getattr(torch._C, f"_get_cublas_{name}")() for name in names}
    for name in names:
        setattr(matmul, name, False)
    yield
    for name, value in before.items():
        setattr(matmul, name, value)


def aten_op_names(f):
    """(f(), the names of the ATen operators it ran, with the other profiler entries beside them), through the
    profiler's CPU activity."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = f()
    return out, {e.key for e in prof.key_averages()}


def cuda_kernel_names(f):
    """(f(), the names of the CUDA kernels it ran, with the runtime calls and profiler entries beside them), through
    the profiler. Under compute-sanitizer, whose CUPTI leaves the profiler blind, the set is empty and the checks of
    which kernel ran skip (say so with LORA_OPS_UNDER_SANITIZER=1, as scripts/gpu_run.sh's memcheck does).
    Anywhere else an empty set fails, so a profiler that records nothing cannot make those checks pass by
    skipping."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = f()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert names or os.environ.get("LORA_OPS_UNDER_SANITIZER") == "1", (
        "the profiler saw no CUDA activity (under compute-sanitizer set LORA_OPS_UNDER_SANITIZER=1)")
    return out, names


@functools.lru_cache(maxsize=None)
def late_copy():
    """copy(src, dst): a Triton kernel that lets its programmatic dependents launch at once
    (griddepcontrol.launch_dependents), sleeps (200 nanosleeps of 1 us per element a thread holds, 8 here: up to
    ~2 ms, nanosleep's duration being a bound, not a promise), then copies src into dst: the worst predecessor for a
    kernel that reads its inputs before griddepcontrol.wait (no kernel of the project may be one). On the H200 the
    sleep has been long enough for the planted bugs that read before the wait to fail these tests."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_after_sleep(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        delay = tl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n mov.u32 $0, $1;", "=r,r", [offs * 0],
                                          dtype=tl.int32, is_pure=False, pack=1)
        for _ in range(200):
            delay = tl.inline_asm_elementwise("nanosleep.u32 1000;\n mov.u32 $0, $1;", "=r,r", [delay],
                                              dtype=tl.int32, is_pure=False, pack=1)
        offs = offs + delay  # the copy waits for the sleep
        for start in range(0, n, BLOCK):
            at = start + offs
            tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)

    return lambda src, dst: copy_after_sleep[(1,)](src, dst, src.numel(), BLOCK=1024)


def _seed_line() -> str:
    return f"lora_ops test seed: LORA_OPS_TEST_SEED={RUN_SEED} replays this run's inputs"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_seed_line())  # also under -q, where the header is not printed


def triton_backend():
    """lora_ops.triton for a test of the Triton backend. Skips (with the reason, listed by -ra) when triton is
    not installed; fails with the import error when it is installed but lora_ops could not load or register it."""
    if backends.triton_error is not None:
        raise RuntimeError(f"the Triton backend is {backends.unavailable['triton']}") from backends.triton_error
    if "triton" in backends.unavailable:
        pytest.skip(f"triton backend absent: {backends.unavailable['triton']}")
    import lora_ops.triton
    return lora_ops.triton


def ascend_model():
    """torch.ops.lora_ops_ascend_model: csrc/ascend's registration, launchers, tiling and kernels on the CPU model of
    the AscendC API, as ops on CPU tensors (a test-only library that setup.py always builds). Nothing there ran on an
    NPU."""
    libs = glob.glob(os.path.join(os.path.dirname(lora_ops.__file__), "_ascend_model*.so"))
    assert libs, "lora_ops/_ascend_model.so is missing: setup.py builds it with _C"
    torch.ops.load_library(libs[0])
    return torch.ops.lora_ops_ascend_model


class Impl:
    """One way to run the ops: through the dispatcher on a device, or the Triton entry points directly."""

    def __init__(self, name, device, module, dtypes):
        self.name, self.device, self.module, self.dtypes = name, device, module, dtypes

    def __repr__(self):
        return self.name


def _impls():
    all_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    impls = [pytest.param(Impl("cpu", "cpu", lora_ops.ops, all_dtypes), id="cpu")]
    # The Triton parameter is always collected, its module resolved by the `impl` fixture: skipped when triton is
    # not installed, failed when it is broken, so that it never drops out of the suite unnoticed.
    if HAS_CUDA:
        impls.append(pytest.param(Impl("triton", "cuda", None, all_dtypes), id="triton", marks=pytest.mark.gpu))
    else:
        # The interpreter mishandles bf16 (docs/design.md §5): fp32 only there.
        impls.append(pytest.param(Impl("triton-interpret", "cpu", None, (torch.float32,)), id="triton-interpret"))
    impls.append(pytest.param(Impl("cuda", "cuda", lora_ops.ops, all_dtypes), id="cuda", marks=pytest.mark.gpu))
    return impls


IMPLS = _impls()

# The Ascend backend on the CPU model, for the test files of the ops it serves: they add it to IMPLS with a
# module-level `impl` fixture that yields from use_impl. Ascend tests fp16 first (the tests that take one dtype use
# impl.dtypes[0], and impl.dtypes[-1] for a float32 h with half weights).
ASCEND_MODEL_IMPL = pytest.param(Impl("ascend-model", "cpu", None, (torch.float16, torch.float32, torch.bfloat16)),
                                 id="ascend-model")


def use_impl(impl):
    """The body of the `impl` fixture: resolves the module of a parameter, then yields it."""
    if impl.module is None:
        impl.module = ascend_model() if impl.name == "ascend-model" else triton_backend()
    if impl.name == "cuda":  # the C++ kernels themselves, not the regimes the op table hands to Triton
        with op_table.disabled():
            yield impl
    else:
        yield impl


@pytest.fixture(params=IMPLS)
def impl(request):
    yield from use_impl(request.param)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
