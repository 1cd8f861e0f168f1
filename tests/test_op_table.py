"""The CUDA kernels' op tables (lora_ops/op_table.py, op_tables/<gpu>.json): built from bench records, covering every
regime, one per GPU model measured and chosen by the GPU without initialising CUDA, looked up alike in Python and in
the C++ kernels, and overridable; on a GPU, the regimes it gives to Triton run Triton's kernels and match the
oracle."""
import glob
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from lora_ops import backends, op_table, reference, testing
from lora_ops.bench import report

from conftest import case_generator, cuda_kernel_names, triton_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _boundary_values(bounds):
    """1, each bound and the value past it, and a huge value: every class edge of an axis."""
    return sorted({1, 1 << 30} | {b for b in bounds} | {b + 1 for b in bounds})


def _regime_points(op):
    return itertools.product(*(_boundary_values(bounds) for _, bounds in op_table.AXES[op]))


PACKAGED = sorted(glob.glob(os.path.join(op_table.TABLES_DIR, "*.json")))


@pytest.mark.parametrize("path", PACKAGED, ids=os.path.basename)
def test_committed_table_covers_every_regime_and_says_where_it_came_from(path):
    table = op_table.load(path)
    for key in ("gpu", "git_sha", "date", "torch", "source"):
        assert table.get(key), f"the table does not say which measurement it came from ({key})"
    assert os.path.basename(path) == f"{op_table.gpu_word(table['gpu'])}.json", "a table is named by its GPU"
    for op in op_table.OPS:
        names = [name for name, _ in op_table.AXES[op]]
        for point in _regime_points(op):
            assert op_table.choice(table, op, **dict(zip(names, point))) in op_table.BACKENDS


@pytest.mark.parametrize("path", PACKAGED, ids=os.path.basename)
def test_committed_table_is_the_builder_output_of_its_results_file(path):
    """No hand-written entry: the table is exactly what the builder makes of the results file it names."""
    table = op_table.load(path)
    with open(os.path.join(ROOT, "benchmarks", "results", table["source"])) as f:
        result = json.load(f)
    assert op_table.build(result["records"], report.table_meta(result, table["source"])) == table


def _rec(op, backend, us, T, mode="graph", dtype="bfloat16", **kw):
    if op == "grouped_gemm":
        fields = dict(groups=8, K=kw.get("K", 4096), N=kw.get("N", 4096))
    else:
        fields = dict(adapters=4, rank=kw.get("rank", 16), pool_rank=kw.get("pool_rank", kw.get("rank", 16)),
                      K=4096, N=4096, slices=kw.get("slices", 1))
        for name in ("lora_ranks", "slice_widths"):
            if name in kw:
                fields[name] = kw[name]
    return dict(op=op, backend=backend, mode=mode, dtype=dtype, T=T, us=us, **fields)


def _pair(op, cuda_us, triton_us, T, **kw):
    return [_rec(op, "cuda", cuda_us, T, **kw), _rec(op, "triton", triton_us, T, **kw)]


META = dict(gpu="test GPU", git_sha="abc1234", date="2026-12-01", torch="2.x", source="synthetic.json")


