"""The broker's decisions without sockets: queue order, credits, routing,
migration, cancellation, deadlines, admission, liveness."""

from __future__ import annotations

import copy

import pytest

from broker.outbox import Side
from protocol.codec import decode, encode
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import (
    CLIENT_TO_BROKER, WORKER_TO_BROKER, Assign, Bye, Cancel, Error, Finished, Heartbeat, Hello,
    Iteration, Register,
    Results, StatusQuery, Status, Submit, Welcome,
)
from tests.support.cores import C1, C2, INFO, W1, W2, assigned, make_core, sent
from tests.support.messages import envelope


# ---------------------------------------------------------------------- core helpers


def register(core, w=W1, slots=2, inflight=None, now=0.0, model="simulated"):
    return core.on_backend(w, Register(model, slots, inflight or slots, INFO, w.decode()), now)


def submit(core, client, ids, now=0.0, model="simulated", **kw):
    return core.on_frontend(client, Submit(model, [envelope(i, [1, 2], 4, **kw) for i in ids]), now)


def results(sends, client) -> list[Results]:
    return sent(sends, Side.FRONTEND, client, Results)


def finished_of(sends, client) -> dict:
    return {f.request_id: f for r in results(sends, client) for f in r.finished}


# ---------------------------------------------------------------------- core


def test_register_welcomes_and_submit_respects_credits():
    core = make_core()
    out = register(core, slots=2, inflight=3)
    (w,) = sent(out, Side.BACKEND, W1, Welcome)
    assert w.broker_id == "broker-A" and w.models == {"simulated": INFO}
    out = submit(core, C1, range(5))
    specs = assigned(out)
    assert len(sent(out, Side.BACKEND, W1, Assign)) == 1  # one message for the batch
    assert len(specs) == 3                                  # never more than its credits
    assert len(core.queues["simulated"]) == 2
    keys = [s.request_id for s in specs]
    assert all(type(k) is int for k in keys)                # workers see broker keys, not client ids
    # A finished request returns a credit: exactly one more is assigned.
    out = core.on_backend(W1, Iteration(ids=[keys[0], keys[0]], tokens=[5, 0],
                                        finished=[Finished(keys[0], FinishReason.STOP, prompt_tokens=2)]), 1.0)
    assert len(assigned(out)) == 1
    fin = finished_of(out, C1)
    assert fin[0].finish_reason is FinishReason.STOP and fin[0].prompt_tokens == 2
    r = results(out, C1)[0]
    assert (r.ids, r.tokens) == ((0, 0), (5, 0))


def test_results_grouped_one_message_per_client_per_iteration():
    core = make_core()
    register(core, slots=4)
    k1 = [s.request_id for s in assigned(submit(core, C1, ["a", "b"]))]
    k2 = [s.request_id for s in assigned(submit(core, C2, ["a"]))]  # same id, other client: fine
    out = core.on_backend(W1, Iteration(ids=[k1[0], k2[0], k1[1]], tokens=[7, 8, 9]), 0.5)
    r1, r2 = results(out, C1), results(out, C2)
    assert len(r1) == 1 and len(r2) == 1
    assert (r1[0].ids, r1[0].tokens) == (("a", "b"), (7, 9))
    assert (r2[0].ids, r2[0].tokens) == (("a",), (8,))


def test_load_spreads_to_the_idle_worker_first():
    core = make_core()
    register(core, W1, slots=2, inflight=3)
    register(core, W2, slots=2, inflight=3)
    out = submit(core, C1, range(4))
    assert len(assigned(out, W1)) == 2 and len(assigned(out, W2)) == 2


