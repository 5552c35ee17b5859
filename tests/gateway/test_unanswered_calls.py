"""An assistant's tool call must be answered right after it, as both vendors refuse a conversation
that leaves one unanswered: OpenAI ("An assistant message with 'tool_calls' must be followed by tool
messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages:
...", its Responses API "No tool output found for function call ..."), Anthropic ("`tool_use` ids were
found without `tool_result` blocks immediately after: ..."). A call left unanswered before the next
message was served on every route (and the chat's end on /v1/chat/completions, /tokenize and
/v1/responses: only /v1/messages refused a final ``tool_use``): the model read a conversation whose
calls had no results, rendered by a template that writes a call's result after it. Now each is a 400
in its vendor's words naming the call's message or item, and the Python SDK, ``slotserve run``'s rows
and the wire refuse it in the same words (:class:`protocol.chat.Answers`). Over the handlers and vendor
apps with a scripted broker client, no sockets."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")

from gateway.errors import APIError  # noqa: E402
from gateway.responses_api import input_messages  # noqa: E402
from protocol.request import RequestParams  # noqa: E402
from tests.protocol.test_duplicate_tool_answers import _refused_everywhere  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {**({} if i is None else {"id": i}), "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        for i in ids]}


def _tool(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "noon"}


ASK, AGAIN = {"role": "user", "content": "time?"}, {"role": "user", "content": "and now?"}
UNANSWERED = {  # messages -> (the assistant message whose calls are unanswered, the ids, the message after)
    "the chat ends": ([ASK, _calls("c1")], 1, "'c1'", None),
    "a user message comes": ([ASK, _calls("c1"), AGAIN], 1, "'c1'", 2),
    "one of two answered": ([ASK, _calls("c1", "c2"), _tool("c2"), AGAIN], 1, "'c1'", 3),
    "one of two, at the end": ([ASK, _calls("c1", "c2"), _tool("c1")], 1, "'c2'", None),
    "answered after a user message": ([ASK, _calls("c1"), AGAIN, _tool("c1")], 1, "'c1'", 2),
    "another call comes": ([ASK, _calls("c1"), _calls("c2"), _tool("c2")], 1, "'c1'", 2),
    "a call sent without an id": ([ASK, _calls(None), AGAIN], 1, "(a call sent without an id)", 2),
    "two turns, the second unanswered": ([ASK, _calls("c1"), _tool("c1"), AGAIN, _calls("c2", "c3")], 4,
                                         "'c2', 'c3'", None),
}


def _says(at: int, ids: str, after: int | None, name=lambda i: f"chat message {i}") -> str:
    where = "before the chat ends" if after is None else f"before {name(after)}"
    return (f"{name(at)} tool_calls: An assistant message with 'tool_calls' must be followed by tool messages "
            f"responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {ids}; "
            f"send a tool message answering each right after {name(at)} ({where}), or leave the calls out")


@pytest.mark.parametrize("case", sorted(UNANSWERED))
def test_the_sdk_a_row_and_the_wire_refuse_an_unanswered_call(case):
    messages, at, ids, after = UNANSWERED[case]
    _refused_everywhere(messages, _says(at, ids, after))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("case", sorted(UNANSWERED))
def test_the_chat_route_and_tokenize_refuse_it_in_openais_words(chat_http, path, case):
    messages, at, ids, after = UNANSWERED[case]
    body = {"model": "m", "messages": messages, **({"max_tokens": 2} if "chat" in path else {})}
    e = error_of(chat_http.post(path, json=body), 400)
    assert (e["param"], e["code"]) == (f"messages.{at}.tool_calls", "invalid_value"), e
    assert e["message"] == _says(at, ids, after, lambda i: f"messages[{i}]").replace(
        f"messages[{at}] tool_calls", f"messages[{at}].tool_calls"), e
    named = re.sub(r"messages\[(\d+)\]\.?", lambda m: f"chat message {m[1]} ", e["message"]).replace(" )", ")")
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 2)
    assert named.replace("  ", " ") == str(sdk.value), (named, str(sdk.value))  # (the same words, its names)
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("messages", [
    [ASK, _calls("c1", "c2"), _tool("c2"), _tool("c1"), AGAIN],  # (in any order, right after the calls)
    [ASK, _calls("c1"), _tool("c1"), AGAIN, _calls("c1"), _tool("c1")],  # (a call made again, answered again)
    [ASK, _calls(None), _tool("x")],  # (a call sent without an id: any id answers it)
])
def test_calls_answered_right_after_them_are_taken(chat_http, messages):
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    assert chat_http.post("/tokenize", json={"model": "m", "messages": messages}).status_code == 200


def _use(*ids: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": "let me look."}] + [
        {"type": "tool_use", "id": i, "name": "get_time", "input": {}} for i in ids]}


def _results(*ids: str, text: str | None = None) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "noon"} for i in ids] + (
        [{"type": "text", "text": text}] if text else [])}


USER = {"role": "user", "content": "time?"}
MESSAGES_UNANSWERED = [  # (messages, the message with the unanswered tool_use blocks, their ids)
    ([USER, _use("t1"), {"role": "user", "content": "and now?"}], 1, "t1"),           # a string answers nothing
    ([USER, _use("t1"), {"role": "user", "content": [{"type": "text", "text": "and now?"}]}], 1, "t1"),
    ([USER, _use("t1", "t2"), _results("t2", text="and?")], 1, "t1"),                  # one of two
    ([USER, _use("t1"), _use("t2"), _results("t2")], 1, "t1"),                         # another assistant turn
    ([USER, _use("t1", "t2"), _results("t1", "t2"), _use("t3", "t4"),
      {"role": "user", "content": "so?"}], 3, "t3, t4"),
    ([USER, _use("t1")], 1, "t1"),                                                     # the end (refused already)
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("messages, at, ids", MESSAGES_UNANSWERED)
def test_the_messages_api_refuses_it_in_anthropics_words(messages_http, path, messages, at, ids):
    body = {"model": "m", "messages": messages, **({"max_tokens": 8} if path == "/v1/messages" else {})}
    r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"messages.{at}: `tool_use` ids were found without `tool_result` blocks immediately "
                              f"after: {ids}. Each `tool_use` block must have a corresponding `tool_result` block in "
                              "the next message"), message
    assert not messages_http.scripted.submitted


def test_the_messages_api_takes_results_in_the_next_message(messages_http):
    messages = [USER, _use("t1", "t2"), _results("t2", "t1", text="and?")]
    r = messages_http.post("/v1/messages/count_tokens", json={"model": "m", "messages": messages},
                           headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text


CALL = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
OUT = {"type": "function_call_output", "call_id": "c1", "output": "noon"}
SAY = {"role": "user", "content": "time?"}


@pytest.mark.parametrize("items, at", [
    ([SAY, CALL], 1),                                                   # the input ends
    ([SAY, CALL, {"role": "user", "content": "and now?"}], 1),          # a message comes
    ([SAY, CALL, {"role": "user", "content": "and now?"}, OUT], 1),     # its output comes after the message
    ([SAY, CALL, {**CALL, "call_id": "c2"}, OUT], 2),                   # one of two answered
    ([SAY, CALL, OUT, {**CALL, "call_id": "c2"}, {**OUT, "call_id": "c2"}, {**CALL, "call_id": "c3"}], 5),
])
def test_the_responses_api_refuses_it_in_openais_words(responses_http, items, at):
    e = error_of(responses_http.post("/v1/responses", json={"model": "m", "input": items}), 400)
    call_id = items[at]["call_id"]
    assert (e["param"], e["code"]) == (f"input.{at}", "invalid_value"), e
    assert e["message"].startswith(f"No tool output found for function call {call_id}. Each function_call "
                                   f"(input[{at}]) needs a function_call_output item with its call_id after it"), e
    assert not responses_http.scripted.submitted


def test_the_responses_api_refuses_a_stored_call_left_unanswered():
    stored = [SAY, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    with pytest.raises(APIError) as e:  # (previous_response_id's calls: answered first in this input)
        input_messages([{"role": "user", "content": "and now?"}], stored)
    assert e.value.param == "input" and e.value.message.startswith(
        "No tool output found for function call c9. Each function_call (the stored conversation "
        "(previous_response_id)) needs"), e.value.message
    assert input_messages([{**OUT, "call_id": "c9"}, SAY], stored)[0]["tool_call_id"] == "c9"


def test_the_responses_api_takes_outputs_after_their_calls(responses_http):
    items = [SAY, CALL, {**CALL, "call_id": "c2"}, {"type": "reasoning", "id": "rs", "summary": []},
             {**OUT, "call_id": "c2"}, OUT, {"role": "user", "content": "plain"}]
    r = responses_http.post("/v1/responses", json={"model": "m", "input": items, "max_output_tokens": 4})
    assert r.status_code == 200, r.text
