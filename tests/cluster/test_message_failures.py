"""Blast radius, kind "one message's failure ends only the requests it
concerns" (issue 10, item 1, the I/O half): whatever goes wrong with one
message -- the encoder refuses it, a frame from the peer cannot be decoded,
handling it raises (a bug), a reply nobody expected arrives -- the loop that
met it ends just the requests that message names, each with an error code
and a message on its handle, and keeps serving every other request. Members:
the client's I/O thread (encoding a batch, reading a frame, handling results
there) and its callback thread, the client's connection itself failing (every
request ends, none waits), the broker's loop (handling a client's message, a
worker's message, encoding a reply, a housekeeping pass) and the worker's I/O
loop (handling an assignment). Failures are injected with monkeypatch into
real sockets and threads; each test then checks the neighbours still run."""

from __future__ import annotations

import msgpack
import pytest

import protocol.framing
from broker.clients import ClientHandler
from broker.core import BrokerCore
from broker.workers import WorkerHandler
from client import Client
from client.client import Client as ClientClass
from client.connection import Connection
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import (
    PROTOCOL_VERSION, Assign, Cancel, Error, Finished, ModelInfo, Results, Status, Submit, Welcome,
)
from tests.support.cluster import ThreadCluster, fake_broker
from tests.support.reference import simulated_reference
from tests.support.waits import wait_until
from worker.process import WorkerProcess

POISON = "poison"
OK_ENDINGS = (FinishReason.STOP, FinishReason.LENGTH)


def names(msg, rid) -> bool:
    return rid in protocol.framing.request_ids(msg)


@pytest.fixture
def cluster():
    with ThreadCluster(heartbeat_interval_s=0.2, worker_liveness_s=2.0) as c:
        c.add_worker(num_slots=4)
        yield c


def run_neighbours(c: Client, n: int = 5):
    """Submit ``n`` plain requests (some with callbacks) and check each gets the engine's tokens."""
    hs = [c.submit_request([i + 1, 7], 6, callback=(lambda seq: None) if i % 2 else None) for i in range(n)]
    c.run(timeout=30)
    for i, h in enumerate(hs):
        assert h.finish_reason in OK_ENDINGS and h.tokens == simulated_reference([i + 1, 7], 6)[0], (i, h.error)


# ---------------------------------------------------------------------- the client


def test_client_encoder_failure_ends_only_that_request_in_its_batch(cluster, monkeypatch):
    real = protocol.framing.encode

    def encode(msg):
        if isinstance(msg, Submit) and names(msg, POISON):
            raise OverflowError("int too big to convert")  # what msgpack raised in the issue
        return real(msg)

    monkeypatch.setattr(protocol.framing, "encode", encode)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        # One burst: the poisoned request and its neighbours leave in the same submit.
        hs = [c.submit_request([i + 1, 7], 6, request_id=POISON if i == 2 else i) for i in range(6)]
        c.run(timeout=30)
        bad = hs[2]
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.BAD_REQUEST
        assert "cannot be encoded" in bad.error.message and "OverflowError" in bad.error.message
        assert all(h.finish_reason in OK_ENDINGS for i, h in enumerate(hs) if i != 2)
        run_neighbours(c)  # the connection still works


def idle(c: Client) -> bool:
    m = c.status().models["simulated"]
    return m.running == 0 and m.queued == 0


def test_client_handling_results_on_the_io_thread_fails_only_that_request(cluster, monkeypatch):
    """(The failing message names only the poisoned request; a message naming
    several would end each of them, and only them.)"""
    real = ClientClass._apply_plain
    fired = []

    def apply_plain(self, msg):
        if names(msg, POISON) and not fired:
            fired.append(msg)
            raise KeyError("a bug")
        return real(self, msg)

    monkeypatch.setattr(ClientClass, "_apply_plain", apply_plain)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        bad = c.submit_request([3, 4], 6, request_id=POISON)
        bad.result(10)
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.INTERNAL
        assert "KeyError" in bad.error.message
        wait_until(lambda: idle(c), 10, "the broker to forget it")
        run_neighbours(c)


def test_client_handling_results_on_the_callback_thread_fails_only_that_request(cluster, monkeypatch):
    real = ClientClass._on_results
    fired = []

    def on_results(self, msg):
        if names(msg, POISON) and not fired:
            fired.append(msg)
            raise RuntimeError("a bug")
        return real(self, msg)

    monkeypatch.setattr(ClientClass, "_on_results", on_results)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        seen = []
        bad = c.submit_request([3, 4], 6, callback=seen.append, request_id=POISON)
        wait_until(bad.done, 10, "the poisoned request to end")
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.INTERNAL
        assert len(seen) == 1  # its callback still ran, once
        wait_until(lambda: idle(c), 10, "the broker to forget it")
        run_neighbours(c)


