"""Blast radius, kind "a timeout on one side must follow from what the other
side promised" (issue 10, item 11): workers and clients heartbeat at the
interval the broker announces in its welcome (whatever their own setting),
so the broker's liveness windows -- refused at config time when shorter
than 3 of those intervals -- never declare a live peer dead: not an idle
worker, not a worker in a long step, not a client waiting for a long
request. And every ending the broker decides carries a code that says why
(``client_silent``, ``slow_consumer``, ``worker_failed``, ``unknown_model``,
``too_large``, ``internal``; a deadline is ``finish_reason`` ``deadline``):
never ``cancelled`` with no error."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import zmq
from click.testing import CliRunner

from broker.config import BrokerConfig
from broker.outbox import Side
from client import Client
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.framing import Refused
from protocol.messages import (
    Bye, Finished, Heartbeat, Iteration, Loading, ModelInfo, Register, Results, Submit,
)
from slotserve.cli import main
from tests.support import cores
from tests.support.messages import envelope
from tests.support.waits import Deadline

SLOTSERVE = [sys.executable, "-m", "slotserve"]


def free_endpoint() -> str:
    s = zmq.Context.instance().socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:*")
    ep = s.getsockopt(zmq.LAST_ENDPOINT).decode()
    s.close(0)
    return ep


def test_the_issues_short_windows_with_a_slow_worker_and_waiting_clients_lose_nobody():
    frontend, backend = free_endpoint(), free_endpoint()
    broker = subprocess.Popen(SLOTSERVE + ["broker", "--frontend", frontend, "--backend", backend,
                                           "--heartbeat-interval-s", "0.1", "--worker-liveness-s", "0.5",
                                           "--client-liveness-s", "0.5"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = subprocess.Popen(SLOTSERVE + ["worker", "--broker", backend, "--step-delay-ms", "500", "--slots", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Clients whose own heartbeat period (1 s, 5 s) is longer than the broker's window.
        with Client(frontend, connect_timeout_s=30) as c, \
                Client(frontend, heartbeat_interval_s=5.0, name="slow-beat") as c2:
            c.wait_for_model(60)
            c2.wait_for_model(60)  # each client learns the model from its own welcome (no model= given)
            hs = [cl.submit_request([i + 1, 2], 4, stop_token=None) for i in range(8) for cl in (c, c2)]
            c.run(timeout=60)  # 4 steps of 500 ms (and more: 16 requests on 8 slots), the clients only waiting
            c2.run(timeout=60)
            assert all(h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 4 for h in hs), \
                [(h.finish_reason, h.error) for h in hs]
            # Idle now, for three liveness windows: nobody is declared dead.
            idle = Deadline(1.5)
            while not idle.passed():
                st = c.status()
                assert st.counters["workers_lost"] == 0 and len(st.workers) == 1, st
            assert st.counters["clients_lost"] == 0 and st.counters["errors"] == 0
    finally:
        for p in (worker, broker):
            p.terminate()
        for p in (worker, broker):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            p.stderr.close()


def test_a_liveness_window_shorter_than_three_heartbeats_is_refused():
    with pytest.raises(ValueError, match="worker_liveness_s .* at least 3 heartbeat intervals"):
        BrokerConfig(heartbeat_interval_s=1.0, worker_liveness_s=2.0)
    with pytest.raises(ValueError, match="client_liveness_s"):
        BrokerConfig(heartbeat_interval_s=1.0, client_liveness_s=2.9)
    BrokerConfig(heartbeat_interval_s=0.1, worker_liveness_s=0.3, client_liveness_s=0.3)  # exactly 3: fine
    r = CliRunner().invoke(main, ["broker", "--heartbeat-interval-s", "1", "--client-liveness-s", "2"])
    assert r.exit_code == 2 and "client_liveness_s (2 s) must be at least 3 heartbeat intervals" in r.output


# ---------------------------------------------------------------------- endings the broker decides

C, W = b"client", b"worker"
INFO = ModelInfo(1000, None, (0,), False)


make_core = functools.partial(cores.make_core, identity="b", heartbeat_interval_s=0.1, worker_liveness_s=0.5,
                              client_liveness_s=0.5, register_grace_s=0.0, max_attempts=1)


def endings(sends) -> dict:
    out = {}
    for s in sends:
        if s.side is Side.FRONTEND and isinstance(s.message, Results):
            out.update({f.request_id: (f.finish_reason, f.code) for f in s.message.finished})
        elif s.side is Side.FRONTEND and hasattr(s.message, "request_ids") and hasattr(s.message, "code"):
            out.update({r: (FinishReason.ERROR, s.message.code) for r in s.message.request_ids})
    return out


def assert_says_why(found: dict) -> None:
    for rid, (reason, code) in found.items():
        assert reason is FinishReason.DEADLINE or (reason is FinishReason.ERROR and code is not None), (rid, reason)


def test_every_ending_the_broker_decides_carries_a_code():
    seen = {}
    # A silent client: queued and running requests.
    core = make_core()
    core.on_backend(W, Register("simulated", 1, 1, INFO, "w"), 0.0)
    core.on_frontend(C, Submit("simulated", [envelope("run", [1], 9), envelope("queued", [2], 9)]), 0.0)
    core.on_backend(W, Heartbeat(progress=0), 0.4)
    out = core.tick(0.6)
    seen.update(endings(out))
    assert seen["run"] == seen["queued"] == (FinishReason.ERROR, ErrorCode.CLIENT_SILENT)
    # A stalled client past the bound.
    core = make_core()
    core.on_backend(W, Register("simulated", 1, 1, INFO, "w"), 0.0)
    core.on_frontend(C, Submit("simulated", [envelope("slow", [1], 9)]), 0.0)
    seen.update(endings(core.client_unreachable(C, ErrorCode.SLOW_CONSUMER)))
    assert seen["slow"] == (FinishReason.ERROR, ErrorCode.SLOW_CONSUMER)
    # A worker that dies (max_attempts 1), a queued deadline, an unknown model, a loader that leaves.
    core = make_core()
    core.on_backend(W, Register("simulated", 1, 1, INFO, "w"), 0.0)
    core.on_backend(b"loader", Loading("big", "l"), 0.0)
    out = core.on_frontend(C, Submit("simulated", [envelope("lost", [1], 9), envelope("late", [2], 9, timeout_s=0.2)]),
                           0.0)
    out += core.on_frontend(C, Submit("nope", [envelope("unknown", [1], 2)]), 0.0)
    out += core.on_frontend(C, Submit("big", [envelope("waits", [1], 2)]), 0.0)
    out += core.on_backend(b"loader", Bye("cannot load"), 0.1)
    out += core.on_frontend(C, Heartbeat(), 0.3) + core.tick(0.3)
    out += core.on_frontend(C, Heartbeat(), 0.7) + core.tick(0.7)  # the worker fell silent
    found = endings(out)
    assert found["lost"] == (FinishReason.ERROR, ErrorCode.WORKER_FAILED)
    assert found["late"] == (FinishReason.DEADLINE, None)
    assert found["unknown"] == found["waits"] == (FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL)
    seen.update(found)
    # A result the broker cannot send; a message whose handling failed.
    core = make_core()
    core.on_backend(W, Register("simulated", 2, 2, INFO, "w"), 0.0)
    core.on_frontend(C, Submit("simulated", [envelope("big", [1], 9), envelope("bug", [2], 9)]), 0.0)
    part = Results(ids=["big"], tokens=[5])
    out = core.undeliverable(Side.FRONTEND, C, [Refused(part, ErrorCode.TOO_LARGE, "too large")], 0.1)
    out += core.handling_failed(Side.FRONTEND, C, Submit("simulated", [envelope("bug", [2], 9)]),
                                RuntimeError("x"), 0.1)
    keys = sorted(core.workers.get(W).inflight)
    out += core.on_backend(W, Iteration(finished=[Finished(k, FinishReason.CANCELLED) for k in keys]), 0.2)
    found = endings(out)
    assert found == {"big": (FinishReason.ERROR, ErrorCode.TOO_LARGE), "bug": (FinishReason.ERROR, ErrorCode.INTERNAL)}
    seen.update(found)
    # A worker's message the broker could not decode.
    core = make_core()
    core.on_backend(W, Register("simulated", 1, 1, INFO, "w"), 0.0)
    core.on_frontend(C, Submit("simulated", [envelope("garbled", [1], 9)]), 0.0)
    (key,) = core.workers.get(W).inflight
    found = endings(core.on_backend_error(W, ProtocolError(ErrorCode.MALFORMED, "bad"), [key], 0.1))
    assert found == {"garbled": (FinishReason.ERROR, ErrorCode.MALFORMED)}
    seen.update(found)
    assert_says_why(seen)
    assert core.counters["cancelled"] == 0


def test_the_broker_heartbeats_workers_still_loading_their_model():
    """A loading worker hears the broker's heartbeat like a registered one
    (else it would take the broker for lost and announce itself again every
    broker liveness window while a long load runs)."""
    core = make_core()
    core.on_backend(b"loader", Loading("big", "l"), 0.0)
    core.on_backend(W, Register("simulated", 1, 1, INFO, "w"), 0.0)
    beats = {s.identity for s in core.tick(0.2) if s.side is Side.BACKEND and isinstance(s.message, Heartbeat)}
    assert beats == {b"loader", W}


def test_an_error_ending_that_cannot_be_sent_is_given_up_not_retried():
    """An undeliverable part holding an ending that is itself an error (the
    broker's refusal of a request it no longer holds): nothing more is sent
    for it (another error ending could fail the same way, forever) and the
    counters stay as they were; a non-error ending in such a part becomes an
    error ending, counted once."""
    core = make_core()
    core.on_backend(W, Register("simulated", 2, 2, INFO, "w"), 0.0)
    core.on_frontend(C, Submit("simulated", [envelope("a", [1], 9), envelope("b", [2], 9)]), 0.0)
    keys = sorted(core.workers.get(W).inflight)
    core.on_backend(W, Iteration(finished=[Finished(keys[0], FinishReason.ERROR, ErrorCode.INTERNAL, "x"),
                                           Finished(keys[1], FinishReason.LENGTH)]), 0.1)
    before = dict(core.counters)
    assert before["errors"] == 1 and before["completed"] == 1
    bad = Results(finished=[Finished("a", FinishReason.ERROR, ErrorCode.INTERNAL, "x")])
    assert core.undeliverable(Side.FRONTEND, C, [Refused(bad, ErrorCode.TOO_LARGE, "too large")], 0.2) == []
    assert dict(core.counters) == before
    ok = Results(finished=[Finished("b", FinishReason.LENGTH)])
    found = endings(core.undeliverable(Side.FRONTEND, C, [Refused(ok, ErrorCode.TOO_LARGE, "too large")], 0.2))
    assert found == {"b": (FinishReason.ERROR, ErrorCode.TOO_LARGE)}
    assert core.counters["completed"] == 0 and core.counters["errors"] == 2
