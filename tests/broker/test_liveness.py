"""Liveness decisions in the broker core, without sockets: a slow worker
(long steps, heartbeats flowing) is never dead; a hung one (heartbeats, no
progress while holding requests) is, and stays on probation until it
progresses; a vanished client's requests are cancelled at once."""

from __future__ import annotations

import functools

from broker.outbox import Side
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import Bye, Cancel, Finished, Heartbeat, Iteration, Loading, Register, Results, Submit
from tests.support import cores
from tests.support.cores import C1, INFO, W1, W2, assigned
from tests.support.messages import envelope


make_core = functools.partial(cores.make_core, heartbeat_interval_s=0.1, worker_liveness_s=0.5,
                              client_liveness_s=100.0, worker_hung_s=2.0)


def finished(sends, client=C1):
    return {f.request_id: f for s in sends if s.identity == client and isinstance(s.message, Results)
            for f in s.message.finished}


def beat(core, w, progress, now):
    out = core.on_backend(w, Heartbeat(progress=progress), now)
    return out + core.tick(now)


def test_slow_step_is_never_hung_and_a_stuck_one_is():
    core = make_core()
    core.on_backend(W1, Register("simulated", 2, 2, INFO, "w1"), 0.0)
    out = core.on_frontend(C1, Submit("simulated", [envelope("a", [1], 5)]), 0.0)
    (spec,) = assigned(out, W1)
    core.on_backend(W1, Heartbeat(progress=10), 0.05)  # the baseline
    # One long step (1.9 s, heartbeats every 0.1 s, progress unchanged): alive.
    t = 0.1
    while t < 1.95:
        beat(core, W1, 10, t)
        t += 0.1
    assert core.counters["workers_lost"] == 0
    # The step completes (progress moves): the hung clock starts again.
    beat(core, W1, 11, 1.95)
    t = 2.0
    while t < 3.9:
        beat(core, W1, 11, t)
        t += 0.1
    assert core.counters["workers_lost"] == 0 and core.workers.get(W1).inflight == {spec.request_id}
    # Stuck past worker_hung_s although it heartbeats: hung, its request requeued.
    out = beat(core, W1, 11, 4.0)
    assert core.counters["workers_hung"] == 1 and core.counters["requeued"] == 1
    assert core.workers.get(W1) is None and len(core.queues["simulated"]) == 1


def test_hung_worker_is_on_probation_until_it_progresses():
    core = make_core()
    core.on_backend(W1, Register("simulated", 4, 4, INFO, "w1"), 0.0)
    core.on_frontend(C1, Submit("simulated", [envelope("a", [1], 5)]), 0.0)
    core.on_backend(W1, Heartbeat(progress=3), 0.1)
    core.on_backend(W1, Heartbeat(progress=3), 2.0)
    core.tick(2.2)
    assert core.counters["workers_hung"] == 1
    # It registers again at once (it heartbeat and was told it is unknown)...
    out = core.on_backend(W1, Register("simulated", 4, 4, INFO, "w1"), 2.3)
    assert assigned(out, W1) == []               # ...but gets nothing while stuck
    out = core.on_backend(W2, Register("simulated", 1, 1, INFO, "w2"), 2.4)
    (spec,) = assigned(out, W2)                  # the healthy worker continues it
    out = core.on_backend(W1, Heartbeat(progress=3), 2.5)
    assert assigned(out, W1) == []
    out = core.on_frontend(C1, Submit("simulated", [envelope("b", [2], 5)]), 2.6)
    assert assigned(out, W1) == [] and len(core.queues["simulated"]) == 1
    # Its stuck step completes: progress moves, it takes requests again.
    out = core.on_backend(W1, Heartbeat(progress=4), 2.7)
    assert [r.params.prompt for r in assigned(out, W1)] == [(2,)]
    assert not core.workers.get(W1).suspect


