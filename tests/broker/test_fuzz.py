"""Hostile input against a live broker: random and mutated frames on both
sockets (hypothesis), oversized frames, wrong protocol versions. The broker
must neither crash nor hang, must answer what deserves an answer, and valid
traffic must flow unchanged afterwards. ``bench/fuzz.py`` runs the same idea
for longer and prints counts."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import BrokerConfig
from client import Client
from tests.support.messages import envelope
from protocol.codec import decode, encode
from protocol.defaults import MIN_MESSAGE_BYTES
from protocol.enums import ErrorCode
from protocol.messages import (
    PROTOCOL_VERSION, Bye, Cancel, Error, Finished, Heartbeat, Hello, Iteration, ModelInfo, Register, StatusQuery, Submit,
)
from protocol.enums import FinishReason
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig

LIMIT = 64 * 1024

FRONT_CORPUS = [encode(m) for m in (
    Hello("fuzz"), Heartbeat(), StatusQuery(), Bye("x"), Cancel([1, "a"]),
    Submit("simulated", [envelope(1, [1, 2], 3), envelope("b", [5], 2, stop_token=[0], priority=2,
                                                                 timeout_s=0.5, stop_sequences=[[1, 2]])]),
)]
BACK_CORPUS = [encode(m) for m in (
    Register("simulated", 2, 3, ModelInfo(1000, 64, (0,), False), "fuzz"), Heartbeat(progress=3), Bye(),
    Iteration(ids=[0, 1], tokens=[4, 5], finished=[Finished(0, FinishReason.STOP, prompt_tokens=2)]),
)]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)


@st.composite
def mutated(draw, corpus):
    base = draw(st.sampled_from(corpus))
    how = draw(st.sampled_from(["field", "bytes", "truncate"]))
    if how == "field":
        d = msgpack.unpackb(base)
        key = draw(st.sampled_from(sorted(d) + ["v", "op", "extra"]))
        d[key] = draw(msgpack_values)
        return msgpack.packb(d)
    if how == "truncate":
        return base[:draw(st.integers(0, len(base)))]
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        data[i:i + draw(st.integers(0, 2))] = draw(st.binary(max_size=3))
    return bytes(data)


def frames(corpus):
    one = st.binary(max_size=200) | msgpack_values.map(msgpack.packb) | mutated(corpus)
    return st.lists(one, min_size=1, max_size=3)


@pytest.fixture(scope="module")
def cluster():
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, max_message_bytes=LIMIT, heartbeat_interval_s=0.2,
                          worker_liveness_s=1.0, client_liveness_s=2.0)
    worker = WorkerConfig(num_slots=4, heartbeat_interval_s=0.2, broker_liveness_s=2.0)
    with LocalCluster(ClusterConfig(broker, (worker,))) as c:
        yield c


class Fuzzer:
    """Two raw DEALERs (one per broker socket) and a real client that checks,
    after every example, that the broker still answers."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.ctx = zmq.Context.instance()
        self.sockets = {}
        for side, ep in (("front", cluster.frontend), ("back", cluster.backend)):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.sockets[side] = s
        self.probe = Client(cluster.frontend, heartbeat_interval_s=0.2, name="fuzz-probe")
        self.sent = {"front": 0, "back": 0}
        self.replies = 0

    def send(self, side, parts):
        self.sockets[side].send_multipart(parts)
        self.sent[side] += 1
        for s in self.sockets.values():  # read what came back (errors, welcomes, assigns)
            while s.poll(0):
                s.recv_multipart()
                self.replies += 1

    def close(self):
        self.probe.close()
        for s in self.sockets.values():
            s.close(0)


@pytest.fixture(scope="module")
def fuzzer(cluster):
    f = Fuzzer(cluster)
    yield f
    f.close()


@pytest.mark.parametrize("limit", [0, 3, MIN_MESSAGE_BYTES - 1])
def test_a_register_announcing_a_frame_limit_nothing_fits_is_refused_as_malformed(fuzzer, limit):
    """Found by this module's fuzzing in CI: a worker registered with max_message_bytes=3,
    after which every welcome, heartbeat and error for it failed to send (66 internal errors).
    Now the register itself is malformed: an error reply, no worker added, no internal error."""
    before = fuzzer.probe.status(timeout_s=5.0)
    frame = msgpack.unpackb(BACK_CORPUS[0])
    frame["max_message_bytes"] = limit
    sock = fuzzer.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fuzzer.cluster.backend)
    try:
        sock.send(msgpack.packb(frame))
        assert sock.poll(5000), "no reply to the bad register"
        reply = decode(sock.recv())
        assert type(reply) is Error and reply.code is ErrorCode.MALFORMED and "max_message_bytes" in reply.message
    finally:
        sock.close(0)
    after = fuzzer.probe.status(timeout_s=5.0)
    assert after.counters["bad_messages"] > before.counters["bad_messages"]
    assert after.counters["internal_errors"] == before.counters["internal_errors"]
    assert len(after.workers) == len(before.workers)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(front=frames(FRONT_CORPUS), back=frames(BACK_CORPUS))
