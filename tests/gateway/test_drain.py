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
from tests.support.gateway import CallInFlight, broker_status, error_of, wait_until
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

    def __init__(self, cluster, load_tokenizer=None, **config) -> None:
        self.stop, self.halt = threading.Event(), threading.Event()
        self.halt_reason: str | None = None  # what halt() says once set (None: True, a second stop signal)
        ready: list[str] = []
        cfg = GatewayConfig(broker=cluster.frontend, port=0, status_interval_s=0.2, **config)
        self.thread = threading.Thread(target=run, args=(cfg,), daemon=True,
                                       kwargs={"stop": self.stop, "halt": self._halted, "on_ready": ready.append,
                                               "load_tokenizer": load_tokenizer})
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
def gateway(cluster, load_tokenizer=None, **config):
    gw = Gateway(cluster, load_tokenizer, **config)
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


@pytest.mark.parametrize("path", ["/v1/completions", "/completion", "/v1/embeddings", "/tokenize"])
def test_a_request_whose_body_never_comes_is_answered_503_when_the_drain_ends(cluster, no_errors_logged, path):
    """A client that never sends all of its body: the drain's end reaches the request reading it, which
    answers 503 at once (the body's read is cancelled). Before, no abort event reached it: the connection
    was closed with no answer after the server's grace (END_GRACE_S)."""
    with gateway(cluster, gated_tokenizer(GatedLetters()), shutdown_timeout_s=0.2) as gw:
        u = urlsplit(gw.url)
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                      + b"Content-Length: 100\r\n\r\n{\"model\": ")
            t0 = time.monotonic()
            gw.stop.set()
            answer = b""
            while b"\r\n\r\n" not in answer and (chunk := s.recv(4096)):
                answer += chunk
            t_end = gw.join(10)
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer
    assert t_end - t0 < 0.2 + END_GRACE_S, "the request waited for the server's grace"
    assert not any("closed 1 connection(s)" in r.getMessage() for r in no_errors_logged.records)


def test_a_connection_whose_response_is_not_complete_is_closed():
    """The last resort (gateway.server._close_busy_connections): a connection whose response is not
    complete (a client that stopped reading its stream) is aborted; a finished one is left alone."""
    from types import SimpleNamespace

    from gateway.server import _close_busy_connections

    aborted = []

    def conn(complete: bool | None):
        transport = SimpleNamespace(abort=lambda: aborted.append(complete))
        cycle = None if complete is None else SimpleNamespace(response_complete=complete)
        return SimpleNamespace(cycle=cycle, transport=transport)

    server = SimpleNamespace(server_state=SimpleNamespace(connections=[conn(False), conn(True), conn(None)]))
    assert _close_busy_connections(server) == 1 and aborted == [False]


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


# --- every route takes part in the drain (gateway.drain_gate) -------------------------------------------------

# The routes that are neither generation nor embeddings, nor /health or /metrics: (method, path, body, whether the
# answer is Anthropic's shape). Each took a new request while the gateway drained: /models/load answered
# {"success": true} and `slotserve up` started loading the model in a cluster that was stopping.
OTHER_ROUTES = [
    ("POST", "/tokenize", {"prompt": "ab"}, False),
    ("POST", "/detokenize", {"tokens": [0, 1]}, False),
    ("POST", "/v1/messages/count_tokens", {"model": "simulated", "messages": [{"role": "user", "content": "ab"}]}, True),
    ("POST", "/models/load", {"model": "simulated"}, False),
    ("POST", "/models/unload", {"model": "simulated"}, False),
    ("GET", "/v1/responses/resp_x", None, False),
    ("DELETE", "/v1/responses/resp_x", None, False),
    ("GET", "/v1/models/simulated", None, False),
    ("GET", "/props", None, False),
    ("GET", "/nope", None, False),
]


