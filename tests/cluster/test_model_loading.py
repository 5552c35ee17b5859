"""Blast radius, kind "a model that is still loading, or not served at all"
(issue 10, item 6): a worker announces its model when it starts loading, so
requests for it wait in the queue -- bounded by their own ``timeout_s`` and
the queue's bound -- instead of ending ``unknown_model`` after the broker's
start-up grace; waiting for a model never spins (the broker pushes a
welcome when the models change; the client asks again only with a backoff);
a model nobody serves or loads fails at once, saying which models are
served and loading, from every entry point (``Client.wait_for_model``, a
submit, ``slotserve run --broker``); a loader that gives up fails the
requests waiting for it; ``Client(addr)`` without ``model=`` uses the
broker's only model and names them all when there are several."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from broker.core import BrokerCore
from client import Client, UnknownModelError
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import Hello
from tests.support.cluster import ThreadCluster, ThreadWorker
from tests.support.waits import wait_until
from worker import SimulatedLLM
from worker.errors import ModelLoadError
from worker.process import WorkerProcess

SLOTSERVE = [sys.executable, "-m", "slotserve"]


def gated_loader(fail: bool = False):
    """A WorkerProcess class whose model load waits for ``Loader.gate`` (a slow
    load that the test ends), then loads a SimulatedLLM or fails."""

    class Loader(WorkerProcess):
        gate = threading.Event()
        started = threading.Event()

        def _load(self):
            Loader.started.set()
            assert Loader.gate.wait(30)
            if fail:
                raise ModelLoadError(f"cannot load model {self.config.model!r}: out of memory")
            self._setup(SimulatedLLM())

    return Loader


def loading(c: Client, model: str) -> int:
    m = c.status().models.get(model)
    return 0 if m is None else m.loading


def serving(c: Client, model: str) -> bool:
    m = c.status().models.get(model)
    return m is not None and m.workers >= 1


def start_loader(cl: ThreadCluster, loader, model: str = "big") -> ThreadWorker:
    w = ThreadWorker(cl.backend, process_cls=loader, load=True, keep_error=True, model=model, num_slots=4)
    cl.workers.append(w)
    assert loader.started.wait(10)
    return w


def test_requests_for_a_loading_model_wait_bounded_by_deadline_and_queue_and_waiting_never_spins(monkeypatch):
    hellos = []
    real = BrokerCore.on_frontend

    def on_frontend(self, identity, msg, now):
        if isinstance(msg, Hello):
            hellos.append(now)
        return real(self, identity, msg, now)

    monkeypatch.setattr(BrokerCore, "on_frontend", on_frontend)
    Loader = gated_loader()
    with ThreadCluster(register_grace_s=0.0, max_queue=3) as cl:
        start_loader(cl, Loader)
        with Client(cl.frontend, model="big") as c:
            wait_until(lambda: loading(c, "big") == 1, 10, "the broker to know the model is loading")
            assert c.loading == ("big",) and "big" not in c.models
            waited = []
            waiter = threading.Thread(target=lambda: waited.append(c.wait_for_model(30)), daemon=True)
            n_hellos = len(hellos)
            waiter.start()
            late = c.submit_request([1, 2], 3, timeout_s=0.5)  # its deadline passes while the model loads
            hs = [c.submit_request([i + 1, 2], 3) for i in range(2)]
            full = c.submit_request([9], 3)                     # the queue holds 3
            wait_until(lambda: late.done() and full.done(), 10, "the deadline and the full queue")
            assert late.finish_reason is FinishReason.DEADLINE
            assert full.finish_reason is FinishReason.ERROR and full.error.code is ErrorCode.QUEUE_FULL
            assert not any(h.done() for h in hs) and c.status().models["big"].queued == 2
            # Half a second and more of waiting: a spinning client would have sent hundreds of hellos.
            assert len(hellos) - n_hellos <= 1
            Loader.gate.set()
            c.run(timeout=20)
            assert all(h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for h in hs)
            waiter.join(10)
            assert waited and waited[0].vocab_size == 1000
            assert loading(c, "big") == 0 and c.status().models["big"].workers == 1


def test_an_unserved_model_fails_at_once_listing_served_and_loading_models():
    Loader = gated_loader()
    with ThreadCluster(register_grace_s=0.0) as cl:
        cl.add_worker()
        start_loader(cl, Loader)
        try:
            with Client(cl.frontend, model="nope") as c:
                # both workers known to the broker (the served one registers on its own thread: asked
                # before that, the broker rightly lists no served model)
                wait_until(lambda: loading(c, "big") == 1 and serving(c, "simulated"), 10,
                           "the loading announcement and the served model")
                with pytest.raises(UnknownModelError) as e:
                    c.wait_for_model(60)  # not after 60 s: at once
                assert e.value.code is ErrorCode.UNKNOWN_MODEL and isinstance(e.value, ValueError)
                assert e.value.served == ("simulated",) and e.value.loading == ("big",)
                assert "simulated" in str(e.value) and "big" in str(e.value)
                h = c.submit_request([1], 2)
                h.result(10)
                assert h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.UNKNOWN_MODEL
                assert "served: simulated" in h.error.message and "loading: big" in h.error.message
        finally:
            Loader.gate.set()


def test_a_loader_that_gives_up_fails_the_requests_waiting_for_it():
    Loader = gated_loader(fail=True)
    with ThreadCluster(register_grace_s=0.0) as cl:
        cl.add_worker()
        w = start_loader(cl, Loader)
        with Client(cl.frontend, model="big") as c:
            wait_until(lambda: loading(c, "big") == 1, 10, "the loading announcement")
            h = c.submit_request([1], 2)
            wait_until(lambda: c.status().models["big"].queued == 1, 10, "the request to wait")
            Loader.gate.set()
            h.result(10)
            assert h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.UNKNOWN_MODEL
            assert "stopped" in h.error.message and "served: simulated" in h.error.message
            # why, once: the load error names the model already (the worker's goodbye adds nothing)
            assert h.error.message.count("cannot load model 'big': out of memory") == 1, h.error.message
            assert h.error.message.count("cannot load model") == 1, h.error.message
            w.thread.join(10)
            assert isinstance(w.error, ModelLoadError)


def test_client_without_model_uses_the_only_one_and_names_them_when_several():
    Loader = gated_loader()
    with ThreadCluster(register_grace_s=0.0) as cl, Client(cl.frontend, model="big") as watch:
        start_loader(cl, Loader)
        try:
            wait_until(lambda: loading(watch, "big") == 1, 10, "the broker to know the model is loading")
            with Client(cl.frontend) as c:
                assert c.model == "big"  # the only model, though still loading
        finally:
            Loader.gate.set()
        cl.add_worker(model="other")
        wait_until(lambda: sorted(m for m, s in watch.status().models.items() if s.workers) == ["big", "other"],
                   10, "both models served")
        with Client(cl.frontend) as c:
            assert sorted(c.models) == ["big", "other"]
            assert c.model is None
            with pytest.raises(ValueError, match="several models.*big, other"):
                c.submit_request([1], 2)
            with pytest.raises(ValueError, match="several models"):
                c.wait_for_model(5)
            assert c.status().models["other"].workers == 1  # a status-only client works


def test_client_without_model_against_a_broker_serving_one_model():
    with ThreadCluster() as cl:
        cl.add_worker()
        with Client(cl.frontend) as c:
            assert c.wait_for_model(10).vocab_size == 1000 and c.model == "simulated"
            h = c.submit_request([1, 2, 3], 4)
            assert h.result(10)[:3] == [1, 2, 3] and h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_slotserve_run_with_a_broker_fails_fast_for_an_unserved_model_and_defaults_to_the_served_one(tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": [1, 2], "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    with ThreadCluster(register_grace_s=0.0) as cl:
        cl.add_worker(model="smollm2-135m")  # served under that name (a SimulatedLLM, no load)
        r = subprocess.run(SLOTSERVE + ["run", str(rows), "-o", str(out), "--broker", cl.frontend, "--model", "simulated",
                                        "--no-progress"], capture_output=True, text=True, timeout=50)
        assert r.returncode == 1, r.stderr
        assert "simulated" in r.stderr and "served: smollm2-135m" in r.stderr
        r = subprocess.run(SLOTSERVE + ["run", str(rows), "-o", str(out), "--broker", cl.frontend, "--no-progress"],
                           capture_output=True, text=True, timeout=50)
        assert r.returncode == 0, r.stderr
        (row,) = map(json.loads, out.read_text().splitlines())
        assert row["finish_reason"] in ("stop", "length") and len(row["tokens"]) >= 1