WELCOME = Welcome("fake-broker", 0.5, {"simulated": ModelInfo(1000, None, (0,), False)})


def test_client_undecodable_frame_ends_the_requests_it_names_and_cancels_them():
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        a, b = c.submit_request([1], 3, request_id="a"), c.submit_request([2], 3, request_id="b")
        fb.take(Submit)
        # A results frame that does not decode (a token that is not an int), naming "a".
        fb.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "results", "ids": ["a"], "tokens": ["x"]}))
        fb.send(Results(ids=["b"], tokens=[9], finished=[Finished("b", FinishReason.LENGTH)]))
        wait_until(lambda: a.done() and b.done(), 10, "both requests to end")
        assert a.finish_reason is FinishReason.ERROR and a.error.code is ErrorCode.MALFORMED
        assert b.finish_reason is FinishReason.LENGTH and b.tokens == [9]
        assert fb.take(Cancel).request_ids == ("a",)  # the broker is told to stop it


@pytest.mark.parametrize("failure", ["handling raises", "undecodable frame"])
def test_client_a_failed_message_is_not_overtaken_by_a_later_ending(monkeypatch, failure):
    """A request whose message failed on the I/O thread ends with that
    failure even when a later frame brings its normal ending before the
    callback thread got to it (that frame is applied on the I/O thread; the
    tokens of the failed one are lost, so ending ``length`` would hide a gap).
    The callback thread is held busy (a blocking ``on_token``) meanwhile."""
    import threading

    gate = threading.Event()
    real = ClientClass._apply_plain

    def apply_plain(self, msg):
        if names(msg, "a") and not msg.finished:
            raise KeyError("a bug")
        return real(self, msg)

    if failure == "handling raises":
        monkeypatch.setattr(ClientClass, "_apply_plain", apply_plain)
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        busy = c.submit_request([1], 3, on_token=lambda t: gate.wait(10), request_id="busy")
        a = c.submit_request([2], 3, request_id="a")
        fb.take(Submit)
        fb.send(Results(ids=["busy"], tokens=[7]))  # the callback thread blocks on it
        if failure == "handling raises":
            fb.send(Results(ids=["a"], tokens=[8]))
        else:
            fb.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "results", "ids": ["a"], "tokens": ["x"]}))
        fb.send(Results(ids=["a"], tokens=[9], finished=[Finished("a", FinishReason.LENGTH)]))
        wait_until(a.done, 10, "the later ending to be applied on the I/O thread")
        gate.set()
        fb.send(Results(finished=[Finished("busy", FinishReason.LENGTH)]))
        busy.result(10)
        code = ErrorCode.INTERNAL if failure == "handling raises" else ErrorCode.MALFORMED
        assert a.finish_reason is FinishReason.ERROR and a.error.code is code, (a.finish_reason, a.error)
        assert busy.finish_reason is FinishReason.LENGTH and busy.tokens == [7]


def test_client_ignores_replies_nobody_expected_and_keeps_working():
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        h = c.submit_request([1], 2, request_id=1)
        fb.take(Submit)
        fb.send(Results(ids=["ghost"], tokens=[5], finished=[Finished("ghost", FinishReason.STOP)]))
        fb.send(Error(ErrorCode.QUEUE_FULL, "not yours", ("nobody", 77)))
        fb.send(Status("x", 1.0, {}, (), 0, {}))               # a status nobody asked for
        fb.send(Welcome("fake-broker", 0.5, {}))             # models changed under it
        fb.send(Results(ids=[1, 1], tokens=[4, 5], finished=[Finished(1, FinishReason.LENGTH)]))
        assert h.result(10) == [1, 4, 5] and h.finish_reason is FinishReason.LENGTH
        fb.send(Results(finished=[Finished(1, FinishReason.STOP)]))  # a second ending: ignored
        h2 = c.submit_request([2], 1, request_id=2)
        fb.take(Submit)
        fb.send(Results(ids=[2], tokens=[3], finished=[Finished(2, FinishReason.LENGTH)]))
        assert h2.result(10) == [2, 3] and h.finish_reason is FinishReason.LENGTH


def test_client_connection_failure_ends_every_request_and_refuses_new_ones(monkeypatch):
    def receive(self, sock):
        raise RuntimeError("socket broke")

    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        seen = []
        hs = [c.submit_request([i + 1], 3, callback=seen.append) for i in range(3)]
        fb.take(Submit)
        monkeypatch.setattr(Connection, "_receive", receive)  # the next frame kills the loop
        fb.send(Results(ids=[0], tokens=[1]))
        wait_until(lambda: all(h.done() for h in hs), 10, "every request to end")
        assert all(h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.BROKER_UNAVAILABLE
                   for h in hs)
        assert len(seen) == 3
        with pytest.raises(RuntimeError, match="connection failed"):
            c.submit_request([1], 1)


