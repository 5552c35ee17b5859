"""``GET /v1/models``, ``GET /v1/models/{model}`` and ``slotserve_model_loaded`` over broker statuses
the tests give (the gateway's own link and handlers, no broker, no socket). A model whose first
worker is loading (``slotserve up`` starting, not a model on demand) was left out of ``/v1/models``
while the 404 for an unknown name listed it as loading; and the gauge kept the last value of a model
that was no longer listed."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.app import ServiceEndpoints  # noqa: E402
from gateway.drain import Drain  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from tests.support.gateway import GivenStatusLink  # noqa: E402
from tests.support.gateway import model_status as model  # noqa: E402


@pytest.fixture
def served():
    """``start(on_demand, aliases, drain) -> (link, http)``: ``/v1/models``, ``/v1/models/{model}`` and
    ``/metrics`` over a link whose status the test gives."""

    def start(on_demand: tuple[str, ...] = (), aliases: tuple[tuple[str, str], ...] = (), drain: Drain | None = None):
        link = GivenStatusLink(on_demand, aliases)
        service = ServiceEndpoints(link, GatewayMetrics(), drain or Drain())
        app = Starlette(routes=[Route("/v1/models", service.models, methods=["GET"]),
                                Route("/v1/models/{model:path}", service.model, methods=["GET"]),
                                Route("/metrics", service.metrics_endpoint, methods=["GET"])])
        return link, TestClient(app)

    return start


def listed(http) -> dict[str, str | None]:
    """``/v1/models`` as ``{id: status value, or None without one}``."""
    return {m["id"]: m.get("status", {}).get("value") for m in http.get("/v1/models").json()["data"]}


def gauge(http) -> dict[str, float]:
    return {m: float(v) for m, v in re.findall(r'^slotserve_model_loaded\{model="([^"]+)"\} (\S+)$',
                                                http.get("/metrics").text, re.M)}


def test_a_model_whose_first_worker_loads_is_listed_as_loading_then_as_any_served_model(served):
    link, http = served()
    link.show({"m": model(1), "boot": model(loading=1)}, {"boot-chat": "boot"})
    with http:
        assert listed(http) == {"m": None, "boot": "loading", "boot-chat": "loading"}
        # the 404 of a name no model has lists the same names, in the same states
        assert "(models: boot (loading), boot-chat (loading), m)" in link.model_not_found("nope", link.status).message
        link.show({"m": model(1), "boot": model(1)}, {"boot-chat": "boot"})  # registered
        assert listed(http) == {"m": None, "boot": None, "boot-chat": None}
        assert gauge(http) == {}  # (the gauge is for gateways with models on demand)


def test_with_models_on_demand_every_state_is_listed_and_the_gauge_follows_the_list(served):
    link, http = served(("lazy", "big"))
    link.show({"m": model(1), "lazy": model(), "big": model(loading=1), "boot": model(loading=1)})
    with http:
        assert listed(http) == {"m": "loaded", "lazy": "unloaded", "big": "loading", "boot": "loading"}
        assert gauge(http) == {"m": 1.0, "lazy": 0.0, "big": 0.0, "boot": 0.0}
        # boot's worker failed to load it, m's worker left: neither is listed, nor keeps a series
        # (m's stayed at 1 before, a loaded model that no worker served)
        link.show({"m": model(0), "lazy": model(), "big": model(1), "boot": model()})
        assert listed(http) == {"lazy": "unloaded", "big": "loaded"}
        assert gauge(http) == {"lazy": 0.0, "big": 1.0}


def test_a_model_on_demand_says_the_brokers_state_and_a_failed_load_says_so_as_llama_cpps_router(served):
    """With models on demand, each says the state the broker gives it (``status``'s ``on_demand``),
    not what its workers alone say: ``loading`` from the order (no worker yet), ``unloading`` from the
    unload (its worker still serves), an unloaded model whose last load failed ``"failed": true`` with
    the worker's ``exit_code`` (llama.cpp's router's) and the ``reason``; every name of a model alike,
    the 404's list too, and the gauges."""
    from protocol.enums import ModelState
    from protocol.messages import DemandState

    link, http = served(("lazy", "lazy-alias", "busy", "broken", "big"), (("lazy-alias", "lazy"),))
    link.show({"lazy": model(), "lazy-alias": model(), "busy": model(1), "broken": model(), "big": model()},
              on_demand={"lazy": DemandState(ModelState.LOADING), "busy": DemandState(ModelState.UNLOADING),
                         "broken": DemandState(ModelState.UNLOADED, True, 1, "not a GGUF file"),
                         "big": DemandState(ModelState.UNLOADED, True, None, "it needs about 9,000 MiB")})
    with http:
        assert listed(http) == {"big": "unloaded", "broken": "unloaded", "busy": "unloading", "lazy": "loading",
                                "lazy-alias": "loading"}
        entries = {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}
        assert entries["broken"] == {"value": "unloaded", "failed": True, "exit_code": 1, "reason": "not a GGUF file"}
        assert entries["big"] == {"value": "unloaded", "failed": True, "reason": "it needs about 9,000 MiB"}
        assert entries["lazy"] == {"value": "loading"}
        assert "busy (unloading)" in link.model_not_found("nope", link.status).message
        assert gauge(http) == {"big": 0.0, "broken": 0.0, "busy": 0.0, "lazy": 0.0, "lazy-alias": 0.0}
        text = http.get("/metrics").text
        assert 'slotserve_model_state{model="busy",state="unloading"} 1.0' in text
        assert 'slotserve_model_state{model="busy",state="loaded"} 0.0' in text
        assert 'slotserve_model_state{model="lazy",state="loading"} 1.0' in text


def test_each_model_is_listed_by_its_primary_name_first_then_its_aliases_as_given(served):
    """A GGUF file served by its stem with its path as an alias listed the path first (sorted:
    '/models/m.gguf' before 'm'), and ``--served-model-name b --served-model-name B/x`` listed the
    alias first, so a client that takes ``data[0]`` (vLLM's examples) asked by the path or the alias.
    Now models by their primary names, each primary first and then its aliases in the given order."""
    link, http = served()
    link.show({"m": model(1), "b": model(1)}, {"/models/m.gguf": "m", "zz": "b", "B/x": "b"})
    with http:
        assert list(listed(http)) == ["b", "zz", "B/x", "m", "/models/m.gguf"]


ON_DEMAND = ("m", "/models/m.gguf", "b", "zz", "B/x")
GROUPS = (("/models/m.gguf", "m"), ("zz", "b"), ("B/x", "b"))  # (as slotserve up gives them: served names)


def test_an_unloaded_model_on_demand_is_listed_by_its_primary_name_first_too(served):
    """Its aliases are the broker's only once its worker registers them: unloaded, its path sorted
    before its stem ('/models/m.gguf', 'B/x', 'b', 'm', 'zz'). The gateway now knows each model on
    demand's names from ``on_demand_aliases``; loading, an alias says its model's state."""
    link, http = served(ON_DEMAND, GROUPS)
    link.show({n: model() for n in ON_DEMAND})  # (requests for each name wait under it)
    with http:
        assert list(listed(http)) == ["b", "zz", "B/x", "m", "/models/m.gguf"]
        assert set(listed(http).values()) == {"unloaded"}
        link.show({**{n: model() for n in ON_DEMAND}, "m": model(loading=1)})
        assert listed(http)["/models/m.gguf"] == "loading"  # (its model's state, before its worker says so)
        link.show({"m": model(1), "b": model()}, {"/models/m.gguf": "m"})  # m registered; b not loaded
        assert list(listed(http)) == ["b", "zz", "B/x", "m", "/models/m.gguf"]


@pytest.mark.parametrize("on_demand, groups, states, aliases, names", [
    ((), (), {"m": model(1), "b": model(1)}, {"/models/m.gguf": "m", "zz": "b", "B/x": "b"},
     "b, zz, B/x, m, /models/m.gguf"),  # (was sorted: /models/m.gguf, B/x, b, m, zz)
    (ON_DEMAND, GROUPS, {n: model() for n in ON_DEMAND}, {},
     "b (unloaded), zz (unloaded), B/x (unloaded), m (unloaded), /models/m.gguf (unloaded)"),
])
def test_the_404s_list_is_in_v1_models_order(served, on_demand, groups, states, aliases, names):
    link, http = served(on_demand, groups)
    link.show(states, aliases)
    with http:
        assert ", ".join(listed(http)) == re.sub(r" \(unloaded\)", "", names)
    assert f"(models: {names})" in link.model_not_found("nope", link.status).message


@pytest.mark.parametrize("pairs", [(("m", "nope"),), (("m",),), [("/models/m.gguf", "m")], (("x", "m"),)])
def test_on_demand_aliases_name_models_on_demand(pairs):
    from gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="on_demand_aliases must be a tuple of \\(alias, primary\\) pairs"):
        GatewayConfig(on_demand_models=ON_DEMAND, on_demand_aliases=pairs)


