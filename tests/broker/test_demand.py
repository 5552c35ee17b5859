"""The models on demand's states in the broker's ``status`` (broker/demand.py), without sockets.

A newcomer found ``GET /v1/models`` saying ``unloaded`` for 0.5-3 s after ``POST /models/load`` had
answered ``{"success": true}`` (the order waited in the launcher's queue for the supervisor's next
pass, and the worker's process then took its start-up time to announce its load), an unloaded model
still ``unloaded`` for as long after a request named it, and an unloaded model ``loaded`` until its
worker was gone (no ``unloading`` at all). Now an order goes through the broker, which shows its state
in the very status that answers it, a request's load in the status after its submit, and the
supervisor's word (``demand``) after each of its passes; a failed load ends ``unloaded`` with
``failed``, never ``loading`` for good."""

from __future__ import annotations

import functools
import logging

from protocol.enums import ModelAction, ModelState
from protocol.messages import (
    Bye, Demand, DemandState, Loading, ModelOrder, PendingOrder, Register, Status, Submit,
)
from tests.support import cores
from tests.support.cores import C1, INFO, W1
from tests.support.messages import envelope

make_core = functools.partial(cores.make_core, on_demand_models=("a", "a-alias", "b"))

LOAD, UNLOAD = ModelAction.LOAD, ModelAction.UNLOAD
UNLOADED, LOADING, LOADED, UNLOADING = (DemandState(s) for s in ModelState)
C2 = b"supervisor"


def order(core, model: str, action: ModelAction, now: float = 1.0) -> Status:
    """Send ``model_order``; the status that answers it."""
    (send,) = core.on_frontend(C1, ModelOrder(model, action), now)
    assert send.identity == C1 and isinstance(send.message, Status)
    return send.message


def said(core, now: float = 1.0, taken: int = 0, broker_id: str | None = None, **states) -> None:
    """The supervisor's ``demand``: model -> DemandState (the others unloaded)."""
    models = {"a": UNLOADED, "b": UNLOADED, **states}
    assert core.on_frontend(C2, Demand(broker_id or core.broker_id, models, {"a-alias": "a"}, taken), now) == []


def test_an_order_shows_its_state_in_the_status_that_answers_it():
    """Before the supervisor's next pass: a load makes an unloaded model loading, an unload a loaded (or
    loading) one unloading, at once; the order waits in ``orders`` for the supervisor."""
    core = make_core()
    # (before the supervisor's first word, every name on demand is one model: an alias is not known yet)
    assert core.status(0.0).on_demand == {"a": UNLOADED, "a-alias": UNLOADED, "b": UNLOADED}
    said(core, 0.0)
    assert core.status(0.0).on_demand == {"a": UNLOADED, "b": UNLOADED}
    st = order(core, "a", LOAD)
    assert st.on_demand["a"] == LOADING and st.on_demand["b"] == UNLOADED
    assert st.orders == (PendingOrder(1, LOAD, "a"),)
    said(core, a=LOADED, b=LOADING)
    st = order(core, "a", UNLOAD)
    assert st.on_demand["a"] == UNLOADING
    assert order(core, "b", UNLOAD).on_demand["b"] == UNLOADING  # (loading: it goes once loaded)
    assert [(o.seq, o.action, o.model) for o in core.status(1.0).orders] == [(2, UNLOAD, "a"), (3, UNLOAD, "b")]


def test_an_order_that_changes_nothing_shows_nothing_and_the_last_order_wins():
    core = make_core()
    said(core, a=LOADED)
    assert order(core, "a", LOAD).on_demand["a"] == LOADED
    assert order(core, "b", UNLOAD).on_demand["b"] == UNLOADED
    order(core, "a", UNLOAD)
    st = order(core, "a", LOAD)  # (replaces the unload: one order per model waits)
    assert st.on_demand["a"] == LOADED and [o.seq for o in st.orders if o.model == "a"] == [4]
    said(core, a=UNLOADING)  # its worker is told to stop: a load leaves it so until the supervisor says
    assert order(core, "a", LOAD).on_demand["a"] == UNLOADING


def test_the_supervisor_takes_orders_up_to_what_it_says_and_its_word_replaces_the_last():
    core = make_core()
    order(core, "a", LOAD)
    order(core, "b", LOAD)
    said(core, taken=1, a=LOADING)  # it read the status before b's order
    st = core.status(1.1)
    assert st.orders == (PendingOrder(2, LOAD, "b"),) and st.on_demand == {"a": LOADING, "b": LOADING}
    said(core, taken=2, a=LOADED, b=LOADING)
    assert core.status(1.2).orders == ()
    order(core, "b", UNLOAD)
    said(core, taken=99, broker_id="another broker", a=LOADED, b=LOADING)  # (a restarted broker's count)
    assert [o.model for o in core.status(1.3).orders] == ["b"] and core.status(1.3).on_demand["b"] == UNLOADING


def test_an_order_by_alias_is_its_models_and_one_for_a_model_not_on_demand_is_not_kept(caplog):
    core = make_core()
    said(core)
    assert order(core, "a-alias", LOAD).on_demand["a"] == LOADING
    with caplog.at_level(logging.WARNING, logger="broker.demand"):
        st = order(core, "served-always", LOAD)
    assert [o.model for o in st.orders] == ["a-alias"] and "not a model on demand here" in caplog.text


