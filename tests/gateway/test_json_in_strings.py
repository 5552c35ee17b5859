"""JSON text inside a body's strings, one level below tests/gateway/test_body_json.py: a body may be valid
JSON and still hold, in a string that is JSON text itself (a tool call's ``arguments``, a schema given
as text), the escape of half a UTF-16 surrogate pair (``"\\ud800"``), which Python's parser reads
as a lone surrogate. It reached the worker, whose tokenizer refused the rendered chat in its own
library's words, a 400 naming only ``messages`` ("chat template rejected the messages: TextEncodeInput
must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"), or failed the request's
encoding for the wire; ``count_tokens`` counted such a schema (200). Each is now a 400 in the route's
own shape naming the field, before anything is submitted.

And the other way: a call the model writes with such an escape, read by a parser that parses values
(Qwen3-Coder's typed parameters, pythonic calls) or turned into Anthropic's ``input`` object, failed
the answer as it was written (pydantic's JSON writer: "surrogates not allowed"): a 500, or a stream
cut off. The arguments now keep the escape as written; Anthropic's ``input`` holds U+FFFD.

Fast lane: the gateway's handlers over the scripted broker client (tests/gateway/test_tools_stream.py).
Cluster: the tiny text model through real processes, a stream in flight meanwhile.
"""

from __future__ import annotations

import json

import httpx
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
from tests.gateway.test_tools_stream import OUTPUTS, OutputClient  # noqa: E402
from tests.support.gateway import error_of, sse  # noqa: E402
from tests.support.scripted import ScriptedLink, letters  # noqa: E402

ESCAPE = "\\ud800"  # the six characters of the escape, as JSON text writes it
ARGUMENTS = '{"city": "' + ESCAPE + '"}'
COLUMN = ARGUMENTS.index(ESCAPE) + 1
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}}]


def escape_words(field: str, column: int = COLUMN) -> str:
    return (f"{field} is not valid JSON: it contains an unpaired surrogate escape '{ESCAPE}' at line 1 column "
            f"{column} (half of a UTF-16 surrogate pair, which is no character); write the character itself, or "
            "both halves of its pair")


def handlers(client: OutputClient, parser: str = "hermes") -> Starlette:
    """Every route that takes chat messages, over ``client`` (a scripted broker client)."""
    link = ScriptedLink(client)
    tokenizers = Tokenizers(letters)
    gen = Generate(GatewayConfig(tool_call_parser=parser), link, GatewayMetrics(), tokenizers=tokenizers)
    tok = TokenizeEndpoints(link, tokenizers)
    responses = ResponsesEndpoints(gen, ResponseStore(8, 60.0))
    messages = MessagesEndpoints(gen, tok)
    return Starlette(routes=[Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
                             Route("/tokenize", tok.tokenize, methods=["POST"]),
                             Route("/v1/responses", responses.create, methods=["POST"]),
                             Route("/v1/messages", messages.create, methods=["POST"]),
                             Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])])


@pytest.fixture
def scripted():
    client = OutputClient()
    with TestClient(handlers(client)) as http:
        yield http, client
    for t in client.threads:
        t.join(10)


def called(arguments: str) -> list[dict]:
    """A chat whose assistant message (index 1) called get_weather with ``arguments``."""
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


OPENAI_CASES = [  # (path, body, param, message)
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": called(ARGUMENTS)},
     "messages.1.tool_calls.0.function.arguments", escape_words("messages[1].tool_calls[0].function.arguments")),
    ("/tokenize", {"model": "m", "messages": called(ARGUMENTS)},
     "messages.1.tool_calls.0.function.arguments", escape_words("messages[1].tool_calls[0].function.arguments")),
    ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGUMENTS},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
     "input.1.arguments", escape_words("input[1].arguments")),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "w", "schema": ARGUMENTS}}},
     "response_format.json_schema.schema", escape_words("response_format.json_schema.schema")),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                              "structured_outputs": {"choice": '["' + ESCAPE + '"]'}},
     "structured_outputs.choice", escape_words("structured_outputs.choice", 3)),
]


@pytest.mark.parametrize("path, body, param, message, stream", [
    (*case, stream) for case in OPENAI_CASES for stream in (False, True) if not (stream and case[0] == "/tokenize")])
