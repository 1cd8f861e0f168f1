"""The decode-step bench's records and their tables in the report, on the CPU: a step timed with input writers
(--between-modules), or with its rows spread unevenly over its adapters (/drawn), is never shown or chosen beside one
timed without, the copy floor is recorded and rendered (and records from before it still render), and --parts
divides each part by a base timed in its own rounds."""
import json

import pytest
import torch

from lora_ops import routes
from lora_ops.bench import decode_step, report

TINY = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=2)


def _step_record(backend, us, base_us, between=None, **extra):
    """A decode-step record of llama3-8b's 32/32/16 step; between None: one from before the bench recorded it."""
    r = dict(op="decode_step", model="llama3-8b", T=32, adapters=32, rank=16, backend=backend, base_us=base_us,
             us=us, overhead_pct=round(100 * (us - base_us) / base_us, 2), floor_pct=19.2, err=1e-3, **extra)
    if between is not None:
        r["between_modules"] = between
    return r


def _run(records):
    return dict(gpu="test GPU", git_sha="abc1234", date="2026-12-01", torch="2.x", copy_tbps=4.2, failures=[],
                records=records)


def test_a_drawn_step_has_a_row_of_its_own_and_no_route_table_regime():
    """A step with drawn adapter sizes beside the even one of the same T, adapters and rank: a row of its own, marked
    drawn, and left out of what a routes table is made of (its sweep's steps are even; records from before the
    spread was recorded are)."""
    even = [_step_record("base", 4000.0, 4000.0), _step_record("fold-cuda", 5200.0, 4000.0, spread="even"),
            _step_record("kext-cuda", 4800.0, 4000.0)]
    drawn = [_step_record("base", 4100.0, 4100.0, spread="drawn"),
             _step_record("fold-cuda", 5700.0, 4100.0, spread="drawn")]
    rows = [line for line in report._decode_table(even + drawn) if line.startswith("| llama3-8b ")]
    assert rows == ["| llama3-8b | 32 | 32 | 16 | 4.00 ms | +19.2% | +19.2% | — | +30% | **+20%** |",
                    "| llama3-8b | 32 | 32 drawn | 16 | 4.10 ms | +19.2% | +19.2% | — | **+39%** | — |"]
    assert decode_step.timed_steps(even + drawn) == {("llama3-8b", 32, 32, 16): {
        "base": 4000.0, "fold-cuda": 5200.0, "kext-cuda": 4800.0}}


