"""The sm_90a grouped_gemm (csrc/cuda/grouped_gemm_sm90.cu, CUTLASS ptr-array, TMA + wgmma), forced with
LORA_OPS_CUDA_GG_KERNEL=sm90 over inputs it can take (fp16/bf16 throughout, rows of each segment contiguous, 16-byte
aligned bases and strides), against the float64 oracle: both tile configurations (cooperative 128 x 256 for groups
of > 128 rows, pingpong 64 x 128 otherwise), invalid slots and garbage metadata, weights as slices of a NaN-filled
pool, determinism, CUDA-graph capture, the fallback of per-slot n_l/k_l, of K = 0 and of N or K not a multiple
of 8 (on the H200 the TMA tiles wrote up to 8-element multiples past n_l), and
the issue's two GEMM shapes (13: 8 x 512 x 4096 x 4096, 64 x 128 x 2048 x 1408) in bf16 and fp16.

The profiler names the kernels a call launched, so each test also asserts that the sm90 path (its prep kernel
and CUTLASS's kernel with the expected schedule) ran, or, for an input it cannot take, that it did not and the
result is still right."""
import pytest
import torch

import lora_ops
from lora_ops import backends, op_table, testing

from conftest import case_generator, cuda_kernel_names, misaligned
from grid import _grouped_runs

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
PREP = "grouped_gemm_sm90_prep_kernel"


def _sm90_available():
    info = backends.build_info().get("backends", {}).get("cuda", {})
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    if not info.get("grouped_gemm_sm90", {}).get("built"):
        pytest.skip(f"the sm_90a grouped_gemm is not built: {info.get('grouped_gemm_sm90', {}).get('reason')}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"sm_90a code needs a 9.0 device, not {torch.cuda.get_device_capability()}")


@pytest.fixture
def sm90(monkeypatch):
    _sm90_available()
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "sm90")


def _ran_sm90(kernels, schedule=None):
    """The call ran the prep kernel and CUTLASS's grouped kernel (with `schedule` in its name, when given). The
    profiler may report the names mangled (`_ZN7cutlass13device_kernel...`) or demangled."""
    cutlass = [k for k in kernels if "cutlass" in k and "device_kernel" in k]
    return any(PREP in k for k in kernels) and bool(cutlass) and all(schedule in k for k in cutlass if schedule)


def _check(problem, schedule=None):
    """'' when the forced sm90 kernel ran (with `schedule`) and matches the oracle, else why not. Under
    compute-sanitizer, where the profiler is blind (no kernel names), only what it computed is checked."""
    err, kernels = cuda_kernel_names(lambda: testing.run_and_check(lora_ops.ops.grouped_gemm, problem))
    if kernels and not _ran_sm90(kernels, schedule):
        return f"the sm90 kernel{' (' + schedule + ')' if schedule else ''} did not run: {sorted(kernels)}"
    return err


def _poison(problem):
    if not problem.accumulate:
        problem.y.fill_(float("nan"))  # every element the op must write starts as NaN
    return problem


# name -> (contiguous token slots(gen), make_grouped_gemm kwargs); K and N multiples of 8, no per-slot sizes (what
# the sm90 kernel takes). num_groups defaults to 5.
SM90_CASES = {
    "small_groups": lambda g: (_grouped_runs([(0, 40), (1, 3), (3, 70), (2, 1)]), dict(K=136, N=72)),
    "cooperative_tiles": lambda g: (_grouped_runs([(1, 300), (0, 517), (4, 260)]), dict(K=200, N=520, alpha=0.5)),
    "overwrite": lambda g: (_grouped_runs([(0, 150), (2, 99)]), dict(K=128, N=136, accumulate=False, alpha=-1.25)),
    "bad_slots": lambda g: (_grouped_runs([(0, 30), (-1, 40), (2, 50), (5, 20), (1, 30), (7, 10)]),
                            dict(K=128, N=128)),
    "skewed": lambda g: (_grouped_runs([(0, 1000), (1, 10), (2, 10), (3, 10)]), dict(K=256, N=256)),
    "pool_slices": lambda g: (_grouped_runs([(0, 200), (1, 190), (3, 180)]),
                              dict(K=192, N=264, pad=8)),
    "alpha_accumulate": lambda g: (_grouped_runs([(1, 129), (3, 257)]), dict(K=384, N=256, alpha=-1.7)),
}
SCHEDULE = {"cooperative_tiles": "Cooperative", "skewed": "Cooperative", "pool_slices": "Cooperative",
            "alpha_accumulate": "Cooperative", "small_groups": "Pingpong", "bad_slots": "Pingpong"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SM90_CASES))
