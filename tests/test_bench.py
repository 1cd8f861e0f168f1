"""The op bench on the CPU (`python -m lora_ops.bench --device cpu --quick`): every op kind runs and is recorded, a
wrong implementation of ours or a broken Triton fails the run (and is stored in the results), the op table is
refused from a partial run and written from a full one's results file, and the README section renders the
lora_expand and grouped_gemm tables."""
import dataclasses
import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

import lora_ops
from lora_ops import backends, op_table, reference, routes, testing
from lora_ops.bench import __main__ as bench, ops, report, timing


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cpu"
    rc = bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    with open(f"{out}.json") as f:
        return rc, json.load(f), out


def test_quick_cpu_bench_times_every_op_kind(quick_run):
    rc, result, out = quick_run
    assert rc == 0
    recs = result["records"]
    kinds = {(r["op"], r["backend"]) for r in recs}
    for op in ("sgmv", "lora_expand", "grouped_gemm"):
        assert (op, "cpu") in kinds and (op, "torch_loop") in kinds, op
    assert ("sgmv", "gg_composed") in kinds  # checked against the oracle before it is timed, as every one
    assert ("build_segments", "cpu") in kinds
    timed = [r for r in recs if r["op"] != "build_segments"]
    assert all(r["sets"] == 1 and r["rotated_bytes"] > 0 for r in timed) and result["l2_bytes"] is None
    gg = [r for r in recs if r["op"] == "grouped_gemm"]
    assert {r["shape"] for r in gg} == {ops.CPU_GG_CASES[0].shape, "LoRA shrink", "LoRA expand"}
    for r in gg:
        assert r["us"] > 0 and r["tflops"] > 0 and "gbps" in r  # GB/s of a loaded CPU may round to 0.0
        assert r["tflops"] == pytest.approx(2 * r["T"] * r["N"] * r["K"] / (r["us"] * 1e-6) / 1e12, rel=0.01)
    shrink = next(r for r in gg if r["shape"] == "LoRA shrink")
    assert (shrink["dtype"], shrink["x_dtype"], shrink["y_dtype"], shrink["accumulate"]) == \
        ("bfloat16", "bfloat16", "float32", False)
    assert out.with_suffix(".csv").exists()
    assert result["failures"] == []
    assert result["op_bench"] == dict(device="cpu", quick=True, min_tokens=0, impls=None,
                                      op_kinds=["sgmv", "lora_expand", "grouped_gemm", "build_segments"],
                                      dtype="bfloat16", sgmv_cases=None)


@pytest.mark.parametrize("kind,factory", [("grouped_gemm", "gg_implementations"),
                                          ("lora_expand", "expand_implementations")])
def test_a_wrong_result_of_ours_fails_the_bench(kind, factory, monkeypatch, capsys, tmp_path):
    real = getattr(ops, factory)

    def with_a_bug(device):
        impls = real(device)
        right = impls["cpu"]

        def off_by_one_row(pb, y):
            right(pb, y)
            y[0] += 1  # one row wrong
        impls["cpu"] = off_by_one_row
        return impls
    monkeypatch.setattr(ops, factory, with_a_bug)
    out = tmp_path / "run"
    assert bench.main(["--device", "cpu", "--quick", "--op-kinds", kind, "--impls", "cpu", "--out", str(out)]) == 1
    assert f"FAILURE: {kind} cpu" in capsys.readouterr().out
    with open(f"{out}.json") as f:
        failures = json.load(f)["failures"]
    assert failures and all(f.startswith(f"{kind} cpu") and "WRONG vs the float64 oracle" in f for f in failures)


def test_sets_rotate_through_twice_the_l2_within_the_memory_budget():
    MiB, GiB, l2 = 1 << 20, 1 << 30, 60 << 20
    # T=1, one adapter (x, its rank-16 A and B, y: 0.27 MiB touched) in a 32-slot pool of 8 MiB per set
    touched = 4096 * 2 + 16 * 8192 * 2 + 4096 * 2
    n = ops.n_sets(touched, 8 * MiB, l2, budget_bytes=32 * GiB)
    assert n == 452 and n * touched >= 2 * l2 > (n - 1) * touched
    assert ops.n_sets(258 * MiB, 392 * MiB, l2, 32 * GiB) == timing.MIN_CALLS  # past the L2 alone: one per call
    n = ops.n_sets(touched, 8 * MiB, l2, budget_bytes=100 * MiB)  # the budget binds: under 2x the L2
    assert n == 12 and n * touched < 2 * l2
    assert ops.n_sets(258 * MiB, 392 * MiB, l2, budget_bytes=100 * MiB) == 1


def test_input_sets_share_the_metadata_and_log_a_case_under_twice_the_l2(monkeypatch):
    case = ops.CPU_CASES[0]
    first = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    another = lambda seed: ops.Problem(case, torch.bfloat16, "cpu", seed, like=first)
    sets, fields = ops._input_sets(first, another, 1 << 20, "cpu", print)
    assert sets == [first] and fields == {"sets": 1, "rotated_bytes": first.touched_bytes()}
    # as on CUDA, with a budget of 10 sets (the caching allocator's idle blocks count as free): 31 would touch
    # twice this L2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (32 * first.allocated_bytes(), 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 9 * first.allocated_bytes())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: first.allocated_bytes())
    logged = []
    sets, fields = ops._input_sets(first, another, 1 << 20, "cuda", logged.append)
    assert len(sets) == fields["sets"] == 10 and fields["rotated_bytes"] == 10 * first.touched_bytes()
    assert len(logged) == 1 and "under 2x the L2: 10 sets touch 0.7 MiB of 2 MiB" in logged[0]
    last = sets[-1]
    assert last.p.seg_indptr is first.p.seg_indptr and last.rows_by_slot is first.rows_by_slot
    assert not torch.equal(last.p.x, first.p.x) and not torch.equal(last.p.lora_a, first.p.lora_a)