class GatedLetters:
    """A text codec (``a`` is 0, ``b`` 1, ...) whose ``encode`` (and with ``decode=True`` its ``decode``) waits
    for :attr:`gate` (a deadlock's bound, 60 s, not a timing), saying on :attr:`entered` that a call is in it."""

    def __init__(self, decode: bool = False) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gated_decode = decode

    def _wait(self) -> None:
        self.entered.set()
        self.gate.wait(60)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # (also as the "hf" tokenizer's)
        self._wait()
        return [ord(c) - ord("a") for c in text]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.gated_decode:
            self._wait()
        return "".join(chr(ord("a") + i) for i in ids)


def gated_tokenizer(codec: GatedLetters):
    from gateway.tokenizer import Tokenizer

    return lambda name: Tokenizer(codec, hf=codec)


def anthropic_overloaded(r: httpx.Response, message_has: str) -> None:
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    assert message_has in body["error"]["message"], body


@pytest.fixture(scope="class")
def draining(cluster):
    """The URL of a gateway that drains, for the tests of a class: a stream held in flight keeps it draining."""
    model = cluster.workers[0].model
    with gateway(cluster, gated_tokenizer(GatedLetters()), shutdown_timeout_s=60) as gw, held_at(model, 5):
        stream = CallInFlight(gw.url, "/v1/completions", completion(50, True))
        wait_until(lambda: len(stream.streamed_tokens()) >= 3, 20, "the stream's first tokens")
        gw.drain()
        yield gw.url
        assert not stream.done, "the drain ended before the test looked at it"
        model.release.set()
        stream.wait(30)
        gw.join(10)


class TestEveryRouteRefusesWhileDraining:
    """One draining gateway for every route."""

    @pytest.mark.parametrize("method, path, body, anthropic", OTHER_ROUTES, ids=[f"{m} {p}" for m, p, *_ in OTHER_ROUTES])
    def test_a_new_request_gets_503(self, draining, method, path, body, anthropic):
        r = httpx.request(method, draining + path, json=body, timeout=10)
        if anthropic:
            anthropic_overloaded(r, "shutting down and takes no new requests")
        else:
            assert_unavailable({"error": error_of(r, 503)}, "shutting down and takes no new requests")
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "ab"}),
                                        ("/v1/messages/count_tokens",
                                         {"model": "simulated", "messages": [{"role": "user", "content": "ab"}]})])
def test_a_tokenize_in_flight_is_answered_before_the_gateway_stops(cluster, no_errors_logged, path, body):
    """Its tokenizer work (seconds for a large text) was unknown to the drain: the gateway stopped at
    once and uvicorn cut the request 2 s later, a plain-text ``500 Internal Server Error``."""
    codec = GatedLetters()
    with gateway(cluster, gated_tokenizer(codec), shutdown_timeout_s=60) as gw:
        call = CallInFlight(gw.url, path, body)
        assert codec.entered.wait(20), "the request did not reach the tokenizer"
        gw.drain()  # (the drain said what it waits for as it began, before /health said draining)
        assert any("stopping: 1 request(s) in flight get up to 60 s" in r.getMessage()
                   for r in no_errors_logged.records), "the drain did not wait for the request"
        assert not call.done
        codec.gate.set()
        call.wait(20)
        gw.join(10)
    assert call.status == 200, (call.status, call.json, call.error)
    assert call.json == ({"input_tokens": 2} if "count_tokens" in path
                         else {"count": 2, "max_model_len": None, "tokens": [0, 1], "token_strs": None})


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "ab"}),
                                        ("/v1/messages/count_tokens",
                                         {"model": "simulated", "messages": [{"role": "user", "content": "ab"}]})])
def test_a_tokenize_past_the_shutdown_timeout_answers_503(cluster, no_errors_logged, path, body):
    codec = GatedLetters()
    try:
        with gateway(cluster, gated_tokenizer(codec), shutdown_timeout_s=0.2) as gw:
            call = CallInFlight(gw.url, path, body)
            assert codec.entered.wait(20), "the request did not reach the tokenizer"
            gw.stop.set()
            call.wait(20)
            codec.gate.set()  # (the tokenizer's thread: the gateway's loop waits for it as it closes)
            gw.join(10)
    finally:
        codec.gate.set()
    assert call.status == 503 and call.headers["retry-after"] == "1", (call.status, call.json, call.error)
    if "count_tokens" in path:
        assert call.json["error"]["type"] == "overloaded_error", call.json
        assert "did not finish within its shutdown timeout of 0.2 s" in call.json["error"]["message"]
    else:
        assert_unavailable(call.json, "did not finish within its shutdown timeout of 0.2 s")


