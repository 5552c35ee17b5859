"""Content given as an empty array is refused as an empty turn on every route that takes content
arrays (an adversarial pass found ``"content": []`` taken as ``""``): ``/v1/chat/completions`` and
``/tokenize`` (OpenAI's rule, every role: an array holds at least one part), a Responses message item,
``/v1/messages`` and its ``count_tokens`` (Anthropic's rule: empty content, ``""`` too, only in a
final assistant message); a 400 naming the field, whole and streamed, before anything is submitted.
The same kind, after: an empty text block anywhere on /v1/messages (Anthropic's "text content blocks
must be non-empty"), a Responses ``function_call_output``'s ``output: []``.
What the vendors take stays taken: ``""``, ``system: []`` (no system prompt), an assistant's null content beside its tool calls, a
``tool_result``'s ``[]`` / ``""`` / no content (Anthropic's is optional), ``output: ""``. The Python
SDK takes content by the chat route's rule (protocol.chat.content_text): an empty array is a ValueError
in its words. Over the handlers apps with scripted broker clients (tests/support/scripted.py), no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("openai")
pytest.importorskip("anthropic")
pytest.importorskip("transformers")

from protocol.request import RequestParams  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402

CALL = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
EMPTY = "is an empty array: an empty turn is refused; send a string"
ANTHROPIC = "all messages must have non-empty content except for the optional final assistant message"


def chat_history(role: str, content) -> tuple[list[dict], int]:
    """A chat whose message of ``role`` has ``content``, and that message's index."""
    if role == "tool":
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": content}], 2
    if role == "assistant":
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "and?"}], 1
    return [{"role": role, "content": content}, {"role": "user", "content": "hi"}][:1 if role == "user" else 2], 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_chat_content_of_an_empty_array_is_a_400_naming_it(chat_http, role, stream):
    messages, i = chat_history(role, [])
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "stream": stream,
                                                      "messages": messages})
    e = error_of(r, 400)
    assert (e["param"], e["code"], e["type"]) == (f"messages.{i}.content", "invalid_value", "invalid_request_error")
    assert e["message"].startswith(f"messages.{i}.content {EMPTY}"), e
    assert ("null" in e["message"]) == (role == "assistant"), e  # (null: the assistant's way to send no text)
    e = error_of(chat_http.post("/tokenize", json={"model": "m", "messages": messages}), 400)
    assert e["param"] == f"messages.{i}.content", e
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("stream", [False, True])
def test_chat_content_openai_takes_is_still_taken(chat_http, stream):
    """``""`` (any role) and an assistant's null content beside its calls (or alone) are OpenAI's."""
    for messages in (chat_history("tool", "")[0], chat_history("assistant", "")[0], chat_history("assistant", None)[0],
                     [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
                     [{"role": "user", "content": [{"type": "text", "text": ""}]}]):
        r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "stream": stream,
                                                          "messages": messages})
        assert r.status_code == 200, (messages, r.text)


def messages_body(path: str, stream: bool | None, messages: list[dict]) -> dict:
    return {"model": "m", "messages": messages, **({} if stream is None else {"max_tokens": 5, "stream": stream})}


MESSAGES_PATHS = [("/v1/messages", False), ("/v1/messages", True), ("/v1/messages/count_tokens", None)]


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
@pytest.mark.parametrize("content", [[], ""], ids=["array", "string"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_messages_empty_content_is_anthropics_400_but_in_a_final_assistant_message(messages_http, path, stream,
                                                                                   content, at):
    """A user's, or an assistant's before the end: Anthropic's error (its words, the field first)."""
    messages = [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "plain"}]
    messages[at] = {**messages[at], "content": content}
    r = messages_http.post(path, json=messages_body(path, stream, messages), headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith(f"messages.{at}.content: {ANTHROPIC}; "), r.text
    assert not messages_http.scripted.submitted


@pytest.mark.parametrize("content", [[], ""], ids=["array", "string"])
def test_messages_a_final_assistant_message_may_be_empty(messages_http, content):
    messages = [{"role": "user", "content": "plain"}, {"role": "assistant", "content": content}]
    r = messages_http.post("/v1/messages/count_tokens", json=messages_body("", None, messages),
                           headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ["user", "assistant", "system", "developer"])
def test_responses_message_item_content_of_an_empty_array_is_a_400_naming_it(responses_http, role, stream):
    items = [{"role": "user", "content": "plain"}, {"type": "message", "role": role, "content": []},
             {"role": "user", "content": "plain"}]
    e = error_of(responses_http.post("/v1/responses", json={"model": "m", "input": items, "stream": stream}), 400)
    assert (e["param"], e["code"]) == ("input.1.content", "invalid_value"), e
    assert e["message"].startswith(f"input.1.content {EMPTY} or a list of at least one input_text part"), e
    assert not responses_http.scripted.submitted


@pytest.mark.parametrize("messages", [[{"role": "user", "content": []}],
                                      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}],
                                      [("user", [])]])
def test_the_sdk_refuses_an_empty_array_of_content_with_a_value_error(messages):
    """An empty array is a ValueError naming the message, in the chat route's words, before a client sends
    anything (a list of text parts is taken, as OpenAI's: tests/gateway/test_chat_content_everywhere.py)."""
    with pytest.raises(ValueError, match=rf"^chat message {len(messages) - 1} content {EMPTY}"):
        RequestParams(messages, 2)