def test_build_gives_triton_only_regimes_it_wins_by_the_margin_and_marks_unmeasured_ones():
    assert op_table.TRITON_MARGIN == 1.05
    records = (_pair("sgmv", 10.0, 12.0, T=8)                            # cuda wins
               + _pair("sgmv", 400.0, 120.0, T=4096, rank=128)           # triton wins by 3.3x
               # one regime, two cases: triton by 1.2x on one, cuda by 2.6x on the other -> cuda (worst 1.2x)
               + _pair("sgmv", 44.0, 37.0, T=256, rank=64) + _pair("sgmv", 14.6, 38.0, T=256, rank=8, pool_rank=64)
               + _pair("sgmv", 104.0, 100.0, T=16384, rank=16)           # triton by 4%: within the margin
               + _pair("sgmv", 106.0, 100.0, T=16384, rank=64)           # triton by 6%: past it
               + [_rec("sgmv", "cuda", 1.0, T=2048)]                      # one backend only: not a comparison
               + _pair("sgmv", 99.0, 1.0, T=40, mode="eager")            # eager: ignored
               + _pair("sgmv", 99.0, 1.0, T=40, dtype="float32")         # fp32: the table does not apply
               + [dict(r, backend="torch_loop") for r in _pair("sgmv", 1.0, 1.0, T=40)]  # baselines: ignored
               + _pair("sgmv", 5.0, 5.0, T=100)                          # a tie keeps the C++ kernel
               + _pair("grouped_gemm", 50.0, 40.0, T=16384, N=16)         # a shrink
               + _pair("lora_expand", 9.0, 3.0, T=32, slices=2)
               # a fused module's records carry its slice widths as a list
               + _pair("lora_expand", 2.0, 8.0, T=8, slices=3, slice_widths=[4096, 1024, 1024]))
    table = op_table.build(records, META)
    op_table.validate(table)
    assert {k: table[k] for k in META} == META

    def cell(op, **values):
        spec = table["ops"][op]
        return spec["cells"][op_table._cell_index(spec["axes"], values)]

    assert cell("sgmv", positions=8, rank=16, slices=1, true_ranks=2)["backend"] == "cuda"
    big = cell("sgmv", positions=4096, rank=128, slices=1, true_ranks=2)
    assert big["backend"] == "triton" and big["measured"]
    assert big["cases"] == [dict(T=4096, adapters=4, rank=128, pool_rank=128, K=4096, N=4096, slices=1,
                                 dtype="bfloat16", us={"cuda": 400.0, "triton": 120.0})]
    mixed = cell("sgmv", positions=256, rank=64, slices=1, true_ranks=2)
    assert mixed["backend"] == "cuda" and len(mixed["cases"]) == 2
    assert not cell("sgmv", positions=2048, rank=16, slices=1, true_ranks=2)["measured"]
    assert not cell("sgmv", positions=40, rank=16, slices=1, true_ranks=2)["measured"]
    tie = cell("sgmv", positions=100, rank=16, slices=1, true_ranks=2)
    assert tie["measured"] and tie["backend"] == "cuda"
    assert cell("sgmv", positions=16384, rank=16, slices=1, true_ranks=2)["backend"] == "cuda"
    assert cell("sgmv", positions=16384, rank=64, slices=1, true_ranks=2)["backend"] == "triton"
    assert table["triton_margin"] == op_table.TRITON_MARGIN
    assert cell("grouped_gemm", positions=16384, n=16, k=4096)["backend"] == "triton"
    assert cell("grouped_gemm", positions=16384, n=4096, k=4096)["backend"] == "cuda"
    assert cell("lora_expand", positions=32, rank=16, slices=2, true_ranks=2)["backend"] == "triton"
    fused = cell("lora_expand", positions=8, rank=16, slices=3, true_ranks=2)
    assert fused["backend"] == "cuda" and fused["cases"][0]["slice_widths"] == [4096, 1024, 1024]
    assert sum(c["measured"] for op in op_table.OPS for c in table["ops"][op]["cells"]) == 9
    unmeasured = [c for op in op_table.OPS for c in table["ops"][op]["cells"] if not c["measured"]]
    assert all(c["backend"] == "cuda" and "cases" not in c for c in unmeasured)


def test_true_ranks_separates_calls_without_ranks_from_calls_with_them():
    """256 positions of a rank-64 pool: Triton wins the calls that pass no ranks (every adapter at rank 64), the C++
    kernel the ones with rank-8 adapters (true-rank cost); records from before the bench said so count as ranks
    passed."""
    records = (_pair("sgmv", 45.6, 38.6, T=256, rank=64, lora_ranks=False)
               + _pair("sgmv", 15.0, 38.2, T=256, rank=8, pool_rank=64, lora_ranks=True)
               + _pair("sgmv", 10.0, 12.0, T=8))
    table = op_table.build(records, META)
    assert op_table.choice(table, "sgmv", positions=256, rank=64, slices=1, true_ranks=1) == "triton"
    assert op_table.choice(table, "sgmv", positions=256, rank=64, slices=1, true_ranks=2) == "cuda"
    spec = table["ops"]["sgmv"]
    old = spec["cells"][op_table._cell_index(spec["axes"], dict(positions=8, rank=16, slices=1, true_ranks=2))]
    assert old["measured"]


