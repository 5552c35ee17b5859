"""Models on demand through real processes (issue 34 item 1): a LocalCluster with two models and room
for one loads each when its requests arrive, unloads the other to make room, serves every request
(none lost, none refused), and unloads an idle model; the HTTP gateway lists each model's state.
The decisions themselves are tested without processes in tests/cli/test_on_demand.py."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from broker import BrokerConfig
from client import Client
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from tests.support.waits import wait_until
from worker.config import WorkerConfig

MODELS = ("model-a", "model-b")


def config(model_a: str = "simulated", **kw) -> ClusterConfig:
    """Two models on demand, ``model-a`` (``model_a``: simulated, or a real model's folder) and
    ``model-b`` (simulated)."""
    workers = tuple(WorkerConfig(model=m, served_model_names=(name,), num_slots=2, warmup=False)
                    for m, name in zip((model_a, "simulated"), MODELS))
    return ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.2,
                                      register_grace_s=0.5),
                         workers=(), on_demand=workers, start_timeout_s=60.0, **kw)


def drive(cluster: LocalCluster, handles, timeout_s: float = 60.0) -> list:
    """Run the supervisor's passes (as ``supervise`` does) until every handle ended; the actions taken."""
    actions = []
    deadline = time.monotonic() + timeout_s
    while not all(h.done() for h in handles):
        assert time.monotonic() < deadline, f"not served: {[h.finish_reason for h in handles]}"
        actions += cluster.on_demand_pass()
        for h in handles:
            if not h.done():
                try:
                    h.result(timeout=0.05)
                except TimeoutError:
                    pass
                break
    return actions


def test_alternating_requests_for_two_models_with_room_for_one_are_all_served():
    with LocalCluster(config(max_loaded_models=1, idle_unload_s=0.0)) as cluster:
        assert cluster.worker_processes == []  # nothing loaded before it is asked for
        clients = {m: Client(cluster.frontend, model=m, connect_timeout_s=10) for m in MODELS}
        try:
            taken = []
            for round_ in range(3):
                for m in MODELS:
                    handles = [clients[m].submit_request([1, 2, 3], 4) for _ in range(2)]
                    taken += drive(cluster, handles)
                    assert all(h.finish_reason.value == "length" and len(h.tokens) == 4 for h in handles), round_
                    assert set(cluster.loaded_on_demand) == {m}  # one at a time
            loads = [a.model for a in taken if type(a).__name__ == "Load"]
            assert loads == list(MODELS) * 3  # each turn loads its model once
            assert all(type(a).__name__ in ("Load", "Unload") for a in taken)
        finally:
            for c in clients.values():
                c.close()


def test_an_idle_model_is_unloaded_and_loads_again_when_asked():
    with LocalCluster(config(max_loaded_models=2, idle_unload_s=0.3)) as cluster:
        with Client(cluster.frontend, model="model-a", connect_timeout_s=10) as c:
            h = c.submit_request([5], 2)
            drive(cluster, [h])
            assert h.finish_reason.value == "length" and set(cluster.loaded_on_demand) == {"model-a"}
            # passes as if later (a pass takes its clock), no sleep: each 1 s on, past idle_unload_s (0.3 s),
            # until one unloads (the first to see the model loaded makes it idle from then)
            t, deadline, unloads = time.monotonic(), time.monotonic() + 30, []
            while not unloads:
                assert time.monotonic() < deadline
                t += 1.0
                unloads = [a for a in cluster.on_demand_pass(now=t) if type(a).__name__ == "Unload"]
            assert unloads[0].model == "model-a" and "idle" in unloads[0].why
            h = c.submit_request([5], 2)
            drive(cluster, [h])
            assert h.finish_reason.value == "length"


@pytest.mark.parametrize("bad, says", [(dict(workers=(), on_demand=()), "at least one worker"),
                                       (dict(max_loaded_models=0), "max_loaded_models")])
def test_bad_cluster_configs_are_value_errors(bad, says):
    kw = dict(broker=BrokerConfig(), workers=(), on_demand=(WorkerConfig(model="simulated"),))
    with pytest.raises(ValueError, match=says):
        ClusterConfig(**{**kw, **bad})


def test_through_http_a_model_loads_on_its_first_request_and_v1_models_says_each_state(tiny_text_dir):
    """model-a is a real model (the tiny text model's folder: transformers loads it in its worker)."""
    import threading

    import httpx
    import openai

    from gateway.config import GatewayConfig

    with LocalCluster(config(tiny_text_dir, max_loaded_models=1, idle_unload_s=0.0,
                             gateway=GatewayConfig(port=0))) as cluster:
        stop = threading.Event()
        supervisor = threading.Thread(target=cluster.supervise, args=(stop.is_set,), daemon=True)
        supervisor.start()
        try:
            states = {m["id"]: m["status"]["value"] for m in httpx.get(cluster.http_url + "/v1/models").json()["data"]}
            assert states == {"model-a": "unloaded", "model-b": "unloaded"}
            # ready with no model loaded: a readiness probe must let the request that loads one through
            health = httpx.get(cluster.http_url + "/health")
            assert health.status_code == 200 and health.json() == {"status": "ok", "models": {},
                                                                   "on_demand": ["model-a", "model-b"]}
            sdk = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=60)
            for m in ("model-b", "model-a"):
                # the tiny model's weights are random: greedy and past its EOS, so that 3 tokens are "length"
                # on every run (at OpenAI's default temperature 1 its EOS came within 3 tokens in CI stop 40)
                out = sdk.completions.create(model=m, prompt=[1, 2, 3], max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
                assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
            states = {m["id"]: m["status"]["value"] for m in httpx.get(cluster.http_url + "/v1/models").json()["data"]}
            assert states["model-a"] == "loaded" and states["model-b"] in ("unloaded", "loaded")  # b: going away
            # llama.cpp's router endpoints: load b (a, idle, makes room), then unload it
            for op, want in (("load", {"model-a": "unloaded", "model-b": "loaded"}),
                             ("unload", {"model-a": "unloaded", "model-b": "unloaded"})):
                assert httpx.post(f"{cluster.http_url}/models/{op}", json={"model": "model-b"}).json() == \
                    {"success": True}
                deadline = time.monotonic() + 60
                while states != want:
                    assert time.monotonic() < deadline, (op, states)
                    states = {m["id"]: m["status"]["value"]
                              for m in httpx.get(cluster.http_url + "/v1/models").json()["data"]}
                metrics = httpx.get(cluster.http_url + "/metrics").text
                for name, state in want.items():
                    assert f'slotserve_model_loaded{{model="{name}"}} {1.0 if state == "loaded" else 0.0}' in metrics
        finally:
            stop.set()
            supervisor.join(30)


def test_a_request_in_flight_when_the_cluster_stops_still_gets_its_model_loaded():
    """The gateway drains while the cluster stops: a request that waits for a model on demand still
    gets it loaded (the supervisor's passes go on during the drain) and is answered, rather than
    waiting out the shutdown timeout for a load that never comes."""
    import threading

    import httpx

    from gateway.config import GatewayConfig

    cluster = LocalCluster(config(max_loaded_models=1, gateway=GatewayConfig(port=0, shutdown_timeout_s=20.0)))
    cluster.start()
    answers = []
    try:
        def ask() -> None:
            answers.append(httpx.post(cluster.http_url + "/v1/completions", timeout=60,
                                      json={"model": "model-a", "prompt": [1, 2, 3], "max_tokens": 3}))

        asker = threading.Thread(target=ask)
        asker.start()
        with Client(cluster.frontend, model="model-a", connect_timeout_s=10) as c:  # queued; no pass ran
            wait_until(lambda: getattr(c.status().models.get("model-a"), "queued", 0), 30,  # (absent until it arrives)
                       "the request queued for model-a",
                       show=lambda: [(a.status_code, a.text) for a in answers])
    finally:
        t0 = time.monotonic()
        cluster.stop()
    asker.join(30)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert time.monotonic() - t0 < 15  # not the whole shutdown timeout


def test_through_http_a_model_on_demand_named_simulated_loads_on_its_first_request():
    """``slotserve up --model simulated --model ...``: the gateway's control connection serves the name
    ``simulated``, and waited for its worker, so each request for it before its load was a 500 (the
    connection cut) rather than waiting in its queue; now it loads it, streamed or not."""
    import threading

    import httpx

    from gateway.config import GatewayConfig

    workers = tuple(WorkerConfig(model="simulated", served_model_names=(name,), num_slots=2, warmup=False)
                    for name in ("simulated", "model-b"))
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.2,
                                     register_grace_s=0.5),
                        workers=(), on_demand=workers, start_timeout_s=60.0, max_loaded_models=1,
                        gateway=GatewayConfig(port=0))
    with LocalCluster(cfg) as cluster:
        stop = threading.Event()
        supervisor = threading.Thread(target=cluster.supervise, args=(stop.is_set,), daemon=True)
        supervisor.start()
        try:
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
            for model in ("simulated", "model-b", "simulated"):  # (room for one: each loads in turn)
                r = httpx.post(cluster.http_url + "/v1/completions", json={**body, "model": model}, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
            httpx.post(cluster.http_url + "/models/unload", json={"model": "simulated"})
            wait_until(lambda: "simulated" not in cluster.loaded_on_demand, 30, "simulated to unload")
            with httpx.stream("POST", cluster.http_url + "/v1/completions", timeout=60,
                              json={**body, "model": "simulated", "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        finally:
            stop.set()
            supervisor.join(30)


def _killed_at_start() -> None:
    """A worker process killed before it says a word (SIGKILL while it starts: the OOM killer)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_model_whose_workers_are_killed_before_they_announce_their_load_fails_its_request():
    """Each worker of model-b dies at once, before it announces its load (the broker never hears
    of it): the launcher announces each such load for it on the cluster's backend, the broker
    counts each as a dead loader, and the request ends worker_failed after max_attempts (3) loads;
    model-a still serves (before: the request waited forever, model-b reloaded after each back-off)."""
    import multiprocessing as mp

    cfg = config(max_loaded_models=1)
    cfg = ClusterConfig(replace(cfg.broker, worker_liveness_s=0.6, heartbeat_interval_s=0.1), (),
                        on_demand=cfg.on_demand, max_loaded_models=1, start_timeout_s=60.0)
    with LocalCluster(cfg) as cluster:
        real, loads = cluster._demand._spawn, []

        def spawn(model, worker_config):
            loads.append(model)
            if model != "model-b":
                return real(model, worker_config)
            p = mp.get_context("spawn").Process(target=_killed_at_start, daemon=True)
            p.start()
            return p

        cluster._demand._spawn = spawn
        with Client(cluster.frontend, model="model-b", connect_timeout_s=10) as cb, \
                Client(cluster.frontend, model="model-a", connect_timeout_s=10) as ca:
            h = cb.submit_request([1, 2], 3)
            drive(cluster, [h])
            assert h.finish_reason.value == "error" and h.error.code.value == "worker_failed", h.error
            assert "exited with code -9 before it announced its load" in str(h.error)
            assert "3 loads failed" in str(h.error) and loads == ["model-b"] * 3
            ha = ca.submit_request([1, 2], 3)
            drive(cluster, [ha])
            assert ha.finish_reason.value == "length" and loads == ["model-b"] * 3 + ["model-a"]


def _surfaces(cluster: LocalCluster, model: str) -> dict:
    """``model``'s state as each surface says it now: ``GET /v1/models``, the broker's status (what
    ``slotserve status`` prints, and its text), and the gateway's ``/metrics``."""
    import httpx
    from click.testing import CliRunner

    from slotserve.cli import main
    from tests.support.gateway import metric

    v1 = {m["id"]: m["status"]["value"] for m in httpx.get(cluster.http_url + "/v1/models").json()["data"]}
    with Client(cluster.frontend, name="test-status", connect_timeout_s=10) as c:
        status = c.status().on_demand[model].state.value
    out = CliRunner().invoke(main, ["status", "--broker", cluster.frontend]).output
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [model]]
    metrics = [s for s in ("unloaded", "loading", "loaded", "unloading")
               if metric(cluster.http_url, "slotserve_model_state", model=model, state=s) == 1.0]
    return {"v1": v1[model], "status": status, "cli": line.split()[6].rstrip(","), "metrics": metrics}


def _drive_until(cluster: LocalCluster, model: str, want: str, timeout_s: float = 60.0) -> list:
    """Run the supervisor's passes until ``GET /v1/models`` says ``model`` is ``want``: each state
    it said, in order (once each)."""
    import httpx

    seen = []

    def said() -> bool:
        cluster.on_demand_pass()
        entry = {m["id"]: m["status"] for m in httpx.get(cluster.http_url + "/v1/models").json()["data"]}[model]
        if not seen or seen[-1] != entry:
            seen.append(entry)
        return entry["value"] == want

    wait_until(said, timeout_s, f"{model} {want}", show=lambda: seen, pause_s=0.05)
    return seen


def test_through_http_every_surface_says_a_load_or_an_unload_from_the_moment_it_is_accepted(tmp_path):
    """A newcomer's report: after ``POST /models/load`` answered ``{"success": true}``, ``GET
    /v1/models`` said ``unloaded`` for 0.5-3 s before ``loading`` (the order waited for the supervisor's
    next pass, then the worker's process for its start-up before it announced its load); after
    ``/models/unload`` it said ``loaded`` until the worker had gone (never ``unloading``); a request for
    an unloaded model left it ``unloaded`` as long. Here no supervisor pass runs between the order (or
    the request) and the checks: every surface -- ``/v1/models``, the broker's status and ``slotserve
    status``, ``/metrics`` -- says ``loading`` (``unloading``) at once, and then nothing but that until
    the model is loaded (unloaded). A model that cannot load ends ``unloaded`` with ``failed``, its
    worker's exit code and words: not ``loading`` for good."""
    import httpx

    from gateway.config import GatewayConfig

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    workers = tuple(WorkerConfig(model=m, served_model_names=(name,), num_slots=2, warmup=False)
                    for m, name in (("simulated", "model-a"), ("simulated", "model-b"), (str(broken), "model-c")))
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.2,
                                     register_grace_s=0.5),
                        workers=(), on_demand=workers, start_timeout_s=60.0, max_loaded_models=2, idle_unload_s=0.0,
                        gateway=GatewayConfig(port=0))
    with LocalCluster(cfg) as cluster:
        url = cluster.http_url
        assert _surfaces(cluster, "model-a") == {"v1": "unloaded", "status": "unloaded", "cli": "unloaded",
                                                 "metrics": ["unloaded"]}
        assert httpx.post(url + "/models/load", json={"model": "model-a"}).json() == {"success": True}
        assert _surfaces(cluster, "model-a") == {"v1": "loading", "status": "loading", "cli": "loading",
                                                 "metrics": ["loading"]}
        assert _drive_until(cluster, "model-a", "loaded") == [{"value": "loading"}, {"value": "loaded"}]
        assert httpx.post(url + "/models/unload", json={"model": "model-a"}).json() == {"success": True}
        assert _surfaces(cluster, "model-a") == {"v1": "unloading", "status": "unloading", "cli": "unloading",
                                                 "metrics": ["unloading"]}
        assert _drive_until(cluster, "model-a", "unloaded") == [{"value": "unloading"}, {"value": "unloaded"}]
        # a request for an unloaded model loads it: loading from the status that first lists it queued
        with Client(cluster.frontend, model="model-b", connect_timeout_s=10) as c:
            h = c.submit_request([1, 2, 3], 3)
            st = wait_until(lambda: (s := c.status()).models["model-b"].queued and s, 30, "model-b's request queued")
            assert st.on_demand["model-b"].state.value == "loading"
            assert _surfaces(cluster, "model-b")["v1"] == "loading"
            assert _drive_until(cluster, "model-b", "loaded") == [{"value": "loading"}, {"value": "loaded"}]
            assert h.result(timeout=60) and h.finish_reason.value == "length"
        # a load that fails: loading, then unloaded and failed (llama.cpp's words), never loading for good
        assert httpx.post(url + "/models/load", json={"model": "model-c"}).json() == {"success": True}
        assert _surfaces(cluster, "model-c")["v1"] == "loading"
        seen = _drive_until(cluster, "model-c", "unloaded")
        assert seen[:-1] == [{"value": "loading"}], seen
        assert seen[-1]["failed"] is True and seen[-1]["exit_code"] != 0 and "model-c" in seen[-1]["reason"], seen
        # in slotserve's words: not the server's path nor the loader's text (the log has them)
        assert "its files could not be read" in seen[-1]["reason"] and str(broken) not in seen[-1]["reason"], seen
        assert _surfaces(cluster, "model-c")["cli"] == "unloaded"
