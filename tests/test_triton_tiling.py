"""The multi-block grid cases really span several tiles of the Triton kernels, as launched.

CI runs the Triton kernels under the interpreter on small shapes; a kernel that drops the K accumulation across
K blocks, a column block, or the column split of a wide slice is only caught by a case that reaches them. These
tests record the launch of each multi-block case, check its result against the oracle, and assert that the
launch did use several K blocks, several column blocks and (sgmv) N_SPLITS > 1: if the config table changes so
that a case stops reaching them, this fails instead of the coverage silently going away."""
import pytest
import torch

from lora_ops import testing

from conftest import HAS_CUDA, case_generator, triton_backend
from grid import GG_CASES, SGMV_CASES

DEVICE = "cuda" if HAS_CUDA else "cpu"
# On a GPU machine these launch the compiled kernels with the GPU's configs: marked gpu there, so that the GPU runs
# (`-m gpu`, scripts/gpu_run.sh) include them; without CUDA they run under the interpreter in CI.
pytestmark = [pytest.mark.gpu] if HAS_CUDA else []


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records (grid, constexpr/config kwargs) of each launch, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _record(monkeypatch, lt, kernel_name):
    recorder = LaunchRecorder(getattr(lt, kernel_name))
    monkeypatch.setattr(lt, kernel_name, recorder)
    return recorder


@pytest.mark.parametrize("name", ["multi_block", "multi_block_slices", "multi_block_y_float32"])
def test_sgmv_multi_block_cases_reach_every_tiling_path(name, monkeypatch):
    lt = triton_backend()
    recorder = _record(monkeypatch, lt, "sgmv_kernel")
    gen = case_generator(name)
    token_lora, kw = SGMV_CASES[name](gen)
    problem = testing.make_sgmv(token_lora, num_slots=6, dtype=torch.float32, device=DEVICE, gen=gen, **kw)
    assert testing.run_and_check(lt.sgmv, problem) == ""

    (grid, cfg), = recorder.launches
    offsets = problem.slice_offsets or [0, problem.y.shape[1]]
    widest = max(b - a for a, b in zip(offsets, offsets[1:]))
    assert cfg["N_SPLITS"] > 1, f"no column split: {cfg}"
    assert grid[1] == (len(offsets) - 1) * cfg["N_SPLITS"]
    assert problem.x.shape[1] > cfg["BLOCK_K"], f"one K block: K = {problem.x.shape[1]}, {cfg}"
    assert widest > cfg["N_SPLITS"] * cfg["BLOCK_N"], f"one column block per split: widest slice {widest}, {cfg}"


@pytest.mark.parametrize("name", ["multi_block", "multi_block_sizes"])
def test_grouped_gemm_multi_block_cases_reach_every_tiling_path(name, monkeypatch):
    lt = triton_backend()
    recorder = _record(monkeypatch, lt, "grouped_gemm_kernel")
    gen = case_generator(name)
    token_lora, kw = GG_CASES[name](gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=5, dtype=torch.float32, device=DEVICE, gen=gen, **kw)
    assert testing.run_and_check(lt.grouped_gemm, problem) == ""

    (grid, cfg), = recorder.launches
    assert grid[1] > 2, f"fewer than three column blocks: grid {grid}, {cfg}"
    assert problem.x.shape[1] > 2 * cfg["BLOCK_K"], f"fewer than three K blocks: K = {problem.x.shape[1]}, {cfg}"