@pytest.mark.parametrize("us", [0.0, -1.0, None])
def test_build_refuses_a_timing_that_is_not_positive(us):
    records = _pair("sgmv", 10.0, 12.0, T=8) + [_rec("sgmv", "triton", us, T=16), _rec("sgmv", "cuda", 5.0, T=16)]
    with pytest.raises(ValueError, match="timing of"):
        op_table.build(records, META)


def _results(records, **kw):
    """A results file of a full GPU op-bench run (as python -m lora_ops.bench --out writes it)."""
    settings = dict(device="cuda", quick=False, impls=None, op_kinds=list(op_table.OPS) + ["build_segments"],
                    dtype="bfloat16")
    settings.update(kw.pop("settings", {}))
    return dict(dict(gpu="test GPU", git_sha="abc1234", date="2026-12-01", torch="2.x", op_bench=settings,
                     failures=[], records=records), **kw)


FULL_RECORDS = (_pair("sgmv", 10.0, 12.0, T=8) + _pair("lora_expand", 9.0, 3.0, T=32)
                + _pair("grouped_gemm", 50.0, 40.0, T=16384, N=16))


@pytest.mark.parametrize("change,msg", [
    (dict(settings=dict(device="cpu")), "not a CUDA GPU"),
    (dict(settings=dict(quick=True)), "--quick"),
    (dict(settings=dict(impls=["cuda", "triton"])), "--impls cuda,triton"),
    (dict(settings=dict(op_kinds=["sgmv", "grouped_gemm"])), "leaves out lora_expand"),
    (dict(settings=dict(dtype="float32")), "--dtype float32"),
    (dict(failures=["sgmv triton {...}: raised RuntimeError"]), "1 failure"),
    (dict(records=[r for r in FULL_RECORDS if not (r["op"] == "lora_expand" and r["backend"] == "triton")]),
     "no lora_expand case was timed on both"),
])
def test_a_partial_or_failed_run_makes_no_table(change, msg, tmp_path):
    records = change.pop("records", FULL_RECORDS)
    result = _results(records, **change)
    assert any(msg in p for p in op_table.results_problems(result)), op_table.results_problems(result)
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="op table not written"):
        op_table.write(str(path), result, META)
    assert not path.exists()


def test_a_full_run_makes_the_builders_table(tmp_path):
    result = _results(FULL_RECORDS)
    assert op_table.results_problems(result) == []
    path = tmp_path / "t.json"
    assert op_table.write(str(path), result, META) == op_table.load(str(path)) == op_table.build(FULL_RECORDS, META)
    # a results file from before the bench stored its settings and failures: judged by its device and records
    legacy = {k: v for k, v in result.items() if k not in ("op_bench", "failures")}
    assert op_table.results_problems(legacy) == []
    assert op_table.results_problems(dict(legacy, gpu="cpu")) == ["the results come from a CPU run"]


def _table(**overrides):
    table = op_table.build([], META)
    for op, cells in overrides.items():
        spec = table["ops"][op]
        for values in cells:
            spec["cells"][op_table._cell_index(spec["axes"], values)]["backend"] = "triton"
    return table


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t["ops"].pop("grouped_gemm"), "no entry for grouped_gemm"),
    (lambda t: t["ops"]["sgmv"]["axes"].reverse(), "axes are"),
    (lambda t: t["ops"]["sgmv"]["axes"][0].update(max=[16, 16, 256, 1023, 4096]), "bounds must increase"),
    (lambda t: t["ops"]["sgmv"]["axes"][0].update(max=[0, 16, 256, 1023, 4096]), "bounds must increase from 1"),
    (lambda t: t["ops"]["sgmv"]["axes"][1].update(max=[16.5, 32, 64]), "bounds must be a list of ints"),
    (lambda t: t["ops"]["lora_expand"]["cells"].pop(), "95 cells for 96 regimes"),
    (lambda t: t["ops"]["sgmv"]["cells"].reverse(), "out of order"),
    (lambda t: t["ops"]["grouped_gemm"]["cells"][3].update(backend="rocm"), "unknown backend 'rocm'"),
    (lambda t: t["ops"]["grouped_gemm"]["cells"][3].pop("measured"), "no 'measured' flag"),
    (lambda t: t.pop("gpu"), "no gpu"),
    (lambda t: t.update(date=""), "no date"),
    (lambda t: t.update(git_sha=None), "no git_sha"),
])
def test_validate_rejects_a_table_with_gaps_or_unknown_names(mutate, msg):
    table = _table()
    mutate(table)
    with pytest.raises(ValueError, match=msg):
        op_table.validate(table)


