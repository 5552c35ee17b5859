"""The decoder's hot paths (issue 30) give what the general checks give: the same values, of the
same types, and the same errors.

- an array of records is checked a column at a time (:func:`protocol.codec._records`) where
  every record has all its fields: compared with each record checked alone;
- an array of envelopes takes its common case inline (:func:`protocol.codec._envelopes`):
  compared with :func:`protocol.codec._envelope` per entry;
- :func:`protocol.request.from_wire` compares the types of the numeric options only: compared
  with the constructor's own path (:func:`protocol.request._build`);
- ``RequestParams(prompt, max_tokens, stop_token=...)`` (a client's hot path): compared with the
  constructor's general path.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol import request as rq
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import PROTOCOL_VERSION, WORKER_TO_BROKER, Envelope, Finished, Rejected, Started, Text
from protocol.request import RequestParams

# Values a peer may send in any field: valid ones of several fields, and wrong ones.
ANY_VALUE = st.sampled_from([0, 1, 3, -1, 2**64 - 1, 0.0, -0.0, 1.0, 0.5, float("inf"), False, True, None, (),
                             (1, 2), "stop", "length", "error", "bad_request", "nope", "", b"x", {}, {"a": 1},
                             "x" * 300])


def _outcome(fn, *args):
    """``fn(*args)``'s value with the type of each of its fields, or its error's type and message."""
    try:
        value = fn(*args)
    except (ProtocolError, ValueError, TypeError) as e:
        return type(e).__name__, getattr(e, "code", None), str(e)
    return value, _types(value)


def _types(value):
    if isinstance(value, tuple):
        return type(value), tuple(_types(v) for v in value)
    return type(value)


def _one_by_one(cls, values, name):
    one = codec._record(cls)
    return tuple(one(v, name) for v in values)


FINISHED = st.tuples(st.integers(0, 9), st.sampled_from(["stop", "length", "error", "cancelled"]),
                     st.sampled_from([None, None, "model_error"]), st.sampled_from([None, "why"]),
                     st.sampled_from([None, 3]), st.sampled_from([None, 7, (1, 2), "\n"]), st.sampled_from([None, 0, 2]))


@settings(max_examples=300, deadline=None)
@given(st.lists(FINISHED, max_size=12), st.data())
def test_finished_arrays_decode_as_each_record_alone(rows, data):
    rows = [list(r) for r in rows]
    if rows and data.draw(st.booleans()):  # one value anywhere replaced by garbage, or a record cut short
        i = data.draw(st.integers(0, len(rows) - 1))
        if data.draw(st.booleans()):
            rows[i][data.draw(st.integers(0, 6))] = data.draw(ANY_VALUE)
        else:
            rows[i] = rows[i][:data.draw(st.integers(0, 6))]
    values = tuple(tuple(r) for r in rows)
    assert _outcome(codec._records(Finished), values, "finished") == _outcome(_one_by_one, Finished, values,
                                                                               "finished")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), ANY_VALUE), max_size=8),
       st.lists(st.tuples(st.integers(0, 5), ANY_VALUE, ANY_VALUE), max_size=8))
def test_text_and_started_arrays_decode_as_each_record_alone(texts, started):
    assert _outcome(codec._records(Text), tuple(texts), "texts") == _outcome(_one_by_one, Text, tuple(texts), "texts")
    assert _outcome(codec._records(Started), tuple(started), "started") == _outcome(
        _one_by_one, Started, tuple(started), "started")


def test_an_iteration_of_many_endings_decodes_to_enum_members():
    """The column path turns the finish reasons into :class:`FinishReason` members, as the record path does."""
    finished = tuple(Finished(k, FinishReason.LENGTH, None, None, 3, None, 0) for k in range(10))
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "iteration", "ids": list(range(10)), "tokens": [5] * 10,
                           "finished": [list(f) for f in finished]})
    msg = codec.decode(frame, WORKER_TO_BROKER)
    assert msg.finished == finished
    assert all(type(f) is Finished and f.finish_reason is FinishReason.LENGTH for f in msg.finished)
    for last in ([9, "done"], [9, "done", None, None, 3, None, 0]):  # cut short, or all its fields
        bad = msgpack.packb({"v": PROTOCOL_VERSION, "op": "iteration", "finished": [list(f) for f in finished[:9]] + [last]})
        with pytest.raises(ProtocolError, match="unknown value 'done'"):
            codec.decode(bad, WORKER_TO_BROKER)


def test_results_with_an_error_code_in_a_column_decode_record_by_record():
    rows = [[k, "error", "model_error", "it failed", None, None, None] for k in range(6)]
    msg = codec._records(Finished)(tuple(tuple(r) for r in rows), "finished")
    assert msg == _one_by_one(Finished, tuple(tuple(r) for r in rows), "finished")
    assert msg[0].code is ErrorCode.MODEL_ERROR


PARAMS = RequestParams([1, 2, 3], 4, stop_token=None)
WIRE_PARAMS = msgpack.unpackb(msgpack.packb(PARAMS), use_list=False)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_from_wire_agrees_with_the_constructor(data):
    """Each option replaced (or not) by a value of another type that may equal its default (``0``,
    ``0.0``, ``False``, ``-0.0``, ``None``, ``()``, ...), or the whole array cut short: the same request
    (field types included) or the same error as :class:`RequestParams`' own path."""
    values = list(WIRE_PARAMS)
    for i in data.draw(st.lists(st.integers(0, len(values) - 1), max_size=3)):
        values[i] = data.draw(ANY_VALUE)
    if data.draw(st.booleans()):
        values = values[:data.draw(st.integers(2, len(values)))]
    values = tuple(values)
    assert _outcome(rq.from_wire, values) == _outcome(rq._build, RequestParams, values, {})


