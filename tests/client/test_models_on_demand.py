"""A client learns from the broker's welcome which models its supervisor loads on demand (protocol
14: ``Welcome.on_demand``, ``slotserve up`` with several models), and resolves and waits for its
model by them, as the HTTP gateway does from its config. Before, it saw only the models with a
worker: without ``model=`` it took whichever one was loaded (each time another, as they were loaded
and unloaded), ``wait_for_model()`` for a model not loaded raised ``unknown_model`` ('start one
(slotserve worker --model lazy)') though its first request would load it, and so ``slotserve run
--broker --model lazy`` failed at once; without ``--model`` it waited 60 s for '(any)'.

In process: a broker whose models on demand are ``lazy`` (no supervisor here: nothing loads it, its
requests wait in the queue) and ``simulated``, served by a worker on a thread."""

from __future__ import annotations

import io

import pytest

from client import Client, UnknownModelError
from slotserve.batch import run_batch
from slotserve.signals import StopSignals
from tests.support.cluster import ThreadCluster
from tests.support.waits import wait_until

ON_DEMAND = ("lazy", "simulated")


@pytest.fixture(scope="module")
def cluster():
    with ThreadCluster(on_demand_models=ON_DEMAND, register_grace_s=0.0) as c:
        c.add_worker()
        with Client(c.frontend, model="simulated") as probe:
            probe.wait_for_model(30)  # (its worker registered: one of the two is loaded)
        yield c


def test_a_client_without_a_model_is_told_to_name_one_of_the_models_on_demand(cluster):
    with Client(cluster.frontend) as c:
        wait_until(lambda: c.on_demand == ON_DEMAND and "simulated" in c.models, 30, "the welcome")
        with pytest.raises(ValueError, match=r"serves several models \(lazy, simulated\): pass model="):
            c.submit_request([1, 2], 3)
        assert c.model is None  # (was "simulated": the one loaded)


def test_wait_for_model_returns_for_a_model_on_demand_that_its_first_request_loads(cluster):
    with Client(cluster.frontend, model="lazy") as c:
        assert c.wait_for_model(30) is None  # (was UnknownModelError: 'start one (slotserve worker --model lazy)')
        h = c.submit_request([1, 2], 3)  # queued: the supervisor would load it now
        wait_until(lambda: c.status().models["lazy"].queued == 1, 30, "the request to wait in lazy's queue")
        assert not h.done()
        assert c.cancel(h.request_id)
        h.result(timeout=30)
    with Client(cluster.frontend, model="simulated") as c:
        assert c.wait_for_model(30).vocab_size > 0  # (a model on demand that is loaded: its info)


def test_an_unknown_model_is_told_the_models_on_demand_too(cluster):
    with Client(cluster.frontend, model="nope") as c:
        with pytest.raises(UnknownModelError, match=r"\(served: simulated; loading: none; on demand: lazy, "
                                                    r"simulated\)"):
            c.wait_for_model(30)


@pytest.mark.parametrize("model", [None, "lazy"])
def test_slotserve_run_takes_a_model_on_demand_and_names_them_without_one(cluster, model):
    out = io.StringIO()
    with StopSignals() as signals:
        outcome = run_batch(io.StringIO(""), out, signals=signals, model=model, broker=cluster.frontend,
                            progress=False, wait_for_model_s=30)
    if model is None:
        assert outcome.message.startswith("the broker at ") and "serves several models (lazy, simulated)" in \
            outcome.message, outcome  # (was: "model '(any)' has no worker after 30 s", or the loaded one's rows)
    else:
        assert outcome.exit_status == 0, outcome  # (an empty job: no request to load it; was unknown_model at once)
