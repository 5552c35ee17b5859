"""Served model names (issue 22, item 5: vLLM's ``--served-model-name``): a
worker serves its model under several names, the first the primary; a client
asking for any of them is served from the one queue of the model; welcomes,
``status``, ``/v1/models`` and ``/health`` list them; a name means one model
only; requests for a name queued before its worker arrived are served once it does."""

from __future__ import annotations

import pytest

from broker.outbox import Side
from client import Client
from protocol.enums import ErrorCode
from protocol.messages import Hello, Loading, Register, Results, Submit, Welcome
from tests.support.cluster import ThreadCluster
from tests.support.cores import C1, C2, INFO, W1, W2, assigned, make_core, sent
from tests.support.messages import envelope
from tests.support.reference import simulated_reference
from tests.support.waits import wait_until
from worker.config import WorkerConfig

ALIAS = "HuggingFaceTB/SmolLM2-135M-Instruct"


def register(core, w, model, *aliases, now=0.0):
    return core.on_backend(w, Register(model, 2, 2, INFO, aliases=aliases), now)


def submit(core, c, model, rid, now=0.0):
    return core.on_frontend(c, Submit(model, (envelope(rid, [1, 2], 3),)), now)


def test_a_request_for_an_alias_is_queued_and_served_as_one_for_its_model():
    core = make_core(register_grace_s=0.0)
    core.on_frontend(C1, Hello(), 0.0)
    sends = register(core, W1, "smollm2-135m", ALIAS, "small")
    (welcome,) = sent(sends, Side.FRONTEND, C1, Welcome)  # clients hear of the names at once
    assert welcome.aliases == {ALIAS: "smollm2-135m", "small": "smollm2-135m"}
    assert set(welcome.models) == {"smollm2-135m"}
    out = submit(core, C1, ALIAS, "a") + submit(core, C1, "small", "b") + submit(core, C1, "smollm2-135m", "c")
    assert [e.request_id for e in assigned(out)] == [0, 1]  # two credits: one queue, in arrival order
    st = core.status(0.1)
    assert set(st.models) == {"smollm2-135m"} and st.models["smollm2-135m"].queued == 1
    assert st.aliases == {ALIAS: "smollm2-135m", "small": "smollm2-135m"}
    # An unknown name's error lists every name served.
    (res,) = sent(submit(core, C2, "nope", "x"), Side.FRONTEND, C2, Results)
    assert res.finished[0].code is ErrorCode.UNKNOWN_MODEL and ALIAS in res.finished[0].message


def test_requests_for_an_alias_wait_while_its_model_loads_and_while_workers_come_back():
    core = make_core(register_grace_s=0.0)
    core.on_backend(W1, Loading("m", "w1", aliases=("m-alias",)), 0.0)
    assert not sent(submit(core, C1, "m-alias", "a"), Side.FRONTEND, C1, Results)  # waits: not unknown_model
    assert [e.request_id for e in assigned(register(core, W1, "m", "m-alias", now=1.0))] == [0]
    # Within a restarted broker's grace, a request for a name nobody announced yet waits
    # under that name; the worker that claims it as an alias takes it.
    core = make_core(register_grace_s=30.0)
    assert not sent(submit(core, C1, "m-alias", "a"), Side.FRONTEND, C1, Results)
    out = register(core, W1, "m", "m-alias", now=1.0)
    assert [e.request_id for e in assigned(out)] == [0] and "m-alias" not in core.queues


def test_a_name_means_one_model():
    core = make_core(register_grace_s=0.0)
    register(core, W1, "a", "shared", "b")
    register(core, W2, "b", "shared")  # "shared" is a's already; "b" is a model of its own from now on
    assert core.status(0.0).aliases == {"shared": "a"}
    assert assigned(submit(core, C1, "b", "x"), W2) and assigned(submit(core, C1, "shared", "y"), W1)


def test_served_names_are_checked_and_the_first_is_the_primary():
    assert WorkerConfig(model="x.gguf").served_names == ("x", "x.gguf")  # a GGUF: its stem, then its path
    assert WorkerConfig(model="smollm2-135m").served_names == ("smollm2-135m",)
    assert WorkerConfig(model="x.gguf", served_model_names=("small", ALIAS)).served_names == ("small", ALIAS)
    for bad in (("a", "a"), ("",), (" a",), ["a"]):
        with pytest.raises(ValueError, match="served_model_names"):
            WorkerConfig(served_model_names=bad)


def test_a_client_asking_for_any_name_is_served_and_the_gateway_lists_them():
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from gateway import GatewayConfig
    from gateway.app import create_app

    with ThreadCluster(heartbeat_interval_s=0.1) as cl:
        cl.add_worker(model="simulated", served_model_names=("sim", ALIAS), num_slots=2)
        with Client(cl.frontend, model=ALIAS) as c:  # before: unknown_model
            assert c.wait_for_model(10).vocab_size == 1000
            assert c.aliases == {ALIAS: "sim"} and {"sim", ALIAS} <= set(c.models)
            h = c.submit_request([3, 4], 5)
            h.result(timeout=10)
            assert (h.tokens, h.finish_reason.value) == simulated_reference([3, 4], 5)
        with Client(cl.frontend) as c:  # no model given: the broker's only model, by its primary name
            c.wait_for_model(10)
            assert c.model == "sim"
        with TestClient(create_app(GatewayConfig(broker=cl.frontend, status_interval_s=0.1))) as http:
            r = wait_until(lambda: (r := http.get("/health")).status_code == 200 and r, 20, "/health 200")
            assert r.json()["models"] == {"sim": 1, ALIAS: 1}
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["sim", ALIAS]  # the primary first
            for name in ("sim", ALIAS):
                r = http.post("/v1/completions", json={"model": name, "prompt": [3, 4], "max_tokens": 5})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == simulated_reference([3, 4], 5)[0]
                assert r.json()["model"] == name  # the name asked for, as vLLM's responses
            assert http.post("/v1/completions", json={"model": "other", "prompt": [3], "max_tokens": 2}
                             ).status_code == 404


def test_slotserve_up_waits_for_its_workers_by_their_primary_name():
    from broker import BrokerConfig
    from slotserve.launcher import ClusterConfig, LocalCluster
    from tests.support.cluster import ANY_PORT

    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                        (WorkerConfig(served_model_names=("sim", ALIAS), num_slots=2),), start_timeout_s=60.0)
    cluster = LocalCluster(cfg)
    cluster.start()  # before: it waited for "simulated", which no worker registers, until its timeout
    try:
        with Client(cluster.frontend, model=ALIAS) as c:
            h = c.submit_request([3, 4], 5)
            h.result(timeout=20)
            assert (h.tokens, h.finish_reason.value) == simulated_reference([3, 4], 5)
    finally:
        cluster.stop()
