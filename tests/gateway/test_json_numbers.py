"""Numbers JSON cannot hold, in HTTP bodies: ``NaN``, ``Infinity``, ``-Infinity`` (not JSON, RFC 8259,
yet pydantic's parser takes them) and ``1e400`` (JSON, but past a double's range: it reads as
infinity). Numeric fields refused them already; elsewhere they rode in. Free-form values failed in a
library's words ("chat_template_kwargs must hold JSON values: Out of range float values are not JSON
compliant", for a schema, tools, template variables) naming only the top field; ``/tokenize`` and
``count_tokens`` took tool definitions holding them (to the chat template, or a 500); a tool call's
arguments written as text with ``1e400`` were submitted (a template's ``tojson`` writes ``Infinity``
into the prompt); metadata got pydantic's "Input should be a valid string (got NaN)"; a key a route
ignores (a content part's, ``/models/load``'s) took them silently. Now one check of every body
(:func:`gateway.errors.nonfinite_number`) answers a 400 naming the number's place, in the route's
error shape, before anything is submitted; a Messages ``tool_use`` block's ``input`` keeps its own
words (tests/gateway/test_messages_api.py ``OUT_OF_RANGE``).

Fast lane: the gateway's handlers over a scripted broker client, and the whole app without a broker
(tests/gateway/test_body_json.py's ``app``, every POST route).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.messages_api import MessagesEndpoints  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.response_store import ResponseStore  # noqa: E402
from gateway.responses_api import ResponsesEndpoints  # noqa: E402
from gateway.tokenize import TokenizeEndpoints  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_body_json import ANTHROPIC, app, http, post_routes  # noqa: E402,F401
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import ScriptedClient, ScriptedLink, letters  # noqa: E402

NAN_WORDS = "which is no JSON number (JSON has no NaN or Infinity, RFC 8259); send a finite number, or the value as a string"
RANGE_WORDS = "past a double's range (about 1.8e308: it reads as infinity); send a number within range, or the value as a string"
CHAT = '"messages": [{"role": "user", "content": "hi"}]'
FUNCTION = '{"type": "function", "function": {"name": "f", "parameters": %s}}'


def words(where: str, written: str) -> str:
    return f"{where} is {written}, " + (NAN_WORDS if written.lstrip("-") in ("NaN", "Infinity") else RANGE_WORDS)


@pytest.fixture
def scripted():
    client = ScriptedClient()
    link = ScriptedLink(client)
    tokenizers = Tokenizers(letters)
    gen = Generate(GatewayConfig(), link, GatewayMetrics(), tokenizers=tokenizers)
    tok = TokenizeEndpoints(link, tokenizers)
    messages = MessagesEndpoints(gen, tok)
    app = Starlette(routes=[Route("/v1/completions", gen.completions, methods=["POST"]),
                            Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
                            Route("/tokenize", tok.tokenize, methods=["POST"]),
                            Route("/v1/responses", ResponsesEndpoints(gen, ResponseStore(8, 60.0)).create,
                                  methods=["POST"]),
                            Route("/v1/messages", messages.create, methods=["POST"]),
                            Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])])
    with TestClient(app) as c:
        yield c, client
    for t in client.threads:
        t.join(10)


def post(http, path: str, body: str):
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


# (path, the body as JSON text with the number written as {x}, its place) -- every kind of field
MEMBERS = [
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "metadata": {"k": {x}}}' % CHAT, "metadata.k"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "chat_template_kwargs": {"t": [1, {x}]}}' % CHAT,
     "chat_template_kwargs.t.1"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "response_format": {"type": "json_schema", '
                             '"json_schema": {"name": "w", "schema": {"type": "number", "maximum": {x}}}}}' % CHAT,
     "response_format.json_schema.schema.maximum"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "structured_outputs": {"json": {"type": "number", '
                             '"minimum": {x}}}}' % CHAT, "structured_outputs.json.minimum"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "tools": [%s]}' % (CHAT, FUNCTION % (
        '{"type": "object", "properties": {"a": {"type": "number", "default": {x}}}}')),
     "tools.0.function.parameters.properties.a.default"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "tool_choice": "required", "tools": [%s]}' % (
        CHAT, FUNCTION % '{"type": "object", "properties": {"a": {"enum": [{x}]}}}'),
     "tools.0.function.parameters.properties.a.enum.0"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "logit_bias": {"3": {x}}}' % CHAT, "logit_bias.3"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, %s, "temperature": {x}}' % CHAT, "temperature"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "hi", "n": {x}}]}]}', "messages.0.content.0.n"),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}, '
                             '{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": '
                             '{"name": "f", "arguments": {"a": {x}}}}]}, {"role": "tool", "tool_call_id": "c", '
                             '"content": "y"}]}', "messages.1.tool_calls.0.function.arguments.a"),
    ("/v1/completions", '{"model": "m", "max_tokens": 4, "prompt": [1, 2, {x}]}', "prompt.2"),
    ("/v1/completions", '{"model": "m", "max_tokens": 4, "prompt": "ab", "logit_bias": {"3": {x}}}', "logit_bias.3"),
    ("/tokenize", '{"model": "m", %s, "tools": [%s]}' % (CHAT, FUNCTION % '{"type": "object", "default": {x}}'),
     "tools.0.function.parameters.default"),
    ("/tokenize", '{"model": "m", %s, "chat_template_kwargs": {"t": {x}}}' % CHAT, "chat_template_kwargs.t"),
    ("/tokenize", '{"model": "m", "prompt": "ab", "extra": {x}}', "extra"),
    ("/v1/responses", '{"model": "m", "max_output_tokens": 4, "input": "hi", "metadata": {"k": {x}}}', "metadata.k"),
    ("/v1/responses", '{"model": "m", "max_output_tokens": 4, "input": "hi", "text": {"format": {"type": "json_schema", '
                      '"name": "w", "schema": {"type": "number", "maximum": {x}}}}}', "text.format.schema.maximum"),
    ("/v1/responses", '{"model": "m", "max_output_tokens": 4, "input": "hi", "tools": [{"type": "function", "name": '
                      '"f", "parameters": {"type": "object", "properties": {"a": {"default": {x}}}}}]}',
     "tools.0.parameters.properties.a.default"),
    ("/v1/messages", '{"model": "m", "max_tokens": 4, %s, "metadata": {"user_id": "u", "k": {x}}}' % CHAT, "metadata.k"),
    ("/v1/messages", '{"model": "m", "max_tokens": 4, %s, "output_config": {"format": {"type": "json_schema", '
                     '"schema": {"type": "number", "maximum": {x}}}}}' % CHAT, "output_config.format.schema.maximum"),
    ("/v1/messages", '{"model": "m", "max_tokens": 4, %s, "tools": [{"name": "f", "input_schema": {"type": "object", '
                     '"properties": {"a": {"default": {x}}}}}]}' % CHAT, "tools.0.input_schema.properties.a.default"),
    ("/v1/messages", '{"model": "m", "max_tokens": 4, %s, "temperature": {x}}' % CHAT, "temperature"),
    ("/v1/messages/count_tokens", '{"model": "m", %s, "tools": [{"name": "f", "input_schema": {"type": "object", '
                                  '"properties": {"a": {"default": {x}}}}}]}' % CHAT,
     "tools.0.input_schema.properties.a.default"),
    ("/v1/messages/count_tokens", '{"model": "m", %s, "system": [{"type": "text", "text": "s", "k": {x}}]}' % CHAT,
     "system.0.k"),
]


@pytest.mark.parametrize("written", ["NaN", "Infinity", "-Infinity", "1e400", "-1E+400"])
@pytest.mark.parametrize("path, body, where", MEMBERS)
def test_a_number_json_cannot_hold_is_a_400_naming_its_place(scripted, path, body, where, written):
    http, client = scripted
    r = post(http, path, body.replace("{x}", written))
    if path in ANTHROPIC:
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": words(where, written)}}, r.text
    else:
        err = error_of(r, 400)
        assert (err["param"], err["message"], err["code"]) == (where, words(where, written), "invalid_value"), err
    assert not client.submitted


@pytest.mark.parametrize("path, body, where", [m for m in MEMBERS if m[0] in ("/v1/chat/completions",
                                                                             "/v1/responses")])
def test_streamed_it_is_the_same_400(scripted, path, body, where):
    http, client = scripted
    err = error_of(post(http, path, body.replace("{x}", "NaN").replace('"model": "m"', '"model": "m", "stream": true')),
                   400)
    assert (err["param"], err["message"]) == (where, words(where, "NaN"))
    assert not client.submitted


# A call's arguments given as JSON text (a string in the body): NaN and Infinity were refused in other
# words; 1e400 was taken and submitted.
CALLED = ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
          '"function": {"name": "f", "arguments": %s}}]}, {"role": "tool", "tool_call_id": "c", "content": "y"}]')
TEXT_ARGUMENTS = [  # (path, body with {args}, param)
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, "messages": %s}' % CALLED % "{args}",
     "messages.1.tool_calls.0.function.arguments"),
    ("/tokenize", '{"model": "m", "messages": %s}' % CALLED % "{args}", "messages.1.tool_calls.0.function.arguments"),
    ("/v1/responses", '{"model": "m", "max_output_tokens": 4, "input": [{"role": "user", "content": "x"}, {"type": '
                      '"function_call", "call_id": "c", "name": "f", "arguments": {args}}, {"type": '
                      '"function_call_output", "call_id": "c", "output": "y"}]}', "input.1.arguments"),
]


@pytest.mark.parametrize("written", ["1e400", "-1e400", "NaN", "Infinity"])
@pytest.mark.parametrize("path, body, param", TEXT_ARGUMENTS)
def test_arguments_text_holding_one_is_a_400_naming_the_arguments(scripted, path, body, param, written):
    http, client = scripted
    args = json.dumps('{"city": [%s]}' % written)
    err = error_of(post(http, path, body.replace("{args}", args)), 400)
    assert err["param"] == param, err
    assert err["message"] == ("a tool call's arguments must be the JSON text of an object, with JSON numbers only: "
                              + words("city[0]", written)), err
    assert not client.submitted


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 2, %s, "metadata": {"k": "NaN Infinity 1e400"}, '
                             '"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": '
                             '{"type": "number", "maximum": 1.7e308, "minimum": -1e-400}}}}' % CHAT),
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 2, "messages": %s}' % CALLED % json.dumps('{"a": 1.5e300}')),
    ("/v1/responses", '{"model": "m", "max_output_tokens": 2, "input": "hi", "metadata": {"k": "NaN"}, '
                      '"temperature": 1e-400}'),
])
def test_finite_numbers_and_the_words_in_strings_are_taken(scripted, path, body):
    """1.7e308 is a double; 1e-400 reads as 0.0 (JSON's number, rounded); NaN in a string is text."""
    http, client = scripted
    r = post(http, path, body)
    assert r.status_code == 200, r.text
    assert len(client.submitted) == 1


@pytest.mark.parametrize("written", ["NaN", "1e400"])
def test_every_post_route_refuses_one_naming_its_place(app, http, written):
    """The whole app, no broker: every route reads its body through the one check (embeddings, rerank,
    infill and /models/load among them), before it asks the broker anything."""
    for path in post_routes(app):
        r = post(http, path, '{"model": "lazy", "input": "x", "extra": {"n": [1, %s]}}' % written)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message == words("extra.n.1", written), (path, message)
        if path not in ANTHROPIC:
            assert r.json()["error"]["param"] == "extra.n.1", (path, r.text)


def test_models_load_no_longer_takes_one_in_a_key_it_ignores(http):
    assert error_of(post(http, "/models/load", '{"model": "lazy", "x": 1}'), 400)["param"] == "x"  # (unknown)
    err = error_of(post(http, "/models/load", '{"model": "lazy", "x": NaN}'), 400)
    assert (err["param"], err["message"]) == ("x", words("x", "NaN"))


def test_a_body_that_is_nan_itself_is_named_the_body(app, http):
    for path in post_routes(app):
        r = post(http, path, "NaN")
        assert r.status_code == 400 and words("the body", "NaN") in r.text, (path, r.text)