def test_choice_follows_the_class_bounds():
    table = _table(sgmv=[dict(positions=1024, rank=17, slices=2, true_ranks=2)],
                   grouped_gemm=[dict(positions=257, n=128, k=129)])
    assert op_table.choice(table, "sgmv", positions=1024, rank=17, slices=2, true_ranks=2) == "triton"
    assert op_table.choice(table, "sgmv", positions=4096, rank=32, slices=3, true_ranks=9) == "triton"  # same class
    assert op_table.choice(table, "sgmv", positions=1023, rank=17, slices=2, true_ranks=2) == "cuda"  # kernel switch
    assert op_table.choice(table, "sgmv", positions=4097, rank=17, slices=2, true_ranks=2) == "cuda"
    assert op_table.choice(table, "sgmv", positions=1024, rank=16, slices=2, true_ranks=2) == "cuda"
    assert op_table.choice(table, "sgmv", positions=1024, rank=33, slices=2, true_ranks=2) == "cuda"
    assert op_table.choice(table, "sgmv", positions=1024, rank=17, slices=1, true_ranks=2) == "cuda"
    assert op_table.choice(table, "sgmv", positions=1024, rank=17, slices=2, true_ranks=1) == "cuda"  # no ranks
    assert op_table.choice(table, "grouped_gemm", positions=4096, n=1, k=1 << 20) == "triton"
    assert op_table.choice(table, "grouped_gemm", positions=256, n=128, k=129) == "cuda"
    assert op_table.choice(table, "grouped_gemm", positions=257, n=129, k=129) == "cuda"
    assert op_table.choice(table, "grouped_gemm", positions=257, n=128, k=128) == "cuda"


def test_the_reference_table_is_packaged_and_an_h100_has_its_own():
    assert op_table.path_for(None) in PACKAGED and op_table.load()["gpu"] == "NVIDIA H200"
    assert op_table.load(op_table.path_for("NVIDIA H100 80GB HBM3"))["gpu"].startswith("NVIDIA H100")


@pytest.mark.parametrize("name,word", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "4090"),
                                       ("NVIDIA RTX A6000", "a6000"), ("Tesla V100-SXM2-16GB", "v100"),
                                       ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100"), ("", "")])
def test_gpu_word_is_the_models_word(name, word):
    assert op_table.gpu_word(name) == word