def test_request_failing_on_max_attempts_workers_ends_with_worker_failed():
    core = make_core(max_attempts=3)
    out = []
    core.on_frontend(C1, Submit("simulated", []), 0.0)
    workers = [f"w{i}".encode() for i in range(3)]
    core.on_backend(workers[0], Register("simulated", 1, 1, INFO, "w0"), 0.0)
    core.on_frontend(C1, Submit("simulated", [envelope("x", [1], 5)]), 0.0)
    t = 0.0
    for i, w in enumerate(workers):
        if i:
            out = core.on_backend(w, Register("simulated", 1, 1, INFO, w.decode()), t)
            assert [r.params.prompt for r in assigned(out, w)] == [(1,)]
        # Two tokens, then it hangs (heartbeats continue, no progress).
        key = core.workers.get(w).inflight.copy().pop()
        core.on_backend(w, Iteration(ids=[key], tokens=[7 + i]), t + 0.1)
        core.on_backend(w, Heartbeat(progress=1), t + 0.2)
        core.on_backend(w, Heartbeat(progress=1), t + 2.0)
        out = core.tick(t + 2.2)
        t += 2.5
    fin = finished(out)
    assert fin["x"].finish_reason is FinishReason.ERROR and fin["x"].code is ErrorCode.WORKER_FAILED
    assert core.counters["requeued"] == 2 and not core.jobs


def test_silent_client_is_ended_in_the_tick_that_notices():
    core = make_core(client_liveness_s=0.5)
    core.on_backend(W1, Register("simulated", 2, 3, INFO, "w1"), 0.0)
    core.on_frontend(C1, Submit("simulated", [envelope(i, [1], 50) for i in range(5)]), 0.0)
    core.on_backend(W1, Heartbeat(progress=0), 0.3)
    assert core.tick(0.4) == [] or core.counters["clients_lost"] == 0
    out = core.tick(0.6)  # silent for longer than client_liveness_s (0.5 s)
    (cancel,) = [s.message for s in out if s.side is Side.BACKEND and isinstance(s.message, Cancel)]
    assert len(cancel.request_ids) == 3                      # the running ones: cancelled at once
    assert len(core.queues["simulated"]) == 0                # the queued ones: removed
    assert core.counters["clients_lost"] == 1 and core.counters["errors"] == 2
    # In case it was only stalled: each request gets one ending, saying why.
    fin = finished(out)
    assert sorted(fin) == list(range(5))
    assert all(f.finish_reason is FinishReason.ERROR and f.code is ErrorCode.CLIENT_SILENT for f in fin.values())
    # The worker frees the slots on its next iteration; the credits come back.
    out = core.on_backend(W1, Iteration(ids=[cancel.request_ids[0]], tokens=[5],
                                        finished=[Finished(k, FinishReason.CANCELLED) for k in cancel.request_ids]), 0.61)
    assert core.workers.get(W1).inflight == set() and not core.jobs
    assert finished(out) == {}                              # nothing more reaches the client
    assert core.counters["errors"] == 5 and core.counters["cancelled"] == 0  # the broker's decision, counted so


def test_cancel_crossing_a_migration_or_the_end_gives_exactly_one_ending():
    core = make_core()
    core.on_backend(W1, Register("simulated", 2, 2, INFO, "w1"), 0.0)
    out = core.on_frontend(C1, Submit("simulated", [envelope("a", [1], 50), envelope("b", [2], 50)]), 0.0)
    ka, kb = (s.request_id for s in assigned(out, W1))
    core.on_backend(W1, Iteration(ids=[ka, kb], tokens=[3, 4]), 0.1)
    # Cancel both; the cancel for "b" crosses its natural end on the worker.
    out = core.on_frontend(C1, Cancel(["a", "b"]), 0.2)
    assert finished(out) == {}                    # running: the worker reports the ending
    out = core.on_backend(W1, Iteration(ids=[kb], tokens=[0], finished=[Finished(kb, FinishReason.STOP)]), 0.25)
    assert {k: f.finish_reason for k, f in finished(out).items()} == {"b": FinishReason.STOP}
    # The worker dies before "a"'s cancel lands: it ends cancelled, not requeued.
    core.on_backend(W2, Register("simulated", 2, 2, INFO, "w2"), 0.3)
    out = core.on_backend(W1, Heartbeat(progress=1), 0.3) + core.tick(1.0)
    assert {k: f.finish_reason for k, f in finished(out).items()} == {"a": FinishReason.CANCELLED}
    assert assigned(out, W2) == [] and core.counters["requeued"] == 0 and not core.jobs
    # Late output for either is dropped; a repeated cancel changes nothing.
    out = core.on_backend(W2, Iteration(ids=[ka], tokens=[9], finished=[Finished(ka, FinishReason.CANCELLED)]), 1.1)
    out += core.on_frontend(C1, Cancel(["a", "b"]), 1.2)
    assert finished(out) == {}