def test_sm90_over_its_grid(sm90, name, dtype):
    gen = case_generator(f"sm90-{name}")
    token_lora, kw = SM90_CASES[name](gen)
    kw.setdefault("num_groups", 5)
    problem = _poison(testing.make_grouped_gemm(token_lora, dtype=dtype, device="cuda", gen=gen, gathered=False,
                                                **kw))
    assert _check(problem, SCHEDULE.get(name)) == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sm90_y_column_slice(sm90, dtype):
    """y a 16-byte aligned column slice of a wider tensor: the columns around it stay bitwise untouched."""
    gen = case_generator("sm90-y-slice")
    problem = testing.make_grouped_gemm(_grouped_runs([(0, 100), (1, 60)]), num_groups=2, K=128, N=136, dtype=dtype,
                                        device="cuda", gen=gen, gathered=False)
    problem.y = torch.randn(160, 160, generator=gen).to(dtype).cuda()[:, 8:144]
    assert _check(problem) == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sm90_garbage_metadata(sm90, dtype):
    """seg_indptr outside [0, T] and decreasing, slots outside [0, L): clamped as in every kernel (compute-sanitizer
    runs this one: no access outside the tensors)."""
    gen = case_generator("sm90-garbage")
    problem = testing.make_grouped_gemm(torch.zeros(300, dtype=torch.int32), num_groups=3, K=128, N=136,
                                        dtype=dtype, device="cuda", gen=gen, gathered=False)
    problem.seg_indptr = torch.tensor([-7, 100, 40, 250, 1 << 30, 5], dtype=torch.int32, device="cuda")
    problem.seg_weight = torch.tensor([1, 0, 2, -1, 3], dtype=torch.int32, device="cuda")
    assert _check(problem) == ""


def test_sm90_ineligible_inputs_fall_back(monkeypatch):
    """Forced sm90 on what it cannot take (token_indices, a misaligned base, fp32 x, per-slot n_l/k_l with tails
    and zeros, N and K not multiples of 8, K = 0 with a NaN alpha) runs another kernel, right."""
    _sm90_available()
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "sm90")
    gen = case_generator("sm90-fallback")
    gathered = testing.make_grouped_gemm(testing.random_token_slots(300, [0, 1, 2], gen), num_groups=3, K=128,
                                         N=136, dtype=torch.bfloat16, device="cuda", gen=gen)
    unaligned_x = testing.make_grouped_gemm(_grouped_runs([(0, 100), (1, 100)]), num_groups=2, K=128, N=136,
                                           dtype=torch.bfloat16, device="cuda", gen=gen, gathered=False)
    unaligned_x.x = misaligned(unaligned_x.x)
    fp32_x = testing.make_grouped_gemm(_grouped_runs([(0, 100), (1, 100)]), num_groups=2, K=128, N=136,
                                       dtype=torch.bfloat16, device="cuda", gen=gen, gathered=False,
                                       x_dtype=torch.float32)
    sizes = testing.make_grouped_gemm(_grouped_runs([(0, 90), (1, 77), (2, 130), (3, 64), (4, 33)]), num_groups=5,
                                      K=264, N=392, n_sizes=[392, 129, 0, 37, 1], k_sizes=[264, 65, 3, 0, 131],
                                      dtype=torch.bfloat16, device="cuda", gen=gen, gathered=False)
    k_zero = testing.make_grouped_gemm(_grouped_runs([(0, 60), (1, 70), (2, 80), (3, 20)]), num_groups=5, K=128,
                                       N=136, accumulate=False, n_sizes=[136, 100, 7, 136, 1],
                                       k_sizes=[128, 0, 0, 9, 0], dtype=torch.bfloat16, device="cuda", gen=gen,
                                       gathered=False)
    odd = testing.make_grouped_gemm(_grouped_runs([(0, 100), (1, 100)]), num_groups=2, K=132, N=140,
                                    dtype=torch.bfloat16, device="cuda", gen=gen, gathered=False, pad=4)
    empty = testing.make_grouped_gemm(_grouped_runs([(0, 70), (-1, 30), (1, 90)]), num_groups=2, K=0, N=136,
                                      accumulate=False, alpha=float("nan"), dtype=torch.bfloat16, device="cuda",
                                      gen=gen, gathered=False)
    for problem in (gathered, unaligned_x, fp32_x, sizes, k_zero, odd, empty):
        err, kernels = cuda_kernel_names(lambda: testing.run_and_check(lora_ops.ops.grouped_gemm, problem))
        assert not any(PREP in k for k in kernels), sorted(kernels)
        assert err == ""