def test_dead_worker_requests_migrate_to_head_with_resume_tokens():
    core = make_core(heartbeat_interval_s=0.1, worker_liveness_s=1.0)
    register(core, W1, slots=2)
    out = submit(core, C1, ["x", "y", "z"])
    kx, ky = [s.request_id for s in assigned(out)]
    core.on_backend(W1, Iteration(ids=[kx, ky, kx], tokens=[11, 21, 12]), 0.5)
    # W1 falls silent: after the liveness window it is dead.
    core.tick(1.2)
    assert core.workers.get(W1) is not None
    core.tick(1.6)
    assert core.workers.get(W1) is None
    out = register(core, W2, slots=1, now=1.65)
    specs = assigned(out, W2)
    assert [s.request_id for s in specs] == [kx]        # head of the queue, ahead of z
    assert specs[0].resume_tokens == (11, 12)
    assert core.counters["requeued"] == 2 and core.counters["workers_lost"] == 1
    # Tokens from the dead worker arriving late are stale and dropped.
    assert not results(core.on_backend(W1, Iteration(ids=[kx], tokens=[99]), 1.7), C1)
    # The new worker continues; the client sees only the new tokens.
    out = core.on_backend(W2, Iteration(ids=[kx], tokens=[13], finished=[Finished(kx, FinishReason.LENGTH)]), 1.8)
    assert (results(out, C1)[0].ids, results(out, C1)[0].tokens) == (("x",), (13,))
    assert [s.request_id for s in assigned(out, W2)] == [ky]   # then y (with its token), then z
    assert assigned(out, W2)[0].resume_tokens == (21,)


def test_bye_migrates_at_once_and_max_attempts_ends_with_worker_failed():
    core = make_core(max_attempts=2, heartbeat_interval_s=0.1, worker_liveness_s=1.0)
    register(core, W1, slots=1)
    (spec,) = assigned(submit(core, C1, ["x"]))
    register(core, W2, slots=1)
    out = core.on_backend(W1, Bye("stopping"), 1.0)      # a clean exit is not a failure
    assert [s.request_id for s in assigned(out, W2)] == [spec.request_id]
    assert (core.counters["workers_left"], core.counters["workers_lost"]) == (1, 0)
    register(core, W1, slots=1, now=1.1)
    core.tick(2.05)                                      # W2 silent: failure 1, x goes to W1
    core.on_backend(W1, Heartbeat(), 2.5)
    out = core.tick(3.6)                                 # W1 silent too: failure 2
    f = finished_of(out, C1)["x"]
    assert f.finish_reason is FinishReason.ERROR and f.code is ErrorCode.WORKER_FAILED
    assert not core.jobs


def test_cancel_queued_and_running():
    core = make_core()
    register(core, W1, slots=1)
    out = submit(core, C1, ["run", "wait"])
    (spec,) = assigned(out)
    out = core.on_frontend(C1, Cancel(["wait", "run", "unknown"]), 1.0)
    assert finished_of(out, C1)["wait"].finish_reason is FinishReason.CANCELLED
    (c,) = sent(out, Side.BACKEND, W1, Cancel)
    assert c.request_ids == (spec.request_id,)
    assert "run" not in finished_of(out, C1)            # ends when the worker says so
    out = core.on_backend(W1, Iteration(finished=[Finished(spec.request_id, FinishReason.CANCELLED)]), 1.1)
    assert finished_of(out, C1)["run"].finish_reason is FinishReason.CANCELLED
    assert not core.jobs


def test_queue_full_unknown_model_and_duplicates():
    core = make_core(max_queue=2, register_grace_s=0)  # no start-up grace: unknown at once
    out = submit(core, C1, ["a"], model="nope")
    assert finished_of(out, C1)["a"].code is ErrorCode.UNKNOWN_MODEL
    register(core, W1, slots=1)
    out = submit(core, C1, ["a", "b", "c", "d"])
    fin = finished_of(out, C1)
    assert set(fin) == {"d"} and fin["d"].code is ErrorCode.QUEUE_FULL
    # A resubmission of an id in flight is recognised and run once.
    out = submit(core, C1, ["b"])
    assert not finished_of(out, C1) and core.counters["duplicates"] == 1
    assert len(core.jobs) == 3


