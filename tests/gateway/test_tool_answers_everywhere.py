"""A tool message is held to one rule at every entry point, in the same words
(:class:`protocol.chat.Answers`): the chat route and ``/tokenize`` refused a ``tool_call_id`` that is
the id of no earlier call (or none) in words of their own, while the Python SDK, ``slotserve run``'s
rows and the wire took it (tests/protocol/test_duplicate_tool_answers.py); now each refuses it, the
gateway naming the messages ``messages[2]`` where the SDK says ``chat message 2``, the rest word for
word. Over the handlers app with a scripted broker client, no sockets."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")

from protocol.request import RequestParams  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for i in ids]}


def _tool(cid: str | None) -> dict:
    return {"role": "tool", "content": "noon", **({} if cid is None else {"tool_call_id": cid})}


ASK = {"role": "user", "content": "time?"}
REFUSED = {  # messages -> the tool message at fault
    "no call at all": ([ASK, _tool("c1")], 1),
    "another call's id": ([ASK, _calls("c2"), _tool("c1")], 2),
    "the call after it": ([ASK, _tool("c1"), _calls("c1")], 1),
    "no id": ([ASK, _calls("c1"), _tool(None)], 2),
    "an empty id": ([ASK, _calls("c1"), _tool("")], 2),
    "a call answered twice": ([ASK, _calls("c1"), _tool("c1"), _tool("c1")], 3),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_gateway_refuses_what_every_entry_point_refuses_in_the_same_words(chat_http, case, path):
    messages, i = REFUSED[case]
    body = {"model": "m", "messages": messages, **({"max_tokens": 2} if "chat" in path else {})}
    e = error_of(chat_http.post(path, json=body), 400)
    assert e["param"] == f"messages.{i}.tool_call_id", e
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 2)
    named = re.sub(r"messages\[(\d+)\](\.tool_call_id)?", lambda m: f"chat message {m[1]}" + (
        " tool_call_id" if m[2] else ""), e["message"])
    assert named == str(sdk.value), (e["message"], str(sdk.value))
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("messages", [
    [ASK, _calls("c1"), _tool("c1")],
    [ASK, _calls("c1", "c2"), _tool("c2"), _tool("c1"), {"role": "user", "content": "again"}, _calls("c1"),
     _tool("c1")],
    [ASK, {"role": "assistant", "content": None, "tool_calls": [  # (a call sent without an id: any answers it)
        {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}, _tool("x")],
])
def test_the_gateway_takes_what_every_entry_point_takes(chat_http, messages):
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    assert chat_http.scripted.submitted[-1].prompt == RequestParams(messages, 2).prompt
    assert chat_http.post("/tokenize", json={"model": "m", "messages": messages}).status_code == 200


@pytest.mark.parametrize("items, at", [
    ([{"type": "function_call", "call_id": "", "name": "get_time", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "", "output": "noon"}], 1),
    ([{"type": "function_call", "call_id": "", "name": "get_time", "arguments": "{}"}], 1),
])
def test_responses_refuses_an_empty_call_id_in_its_own_words(responses_http, items, at):
    # was: a function_call and its output with call_id "" passed the Responses check ("" is a call's id) and
    # the chat rule refused the output as 'input[2].call_id: a tool message needs the tool_call_id ...'
    e = error_of(responses_http.post("/v1/responses", json={"model": "m", "input": [ASK, *items]}), 400)
    assert e["param"] == f"input.{at}.call_id", e
    assert e["message"].startswith(f"input.{at}.call_id must not be empty"), e
    assert not responses_http.scripted.submitted