def test_after_a_restart_requests_wait_for_workers_to_register_within_the_grace():
    core = make_core(register_grace_s=3.0)
    # A client resubmits before any worker has re-registered with this new broker.
    out = core.on_frontend(C1, Submit("simulated", [envelope("r", [1], 5, resume_tokens=[7, 8])]), 0.1)
    out += core.on_frontend(C1, Submit("other", [envelope("o", [1], 5)]), 0.2)
    assert finished(out) == {} and core.status(0.2).models["simulated"].queued == 1
    out = core.on_backend(W1, Register("simulated", 2, 2, INFO, "w1"), 0.5)
    (spec,) = assigned(out, W1)
    assert spec.resume_tokens == (7, 8)               # continues where the old broker stopped
    # Past the grace a model nobody registered is an error, queued or new.
    out = core.tick(3.1)
    assert finished(out)["o"].code is ErrorCode.UNKNOWN_MODEL
    out = core.on_frontend(C1, Submit("other", [envelope("o2", [1], 5)]), 3.2)
    assert finished(out)["o2"].code is ErrorCode.UNKNOWN_MODEL
    assert list(core.jobs) == [spec.request_id]


def test_requests_for_a_model_on_demand_wait_past_the_grace_and_status_lists_it():
    """``on_demand_models`` (issue 34): a supervisor loads them when asked for, so their requests wait
    in the queue however long no worker serves them (their deadlines still apply), and ``status`` lists
    each one, with ``workers`` 0 while it is not loaded: the demand the supervisor reads."""
    core = make_core(register_grace_s=1.0, on_demand_models=("lazy",))
    assert core.status(0.0).models["lazy"] == (0, 0, 0, 0, 0, 0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("l", [1], 5)]), 0.1)
    out += core.on_frontend(C1, Submit("other", [envelope("o", [1], 5)]), 0.1)
    out += core.tick(5.0)  # past the grace: the other model is unknown, the one on demand waits
    assert set(finished(out)) == {"o"} and core.status(5.0).models["lazy"].queued == 1
    out = core.on_backend(W1, Register("lazy", 2, 2, INFO, "w1"), 6.0)
    (spec,) = assigned(out, W1)
    assert spec.request_id is not None and core.status(6.0).models["lazy"].workers == 1


def test_a_model_on_demand_whose_loading_worker_says_goodbye_fails_its_waiting_requests():
    """A worker that stops while loading a model on demand failed to load it (its supervisor stops
    a loading worker only when everything stops): the requests waiting for it end ``worker_failed``
    with the worker's reason, rather than waiting forever while their demand reloads it in a loop.
    One that dies silently says nothing: its requests wait for the next load (they count it as a
    failed attempt: :func:`test_a_model_on_demand_whose_loads_die_silently_fails_its_requests_after_max_attempts`)."""
    core = make_core(on_demand_models=("lazy", "alias"))
    core.on_backend(W1, Loading("lazy", "w1", ("alias",)), 0.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("a", [1], 5)]), 0.1)
    out += core.on_frontend(C1, Submit("alias", [envelope("b", [1], 5)]), 0.1)
    assert finished(out) == {}
    out = core.on_backend(W1, Bye("cannot load model 'lazy': not a GGUF file", load_failed=True), 0.2)
    ended = finished(out)
    assert set(ended) == {"a", "b"} and {f.code for f in ended.values()} == {ErrorCode.WORKER_FAILED}
    assert "not a GGUF file" in ended["a"].message and core.status(0.2).models["lazy"].queued == 0
    # silent: the next worker's load is awaited
    core.on_backend(W2, Loading("lazy", "w2"), 1.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("c", [1], 5)]), 1.1) + core.tick(30.0)
    assert finished(out) == {} and core.status(30.0).models["lazy"].queued == 1