@pytest.mark.parametrize("name,table_gpu", [("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
                                            ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
                                            ("NVIDIA A100-SXM4-80GB", "NVIDIA H200"), (None, "NVIDIA H200")])
def test_import_installs_the_table_of_the_gpu_it_sees(name, table_gpu, monkeypatch):
    """A GPU model with a table of its own gets it; any other GPU, or none, the reference GPU's."""
    seen = []
    monkeypatch.setattr(op_table, "install", seen.append)
    monkeypatch.setattr(op_table, "visible_gpu_name", lambda: name)
    monkeypatch.setattr(op_table, "cuda_kernels_take_tables", lambda: True)
    monkeypatch.delitem(backends.unavailable, "triton", raising=False)
    monkeypatch.delenv("LORA_OPS_OP_TABLE", raising=False)
    op_table.install_default()
    assert seen.pop()["gpu"] == table_gpu


@pytest.mark.parametrize("visible,index", [(None, "0"), ("1,0", "1"), (" 2", "2"), ("GPU-5d8f0c1e,0", "GPU-5d8f0c1e"),
                                           ("", None), ("-1", None), (",0", None)])
def test_the_gpu_is_named_through_nvml_as_cuda_visible_devices_names_the_first(visible, index, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(op_table, "_nvml_device_name", lambda i: asked.append(i) or "NVIDIA H100 80GB HBM3")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert op_table.visible_gpu_name() == (None if index is None else "NVIDIA H100 80GB HBM3")
    assert asked == ([] if index is None else [index])


@pytest.mark.parametrize("device", ["\u00b2", "4294967296", "GPU-00000000-0000-0000-0000-000000000000", "MIG-x"])
def test_nvml_names_no_gpu_for_an_index_or_uuid_it_does_not_have(device):
    """Whether or not there is a driver: no exception, no GPU 0 for an index past 32 bits, None."""
    assert op_table._nvml_device_name(device) is None


def test_nvml_is_asked_once_a_process_and_device(monkeypatch):
    """The op table and the route table both name the GPU: NVML is initialised (every GPU attached) once per device
    asked, not once per table."""
    inits = []

    class StandInNvml:
        def nvmlInit_v2(self):
            return inits.append(1) or 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            return 0

        def nvmlDeviceGetName(self, handle, name, length):
            name.value = b"NVIDIA H100 80GB HBM3"
            return 0

        def nvmlShutdown(self):
            return 0

    monkeypatch.setattr(op_table.ctypes, "CDLL", lambda path: StandInNvml())
    op_table._nvml_device_name.cache_clear()
    try:
        assert [op_table._nvml_device_name(d) for d in ("0", "0", "1", "0")] == ["NVIDIA H100 80GB HBM3"] * 4
        assert len(inits) == 2  # devices 0 and 1
    finally:
        op_table._nvml_device_name.cache_clear()  # the stand-in's answers are not this machine's


def _after_import(script: str, visible_devices=None) -> list:
    """The output lines of `script` run after `import torch, lora_ops` in a fresh process, with CUDA_VISIBLE_DEVICES
    unset or as given."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    out = subprocess.run([sys.executable, "-c", "import torch, lora_ops\nfrom lora_ops import op_table\n" + script],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_import_leaves_cuda_uninitialised():
    """Choosing the table must not initialise CUDA: a process that forks workers after importing lora_ops could not
    use CUDA in them (the GPU test below forks one)."""
    assert _after_import("print(torch.cuda.is_initialized())")[0] == "False"


@pytest.mark.gpu
def test_nvml_names_the_gpu_cuda_names_and_a_forked_worker_can_use_cuda():
    out = _after_import("print(op_table.visible_gpu_name())\nprint(op_table.installed['gpu'])\n"
                        "import os\npid = os.fork()\n"
                        "if pid == 0:\n"
                        "    os._exit(0 if torch.ones(4, device='cuda').sum().item() == 4 else 3)\n"
                        "print(os.waitpid(pid, 0)[1])\nprint(torch.cuda.get_device_name(0))")
    nvml_name, installed_gpu, child_status, cuda_name = out[:4]
    assert op_table.gpu_word(nvml_name) == op_table.gpu_word(cuda_name), (nvml_name, cuda_name)
    assert installed_gpu == op_table.load(op_table.path_for(cuda_name))["gpu"]
    assert child_status == "0", "a worker forked after the import could not use CUDA"
    assert _after_import("print(op_table.visible_gpu_name())", visible_devices="")[0] == "None"


def test_override_picks_the_table_at_import(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(op_table, "install", seen.append)
    monkeypatch.delenv("LORA_OPS_OP_TABLE", raising=False)
    op_table.install_default()
    assert seen.pop() in [op_table.load(path) for path in PACKAGED]
    monkeypatch.setenv("LORA_OPS_OP_TABLE", "off")
    op_table.install_default()
    assert seen.pop() is None
    custom = _table(sgmv=[dict(positions=1, rank=1, slices=1, true_ranks=2)])
    path = tmp_path / "table.json"
    path.write_text(json.dumps(custom))
    monkeypatch.setenv("LORA_OPS_OP_TABLE", str(path))
    op_table.install_default()
    assert seen.pop() == custom
    path.write_text(json.dumps(dict(custom, ops={})))
    with pytest.raises(ValueError, match="no entry for sgmv"):
        op_table.install_default()


def test_a_missing_table_file_fails_the_import_with_its_path():
    env = dict(os.environ, LORA_OPS_OP_TABLE="/nonexistent/op_table.json")
    out = subprocess.run([sys.executable, "-c", "import lora_ops"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "/nonexistent/op_table.json" in out.stderr


def test_every_op_of_the_table_has_a_triton_twin_by_name():
    triton_backend()
    for op in op_table.OPS:
        assert op in backends.TRITON_BY_NAME
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lora_ops::_triton_{op}", "CUDA"), op
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lora_ops::_triton_{op}", "Meta"), op


# The C++ table (csrc/common/op_table.h) is in every build: its lookup and setter are tested without a GPU.

def test_cpp_lookup_agrees_with_the_python_lookup_at_every_class_edge():
    triton_backend()
    tables = [op_table.load(), _table(sgmv=[dict(positions=1024, rank=17, slices=2, true_ranks=2)],
                                      lora_expand=[dict(positions=1, rank=1, slices=1, true_ranks=2)],
                                      grouped_gemm=[dict(positions=257, n=128, k=129)])]
    previous = op_table.installed
    try:
        for table in tables:
            op_table.install(table)
            for op in op_table.OPS:
                names = [name for name, _ in op_table.AXES[op]]
                for point in _regime_points(op):
                    values = dict(zip(names, point))
                    assert op_table.cuda_choice(op, **values) == op_table.choice(table, op, **values), (op, values)
        with op_table.disabled():
            assert op_table.installed is None
            assert op_table.cuda_choice("sgmv", positions=1024, rank=17, slices=2, true_ranks=2) == "cuda"
        assert op_table.cuda_choice("sgmv", positions=1024, rank=17, slices=2, true_ranks=2) == "triton"  # restored
    finally:
        op_table.install(previous)


SGMV_AXES = "positions,rank,slices,true_ranks"


@pytest.mark.parametrize("args,msg", [
    (("bgmv", "", [], [], []), "unknown op 'bgmv'"),
    (("sgmv", "positions,n,k", [1, 1, 1], [1, 1, 1], [0] * 8), "axes 'positions,n,k', expected"),
    (("sgmv", "positions,rank,slices", [1, 1, 1], [1, 1, 1], [0] * 8), "axes 'positions,rank,slices', expected"),
    (("sgmv", SGMV_AXES, [1, 1], [1, 1], [0] * 4), "2 bound counts for 4 axes"),
    (("sgmv", SGMV_AXES, [1, 1, 1, 1], [1, 1, 1, 1], [0] * 15), "15 regimes given for 16"),
    (("sgmv", SGMV_AXES, [2, 1, 1, 1], [5, 5, 1, 1, 1], [0] * 24), "must increase"),
    (("sgmv", SGMV_AXES, [1, 1, 1, 1], [1, 1, 1, 1], [0] * 15 + [2]), "must be 0 or 1"),
    (("sgmv", SGMV_AXES, [1, 1, 9, 1], [1, 1, 1, 1], [0] * 16), "do not match"),
])
def test_cpp_setter_rejects_a_malformed_table(args, msg):
    with pytest.raises(ValueError, match=msg):
        torch.ops.lora_ops._set_cuda_op_table(*args)


def test_install_is_all_or_nothing(monkeypatch):
    """An op whose table the C++ setter refuses leaves every op on the previous table."""
    triton_backend()
    before = _table(sgmv=[dict(positions=1024, rank=17, slices=2, true_ranks=2)])
    after = _table(sgmv=[dict(positions=1, rank=1, slices=1, true_ranks=2)],
                   grouped_gemm=[dict(positions=1, n=1, k=1)])
    real = torch.ops.lora_ops._set_cuda_op_table

    def refusing_grouped_gemm(op, axes, *rest):
        if op == "grouped_gemm" and axes:
            raise RuntimeError("lora_ops op table: refused for the test")
        return real(op, axes, *rest)
    previous = op_table.installed
    try:
        op_table.install(before)
        monkeypatch.setattr(torch.ops.lora_ops, "_set_cuda_op_table", refusing_grouped_gemm)
        with pytest.raises(RuntimeError, match="refused for the test"):
            op_table.install(after)
        assert op_table.installed is before
        assert op_table.cuda_choice("sgmv", positions=1024, rank=17, slices=2, true_ranks=2) == "triton"
        assert op_table.cuda_choice("sgmv", positions=1, rank=1, slices=1, true_ranks=2) == "cuda"
        assert op_table.cuda_choice("grouped_gemm", positions=1, n=1, k=1) == "cuda"
    finally:
        monkeypatch.undo()
        op_table.install(previous)


def test_an_error_of_the_triton_twin_says_the_op_table_routes_there():
    """lora_ops::_triton_<op> (what the C++ kernels redispatch the table's Triton regimes to) is Triton's kernel
    with a note on its errors; here the same wrapper around the kernel on CPU tensors (TRITON_INTERPRET)."""
    lt = triton_backend()
    p, _ = _routed_problem("sgmv", T=64, device="cpu", dtype=torch.float32)
    bad_ranks = p.lora_ranks[:-1]  # one slot short
    twin = backends.noting_the_op_table("sgmv", lt.sgmv)
    args = list(p.args())
    args[7] = bad_ranks
    with pytest.raises(ValueError, match="lora_ranks") as raised:
        twin(*args)
    assert any("op table" in n and "LORA_OPS_OP_TABLE=off" in n for n in raised.value.__notes__)


# ---- on a GPU: the regimes the table gives to Triton ----

def _routed_problem(op, T=2048, dtype=torch.bfloat16, device="cuda"):
    """A problem of `op` in a regime that a test table gives to Triton (positions 1024-4096, rank 17-32,
    slices 2+; grouped_gemm: positions 257-4096, n <= 128, k > 128), with every optional argument away from its
    default (varied true ranks, scale 0.5; per-group sizes, alpha 0.5, y = instead of y +=), so that a dropped or
    swapped argument on the way to Triton gives a wrong result."""
    gen = case_generator(f"op_table-{op}")
    token_lora = testing.random_token_slots(T, [0, 3, 5], gen)
    if op == "grouped_gemm":
        p = testing.make_grouped_gemm(token_lora, num_groups=6, K=256, N=32, dtype=dtype, device=device, gen=gen,
                                      n_sizes=[32, 20, 7, 13, 1, 25], k_sizes=[256, 100, 64, 200, 256, 177],
                                      alpha=0.5, accumulate=False)
        return p, reference.grouped_gemm
    p = testing.make_sgmv(token_lora, num_slots=6, K=256, N=96, max_rank=32, dtype=dtype, device=device, gen=gen,
                          ranks=[32, 5, 17, 9, 1, 23], slice_offsets=[0, 32, 64, 96], scale=0.5)
    if op == "sgmv":
        return p, reference.sgmv
    h = torch.randn(T, 6, 3 * 32, generator=gen).to(dtype).to(device)
    return testing.SgmvProblem(p.y, h, None, p.lora_b, p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks,
                               p.lora_scales, p.slice_offsets, p.scale), reference.lora_expand


def _args(op, p, y=None):
    if op == "lora_expand":
        return (p.y if y is None else y, p.x, p.lora_b, p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks,
                p.lora_scales, p.slice_offsets, p.scale)
    return p.args(y)


def _weights_dtype(op, p):
    return p.w.dtype if op == "grouped_gemm" else p.lora_b.dtype


TRITON_KERNEL = {"sgmv": "sgmv_kernel", "lora_expand": "lora_expand_kernel", "grouped_gemm": "grouped_gemm_kernel"}
CPP_KERNELS = {"sgmv": ("sgmv_mma_kernel", "sgmv_shrink"),
               "lora_expand": ("expand_positions_kernel", "expand_tiles_kernel", "expand_segments_kernel",
                               "expand_rows_kernel", "expand_runs_kernel"),
               "grouped_gemm": ("grouped_gemm_tile_kernel", "grouped_gemm_expand_kernel", "sgmv_shrink",
                                "grouped_gemm_split_sum_kernel", "expand_segments_kernel")}


def _assert_cpp_ran(op, kernels, names=None):
    """The call ran a C++ kernel of `op` (demangled in lora_ops::cuda; `names`: one of these) and no Triton one."""
    assert TRITON_KERNEL[op] not in kernels, kernels
    assert any("lora_ops::cuda::" in k and any(n in k for n in names or CPP_KERNELS[op]) for k in kernels), kernels


def _with_a_short_size_vector(op, p):
    """The problem's arguments with its per-slot size vector one entry short (a contract error)."""
    args = list(_args(op, p, p.y.clone()))
    index = {"sgmv": 7, "lora_expand": 6, "grouped_gemm": 6}[op]  # lora_ranks; grouped_gemm: n_sizes
    args[index] = args[index][:-1]
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("op", op_table.OPS)
def test_triton_regime_runs_triton_and_matches_the_oracle(op, monkeypatch):
    triton_backend()
    if backends.cuda_served_by[op] != "cuda":
        pytest.skip(f"{op} has no C++ CUDA kernel to consult the table")
    table = _table(**{op: [dict(positions=2048, n=32, k=256) if op == "grouped_gemm"
                           else dict(positions=2048, rank=32, slices=3, true_ranks=2)]})
    p, oracle = _routed_problem(op)
    public = getattr(torch.ops.lora_ops, op).default
    before = p.y.clone()
    ref = oracle(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in _args(op, p)])
    previous = op_table.installed
    try:
        op_table.install(table)
        y = before.clone()
        kernels = cuda_kernel_names(lambda: public(*_args(op, p, y)))[1]
        assert TRITON_KERNEL[op] in kernels, kernels
        assert not testing.check_against_reference(y, before, ref, _weights_dtype(op, p))
        y_graph = before.clone()  # capturable: no host sync on the way to Triton
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            public(*_args(op, p, y_graph))
        torch.cuda.current_stream().wait_stream(stream)
        y_graph.copy_(before)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y)
        compiled = torch.compile(lambda yy: public(*_args(op, p, yy)), fullgraph=True)
        y_compiled = before.clone()
        compiled(y_compiled)
        assert torch.equal(y_compiled, y)
        # an error on the routed path says the op table sent the call to Triton
        with pytest.raises(ValueError) as raised:
            public(*_with_a_short_size_vector(op, p))
        assert any("LORA_OPS_OP_TABLE=off" in n for n in getattr(raised.value, "__notes__", [])), raised.value
        # Forcing the C++ backend: LORA_OPS_OP_TABLE=off (no table), or a forced C++ kernel where there is one.
        with op_table.disabled():
            y_off = before.clone()
            _assert_cpp_ran(op, cuda_kernel_names(lambda: public(*_args(op, p, y_off)))[1])
            assert not testing.check_against_reference(y_off, before, ref, _weights_dtype(op, p))
        forced = {"sgmv": ("LORA_OPS_CUDA_SGMV_KERNEL", "split", "sgmv_shrink"),
                  "lora_expand": ("LORA_OPS_CUDA_EXPAND_KERNEL", "tiles", "expand_tiles_kernel"),
                  "grouped_gemm": ("LORA_OPS_CUDA_GG_KERNEL", "mma", "grouped_gemm_tile_kernel")}
        if op in forced:
            variable, value, kernel = forced[op]
            monkeypatch.setenv(variable, value)
            y_forced = before.clone()
            _assert_cpp_ran(op, cuda_kernel_names(lambda: public(*_args(op, p, y_forced)))[1], (kernel,))
            assert not testing.check_against_reference(y_forced, before, ref, _weights_dtype(op, p))
            monkeypatch.delenv(variable)
        # fp32 weights stay on the C++ kernels: the table was measured on fp16/bf16
        p32, _ = _routed_problem(op, dtype=torch.float32)
        ref32 = oracle(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in _args(op, p32)])
        y32 = p32.y.clone()
        _assert_cpp_ran(op, cuda_kernel_names(lambda: public(*_args(op, p32, y32)))[1])
        assert not testing.check_against_reference(y32, p32.y, ref32, torch.float32)
    finally:
        op_table.install(previous)
