"""The wire contract: every message round-trips; anything malformed raises
ProtocolError with a code and never anything else."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.defaults import MIN_HEARTBEAT_INTERVAL_S, MIN_MESSAGE_BYTES
from protocol.codec import decode, encode, peek_request_ids
from protocol.enums import ErrorCode, FinishReason, ModelAction, ModelState
from protocol.errors import ContextLengthError, ProtocolError
from protocol.messages import (
    BROKER_TO_CLIENT, CLIENT_TO_BROKER, MESSAGE_TYPES, PROTOCOL_VERSION, WORKER_TO_BROKER, Assign, Bye,
    Cancel, Demand, DemandState, Envelope, Error, Finished, Heartbeat, Hello, Iteration, Loading, Logprobs, ModelInfo,
    ModelOrder, ModelStatus, Op, PendingOrder, Register, Rejected, Results, Started, Status, StatusQuery, Submit, Text,
    Welcome, WorkerStatus,
)
from protocol.logprobs import MAX_LOGPROBS, TokenLogprob
from protocol.request import MAX_REQUEST_ID_CHARS, ModelLimits, RequestId, RequestParams
from protocol.validation import ROLE, WIRE_INT_MAX, WIRE_INT_MIN

P = RequestParams

SAMPLES = [
    Hello("me"),
    Welcome("b1", 0.5, {"simulated": ModelInfo(1000, None, (0,), False)}),
    Welcome("b1", 0.5, {}, 1 << 20, ("smollm2-135m",), 3.5),
    Submit("simulated", [Envelope(1, P([1, 2, 3], 5)),
                         Envelope("a", P("text prompt", 3, stop_token=None, stop_sequences=[[1, 2], [3]],
                                         priority=-2, timeout_s=1.5, temperature=0.7, top_p=0.9, top_k=5, seed=7,
                                         stop=["\n\n", "é"], include_stop_str_in_output=True)),
                         Envelope(2, P([{"role": "user", "content": "hi"}], 4, stop_token=[5, 0]), (9,), 0.5),
                         Envelope(3, P([1, 2], 4, logprobs=5, prompt_logprobs=0, logit_bias={7: -100, "3": 2.5},
                                       repetition_penalty=1.3, presence_penalty=-2, frequency_penalty=0.5,
                                       min_p=0.1)),
                         Envelope(4, P([1], 3, structured={"json_schema": {"type": "object", "required": ["a"]}})),
                         Envelope(5, P([1], 3, structured=("choice", ["yes", "no"])))]),
    Assign([Envelope(7, P([4], 9), resume_tokens=(5, 6), time_left_s=0.25)]),
    Cancel([1, "a"]),
    Iteration(ids=[1, 2, 1], tokens=[3, 5, 4], texts=[Text(1, "ab")],
              finished=[Finished(1, FinishReason.STOP, prompt_tokens=3, stop_reason=4),
                        Finished(2, FinishReason.ERROR, ErrorCode.MODEL_ERROR, "boom")]),
    Results(ids=["x"], tokens=[1], finished=[Finished("x", FinishReason.STOP, stop_reason=(1, 2)),
                                             Finished("y", FinishReason.STOP, stop_reason="\n\n")]),
    Results(ids=["x", 4, "x"], tokens=[1, 2, 3], started=[Started("x", 2)],
            logprobs=[Logprobs("x", (TokenLogprob(-0.25, ((1, -0.25), (9, -2.0))), TokenLogprob(float("-inf"))),
                               (None, TokenLogprob(-1.5, ((0, float("-inf")),)))),
                      Logprobs(4, prompt=(None,))]),
    Error(ErrorCode.QUEUE_FULL, "full", ["a", 2]),
    Heartbeat(), Heartbeat(broker_id="b"), Heartbeat(progress=12),
    StatusQuery(),
    Status("b", 1.5, {"m": ModelStatus(1, 2, 3, 4, 5), "n": ModelStatus(0, 0, 0, 0, 0, 2)},
           [WorkerStatus("w", "m", 4, 2, 10, False)], 2,
           {"submitted": 3}),
    Status("b", 1.5, {"m": ModelStatus(0, 0, 0, 0, 0, 1)}, (), 0, {}, {}, {"vm:7": "m"}),  # a worker loading
    Bye("done"),
    Register("simulated", 4, 5, ModelInfo(100, 64, (0, 1), True), "w1"),
    Register("simulated", 4, 5, ModelInfo(), "w1", 1 << 20),
    Loading("smollm2-135m", "w2"),
    ModelOrder("smollm2-135m", ModelAction.LOAD),
    Demand("b", {"m": DemandState(ModelState.LOADING), "n": DemandState(ModelState.UNLOADED, True, -9, "killed")},
           {"m-alias": "m"}, 3),
    Status("b", 1.5, {"m": ModelStatus(0, 0, 0, 0, 0)}, (), 0, {}, {}, {}, {"m": DemandState(ModelState.UNLOADING)},
           (PendingOrder(4, ModelAction.UNLOAD, "m"),)),  # models on demand: their states, an order not taken
]


def test_samples_cover_every_op():
    assert {type(m).op for m in SAMPLES} == set(Op) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["op"] == msg.op.value


def test_wire_format_maps_of_fields_with_records_as_arrays():
    raw = msgpack.unpackb(encode(Submit("m", [Envelope(1, P([1], 2)), Envelope(2, P([1], 2, top_k=5), (3,))])),
                          raw=False)
    assert raw == {"v": PROTOCOL_VERSION, "op": "submit", "model": "m",  # (trailing defaults left out)
                   "requests": [[1, [[1], 2, "default"]], [2, [[1], 2, "default", [], 0, None, 0.0, 1.0, 5], [3]]]}
    raw = msgpack.unpackb(encode(Submit("m", [Envelope(1, P([1], 2, structured={"regex": "a+"}))])), raw=False)
    assert raw["requests"][0][1][P._fields.index("structured")] == ["regex", "a+", ""]  # a constraint: [kind, spec, think]


# ---------------------------------------------------------------------- every message type, built by hypothesis

token = st.integers(0, 2**31)
wire_int = st.integers(WIRE_INT_MIN, WIRE_INT_MAX)
request_id = st.one_of(wire_int, st.text(min_size=1, max_size=MAX_REQUEST_ID_CHARS))
finite = st.floats(allow_nan=False, allow_infinity=False)
role = st.from_regex(ROLE, fullmatch=True)  # (a chat role is a name: as_role)


@st.composite
def params(draw):
    max_tokens = draw(st.integers(1, 10**6))
    structured = draw(st.one_of(st.none(), st.just({"regex": "[0-9]+"}), st.just({"json_object": True}),
                                st.builds(lambda c: {"choice": c}, st.lists(st.text(min_size=1), min_size=1,
                                                                            max_size=3))))
    p = RequestParams(
        draw(st.one_of(st.lists(token, min_size=1, max_size=8), st.text(min_size=1, max_size=20),
                       st.lists(st.fixed_dictionaries({"role": role, "content": st.text(max_size=20)}),
                                min_size=1, max_size=3))),
        max_tokens,
        stop_token=draw(st.one_of(st.just("default"), st.none(), token, st.lists(token, max_size=3))),
        stop_sequences=draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=3)),
        priority=draw(wire_int), timeout_s=draw(st.one_of(st.none(), st.floats(0.001, 1e6))),
        temperature=draw(st.floats(0, 5)), top_p=draw(st.floats(0.01, 1)), top_k=draw(st.integers(0, 100)),
        seed=draw(st.one_of(st.none(), st.integers(0, WIRE_INT_MAX))),
        min_tokens=0 if structured else draw(st.integers(0, max_tokens)),  # (not with a constraint)
        stop=draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        min_p=draw(st.floats(0, 1)),
        logit_bias=draw(st.dictionaries(token, st.floats(-100, 100), max_size=3)),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(1e-3, 1e3))),
        presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
        logprobs=draw(logprob_counts), prompt_logprobs=draw(logprob_counts), structured=structured)
    if type(p.prompt) is str and draw(st.booleans()):  # fill in the middle
        p = p._replace(suffix=draw(st.text(max_size=10)),
                       input_extra=draw(st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=2)))
    return p


@st.composite
def envelopes(draw):
    p = draw(params())
    resume = draw(st.lists(token, max_size=min(4, p.max_tokens - 1)))
    return Envelope(draw(request_id), p, tuple(resume), draw(st.one_of(st.none(), finite)))


logprob_counts = st.one_of(st.none(), st.integers(0, MAX_LOGPROBS))
logprob = st.floats(max_value=0.0, allow_nan=False)  # -inf included: a token of probability 0
token_logprobs = st.builds(TokenLogprob, logprob, st.lists(st.tuples(token, logprob), max_size=3).map(tuple))
prompt_logprobs = st.lists(token_logprobs, max_size=3).map(lambda x: (None, *x))


@st.composite
def token_batches(draw, cls):
    ids = draw(st.lists(request_id, max_size=6))
    records = []  # the entries of some requests' tokens (one or two records each), some prompts alone
    for rid in draw(st.lists(st.sampled_from(ids), unique=True)) if ids else ():
        entries = [draw(token_logprobs) for r in ids if r == rid]
        cut = draw(st.integers(0, len(entries)))
        prompt = draw(st.one_of(st.none(), prompt_logprobs))
        ids_ = None if prompt is None else draw(st.one_of(st.none(), st.lists(token, min_size=len(prompt),
                                                                              max_size=len(prompt)).map(tuple)))
        records.append(Logprobs(rid, tuple(entries[:cut]), prompt, ids_))
        if entries[cut:]:
            records.append(Logprobs(rid, tuple(entries[cut:])))
    records += [Logprobs(rid, (), draw(prompt_logprobs))
                for rid in draw(st.lists(request_id, max_size=2)) if rid not in ids]
    return cls(ids, draw(st.lists(wire_int, min_size=len(ids), max_size=len(ids))),
               draw(st.lists(strategy(Text), max_size=3)), draw(st.lists(strategy(Finished), max_size=3)),
               draw(st.lists(strategy(Started), max_size=3)), records)


@st.composite
def registers(draw):
    slots = draw(st.integers(1, 2**16))
    limit = st.none() | st.integers(1, WIRE_INT_MAX)  # (a register's limits are >= 1, its EOS ids in the vocabulary)
    vocab = draw(limit)
    eos = st.integers(0, WIRE_INT_MAX if vocab is None else vocab - 1)
    info = ModelInfo(vocab, draw(limit), tuple(draw(st.lists(eos, max_size=4))), draw(st.booleans()))
    return Register(draw(st.text(max_size=8)), slots, draw(st.integers(slots, 2**17)),
                    info, draw(st.text(max_size=8)), draw(st.integers(MIN_MESSAGE_BYTES, WIRE_INT_MAX)))


@st.composite
def welcomes(draw):
    positive = st.floats(min_value=1e-6, max_value=1e6)
    interval = st.floats(min_value=MIN_HEARTBEAT_INTERVAL_S, max_value=1e6)
    return Welcome(draw(st.text(max_size=12)), draw(interval), draw(strategy(dict[str, ModelInfo])),
                   draw(st.integers(MIN_MESSAGE_BYTES, WIRE_INT_MAX)), draw(strategy(tuple[str, ...])),
                   draw(st.one_of(st.just(0.0), positive)))


@st.composite
def demands(draw):
    """A ``demand``: its states are states (a failed one unloaded, only a failed one with a code or words)."""
    failed = st.builds(DemandState, st.just(ModelState.UNLOADED), st.just(True), st.none() | wire_int,
                       st.text(max_size=12))
    state = st.sampled_from(list(ModelState)).map(DemandState) | failed
    return Demand(draw(st.text(max_size=12)), draw(st.dictionaries(st.text(max_size=6), state, max_size=3)),
                  draw(strategy(dict[str, str])), draw(st.integers(0, WIRE_INT_MAX)))


SPECIAL = {RequestParams: params(), Envelope: envelopes(), Iteration: token_batches(Iteration),
           Results: token_batches(Results), Register: registers(), Welcome: welcomes(), TokenLogprob: token_logprobs,
           Demand: demands()}


def strategy(tp) -> st.SearchStrategy:
    """Values of the declared type ``tp``, derived from the annotations as the codec's decoders are."""
    if tp in SPECIAL:
        return SPECIAL[tp]
    if tp == RequestId:
        return request_id
    simple = {int: wire_int, float: finite, str: st.text(max_size=12), bool: st.booleans(), type(None): st.none()}
    if tp in simple:
        return simple[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*map(strategy, args))
    if origin is tuple:
        return st.lists(strategy(args[0]), max_size=4).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), strategy(args[1]), max_size=3)
    hints = typing.get_type_hints(tp)
    names = tp._fields if hasattr(tp, "_fields") else [f.name for f in dataclasses.fields(tp)]
    return st.builds(tp, **{n: strategy(hints[n]) for n in names})


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_type_round_trips(cls, data):
    msg = data.draw(strategy(cls))
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