def test_a_loading_worker_told_to_stop_leaves_its_requests_waiting_for_the_next_load():
    """A worker stopped by a signal while it loads (its goodbye without ``load_failed``: a break-it
    pass sent SIGTERM to the worker loading smollm2-135m on demand, and its waiting request got 500
    worker_failed "the worker loading model ... stopped (worker stopping); ... fix the model or remove
    it", the model marked failed) is no fault of the model's: on demand its requests wait for the
    next load; a model of a fixed set that nobody else serves or loads ends ``unknown_model`` past
    the grace, as when its loader falls silent, saying it was stopped."""
    core = make_core(on_demand_models=("lazy",))
    core.on_backend(W1, Loading("lazy", "w1"), 0.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("a", [1], 5)]), 0.1)
    out += core.on_backend(W1, Bye("worker stopping"), 0.2)
    assert finished(out) == {} and core.status(0.2).models["lazy"].queued == 1
    assert core.status(0.2).on_demand == {} or not core.status(0.2).on_demand["lazy"].failed
    out = core.on_backend(W2, Register("lazy", 2, 2, INFO, "w2"), 1.0)  # the next load serves it
    (spec,) = assigned(out, W2)
    assert spec.request_id is not None and core.status(1.0).models["lazy"].queued == 0
    fixed = make_core(register_grace_s=0)
    fixed.on_backend(W1, Loading("m", "w1"), 0.0)
    out = fixed.on_frontend(C1, Submit("m", [envelope("b", [1], 5)]), 0.1)
    out += fixed.on_backend(W1, Bye("worker stopping"), 0.2)
    (end,) = finished(out).values()
    assert end.code is ErrorCode.UNKNOWN_MODEL and "was stopped before it loaded it" in end.message


def _silent_load(core, worker, t, model="lazy"):
    """``worker`` starts loading ``model`` at ``t`` and dies silently (SIGKILL, the OOM killer): the
    sends of the tick that finds it silent past its liveness window (0.5 s)."""
    core.on_backend(worker, Loading(model, worker.decode()), t)
    return core.tick(t + 0.6)


def test_a_model_on_demand_whose_loads_die_silently_fails_its_requests_after_max_attempts():
    """A worker killed while it loads a model on demand (SIGKILL, the OOM killer) says no goodbye; the
    broker drops it once it is silent past its liveness window. Each request waiting for the model then
    counts a failed attempt, as one lost with a worker does: one frozen load (killed and loaded again by
    its supervisor) still serves it, and at ``max_attempts`` (3) it ends ``worker_failed`` saying the
    loader died or was killed (before: it waited forever, and its demand reloaded the model each time).
    A request that came after the first death counts only the loads it waited through."""
    core = make_core(on_demand_models=("lazy", "alias"))
    core.on_backend(W1, Loading("lazy", "w1", ("alias",)), 0.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("a", [1], 5)]), 0.1)
    out += core.on_frontend(C1, Submit("alias", [envelope("b", [1], 5)]), 0.1)
    out += core.tick(0.7)  # w1 silent past its window: a first failed load
    assert finished(out) == {} and core.status(0.7).models["lazy"].queued == 2
    out = core.on_frontend(C1, Submit("lazy", [envelope("c", [1], 5)]), 0.8)
    out += _silent_load(core, W2, 1.0)  # the second
    assert finished(out) == {} and core.status(1.6).models["lazy"].queued == 3
    out = _silent_load(core, W1, 2.0)  # the third: a and b end, c has waited through two
    ended = finished(out)
    assert set(ended) == {"a", "b"} and {f.code for f in ended.values()} == {ErrorCode.WORKER_FAILED}
    assert {f.finish_reason for f in ended.values()} == {FinishReason.ERROR}
    assert "the worker loading model 'lazy' (worker-1) fell silent while loading it" in ended["a"].message
    assert "died or was killed (out of memory?)" in ended["a"].message and "3 loads" in ended["a"].message
    assert core.status(2.6).models["lazy"].queued == 1
    out = _silent_load(core, W2, 3.0)
    assert set(finished(out)) == {"c"} and core.status(3.6).models["lazy"].queued == 0
    assert core.counters["errors"] == 3