def _issue_problem(groups, rows, K, N, dtype, key):
    """The issue's GEMM shape: `groups` contiguous segments of `rows` rows, one weight each."""
    gen = case_generator(key)
    x = torch.randn(groups * rows, K, generator=gen).to(dtype)
    w = (torch.randn(groups, N, K, generator=gen) / K ** 0.5).to(dtype)
    y = torch.randn(groups * rows, N, generator=gen).to(dtype)
    indptr = torch.arange(groups + 1, dtype=torch.int32) * rows
    return testing.GroupedGemmProblem(y.cuda(), x.cuda(), w.cuda(), indptr.cuda(),
                                      torch.arange(groups, dtype=torch.int32).cuda())


ISSUE_SHAPES = {"8x512x4096x4096": (8, 512, 4096, 4096, "Cooperative"),
                "64x128x2048x1408": (64, 128, 2048, 1408, "Pingpong")}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(ISSUE_SHAPES))
def test_sm90_issue_shapes_against_the_oracle(shape, dtype, monkeypatch):
    """The automatic choice (op table off: the C++ kernels themselves) takes the sm90 kernel at both shapes."""
    _sm90_available()
    monkeypatch.delenv("LORA_OPS_CUDA_GG_KERNEL", raising=False)
    groups, rows, K, N, schedule = ISSUE_SHAPES[shape]
    problem = _issue_problem(groups, rows, K, N, dtype, f"sm90-{shape}")
    with op_table.disabled():
        assert _check(problem, schedule) == ""


@pytest.mark.parametrize("name", ["cooperative_tiles", "pool_slices", "small_groups"])
def test_sm90_bitwise_deterministic(sm90, name):
    gen = case_generator(f"sm90-det-{name}")
    token_lora, kw = SM90_CASES[name](gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=5, dtype=torch.bfloat16, device="cuda", gen=gen,
                                        gathered=False, **kw)
    outs = []
    for _ in range(3):
        y = problem.y.clone()
        lora_ops.ops.grouped_gemm(*problem.args(y))
        outs.append(y)
    assert all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs[1:])


@pytest.mark.parametrize("name", ["cooperative_tiles", "overwrite"])
def test_sm90_cuda_graph_replay(sm90, name):
    """Captured once (no host sync, no host read of device metadata; workspace from the caching allocator),
    replayed on fresh y values and new metadata values written in place."""
    gen = case_generator(f"sm90-graph-{name}")
    token_lora, kw = SM90_CASES[name](gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=5, dtype=torch.bfloat16, device="cuda", gen=gen,
                                        gathered=False, **kw)
    y = problem.y.clone()
    graph = testing.capture_grouped_gemm(lora_ops.ops.grouped_gemm, problem, y)
    fresh = torch.randn(y.shape, generator=gen).to(y.dtype).cuda()
    y.copy_(fresh)
    problem.seg_weight.copy_(problem.seg_weight.flip(0))  # the replay reads the metadata on the device
    graph.replay()
    expected = fresh.clone()
    lora_ops.ops.grouped_gemm(*problem.args(expected))
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