# ---------------------------------------------------------------------- malformed frames


def _frame(**fields) -> bytes:
    d = {"v": PROTOCOL_VERSION}
    d.update(fields)
    return msgpack.packb(d, use_bin_type=True)


GOOD_PARAMS = [[1], 2]


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
    (_frame(op="hello", client_name="x", extra=1), ErrorCode.MALFORMED),   # a field hello does not have
    (_frame(op="submit", model="m", requests="nope"), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[[1.5, GOOD_PARAMS]]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[["x" * 300, GOOD_PARAMS]]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[{"id": 1}]), ErrorCode.MALFORMED),
    (_frame(op="submit", model="m", requests=[[1]]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1], tokens=[]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1], tokens=[True]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=[1.5], tokens=[1]), ErrorCode.MALFORMED),
    (_frame(op="iteration", ids=["x" * 300], tokens=[1]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[[1]]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[{"id": 1, "reason": "stop"}]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[[1, "exploded"]]), ErrorCode.MALFORMED),
    (_frame(op="iteration", finished=[[1, "stop", None, None, None, 1.5]]), ErrorCode.MALFORMED),
    (_frame(op="register", model="m", num_slots=0, max_inflight=1), ErrorCode.MALFORMED),
    (_frame(op="register", model="m", num_slots=4, max_inflight=2), ErrorCode.MALFORMED),
    (_frame(op="register", model="m", num_slots=1, max_inflight=1, max_message_bytes=3), ErrorCode.MALFORMED),
    (_frame(op="welcome", broker_id="b", heartbeat_interval_s=1.0, max_message_bytes=MIN_MESSAGE_BYTES - 1),
     ErrorCode.MALFORMED),
    (_frame(op="welcome", broker_id="b", heartbeat_interval_s=1e-9), ErrorCode.MALFORMED),  # peers would busy-loop
    (_frame(op="error", code="no_such_code", message="x"), ErrorCode.MALFORMED),
    (_frame(op="demand", broker_id="b", models={}, orders_taken=-5), ErrorCode.MALFORMED),  # (seqs start at 1)
    (_frame(op="demand", broker_id="b", models={"m": ["loaded", True, 7, "x"]}), ErrorCode.MALFORMED),  # failed: unloaded
    (_frame(op="demand", broker_id="b", models={"m": ["unloaded", False, 7]}), ErrorCode.MALFORMED),  # (not failed)
    (_frame(op="demand", broker_id="b", models={"m": ["loading", False, None, "why"]}), ErrorCode.MALFORMED),
    (_frame(op="welcome", broker_id="b", heartbeat_interval_s=float("nan")), ErrorCode.MALFORMED),
    (msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "client_name": b"bytes"}, use_bin_type=True),
     ErrorCode.MALFORMED),
    (b"\x81\xa1v\x02\xa2op\xa5hello\xa1x", ErrorCode.MALFORMED),                   # truncated
    (msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "client_name": "a"}) + b"\x00", ErrorCode.MALFORMED),
    (b"\x82\xa1v\x02\xa2op\xa5hello" + b"\xa1\xed\xa0\xbd", ErrorCode.MALFORMED),   # invalid UTF-8 (a surrogate)
])
def test_malformed_raises_protocol_error_with_code(data, code):
    with pytest.raises(ProtocolError) as ei:
        decode(data)
    assert ei.value.code is code
    assert ei.value.message