def test_a_request_for_an_unloaded_model_shows_its_load_at_once_unless_it_cannot_fit():
    """A request naming a model not loaded loads it: from its submit, not the supervisor's next pass.
    One that does not fit now (refused: failed, no exit code) stays unloaded while its requests wait."""
    core = make_core()
    said(core, b=DemandState(ModelState.UNLOADED, True, None, "it needs about 9,000 MiB"))
    core.on_frontend(C1, Submit("a-alias", [envelope("r1", [1], 5)]), 1.0)
    core.on_frontend(C1, Submit("b", [envelope("r2", [1], 5)]), 1.0)
    st = core.status(1.0)
    assert st.on_demand["a"] == LOADING
    assert st.on_demand["b"] == DemandState(ModelState.UNLOADED, True, None, "it needs about 9,000 MiB")


def test_what_the_broker_saw_since_the_supervisor_spoke_counts():
    """A worker registered: loaded before the next pass says so; a loaded model whose worker left is
    unloaded, or loading while requests wait for it; a worker announcing its load: loading."""
    core = make_core()
    said(core, a=LOADING)
    core.on_backend(W1, Loading("a", "w1", ("a-alias",)), 1.0)
    assert core.status(1.0).on_demand["a"] == LOADING
    core.on_backend(W1, Register("a", 2, 2, INFO, "w1", aliases=("a-alias",)), 2.0)
    assert core.status(2.0).on_demand["a"] == LOADED
    said(core, 2.1, a=LOADED)
    core.on_backend(W1, Bye("stopping"), 3.0)
    assert core.status(3.0).on_demand["a"] == UNLOADED
    core.on_frontend(C1, Submit("a", [envelope("r", [1], 5)]), 3.1)
    assert core.status(3.1).on_demand["a"] == LOADING


def test_a_failed_load_ends_unloaded_and_failed_with_the_workers_words_never_loading():
    core = make_core()
    st = order(core, "a", LOAD)
    said(core, taken=st.orders[-1].seq, a=LOADING)
    core.on_backend(W1, Loading("a", "w1"), 1.5)
    core.on_backend(W1, Bye("cannot load model 'a': not a GGUF file", load_failed=True), 2.0)
    assert core.status(2.0).on_demand["a"] == LOADING  # (until the supervisor saw its process end)
    said(core, 2.1, taken=1, a=DemandState(ModelState.UNLOADED, True, 1, "its worker exited with code 1"))
    got = core.status(2.1).on_demand["a"]
    assert got.state is ModelState.UNLOADED and got.failed and got.exit_code == 1
    assert "not a GGUF file" in got.reason  # the worker's own words, where it said any
    # the next load forgets them: a worker killed while it loads says nothing (dropped once silent)
    core.on_backend(W1, Loading("a", "w1"), 3.0)
    core.tick(1000.0)
    said(core, 1000.0, a=DemandState(ModelState.UNLOADED, True, -9, "its worker exited with code -9"))
    assert core.status(1000.0).on_demand["a"] == DemandState(ModelState.UNLOADED, True, -9,
                                                              "its worker exited with code -9")


def test_a_broker_without_models_on_demand_says_no_state():
    core = cores.make_core()
    assert core.status(0.0).on_demand == {} and core.status(0.0).orders == ()


def test_an_alias_of_a_model_on_demand_is_listed_as_its_alias_not_as_a_model():
    """``slotserve up --models-dir`` serves each model by its folder's name and its path too: the status
    listed the path as a model of its own, with no worker even while its model was loaded (``slotserve
    status``'s row ``/srv/models/tiny-a 0 0 0 0/0 0`` under ``tiny-a``'s; the broker's metrics'
    ``slotserve_workers{model="/srv/models/tiny-a"} 0``). Once the supervisor said which names are
    aliases, each is listed among ``aliases``, its model's line counting its requests."""
    core = make_core()
    said(core, a=LOADED)
    core.on_backend(W1, Register("a", 2, 2, INFO, "w1", aliases=("a-alias",)), 1.0)
    st = core.status(1.0)
    assert sorted(st.models) == ["a", "b"] and st.models["a"].workers == 1
    assert st.aliases == {"a-alias": "a"}
    core.on_frontend(C1, Submit("a-alias", [envelope("r", [1], 5)]), 1.1)  # (served at once: it is a's)
    assert sorted(core.status(1.1).models) == ["a", "b"] and core.status(1.1).models["a"].running == 1


def test_a_demand_that_claims_orders_never_given_or_names_no_model_on_demand_changes_nothing_of_them(caplog):
    """Anyone may send ``demand`` (the supervisor is a client as another). One with this broker's id
    that said it took orders up to 2**63 - 1 dropped every order waiting for the supervisor, each of
    which had answered ``{"success": true}`` (a break-it pass: tiny-c's load order lost, tiny-c never
    loaded); its states for names that are no model on demand here were listed. Now a demand that says
    it took an order this broker never gave is ignored (logged), and only models on demand are listed."""
    core = make_core()
    said(core)
    order(core, "a", LOAD)
    with caplog.at_level(logging.WARNING, logger="broker.demand"):
        said(core, taken=2**63 - 1, a=LOADED)
        assert [(o.seq, o.model) for o in core.status(1.0).orders] == [(1, "a")]
        assert core.status(1.0).on_demand["a"] == LOADING  # (its word ignored whole)
        said(core, taken=1, a=LOADING, ghost=LOADED)
    st = core.status(1.0)
    assert st.orders == () and sorted(st.on_demand) == ["a", "b"]
    assert "took orders up to 9223372036854775807" in caplog.text and "'ghost'" in caplog.text
