"""Blast radius, kind "a client's string echoed whole in an error": an unknown_model reply echoed
a 100 KB model name whole, and for an empty name suggested `slotserve worker --model ` with
nothing after it. Every message that echoes what a client sent goes through
protocol.validation.clip / echo (the first 100 characters and '… (N characters)'); an empty
model name gets its own message. Members: the broker's unknown_model and queue_full replies
(the wire), the SDK's UnknownModelError and wait_for_model timeout, the gateway's 404 (HTTP),
a JSONL row's unknown field, an unknown enum value on the wire, an endpoint."""

from __future__ import annotations

import pathlib
import re

import msgpack
import pytest

from broker.outbox import Side
from client.errors import UnknownModelError
from gateway.link import not_found
from protocol.codec import decode
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.messages import PROTOCOL_VERSION, Results, Submit
from protocol.request import RequestParams
from protocol.structured import check_structured
from protocol.validation import ECHO_MAX_CHARS, as_int, clip, echo
from tests.support.cores import C1, make_core, sent
from tests.support.messages import envelope

LONG = "m" * 100_000


def test_clip_and_echo():
    assert clip("short") == "short" and echo("short") == "'short'"
    assert clip(LONG) == "m" * ECHO_MAX_CHARS + "… (100000 characters)"
    assert echo(LONG) == repr("m" * ECHO_MAX_CHARS) + "… (100000 characters)"
    assert echo(list(range(10_000))).endswith("characters)") and len(echo(list(range(10_000)))) < 140


def _unknown(model: str) -> str:
    core = make_core(register_grace_s=0)  # no start-up grace: unknown at once
    out = core.on_frontend(C1, Submit(model, [envelope("a", [1, 2], 4)]), 0.0)
    (fin,) = [f for r in sent(out, Side.FRONTEND, C1, Results) for f in r.finished]
    assert fin.code is ErrorCode.UNKNOWN_MODEL
    return fin.message


def test_the_brokers_unknown_model_reply_is_short():
    words = _unknown(LONG)
    assert len(words) < 400 and "(100000 characters)" in words and "start a worker for it" in words
    assert "--model m" not in words  # no command with a name cut short


def test_an_empty_model_name_has_its_own_message():
    words = _unknown("")
    assert words.startswith("the request names no model (an empty name); name one (served: none")
    assert "--model" not in words
    e = UnknownModelError("", "tcp://127.0.0.1:5555", {"a": 1}, ())
    assert "(an empty name); name one (served: a; loading: none)" in str(e) and "--model" not in str(e)
    assert not_found("", {"a": "loaded"}) == "The request names no model (an empty name): name one (models: a)"


def test_the_sdk_and_the_gateway_echo_a_long_name_short():
    e = str(UnknownModelError(LONG, "tcp://127.0.0.1:5555", {}, ()))
    assert len(e) < 400 and "(100000 characters)" in e and "start a worker for it" in e
    words = not_found(LONG, {"a": "loaded"})
    assert len(words) < 300 and words.startswith(f"The model `{'m' * ECHO_MAX_CHARS}… (100000 characters)` does")
    short = str(UnknownModelError("nope", "tcp://127.0.0.1:5555", {}, ()))
    assert "model 'nope'" in short and "slotserve worker --model nope" in short  # a short name: as before


def test_a_rows_unknown_field_is_echoed_short():
    with pytest.raises(ValueError) as e:
        RequestParams.from_mapping({"max_tokens": 1, "prompt": [1], LONG: 1})
    assert "(100000 characters)" in str(e.value) and len(str(e.value)) < 2000


# Silent cuts (the kind's second pass): a client's value shown in an error was cut short at 20-200
# characters with no mark, by a slice (json_shown's json.dumps(value)[:40], the Responses API's
# _one_of at 60, a Content-Type at 80) or a format precision ({value!r:.80}); each now goes through
# clip / echo, so a cut value says it was cut and how long it was.

_SOURCES = ("gateway", "protocol", "broker", "worker", "client", "slotserve")
_SILENT_CUT = re.compile(r"""
      ![rsa]:\.\d+\}            # {value!r:.80}: a repr cut by precision
    | \{[^{}:!]+:\.\d+\}        # {value:.40}: a string cut by precision (a float's has a type: {x:.2f})
    | \[:\d+\]!r\}              # {value[:80]!r}
    | json\.dumps\([^()]*\)\[:\d+\]   # json.dumps(value)[:40]
    | \(map\(str,\ [^()]*\)\)\[:\d+\]  # sorted(map(str, keys))[:8]
""", re.X)


def test_no_error_message_cuts_a_value_without_saying_so():
    root = pathlib.Path(__file__).resolve().parents[2]
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}" for folder in _SOURCES
             for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if _SILENT_CUT.search(line)]
    assert not found, "cut with clip/echo (protocol.validation), which mark the cut:\n" + "\n".join(found)