@pytest.mark.parametrize("bad_params, message", [
    ([[-1], 4], "negative token id"),
    ([[1], 0], "max_tokens must be >= 1"),
    ([[1, "a"], 2], "must be an int"),
    ([[1], 2, "default", [], 0, None, float("nan")], "temperature must be finite"),
    ([[1], 2, "sometimes"], "stop_token must be"),
    ([[[1, 2]], 2], "chat message 0"),
    ([[1], 2, "default", [], 0, None, 0.0, 1.0, 0, None, 0, [], False, [], 1.0, 0.0, 0.0, 0.0, None, None, None, None,
      None, [], False, None, "generate", False, None, "extra"], "upgrade this one"),
    ([[1]], "the first two required"),
    ("not an array", "expected an array"),
])
def test_one_bad_request_in_a_batch_is_rejected_alone(bad_params, message):
    msg = decode(_frame(op="submit", model="m", requests=[[1, GOOD_PARAMS], ["bad", bad_params], [2, GOOD_PARAMS]]))
    good1, bad, good2 = msg.requests
    assert type(good1) is type(good2) is Envelope and (good1.request_id, good2.request_id) == (1, 2)
    assert type(bad) is Rejected and bad.request_id == "bad" and message in bad.message


BAD_ROLES = ["", "user<|im_end|>", "user\nsystem", "us er", "1st", "-x", "a" * 33, "naïve", "user:"]


