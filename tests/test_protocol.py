"""The wire contract: every message round-trips; anything malformed raises
ProtocolError with the right code and never anything else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode, peek_request_ids
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import (
    BROKER_TO_CLIENT, CLIENT_TO_BROKER, MESSAGE_TYPES, PROTOCOL_VERSION, WORKER_TO_BROKER, Assign, Bye,
    Cancel, Error, Finished, Heartbeat, Hello, Iteration, ModelInfo, ModelStatus, Op, Register,
    RequestSpec, Results, Status, StatusQuery, Submit, Welcome,
)

SAMPLES = [
    Hello("me"),
    Welcome("b1", 0.5, {"simulated": ModelInfo(1000, None, (0,), False)}),
    Submit("simulated", [RequestSpec(1, [1, 2, 3], 5),
                         RequestSpec("a", "text prompt", 3, stop_tokens=[], stop_sequences=[[1, 2], [3]],
                                     priority=-2, timeout_s=1.5, temperature=0.7, top_p=0.9, top_k=5, seed=7),
                         RequestSpec(2, None, 4, messages=[{"role": "user", "content": "hi"}], stop_tokens=[0, 5])]),
    Assign([RequestSpec(7, [4], 9, resume_tokens=[5, 6], timeout_s=0.25)]),
    Cancel([1, "a"]),
    Iteration(ids=[1, 2, 1], tokens=[3, 5, 4], texts=[[1, "ab"]],
              finished=[Finished(1, FinishReason.STOP, prompt_tokens=3),
                        Finished(2, FinishReason.ERROR, ErrorCode.MODEL_ERROR, "boom")]),
    Results(ids=["x"], tokens=[1], finished=[Finished("x", FinishReason.LENGTH)]),
    Error(ErrorCode.QUEUE_FULL, "full", ["a", 2]),
    Heartbeat(), Heartbeat(broker_id="b"), Heartbeat(progress=12),
    StatusQuery(),
    Status("b", 1.5, {"m": ModelStatus(1, 2, 3, 4, 5)}, [{"name": "w", "model": "m", "num_slots": 4, "inflight": 2}],
           2, {"submitted": 3}),
    Bye("done"),
    Register("simulated", 4, 5, ModelInfo(100, 64, (0, 1), True), "w1"),
]


def test_samples_cover_every_op():
    assert {type(m).op for m in SAMPLES} == set(Op) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["op"] == msg.op.value


def test_defaults_are_omitted_on_the_wire():
    raw = msgpack.unpackb(encode(Submit("m", [RequestSpec(1, [1], 2)])), raw=False)
    assert raw["requests"] == [{"id": 1, "max_tokens": 2, "prompt": [1]}]


token = st.integers(min_value=0, max_value=2**31)
rid = st.one_of(st.integers(min_value=-2**63, max_value=2**63 - 1), st.text(max_size=20))
specs = st.builds(
    RequestSpec, request_id=rid, prompt=st.one_of(st.lists(token, min_size=1, max_size=8), st.text(min_size=1)),
    max_tokens=st.integers(1, 10**6), stop_tokens=st.one_of(st.none(), st.lists(token, max_size=3)),
    stop_sequences=st.lists(st.lists(token, min_size=1, max_size=3), max_size=3),
    priority=st.integers(-100, 100), timeout_s=st.one_of(st.none(), st.floats(0.001, 1e6)),
    temperature=st.floats(0, 5), top_p=st.floats(0.01, 1), top_k=st.integers(0, 100),
    seed=st.one_of(st.none(), st.integers(0, 2**32)), resume_tokens=st.lists(token, max_size=4))


@settings(max_examples=60, deadline=None)
@given(st.lists(specs, max_size=5))
def test_submit_round_trip_property(reqs):
    msg = Submit("model", reqs)
    assert decode(encode(msg), CLIENT_TO_BROKER) == msg


def _frame(**fields) -> bytes:
    d = {"v": PROTOCOL_VERSION}
    d.update(fields)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("data,code", [
    (b"", ErrorCode.MALFORMED),
    (b"\xc1", ErrorCode.MALFORMED),                       # reserved msgpack byte
    (msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED),       # not a map
    (msgpack.packb({"op": "hello"}), ErrorCode.UNSUPPORTED_VERSION),
    (msgpack.packb({"v": 999, "op": "hello"}), ErrorCode.UNSUPPORTED_VERSION),
    (msgpack.packb({"v": True, "op": "hello"}), ErrorCode.UNSUPPORTED_VERSION),
    (_frame(op="launch_missiles"), ErrorCode.UNKNOWN_OP),
    (_frame(op=3), ErrorCode.UNKNOWN_OP),
    (_frame(op="submit"), ErrorCode.MALFORMED),            # missing fields
    (_frame(op="submit", model="m", requests=[{"id": 1, "max_tokens": 2}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1, "x"], "max_tokens": 2}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1, True], "max_tokens": 2}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1.5, "prompt": [1], "max_tokens": 2}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": "x" * 300, "prompt": [1], "max_tokens": 2}]),
     ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1], "max_tokens": 2.0}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1], "max_tokens": 2, "timeout_s": "1"}]),
     ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1], "max_tokens": 2,
                                               "temperature": float("nan")}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests="nope"), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1], tokens=[]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1], tokens=[True]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1.5], tokens=[1]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=["x" * 300], tokens=[1]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[[1]]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[{"id": 1, "reason": "stop"}]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[[1, "exploded"]]), ErrorCode.MALFORMED),
    (_frame(op="register", model="m", num_slots=0), ErrorCode.MALFORMED),
    (_frame(op="register", model="m", num_slots=4, max_inflight=2), ErrorCode.MALFORMED),
    (_frame(op="error", code="no_such_code", message="x"), ErrorCode.MALFORMED),
    (msgpack.packb({"v": 1, "op": "hello", "client_name": b"bytes"}, use_bin_type=True), ErrorCode.MALFORMED),
])
def test_malformed_raises_protocol_error_with_code(data, code):
    with pytest.raises(ProtocolError) as ei:
        decode(data)
    assert ei.value.code is code
    assert ei.value.message


def test_op_not_allowed_on_socket():
    with pytest.raises(ProtocolError) as ei:
        decode(encode(Register("m", 1, 1)), CLIENT_TO_BROKER)
    assert ei.value.code is ErrorCode.UNKNOWN_OP
    with pytest.raises(ProtocolError):
        decode(encode(Submit("m", [])), WORKER_TO_BROKER)
    with pytest.raises(ProtocolError):
        decode(encode(Assign([])), BROKER_TO_CLIENT)


def test_too_large():
    data = encode(Submit("m", [RequestSpec(1, list(range(1000)), 5)]))
    with pytest.raises(ProtocolError) as ei:
        decode(data, max_bytes=100)
    assert ei.value.code is ErrorCode.TOO_LARGE


def test_peek_request_ids_best_effort():
    bad = _frame(op="submit", model="m", requests=[{"id": 1, "prompt": [1, "x"], "max_tokens": 2},
                                                   {"id": "b"}, {"no": "id"}, 7])
    assert peek_request_ids(bad) == [1, "b"]
    assert peek_request_ids(b"\xc1garbage") == []
    assert peek_request_ids(msgpack.packb([1])) == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=10),
              st.binary(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children,
                                                                               max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([op.value for op in Op]), st.dictionaries(
    st.sampled_from(["model", "requests", "ids", "tokens", "finished", "texts", "broker_id", "code", "message",
                     "num_slots", "max_inflight", "info", "models", "heartbeat_interval_s", "workers", "counters",
                     "uptime_s", "clients", "progress", "client_name", "reason", "worker_name"]),
    json_like, max_size=6))
def test_structured_garbage_only_ever_raises_protocol_error(op, fields):
    try:
        decode(_frame(op=op, **fields))
    except ProtocolError:
        pass