def test_from_wire_checks_an_option_equal_to_its_default_but_of_another_type():
    params = rq.from_wire(WIRE_PARAMS)
    assert params == PARAMS and type(params) is RequestParams and params.stop_token == ()
    temperature = RequestParams._fields.index("temperature")
    params = rq.from_wire(WIRE_PARAMS[:temperature] + (0,) + WIRE_PARAMS[temperature + 1:])  # an int 0
    assert params == PARAMS and type(params.temperature) is float
    with pytest.raises(ValueError, match="stop_sequences"):
        rq.from_wire(WIRE_PARAMS[:3] + (0,) + WIRE_PARAMS[4:])


ENVELOPE = st.one_of(
    st.tuples(st.integers(0, 2**64 - 1), st.just(WIRE_PARAMS), st.just(()), st.none()),
    st.tuples(st.one_of(st.integers(-2, 3), st.text(max_size=3), ANY_VALUE), st.just(WIRE_PARAMS),
              st.sampled_from([(), (5,), (1, 2, 3, 4, 5), None, "x"]), st.sampled_from([None, 0.5, -1.0, 1, "x"])),
    st.tuples(st.integers(0, 9), st.sampled_from([WIRE_PARAMS[:2], WIRE_PARAMS[:2] + ("x",), (1,), "x", None,
                                                  WIRE_PARAMS[:6] + (-1.0,) + WIRE_PARAMS[7:]])),
    st.lists(ANY_VALUE, max_size=5).map(tuple),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(ENVELOPE, max_size=6))
def test_envelope_arrays_decode_as_each_envelope_alone(entries):
    entries = tuple(tuple(e) if isinstance(e, tuple) else e for e in entries)

    def each(v, name):
        return tuple(codec._envelope(x, name) for x in v)

    got, want = _outcome(codec._envelopes, entries, "requests"), _outcome(each, entries, "requests")
    assert got == want
    if isinstance(got[0], tuple):
        assert all(type(e) in (Envelope, Rejected) for e in got[0])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(st.integers(-2, 2**64), max_size=4), st.lists(st.integers(0, 9), max_size=4).map(tuple),
                 st.sampled_from(["text", "", (), [1.0], [True], [{"role": "user", "content": "hi"}]])),
       st.sampled_from([1, 4, 0, -1, 2**64, True, 4.0, "4"]),
       st.one_of(st.none(), st.integers(-1, 2**64), st.lists(st.integers(-1, 9), max_size=3),
                 st.sampled_from(["default", "x", True, 1.5, (), (3,), [3, 3, 1], {5}])))