def test_a_default_and_a_between_modules_run_merge_into_separate_decode_tables(tmp_path, capsys):
    """A default run and a --between-modules run of the same step, merged: each table's row shows one run's base
    and overheads, and the between-modules table says what it was timed with."""
    default = [_step_record("base", 4000.0, 4000.0), _step_record("fold-cuda", 5200.0, 4000.0),
               _step_record("kext-cuda", 4800.0, 4000.0)]  # from before the bench recorded between_modules
    between = [_step_record("base", 4400.0, 4400.0, between=True),
               _step_record("kext-cuda", 5500.0, 4400.0, between=True)]
    paths = [tmp_path / "default.json", tmp_path / "between.json"]
    for path, records in zip(paths, (default, between)):
        path.write_text(json.dumps(_run(records)))
    assert report.main([str(p) for p in paths]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| llama3-8b ")]
    assert rows == ["| llama3-8b | 32 | 32 | 16 | 4.00 ms | +19.2% | +19.2% | — | +30% | **+20%** |",
                    "| llama3-8b | 32 | 32 | 16 | 4.40 ms | +19.2% | +19.2% | — | **+25%** |"]
    heading = next(i for i, line in enumerate(lines) if line.startswith("With --between-modules"))
    assert lines.index(rows[0]) < heading < lines.index(rows[1])
    merged = report.merge([_run(default), _run(between)])["records"]
    assert report._decode_table(merged) == report._decode_table(default)
    assert report._decode_table(merged, between=True) == report._decode_table(between, between=True)


def _sweep(between: bool, fastest: str):
    """A route sweep's records of llama3-8b on stand-in timings, `fastest` the fastest route at every step."""
    records = []
    for mixes in routes.CLASS_MIXES:
        for rank, adapters in mixes:
            for T in routes.REGIME_SAMPLES:
                us = dict({"base": 100.0}, **{n: 120.0 if n == fastest else 150.0 for n in routes.timed_names(T)})
                records += [dict(op="decode_step", model="llama3-8b", T=T, adapters=adapters, rank=rank,
                                 between_modules=between, backend=b, us=v) for b, v in us.items()]
    return records


def test_the_routes_table_leaves_out_between_modules_records():
    """A --between-modules run's records at the sweep's steps (merged, or from the same run) choose no route."""
    meta = dict(gpu="test", git_sha="x", date="d")
    sweep = _sweep(False, "fold-cuda")
    table = decode_step.routes_table(sweep, meta, ["llama3-8b"])
    assert {r["route"] + "-" + r["backend"] for c in routes.rank_classes(routes.model_tables(table)[0])
            for r in c["regimes"]} == {"fold-cuda"}
    assert decode_step.routes_table(sweep + _sweep(True, "sgmv-cuda"), meta, ["llama3-8b"]) == table


def test_the_copy_floor_is_the_adapters_present_at_the_copy_bandwidth():
    # per layer and slot at rank 4: A 4·(3·64 + 64 + 2·64 + 128) = 2048 and B 4·(128 + 64 + 256 + 64) = 2048
    # elements; 3 adapters present, 2 layers, bf16
    step = decode_step.Step(T=6, adapters=3, rank=4)
    assert decode_step.adapter_bytes(TINY, step) == 2 * 2 * 3 * 4096
    assert decode_step.floor_copy_us(TINY, step, 49152 / 1e9) == pytest.approx(1000.0)  # 49152 B at 49.152 GB/s
    assert decode_step.floor_copy_us(TINY, step, None) is None
    # T below the adapters: T of them are present
    assert decode_step.adapter_bytes(TINY, decode_step.Step(T=2, adapters=3, rank=4)) == 2 * 2 * 2 * 4096
    # qwen2-7b's 32/32/16 step (H200, 4.221 TB/s): 2.584 GB of adapters, 612 µs, where the kext route added 469
    qwen = decode_step.MODELS["qwen2-7b"]
    assert decode_step.adapter_bytes(qwen, decode_step.Step(32, 32, 16)) / 1e9 == pytest.approx(2.584, abs=5e-4)
    assert decode_step.floor_copy_us(qwen, decode_step.Step(32, 32, 16), 4.221) == pytest.approx(612.1, abs=0.1)


def _replay_eagerly(monkeypatch, interleaved):
    """decode_step with its CUDA graphs replaced by their calls, replayed eagerly, and time_interleaved by
    `interleaved`."""
    class Eager:
        def __init__(self, calls):
            self.calls = calls

        def replay(self):
            for f in self.calls:
                f()

    monkeypatch.setattr(decode_step, "capture", Eager)
    monkeypatch.setattr(decode_step, "time_interleaved", interleaved)
    monkeypatch.setattr(decode_step, "routes", lambda: {"fold-cpu": ("fold", torch.ops.lora_ops.lora_expand.default)})


@pytest.mark.parametrize("copy_tbps", [49152 / 1e9, None])
def test_decode_step_records_the_copy_floor_against_its_base(monkeypatch, copy_tbps):
    _replay_eagerly(monkeypatch, lambda runs, min_ms: {name: (run(), 4.0)[-1] for name, run in runs.items()})
    records, failures = [], []
    decode_step.bench_step(TINY, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                           copy_tbps=copy_tbps)
    assert not failures and [r["backend"] for r in records] == ["base", "fold-cpu"]
    expected = (1000.0, 25.0) if copy_tbps else (None, None)  # 1000 µs over the base step's 4 ms
    assert all((r["floor_copy_us"], r["floor_copy_pct"]) == expected for r in records)
    assert all(r["between_modules"] is False for r in records)


def test_decode_table_renders_the_copy_floor_beside_the_floor_and_records_from_before_it():
    new = [_step_record("base", 4000.0, 4000.0, floor_copy_us=612.1, floor_copy_pct=15.3),
           _step_record("kext-cuda", 4480.0, 4000.0, floor_copy_us=612.1, floor_copy_pct=15.3)]
    old = [dict(r, T=128) for r in (_step_record("base", 4000.0, 4000.0), _step_record("kext-cuda", 4600.0, 4000.0))]
    table = report._decode_table(new + old)
    assert table[0] == "| model | T | adapters | rank | base step | floor | copy floor | fold floor | " \
                       "serving default | kext-cuda |"
    assert table[1] == "|---|---|---|---|---|---|---|---|---|---|"
    assert table[2] == "| llama3-8b | 32 | 32 | 16 | 4.00 ms | +19.2% | +15.3% | +19.2% | — | **+12%** |"
    assert table[3] == "| llama3-8b | 128 | 32 | 16 | 4.00 ms | +19.2% | — | +19.2% | — | **+15%** |"
    # a file from before the copy floor: the table and its legend as they were, with no copy floor
    assert report._decode_table(old) == [
        "| model | T | adapters | rank | base step | floor | fold floor | serving default | kext-cuda |",
        "|---|---|---|---|---|---|---|---|---|",
        "| llama3-8b | 128 | 32 | 16 | 4.00 ms | +19.2% | +19.2% | — | **+15%** |"]
    assert "copy floor" not in report.readme_section(_run(old))
    text = report.readme_section(_run(new))
    assert "as if read at the base step's bandwidth; *copy floor*, those bytes at the run's copy bandwidth" in text


def test_parts_are_divided_by_a_base_timed_in_their_own_rounds(monkeypatch):
    """--parts: each part is timed in the same rounds as a replay of the base step's graph, and its % is of that
    base, not of the base timed before the parts (here 4 ms; the parts' bases drift from 1.1 ms on)."""
    timed = []

    def interleaved(runs, min_ms):
        for run in runs.values():
            run()
        timed.append(runs)
        if len(timed) == 1:  # the step's base and routes
            return {name: 4.0 if name == "base" else 5.0 for name in runs}
        return {name: 1.0 + len(timed) / 10 if name == "base" else 0.5 for name in runs}

    _replay_eagerly(monkeypatch, interleaved)
    records, failures = [], []
    decode_step.bench_step(TINY, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                           parts=True)
    assert not failures
    parts = [r for r in records if r["op"] == "decode_step_part"]
    assert len(parts) == len(timed) - 1 > 0
    base_step = timed[0]["base"].__self__
    for i, (r, runs) in enumerate(zip(parts, timed[1:])):
        base_ms = 1.0 + (i + 2) / 10
        assert set(runs) == {"base", r["backend"]} and runs["base"].__self__ is base_step
        assert (r["base_us"], r["us"], r["pct_of_base"]) == (round(base_ms * 1e3, 1), 500.0,
                                                             round(100 * 0.5 / base_ms, 2))


def test_a_dirty_commit_stays_dirty_in_the_report():
    assert report.short_sha("a24a444c0ffee") == "a24a444"
    assert report.short_sha("a24a444c0ffee-dirty") == "a24a444-dirty"
    assert "commit `a24a444-dirty`" in report.readme_section(dict(_run([]), git_sha="a24a444c0ffee-dirty"))
