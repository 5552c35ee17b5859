"""A tool call in a chat request's messages takes the keys OpenAI's type has (its
``ChatCompletionMessageToolCallParam``: ``id``, ``type``, ``function``; the function's ``name`` and
``arguments``), as the message and its text parts do: a message's unknown key and a text part's were a 400
(``Unrecognized request argument supplied: messages.0.content.1.foo``) while a call's unknown key and its
function's were taken silently (``{"id": ..., "function": {...}, "foo": 1}`` served, on
``/v1/chat/completions`` and ``/tokenize``). Now each is the same 400, naming
``messages.1.tool_calls.0.foo`` or ``messages.1.tool_calls.0.function.foo`` and what the object takes; the
``index`` a client that gathered the call from a stream's deltas keeps on it is taken (an integer, not
used), as OpenAI's API takes it. Over the handlers app with a scripted broker client, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.support.gateway import error_of  # noqa: E402

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LONG, CLIPPED = "k" * 5000, "k" * 100 + "… (5000 characters)"
PATHS = ["/v1/chat/completions", "/tokenize"]


def _body(path: str, call: dict) -> dict:
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    return {"model": "m", "messages": messages, **({"max_tokens": 2} if "chat" in path else {})}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key, shown", [("foo", "foo"), ("arguments", "arguments"), (LONG, CLIPPED)],
                         ids=["foo", "arguments", "long"])
def test_an_unknown_key_of_a_tool_call_is_an_unknown_field(chat_http, path, key, shown):
    # ("arguments" beside "function": a call written flat, whose key belongs in the function)
    e = error_of(chat_http.post(path, json=_body(path, {**CALL, key: 1})), 400)
    field = f"messages.1.tool_calls.0.{shown}"
    assert (e["param"], e["code"]) == (field, "unknown_parameter"), e
    assert e["message"].startswith(f"Unrecognized request argument supplied: {field} (messages.1.tool_calls.0 takes "
                                   "id, type and function"), e
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key, shown", [("foo", "foo"), ("id", "id"), (LONG, CLIPPED)], ids=["foo", "id", "long"])
def test_an_unknown_key_of_a_tool_calls_function_is_an_unknown_field(chat_http, path, key, shown):
    e = error_of(chat_http.post(path, json=_body(path, {**CALL, "function": {**CALL["function"], key: 1}})), 400)
    field = f"messages.1.tool_calls.0.function.{shown}"
    assert (e["param"], e["code"]) == (field, "unknown_parameter"), e
    assert e["message"].startswith(f"Unrecognized request argument supplied: {field} "
                                   "(messages.1.tool_calls.0.function takes name and arguments)"), e
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("path", PATHS)
def test_a_streamed_calls_index_is_taken_and_changes_nothing(chat_http, path):
    r = chat_http.post(path, json=_body(path, {"index": 0, **CALL}))
    assert r.status_code == 200, r.text
    plain = chat_http.post(path, json=_body(path, CALL))
    if path == "/tokenize":
        assert r.json()["tokens"] == plain.json()["tokens"]
    else:
        first, second = chat_http.scripted.submitted
        assert first.prompt == second.prompt


@pytest.mark.parametrize("index", ["0", 1.5, True, -1])
def test_an_index_that_is_no_count_is_named(chat_http, index):
    path = "/v1/chat/completions"
    e = error_of(chat_http.post(path, json=_body(path, {"index": index, **CALL})), 400)
    assert (e["param"], e["code"]) == ("messages.1.tool_calls.0.index", "invalid_type"), e
    assert e["message"].startswith("messages.1.tool_calls.0.index must be an integer >= 0 or null; got "), e