def test_stop_token_alone_agrees_with_the_general_path(prompt, max_tokens, stop_token):
    """``RequestParams(prompt, max_tokens, stop_token=...)`` (a client's hot path): the same request
    (field types included) or the same error as the general path (here taken by also giving
    ``priority`` its default)."""
    assert _outcome(lambda *a: RequestParams(*a[:2], stop_token=a[2]), prompt, max_tokens, stop_token) == _outcome(
        lambda *a: rq._build(RequestParams, a[:2], {"stop_token": a[2], "priority": 0}), prompt, max_tokens,
        stop_token)


# A short request array as to_wire sends a plain one, [prompt, max_tokens, stop_token], or one that
# misses that path in one value (a text, empty or out-of-range prompt, a bool or float budget, a
# stop token that is not () or one id).
PLAIN = st.tuples(
    st.one_of(st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
              st.sampled_from([(), (-1,), (2**64,), (2**64 - 1,), (True,), (1.0,), "text", None, [1]])),
    st.sampled_from([4, 4, 1, 2**64 - 1, 0, -1, 2**64, True, 4.0]),
    st.sampled_from([(), (), (3,), (0,), (2**64 - 1,), (2**64,), (-1,), (True,), (2, 1), None, 5, "default"]))


@settings(max_examples=400, deadline=None)
@given(st.lists(PLAIN, max_size=6))
def test_plain_request_arrays_decode_as_each_alone(arrays):
    """:func:`protocol.request.from_wire_plain` gives what :func:`~protocol.request.from_wire` gives
    each array (field types included) when every one is on the plain path, else None."""
    arrays = tuple(arrays)
    got = rq.from_wire_plain(arrays)
    each = [_outcome(rq.from_wire, a) for a in arrays]

    def plain(a, outcome):  # valid, and as to_wire sends it: id tuples, an int budget, no stop token or one
        return (type(outcome[0]) is RequestParams and type(a[0]) is tuple and type(a[1]) is int
                and type(a[2]) is tuple and len(a[2]) <= 1 and all(type(x) is int for x in a[0] + a[2]))

    if arrays and all(map(plain, arrays, each)):
        assert got is not None
    if got is not None:
        assert [(p, _types(p)) for p in got] == each


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.integers(0, 9), st.sampled_from([-1, 2**64 - 1, "x", "", True, None, 1.0])),
                          PLAIN), max_size=6))
def test_plain_envelope_arrays_decode_as_each_envelope_alone(entries):
    """A submit of plain requests (the column path, :func:`protocol.codec._plain_envelopes`) decodes
    as each envelope alone: the same envelopes, Rejected entries and errors."""
    entries = tuple(entries)

    def each(v, name):
        return tuple(codec._envelope(x, name) for x in v)

    assert _outcome(codec._envelopes, entries, "requests") == _outcome(each, entries, "requests")


def test_a_submit_of_plain_requests_takes_the_column_path():
    entries = tuple((i, ((i + 1, 2, 3), 4, () if i % 2 else (7,))) for i in range(5))
    got = codec._plain_envelopes(entries)
    assert got == tuple(Envelope(i, RequestParams([i + 1, 2, 3], 4, stop_token=() if i % 2 else 7)) for i in range(5))
    assert all(type(e) is Envelope and type(e.params) is RequestParams for e in got)
    assert codec._plain_envelopes(entries[:4] + ((4, ((5, 2, -3), 4, ())),)) is None  # one bad id: each alone
