"""A tool's or a call's name with a newline after it (``"get_time\\n"``). The names were checked with
``re.match(r"^[A-Za-z0-9_-]{1,64}$")``, and Python's ``$`` matches before a final newline too: the name
was taken on the chat path (tool definitions, a call in the history), on ``/tokenize``, in Responses
function tools and ``function_call`` items, in Messages tools and ``count_tokens``, and by the SDK
(tests/protocol/test_tool_names.py). Now one rule, :func:`protocol.tools.is_tool_name` (a whole
match), refuses it everywhere, a 400 naming the field, before anything is submitted (Messages'
``tool_use`` blocks already were: tests/gateway/test_messages_api.py).

Fast lane: the gateway's handlers over a scripted broker client.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from tests.gateway.test_json_numbers import ANTHROPIC, scripted  # noqa: E402,F401
from tests.support.gateway import error_of  # noqa: E402

NAME = "get_time\n"
RULE = "must be 1-64 letters, digits, '_' or '-'"
USER = [{"role": "user", "content": "x"}]


def _called(name: str) -> list[dict]:
    return USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "y"}]


def _chat_tools(name: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]


MEMBERS = [  # (path, body with the name, the field named, the words)
    ("/v1/chat/completions", lambda n: {"model": "m", "max_tokens": 4, "messages": USER, "tools": _chat_tools(n)},
     "tools.0.function.name", f"tools.0.function.name {RULE}"),
    ("/v1/chat/completions", lambda n: {"model": "m", "max_tokens": 4, "messages": _called(n)},
     "messages.1.tool_calls.0.function.name", f"a tool call's name {RULE}, got 'get_time\\n'"),
    ("/tokenize", lambda n: {"model": "m", "messages": USER, "tools": _chat_tools(n)},
     "tools.0.function.name", f"tools.0.function.name {RULE}"),
    ("/tokenize", lambda n: {"model": "m", "messages": _called(n)},
     "messages.1.tool_calls.0.function.name", f"a tool call's name {RULE}, got 'get_time\\n'"),
    ("/v1/responses", lambda n: {"model": "m", "max_output_tokens": 4, "input": "x", "tools": [
        {"type": "function", "name": n, "parameters": {"type": "object"}}]}, "tools.0.name", f"tools.0.name {RULE}"),
    ("/v1/responses", lambda n: {"model": "m", "max_output_tokens": 4, "input": [
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": n, "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "y"}]},
     "input.1.name", f"input[1].name: a tool call's name {RULE}, got 'get_time\\n'"),
    ("/v1/messages", lambda n: {"model": "m", "max_tokens": 4, "messages": USER, "tools": [
        {"name": n, "input_schema": {"type": "object"}}]}, "tools.0.name", f"tools.0.name {RULE}"),
    ("/v1/messages/count_tokens", lambda n: {"model": "m", "messages": USER, "tools": [
        {"name": n, "input_schema": {"type": "object"}}]}, "tools.0.name", f"tools.0.name {RULE}"),
]


@pytest.mark.parametrize("path, body, param, message, stream", [
    (*m, stream) for m in MEMBERS for stream in (False, True)
    if not (stream and m[0] in ("/tokenize", "/v1/messages/count_tokens"))])  # (routes without a stream)
def test_a_name_with_a_newline_after_it_is_a_400_naming_it(scripted, path, body, param, message, stream):
    http, client = scripted
    r = http.post(path, content=json.dumps({**body(NAME), **({"stream": True} if stream else {})}),
                  headers={"content-type": "application/json"})
    if path in ANTHROPIC:
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
    else:
        err = error_of(r, 400)
        assert (err["param"], err["message"]) == (param, message), err
    assert not client.submitted


@pytest.mark.parametrize("path, body, param, message", [m for m in MEMBERS if m[0] in ("/v1/chat/completions",
                                                                                      "/v1/responses")])
def test_the_name_without_it_is_taken(scripted, path, body, param, message):
    http, client = scripted
    r = http.post(path, json=body("get_time"))
    assert r.status_code == 200, r.text
    assert len(client.submitted) == 1
