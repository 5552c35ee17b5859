"""Blast radius, kind "a client's string echoed whole in an error": an unknown_model reply echoed
a 100 KB model name whole, and for an empty name suggested `slotserve worker --model ` with
nothing after it. Every message that echoes what a client sent goes through
protocol.validation.clip / echo (the first 100 characters and '… (N characters)'); an empty
model name gets its own message. Members: the broker's unknown_model and queue_full replies
(the wire), the SDK's UnknownModelError and wait_for_model timeout, the gateway's 404 (HTTP),
a JSONL row's unknown field, an unknown enum value on the wire, an endpoint."""

from __future__ import annotations

import pytest

from broker.outbox import Side
from client.errors import UnknownModelError
from gateway.link import not_found
from protocol.enums import ErrorCode
from protocol.messages import Results, Submit
from protocol.request import RequestParams
from protocol.validation import ECHO_MAX_CHARS, clip, echo
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
