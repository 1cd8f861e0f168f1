"""The serving layer's route tables (lora_ops/route_tables/<gpu>.json, written by the decode-step bench): each
covers every regime with a route that exists, the GPU's own is taken, and every route on each of its backends
gives PEFT's outputs."""
import copy
import glob
import json
import os
import pathlib
import re

import pytest
import torch

from lora_ops import backends, op_table, routes

import serving_models
from conftest import cuda_kernel_names
from test_serving import _model_and_adapters, _peft_model, _pool_model, adapters  # noqa: F401  (adapters: a fixture)


@pytest.fixture(scope="module")
def biased_adapters(tmp_path_factory):
    """adapters' model with a bias in every linear layer, and its adapters."""
    base, root = _model_and_adapters(tmp_path_factory, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for module in base.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.1)  # transformers initialises them to zero
    return base, root


PACKAGED = sorted(glob.glob(os.path.join(routes.TABLES_DIR, "*.json")))


def test_the_reference_gpu_has_a_table():
    assert routes.PATH in PACKAGED


@pytest.mark.parametrize("path", PACKAGED, ids=os.path.basename)
def test_every_packaged_table_is_named_by_its_gpu(path):
    """A route table is named by the model's word of the GPU it was measured on (the op tables' rule), which every
    GPU of that model takes."""
    assert os.path.basename(path) == f"{op_table.gpu_word(routes.load(path)['gpu'])}.json"


@pytest.mark.parametrize("name, table", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                         ("NVIDIA A100-SXM4-80GB", "h200"), (None, "h200")])
def test_the_serving_layer_takes_its_gpus_table(name, table, tmp_path, monkeypatch):
    """The table the serving layer installs (at its first use) is that of the GPU the process sees first, by its
    model's word, else the reference GPU's (no GPU, or a model without a table)."""
    for word in ("h200", "h100"):  # a directory of tables whose gpu fields say which file was read
        (tmp_path / f"{word}.json").write_text(json.dumps({"gpu": word}))
    monkeypatch.setattr(routes, "TABLES_DIR", str(tmp_path))
    monkeypatch.setattr(op_table, "visible_gpu_name", lambda: name)
    monkeypatch.setattr(routes, "_tables", None)  # restored after the test, with _modules
    monkeypatch.setattr(routes, "_modules", None)
    installed = []
    monkeypatch.setattr(routes, "install", installed.append)
    routes._load()
    assert [t["gpu"] for t in installed] == [table]


def test_kext_max_tokens_is_the_kernels_bound():
    """routes.KEXT_MAX_TOKENS restates lora_linear's kLoraLinearMaxTokens (csrc/cuda/kernels.h): the bench times the
    kext route, and a table may give it, exactly as far as the kernels serve."""
    header = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "kernels.h"
    bound = re.search(r"constexpr int64_t kLoraLinearMaxTokens = (\d+);", header.read_text())
    assert bound and int(bound.group(1)) == routes.KEXT_MAX_TOKENS


@pytest.mark.parametrize("path", PACKAGED, ids=os.path.basename)
def test_committed_table_is_the_sweeps_output_of_its_results_file(path):
    """No hand-written entry: each table is exactly what the bench's table builder makes of the sweep's records it
    names (benchmarks/results/<source>)."""
    from lora_ops.bench import decode_step, report
    table = routes.load(path)
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / table["source"]
    result = json.loads(path.read_text())
    models = [m["model"] for m in routes.model_tables(table)]
    assert decode_step.routes_table(result["records"], report.table_meta(result, table["source"]), models) == table