def test_a_wrong_graph_replay_fails_the_bench_and_is_not_timed(monkeypatch):
    """time_cuda with the graph replayed on the host: a kernel right on each set's first call (the eager check) but
    not on later ones (a captured launch gone stale) fails on the replay that the timing checks first."""
    monkeypatch.setattr(timing, "capture", lambda calls: SimpleNamespace(replay=lambda: [f() for f in calls]))
    monkeypatch.setattr(timing, "time_loop", lambda run, min_ms: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    case = ops.CPU_CASES[1]
    first = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    sets = [first] + [ops.Problem(case, torch.bfloat16, "cpu", seed, like=first) for seed in (2, 3)]
    right = ops._ours(lora_ops.ops, "sgmv")
    seen = set()

    def first_call_only(pb, y):
        if id(pb) not in seen:
            seen.add(id(pb))
            right(pb, y)
    records, failures = [], []
    row = {"T": case.T, "sets": 3}
    ops._measure("sgmv", row, {"cpu": right, "stale": first_call_only}, sets, lambda pb: pb.p.y,
                 lambda pb: reference.sgmv(*pb.p.args()), torch.bfloat16, first.min_bytes(), None, "cuda", None,
                 records, failures, lambda s: None)
    assert [(r["backend"], r["mode"], r["sets"]) for r in records] == [("cpu", "graph", 3), ("cpu", "eager", 3)]
    assert len(failures) == 1 and failures[0].startswith("sgmv stale {'T': 8, 'sets': 3}: WRONG vs the float64 "
                                                          "oracle after a graph replay, set 1 of 3: ")


def test_the_eager_check_covers_the_last_set():
    case = ops.CPU_CASES[1]
    first = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    sets = [first, ops.Problem(case, torch.bfloat16, "cpu", 2, like=first)]
    right = ops._ours(lora_ops.ops, "sgmv")
    records, failures = [], []
    ops._measure("sgmv", {}, {"first_set_inputs": lambda pb, y: right(first, y)}, sets, lambda pb: pb.p.y,
                 lambda pb: reference.sgmv(*pb.p.args()), torch.bfloat16, 0, None, "cpu", None, records, failures,
                 lambda s: None)
    assert records == [] and len(failures) == 1 and "WRONG vs the float64 oracle: set 2 of 2" in failures[0]


def test_a_broken_triton_fails_the_bench(monkeypatch, capsys):
    monkeypatch.setattr(backends, "triton_error", ImportError("triton's compiler failed to load"))
    monkeypatch.setitem(backends.unavailable, "triton", "installed but failed to load: ImportError: ...")
    assert bench.main(["--device", "cpu", "--quick", "--op-kinds", "lora_expand", "--impls", "cpu"]) == 1
    assert "FAILURE: triton installed but failed to load" in capsys.readouterr().out


def test_min_tokens_times_only_the_longer_cases(tmp_path):
    """--min-tokens T (an A/B of the prefill kernels): only the cases of at least T tokens run, of every op kind
    that has cases, and the results file records the setting (which keeps an op table from such a run)."""
    out = tmp_path / "run"
    assert bench.main(["--device", "cpu", "--min-tokens", "32", "--op-kinds", "sgmv,lora_expand,grouped_gemm",
                       "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    timed = [r for r in result["records"] if r["op"] in ("sgmv", "lora_expand", "grouped_gemm")]
    for op, cases in (("sgmv", ops.CPU_CASES), ("lora_expand", ops.CPU_EXPAND_CASES),
                      ("grouped_gemm", ops.CPU_GG_CASES)):
        assert {r["T"] for r in timed if r["op"] == op} == {c.T for c in cases if c.T >= 32}, op
    assert result["op_bench"]["min_tokens"] == 32


def test_sgmv_cases_replace_the_default_ones_and_are_recorded(tmp_path):
    """--sgmv-cases T/ADAPTERS/RANK[/SLICES]: those sgmv cases run (K = N = 4096; 3 slices: the fused QKV's widths)
    instead of the default ones, and the results file records them."""
    out = tmp_path / "run"
    assert bench.main(["--device", "cpu", "--op-kinds", "sgmv", "--sgmv-cases", "8/2/16, 4/3/8/3", "--impls", "cpu",
                       "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    timed = sorted((r["T"], r["adapters"], r["rank"], r["K"], r["N"], r["slices"]) for r in result["records"]
                   if r["op"] == "sgmv")
    assert timed == [(4, 3, 8, 4096, 6144, 3), (8, 2, 16, 4096, 4096, 1)]
    qkv = next(r for r in result["records"] if r["op"] == "sgmv" and r["slices"] == 3)
    assert qkv["slice_widths"] == list(ops.QKV_WIDTHS)
    assert result["op_bench"]["sgmv_cases"] == "8/2/16, 4/3/8/3"


@pytest.mark.parametrize("text,msg", [("8/2", "expected T/ADAPTERS/RANK"), ("8/2/16/2", "SLICES is 1 or 3"),
                                      ("8/0/16", "positive integers"), ("8/33/16", "at most 32 adapters")])
def test_sgmv_cases_refuses_a_malformed_case(text, msg, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--op-kinds", "sgmv", "--sgmv-cases", text])
    assert msg in capsys.readouterr().err
    for other in (["--op-kinds", "lora_expand"], ["--decode-step"]):
        with pytest.raises(SystemExit):
            bench.main(["--device", "cpu", *other, "--sgmv-cases", "8/2/16"])
        assert "--sgmv-cases needs the op bench" in capsys.readouterr().err


def test_forced_prefill_kernels_are_timed_only_where_named(monkeypatch):
    """The forced C++ prefill kernels (ops.FORCED_PREFILL) set their variables around each call only, and those of
    names.ON_REQUEST run only where --impls names them."""
    seen = []
    monkeypatch.setattr(ops.lora_ops, "sgmv", lambda *args: seen.append(
        (os.environ.get("LORA_OPS_CUDA_SGMV_KERNEL"), os.environ.get("LORA_OPS_CUDA_SGMV_WGMMA_ROWS"))))
    monkeypatch.delenv("LORA_OPS_CUDA_SGMV_KERNEL", raising=False)
    monkeypatch.setenv("LORA_OPS_CUDA_SGMV_WGMMA_ROWS", "64")
    pb = SimpleNamespace(args=lambda y: (y,))
    ops.forced_prefill(ops.FORCED_PREFILL["cuda-wgmma-rows128"])(pb, None)
    ops.forced_prefill(ops.FORCED_PREFILL["cuda-mma"])(pb, None)
    assert seen == [("wgmma", "128"), ("mma", "64")]
    assert "LORA_OPS_CUDA_SGMV_KERNEL" not in os.environ and os.environ["LORA_OPS_CUDA_SGMV_WGMMA_ROWS"] == "64"
    named = []
    monkeypatch.setattr(ops, "implementations", lambda device: {name: None for name in ("cuda", *ops.FORCED_PREFILL)})
    monkeypatch.setattr(ops, "bench_case", lambda case, impls, *args: named.append(sorted(impls)))
    cases = ops.parse_sgmv_cases("2048/8/128")
    for only in (None, ["cuda", "cuda-mma"]):
        bench.run_op_bench(["sgmv"], False, 0, only, None, "cuda", 0, None, [], [], print, cases)
    assert named == [["cuda", "cuda-wgmma"], ["cuda", "cuda-mma"]]


@pytest.mark.parametrize("argv,msg", [
    (["--device", "cpu"], "not a CUDA GPU"),
    (["--device", "cuda", "--quick"], "--quick times only the first few cases"),
    (["--device", "cuda", "--min-tokens", "1024"], "--min-tokens 1024 times only the longer cases"),
    (["--device", "cuda", "--impls", "cuda"], "--impls cuda"),
    (["--device", "cuda", "--op-kinds", "sgmv,grouped_gemm"], "leaves out lora_expand"),
    (["--device", "cuda", "--dtype", "float32"], "--dtype float32"),
    (["--device", "cuda", "--sgmv-cases", "2048/8/128"], "--sgmv-cases 2048/8/128 times other sgmv cases"),
])
def test_op_table_flag_refuses_a_partial_run_before_running(argv, msg, tmp_path, capsys):
    table = tmp_path / "t.json"
    with pytest.raises(SystemExit):
        bench.main(argv + ["--out", str(tmp_path / "run"), "--op-table", str(table)])
    assert msg in capsys.readouterr().err
    assert not table.exists() and not (tmp_path / "run.json").exists()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--op-table", str(table)])  # no --out: refused
    assert "needs --out" in capsys.readouterr().err


def _table_results(failures=()):
    """A full GPU run's results file, as the bench writes it (op_bench settings, failures, graph records)."""
    pair = lambda op, cuda_us, triton_us, **kw: [dict(op=op, backend=b, mode="graph", dtype="bfloat16", us=us, **kw)
                                                  for b, us in (("cuda", cuda_us), ("triton", triton_us))]
    sgmv = dict(adapters=4, rank=16, pool_rank=16, K=4096, N=4096, slices=1)
    records = (pair("sgmv", 10.0, 12.0, T=8, **sgmv) + pair("sgmv", 400.0, 120.0, T=4096, **dict(sgmv, rank=128,
                                                                                              pool_rank=128))
               + pair("lora_expand", 9.0, 3.0, T=32, **sgmv)
               + pair("grouped_gemm", 50.0, 40.0, T=16384, groups=8, K=4096, N=16))
    return dict(gpu="test GPU", git_sha="abc1234", date="2026-12-01", torch="2.x", copy_tbps=4.2,
                op_bench=dict(device="cuda:0", quick=False, impls=None, op_kinds=list(bench.OP_KINDS),
                              dtype="bfloat16"), failures=list(failures), records=records)


def test_report_writes_the_op_table_from_a_full_runs_results_and_refuses_one_with_failures(tmp_path):
    result = _table_results()
    results, table = tmp_path / "run.json", tmp_path / "t.json"
    results.write_text(json.dumps(result))
    assert report.main([str(results), "--op-table", str(table)]) == 0
    assert op_table.load(str(table)) == op_table.build(result["records"], report.table_meta(result, "run.json"))
    assert op_table.choice(op_table.load(str(table)), "sgmv", positions=4096, rank=128, slices=1,
                           true_ranks=2) == "triton"
    table.unlink()
    results.write_text(json.dumps(_table_results(failures=["sgmv triton {...}: raised RuntimeError"])))
    with pytest.raises(SystemExit, match="op table not written: the run had 1 failure"):
        report.main([str(results), "--op-table", str(table)])
    assert not table.exists()


def test_report_merges_the_op_and_decode_runs_of_one_commit_and_writes_the_table_from_them(tmp_path):
    ops_run = _table_results()
    ops_run["records"] = [dict(op="launch_floor", backend="torch", mode="graph", us=0.9)] + ops_run["records"]
    decode = [dict(op="launch_floor", backend="torch", mode="graph", us=0.95),
              dict(op="decode_step", model="llama3-8b", T=32, adapters=32, rank=16, backend="fold-cuda",
                   base_us=4370.0, us=6000.0, overhead_pct=37.3, floor_pct=19.0)]
    decode_run = {k: v for k, v in ops_run.items() if k != "op_bench"}
    decode_run.update(records=decode, failures=["decode_step fold-triton: raised RuntimeError"])
    paths = [tmp_path / "ops.json", tmp_path / "decode.json"]
    for path, run in zip(paths, (ops_run, decode_run)):
        path.write_text(json.dumps(run))
    assert report.main([str(p) for p in paths] + ["--out", str(tmp_path / "all")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["op_bench"] == ops_run["op_bench"] and merged["failures"] == decode_run["failures"]
    assert merged["records"] == ops_run["records"] + decode[1:]  # one launch floor: the first run's
    with pytest.raises(SystemExit, match="op table not written: the run had 1 failure"):  # a failure of either run
        report.main([str(p) for p in paths] + ["--op-table", str(tmp_path / "t.json")])
    decode_run.update(failures=[], git_sha="fedcba9")
    paths[1].write_text(json.dumps(decode_run))
    with pytest.raises(SystemExit, match=r"the results disagree on git_sha: \['abc1234', 'fedcba9'\]"):
        report.main([str(p) for p in paths])
    decode_run.update(git_sha="abc1234", op_bench=ops_run["op_bench"])
    paths[1].write_text(json.dumps(decode_run))
    with pytest.raises(SystemExit, match="more than one of the results has an op bench"):
        report.main([str(p) for p in paths])


def _gg(backend, us, shape="8x512x4096x4096", w="bfloat16", K=4096, N=4096, T=4096, groups=8, pct=None,
        unavailable=None):
    r = dict(op="grouped_gemm", backend=backend, mode="graph", shape=shape, groups=groups, T=T, K=K, N=N, dtype=w,
             x_dtype=w, y_dtype=w, accumulate=False, us=us, pct_roofline=pct)
    if us is not None:
        r["tflops"] = round(2 * T * N * K / (us * 1e-6) / 1e12, 2)
    else:
        r["unavailable"] = unavailable
    return r


def _replay_eagerly(monkeypatch, on_capture=lambda calls: None):
    """decode_step with its CUDA graphs replaced: each capture keeps its calls (on_capture sees them first, and may
    raise as a capture can) and replays them eagerly; time_interleaved runs each twice and reports 1 ms."""
    from lora_ops.bench import decode_step

    class Eager:
        def __init__(self, calls):
            on_capture(calls)
            self.calls = calls

        def replay(self):
            for f in self.calls:
                f()

    monkeypatch.setattr(decode_step, "capture", Eager)
    monkeypatch.setattr(decode_step, "time_interleaved",
                        lambda runs, min_ms: {name: (run(), run(), 1.0)[-1] for name, run in runs.items()})
    return decode_step


def test_decode_step_checks_the_timed_graphs_last_layer(monkeypatch):
    """bench_step (CUDA graphs on the GPU; here each capture replays its calls eagerly) checks the first layer run
    alone and the last layer as the timed replays leave it: a route right on its first layer only is caught."""
    decode_step = _replay_eagerly(monkeypatch)
    sgmv = torch.ops.lora_ops.sgmv.default
    calls = []

    def first_layer_only(y, *args):  # one call per module and layer: right while the first layer runs
        calls.append(1)
        if len(calls) <= 4:
            sgmv(y, *args)

    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", sgmv),
                                                        "fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default),
                                                        "first-only": ("sgmv", first_layer_only)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=3)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print)
    assert [r["backend"] for r in records] == ["base", "sgmv-cpu", "fold-cpu"]
    assert all(r["err"] < 2e-2 for r in records)
    assert len(failures) == 1 and "first-only" in failures[0] and "relative error" in failures[0]


def test_decode_step_drawn_spread_puts_uneven_rows_on_every_adapter(monkeypatch):
    """A step given /drawn has every adapter on at least one row and the rows spread unevenly (testing.drawn_sizes),
    where the default spreads them evenly; its records say which, and the routes right on both."""
    decode_step = _replay_eagerly(monkeypatch)
    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", torch.ops.lora_ops.sgmv.default),
                                                        "fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    sizes = {}
    for spread in decode_step.SPREADS:
        step = decode_step.Step(T=24, adapters=6, rank=4, spread=spread)
        counts = torch.bincount(decode_step.Setup(model, step, "cpu").token_lora.long(), minlength=32)
        sizes[spread] = sorted(counts[counts > 0].tolist())
        records, failures = [], []
        decode_step.bench_step(model, step, "cpu", records, failures, print)
        assert not failures and all(r["spread"] == spread for r in records)
    assert sizes["even"] == [4] * 6
    assert len(sizes["drawn"]) == 6 and sum(sizes["drawn"]) == 24 and sizes["drawn"] != [4] * 6


def test_decode_step_marks_the_route_the_serving_layer_takes(monkeypatch):
    """Each step's record of the route the routes table gives that step says so (serving_default), and no other
    record does: the report's "serving default" column reads it. A table of three regimes, so that each step's
    route differs from the others' and from one token's."""
    decode_step = _replay_eagerly(monkeypatch)
    monkeypatch.setattr(routes, "_tables", None)  # restored after the test, with _modules
    monkeypatch.setattr(routes, "_modules", None)
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    routes.install({"models": [{"model": "tiny", "ranks": [{"max_rank": None, "regimes": [
        {"max_tokens": 4, "route": "kext", "backend": "cuda", "us": [{"kext-cuda": 1.0, "fold-cuda": 2.0}]},
        {"max_tokens": 16, "route": "fold", "backend": "cuda", "us": [{"fold-cuda": 1.0}]},
        {"max_tokens": None, "route": "sgmv", "backend": "triton", "us": [{"sgmv-triton": 1.0}]}]}]}]})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    kinds = {"kext": ("kext", lora_ops.ops.lora_linear), "fold": ("fold", torch.ops.lora_ops.lora_expand.default),
             "sgmv": ("sgmv", torch.ops.lora_ops.sgmv.default)}
    monkeypatch.setattr(decode_step, "routes", lambda: {n: kinds[n.split("-")[0]]
                                                        for n in ("kext-cuda", "fold-cuda", "sgmv-triton")})
    for T, expected in ((3, "kext-cuda"), (6, "fold-cuda"), (300, "sgmv-triton")):
        records, failures = [], []
        decode_step.bench_step(model, decode_step.Step(T=T, adapters=3, rank=4), "cpu", records, failures, print)
        assert not failures
        assert [r["backend"] for r in records if r.get("serving_default")] == [expected]


def test_decode_step_between_modules_writes_each_input_before_its_module(monkeypatch):
    """--between-modules: in the base and in every route, a kernel writes each module's input just before the module
    (x *= 1 in place: the outputs stay the oracle's), and the records say so; without it no input is written."""
    decode_step = _replay_eagerly(monkeypatch)
    setups = []
    init = decode_step.Setup.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setups.append(self)

    monkeypatch.setattr(decode_step.Setup, "__init__", kept)
    monkeypatch.setattr(decode_step, "routes", lambda: {"fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    for between in (False, True):
        records, failures = [], []
        decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                               between=between)
        assert not failures and [r["backend"] for r in records] == ["base", "fold-cpu"]
        assert all(r["err"] < 2e-2 and r.get("between_modules", False) == between for r in records)
        # the in-place writes bump each input's version counter: once per module call, in every graph
        assert all((x._version > 0) == between for x in setups[-1].x.values())


def test_decode_step_checks_the_kext_routes_returned_outputs(monkeypatch):
    """A kext route's y is what its op returns, one tensor per call: the bench checks that y, first layer and last,
    against the float64 oracle (a stand-in adding no LoRA is caught), and --parts times no part of it (one op)."""
    decode_step = _replay_eagerly(monkeypatch)
    right = lambda *args: reference.lora_linear(*args).to(args[0].dtype)  # h unrounded: well within the tolerance
    monkeypatch.setattr(decode_step, "routes", lambda: {"kext-oracle": ("kext", right),
                                                        "kext-base-only": ("kext", lambda x, w, *rest: x @ w.t())})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                           parts=True)
    assert [r["backend"] for r in records if r["op"] == "decode_step"] == ["base", "kext-oracle"]
    assert len(failures) == 1 and "kext-base-only" in failures[0] and "relative error" in failures[0]
    # its parts: each module's layers alone (the failed route's none)
    kext_parts = [r["backend"] for r in records if r["op"] == "decode_step_part" and "kext" in r["backend"]]
    assert kext_parts == [f"kext-oracle-{m}" for m in ("qkv", "o", "gate_up", "down")]


@pytest.mark.parametrize("fallback", ["fold", "sgmv"])
def test_decode_step_kext_route_runs_the_tables_fallback_where_the_kernels_do_not_serve(monkeypatch, fallback):
    """A module lora_linear's kernels do not serve on CUDA (Module.kext_fallback: the 70B shard's o_proj, K = 1024,
    has fewer K blocks than the GEMM's stages) runs the routes table's fallback for the step in the kext route's
    step, as the serving layer does, instead of timing lora_linear's composition (H200, 2e50c00: +164% against
    fold-cuda's +50% at T=32/32); the step's outputs still check."""
    decode_step = _replay_eagerly(monkeypatch)
    us = {"kext-cuda": 1.0, "fold-cuda": 2.0 if fallback == "fold" else 3.0, "sgmv-cuda": 2.5}
    monkeypatch.setattr(routes, "_tables", [routes._with_fallbacks([{"max_rank": None, "regimes": [
        {"max_tokens": 64, "route": "kext", "backend": "cuda", "us": [us]},
        {"max_tokens": None, "route": "sgmv", "backend": "cuda"}]}])])
    monkeypatch.setattr(routes, "_modules", [[(64, 64)]])
    ran = []
    real_op = routes.op
    # each call's op kind and, for lora_expand, whether it got the rows form (no seg_indptr), as CUDA's fold route does
    monkeypatch.setattr(routes, "op", lambda kind, backend: (
        lambda *a: ran.append((kind, kind == "lora_expand" and a[3] is None)) or real_op(kind, backend)(*a)))
    weights = []
    right = lambda *args: weights.append(args[1].shape) or reference.lora_linear(*args).to(args[0].dtype)
    monkeypatch.setattr(decode_step, "routes", lambda: {"kext-oracle": ("kext", right)})
    init = decode_step.Module.__init__

    def o_proj_not_served(self, K, widths, *rest):
        init(self, K, widths, *rest)
        self.kext_fallback = (K, tuple(widths)) == (64, (64,))  # the tiny model's o_proj
    monkeypatch.setattr(decode_step.Module, "__init__", o_proj_not_served)
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print)
    assert not failures and [r["backend"] for r in records] == ["base", "kext-oracle"]
    assert weights and (64, 64) not in weights and (128, 64) in weights  # o_proj's never; qkv's, ...
    assert ran and set(ran) == {("lora_expand", True) if fallback == "fold" else ("sgmv", False)}


def test_decode_step_times_the_kext_route_on_the_serving_pools_layout(monkeypatch):
    """kext-cuda (one lora_linear per module; on the CPU its composition of torch ops) is a route of the bench on
    every build, checked against the float64 oracle with the fold route's tolerance (h rounded to bf16), and every
    route reads B as the serving pool lays it out: lora_b [L, N, R], and for kext its copy b_cols [N, L·R]."""
    decode_step = _replay_eagerly(monkeypatch)
    m = decode_step.Module(64, (64, 32, 32), 4, "cpu", 0)
    assert m.lora_b.shape == (decode_step.POOL_SLOTS, 128, 4) and m.lora_b.is_contiguous()
    assert m.b_cols.shape == (128, decode_step.POOL_SLOTS * 4)
    assert m.kext_lora_b.data_ptr() == m.b_cols.data_ptr()
    assert m.kext_lora_b.stride() == (4, decode_step.POOL_SLOTS * 4, 1)
    assert torch.equal(m.kext_lora_b, m.lora_b)
    kext = decode_step.routes()["kext-cuda"]
    assert kext == ("kext", lora_ops.ops.lora_linear)
    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", torch.ops.lora_ops.sgmv.default),
                                                        "fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default),
                                                        "kext-cuda": kext})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=3)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print)
    assert not failures and [r["backend"] for r in records] == ["base", "sgmv-cpu", "fold-cpu", "kext-cuda"]
    errs = {r["backend"]: r["err"] for r in records}
    assert errs["kext-cuda"] < 2 * max(errs["base"], 1e-3) and errs["fold-cpu"] < 2 * max(errs["base"], 1e-3)
    # past the tokens lora_linear's kernels serve, kext is no route (its composition would be timed): not timed
    records = []
    T = routes.KEXT_MAX_TOKENS + 1
    decode_step.bench_step(model, decode_step.Step(T=T, adapters=3, rank=4), "cpu", records, failures, print)
    assert not failures and [r["backend"] for r in records] == ["base", "sgmv-cpu", "fold-cpu"]


