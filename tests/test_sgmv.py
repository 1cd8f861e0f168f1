import os
import re
import subprocess
import sys

import pytest
import torch

import lora_ops
from lora_ops import backends, op_table, reference, testing
from lora_ops.bench import ops as bench_ops

from conftest import Impl, case_generator, cuda_kernel_names, repeat_runs
from grid import SGMV_CASES, SGMV_LARGE_CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _problem(case, impl, dtype, key):
    gen = case_generator(key)
    token_lora, kw = case(gen)
    kw.setdefault("num_slots", 6)
    return testing.make_sgmv(token_lora, dtype=dtype, device=impl.device, gen=gen, **kw)


def _run_and_check(impl, problem):
    return testing.run_and_check(impl.module.sgmv, problem)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_CASES))
def test_sgmv_parity(impl, name, dtype):
    if dtype not in impl.dtypes:
        pytest.skip(f"{impl.name} is tested in {impl.dtypes} only")
    problem = _problem(SGMV_CASES[name], impl, dtype, key=name)
    assert _run_and_check(impl, problem) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_LARGE_CASES))
def test_sgmv_parity_large(impl, name, dtype):
    if impl.device != "cuda":
        pytest.skip("GPU-sized case")
    problem = _problem(SGMV_LARGE_CASES[name], impl, dtype, key=name)
    assert _run_and_check(impl, problem) == ""


def test_sgmv_int64_indices(impl):
    dtype = impl.dtypes[0]
    problem = _problem(SGMV_CASES["mixed_ranks"], impl, dtype, key=3)
    problem.seg_indptr, problem.seg_lora = problem.seg_indptr.long(), problem.seg_lora.long()
    problem.token_indices, problem.lora_ranks = problem.token_indices.long(), problem.lora_ranks.long()
    assert _run_and_check(impl, problem) == ""


def test_sgmv_per_token_routing(impl):
    """BGMV: one segment per row, seg_lora = token_lora (with -1 rows)."""
    dtype = impl.dtypes[0]
    gen = case_generator(11)
    token_lora = testing.random_token_slots(19, [0, 1, -1, 3], gen)
    problem = testing.make_sgmv(token_lora, num_slots=4, K=24, N=20, max_rank=8, dtype=dtype, device=impl.device,
                                gen=gen, gathered=False)
    problem.seg_indptr = torch.arange(20, dtype=torch.int32, device=impl.device)
    problem.seg_lora = token_lora.to(impl.device)
    assert _run_and_check(impl, problem) == ""


def test_sgmv_garbage_metadata(impl):
    _check_garbage_metadata(impl, impl.dtypes[0])


def _check_garbage_metadata(impl, dtype):
    """Out-of-range indptr, reversed segments, rows outside [0, T), huge slots: skipped/clamped, never OOB."""
    gen = case_generator(5)
    T = 16
    problem = testing.make_sgmv(torch.zeros(T, dtype=torch.int32), num_slots=3, K=20, N=12, max_rank=4,
                                dtype=dtype, device=impl.device, gen=gen)
    dev = impl.device
    problem.token_indices = torch.tensor([3, -5, 7, T + 7, 1, 2, 1 << 30, 9, 0, 4, 5, 6, 8, 10, 11, 12],
                                         dtype=torch.int32, device=dev)
    problem.seg_indptr = torch.tensor([-4, 3, 1, 9, 1 << 30], dtype=torch.int32, device=dev)
    problem.seg_lora = torch.tensor([0, 1, -1, 2], dtype=torch.int32, device=dev)
    problem.lora_ranks = torch.tensor([4, 99, -3], dtype=torch.int32, device=dev)
    assert _run_and_check(impl, problem) == ""
    problem.seg_lora = torch.tensor([1 << 30, -(1 << 30), 7, 3], dtype=torch.int32, device=dev)
    assert _run_and_check(impl, problem) == ""


def test_sgmv_deterministic(impl):
    dtype = impl.dtypes[-1]
    problem = _problem(SGMV_CASES["mixed_ranks"], impl, dtype, key=21)
    def run():
        y = problem.y.clone()
        impl.module.sgmv(*problem.args(y))
        return y
    outs = repeat_runs(impl, run)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# The CUDA sgmv kernels the tests force, by the variables that force them: the decode regime's split kernel and the
# bench's forced prefill kernels (wgmma: the wgmma kernel's tiles of positions by the automatic choice; -rows64,
# -rows128: at a rank tile of 128, tiles of 64 positions (one warpgroup) or 128 (two) at any batch size).
FORCED_KERNELS = {"split": {"LORA_OPS_CUDA_SGMV_KERNEL": "split"},
                  **{name.removeprefix("cuda-"): variables for name, variables in bench_ops.FORCED_PREFILL.items()}}