def test_slotserve_up_gives_the_gateway_each_model_on_demands_names(monkeypatch):
    from slotserve import demand_supervisor
    from slotserve.demand_supervisor import DemandSupervisor
    from worker.config import WorkerConfig

    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: 1)
    configs = (WorkerConfig(model="simulated", served_model_names=("b", "zz", "B/x")),
               WorkerConfig(model="simulated", served_model_names=("m", "/models/m.gguf")))
    sup = DemandSupervisor(configs, 1, 300.0, spawn=None, connect=None)
    assert sup.aliases == (("zz", "b"), ("B/x", "b"), ("/models/m.gguf", "m"))
    assert sup.served_names == ("b", "zz", "B/x", "m", "/models/m.gguf")


@pytest.mark.parametrize("on_demand, groups, states, aliases", [
    ((), (), {"m": model(1), "b": model(1), "boot": model(loading=1)}, {"/models/m.gguf": "m", "zz": "b", "B/x": "b"}),
    (ON_DEMAND, GROUPS, {**{n: model() for n in ON_DEMAND}, "m": model(loading=1), "b": model(1)}, {}),
])
def test_each_listed_name_is_retrieved_as_listed_and_another_is_the_routes_404(served, on_demand, groups, states,
                                                                              aliases):
    """OpenAI's retrieve (the SDK's ``client.models.retrieve``, Ollama's ``/v1/models/{model}``) was a
    404 ``GET /v1/models/m: Not Found`` for every name. Now each name the list gives, a primary or an
    alias, ``/`` in it or not (sent as ``%2F`` too, as the SDK sends it), served, loading or on
    demand, answers its list entry; another name the 404 every route gives for it."""
    from urllib.parse import quote

    link, http = served(on_demand, groups)
    link.show(states, aliases)
    with http:
        data = http.get("/v1/models").json()["data"]
        assert {m["id"] for m in data} >= {"m", "/models/m.gguf", "b", "zz", "B/x"}
        for entry in data:
            for path in ("/v1/models/" + entry["id"], "/v1/models/" + quote(entry["id"], safe="")):
                r = http.get(path)
                assert (r.status_code, r.json()) == (200, entry), path
        for name in ("nope", "M", "b/"):
            r = http.get("/v1/models/" + name)
            assert r.status_code == 404, name
            want = link.model_not_found(name, link.status)
            assert r.json() == {"error": {"message": want.message, "type": "invalid_request_error",
                                          "param": "model", "code": "model_not_found"}}


def test_retrieving_a_model_while_draining_is_the_503_of_the_list(served):
    drain = Drain()
    link, http = served(drain=drain)
    link.show({"m": model(1)})
    with http:
        assert http.get("/v1/models/m").status_code == 200
        drain.begin()
        for path in ("/v1/models", "/v1/models/m", "/v1/models/nope"):
            r = http.get(path)
            assert r.status_code == 503 and r.headers["connection"] == "close", path
            assert r.json()["error"] == http.get("/v1/models").json()["error"]