def test_decode_step_reports_a_route_whose_capture_raises_and_times_the_others(monkeypatch):
    """A route that raises while its graph is captured (e.g. a sync under capture) is a failure of that route
    alone: the base and the other routes are still timed, checked and recorded."""
    captures = []

    def capture(calls):
        captures.append(calls)
        if len(captures) == 2:  # the base's, then the first route's: sgmv-cpu
            raise RuntimeError("operation not permitted when stream is capturing")

    decode_step = _replay_eagerly(monkeypatch, capture)
    sgmv = torch.ops.lora_ops.sgmv.default
    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", sgmv),
                                                        "fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print)
    assert [r["backend"] for r in records] == ["base", "fold-cpu"]
    assert len(failures) == 1 and "sgmv-cpu" in failures[0] and "capturing" in failures[0]


def test_decode_step_parts_time_the_fold_gemms_of_every_module_and_of_each_alone(monkeypatch):
    """--parts: the fold GEMM (cuBLAS's and fold_linear's) over the whole step and over each module's layers alone,
    each route's LoRA kernels alone (a fold route's expand also per module), and each module's layers alone through
    the base GEMM and through the fold route, recorded as % of the base step."""
    sizes = []
    decode_step = _replay_eagerly(monkeypatch, lambda calls: sizes.append(len(calls)))
    monkeypatch.setattr(decode_step, "time_interleaved",  # each part beside the base step: half its time
                        lambda runs, min_ms: {name: (run(), 4.0 if name == "base" else 2.0)[-1]
                                              for name, run in runs.items()})
    monkeypatch.setattr(decode_step, "routes", lambda: {"fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=3)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                           parts=True)
    assert not failures
    parts = {r["backend"]: r for r in records if r["op"] == "decode_step_part"}
    modules = ["qkv", "o", "gate_up", "down"]
    assert list(parts) == ["fold-gemm", "fold-gemm-fold_linear"] + \
        [name for m in modules for name in (f"fold-gemm-{m}", f"fold-gemm-fold_linear-{m}", f"base-{m}")] + \
        ["expand-only-cpu"] + [f"expand-only-cpu-{m}" for m in modules] + [f"fold-cpu-{m}" for m in modules]
    assert all(r["pct_of_base"] == 50.0 for r in parts.values())
    # the captures after the base's and the route's: the parts', in that order (build_segments + 4 x 3 layers)
    assert sizes[2:] == [12, 12] + [3] * 12 + [13] + [4] * 4 + [4] * 4


def test_time_interleaved_times_every_run_in_each_round_and_takes_the_median(monkeypatch):
    """The rounds alternate the runs (a drift over the measurement moves them alike) and each run's time is the
    median of its rounds (one slow round, e.g. a clock change, does not move it)."""
    from lora_ops.bench import timing
    order, times = [], iter([5.0, 1.0, 9.0, 1.2, 5.0, 40.0])

    def fake_loop(run, min_ms):
        order.append(run.__name__)
        assert min_ms == 10.0
        return next(times)

    def base():
        pass

    def route():
        pass

    monkeypatch.setattr(timing, "time_loop", fake_loop)
    assert timing.time_interleaved({"base": base, "route": route}, min_ms=30.0, rounds=3) == \
        {"base": 5.0, "route": 1.2}
    assert order == ["base", "route"] * 3


def test_decode_step_floors_count_the_present_adapters_and_the_fold_routes_every_slot_a():
    from lora_ops.bench import decode_step
    # qkv 8 -> (8, 4, 4), o 8 -> 8, gate_up 8 -> (16, 16), down 16 -> 8: 576 base weights; per slot at rank 2,
    # A 2·(3·8 + 8 + 2·8 + 16) = 128 and B 2·(16 + 8 + 32 + 8) = 128
    model = decode_step.ModelShape("tiny", hidden=8, q=8, kv=4, intermediate=16, layers=1)
    floor, fold = decode_step.floors_pct(model, decode_step.Step(T=4, adapters=3, rank=2))
    assert floor == pytest.approx(100 * 3 * 256 / 576)
    assert fold == pytest.approx(100 * (decode_step.POOL_SLOTS * 128 + 3 * 128) / 576)
    # Llama-3-8B: every slot's A puts the fold route's floor above the target at rank 64 (+45%) and with
    # one adapter (+5%); with the whole pool present the two floors are one
    llama = decode_step.MODELS["llama3-8b"]
    assert [round(v, 1) for v in decode_step.floors_pct(llama, decode_step.Step(64, 16, 64))] == [38.5, 56.7]
    assert [round(v, 1) for v in decode_step.floors_pct(llama, decode_step.Step(32, 1, 16))] == [0.6, 9.5]
    assert [round(v, 1) for v in decode_step.floors_pct(llama, decode_step.Step(32, 32, 16))] == [19.2, 19.2]
    # 16 tokens over 32 adapters: 16 of them are present
    assert [round(v, 1) for v in decode_step.floors_pct(llama, decode_step.Step(16, 32, 16))] == [9.6, 14.2]
    rows = [dict(op="decode_step", model="llama3-8b", T=64, adapters=16, rank=64, backend=b, base_us=4000.0,
                 us=us, overhead_pct=pct, floor_pct=38.5) for b, us, pct in
            (("base", 4000.0, 0.0), ("fold-cuda", 8000.0, 100.0), ("fold-triton", 7000.0, 75.0),
             ("kext-cuda", 6000.0, 50.0))]
    table = report._decode_table(rows)
    assert table[0] == "| model | T | adapters | rank | base step | floor | fold floor | serving default | " \
                       "fold-cuda | fold-triton | kext-cuda |"
    assert table[2] == "| llama3-8b | 64 | 16 | 64 | 4.00 ms | +38.5% | +56.7% | — | +100% | +75% | **+50%** |"
    rows[1]["serving_default"] = True
    assert report._decode_table(rows)[2] == "| llama3-8b | 64 | 16 | 64 | 4.00 ms | +38.5% | +56.7% | " \
                                            "+100% (fold-cuda) | +100% | +75% | **+50%** |"


def test_readme_section_renders_grouped_gemm_and_lora_expand(tmp_path):
    records = [_gg("cuda", 200.0, pct=20.0), _gg("triton", 250.0, pct=16.0), dict(_gg("grouped_mm", 190.0),
                                                                                  timed_alone=True),
               _gg("cuda", 210.0, w="float16", pct=19.0), _gg("triton", 260.0, w="float16", pct=15.0),
               _gg("grouped_mm", None, w="float16", unavailable="RuntimeError: capture failed"),
               dict(_gg("grouped_mm", 400.0, w="float16"), mode="eager"),  # torch 2.11: fp16 eager only
               _gg("cuda", 100.0, shape="64x128x2048x1408", groups=64, T=8192, K=2048, N=1408),
               _gg("grouped_mm", 120.0, shape="64x128x2048x1408", groups=64, T=8192, K=2048, N=1408),
               _gg("cuda", 40.0, shape="LoRA shrink", T=16384, N=16, pct=80.0),
               _gg("triton", 36.0, shape="LoRA shrink", T=16384, N=16, pct=89.0),
               dict(op="lora_expand", backend="cuda", mode="graph", T=32, adapters=32, rank=16, pool_rank=16,
                    N=4096, slices=1, dtype="bfloat16", us=5.0, pct_roofline=30.0),
               dict(op="lora_expand", backend="triton", mode="graph", T=32, adapters=32, rank=16, pool_rank=16,
                    N=4096, slices=1, dtype="bfloat16", us=7.0, pct_roofline=21.0)]
    result = dict(gpu="test GPU", date="2026-12-01", git_sha="abcdef0", torch="2.x", copy_tbps=4.2, records=records)
    text = report.readme_section(result)
    assert "**grouped_gemm op**" in text and "**lora_expand op**" in text
    assert "| 8x512x4096x4096 | 8 × 512, 4096 × 4096 | bf16 / bf16 / bf16 |" in text
    assert "unavailable" in text
    assert "lora_ops (cuda) reaches 0.95× the TFLOP/s of torch._grouped_mm" in text
    assert "(687 against 723; torch._grouped_mm timed alone, on its own output)" in text
    assert "8x512x4096x4096 in fp16: 654 TFLOP/s, 0.95× its bf16 speed (torch._grouped_mm's fp16 path cannot be " \
           "captured in a graph; eager it takes 400.0 µs, 344 TFLOP/s)" in text
    assert "lora_ops (cuda) reaches 1.20× the TFLOP/s of torch._grouped_mm (472 against 394; torch._grouped_mm timed " \
           "with the store of its output into y)" in text
    assert "grouped_gemm LoRA shrink: 36.0 µs, 89% of the memory roofline (triton)" in text
    assert "| 32 | 32 | 16 (16) | 4096, 1 | 5.0 (30%) | 7.0 (21%) | cuda |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n")
    report.update_readme(str(readme), result)
    assert readme.read_text() == f"intro\n{report.BEGIN}\n{text}\n{report.END}\noutro\n"


@pytest.mark.gpu
def test_grouped_gemm_baselines_match_the_oracle_on_the_gpu():
    """torch._grouped_mm and the torch loop as the bench calls them: right, or (torch._grouped_mm in fp16, with an
    fp32 x, or with an fp32 y from half inputs: torch 2.11 wants out_dtype = x's dtype) refused by torch."""
    for case in ops.CPU_GG_CASES:
        pb = ops.GroupedGemmProblem(case, "cuda", seed=3)
        for name, fn in (("grouped_mm", ops.gg_grouped_mm), ("torch_loop", ops.gg_torch_loop)):
            y = pb.p.y.clone()
            ref = reference.grouped_gemm(*pb.p.args())
            try:
                fn(pb, y)
            except RuntimeError:
                assert name == "grouped_mm" and (case.dtype != "bfloat16" or "float32" in (case.x_dtype, case.y_dtype)), case
                continue
            assert not testing.check_against_reference(y, pb.p.y, ref, pb.p.w.dtype), (name, case)
    torch.cuda.synchronize()


def test_route_choice_bounds_the_worst_slowdown_at_both_ends_of_a_regime_and_over_the_mixes():
    from lora_ops.bench.decode_step import choose_routes
    # the 7f9cdc6 rank-16 samples at T = 64, 256, 1024 (µs): at its top end alone, 65-256 took fold-triton (12.8%
    # slower than fold-cuda at 64), 257-1024 sgmv-cuda (20.7% slower than fold-triton at 256)
    samples = [{"sgmv-cuda": 6705.6, "fold-cuda": 5252.5, "sgmv-triton": 8991.8, "fold-triton": 5923.7},
               {"sgmv-cuda": 10196.4, "fold-cuda": 8872.7, "sgmv-triton": 11193.8, "fold-triton": 8445.8},
               {"sgmv-cuda": 25358.9, "fold-cuda": 30562.1, "sgmv-triton": 28017.8, "fold-triton": 26573.7}]
    chosen = choose_routes([samples])
    assert [c for c, _ in chosen] == ["fold-cuda", "fold-cuda", "fold-triton"]
    assert [w for _, w in chosen] == pytest.approx([1.0, 8872.7 / 8445.8, 26573.7 / 25358.9])
    assert choose_routes([[{"a": 2.0, "b": 2.0, "c": 1.0}]]) == [("c", 1.0)]
    assert [c for c, _ in choose_routes([[{"a": 1.0, "b": 1.1}, {"a": 1.05, "b": 1.0}]])] == ["a", "a"]  # 5% < 10%
    assert [c for c, _ in choose_routes([[{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}]])] == ["a", "a"]  # tie: first
    # The 057b51d 70B shard at T = 16 and 32 (ms; with one adapter at 16 a stand-in): with 32 adapters kext-cuda
    # leads at 16 and ties at 32, so it takes 17-32 tokens; with one adapter it is 10% slower at 32: over both
    # mixes fold-cuda takes 17-32 (its worst: 7% behind at 16 tokens)
    mixed = [{"kext-cuda": 7.197, "fold-cuda": 7.676}, {"kext-cuda": 8.160, "fold-cuda": 8.101}]
    single = [{"kext-cuda": 7.0, "fold-cuda": 6.6}, {"kext-cuda": 7.343, "fold-cuda": 6.684}]
    assert [c for c, _ in choose_routes([mixed])] == ["kext-cuda", "kext-cuda"]
    assert [c for c, _ in choose_routes([mixed, single])] == ["kext-cuda", "fold-cuda"]
    # a route timed in one mix only (not at this T in another) is not chosen
    assert [c for c, _ in choose_routes([[{"a": 1.0, "b": 2.0}], [{"b": 2.0}]])] == ["b"]
    # a route that serves only the regime below (kext up to 128 tokens) does not set the pace at this regime's
    # lower end: against it fold-cuda's and sgmv-cuda's ratios there would both be ~2 and hide sgmv's 33% lead at 256
    at_128 = {"sgmv-cuda": 101.0, "fold-cuda": 100.0, "kext-cuda": 50.0}
    at_256 = {"sgmv-cuda": 150.0, "fold-cuda": 200.0}
    assert choose_routes([[at_128, at_256]])[1] == ("sgmv-cuda", pytest.approx(1.01))


def _regime(T: int, slowdown: float, *mixes: dict) -> dict:
    """A routes table's regime measured at T: its chosen route's worst slowdown and its mixes' times."""
    return dict(measured_T=T, slowdown=slowdown, us=[dict(m, base=1.0) for m in mixes])


def test_split_points_are_the_middles_of_regimes_whose_lead_changes_between_their_ends():
    """split_points: the middle (rounded down) of each regime more than SPLIT_ABOVE off at an end, the worst first;
    none where the ends are closer than SPLIT_MIN_TOKENS, where the mixes disagree at either end (no T between the
    ends helps), or for the first regime (one end); the regime's own routes set the pace at its lower end."""
    from lora_ops.bench.decode_step import split_points
    at = lambda T, slowdown, fold, sgmv: _regime(T, slowdown, {"fold-cuda": fold, "sgmv-cuda": sgmv})
    assert split_points([at(512, 1.0, 1.0, 2.0), at(768, 1.06, 1.0, 1.5), at(1024, 1.3, 1.3, 1.0)]) == [896, 640]
    assert split_points([at(512, 1.0, 1.0, 2.0), at(768, 1.05, 1.0, 1.05)]) == []  # within 5%
    assert split_points([at(64, 1.3, 1.0, 1.3), at(128, 1.0, 1.0, 1.2)]) == []  # the first regime: one end
    assert split_points([at(64, 1.0, 1.0, 1.2), at(72, 1.2, 1.2, 1.0)]) == []  # 8 tokens apart
    assert split_points([at(64, 1.0, 1.0, 1.2), at(81, 1.2, 1.2, 1.0)]) == [72]
    # fold-cuda leads with one adapter and sgmv-cuda by as much with 32, at the lower end or at the upper: no route
    # is within 5% there
    disagree = ({"fold-cuda": 1.0, "sgmv-cuda": 1.1}, {"fold-cuda": 1.1, "sgmv-cuda": 1.0})
    agree = lambda fold, sgmv: ({"fold-cuda": fold, "sgmv-cuda": sgmv},) * 2
    assert split_points([_regime(768, 1.1, *disagree), _regime(1024, 1.1, *agree(1.1, 1.0))]) == []
    assert split_points([_regime(768, 1.0, *agree(1.0, 1.2)), _regime(1024, 1.1, *disagree)]) == []
    assert split_points([_regime(768, 1.0, *agree(1.0, 1.2)), _regime(1024, 1.1, *agree(1.1, 1.0))]) == [896]
    # kext-cuda, fastest at 128 but not timed at 256, does not make 128 an end where no route of 129-256 is within
    # 5%: fold-cuda leads both routes of the regime there
    low = _regime(128, 1.0, {"fold-cuda": 1.0, "sgmv-cuda": 1.3, "kext-cuda": 0.5})
    assert split_points([low, _regime(256, 1.3, {"fold-cuda": 1.3, "sgmv-cuda": 1.0})]) == [192]


def _times(T: int) -> dict:
    """Stand-in times of every route at T: fold-cuda fastest up to 768 tokens, sgmv-cuda (11% ahead) from 1000."""
    us = {"base": 1.0, **{n: 300.0 for n in routes.timed_names(T)}}
    return dict(us, **{"fold-cuda": 100.0, "sgmv-cuda": 90.0 if T >= 1000 else 200.0})


def test_class_regimes_split_as_the_sweep_does_and_take_no_other_steps():
    """class_regimes replays the sweep's splits from the records: the split due until it is timed for the base and
    every route of every mix, then the next; a complete step that no split asked for (another step of the run, a
    merged sweep's split) is no bound, and a split timed incompletely is none either."""
    from lora_ops.bench.decode_step import class_regimes
    mixes = ((16, 32), (16, 1))
    timed = {("m", T, a, r): _times(T) for T in routes.REGIME_SAMPLES + (200,) for r, a in mixes}
    timed[("other", 896, 32, 16)] = timed[("other", 896, 1, 16)] = _times(896)  # another model's
    bounds = lambda regimes: [r["max_tokens"] for r in regimes]
    regimes, due = class_regimes(timed, "m", mixes)
    assert bounds(regimes) == list(routes.REGIME_BOUNDS) and due == 896  # 768-1024: fold-cuda 11% off at 1024
    assert regimes[routes.REGIME_BOUNDS.index(1024)]["slowdown"] == pytest.approx(100 / 90, abs=1e-3)
    timed[("m", 896, 32, 16)] = _times(896)
    timed[("m", 896, 1, 16)] = {k: v for k, v in _times(896).items() if k != "base"}  # no base time in one mix
    assert class_regimes(timed, "m", mixes)[1] == 896
    timed[("m", 896, 1, 16)] = _times(896)
    regimes, due = class_regimes(timed, "m", mixes)
    assert bounds(regimes) == sorted(routes.REGIME_BOUNDS[:-1] + (896,)) + [None] and due == 960
    for T in (960, 992):
        timed.update({("m", T, a, r): _times(T) for r, a in mixes})
    regimes, due = class_regimes(timed, "m", mixes)  # SPLIT_MAX_SAMPLES: no fourth split is due
    assert bounds(regimes) == sorted(routes.REGIME_BOUNDS[:-1] + (896, 960, 992)) + [None] and due is None
    assert [r["measured_T"] for r in regimes] == bounds(regimes)[:-1] + [routes.REGIME_SAMPLES[-1]]


def _stand_in_step(model, step, device, records, failures, log, *rest):
    """bench_step's records on stand-in timings: kext-cuda wins at rank 16 up to KEXT_MAX_TOKENS (the bench times
    it no further) and at rank 64 up to 48 tokens, fold-cuda beyond at rank 16, fold-triton at rank 64, sgmv-cuda
    from 1024 tokens at both; on the 70B shard sgmv-cuda everywhere."""
    us = {"base": 100.0, "fold-cuda": 130.0 if step.rank == 16 else 190.0, "fold-triton": 150.0,
          "sgmv-cuda": 120.0 if step.T >= 1024 or model.name == "llama3-70b-tp8" else 200.0, "sgmv-triton": 210.0}
    if step.T <= routes.KEXT_MAX_TOKENS:
        us["kext-cuda"] = 125.0 if step.rank == 16 else (140.0 if step.T <= 48 else 160.0)
    records += [dict(op="decode_step", model=model.name, backend=b, us=v, T=step.T, adapters=step.adapters,
                     rank=step.rank) for b, v in us.items()]


def test_routes_table_has_a_class_per_pool_rank_with_the_fastest_route_per_regime(tmp_path, monkeypatch):
    """write_routes (GPU-only through the CLI) on stand-in timings: a table per model with its modules' (K, N), one
    class per rank bound measured at its mixes, each regime's route by choose_routes with every mix's times, a
    table that routes.pick reads, and none written when a route fails."""
    from lora_ops.bench import decode_step

    ran = []
    monkeypatch.setattr(decode_step, "bench_step", lambda model, step, *rest, only=None: ran.append((model.name, step))
                        or only == routes.NAMES and _stand_in_step(model, step, *rest))  # lora_ops' routes alone
    path = str(tmp_path / "routes.json")
    failures = []
    models = ["llama3-8b", "qwen2-7b", "llama3-70b-tp8"]
    decode_step.write_routes(path, "cuda", [], failures, lambda s: None, dict(gpu="test", git_sha="x", date="d"),
                             models)
    assert failures == []
    # each class of llama3-8b and of qwen2-7b split three times (SPLIT_MAX_SAMPLES, a model's own) where its route
    # is 8-25% slower at 1024 tokens than sgmv-cuda there and the fastest at 768, the worse half again each time
    # (not rank 64's 49-64 tokens, 6.7% off: the worst first); the shard's routes tie nowhere
    splits = (896, 960, 992)
    assert sorted(set(ran), key=str) == sorted({(m, decode_step.Step(T, a, r)) for m in models
                                                for mixes in routes.CLASS_MIXES for r, a in mixes
                                                for T in routes.REGIME_SAMPLES + (splits if m != models[2] else ())},
                                               key=str)
    table = routes.load(path)
    routes.validate(table)
    assert [m["model"] for m in routes.model_tables(table)] == models
    *split, shard = routes.model_tables(table)
    assert shard["modules"] == [[8192, 1280], [1024, 8192], [8192, 7168], [3584, 8192]]
    assert {r["route"] for c in routes.rank_classes(shard) for r in c["regimes"]} == {"sgmv"}
    # up to 1024: sgmv-cuda wins at 1024 by 8% (rank 16), but is 54% slower at 992; beyond, at both ends. kext-cuda
    # at rank 16 in the regimes up to KEXT_MAX_TOKENS, fold-cuda in the next (kext-cuda is not timed at its upper
    # end, fold-cuda 4% slower at its lower); at rank 64 up to 64 tokens (6.7% off there, fold-triton 7.1% at 48)
    want = {16: ("fold-cuda", routes.KEXT_MAX_TOKENS), 64: ("fold-triton", 64)}
    for model_table in split:
        classes = routes.rank_classes(model_table)
        assert [c["max_rank"] for c in classes] == list(routes.RANK_BOUNDS)
        assert [[(m["rank"], m["adapters"]) for m in c["mixes"]] for c in classes] == \
            [list(mixes) for mixes in routes.CLASS_MIXES]
        for c, mixes in zip(classes, routes.CLASS_MIXES):
            fold, kext_up_to = want[mixes[0][0]]
            got = [f"{r['route']}-{r['backend']}" for r in c["regimes"]]
            bounds = [r["max_tokens"] for r in c["regimes"]]
            assert bounds == sorted(routes.REGIME_BOUNDS[:-1] + splits) + [None]
            assert [r["measured_T"] for r in c["regimes"]] == bounds[:-1] + [routes.REGIME_SAMPLES[-1]]
            assert got == ["kext-cuda" if b is not None and b <= kext_up_to else
                           fold if b is not None and b <= 1024 else "sgmv-cuda" for b in bounds]
            assert got[-2:] == ["sgmv-cuda"] * 2
            slowdowns = {r["max_tokens"]: r["slowdown"] for r in c["regimes"]}
            assert slowdowns[896] == slowdowns[960] == 1.0 and slowdowns[1024] > routes.SPLIT_ABOVE  # budget spent
            assert all(len(r["us"]) == len(mixes) and r["us"][0]["base"] == 100.0 for r in c["regimes"])
            assert c["regimes"][0]["slowdown"] == 1.0 and max(r["slowdown"] for r in c["regimes"]) > 1.0
    # The same table from the run's results file (python -m lora_ops.bench.report --routes), and none from a
    # file with failures or without the sweep.
    records = []
    for name, step in ran:
        _stand_in_step(decode_step.MODELS[name], step, "cuda", records, [], None)
    # an earlier record of a route at a sample step (the issue rows run first): the sweep's own counts; and a
    # peer's record (a run's vllm route), faster than every route: no table chooses a peer
    stale = dict(next(r for r in records if r["backend"] == "fold-triton"), us=1.0)
    peer = dict(records[0], backend="vllm", us=0.5)
    # another step of the run, every route timed (--steps 200/16/64 beside --routes): no split asked for it
    other = []
    _stand_in_step(decode_step.MODELS["llama3-8b"], decode_step.Step(200, 16, 64), "cuda", other, [], None)
    results = dict(gpu="test", git_sha="x", date="d", torch="t", failures=[],
                   records=[stale] + other + records + [peer])
    (tmp_path / "run.json").write_text(json.dumps(results))
    assert report.main([str(tmp_path / "run.json"), "--routes", str(tmp_path / "again.json"),
                        "--routes-models", ",".join(models)]) == 0
    again = routes.load(str(tmp_path / "again.json"))
    assert again.pop("source") == "run.json" and again == dict(table, torch="t")
    some_routes = [r for r in records if r["backend"] in ("base", "fold-cuda")]  # a run with --impls fold-cuda
    no_kext = [r for r in records if r["backend"] != "kext-cuda"]  # a run before the route
    one_mix = [r for r in records if r["adapters"] != 1]  # a run before the single-adapter mix
    for broken in (dict(results, failures=["decode_step fold-cuda: raised"]), dict(results, records=records[:-5]),
                   dict(results, records=some_routes), dict(results, records=no_kext),
                   dict(results, records=one_mix)):
        (tmp_path / "run.json").write_text(json.dumps(broken))
        with pytest.raises(SystemExit):
            report.main([str(tmp_path / "run.json"), "--routes", str(tmp_path / "none.json"),
                         "--routes-models", ",".join(models)])
        assert not (tmp_path / "none.json").exists()
    (tmp_path / "run.json").write_text(json.dumps(dict(results, records=[r for r in records
                                                                         if r["model"] != "qwen2-7b"])))
    with pytest.raises(SystemExit):  # the default's three models: qwen2-7b has no sweep in the run
        report.main([str(tmp_path / "run.json"), "--routes", str(tmp_path / "none.json")])
    failing = lambda model, step, device, records, failures, *rest, **kw: failures.append("fold-cuda raised")
    monkeypatch.setattr(decode_step, "bench_step", failing)
    (tmp_path / "routes.json").unlink()
    decode_step.write_routes(path, "cuda", [], failures, lambda s: None, dict(gpu="test", git_sha="x", date="d"),
                             models)
    assert not (tmp_path / "routes.json").exists() and "not written" in failures[-1]
    monkeypatch.setattr(routes, "_tables", None)  # restored after the test, with _modules
    monkeypatch.setattr(routes, "_modules", None)
    routes.install(table)
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    assert routes.pick(routes.KEXT_MAX_TOKENS, "cuda", 16) == ("kext", "cuda")
    assert routes.pick(routes.KEXT_MAX_TOKENS, "cuda", 16, kext_serves=False) == ("fold", "cuda")
    assert routes.pick(routes.KEXT_MAX_TOKENS + 1, "cuda", 16) == ("fold", "cuda")
    assert routes.pick(64, "cuda", 64) == ("kext", "cuda")
    assert routes.pick(80, "cuda", 64) == ("fold", "triton")
    assert routes.pick(900, "cuda", 64) == routes.pick(1000, "cuda", 64) == ("fold", "triton")  # the splits
    assert routes.pick(64, "cuda", 16, True, 2) == ("sgmv", "cuda")
    assert decode_step.serving_default(decode_step.MODELS["llama3-70b-tp8"], decode_step.Step(64, 32, 16)) == \
        "sgmv-cuda"
    assert decode_step.serving_default(decode_step.MODELS["llama3-8b"], decode_step.Step(64, 32, 16)) == "kext-cuda"


def test_decode_step_steps_option_parses_and_refuses_bad_steps(capsys):
    from lora_ops.bench import decode_step
    assert decode_step.parse_steps("16/16/64,4/4/8") == [decode_step.Step(16, 16, 64), decode_step.Step(4, 4, 8)]
    assert decode_step.parse_steps("64/16/64/drawn,4/4/8/even") == [decode_step.Step(64, 16, 64, "drawn"),
                                                                    decode_step.Step(4, 4, 8)]
    for bad, msg in (("16/16", "three positive integers"), ("0/1/16", "three positive integers"),
                     ("64/16/64/lumpy", "/even or /drawn"), ("64/16/drawn", "three positive integers"),
                     ("8/33/16", "more adapters than the pool's 32 slots")):
        with pytest.raises(SystemExit):
            bench.main(["--device", "cuda", "--decode-step", "--steps", bad])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--steps", "16/16/64"])  # the op bench has no steps
    assert "--steps needs --decode-step" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one shape's sweep would overwrite the three shapes' tables
        bench.main(["--device", "cuda", "--decode-step", "--routes", routes.PATH])
    assert "holds every shape's table: give --models all" in capsys.readouterr().err


def test_bench_writes_a_serving_route_table_of_its_own_gpu_only(capsys, monkeypatch):
    """A route sweep on one GPU model does not overwrite another model's packaged table (routes.PATH, the H200's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--decode-step", "--models", "all", "--routes", routes.PATH])
    assert "this GPU's is " + os.path.join(routes.TABLES_DIR, "h100.json") in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gg_composed_is_the_sgmv_on_slices_and_true_ranks(dtype):
    """The op bench's gg_composed baseline (lora_ops.grouped_gemm twice a slice) against the oracle, where the quick
    bench's case has neither: three slices of unequal widths, adapters of rank 8 in a rank-16 pool (the ops get
    lora_ranks)."""
    case = ops.Case(40, 5, 8, K=64, N=96, slices=3, slice_widths=(48, 32, 16), pool_rank=16, pool_slots=8)
    pb = ops.Problem(case, dtype, "cpu", seed=11)
    before = pb.p.y.clone()
    ops.gg_composed(pb, pb.p.y)
    ref = reference.sgmv(*pb.p.args(before))
    assert testing.check_against_reference(pb.p.y, before, ref, dtype) == ""


def test_gg_composed_halves_take_the_op_tables_backends():
    """gg_composed runs each half where the op table puts its regime, as the serving dispatch would: on the H200's
    table the LoRA shrink past 4096 rows (n = 16, K = 4096) on Triton, its expand (k = 16) and every half at 4096
    rows on the C++ kernels; without a table (the CPU, no Triton) every half on lora_ops.ops."""
    pytest.importorskip("triton")
    import lora_ops.triton as lt
    table = op_table.load(op_table.path_for("NVIDIA H200"))
    cpp = lora_ops.ops.grouped_gemm
    assert ops.gg_halves(table, 16384, 4096, 16, [4096]) == (lt.grouped_gemm, [cpp])
    assert ops.gg_halves(table, 4096, 4096, 16, [4096, 1024]) == (cpp, [cpp, cpp])
    assert ops.gg_halves(None, 16384, 4096, 16, [4096, 1024]) == (cpp, [cpp, cpp])


def test_case_slice_offsets():
    qkv = ops.Case(64, 16, 16, N=6144, slices=3, slice_widths=ops.QKV_WIDTHS)
    assert qkv.offsets == [0, 4096, 5120, 6144]
    assert ops.Case(8, 4, 16, N=1000, slices=3).offsets == [0, 333, 666, 1000]
    assert ops.Problem(dataclasses.replace(qkv, T=4, K=64), torch.float32, "cpu", seed=1).p.slice_offsets == \
        [0, 4096, 5120, 6144]
    with pytest.raises(ValueError, match="slice_widths"):
        ops.Case(8, 4, 16, N=6144, slices=3, slice_widths=(4096, 1024, 512))


# The floors' byte counts, written out per term (bf16 weights and x, the case's y dtype): what a kernel must read
# and write. A pool rank above the adapter's must not count (true-rank cost), every slice's A rows must.
@pytest.mark.parametrize("slices, N", [(1, 1024), (3, 1536)])
def test_sgmv_bytes_count_x_the_true_rank_rows_of_every_slice_and_y_twice(slices, N):
    case = ops.Case(8, 4, 8, K=1024, N=N, slices=slices, pool_rank=64)
    pb = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    x, a, b, y = 8 * 1024 * 2, 4 * (slices * 8) * 1024 * 2, 4 * N * 8 * 2, 8 * N * 2
    assert pb.touched_bytes() == x + a + b + y
    assert pb.min_bytes() == x + a + b + 2 * y


def test_expand_bytes_count_each_rows_window_of_h_the_b_of_adapters_present_and_y_twice():
    case = ops.Case(8, 4, 16, N=1024, slices=2, pool_rank=64)
    pb = ops.ExpandProblem(case, torch.bfloat16, "cpu", seed=1)
    h, b, y = 8 * 2 * 16 * 2, 4 * 1024 * 16 * 2, 8 * 1024 * 2
    assert pb.touched_bytes() == h + b + y and pb.min_bytes() == h + b + 2 * y


@pytest.mark.parametrize("accumulate", [False, True])
def test_grouped_gemm_bytes_read_y_only_when_accumulating(accumulate):
    case = ops.GroupedGemmCase(4, 16, 32, 48, "bfloat16", x_dtype="float32", accumulate=accumulate)
    pb = ops.GroupedGemmProblem(case, "cpu", seed=1)
    x, w, y = 64 * 32 * 4, 4 * 48 * 32 * 2, 64 * 48 * 2
    assert pb.touched_bytes() == x + w + y
    assert pb.min_bytes() == x + w + y + (y if accumulate else 0)
    assert pb.flops() == 2 * 64 * 48 * 32


def test_the_bench_times_its_implementations_in_turn_round_after_round(monkeypatch):
    """On CUDA (faked on the host) every implementation and mode that passed its checks is timed in each of the
    rounds, in turn; its record is the median of its rounds over the calls a run makes, and its roofline % is
    the floor's bytes over that time against the copy bandwidth. Timed one after another, two implementations a
    few % apart could trade places with a drift of the clocks."""
    monkeypatch.setattr(timing, "capture", lambda calls: SimpleNamespace(replay=lambda: [f() for f in calls]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    names = iter(["a-graph", "a-eager", "b-graph", "b-eager"])  # the order _measure makes its runners in
    real_runner = ops.cuda_runner

    def named_runner(calls, graph, check=None):
        run, n = real_runner(calls, graph, check)
        return SimpleNamespace(name=next(names), run=run), n
    monkeypatch.setattr(ops, "cuda_runner", named_runner)
    order = []
    ms_of = {"a": [1.0, 9.0, 2.0, 2.0, 2.0], "b": [4.0, 4.0, 1.0, 4.0, 4.0]}  # one outlier round each

    def fake_loop(run, min_ms):
        order.append(run.name)
        return ms_of[run.name[0]][order.count(run.name) - 1]
    monkeypatch.setattr(timing, "time_loop", fake_loop)
    case = ops.CPU_CASES[1]
    first = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    sets = [first, ops.Problem(case, torch.bfloat16, "cpu", 2, like=first)]
    right = ops._ours(lora_ops.ops, "sgmv")
    records, failures = [], []
    ops._measure("sgmv", {"T": case.T}, {"a": right, "b": right}, sets, lambda pb: pb.p.y,
                 lambda pb: reference.sgmv(*pb.p.args()), torch.bfloat16, first.min_bytes(), None, "cuda", 1e-4,
                 records, failures, lambda s: None)
    assert failures == []
    assert order == ["a-graph", "a-eager", "b-graph", "b-eager"] * 5
    eager_calls = 2 * (ops.MIN_CALLS // 2)  # eager runs repeat the 2 sets up to MIN_CALLS; checked graphs do not
    us = {(r["backend"], r["mode"]): r["us"] for r in records}
    assert us == {("a", "graph"): 2e3 / 2, ("a", "eager"): 2e3 / eager_calls, ("b", "graph"): 4e3 / 2,
                  ("b", "eager"): 4e3 / eager_calls}
    rec = next(r for r in records if (r["backend"], r["mode"]) == ("a", "graph"))
    assert rec["pct_roofline"] == pytest.approx(100 * first.min_bytes() / 1e-3 / 1e9 / 0.1, abs=0.05)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_implementations_timed_runs_call_that_implementation(device, monkeypatch):
    """_measure makes every implementation's runners in one loop and times them after it: each run must call its
    own implementation, in both modes (CUDA faked on the host). Session 42's interleaved bench timed the last
    implementation's eager calls under every name: its call lists looked the loop's function up when called."""
    right = ops._ours(lora_ops.ops, "sgmv")
    ran = []
    impls = {name: (lambda pb, y, name=name: (ran.append(name), right(pb, y))) for name in ("a", "b")}

    def which_ran(run):
        ran.clear()
        run()
        return set(ran)
    timed = {}
    if device == "cuda":
        monkeypatch.setattr(timing, "capture", lambda calls: SimpleNamespace(replay=lambda: [f() for f in calls]))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(ops, "time_interleaved", lambda runs, min_ms: {
            key: timed.setdefault(key, which_ran(run)) and 1.0 for key, run in runs.items()})
    else:
        monkeypatch.setattr(ops, "time_cpu", lambda run: timed.setdefault(len(timed), which_ran(run)) and 1.0)
    case = ops.CPU_CASES[1]
    first = ops.Problem(case, torch.bfloat16, "cpu", seed=1)
    sets = [first, ops.Problem(case, torch.bfloat16, "cpu", 2, like=first)]
    records, failures = [], []
    ops._measure("sgmv", {"T": case.T}, impls, sets, lambda pb: pb.p.y, lambda pb: reference.sgmv(*pb.p.args()),
                 torch.bfloat16, first.min_bytes(), None, device, None, records, failures, lambda s: None)
    assert failures == [] and len(records) == (4 if device == "cuda" else 2)
    if device == "cuda":
        assert timed == {(name, mode): {name} for name in ("a", "b") for mode in ("graph", "eager")}
    else:
        assert timed == {0: {"a"}, 1: {"b"}}


def test_records_from_a_changed_tree_say_so(tmp_path, monkeypatch):
    monkeypatch.delenv("LORA_OPS_GIT_SHA", raising=False)
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                                       text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD")
    (tmp_path / "untracked").write_text("")
    assert bench.git_sha(str(tmp_path)) == head
    (tmp_path / "f").write_text("2")
    assert bench.git_sha(str(tmp_path)) == head + "-dirty"
    monkeypatch.setenv("LORA_OPS_GIT_SHA", "abc")
    assert bench.git_sha(str(tmp_path)) == "abc"


def test_the_decode_step_and_routes_run_with_the_serving_op_table_and_the_op_bench_without(monkeypatch, tmp_path):
    """The serving layer's backend "cuda" is the public op, which hands the op table's regimes to Triton: the
    decode step and the routes sweep time it so. The op bench times the C++ kernels alone (the table is made from
    it)."""
    table = {"stands for": "the installed table"}
    monkeypatch.setattr(op_table, "installed", table)
    seen = {}
    monkeypatch.setattr(bench, "run_op_bench", lambda *a: seen.setdefault("ops", op_table.installed))
    monkeypatch.setattr(bench.decode_step, "run", lambda *a: seen.setdefault("decode", op_table.installed))
    monkeypatch.setattr(bench.decode_step, "write_routes", lambda *a: seen.setdefault("routes", op_table.installed))
    monkeypatch.setattr(op_table, "install", lambda t: setattr(op_table, "installed", t))
    # a CUDA device on the host: its properties and the run's first measurements faked
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(name="fake", L2_cache_size=1))
    monkeypatch.setattr(bench, "copy_bandwidth_tbps", lambda d: 4.0)
    monkeypatch.setattr(bench, "launch_floor_us", lambda d: 1.0)
    monkeypatch.setattr(bench.ops, "host_overhead_us", lambda d: 1.0)
    monkeypatch.setattr(bench.peers, "vllm_ops", lambda: (None, "not built"))
    bench.main(["--device", "cuda", "--ops", "--decode-step", "--routes", str(tmp_path / "r.json")])
    assert seen == {"ops": None, "decode": table, "routes": table}
    assert op_table.installed is table