# The tokenizer's work on a request, on each route that runs it: its answer ended by the drain, the work still runs.
TOKENIZER_WORK = [("/tokenize", {"prompt": "ab"}, False),
                  ("/v1/messages/count_tokens", {"model": "simulated", "messages": [{"role": "user", "content": "ab"}]},
                   False),
                  ("/detokenize", {"tokens": [0, 1]}, True),
                  ("/completion", {"prompt": [0, "ab"], "n_predict": 2}, False),  # (a mixed prompt's strings)
                  ("/completion", {"prompt": [0, 1], "n_predict": 2, "logit_bias": [["ab", -1.0]]}, False)]


@pytest.mark.parametrize("path, body, decode", TOKENIZER_WORK, ids=[f"{p} {i}" for i, (p, *_) in
                                                                     enumerate(TOKENIZER_WORK)])
def test_the_tokenizer_work_of_an_ended_request_does_not_hold_the_gateway_stop(cluster, no_errors_logged, path, body,
                                                                                 decode):
    """It ran on the event loop's default executor, which the loop's close joins: ``gateway.run`` returned
    only once the tokenizer was done (a 7 MB text: up to 39 s past the drain), and ``slotserve up`` killed
    its gateway ("did not stop within its drain and 5.0 s: killing it")."""
    codec = GatedLetters(decode)
    try:
        with gateway(cluster, gated_tokenizer(codec), shutdown_timeout_s=0.2) as gw:
            call = CallInFlight(gw.url, path, body)
            assert codec.entered.wait(20), "the request did not reach the tokenizer"
            gw.stop.set()
            call.wait(20)
            gw.join(10)  # (the tokenizer still holds the gate)
            assert not codec.gate.is_set()
    finally:
        codec.gate.set()
    assert call.status == 503, (call.status, call.json, call.error)


def test_the_tokenizer_threads_are_daemons_bounded_in_number_and_carry_results_and_errors():
    from gateway.threads import DaemonPool

    pool = DaemonPool(2, "test-pool")
    gate, running = threading.Event(), []

    def held(i: int) -> int:
        running.append(i)
        gate.wait(60)
        return i * 10

    def failing() -> None:
        raise ValueError("no")

    async def scenario():
        futures = [pool.run(held, i) for i in range(5)]
        await asyncio.to_thread(wait_until, lambda: len(running) == 2, 10, "two calls running")
        assert pool._threads == 2 and len(running) == 2  # the other three wait for a thread
        gate.set()
        assert await asyncio.gather(*futures) == [0, 10, 20, 30, 40]
        with pytest.raises(ValueError, match="no"):
            await pool.run(failing)

    asyncio.run(scenario())
    threads = [t for t in threading.enumerate() if t.name.startswith("test-pool-")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    with pytest.raises(ValueError):
        DaemonPool(0, "none")


def test_unless_ended_gives_the_result_or_cancels_the_work_when_ended_or_when_its_caller_is_cancelled():
    from gateway.drain import unless_ended

    async def scenario():
        ended = asyncio.Event()
        assert await unless_ended(asyncio.sleep(0, "done"), ended) == (True, "done")

        async def boom():
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await unless_ended(boom(), ended)
        forever = asyncio.ensure_future(asyncio.Event().wait())
        waiting = asyncio.ensure_future(unless_ended(forever, ended))
        await asyncio.sleep(0)  # (it waits on both now)
        ended.set()
        assert await waiting == (False, None) and forever.cancelled()
        forever = asyncio.ensure_future(asyncio.Event().wait())
        caller = asyncio.ensure_future(unless_ended(forever, asyncio.Event()))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert forever.cancelled()

    asyncio.run(scenario())