@pytest.mark.parametrize("path", PACKAGED, ids=os.path.basename)
def test_committed_table_covers_every_regime(path, monkeypatch):
    table = routes.load(path)
    monkeypatch.setattr(routes, "_tables", None)  # restored after the test, with _modules
    monkeypatch.setattr(routes, "_modules", None)
    routes.install(table)  # what pick reads
    routes.validate(table)
    models = routes.model_tables(table)
    assert [m["model"] for m in models] == ["llama3-8b", "qwen2-7b", "llama3-70b-tp8"]  # the bench's three shapes
    for key in ("gpu", "git_sha", "date"):
        assert table.get(key), f"the table does not say which measurement it came from ({key})"
    for index, model in enumerate(models):
        bounds = set()
        for c in routes.rank_classes(model):
            mine = [r["max_tokens"] for r in c["regimes"]]  # the sweep's bounds, and its splits (split_points)
            assert set(routes.REGIME_BOUNDS) <= set(mine) and mine[-1] is None
            assert [r["measured_T"] for r in c["regimes"]] == mine[:-1] + [routes.REGIME_SAMPLES[-1]]
            bounds |= set(mine[:-1])
        for tokens in (1, *[t for b in sorted(bounds) for t in (b, b + 1)], 1 << 20):
            for max_rank in (1, 16, 32, 33, 64, 256):
                assert routes.pick(tokens, "cuda", max_rank, True, index) in routes.PAIRS
                assert routes.pick(tokens, "cuda", max_rank, False, index)[0] != "kext"


def _stand_in_tables(monkeypatch, *tables, modules=None):
    """routes' loaded tables replaced by these (each a list of rank classes), with their modules' (K, N)."""
    monkeypatch.setattr(routes, "_tables", [routes._with_fallbacks(t) for t in tables])
    monkeypatch.setattr(routes, "_modules", modules or [[(64, 64)]] * len(tables))


def test_pick_takes_the_fastest_other_route_where_the_kext_kernels_do_not_serve(monkeypatch):
    """A module whose shapes, dtype or GPU lora_linear's kernels do not serve (its composition of torch ops would
    run) takes the other route the table timed at that regime's two ends that is least slow over its mixes."""
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    us = {"base": 100.0, "kext-cuda": 110.0, "fold-cuda": 130.0, "fold-triton": 125.0, "sgmv-cuda": 150.0,
          "sgmv-triton": 160.0}
    regimes = [{"max_tokens": 64, "route": "kext", "backend": "cuda", "us": [us]},
               {"max_tokens": None, "route": "sgmv", "backend": "cuda"}]
    _stand_in_tables(monkeypatch, [{"max_rank": None, "regimes": regimes}])
    assert routes.pick(64, "cuda", 16) == ("kext", "cuda")
    assert routes.pick(64, "cuda", 16, kext_serves=False) == ("fold", "triton")
    assert routes.pick(65, "cuda", 16, kext_serves=False) == ("sgmv", "cuda")
    # a second mix in which fold-triton is 20% slower than fold-cuda: fold-cuda's worst (4%) is the smaller
    regimes[0]["us"].append(dict(us, **{"fold-cuda": 100.0, "fold-triton": 120.0}))
    _stand_in_tables(monkeypatch, [{"max_rank": None, "regimes": regimes}])
    assert routes.pick(64, "cuda", 16, kext_serves=False) == ("fold", "cuda")
    regimes[0]["us"].reverse()  # whichever mix is last
    _stand_in_tables(monkeypatch, [{"max_rank": None, "regimes": regimes}])
    assert routes.pick(64, "cuda", 16, kext_serves=False) == ("fold", "cuda")
    # the regime below's times count too (its sample is this regime's bottom end, as the bench's choice reads it):
    # fold-triton's 40% behind fold-cuda there outweighs its 4% lead at the top
    below = {"max_tokens": 16, "route": "fold", "backend": "cuda",
             "us": [dict(us, **{"fold-cuda": 100.0, "fold-triton": 140.0})]}
    top = {"max_tokens": 64, "route": "kext", "backend": "cuda",
           "us": [dict(us, **{"fold-cuda": 130.0, "fold-triton": 125.0})]}
    _stand_in_tables(monkeypatch, [{"max_rank": None, "regimes": [below, top, regimes[-1]]}])
    assert routes.pick(64, "cuda", 16, kext_serves=False) == ("fold", "cuda")
    monkeypatch.setenv("LORA_OPS_ROUTE", "kext-cuda")  # forced: taken whatever the kernels serve
    assert routes.pick(64, "cuda", 16, kext_serves=False) == ("kext", "cuda")