KERNEL_VARIABLES = {"LORA_OPS_CUDA_SGMV_CLUSTER"} | {v for variables in FORCED_KERNELS.values() for v in variables}


def _force_kernel(kernel, monkeypatch):
    """Sets the variables that force `kernel` (None: the automatic choice) and clears the others."""
    if backends.cuda_served_by.get("sgmv") != "cuda":
        pytest.skip("the CUDA sgmv kernels are not built")
    if kernel and kernel.startswith("wgmma") and not backends.sm90_kernels_run():
        pytest.skip("the sm_90a kernels are not built or this GPU is not 9.0")
    for variable in KERNEL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in FORCED_KERNELS.get(kernel, {}).items():
        monkeypatch.setenv(variable, value)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "mma", "wgmma", "wgmma-rows128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_CASES) + list(SGMV_LARGE_CASES) + ["garbage_metadata"])
def test_sgmv_each_cuda_kernel(name, dtype, kernel, monkeypatch):
    """Every CUDA sgmv kernel over the whole grid, not only where the automatic choice puts it on this GPU
    (a preferred kernel that cannot take an input leaves it to the automatic choice)."""
    _force_kernel(kernel, monkeypatch)
    cuda = Impl("cuda", "cuda", lora_ops.ops, DTYPES)
    if name == "garbage_metadata":
        _check_garbage_metadata(cuda, dtype)
        return
    problem = _problem({**SGMV_CASES, **SGMV_LARGE_CASES}[name], cuda, dtype, key=name)
    assert _run_and_check(cuda, problem) == ""


# Prefill shapes that take each path of the tensor-core kernel (sgmv_mma.cu) on Hopper (up to 256 SMs; a K of 64 *
# 4 * C elements or more gives clusters of C CTAs, at most 8): rank 128 (a 128-wide rank tile, ranks that end
# inside a 16-byte chunk, a K tail) in clusters of 8, 4 and 2 and in none, two slices sharing a 128-wide rank tile
# (each warp's rank share one slice; a batch long enough, 512 tiles, to keep them grouped), a short fused QKV batch
# split into one group per slice, and a longer one whose 3 slices share one block-diagonal rank tile.
MMA_PATH_CASES = {
    "rank128_clustered": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3], g),
                                    dict(K=4104, N=1000, max_rank=128, num_slots=4, ranks=[128, 100, 7, 0],
                                         y_col_pad=16)),
    "rank128_cluster_of_4": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3], g),
                                       dict(K=1024, N=1000, max_rank=128, num_slots=4, ranks=[128, 100, 7, 0])),
    "rank128_cluster_of_2": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3], g),
                                       dict(K=512, N=1000, max_rank=128, num_slots=4, ranks=[128, 100, 7, 0])),
    # 64 tiles in clusters of 8 outnumber the clusters an H100/H200 holds at once: fit_one_wave narrows them
    "rank128_narrowed_to_one_wave": lambda g: (testing.random_token_slots(4096, [0, 1, 2, 3], g),
                                               dict(K=4096, N=1000, max_rank=128, num_slots=4,
                                                    ranks=[128, 100, 7, 0])),
    "rank128_one_cta": lambda g: (testing.random_token_slots(600, [0, 1, 2, 3, -1], g),
                                  dict(K=264, N=1000, max_rank=128, num_slots=4, ranks=[128, 71, 0, 16])),
    "two_slices_rank_tile_128": lambda g: (testing.random_token_slots(512 * 64, [0, 1, 2], g),
                                           dict(K=200, N=528, max_rank=64, num_slots=3, ranks=[64, 40, 9],
                                                slice_offsets=[0, 264, 528])),
    "qkv_short_batch_split": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3, -1], g),
                                        dict(K=4096, N=3072, max_rank=16, num_slots=4,
                                             slice_offsets=[0, 1024, 2048, 3072])),
    "qkv_shared_rank_tile": lambda g: (testing.random_token_slots(2560, [0, 1, 2, 3], g),
                                       dict(K=4096, N=3072, max_rank=32, num_slots=4, ranks=[32, 9, 16, 0],
                                            slice_offsets=[0, 2048, 2560, 3072])),
    # Rank tiles 16 and 64 (the cluster sum beside the early expand's loads in flight, and at offset 0 where the
    # early expand does not fit): the fewest fragments a thread, so the most uneven last share in clusters of 3-7.
    "rank16_tile": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3], g),
                              dict(K=2056, N=1000, max_rank=16, num_slots=4, ranks=[16, 9, 1, 0])),
    "rank64_tile": lambda g: (testing.random_token_slots(1024, [0, 1, 2, 3], g),
                              dict(K=2056, N=1000, max_rank=64, num_slots=4, ranks=[64, 33, 5, 0])),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "wgmma-rows64", "wgmma-rows128"])