def _marked(words: str, length: int) -> bool:
    return f"… ({length} characters)" in words and len(words) < 1000


def test_json_shown_and_the_bodies_shown_values_mark_the_cut():
    from gateway.messages_body import json_shown
    from gateway.schemas import _shown

    assert json_shown("short") == '"short"' and _shown(5) == "5"  # short: whole, as before
    assert _marked(json_shown(LONG), len(LONG) + 2) and _marked(_shown(LONG), len(LONG) + 2)


def test_the_responses_api_one_of_marks_the_cut():
    from gateway.errors import APIError
    from gateway.responses_api import _one_of

    with pytest.raises(APIError) as e:
        _one_of(LONG, ("auto", "none"), "truncation")
    assert e.value.message.startswith(f"Invalid value: '{'m' * ECHO_MAX_CHARS}… (100000 characters)'.")
    with pytest.raises(APIError) as e:
        _one_of(["x" * 500], ("auto", "none"), "truncation")
    assert _marked(e.value.message, 504)


@pytest.mark.parametrize("headers, length", [
    ({"content-type": "text/" + "x" * 500}, 505),
    ({"content-type": "application/json; charset=" + "x" * 500}, 500),
    ({"content-type": "application/json", "content-encoding": "x" * 500}, 500),
])
def test_the_gateways_header_refusals_mark_the_cut(headers, length):
    from starlette.datastructures import Headers

    from gateway.errors import APIError
    from gateway.generate import _check_json_body_headers

    with pytest.raises(APIError) as e:
        _check_json_body_headers(Headers(headers))
    assert _marked(e.value.message, length)


@pytest.mark.parametrize("build", [
    lambda: RequestParams.from_mapping({"max_tokens": 1, "messages": [LONG]}),                 # protocol.request
    lambda: RequestParams.from_mapping({"max_tokens": 1, "prompt": [1], "include_stop_str_in_output": LONG}),
    lambda: check_structured({LONG: 1, "b": 2}),                                               # protocol.structured
    lambda: check_structured({"choice": ["a", [LONG]]}),
    lambda: check_structured({LONG: True}),
    lambda: as_int(LONG, "n"),                                                                  # protocol.validation
    lambda: decode(msgpack.packb({"v": PROTOCOL_VERSION, "op": LONG})),                        # protocol.codec
    lambda: decode(msgpack.packb({"v": LONG, "op": "submit"})),
])
def test_each_protocol_refusal_marks_the_cut(build):
    with pytest.raises((ValueError, ProtocolError)) as e:
        build()
    assert "characters)" in str(e.value) and len(str(e.value)) < 1000, str(e.value)[:300]


# Kind "a client's number echoed whole in an error": the request's range checks and the gateway's own
# wrote a 300-digit number whole (f"{value}", f"{value!r}"), and an int past Python's limit on the digits
# str() writes (4,300) failed their f-string with Python's words ("Exceeds the limit (4300 digits) for
# integer string conversion; use sys.set_int_max_str_digits() ..."), or "must be a number, got int".
NUMBER, HUGE = 10**300, 10**5000
_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "temperature", "top_p", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "timeout_s")


@pytest.mark.parametrize("field", _FIELDS)
@pytest.mark.parametrize("number", [NUMBER, -NUMBER, HUGE, -HUGE], ids=["long", "-long", "huge", "-huge"])
def test_each_request_number_is_echoed_cut_or_by_its_size(field, number):
    try:
        RequestParams.from_mapping({"max_tokens": 3, "prompt": [1], field: number})
    except ValueError as e:
        words = str(e)
        assert words.startswith(field) and len(words) < 300 and "sys." not in words, words
        assert "… (30" in words or "an int of about 5,001 digits" in words, words
        assert "got int" not in words, words
    else:  # (a huge positive temperature, timeout or repetition penalty is one the request takes)
        assert number == NUMBER and field in ("temperature", "timeout_s", "repetition_penalty")


def test_echo_names_an_int_too_long_to_write_by_its_size():
    assert echo(HUGE) == "an int of about 5,001 digits" and echo(-HUGE) == "an int of about 5,001 digits"
    assert echo(10**4299) == clip(str(10**4299), ECHO_MAX_CHARS + 2)  # (within the limit: its digits, cut)
    with pytest.raises(ValueError, match=r"got an int of about 5,001 digits"):
        as_int(HUGE, "n")
    with pytest.raises(ValueError, match=r"n must be a finite number, got an int of about 5,001 digits, past a double"):
        from protocol.validation import as_float
        as_float(HUGE, "n")


def test_an_embedding_s_dimensions_are_echoed_cut():
    from protocol.embedding import truncate

    with pytest.raises(ValueError) as e:
        truncate([1.0, 2.0], NUMBER)
    assert _marked(str(e.value), 301)