def test_random_and_mutated_frames_never_crash_or_hang_the_broker(fuzzer, front, back):
    fuzzer.send("front", front)
    fuzzer.send("back", back)
    st_ = fuzzer.probe.status(timeout_s=5.0)     # no hang: it still answers at once
    assert st_.counters["internal_errors"] == 0  # no handler bug hit (they are caught and counted)


def test_after_fuzzing_valid_traffic_flows_and_the_broker_lives(cluster, fuzzer):
    fuzzer.close()
    assert fuzzer.sent["front"] >= 150 and fuzzer.sent["back"] >= 150
    reqs = [([i + 1, 9], 10) for i in range(50)]
    engine = BatchInferenceEngine(SimulatedLLM(), 4, stop_token=0)
    expected = [engine.submit_request(p, m) for p, m in reqs]
    engine.run()
    with Client(cluster.frontend, model="simulated") as c:  # fuzzed registrations may have added models
        hs = [c.submit_request(p, m) for p, m in reqs]
        c.run(timeout=30)
        st_ = c.status()
    assert [h.tokens for h in hs] == [h.tokens for h in expected]
    assert cluster.broker_process.is_alive()
    assert st_.counters["bad_messages"] > 0 and st_.counters["internal_errors"] == 0


def ask(endpoint, parts, timeout_s=10.0):
    """Send ``parts`` from a fresh DEALER; return the first reply decoded (any op)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(parts)
        if not s.poll(timeout_s * 1000):
            raise AssertionError("no reply")
        return decode(s.recv())
    finally:
        s.close(0)


@pytest.mark.parametrize("side", ["frontend", "backend"])
def test_wrong_version_too_large_and_multipart_get_clear_error_codes(cluster, side):
    ep = getattr(cluster, side)
    e = ask(ep, [msgpack.packb({"v": PROTOCOL_VERSION + 1, "op": "hello" if side == "frontend" else "register"})])
    assert isinstance(e, Error) and e.code is ErrorCode.UNSUPPORTED_VERSION and f"v{PROTOCOL_VERSION}" in e.message
    e = ask(ep, [msgpack.packb({"op": "hello"})])
    assert e.code is ErrorCode.UNSUPPORTED_VERSION
    e = ask(ep, [b"\x00" * (LIMIT + 1)])
    assert e.code is ErrorCode.TOO_LARGE and str(LIMIT) in e.message
    e = ask(ep, [encode(Heartbeat()), b"second frame"])
    assert e.code is ErrorCode.MALFORMED
    e = ask(ep, [encode(Hello()) if side == "backend" else encode(Heartbeat(progress=1))[:3]])
    assert e.code in (ErrorCode.UNKNOWN_OP, ErrorCode.MALFORMED)


def test_frame_past_the_hard_limit_drops_only_that_connection(cluster):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(cluster.frontend)
    try:
        s.send(b"\x00" * (4 * LIMIT + 1))  # past zmq's MAXMSGSIZE: the broker drops the connection
        assert mon.poll(10_000), "the broker kept a connection that sent an oversized frame"
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)
    with Client(cluster.frontend, model="simulated") as c:
        h = c.submit_request([1, 2, 3], 5)
        c.run(timeout=20)
    assert h.finish_reason is not None and h.error is None


@pytest.mark.parametrize("answer_version", ["own", "theirs"])
def test_client_facing_a_broker_of_another_version_gets_a_clear_error_at_once(answer_version):
    """The broker's refusal comes in its own protocol version ("theirs", as a real broker of
    another version sends it: the client cannot decode it, and a breaker found it then waited
    out its connect timeout and blamed a missing broker) or in the client's ("own")."""
    from client import RemoteError
    from protocol.messages import PROTOCOL_VERSION

    # A stand-in for a broker of another protocol version: it answers every
    # message with the error a real one sends (owned by this thread only).
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if router.poll(20):
                ident, _ = router.recv_multipart()
                frame = msgpack.unpackb(encode(Error(
                    ErrorCode.UNSUPPORTED_VERSION, "protocol version 1 is not supported; this peer speaks v2")))
                frame["v"] = PROTOCOL_VERSION + (1 if answer_version == "theirs" else 0)
                router.send_multipart([ident, msgpack.packb(frame)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(RemoteError, match="speaks v2" if answer_version == "own" else "another protocol") as e:
            Client(f"tcp://127.0.0.1:{port}", connect_timeout_s=30)
        assert e.value.code is ErrorCode.UNSUPPORTED_VERSION
        assert time.monotonic() - started < 30   # refused at once, not after the connect timeout
    finally:
        stop.set()
        t.join(5)
        router.close(0)