def test_a_pool_takes_the_table_of_the_nearest_measured_modules(monkeypatch):
    """table_for: the committed table measured on the model whose modules are nearest (octaves of K and N) a pool's,
    the bench's fused modules or a model's own unfused ones, the first listed on a tie."""
    monkeypatch.setattr(routes, "_tables", None)
    names = [m["model"] for m in routes.model_tables(routes.load())]
    unfused = {  # q, k, v, o, gate, up, down: (K, N)
        "llama3-8b": [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336),
                      (14336, 4096)],
        "qwen2-7b": [(3584, 3584), (3584, 512), (3584, 512), (3584, 3584), (3584, 18944), (3584, 18944),
                     (18944, 3584)],
        "llama3-70b-tp8": [(8192, 1024), (8192, 128), (8192, 128), (1024, 8192), (8192, 3584), (8192, 3584),
                           (3584, 8192)]}
    from lora_ops.bench.decode_step import MODELS
    for name, modules in unfused.items():
        assert names[routes.table_for(modules)] == name
        assert names[routes.table_for([(K, sum(w)) for _, K, w in MODELS[name].modules()])] == name
    assert routes.table_for([]) == 0
    _stand_in_tables(monkeypatch, [], [], modules=[[(64, 64)], [(64, 64)]])  # equally near: the first
    assert routes.table_for([(128, 64)]) == 0
    _stand_in_tables(monkeypatch, [], [], modules=[[(4096, 4096)], [(64, 64)]])
    assert routes.table_for([(128, 64)]) == 1


def test_a_pools_table_index_follows_the_installed_table(monkeypatch):
    """NearestTable (what a pool asks pick with) finds its index again once another table is installed: one kept
    from the first table would name another model's table (or none) in the second."""
    monkeypatch.setattr(routes, "_tables", None)  # restored after the test, with _modules
    monkeypatch.setattr(routes, "_modules", None)
    regimes = [{"max_tokens": None, "route": "sgmv", "backend": "cuda"}]
    model = lambda name, kn: {"model": name, "modules": [list(kn)], "ranks": [{"max_rank": None, "regimes": regimes}]}
    nearest = routes.NearestTable([(64, 64)])
    routes.install({"models": [model("big", (4096, 4096)), model("small", (64, 64))]})
    assert nearest.index() == 1
    routes.install({"models": [model("small", (64, 64)), model("big", (4096, 4096))]})
    assert nearest.index() == 0
    routes.install({"models": [model("big", (4096, 4096))]})
    assert nearest.index() == 0