def test_an_escape_in_json_text_is_a_400_naming_the_field(scripted, path, body, param, message, stream):
    http, client = scripted
    r = http.post(path, json={**body, **({"stream": True} if stream else {})})
    err = error_of(r, 400)
    assert (err["param"], err["message"], err["type"]) == (param, message, "invalid_request_error"), err
    assert not client.submitted  # refused before anything was submitted


@pytest.mark.parametrize("path", ANTHROPIC)
def test_a_tool_use_input_that_is_no_object_is_a_400_naming_it(scripted, path):
    """Anthropic's ``tool_use.input`` is an object: JSON text in a string is refused naming the block
    (it was taken as the JSON text of a string, then refused as 'messages: a tool call's arguments
    must be the JSON text of an object')."""
    http, client = scripted
    body = {"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": ARGUMENTS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        **({"max_tokens": 4} if path == "/v1/messages" else {})}
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "messages.1.content.0.input must be an object (the call's arguments)"}}
    assert not client.submitted


# ---------------------------------------------------------------------- the model writes the escape

CALLS = {  # parser -> (the model's output: one get_weather call whose value escapes a lone surrogate, its arguments)
    "hermes": ('<tool_call>{"name": "get_weather", "arguments": ' + ARGUMENTS + '}</tool_call>', ARGUMENTS),
    "qwen3_coder": ('<tool_call>\n<function=get_weather>\n<parameter=days>\n["' + ESCAPE + '", 1]\n</parameter>\n'
                    '</function>\n</tool_call>', '{"days": ["' + ESCAPE + '", 1]}'),
    "pythonic": ('[get_weather(city="' + ESCAPE + '")]', ARGUMENTS),
    "llama3_json": ('{"name": "get_weather", "parameters": ' + ARGUMENTS + '}', ARGUMENTS),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGUMENTS + '}]', ARGUMENTS),
    "openai": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' + ARGUMENTS + '<|call|>',
               ARGUMENTS),
}


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_a_call_the_model_writes_with_the_escape_is_answered(monkeypatch, parser):
    """Chat (whole and streamed) keeps the arguments' escape as the text; Anthropic's ``input``
    object has U+FFFD where no character was. Was: a 500 (``internal gateway error:
    PydanticSerializationError``) for Qwen3-Coder's and pythonic calls, and for every parser's
    Messages answer."""
    output, arguments = CALLS[parser]
    monkeypatch.setitem(OUTPUTS, "lone_call", output)
    client = OutputClient()
    body = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "lone_call"}], "tools": TOOLS}
    with TestClient(handlers(client, parser)) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["arguments"] == arguments
        events = sse(http, "/v1/chat/completions", body)
        streamed = "".join(c["function"].get("arguments", "") for e in events for ch in e["choices"]
                           for c in ch["delta"].get("tool_calls") or ())
        assert streamed == arguments and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        r = http.post("/v1/messages", json={
            "model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "lone_call"}],
            "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]})
        assert r.status_code == 200, r.text
        (block,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
        assert block["input"] == json.loads(arguments.replace(ESCAPE, "\\ufffd"))
    for t in client.threads:
        t.join(10)


# ---------------------------------------------------------------------- through real processes

def test_every_chat_route_refuses_it_while_a_stream_runs_on(cluster, text_model):
    """The tiny text model's cluster: each route's 400 before the worker sees the chat (the worker's
    tokenizer refused it in its library's words, naming only ``messages``), and a stream in flight
    meanwhile ends as it would have."""
    url = cluster.http_url
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json={
            "model": text_model, "prompt": "hello", "max_tokens": 24, "temperature": 0, "stream": True,
            "ignore_eos": True}) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        for path, body, param, message in OPENAI_CASES:
            r = http.post(url + path, json={**body, "model": text_model})
            err = error_of(r, 400)
            assert (err["param"], err["message"]) == (param, message), (path, err)
        chunks = [first] + [line for line in lines if line.startswith("data: {")]
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
    whole = httpx.post(url + "/v1/completions", json={"model": text_model, "prompt": "hello", "max_tokens": 24,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert text == whole["choices"][0]["text"] and whole["choices"][0]["finish_reason"] == "length"