def test_a_silent_loader_costs_no_attempt_while_another_worker_serves_or_loads_its_model():
    """Only a load that leaves the model with no worker serving or loading it costs the waiting
    requests an attempt; with ``max_attempts`` 1 that load ends them at once. A model that is not on
    demand is untouched (past the grace, a model never served ends ``unknown_model`` as before)."""
    core = make_core(on_demand_models=("lazy",), max_attempts=1)
    core.on_backend(W1, Loading("lazy", "w1"), 0.0)
    core.on_backend(W2, Loading("lazy", "w2"), 0.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("a", [1], 5)]), 0.1)
    out += core.on_backend(W2, Heartbeat(), 0.5) + core.tick(0.7)  # w1 silent, w2 still loading
    assert finished(out) == {} and core.status(0.7).models["lazy"].queued == 1
    out = core.tick(1.2)  # w2 silent too: nobody loads it now
    assert finished(out)["a"].code is ErrorCode.WORKER_FAILED
    core.on_backend(W1, Register("lazy", 1, 1, INFO, "w1"), 2.0)  # served: a silent loader beside it costs nothing
    core.on_backend(W1, Heartbeat(), 2.5)
    core.on_backend(W2, Loading("lazy", "w2"), 2.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("b", [1], 5), envelope("c", [1], 5)]), 2.1)
    out += core.on_backend(W1, Heartbeat(), 2.6) + core.tick(2.7)
    assert finished(out) == {} and len(core.queues["lazy"]) == 1
    other = make_core(register_grace_s=1.0, max_attempts=1)
    other.on_backend(W1, Loading("fixed", "w1"), 0.0)
    out = other.on_frontend(C1, Submit("fixed", [envelope("f", [1], 5)]), 0.1) + other.tick(0.7)
    assert finished(out) == {}  # within the grace: it waits
    assert finished(other.tick(1.1))["f"].code is ErrorCode.UNKNOWN_MODEL


def test_a_model_on_demand_whose_loader_cannot_register_fails_its_waiting_requests():
    """A worker loading a model on demand whose frame limit cannot hold the broker's welcome can never
    register (it tries again and is refused again): the requests waiting for the model end
    ``worker_failed`` saying why, as on a goodbye (before: they waited forever)."""
    many = tuple(f"model-{i:03d}-" + "x" * 60 for i in range(20))  # (a welcome of some 1.5 KiB)
    core = make_core(on_demand_models=("lazy",) + many)
    core.on_backend(W1, Loading("lazy", "w1"), 0.0)
    out = core.on_frontend(C1, Submit("lazy", [envelope("a", [1], 5)]), 0.1)
    out += core.on_backend(W1, Register("lazy", 2, 2, INFO, "w1", max_message_bytes=1024), 0.2)
    (f,) = finished(out).values()
    assert f.code is ErrorCode.WORKER_FAILED and "cannot register" in f.message
    assert core.status(0.2).models["lazy"].queued == 0


def test_status_names_each_worker_loading_until_it_registers_or_falls_silent():
    """``status.loading_workers`` names each worker loading (its model): what the launcher watches to
    kill one frozen in its load. A registered worker is listed in ``workers`` instead; a loading one
    the broker drops as silent is in neither (the launcher then kills it)."""
    core = make_core(on_demand_models=("lazy",))
    core.on_backend(W1, Loading("lazy", "w1"), 0.0)
    core.on_backend(W2, Loading("simulated", "w2"), 0.0)
    assert core.status(0.1).loading_workers == {"w1": "lazy", "w2": "simulated"}
    core.on_backend(W2, Register("simulated", 2, 2, INFO, "w2"), 0.2)
    st = core.status(0.2)
    assert st.loading_workers == {"w1": "lazy"} and [w.name for w in st.workers] == ["w2"]
    core.on_backend(W2, Heartbeat(), 29.0)
    core.tick(30.0)  # w1 silent past its liveness window
    assert core.status(30.0).loading_workers == {}


def test_slotserve_status_lists_a_worker_loading(monkeypatch):
    """``slotserve status`` shows each worker still loading its model (and --json its map)."""
    import json

    from click.testing import CliRunner

    import client
    from protocol.messages import ModelStatus, Status
    from slotserve.cli import main

    st = Status("b", 1.0, {"lazy": ModelStatus(1, 0, 0, 0, 0, 1)}, (), 0, {}, {}, {"vm:42": "lazy"})

    class _Client:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def status(self, timeout_s: float) -> Status:
            return st

    monkeypatch.setattr(client, "Client", _Client)
    r = CliRunner().invoke(main, ["status"])
    assert r.exit_code == 0 and any(line.split() == ["worker", "vm:42", "lazy", "loading"]
                                    for line in r.output.splitlines()), r.output
    r = CliRunner().invoke(main, ["status", "--json"])
    assert json.loads(r.output)["loading_workers"] == {"vm:42": "lazy"}