def test_no_module_of_a_cpu_pool_is_served_by_the_kext_kernels(adapters):  # noqa: F811
    """_lora_linear_kernels_serve is false off CUDA (on a GPU, true only where the sm_90 kernels run: not for this
    model's 64 features, below the GEMM's 64 x pipeline stages), and a pool there keeps no copy of B."""
    base, root = adapters
    _, pool = _pool_model(base, root, ["a"])
    assert pool.modules and not any(m.kext_serves or m.b_cols is not None for m in pool.modules.values())
    w, b_cols = torch.zeros(128, 1536, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    lora_a = torch.zeros(4, 16, 1536, dtype=torch.bfloat16)  # shapes the kernels serve on sm_90, here on the CPU
    assert not torch.ops.lora_ops._lora_linear_kernels_serve(w, lora_a, b_cols.view(128, 4, 16).permute(1, 0, 2),
                                                             None)


@pytest.mark.parametrize("regimes,msg", [
    ([], "no regimes"),
    ([{"max_tokens": 16, "route": "fold", "backend": "cuda"}], "only the last regime may be open-ended"),
    ([{"max_tokens": None, "route": "fold", "backend": "cuda"}, {"max_tokens": None, "route": "sgmv", "backend": "cuda"}],
     "only the last regime may be open-ended"),
    ([{"max_tokens": 64, "route": "fold", "backend": "cuda"}, {"max_tokens": 16, "route": "fold", "backend": "cuda"},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "bounds must increase"),
    ([{"max_tokens": 0, "route": "fold", "backend": "cuda"}, {"max_tokens": None, "route": "sgmv", "backend": "cuda"}],
     "bounds must increase from 1"),
    ([{"max_tokens": None, "route": "bgmv", "backend": "cuda"}], "unknown route/backend"),
    ([{"max_tokens": None, "route": "fold", "backend": "rocm"}], "unknown route/backend"),
    ([{"max_tokens": None, "route": "kext", "backend": "triton"}], "unknown route/backend"),  # one op, no Triton
    ([{"max_tokens": 256, "route": "kext", "backend": "cuda"},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "the kext route serves up to 128 tokens"),
    ([{"max_tokens": 64, "route": "kext", "backend": "cuda", "us": [{"kext-cuda": 1.0, "fold-cuda": 2.0},
                                                                    {"kext-cuda": 1.0}]},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "a kext regime needs the times of another route"),
    ({"models": []}, "no model tables"),
    ([{"max_tokens": None, "route": "fold", "backend": "cuda", "us": {"fold-cuda": 1.0}}], "a list of each mix"),
    ({"models": [{"model": "a", "modules": [[64, 64]], "regimes": [{"max_tokens": None, "route": "fold",
                                                                    "backend": "cuda"}]},
                 {"model": "b", "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]}]},
     "model 'b' needs its modules"),
    ({"models": [{"model": "a", "modules": [[64, 0]], "regimes": [{"max_tokens": None, "route": "fold",
                                                                   "backend": "cuda"}]},
                 {"model": "b", "modules": [[64, 64]], "regimes": []}]}, "model 'a' needs its modules"),
    ({"models": [{"model": "a", "modules": [[64, 64]], "regimes": [{"max_tokens": None, "route": "fold",
                                                                    "backend": "cuda"}]},
                 {"model": "b", "modules": [[64, 64]], "regimes": []}]}, "no regimes"),
    ({"ranks": []}, "no rank classes"),
    ({"ranks": [{"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]}]},
     "only the last rank class may be open-ended"),
    ({"ranks": [{"max_rank": 64, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": None, "regimes": [{"max_tokens": None, "route": "sgmv", "backend": "cuda"}]}]},
     "rank class bounds must increase"),
    ({"ranks": [{"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": None, "regimes": []}]}, "no regimes"),
    # NaN passes every comparison as False, so it slipped through both bound checks and matched no T
    ([{"max_tokens": float("nan"), "route": "fold", "backend": "cuda"},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "regime bounds must be integers"),
    ([{"max_tokens": 64.5, "route": "fold", "backend": "cuda"},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "regime bounds must be integers"),
    ({"ranks": [{"max_rank": float("nan"), "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": None, "regimes": [{"max_tokens": None, "route": "sgmv", "backend": "cuda"}]}]},
     "rank class bounds must be integers"),
    # a NaN time made every slowdown NaN and the first route win the kext fallback
    ([{"max_tokens": 4, "route": "kext", "backend": "cuda",
       "us": [{"kext-cuda": 1.0, "sgmv-cuda": float("nan"), "fold-cuda": 2.0}]},
      {"max_tokens": None, "route": "sgmv", "backend": "cuda"}], "times must be positive finite"),
    ([{"max_tokens": None, "route": "fold", "backend": "cuda", "us": [{"fold-cuda": 0.0}]}],
     "times must be positive finite"),
])
def test_validate_rejects_a_table_with_gaps_or_unknown_names(regimes, msg):
    with pytest.raises(ValueError, match=msg):
        routes.validate(regimes if isinstance(regimes, dict) else {"regimes": regimes})


def test_describe_gives_each_route_its_token_ranges():
    regimes = [{"max_tokens": 4, "route": "kext", "backend": "cuda"}, {"max_tokens": 16, "route": "kext",
                                                                       "backend": "cuda"},
               {"max_tokens": 64, "route": "fold", "backend": "cuda"}, {"max_tokens": None, "route": "kext",
                                                                         "backend": "cuda"}]
    table = {"models": [{"model": "m", "ranks": [{"max_rank": 32, "regimes": regimes},
                                                 {"max_rank": None, "regimes": regimes[-1:]}]}]}
    assert routes.describe(table) == ["m, R <= 32: kext-cuda 1-16, fold-cuda 17-64, kext-cuda 65+ tokens",
                                      "m, larger R: kext-cuda 1+ tokens"]
    assert routes.describe({"regimes": regimes[2:]}) == ["any model, larger R: fold-cuda 1-64, kext-cuda 65+ tokens"]


def test_a_triton_regime_without_triton_runs_its_route_as_backend_cuda(monkeypatch):
    """The public op serves a "triton" regime when Triton is not installed (op()); the route must then hand it its
    own form (the fold route's rows form), not the segments Triton's kernel takes: no table measured that mix."""
    from lora_ops import backends
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    _stand_in_tables(monkeypatch, [{"max_rank": None, "regimes": [
        {"max_tokens": None, "route": "fold", "backend": "triton"}]}])
    assert routes.pick(80, "cuda") == ("fold", "triton") or "triton" in backends.unavailable
    monkeypatch.setitem(backends.unavailable, "triton", "not installed (pip install triton)")
    assert routes.pick(80, "cuda") == ("fold", "cuda")
    assert routes.fold_expand_rows(routes.pick(80, "cuda")[1], "slots", ("indptr", "lora", "idx")) == \
        (None, "slots", "idx")


def test_pick_follows_the_bounds(monkeypatch):
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    low = [{"max_tokens": 16, "route": "fold", "backend": "triton"},
           {"max_tokens": None, "route": "sgmv", "backend": "cuda"}]
    high = [{"max_tokens": 64, "route": "fold", "backend": "cuda"}, {"max_tokens": None, "route": "sgmv", "backend": "triton"}]
    _stand_in_tables(monkeypatch, [{"max_rank": 32, "regimes": low}, {"max_rank": None, "regimes": high}])
    assert routes.pick(16, "cuda") == ("fold", "triton")  # max rank 16 by default
    assert routes.pick(17, "cuda") == ("sgmv", "cuda")
    assert routes.pick(16, "cuda", 32) == ("fold", "triton")
    assert routes.pick(16, "cuda", 33) == ("fold", "cuda")
    assert routes.pick(65, "cuda", 64) == ("sgmv", "triton")
    assert routes.pick(3, "cpu") == ("sgmv", "cuda")  # off CUDA: the public op
    monkeypatch.setenv("LORA_OPS_ROUTE", "fold-triton")
    assert routes.pick(1 << 20, "cuda") == ("fold", "triton")
    assert routes.pick(3, "cpu") == ("fold", "cuda")
    monkeypatch.setenv("LORA_OPS_ROUTE", "kext-cuda")
    assert routes.pick(3, "cuda") == routes.pick(3, "cpu") == ("kext", "cuda")  # off CUDA: the op's composition
    for forced in ("fold", "kext-triton"):
        monkeypatch.setenv("LORA_OPS_ROUTE", forced)
        for device_type in ("cuda", "cpu"):
            with pytest.raises(ValueError, match=f"LORA_OPS_ROUTE='{forced}': expected <route>-<backend>, one of "
                                                 "sgmv-cuda, sgmv-triton, fold-cuda, fold-triton, kext-cuda$"):
                routes.pick(3, device_type)


def test_patching_reads_the_table_before_any_compiled_forward(adapters, monkeypatch):  # noqa: F811
    """torch.compile cannot trace the table's file read (the H200 run at e2cd407 failed a compiled model's first
    CUDA forward on it): wrapping the layers reads it, and a compiled route choice then traces (the kext regimes'
    fallback too: worked out at load, since torch 2.11's dynamo refused pick's min(..., key=...), H200, 3169682)."""
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    monkeypatch.setattr(routes, "_tables", None)
    base, root = adapters
    _pool_model(base, root, [])
    assert routes._tables is not None
    torch._dynamo.reset()
    for serves in (True, False):  # without: the kext regimes' fallback
        for table in range(len(routes._tables)):
            picked = torch.compile(
                lambda x: x * (2 if routes.pick(x.shape[0], "cuda", 16, serves, table)[0] == "fold" else 3),
                fullgraph=True, backend="eager")(torch.ones(4))
            assert picked[0].item() == (2.0 if routes.pick(4, "cuda", 16, serves, table)[0] == "fold" else 3.0)


def test_the_layers_route_by_their_pools_table(adapters, monkeypatch):  # noqa: F811
    """Every layer asks routes.pick with its pool's table (the one nearest the pool's modules, chosen once per
    installed table)."""
    base, root = adapters
    _, pool = _pool_model(base, root, [])
    kn = [(m.in_features, m.out_features) for m in pool.modules.values()]
    assert any(k != n for k, n in kn)
    # two tables, measured on these modules and on their (N, K): the pool takes the former (K: in_features)
    routes._load()
    monkeypatch.setattr(routes, "_modules", [[(n, k) for k, n in kn], kn])
    monkeypatch.setattr(routes, "_tables", routes._tables[:1] * 2)
    model, pool = _pool_model(base, root, ["a"])
    assert pool.route_table.index() == 1
    monkeypatch.setattr(pool.route_table, "index", lambda: 7)  # any index: what the layers pass on
    asked = []
    real_pick = routes.pick
    monkeypatch.setattr(routes, "pick", lambda *a: asked.append(a[4]) or real_pick(*a[:4]))
    with torch.no_grad(), pool.batch(["a"], tokens_per_row=3):
        model(torch.randint(0, 256, (1, 3)))
    assert len(asked) == len(pool.modules) and set(asked) == {7}


ROUTE_PARAMS = ["sgmv-cuda", "fold-cuda", "kext-cuda"] + [pytest.param(r, marks=pytest.mark.gpu)
                                                           for r in ("sgmv-triton", "fold-triton")]


@pytest.mark.parametrize("models", ["adapters", "biased_adapters"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("route", ROUTE_PARAMS)
def test_every_route_matches_peft(models, device, route, monkeypatch, request):
    """Prefill and decode of a mixed batch through each forced route, against PEFT's own mixed-adapter forward, on
    base layers without and with a bias (the sgmv route's is the base layer's, the fold route's in bias_cat, the kext
    route's passed to lora_linear); every route leaves the model exactly the base without a batch, and reads the
    pool's weights: the base weight and A as views of [W; A], B contiguous, and where lora_linear's CUDA kernels
    serve the module B's copy as columns [N, L·R] (each row's slots side by side, the layout of the kext route's
    GEMM [W | B]; these models' 64 features are below the kernels' sizes: no copy)."""
    if device == "cpu" and route.endswith("triton"):
        pytest.skip("Triton routes run on CUDA tensors")
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    base, root = request.getfixturevalue(models)
    names = ["a", "b", "c"]
    ref_model = _peft_model(base, root, names).to(device)
    model, pool = _pool_model(base, root, names, device=device)
    rows = ["a", None, "b", "c", "b"]
    ids = torch.randint(0, 256, (len(rows), 6), device=device)
    with torch.no_grad():
        with pool.batch(rows, tokens_per_row=ids.shape[1]):
            got = model(ids).logits
        want = ref_model(ids, adapter_names=[r or "__base__" for r in rows]).logits
        plain = model(ids).logits
        base_logits = copy.deepcopy(base).to(device)(ids).logits
    tol = 1e-5 if route.startswith("sgmv") else 2e-5  # fold, kext: h rounds to the activation dtype (fp32 here)
    assert ((got - want).norm() / want.norm()).item() < tol
    torch.testing.assert_close(plain, base_logits, rtol=1e-5, atol=1e-5)
    m = next(iter(pool.modules.values()))
    assert m.lora_a.data_ptr() == m.w_cat[m.out_features:].data_ptr()  # A lives inside [W; A]: not copied
    L, N, R = m.lora_b.shape
    assert m.lora_b.is_contiguous()
    if m.kext_serves:  # lora_linear's CUDA kernels read B's copy, as columns of W's rows
        assert m.kext_lora_b.data_ptr() == m.b_cols.data_ptr() and m.kext_lora_b.stride() == (R, L * R, 1)
        assert torch.equal(m.kext_lora_b, m.lora_b)  # kept equal
    else:  # elsewhere lora_linear's composition reads lora_b itself: no copy
        assert m.kext_lora_b is m.lora_b and m.b_cols is None


ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["llama", "fused-twin"])
def test_kext_route_runs_its_kernels_in_a_model(tmp_path, fused, monkeypatch):
    """At lora_linear's kernels' sizes (K of 1536 and 2048, every width a multiple of 64; the other serving tests'
    64-feature models run its composition), the kext route runs its CUDA kernels in every patched layer, on B's copy
    as columns of W's rows, with fused slices too, and gives PEFT's outputs to bf16's rounding, as the sgmv route
    does."""
    if not backends.sm90_kernels_run():
        pytest.skip("lora_linear's CUDA kernels are sm_90a: not built, or not this GPU")
    base = serving_models.llama(hidden_size=1536, intermediate_size=2048, num_attention_heads=12,
                                num_key_value_heads=4, num_hidden_layers=1)
    adapters = {name: serving_models.save_adapter(base, tmp_path / name, r=rank, lora_alpha=2 * rank,
                                                  target_modules=ALL_MODULES) for name, rank in (("a", 16), ("b", 8))}
    model = serving_models.fused_twin(base) if fused else base
    rows = ["a", None, "b", "a"]
    ids = torch.randint(0, serving_models.VOCAB, (len(rows), 6), device="cuda")  # 24 tokens
    want = serving_models.peft_logits(serving_models.peft_model(base, adapters).cuda(), ids, rows)
    with torch.no_grad():
        plain = copy.deepcopy(base).cuda()(ids).logits
    model, got = model.to(torch.bfloat16), {}
    for route in ("kext-cuda", "sgmv-cuda"):
        monkeypatch.setenv("LORA_OPS_ROUTE", route)
        lora_model, pool = serving_models.pool_model(model, adapters, device="cuda")
        got[route], ran = cuda_kernel_names(lambda: serving_models.pool_logits(lora_model, pool, ids, rows))
        if route == "kext-cuda":
            assert all(m.kext_serves for m in pool.modules.values())
            assert any("kext_shrink_kernel" in k for k in ran) and any("KextMainloop" in k for k in ran), ran
            for m in pool.modules.values():
                L, N, R = m.lora_b.shape
                assert m.kext_lora_b.data_ptr() == m.b_cols.data_ptr() and m.kext_lora_b.stride() == (R, L * R, 1)
                assert torch.equal(m.kext_lora_b, m.lora_b)
            pool.unload("a")  # the copy follows an unload too (every load: the logits above)
            assert all(torch.equal(m.kext_lora_b, m.lora_b) for m in pool.modules.values())
    err = {route: serving_models.rel_err(logits, want) for route, logits in got.items()}
    assert err["kext-cuda"] < 1.5 * err["sgmv-cuda"] + 2e-3, err
    assert serving_models.rel_err(plain, want) > 10 * err["kext-cuda"], "the adapters must change the output"
