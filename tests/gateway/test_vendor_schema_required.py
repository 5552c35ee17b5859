"""A structured output's schema, which Anthropic's ``output_config.format`` and the Responses API's
``text.format`` require (the SDKs' ``JSONOutputFormatParam.schema`` and
``ResponseFormatTextJSONSchemaConfigParam.schema``: ``Required[Dict]``), is a 400 naming it when
null or absent, whole, streamed and in ``count_tokens``; chat's ``response_format.json_schema.schema``,
optional in OpenAI's chat API, still means any JSON object when left out.

Before, ``"schema": null`` on /v1/messages, and a ``text.format`` of type ``json_schema`` without a
schema (or with null) on /v1/responses, were served as chat's optional schema: any JSON object, where
the client had meant a schema and lost it. Over the gateway's handlers and a scripted broker client:
no sockets, no processes."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_json_in_strings import handlers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import served  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object"}


@pytest.fixture(scope="module")
def http():
    client = OutputClient(defaultdict(lambda: "{}"))
    with served(handlers(client), client) as h:
        yield h, client


@pytest.mark.parametrize("path, stream", [("/v1/messages", False), ("/v1/messages", True),
                                          ("/v1/messages/count_tokens", False)], ids=["whole", "streamed", "count"])
def test_a_null_messages_schema_is_anthropics_400(http, path, stream):
    h, _ = http
    body = {"model": "m", "messages": CHAT, "output_config": {"format": {"type": "json_schema", "schema": None}}}
    if path == "/v1/messages":
        body.update(max_tokens=4, stream=stream)
    r = h.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"type": "invalid_request_error", "message": "output_config.format.schema: Input "
                                 "should be an object (a JSON schema); got null"}, r.text
    body["output_config"]["format"]["schema"] = SCHEMA
    assert h.post(path, json=body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt, code, says", [
    ({"type": "json_schema", "name": "x"}, "missing_required_parameter", "Missing required parameter: "
                                                                         "'text.format.schema'"),
    ({"type": "json_schema", "name": "x", "schema": None}, "invalid_type", "Invalid type for 'text.format.schema': "
                                                                           "expected an object"),
], ids=["absent", "null"])
def test_a_responses_schema_absent_or_null_is_openais_400(http, fmt, code, says, stream):
    h, _ = http
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": stream, "text": {"format": {**fmt}}}
    r = h.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["param"], e["code"]) == ("text.format.schema", code) and e["message"].startswith(says), e
    body["text"]["format"]["schema"] = SCHEMA
    assert h.post("/v1/responses", json=body).status_code == 200


def test_chats_optional_schema_is_still_any_json_object(http):
    h, client = http
    r = h.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4,
                                             "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 200, r.text
    assert client.submitted[-1].structured is not None
