"""An unknown key of a nested object is an unknown field, as an unknown top-level field is: chat's
``tools[].function``, ``response_format``, ``response_format.json_schema`` and ``structured_outputs``,
the Responses API's ``text`` and ``text.format`` each wrote the keys it was not given as a Python list,
whole and twice ('text takes format and verbosity, not [\\'kkk...\\']' and ``param`` ``text.kkk...``,
a 5,000-character key 10 kB of answer; "not ['a\\'\\"\\x00é']"), with ``code`` ``invalid_value``, and a
``text.format`` of type text or json_object took any key (its ``json_schema`` was served, or refused
in ``response_format``'s words). Now each is ``unknown_parameter`` naming ``where.key``, the key
clipped, and saying what the object takes (gateway.errors.unknown_key, the Responses API's own words
there). Over the gateway's handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_error_field_names import BODIES, routes_app  # noqa: E402
from tests.support.gateway import error_of, served  # noqa: E402
from tests.support.scripted import ScriptedClient  # noqa: E402

C, P, R = "/v1/chat/completions", "/v1/completions", "/v1/responses"
FN = {"name": "f", "parameters": {"type": "object"}}
SCHEMA = {"name": "a", "schema": {"type": "object"}}
LONG = "k" * 5000
CLIPPED = "k" * 100 + "… (5000 characters)"

CASES = [  # (route, where, the body's fields with the unknown key k, what the message says the object takes)
    (C, "tools.0.function", lambda k: {"tools": [{"type": "function", "function": {**FN, k: 1}}]},
     "name, description, parameters and strict"),
    (C, "tools.0", lambda k: {"tools": [{"type": "function", "function": FN, k: 1}]}, "type and function"),
    (C, "response_format", lambda k: {"response_format": {"type": "text", k: 1}}, "type and json_schema"),
    (P, "response_format", lambda k: {"response_format": {"type": "json_object", k: 1}}, "type and json_schema"),
    (C, "response_format.json_schema",
     lambda k: {"response_format": {"type": "json_schema", "json_schema": {**SCHEMA, k: 1}}},
     "name, schema, strict and description"),
    (C, "structured_outputs", lambda k: {"structured_outputs": {"regex": "a", k: 1}}, "one of choice, grammar"),
    (R, "text", lambda k: {"text": {k: 1}}, "format and verbosity"),
    (R, "text.format", lambda k: {"text": {"format": {"type": "text", k: 1}}}, "type alone with type text"),
    (R, "text.format", lambda k: {"text": {"format": {"type": "json_object", k: 1}}},
     "type alone with type json_object"),
    (R, "text.format", lambda k: {"text": {"format": {"type": "json_schema", **SCHEMA, k: 1}}},
     "type, name, schema, strict and description"),
]


@pytest.fixture(scope="module")
def http():
    client = ScriptedClient()
    with served(routes_app(client), client) as h:
        yield h


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key, shown", [("foo", "foo"), ("a'\"\x00é", "a'\"\x00é"), (LONG, CLIPPED)],
                         ids=["plain", "quotes", "long"])
@pytest.mark.parametrize("path, where, body, takes", CASES, ids=[f"{p}:{w}:{i}" for i, (p, w, *_) in enumerate(CASES)])
def test_an_unknown_nested_key_is_an_unknown_field_named_clipped(http, path, where, body, takes, key, shown, stream):
    r = http.post(path, json={**BODIES[path], **body(key), "stream": stream})
    e = error_of(r, 400)
    field = f"{where}.{shown}"
    assert (e["param"], e["code"]) == (field, "unknown_parameter"), e
    said = f"Unknown parameter: '{field}'" if path == R and where.startswith("text") else \
        f"Unrecognized request argument supplied: {field}"
    assert e["message"].startswith(f"{said} ({where} takes {takes}"), e  # (was "..., not ['foo']", code invalid_value)
    assert len(r.content) < 1000, len(r.content)  # (the 5,000-character key was written twice: 10 kB)


@pytest.mark.parametrize("fmt", [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", **SCHEMA}])
def test_each_text_format_openai_takes_is_served(http, fmt):
    r = http.post(R, json={**BODIES[R], "text": {"format": fmt, "verbosity": "low"}})
    assert r.status_code == 200, r.text
