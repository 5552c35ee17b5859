"""An error can always be written (gateway/errors.py): a message or field name holding a lone surrogate
(half a UTF-16 pair: UTF-8 cannot encode it) made pydantic's JSON writer refuse the whole error
("Error serializing to JSON: UnicodeEncodeError: ... surrogates not allowed"), so the answer meant to
say what was wrong became a 500, or a stream ended without its error event. Such a character is now
written as its escape, the six characters ``\\ud800``, in every shape the gateway writes an error in."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")

from gateway.errors import APIError, bad_request, writable  # noqa: E402
from gateway.responses import error_response, json_response, sse  # noqa: E402

LONE = "\ud800"


def test_writable_escapes_only_what_utf8_cannot_encode():
    assert writable("é ok 😀") == "é ok 😀"
    assert writable(f"a{LONE}b\udfff") == "a\\ud800b\\udfff"


def test_every_shape_of_an_error_with_a_lone_surrogate_is_written():
    e = bad_request(f"field {LONE} is wrong, é", f"messages.0.{LONE}")
    assert json.loads(e.to_json())["error"] == {
        "message": "field \\ud800 is wrong, é", "type": "invalid_request_error", "param": "messages.0.\\ud800",
        "code": "invalid_value"}
    assert json.loads(error_response(e).body)["error"]["message"] == "field \\ud800 is wrong, é"
    assert json.loads(sse(e.body())[len(b"data: "):])["error"]["param"] == "messages.0.\\ud800"  # a stream's error
    assert json.loads(json_response(e.anthropic_body()).body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.0.\\ud800: field \\ud800 is wrong, é"}}
    assert str(e) == "field \\ud800 is wrong, é"  # (a log line, or a message built from it)


def test_a_message_or_field_set_later_is_written_too():
    """The translations rename ``param`` and the embeddings route rewrites ``message`` after the
    error is made: the same rule holds for what they set."""
    e = APIError(404, "fine")
    e.message, e.param = f"model `{LONE}` does not exist", f"input[{LONE}]"
    assert json.loads(e.to_json())["error"]["message"] == "model `\\ud800` does not exist"
    assert json.loads(json_response(e.anthropic_body()).body)["error"] == {
        "type": "not_found_error", "message": "input[\\ud800]: model `\\ud800` does not exist"}