# ---------------------------------------------------------------------- the broker


def test_broker_handling_a_client_message_fails_only_its_requests(cluster, monkeypatch):
    real = ClientHandler.submit

    def submit(self, cs, msg, now, out):
        if names(msg, POISON):
            raise ZeroDivisionError("a bug")
        return real(self, cs, msg, now, out)

    monkeypatch.setattr(ClientHandler, "submit", submit)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        bad = c.submit_request([5], 4, request_id=POISON)
        assert bad.result(10) == [5] and bad.error.code is ErrorCode.INTERNAL
        assert "ZeroDivisionError" in bad.error.message
        run_neighbours(c)
        assert c.status().counters["internal_errors"] == 1


def test_broker_handling_a_worker_message_fails_only_its_requests(cluster, monkeypatch):
    real = WorkerHandler.iteration
    poisoned = []

    def iteration(self, w, msg, now, out):
        keys = set(protocol.framing.request_ids(msg))
        if any(self._jobs.by_key[k].rid == POISON for k in keys if k in self._jobs.by_key):
            poisoned.append(msg)
            raise ValueError("a bug")
        return real(self, w, msg, now, out)

    monkeypatch.setattr(WorkerHandler, "iteration", iteration)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        bad = c.submit_request([5], 50, request_id=POISON, stop_token=None)
        bad.result(10)
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.INTERNAL
        run_neighbours(c)  # the worker's other requests, and the worker, carry on
        st = c.status()
        assert st.models["simulated"].running == 0 and st.counters["workers_lost"] == 0
        assert len(poisoned) >= 1


def test_broker_reply_that_cannot_be_encoded_fails_only_its_request(cluster, monkeypatch):
    real = protocol.framing.encode
    import broker.server

    def encode(msg):
        if isinstance(msg, Results) and POISON in msg.ids:  # its tokens; its error ending can still go
            raise TypeError("cannot serialize")
        return real(msg)

    monkeypatch.setattr(protocol.framing, "encode", encode)
    monkeypatch.setattr(broker.server, "encode", encode)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        bad = c.submit_request([5], 4, request_id=POISON)
        run_neighbours(c)
        bad.result(10)
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.BAD_REQUEST
        assert "TypeError" in bad.error.message


def test_broker_housekeeping_failure_is_retried_and_serving_goes_on(cluster, monkeypatch):
    real = BrokerCore.tick
    failed = []

    def tick(self, now):
        if not failed:
            failed.append(now)
            raise RuntimeError("a bug")
        return real(self, now)

    monkeypatch.setattr(BrokerCore, "tick", tick)
    with Client(cluster.frontend) as c:
        wait_until(lambda: failed, 10, "a housekeeping pass")
        c.wait_for_model(10)
        run_neighbours(c)
        assert c.status().counters["internal_errors"] == 1


# ---------------------------------------------------------------------- the worker


def test_worker_handling_an_assignment_fails_only_its_requests(cluster, monkeypatch):
    real = WorkerProcess.assign

    def assign(self, entries):
        if any(e.params.prompt == (999,) for e in entries):
            raise MemoryError("a bug")
        return real(self, entries)

    monkeypatch.setattr(WorkerProcess, "assign", assign)
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        bad = c.submit_request([999], 4)
        bad.result(10)
        assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.INTERNAL
        assert "MemoryError" in bad.error.message
        run_neighbours(c)
        assert c.status().counters["workers_lost"] == 0
        assert all(w.thread.is_alive() for w in cluster.workers)


def test_worker_assign_frame_it_cannot_decode_refuses_only_its_requests():
    """The broker->worker direction of a frame the receiver refuses: an
    ``assign`` that does not decode at the worker ends the requests it named
    (the worker answers with their endings); the others run."""
    from broker.outbox import Side

    with ThreadCluster(heartbeat_interval_s=0.2, worker_liveness_s=2.0) as cl:
        cl.add_worker(num_slots=4)
        with Client(cl.frontend) as c:
            c.wait_for_model(10)
            server = cl.server
            real_send = server._send

            def send(side, identity, data, msg):
                if side is Side.BACKEND and isinstance(msg, Assign) and any(
                        e.params.prompt == (999,) for e in msg.requests):
                    data = data.replace(b"\xa6assign", b"\xa6assigN")  # an op the worker does not know
                return real_send(side, identity, data, msg)

            server._send = send
            bad = c.submit_request([999], 4)
            bad.result(10)
            assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.UNKNOWN_OP
            run_neighbours(c)