@pytest.mark.parametrize("role", BAD_ROLES)
def test_a_chat_role_that_is_not_a_name_is_refused_at_every_entry_point_naming_the_message(role):
    """One rule for a chat message's role (protocol.validation.as_role, the gateway's too): a name
    of letters, digits, '_' and '-', at most 32. The Python SDK and ``slotserve run`` rows build
    ``RequestParams``; a peer that skipped the check gets that request rejected off the wire."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    says = "chat message 1 role must be a name such as 'user', 'assistant' or 'system'"
    for build in (lambda: RequestParams(messages, 2), lambda: RequestParams.from_mapping(
            {"messages": messages, "max_tokens": 2}), lambda: RequestParams([("user", "hi"), (role, "x")], 2)):
        with pytest.raises(ValueError) as e:
            build()
        assert str(e.value).startswith(says) and f"got {role!r:.40}" in str(e.value), str(e.value)
    (bad,) = decode(_frame(op="submit", model="m", requests=[[1, [[["user", "hi"], [role, "x"]], 2]]])).requests
    assert type(bad) is Rejected and says in bad.message


def test_any_name_is_a_role():
    # ("tool" too, whose message answers a call: test_duplicate_tool_answers)
    for role in ("user", "assistant", "system", "developer", "function", "ipython", "observation", "wizard",
                 "_x", "a-b_2", "A" * 32):
        assert RequestParams([{"role": role, "content": "x"}], 2).prompt[0].role == role


def test_request_fields_travel_by_position_new_ones_last():
    """An older peer's shorter array gets the defaults of the fields it lacks."""
    (entry,) = decode(_frame(op="submit", model="m", requests=[[1, [[1, 2], 5, None]]])).requests
    assert entry.params == P([1, 2], 5, stop_token=None)