def test_queued_deadline_and_remaining_timeout_on_dispatch():
    core = make_core()
    register(core, W1, slots=1)
    submit(core, C1, ["first"])
    submit(core, C1, ["late"], now=0.0, timeout_s=0.5)
    submit(core, C1, ["ok"], now=0.0, timeout_s=5.0)
    out = core.tick(0.6)
    assert finished_of(out, C1)["late"].finish_reason is FinishReason.DEADLINE
    key = next(iter(core.workers.get(W1).inflight))
    out = core.on_backend(W1, Iteration(finished=[Finished(key, FinishReason.STOP)]), 2.0)
    (spec,) = assigned(out)
    assert spec.time_left_s == pytest.approx(3.0) and spec.params.timeout_s == 5.0  # time left beside the original


def test_silent_client_is_forgotten_and_its_requests_ended_client_silent():
    core = make_core(heartbeat_interval_s=0.1, client_liveness_s=1.0)
    register(core, W1, slots=1)
    (spec,) = assigned(submit(core, C1, ["a", "b"]))
    register(core, W1, slots=1, now=0.5)  # re-registration: keeps the worker alive
    core.on_backend(W1, Heartbeat(), 1.5)
    out = core.tick(1.5)
    assert C1 not in core.clients
    cancels = sent(out, Side.BACKEND, W1, Cancel)
    assert sum(len(c.request_ids) for c in cancels) <= 1
    # One ending per request, in case the client was only stalled, saying why.
    fin = finished_of(out, C1)
    assert sorted(fin) == ["a", "b"]
    assert all(f.finish_reason is FinishReason.ERROR and f.code is ErrorCode.CLIENT_SILENT for f in fin.values())


def test_client_lost_running_job_results_dropped_and_credit_returned():
    core = make_core()
    register(core, W1, slots=1)
    (spec,) = assigned(submit(core, C1, ["a"]))
    out = core.on_frontend(C1, Bye(), 1.0)
    assert sent(out, Side.BACKEND, W1, Cancel)[0].request_ids == (spec.request_id,)
    out = core.on_backend(W1, Iteration(ids=[spec.request_id], tokens=[3],
                                        finished=[Finished(spec.request_id, FinishReason.CANCELLED)]), 1.1)
    assert not sent(out, Side.FRONTEND)
    assert core.workers.get(W1).credits == 1


def test_slow_consumer_gets_error_naming_its_requests():
    core = make_core()
    register(core, W1, slots=1)
    submit(core, C1, ["a", "b"])
    out = core.client_unreachable(C1, ErrorCode.SLOW_CONSUMER)
    (err,) = sent(out, Side.FRONTEND, C1, Error)
    assert err.code is ErrorCode.SLOW_CONSUMER and sorted(err.request_ids) == ["a", "b"]


def test_unknown_worker_told_to_register_and_reregistration_requeues():
    core = make_core()
    (err,) = sent(core.on_backend(W1, Heartbeat(progress=1), 0.0), Side.BACKEND, W1, Error)
    assert err.code is ErrorCode.NOT_REGISTERED
    register(core, W1, slots=1)
    (spec,) = assigned(submit(core, C1, ["a"]))
    out = register(core, W1, slots=1, now=1.0)  # the worker dropped its work and came back
    assert [s.request_id for s in assigned(out)] == [spec.request_id]


