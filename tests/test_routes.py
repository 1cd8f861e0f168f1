"""The serving layer's route table (lora_ops/routes.json, written by the decode-step bench): it covers every
regime, and both routes on every backend give PEFT's outputs."""
import copy

import pytest
import torch

from lora_ops import routes

from test_serving import _peft_model, _pool_model, adapters  # noqa: F401  (adapters: a module fixture)


def test_committed_table_covers_every_regime():
    table = routes.load()
    routes.validate(table)
    for c in routes.rank_classes(table):
        assert [r["max_tokens"] for r in c["regimes"]] == list(routes.REGIME_BOUNDS)
    for key in ("gpu", "git_sha", "date"):
        assert table.get(key), f"the table does not say which measurement it came from ({key})"
    for tokens in (1, *[t for b in routes.REGIME_BOUNDS[:-1] for t in (b, b + 1)], 1 << 20):
        for max_rank in (1, 16, 32, 33, 64, 256):
            assert routes.pick(tokens, "cuda", max_rank) in {(r, b) for r in routes.ROUTES for b in routes.BACKENDS}


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
    ({"ranks": []}, "no rank classes"),
    ({"ranks": [{"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]}]},
     "only the last rank class may be open-ended"),
    ({"ranks": [{"max_rank": 64, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": None, "regimes": [{"max_tokens": None, "route": "sgmv", "backend": "cuda"}]}]},
     "rank class bounds must increase"),
    ({"ranks": [{"max_rank": 32, "regimes": [{"max_tokens": None, "route": "fold", "backend": "cuda"}]},
                {"max_rank": None, "regimes": []}]}, "no regimes"),
])
def test_validate_rejects_a_table_with_gaps_or_unknown_names(regimes, msg):
    with pytest.raises(ValueError, match=msg):
        routes.validate(regimes if isinstance(regimes, dict) else {"regimes": regimes})


def test_pick_follows_the_bounds(monkeypatch):
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    low = [{"max_tokens": 16, "route": "fold", "backend": "triton"},
           {"max_tokens": None, "route": "sgmv", "backend": "cuda"}]
    high = [{"max_tokens": 64, "route": "fold", "backend": "cuda"}, {"max_tokens": None, "route": "sgmv", "backend": "triton"}]
    monkeypatch.setattr(routes, "_table", [{"max_rank": 32, "regimes": low}, {"max_rank": None, "regimes": high}])
    assert routes.pick(16, "cuda") == ("fold", "triton")  # max rank 16 by default
    assert routes.pick(17, "cuda") == ("sgmv", "cuda")
    assert routes.pick(16, "cuda", 32) == ("fold", "triton")
    assert routes.pick(16, "cuda", 33) == ("fold", "cuda")
    assert routes.pick(65, "cuda", 64) == ("sgmv", "triton")
    assert routes.pick(3, "cpu") == ("sgmv", "cuda")  # off CUDA: the public op
    monkeypatch.setenv("LORA_OPS_ROUTE", "fold-triton")
    assert routes.pick(1 << 20, "cuda") == ("fold", "triton")
    assert routes.pick(3, "cpu") == ("fold", "cuda")
    monkeypatch.setenv("LORA_OPS_ROUTE", "fold")
    with pytest.raises(ValueError, match="LORA_OPS_ROUTE='fold': expected <route>-<backend>"):
        routes.pick(3, "cuda")


def test_patching_reads_the_table_before_any_compiled_forward(adapters, monkeypatch):  # noqa: F811
    """torch.compile cannot trace the table's file read (the H200 run at e2cd407 failed a compiled model's first
    CUDA forward on it): wrapping the layers reads it, and a compiled route choice then traces."""
    monkeypatch.delenv("LORA_OPS_ROUTE", raising=False)
    monkeypatch.setattr(routes, "_table", None)
    base, root = adapters
    _pool_model(base, root, [])
    assert routes._table is not None
    torch._dynamo.reset()
    picked = torch.compile(lambda x: x * (2 if routes.pick(x.shape[0], "cuda")[0] == "fold" else 3),
                           fullgraph=True, backend="eager")(torch.ones(4))
    assert picked[0].item() in (2.0, 3.0)


ROUTE_PARAMS = ["sgmv-cuda", "fold-cuda"] + [pytest.param(r, marks=pytest.mark.gpu)
                                              for r in ("sgmv-triton", "fold-triton")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("route", ROUTE_PARAMS)
def test_every_route_matches_peft(adapters, device, route, monkeypatch):  # noqa: F811
    """Prefill and decode of a mixed batch through each forced route, against PEFT's own mixed-adapter forward;
    the fold route keeps the base weight a view of [W; A] and leaves the model exactly the base without a batch."""
    if device == "cpu" and route.endswith("triton"):
        pytest.skip("Triton routes run on CUDA tensors")
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    base, root = adapters
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
    tol = 1e-5 if route.startswith("sgmv") else 2e-5  # fold: h rounds to the activation dtype (fp32 here)
    assert ((got - want).norm() / want.norm()).item() < tol
    torch.testing.assert_close(plain, base_logits, rtol=1e-5, atol=1e-5)
    m = next(iter(pool.modules.values()))
    assert m.lora_a.data_ptr() == m.w_cat[m.out_features:].data_ptr()  # A lives inside [W; A]: not copied