def test_resume_tokens_that_complete_the_request_are_rejected():
    (entry,) = decode(_frame(op="assign", requests=[[7, [[1], 2], [5, 6]]])).requests
    assert type(entry) is Rejected and "already complete" in entry.message


def test_op_not_allowed_on_socket():
    with pytest.raises(ProtocolError) as ei:
        decode(encode(Register("m", 1, 1)), CLIENT_TO_BROKER)
    assert ei.value.code is ErrorCode.UNKNOWN_OP
    with pytest.raises(ProtocolError):
        decode(encode(Submit("m", [])), WORKER_TO_BROKER)
    with pytest.raises(ProtocolError):
        decode(encode(Assign([])), BROKER_TO_CLIENT)


def test_too_large():
    data = encode(Submit("m", [Envelope(1, P(list(range(1000)), 5))]))
    with pytest.raises(ProtocolError) as ei:
        decode(data, max_bytes=100)
    assert ei.value.code is ErrorCode.TOO_LARGE


def test_peek_request_ids_best_effort():
    bad = _frame(op="submit", model="m", requests=[[1, [[1, "x"], 2]], ["b"], {"no": "id"}, 7, [1.5]])
    assert peek_request_ids(bad) == [1, "b"]
    assert peek_request_ids(b"\xc1garbage") == []
    assert peek_request_ids(msgpack.packb([1])) == []


