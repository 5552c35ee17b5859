"""A call answered twice, and (Messages API) a call id used twice, are refused as the vendors refuse
them: ``/v1/messages`` and its ``count_tokens`` took two ``tool_use`` blocks with one id and two
``tool_result`` blocks for one call, which Anthropic answers 400 invalid_request_error
("messages.1.content.1: `tool_use` ids must be unique", "each tool_use must have a single result");
``/v1/chat/completions`` and ``/tokenize`` took two ``tool`` messages for one ``tool_call_id``, which
OpenAI answers "Invalid parameter: Duplicate value for 'tool_call_id' of 'call_X', in messages[7] and
messages[8]." (``param`` the second's ``tool_call_id``); the Responses API's ``function_call_output``
items were refused there by the chat path's check in its words (``messages[2]``); now by their own. What the vendors take stays taken: a call made again later, by its
id, answered again (chat). Over the handlers apps with scripted broker clients, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402

TOOLS = [{"name": "get_time", "input_schema": {"type": "object"}}]


def _use(uid: str) -> dict:
    return {"type": "tool_use", "id": uid, "name": "get_time", "input": {}}


def _result(uid: str) -> dict:
    return {"type": "tool_result", "tool_use_id": uid, "content": "noon"}


ASK = {"role": "user", "content": "time?"}
ANTHROPIC_CASES = {  # messages -> (the field at fault, Anthropic's words it starts with)
    "one id twice in a message": ([ASK, {"role": "assistant", "content": [_use("t1"), _use("t1")]},
                                   {"role": "user", "content": [_result("t1")]}],
                                  "messages.1.content.1", "`tool_use` ids must be unique"),
    "one id in two messages": ([ASK, {"role": "assistant", "content": [_use("t1")]},
                                {"role": "user", "content": [_result("t1")]},
                                {"role": "assistant", "content": [_use("t1")]},
                                {"role": "user", "content": [_result("t1")]}],
                               "messages.3.content.0", "`tool_use` ids must be unique"),
    "two results in a message": ([ASK, {"role": "assistant", "content": [_use("t1")]},
                                  {"role": "user", "content": [_result("t1"), _result("t1")]}],
                                 "messages.2.content.1.tool_use_id", "each tool_use must have a single result"),
    "two results in two messages": ([ASK, {"role": "assistant", "content": [_use("t1")]},
                                     {"role": "user", "content": [_result("t1")]},
                                     {"role": "assistant", "content": "and again"},
                                     {"role": "user", "content": [_result("t1")]}],
                                    "messages.4.content.0.tool_use_id", "each tool_use must have a single result"),
}


@pytest.mark.parametrize("path, stream", [("/v1/messages", False), ("/v1/messages", True),
                                          ("/v1/messages/count_tokens", None)])
@pytest.mark.parametrize("case", sorted(ANTHROPIC_CASES))
def test_messages_refuses_a_tool_use_id_used_twice_and_a_call_answered_twice(messages_http, case, path, stream):
    messages, field, words = ANTHROPIC_CASES[case]
    body = {"model": "m", "messages": messages, "tools": TOOLS,
            **({} if stream is None else {"max_tokens": 5, "stream": stream})}
    r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["message"].startswith(f"{field}: {words}: t1 "), error
    assert not messages_http.scripted.submitted


def test_messages_still_takes_distinct_ids_each_answered_once(messages_http):
    messages = [ASK, {"role": "assistant", "content": [_use("t1"), _use("t2")]},
                {"role": "user", "content": [_result("t1"), _result("t2"), {"type": "text", "text": "plain"}]}]
    for path, extra in (("/v1/messages", {"max_tokens": 5}), ("/v1/messages/count_tokens", {})):
        r = messages_http.post(path, json={"model": "m", "messages": messages, **extra},
                               headers={"x-api-key": KEY})
        assert r.status_code == 200, r.text


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for i in ids]}


def _tool(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "noon"}


CHAT_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("messages, first, second", [
    ([ASK, _calls("c1"), _tool("c1"), _tool("c1")], 2, 3),
    ([ASK, _calls("c1", "c2"), _tool("c1"), _tool("c2"), {"role": "user", "content": "and?"}, _tool("c1")], 2, 5),
])
def test_chat_refuses_a_call_answered_twice_in_openai_s_words(chat_http, path, messages, first, second):
    body = {"model": "m", "messages": messages, "tools": CHAT_TOOLS, **({"max_tokens": 2} if "chat" in path else {})}
    e = error_of(chat_http.post(path, json=body), 400)
    assert e["param"] == f"messages.{second}.tool_call_id", e
    assert e["message"].startswith(f"messages[{second}].tool_call_id: Duplicate value for 'tool_call_id' of 'c1', "
                                   f"in messages[{first}] and messages[{second}]"), e
    assert not chat_http.scripted.submitted


def test_chat_still_takes_a_call_made_again_and_answered_again(chat_http):
    messages = [ASK, _calls("c1"), _tool("c1"), {"role": "user", "content": "again"}, _calls("c1"), _tool("c1")]
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages,
                                                      "tools": CHAT_TOOLS})
    assert r.status_code == 200, r.text


def test_responses_refuses_a_call_output_given_twice(responses_http):
    items = [{"role": "user", "content": "time?"},
             {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "noon"},
             {"type": "function_call_output", "call_id": "c1", "output": "noon"}]
    e = error_of(responses_http.post("/v1/responses", json={"model": "m", "input": items, "tools": [
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]}), 400)
    assert e["param"] == "input.3.call_id", e
    assert e["message"].startswith("Duplicate value for 'call_id' of 'c1': input[2] answers this call already"), e
    assert not responses_http.scripted.submitted
