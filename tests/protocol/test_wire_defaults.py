"""Trailing defaults left out on the wire (issue 30): :func:`protocol.request.to_wire` and the
envelopes of ``submit`` / ``assign`` (:func:`protocol.codec.encode`) drop the fields after the last
one that differs from its default (a request's ``stop_token`` always kept), and the decoder gives
them back.

- every option, set alone to a value other than its default, survives the round trip with its
  type, and the array stops right after it (or after ``stop_token``, always kept);
- arrays with every field given (as encoders sent them before, and as an older peer may) decode to
  the same requests as the short ones;
- the decoder's path for ``[prompt, max_tokens, stop_token]`` gives what the constructor's general
  path gives, values and errors alike.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import request as rq
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.messages import PROTOCOL_VERSION, Assign, Envelope, Rejected, Submit
from protocol.request import DEFAULT, RequestParams
from tests.protocol.test_decode_hot_paths import ANY_VALUE, _outcome
from tests.protocol.test_protocol import envelopes

OPTIONS = {  # one value other than the default per option
    "stop_token": (7, 2), "stop_sequences": [[1, 2]], "priority": -3, "timeout_s": 2.5, "temperature": 0.7,
    "top_p": 0.9, "top_k": 40, "seed": 0, "min_tokens": 1, "stop": ["\n"], "include_stop_str_in_output": True,
    "logit_bias": {5: -1.5}, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "min_p": 0.05, "logprobs": 0, "prompt_logprobs": 2, "structured": {"regex": "a+"}, "tools": None, "clamp_max_tokens": True,
    "suffix": "\n    return x", "input_extra": [{"filename": "a.py", "text": "x = 1"}], "kind": "embed",
    "chat_template_kwargs": '{"enable_thinking":false}', "continue_final_message": True, "add_generation_prompt": False,
}


def _types(params):
    return tuple(map(type, params))


def _round_trip(params: RequestParams) -> RequestParams:
    (entry,) = decode(encode(Assign([Envelope(1, params)]))).requests
    return entry.params


def test_every_option_is_dropped_at_its_default_and_kept_otherwise():
    assert set(OPTIONS) | {"prompt", "max_tokens"} == set(RequestParams._fields)
    plain = RequestParams([1, 2, 3], 4)
    assert rq.to_wire(plain) == ((1, 2, 3), 4, DEFAULT) and _round_trip(plain) == plain
    assert rq.to_wire(RequestParams([1, 2, 3], 4, stop_token=None)) == ((1, 2, 3), 4, ())
    for name, value in OPTIONS.items():
        if name == "tools":
            params = RequestParams([{"role": "user", "content": "hi"}], 4, tools='[{"type": "function", '
                                   '"function": {"name": "f", "parameters": {"type": "object"}}}]')
        elif name in ("chat_template_kwargs", "continue_final_message", "add_generation_prompt"):  # (a chat prompt)
            params = RequestParams([{"role": "user", "content": "hi"}], 4, **{name: value})
        elif name == "kind":  # (an embedding: max_tokens 1)
            params = RequestParams([1, 2, 3], 1, kind=value)
        elif name in ("suffix", "input_extra"):  # (fill in the middle: a text prompt, and a suffix)
            params = RequestParams("def f(x):", 4, **{"suffix": OPTIONS["suffix"], name: value})
        else:
            params = RequestParams([1, 2, 3], 4, **{name: value})
        wire = rq.to_wire(params)
        assert len(wire) == max(3, RequestParams._fields.index(name) + 1), name  # cut right after it
        back = _round_trip(params)
        assert back == params and _types(back) == _types(params), name


def test_options_given_as_their_defaults_in_another_type_are_normalised_and_left_out():
    """A value equal to its default but of another type is normalised when the request is built (or
    refused), so what is left out is the default itself, and the far side decodes the same types."""
    params = RequestParams([1], 2, temperature=0, top_p=1, repetition_penalty=1, min_p=0, presence_penalty=0,
                           frequency_penalty=0, priority=0, top_k=0, min_tokens=0, logit_bias={}, stop=[],
                           stop_sequences=[])
    assert rq.to_wire(params) == ((1,), 2, DEFAULT)
    assert _types(_round_trip(params)) == _types(params) == _types(RequestParams([1], 2))
    for name in ("priority", "top_k", "min_tokens", "include_stop_str_in_output"):
        with pytest.raises(ValueError, match=name):
            RequestParams([1], 2, **{name: 0.0 if name == "include_stop_str_in_output" else False})


@settings(max_examples=300, deadline=None)
@given(st.lists(envelopes(), min_size=1, max_size=4))
def test_short_and_full_arrays_decode_alike(entries):
    """What the encoder sends and the same envelopes with every field given (nothing left out) decode to
    the same messages, field types included."""
    msg = Submit("m", entries)
    short = decode(encode(msg))
    full = msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "m",
                          "requests": [[e.request_id, list(e.params), list(e.resume_tokens), e.time_left_s]
                                       for e in entries]})
    assert short == msg == decode(full)
    for a, b in zip(short.requests, decode(full).requests):
        assert _types(a.params) == _types(b.params) and type(a.time_left_s) is type(b.time_left_s)
    for wire in msgpack.unpackb(encode(msg), raw=False)["requests"]:
        assert 2 <= len(wire) <= 4 and 3 <= len(wire[1]) <= len(RequestParams._fields)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(st.integers(0, 9), max_size=3).map(tuple), ANY_VALUE), st.one_of(ANY_VALUE, st.just(4)),
       st.one_of(ANY_VALUE, st.just(DEFAULT), st.lists(st.integers(-1, 9), max_size=3).map(tuple)))
def test_three_values_decode_as_the_constructor_builds_them(prompt, max_tokens, stop_token):
    values = (prompt, max_tokens, stop_token)
    assert _outcome(rq.from_wire, values) == _outcome(rq._build, RequestParams, values, {})


def test_a_short_envelope_with_bad_parameters_fails_alone():
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "m",
                           "requests": [[1, [[1, 2], 3]], [2, [[1, 2], 0, None]], [3, [[1], 2, "nope"]]]})
    ok, zero, nope = decode(frame).requests
    assert ok == Envelope(1, RequestParams([1, 2], 3))
    assert type(zero) is Rejected and zero.request_id == 2 and "max_tokens" in zero.message
    assert type(nope) is Rejected and nope.request_id == 3 and "stop_token" in nope.message
    with pytest.raises(ProtocolError):  # an envelope of one value names no parameters: the frame fails
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "m", "requests": [[1]]}))