# ---------------------------------------------------------------------- empty blocks, system, tool outputs

NON_EMPTY = "text content blocks must be non-empty; write the text, or leave the block out"
EMPTY_TEXT = {"type": "text", "text": ""}
USE = {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}


def empty_text_at(place: str) -> tuple[dict, str]:
    """A Messages body (its ``system`` and ``messages``) with an empty text block at ``place``, and
    that block's field."""
    plain = {"type": "text", "text": "plain"}
    if place == "system":
        return {"system": [{"type": "text", "text": "Be brief."}, EMPTY_TEXT], "messages": [
            {"role": "user", "content": "plain"}]}, "system.1.text"
    if place == "user":
        return {"messages": [{"role": "user", "content": [plain, EMPTY_TEXT]}]}, "messages.0.content.1.text"
    if place in ("assistant", "final assistant"):  # (a final assistant message may be empty, not its blocks)
        messages = [{"role": "user", "content": "plain"}, {"role": "assistant", "content": [EMPTY_TEXT]},
                    {"role": "user", "content": "plain"}]
        return {"messages": messages[:2] if place == "final assistant" else messages}, "messages.1.content.0.text"
    if place == "beside a call":  # (what a client that stored a reply's empty text block sends back)
        return {"messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": [EMPTY_TEXT, USE]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                           "content": "1"}, plain]}]}, "messages.1.content.0.text"
    assert place == "tool_result"
    return {"messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": [USE]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [EMPTY_TEXT]}, plain]}]}, \
        "messages.2.content.0.content.0.text"


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
@pytest.mark.parametrize("place", ["system", "user", "assistant", "final assistant", "beside a call", "tool_result"])
def test_messages_an_empty_text_block_is_anthropics_400_naming_it(messages_http, path, stream, place):
    """``{"type": "text", "text": ""}`` anywhere -- a message, ``system``, a ``tool_result``'s content --
    is Anthropic's 400 ("text content blocks must be non-empty"), naming the block's text: it was
    taken as no text."""
    body, field = empty_text_at(place)
    body = {**messages_body(path, stream, body["messages"]), **({"system": body["system"]} if "system" in body else {})}
    r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{field}: {NON_EMPTY}"}}, r.text
    assert not messages_http.scripted.submitted


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
def test_messages_system_of_an_empty_array_is_no_system_prompt(messages_http, path, stream):
    """``system: []`` is taken as Anthropic takes it (``system`` is a string or text blocks, with no least
    length; clients send ``[]`` for "no system prompt"): no system message, as if ``system`` were left
    out. It was an empty system message, then (27873b8) a 400 that refused what Anthropic answers.
    A string, ``""`` too, is taken as before."""
    plain = messages_body(path, stream, [{"role": "user", "content": "plain"}])
    r = messages_http.post(path, json={**plain, "system": []}, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    if stream is not None:
        assert [(m.role, m.content) for m in messages_http.scripted.submitted[-1].prompt] == [("user", "plain")]
    else:  # (count_tokens: the count of the body without system)
        assert r.json() == messages_http.post(path, json=plain, headers={"x-api-key": KEY}).json()
    r = messages_http.post(path, json={**plain, "system": ""}, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
@pytest.mark.parametrize("content", [[], "", None], ids=["array", "string", "none"])
def test_messages_a_tool_result_may_be_empty_as_anthropics_may(messages_http, path, stream, content):
    """A ``tool_result``'s ``content`` is optional in Anthropic's API, with no least length (a tool may
    answer nothing): ``[]``, ``""`` and none at all are taken, as a tool message with no text."""
    result = {"type": "tool_result", "tool_use_id": "t1", **({} if content is None else {"content": content})}
    messages = [{"role": "user", "content": "plain"}, {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [result, {"type": "text", "text": "plain"}]}]
    r = messages_http.post(path, json=messages_body(path, stream, messages), headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    if stream is not None:
        prompt = messages_http.scripted.submitted[-1].prompt
        assert [(m.role, m.content) for m in prompt][2:] == [("tool", ""), ("user", "plain")]


CALLED = [{"role": "user", "content": "plain"},
          {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_output_of_an_empty_array_is_a_400_naming_it(responses_http, stream):
    """A ``function_call_output``'s ``output`` ``[]`` is refused as a message item's content ``[]`` is
    (OpenAI's rule: an array of at least one part); ``""`` stays taken (a string, as a chat tool
    message's ``""``: a tool may answer nothing)."""
    items = CALLED + [{"type": "function_call_output", "call_id": "c1", "output": []},
                      {"role": "user", "content": "plain"}]
    e = error_of(responses_http.post("/v1/responses", json={"model": "m", "input": items, "stream": stream}), 400)
    assert (e["param"], e["code"]) == ("input.2.output", "invalid_value"), e
    assert e["message"].startswith(f"input.2.output {EMPTY} or a list of at least one input_text part"), e
    assert not responses_http.scripted.submitted
    items[2]["output"] = ""
    r = responses_http.post("/v1/responses", json={"model": "m", "input": items, "stream": stream})
    assert r.status_code == 200, r.text
    assert [(m.role, m.content) for m in responses_http.scripted.submitted[-1].prompt][2:] == [
        ("tool", ""), ("user", "plain")]