def test_hello_status_heartbeats_and_bad_messages():
    core = make_core(heartbeat_interval_s=1.0)
    register(core, W1, slots=3)
    submit(core, C1, range(5))
    (w,) = sent(core.on_frontend(C2, Hello("x"), 0.1), Side.FRONTEND, C2, Welcome)
    assert "simulated" in w.models
    (st,) = sent(core.on_frontend(C2, StatusQuery(), 0.2), Side.FRONTEND, C2, Status)
    m = st.models["simulated"]
    assert (m.queued, m.running, m.workers, m.slots_busy, m.slots_total) == (2, 3, 1, 3, 3)
    assert st.counters["submitted"] == 5 and st.clients == 2
    out = core.tick(0.3)
    hbs = sent(out, kind=Heartbeat)
    assert len(hbs) == 3 and all(h.broker_id == "broker-A" for h in hbs)
    assert not sent(core.tick(0.4), kind=Heartbeat)    # once per interval
    err = ProtocolError(ErrorCode.MALFORMED, "bad")
    (e,) = sent(core.on_frontend_error(C2, err, ["z"], 0.5), Side.FRONTEND, C2, Error)
    assert e.code is ErrorCode.MALFORMED and e.request_ids == ("z",)
    # Ids of requests already in flight are not ended by someone else's bad frame.
    (e,) = sent(core.on_frontend_error(C1, err, [0], 0.5), Side.FRONTEND, C1, Error)
    assert e.request_ids == ()


def test_the_broker_never_changes_a_message_it_received():
    """Decoded messages go through the core untouched: the same bytes encode
    again afterwards, and the parameters a worker gets are the very objects
    the client sent (routing travels beside them)."""
    core = make_core()
    register(core, W1, slots=3)
    data = encode(Submit("simulated", [envelope("a", [1, 2], 4, stop_token=None, timeout_s=5.0, priority=2),
                                       envelope("b", "text", 3, resume_tokens=[7]),
                                       envelope("c", [3], 9, temperature=0.5, seed=1)]))
    msg = decode(data, CLIENT_TO_BROKER)
    before = copy.deepcopy(msg)
    out = core.on_frontend(C1, msg, 0.0)
    assert msg == before and encode(msg) == data
    by_params = {id(e.params): e for e in assigned(out)}  # (priority 2 sends "a" last)
    a, b, c = (by_params[id(e.params)] for e in msg.requests)  # the very objects the client sent
    assert b.resume_tokens == (7,) and a.time_left_s == 5.0 and c.time_left_s is None
    key = a.request_id
    it_data = encode(Iteration(ids=[key], tokens=[5], finished=[Finished(key, FinishReason.STOP, stop_reason=5)]))
    it = decode(it_data, WORKER_TO_BROKER)
    out = core.on_backend(W1, it, 1.0)
    assert encode(it) == it_data
    (f,) = finished_of(out, C1).values()
    assert (f.request_id, f.stop_reason) == ("a", 5)


# ---------------------------------------------------------------------- control messages over a peer's limit


def many_models(core, n=40):
    """Workers for ``n`` models with long names, so a welcome is several KiB."""
    for i in range(n):
        register(core, b"w-%d" % i, model=f"model-{i:03d}-" + "x" * 60)


def test_a_worker_whose_limit_cannot_hold_the_welcome_is_refused_as_a_misconfigured_peer(caplog):
    """The welcome lists every model served; a worker that announced a frame
    limit too small for it cannot complete its registration. That is the
    worker's configuration, not a broker fault: counted in
    ``control_too_large`` (not ``internal_errors``), logged as a warning that
    says which knob to raise, the worker told in a short error that fits its
    limit, and it gets no requests (the others keep serving)."""
    core = make_core()
    many_models(core)
    register(core, W2, slots=2)
    first = assigned(submit(core, C1, ["a", "b", "c"]), W2)
    with caplog.at_level("WARNING", logger="broker.core"):
        out = core.on_backend(W1, Register("simulated", 2, 2, INFO, "tiny", max_message_bytes=1024), 1.0)
    assert not sent(out, Side.BACKEND, W1, Welcome) and not assigned(out, W1)
    (err,) = sent(out, Side.BACKEND, W1, Error)
    assert err.code is ErrorCode.TOO_LARGE and "--max-message-bytes on this worker" in err.message
    assert len(encode(err)) <= 1024
    (rec,) = [r for r in caplog.records if "cannot register" in r.getMessage()]
    assert rec.levelname == "WARNING" and "raise --max-message-bytes on that worker" in rec.getMessage()
    c = core.counters
    assert c["control_too_large"] == 1 and c["internal_errors"] == 0 and c["workers_lost"] == 0
    assert core.workers.get(W1) is None
    # Everyone else carries on: the requests run on the other worker.
    key = first[0].request_id
    out = core.on_backend(W2, Iteration(ids=[key], tokens=[5], finished=[Finished(key, FinishReason.LENGTH)]), 3.0)
    assert list(finished_of(out, C1)) == ["a"] and len(assigned(out, W2)) == 1  # "c" takes the freed slot
    # With the limit raised it registers.
    out = core.on_backend(W1, Register("simulated", 2, 2, INFO, "tiny", max_message_bytes=64 * 1024), 4.0)
    assert sent(out, Side.BACKEND, W1, Welcome) and core.workers.get(W1) is not None