def _decodes_or_refuses_with_a_code(data: bytes) -> None:
    """The codec's promise for any bytes: a ProtocolError with a code, or a valid
    message -- one that encodes again and decodes to the same op. Any other
    exception fails the test: decode has no catch-all that would hide it."""
    try:
        msg = decode(data)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode) and e.message
        return
    again = decode(encode(msg))
    assert type(again) is type(msg)
    if not any(type(r) is Rejected for r in getattr(msg, "requests", ())):
        assert again == msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_protocol_error(data):
    _decodes_or_refuses_with_a_code(data)


json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=10),
              st.binary(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children,
                                                                               max_size=4)),
    max_leaves=20)


@st.composite
def own_fields(draw):
    """An op with garbage in (mostly) its own fields."""
    cls = draw(st.sampled_from(list(MESSAGE_TYPES.values())))
    names = [f.name for f in dataclasses.fields(cls)] + ["bogus"]
    return cls.op.value, draw(st.dictionaries(st.sampled_from(names), json_like, max_size=len(names)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(own_fields())
def test_structured_garbage_only_ever_raises_protocol_error(op_fields):
    op, fields = op_fields
    _decodes_or_refuses_with_a_code(_frame(op=op, **fields))


def _paths(value, path=()):
    """Every position inside a decoded frame (its maps' values, its arrays' items)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    return [*value[:head], _replaced(value[head], rest, new), *value[head + 1:]]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.data())
def test_one_value_anywhere_in_a_valid_frame_replaced_by_garbage(msg, data):
    raw = msgpack.unpackb(encode(msg), raw=False)
    path = data.draw(st.sampled_from([p for p in _paths(raw) if p[:1] not in (("v",), ("op",))]))
    _decodes_or_refuses_with_a_code(msgpack.packb(_replaced(raw, path, data.draw(json_like)), use_bin_type=True))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(json_like, st.lists(json_like, max_size=12)), max_size=4))
def test_garbage_request_entries_fail_alone_or_the_frame_with_a_code(entries):
    _decodes_or_refuses_with_a_code(_frame(op="submit", model="m", requests=entries))


def test_no_config_takes_a_frame_limit_that_no_control_message_fits():
    """The kind of the fuzzer's finding (test_fuzz): a frame limit below MIN_MESSAGE_BYTES
    is refused wherever one is set, not only when announced on the wire."""
    from broker import BrokerConfig
    from worker.config import WorkerConfig

    for config in (BrokerConfig, WorkerConfig):
        with pytest.raises(ValueError, match=f"max_message_bytes must be an int >= {MIN_MESSAGE_BYTES}"):
            config(max_message_bytes=MIN_MESSAGE_BYTES - 1)
        assert config(max_message_bytes=MIN_MESSAGE_BYTES).max_message_bytes == MIN_MESSAGE_BYTES


def test_no_broker_config_announces_a_heartbeat_interval_that_busy_loops_its_peers():
    """Same kind, the other announced value: peers heartbeat at the broker's interval."""
    from broker import BrokerConfig

    with pytest.raises(ValueError, match=f"heartbeat_interval_s must be >= {MIN_HEARTBEAT_INTERVAL_S}"):
        BrokerConfig(heartbeat_interval_s=MIN_HEARTBEAT_INTERVAL_S / 10)
    assert BrokerConfig(heartbeat_interval_s=MIN_HEARTBEAT_INTERVAL_S).heartbeat_interval_s == MIN_HEARTBEAT_INTERVAL_S


@pytest.mark.parametrize("params, prompt_len", [(P([1, 2, 3], 2), None), (P("some text", 2), 3),
                                                (P([{"role": "user", "content": "hi"}], 2), 3)])
def test_context_exceeded_has_its_own_code_for_every_prompt_kind(params, prompt_len):
    # token ids and text got the same ValueError, sent on the wire as bad_request, while the gateway
    # said invalid_value for ids: one ValueError subclass with a code makes every path say the same
    from protocol.errors import ContextLengthError
    from protocol.request import ModelLimits

    with pytest.raises(ContextLengthError, match=r"exceeds the served context of 4 tokens \(--max-model-len\)") as e:
        ModelLimits(max_seq_len=4).check(params, prompt_len)
    assert isinstance(e.value, ValueError) and e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    ModelLimits(max_seq_len=5).check(params, prompt_len)  # exactly full is fine
    fin = Finished(1, FinishReason.ERROR, e.value.code, str(e.value))
    assert decode(encode(Results(ids=[], tokens=[], finished=[fin]))).finished == (fin,)


def test_error_code_takes_an_error_code_only():
    from protocol.errors import ContextLengthError, error_code

    assert error_code(ContextLengthError("long"), ErrorCode.INTERNAL) is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    for foreign in (type("E", (ValueError,), {"code": "E42"})(), type("H", (OSError,), {"code": 404})(), KeyError("k"),
                    None):
        assert error_code(foreign, ErrorCode.INTERNAL) is ErrorCode.INTERNAL
        assert error_code(foreign, None) is None


_HEAD = b"\x82\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa2op"  # a map of two: v, then op's value follows
UNREADABLE = {  # a frame msgpack cannot read -> our words for it (msgpack's: StackError, ExtraData, ...)
    "nested past 1,024 levels": (_HEAD + b"\x91" * 1100 + b"\xc0", "it nests arrays and maps more than 1,024 levels"),
    "maps nested past it": (b"\x81\xa1a" * 1100 + b"\xc0", "it nests arrays and maps more than 1,024 levels"),
    "a reserved byte": (b"\xc1", "it holds a byte that starts no msgpack value"),
    "bytes after the map": (msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello"}) + b"\x00", "more bytes follow"),
    "empty": (b"", "it ends inside a value"),
    "cut in a string": (_HEAD + b"\xa5hel", "it ends inside a value"),
    "a string that is no UTF-8": (_HEAD + b"\xa1\xed", "a string in it is not valid UTF-8"),
    "an array as a key": (b"\x81\x91\x01\x01", "a map's key is an array, not a string"),
    # (each said 'a map's key is an array or a map (keys are strings or numbers)': msgpack takes string keys alone)
    "an integer as a key": (msgpack.packb({1: 2}), "a map's key is an integer, not a string"),
    "a float as a key": (msgpack.packb({1.5: 2}), "a map's key is a float, not a string"),
    "nil as a key": (msgpack.packb({None: 2}), "a map's key is nil, not a string"),
    "a boolean as a key": (msgpack.packb({True: 2}), "a map's key is a boolean, not a string"),
    "a map as a key": (b"\x81\x81\xa1a\x01\x01", "a map's key is a map, not a string"),
    "a length past the frame": (b"\xdd\xff\xff\xff\xff", "an array, map, string or binary claims more entries"),
    "a bad timestamp": (b"\xd5\xff\x00\x00", "its bytes are no msgpack value"),
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_a_frame_msgpack_cannot_read_is_malformed_in_our_words(name):
    # a frame nested past msgpack's 1,024 levels answered 'not a msgpack message (StackError)': a library's
    # exception name reached the peer (ExtraData, FormatError, ValueError likewise)
    data, says = UNREADABLE[name]
    with pytest.raises(ProtocolError) as e:
        decode(data)
    assert e.value.code is ErrorCode.MALFORMED and e.value.message.startswith("not a msgpack message: " + says), \
        e.value.message
    assert not any(w in e.value.message for w in ("Error", "ExtraData", "Unpack", "strict_map_key", "max_")), \
        e.value.message


def test_the_broker_answers_an_unreadable_frame_in_our_words_on_both_sockets():
    from broker.outbox import Side
    from protocol.messages import Error
    from tests.support.cores import C1, W1, make_core, sent

    data = UNREADABLE["nested past 1,024 levels"][0]
    with pytest.raises(ProtocolError) as e:
        decode(data)
    core = make_core()
    for side, answer in ((Side.FRONTEND, core.on_frontend_error), (Side.BACKEND, core.on_backend_error)):
        peer = C1 if side is Side.FRONTEND else W1
        (reply,) = sent(answer(peer, e.value, peek_request_ids(data), 0.5), side, peer, Error)
        assert reply.code is ErrorCode.MALFORMED and "StackError" not in reply.message, reply
        assert reply.message == "not a msgpack message: it nests arrays and maps more than 1,024 levels deep", reply