@pytest.mark.parametrize("y_dtype", [None, torch.float32], ids=["y_like_x", "y_float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MMA_PATH_CASES))
def test_sgmv_mma_paths(name, dtype, y_dtype, kernel, monkeypatch):
    """Each prefill tensor-core kernel against the oracle, and bitwise the same on a second run (the cluster's h
    sum). The wgmma kernel (sm_90a) takes y of x's dtype; a float32 y stays on mma.sync's. At a rank tile of 128 it
    runs its two-warpgroup instance (the last template argument of the kernel's name) forced, or from 3072 positions
    on (kWgmmaMinPositions). The rank tile is 128 for ranks above 64 and for the two rank-64 slices that 512
    tiles keep together; the fused QKV of rank 32 has one where the GPU's SM count keeps its 3 slices together."""
    _force_kernel(kernel, monkeypatch)
    gen = case_generator(name)
    token_lora, kw = MMA_PATH_CASES[name](gen)
    problem = testing.make_sgmv(token_lora, dtype=dtype, device="cuda", gen=gen, y_dtype=y_dtype, **kw)
    again = problem.y.clone()
    _, ran = cuda_kernel_names(lambda: lora_ops.ops.sgmv(*problem.args(problem.y.clone())))
    if kernel.startswith("wgmma") and y_dtype is None:
        rank_tile_128 = kw["max_rank"] > 64 or name == "two_slices_rank_tile_128"
        rows128 = {"wgmma": token_lora.numel() >= 3072, "wgmma-rows64": False, "wgmma-rows128": True}[kernel]
        warpgroups = "2" if rank_tile_128 and rows128 else "[12]" if name == "qkv_shared_rank_tile" and rows128 else "1"
        wanted = re.compile(rf"sgmv_wgmma_kernel<[^>]*, {warpgroups}>")
    else:
        wanted = re.compile("sgmv_mma_kernel")
    assert not ran or any(wanted.search(kernel_name) for kernel_name in ran), ran
    assert _run_and_check(Impl("cuda", "cuda", lora_ops.ops, DTYPES), problem) == ""
    lora_ops.ops.sgmv(*problem.args(again))
    assert torch.equal(again, problem.y)


# The automatic choice's bounds (csrc/cuda/kernels.h: kWgmmaMinRankTile = 64, kWgmmaMinPositions = 3072) on sm_90a:
# (positions, rank, the kernel instance that runs); elsewhere mma.sync's runs throughout.
AUTO_CHOICE_CASES = [(3071, 128, "sgmv_mma_kernel"), (3072, 128, r"sgmv_wgmma_kernel<[^>]*, 2>"),
                     (3071, 64, "sgmv_mma_kernel"), (3072, 64, r"sgmv_wgmma_kernel<[^>]*, 1>"),
                     (4096, 32, "sgmv_mma_kernel")]


@pytest.mark.gpu
@pytest.mark.parametrize("positions, rank, wanted", AUTO_CHOICE_CASES)
def test_sgmv_prefill_automatic_choice_takes_each_kernel_within_its_bounds(positions, rank, wanted, monkeypatch):
    _force_kernel(None, monkeypatch)
    if not backends.sm90_kernels_run():
        wanted = "sgmv_mma_kernel"
    gen = case_generator(f"auto-{positions}-{rank}")
    problem = testing.make_sgmv(testing.random_token_slots(positions, [0, 1, 2, 3], gen), num_slots=4, K=256, N=320,
                                max_rank=rank, dtype=torch.bfloat16, device="cuda", gen=gen)
    with op_table.disabled():  # the C++ kernels, not the regimes the table gives Triton
        _, ran = cuda_kernel_names(lambda: lora_ops.ops.sgmv(*problem.args(problem.y.clone())))
        assert not ran or any(re.search(wanted, kernel_name) for kernel_name in ran), ran
        assert _run_and_check(Impl("cuda", "cuda", lora_ops.ops, DTYPES), problem) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [1, 2, 3, 5, 6, 7])
@pytest.mark.parametrize("kernel, y_dtype", [("mma", None), ("mma", torch.float32), ("wgmma", None),
                                             ("wgmma-rows128", None)], ids=["mma", "mma-y_float32", "wgmma",
                                                                            "wgmma-rows128"])
@pytest.mark.parametrize("name", ["rank128_clustered", "rank128_one_cta", "qkv_shared_rank_tile", "rank16_tile",
                                  "rank64_tile"])
def test_sgmv_prefill_forced_cluster_sizes(name, kernel, y_dtype, cluster, monkeypatch):
    """The prefill kernels in clusters of sizes the one-wave rule may pick on some GPU (any count up to 8: the h
    sum's last member takes a shorter share; members past the end of K or of the columns take none; in pairs half
    the sum's traffic is a member's own), forced (LORA_OPS_CUDA_SGMV_CLUSTER), against the oracle; a float32 y (the
    sum kept in float32 for the hi + lo split) on mma.sync, which is where it runs."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    _force_kernel(kernel, monkeypatch)
    monkeypatch.setenv("LORA_OPS_CUDA_SGMV_CLUSTER", str(cluster))
    gen = case_generator(f"{name}-cluster-{cluster}")
    token_lora, kw = MMA_PATH_CASES[name](gen)
    problem = testing.make_sgmv(token_lora, dtype=torch.bfloat16, device="cuda", gen=gen, y_dtype=y_dtype, **kw)
    assert _run_and_check(Impl("cuda", "cuda", lora_ops.ops, DTYPES), problem) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, variable, value, expected", [
    ("mma", "LORA_OPS_CUDA_SGMV_CLUSTER", "9", "expected auto, 1, 2"),
    ("mma", "LORA_OPS_CUDA_SGMV_WGMMA_ROWS", "32", "expected auto, 64 or 128"),  # read on either kernel's path
])
def test_sgmv_forced_prefill_setting_out_of_range_is_an_error(kernel, variable, value, expected, monkeypatch):
    _force_kernel(kernel, monkeypatch)
    monkeypatch.setenv(variable, value)
    gen = case_generator(f"{variable}={value}")
    token_lora, kw = MMA_PATH_CASES["rank128_one_cta"](gen)
    problem = testing.make_sgmv(token_lora, dtype=torch.bfloat16, device="cuda", gen=gen, **kw)
    with pytest.raises(ValueError, match=f"{variable} = '{value}': {expected}"):
        lora_ops.ops.sgmv(*problem.args())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "wgmma-rows128"])
def test_prefill_first_call_of_the_process_inside_a_graph_capture(kernel, monkeypatch):
    """A process's first prefill sgmv may come inside a CUDA graph capture, where the launch asks once how many
    clusters the GPU holds (fit_one_wave): the capture holds, and its replay on new inputs matches the oracle."""
    _force_kernel(kernel, monkeypatch)
    code = """if True:
        import torch, lora_ops
        from lora_ops import reference, testing
        gen = torch.Generator().manual_seed(58)
        problem = testing.make_sgmv(testing.random_token_slots(4096, [0, 1, 2, 3], gen), num_slots=4, K=4096,
                                    N=1000, max_rank=128, ranks=[128, 100, 7, 0], dtype=torch.bfloat16,
                                    device="cuda", gen=gen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lora_ops.ops.sgmv(*problem.args(problem.y))
        for t in (problem.x, problem.lora_a, problem.lora_b, problem.y):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) / t.shape[-1] ** 0.5)
        y_before = problem.y.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert testing.check_against_reference(problem.y, y_before, reference.sgmv(*problem.args(y_before)),
                                               torch.bfloat16) == ""
        print("replayed")
    """
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "replayed" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_y_tolerance_fails_an_intermediate_rounded_to_half(dtype):
    """With a float32 y the intermediate h must stay float32 (docs/design.md §2), and the tolerance follows y's dtype:
    the same delta with h rounded once to `dtype` fails the check that the float32 h passes."""
    gen = case_generator("h_rounded_to_half")
    T, K, N, R = 40, 64, 48, 16
    x = torch.randn(T, K, generator=gen).to(dtype)
    lora_a = (torch.randn(1, R, K, generator=gen) / K ** 0.5).to(dtype)
    lora_b = (torch.randn(1, N, R, generator=gen) / R ** 0.5).to(dtype)
    y = torch.randn(T, N, generator=gen)
    ref = reference.sgmv(y, x, lora_a, lora_b, torch.tensor([0, T]), torch.tensor([0]))
    h = x.double() @ lora_a[0].double().T
    with_h = lambda h: (y.double() + h @ lora_b[0].double().T).float()
    assert testing.check_against_reference(with_h(h.float().double()), y, ref, dtype) == ""
    assert "relative error" in testing.check_against_reference(with_h(h.to(dtype).double()), y, ref, dtype)