def test_a_control_message_over_the_limit_counts_as_a_bad_peer_not_an_internal_error(caplog):
    """The socket loop hands back a status (or a welcome) it could not send
    because it is over the receiver's frame limit: the broker counts it in
    ``control_too_large``, logs a warning naming the knob, tells the peer in a
    short error, and nothing else changes. An error that does not fit is not
    answered with another error."""
    from protocol.framing import Refused

    core = make_core(max_message_bytes=1024)
    many_models(core)
    submit(core, C1, ["a"])
    (st,) = sent(core.on_frontend(C1, StatusQuery(), 0.1), Side.FRONTEND, C1, Status)
    assert len(encode(st)) > 1024
    with caplog.at_level("WARNING", logger="broker.core"):
        out = core.undeliverable(Side.FRONTEND, C1, [Refused(st, ErrorCode.TOO_LARGE, "too big")], 0.2)
    (err,) = sent(out, Side.FRONTEND, C1, Error)
    assert err.code is ErrorCode.TOO_LARGE and not err.request_ids and len(encode(err)) <= 1024
    assert "status" in err.message and "--max-message-bytes on the broker" in err.message
    (rec,) = [r for r in caplog.records if "cannot send a status" in r.getMessage()]
    assert rec.levelname == "WARNING" and "raise --max-message-bytes" in rec.getMessage()
    assert core.counters["control_too_large"] == 1 and core.counters["internal_errors"] == 0
    assert core._by_client  # the client's request is untouched
    big = Error(ErrorCode.MALFORMED, "x" * 2000)
    assert core.undeliverable(Side.FRONTEND, C1, [Refused(big, ErrorCode.TOO_LARGE, "too big")], 0.3) == []
    assert core.counters["control_too_large"] == 2 and core.counters["internal_errors"] == 0
    # A message the encoder refuses is still the broker's own bug.
    core.undeliverable(Side.FRONTEND, C1, [Refused(st, ErrorCode.BAD_REQUEST, "cannot encode")], 0.4)
    assert core.counters["internal_errors"] == 1


def test_a_broker_process_collects_garbage_less_often():
    """tune_gc (called by the broker's process shells) sets the collector's thresholds, above
    CPython's (700, 10, 10): rarer passes over the requests a broker holds."""
    import gc

    from broker.server import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert all(t > d for t, d in zip(GC_THRESHOLDS, (700, 10, 10)))
    finally:
        gc.set_threshold(*before)


def test_stale_tokens_count_neither_as_output_nor_as_an_iteration():
    """``tokens_out`` counts the tokens routed to a job (not those of a key the worker no longer
    holds), and a worker's ``iterations`` the iterations that routed at least one."""
    core = make_core()
    register(core, slots=2)
    (key,) = [s.request_id for s in assigned(submit(core, C1, ["a"]))]
    core.on_backend(W1, Iteration(ids=[key, 999, key], tokens=[5, 6, 7]), 0.5)  # 999: no such job
    assert core.counters["tokens_out"] == 2
    assert core.workers.get(W1).iterations == 1
    core.on_backend(W1, Iteration(ids=[999, 998], tokens=[1, 2]), 0.6)  # only stale keys
    assert core.counters["tokens_out"] == 2
    assert core.workers.get(W1).iterations == 1
