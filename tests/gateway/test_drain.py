"""Graceful drain (issue 22, item 1) of the gateway itself: :func:`gateway.run`
on a thread of the test, stopped by its ``stop`` and ``halt`` flags, over a
broker and a slow worker on threads (20 ms per iteration, so a 150-token
stream takes 3 s), whose model the drain test holds (:class:`HoldingSim`) so
that nothing in flight can finish before the test has looked at the drain.

Once ``stop`` is set: new requests get 503 in OpenAI's shape with
``Retry-After`` (and ``Connection: close``), ``/health`` 503 ``draining``;
what is in flight finishes (the whole output, ``[DONE]``) within
``shutdown_timeout_s``; after it a stream gets what it had, a final error
event and ``[DONE]``, a request a 503, and their broker requests are
cancelled; ``halt`` ends the wait at once; a connection that cannot take its
last words (a client that never sends its whole body) is closed; no ERROR
is logged. The commands (``serve``, ``up``) and real signals: tests/cli/test_drain.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from gateway import GatewayConfig, run
from gateway.drain import END_GRACE_S, HALTED, PARENT_GONE, Drain
from tests.support.cluster import ThreadCluster
from tests.support.gateway import CallInFlight, broker_status, error_of, metric, wait_until
from tests.support.reference import simulated_reference
from worker.models.simulated import SimulatedLLM

STEP_MS = 20.0
PROMPT = [5, 6]


def completion(max_tokens: int, stream: bool) -> dict:
    return {"model": "simulated", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def reference(max_tokens: int) -> list[int]:
    return simulated_reference(PROMPT, max_tokens, stop_token=None)[0]


class HoldingSim(SimulatedLLM):
    """SimulatedLLM whose steps can be held: while :attr:`hold_from` (a sequence length,
    prompt plus generated tokens) is set, a step with a sequence that long blocks until
    :attr:`release` is set (which :class:`ThreadWorker`'s close sets too)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_from: int | None = None
        self.release = threading.Event()

    def next_tokens(self, sequences):
        if self.hold_from is not None and max(map(len, sequences)) >= self.hold_from:
            self.release.wait()
        return super().next_tokens(sequences)


@contextlib.contextmanager
def held_at(model: HoldingSim, tokens: int):
    """Within the block, no sequence of ``model`` gets past ``tokens`` generated tokens
    (after PROMPT) until the block sets ``model.release``; on leaving it is released."""
    model.release.clear()
    model.hold_from = len(PROMPT) + tokens
    try:
        yield model
    finally:
        model.hold_from = None
        model.release.set()


@pytest.fixture(scope="module")
def cluster():
    with ThreadCluster(heartbeat_interval_s=0.2) as c:
        c.add_worker(HoldingSim(), num_slots=8, step_delay_ms=STEP_MS)
        yield c


def running(cluster) -> int:
    """Requests the broker has on a worker now."""
    models = broker_status(cluster).models
    return models["simulated"].running if "simulated" in models else 0


class Gateway:
    """``gateway.run`` on a thread, with its flags: :attr:`stop` drains, :attr:`halt` ends the drain."""

    def __init__(self, cluster, **config) -> None:
        self.stop, self.halt = threading.Event(), threading.Event()
        self.halt_reason: str | None = None  # what halt() says once set (None: True, a second stop signal)
        ready: list[str] = []
        cfg = GatewayConfig(broker=cluster.frontend, port=0, status_interval_s=0.2, **config)
        self.thread = threading.Thread(target=run, args=(cfg,), daemon=True,
                                       kwargs={"stop": self.stop, "halt": self._halted, "on_ready": ready.append})
        self.thread.start()
        self.url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        wait_until(lambda: httpx.get(self.url + "/health", timeout=5).status_code == 200, 30, "/health 200")
        self.stopped_s: float | None = None

    def _halted(self) -> bool | str:
        return self.halt.is_set() and (self.halt_reason or True)

    def drain(self) -> float:
        """Set ``stop``; returns when ``/health`` says draining (the monotonic time of the stop)."""
        t0 = time.monotonic()
        self.stop.set()
        wait_until(lambda: httpx.get(self.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
        return t0

    def join(self, timeout_s: float) -> float:
        """Wait for ``run`` to return; its monotonic end time."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"gateway.run did not return within {timeout_s} s"
        return time.monotonic()


@contextlib.contextmanager
def gateway(cluster, **config):
    gw = Gateway(cluster, **config)
    try:
        yield gw
    finally:
        gw.stop.set()
        gw.halt.set()
        gw.thread.join(30)


@pytest.fixture
def no_errors_logged(caplog):
    """Fails the test if anything logged at ERROR or above (uvicorn's "Cancel N running task(s)"
    and "Exception in ASGI application" included)."""
    caplog.set_level(logging.WARNING)
    yield caplog
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def assert_unavailable(body: dict, message_has: str) -> None:
    """``body`` (a stream's event, a reply's JSON) is OpenAI's error shape for a 503 saying ``message_has``."""
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "unavailable"
    assert message_has in body["error"]["message"], body


def assert_refused_while_draining(url: str) -> None:
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    assert health.headers["retry-after"] == "1"
    for r in (httpx.post(url + "/v1/completions", json=completion(2, False), timeout=5),
              httpx.post(url + "/v1/completions", json=completion(2, True), timeout=5),
              httpx.get(url + "/v1/models", timeout=5)):
        error = error_of(r, 503)
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert_unavailable({"error": error}, "shutting down and takes no new requests")
    assert httpx.get(url + "/metrics", timeout=5).status_code == 200  # scrapers still see the last numbers


def test_a_drain_lets_streams_and_requests_finish_and_refuses_new_ones(cluster, no_errors_logged):
    # The model holds at 60 tokens until the drain was looked at: the 120-token request takes 2.4 s, and
    # the drain's /health polls and its five checks had to end before it did, which a busy machine need not grant.
    # The stream goes first, so it is the one that meets the hold: neither can finish before the release.
    with gateway(cluster, shutdown_timeout_s=30) as gw, held_at(cluster.workers[0].model, 60) as model:
        stream = CallInFlight(gw.url, "/v1/completions", completion(150, True))
        wait_until(lambda: len(stream.streamed_tokens()) >= 3, 20, "the stream's first tokens")
        plain = CallInFlight(gw.url, "/v1/completions", completion(120, False))
        wait_until(lambda: running(cluster) == 2, 20, "both requests on the worker")
        t0 = gw.drain()
        assert_refused_while_draining(gw.url)
        assert not stream.done and not plain.done, "the drain ended the requests in flight"
        model.release.set()
        stream.wait(30)
        plain.wait(30)
        t_end = gw.join(10)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    assert not any("error" in e for e in stream.events[:-1])
    assert stream.streamed_tokens() == reference(150)
    assert plain.status == 200 and plain.json["choices"][0]["token_ids"] == reference(120), plain.json
    assert t_end - t0 < 10, "the drain waited past its requests' end"


@pytest.mark.parametrize("timeout_s", [0.0, 0.5])
def test_at_the_timeout_a_stream_ends_with_an_error_event_and_a_request_with_503(cluster, no_errors_logged,
                                                                                 timeout_s):
    with gateway(cluster, shutdown_timeout_s=timeout_s) as gw:
        stream = CallInFlight(gw.url, "/v1/completions", completion(5000, True))
        plain = CallInFlight(gw.url, "/v1/completions", completion(5000, False))
        wait_until(lambda: len(stream.events) >= 3 and running(cluster) == 2, 20, "both requests on the worker")
        t0 = time.monotonic()
        gw.stop.set()
        stream.wait(10)
        plain.wait(10)
        t_end = gw.join(10)
    assert t0 + timeout_s <= t_end < t0 + timeout_s + 3.0
    assert stream.status == 200 and stream.events[-1] == "[DONE]", stream.events[-3:]
    assert_unavailable(stream.events[-2], f"did not finish within its shutdown timeout of {timeout_s:g} s")
    tokens = stream.streamed_tokens()
    assert tokens and tokens == reference(5000)[:len(tokens)]
    assert plain.status == 503 and plain.headers["retry-after"] == "1"
    assert_unavailable(plain.json, "did not finish within its shutdown timeout")
    wait_until(lambda: running(cluster) == 0, 10, "the ended requests to be cancelled on the worker")


@pytest.mark.parametrize("reason, message", [(None, HALTED), (PARENT_GONE, PARENT_GONE)])
def test_a_halt_ends_the_drain_at_once(cluster, no_errors_logged, reason, message):
    """A halt's reason is what the requests it ends are told: a second stop signal (HALTED), or
    the parent gone (slotserve up killed: its gateway child said "a second stop signal" before)."""
    with gateway(cluster, shutdown_timeout_s=30) as gw:
        gw.halt_reason = reason
        stream = CallInFlight(gw.url, "/v1/completions", completion(5000, True))
        plain = CallInFlight(gw.url, "/v1/completions", completion(5000, False))
        wait_until(lambda: len(stream.events) >= 3 and running(cluster) == 2, 20, "both requests on the worker")
        gw.drain()
        assert not stream.done
        t0 = time.monotonic()
        gw.halt.set()
        stream.wait(10)
        plain.wait(10)
        t_end = gw.join(10)
    assert t_end - t0 < 3.0
    assert stream.events[-1] == "[DONE]" and stream.events[-2]["error"]["message"] == message
    assert plain.status == 503 and plain.json["error"]["message"] == message
    wait_until(lambda: running(cluster) == 0, 10, "the ended requests to be cancelled on the worker")


def test_a_connection_that_cannot_take_its_last_words_is_closed(cluster, no_errors_logged):
    """A client that never sends all of its body holds a request no abort event
    reaches: after the grace its connection is closed, and nothing logs an error."""
    with gateway(cluster, shutdown_timeout_s=0.2) as gw:
        u = urlsplit(gw.url)
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")
            wait_until(lambda: metric(gw.url, "slotserve_http_requests_in_flight") == 1, 10, "the request in flight")
            t0 = time.monotonic()
            gw.stop.set()
            t_end = gw.join(10)
            try:
                assert s.recv(1024) == b""  # closed, nothing sent
            except ConnectionResetError:
                pass  # closed with a reset: as good
    assert 0.2 + END_GRACE_S <= t_end - t0 < 0.2 + END_GRACE_S + 2.0
    assert any("closed 1 connection(s)" in r.getMessage() for r in no_errors_logged.records)


def test_a_gateway_whose_broker_is_down_stops_at_once(no_errors_logged):
    """Its connect to the broker (up to ``connect_timeout_s``) runs on a thread the event
    loop's shutdown does not wait for: stopping takes a tick, not the connect timeout."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    stop, ready = threading.Event(), []
    cfg = GatewayConfig(broker=dead, port=0, status_interval_s=0.2, connect_timeout_s=60.0)
    thread = threading.Thread(target=run, args=(cfg,), daemon=True,
                              kwargs={"stop": stop, "halt": lambda: False, "on_ready": ready.append})
    thread.start()
    url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
    assert httpx.get(url + "/health", timeout=5).status_code == 503  # up, connecting
    t0 = time.monotonic()
    stop.set()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - t0 < 10.0, "the stop waited on the connect"


def test_the_registry_ends_a_call_that_comes_after_the_end_and_wait_idle_obeys_halt():
    class Call:
        def __init__(self):
            self.ended = None

        def end(self, message):
            self.ended = message

    async def scenario():
        drain = Drain()
        assert await drain.wait_idle(0.0)  # nothing in flight: idle at once
        a = Call()
        drain.add(a)
        assert drain.begin() == 1 and drain.draining
        assert not await drain.wait_idle(5.0, halt=lambda: True)  # halt: no wait
        assert not await drain.wait_idle(0.05)
        assert drain.end_all("bye") == 1 and a.ended == "bye"
        b = Call()
        drain.add(b)  # came in after the end: ended at once
        assert b.ended == "bye"
        for c in (a, b):
            drain.discard(c)
        assert await drain.wait_idle(0.0) and drain.in_flight == 0

    asyncio.run(scenario())


def test_the_gateway_child_halts_with_the_reason_its_requests_get():
    """``slotserve up``'s gateway child (launcher.gateway_halt): its parent gone is said so, a second
    SIGTERM or the parent's halt event is a second stop signal, one SIGTERM drains."""
    from slotserve.launcher import gateway_halt
    from slotserve.signals import PARENT_GONE as PARENT_GONE_REASON, SignalStopFlag

    stop, halt = SignalStopFlag(), threading.Event()
    assert gateway_halt(stop, halt) is False
    stop.set(15)
    assert gateway_halt(stop, halt) is False  # one SIGTERM: the drain runs
    halt.set()
    assert gateway_halt(stop, halt) is True
    stop.set(15)
    assert gateway_halt(stop) is True
    gone = SignalStopFlag()
    gone.set(PARENT_GONE_REASON)
    assert gateway_halt(gone) == PARENT_GONE
