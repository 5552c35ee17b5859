"""An entry of a list that a body tags by type -- a chat message's content part, a Messages content
block (in a message, ``system`` or a ``tool_result``), a Responses input item, content part or tool --
that is no object, or whose ``type`` is missing, null or no string, is the client's malformed input: a
400 naming the entry or its ``type``, in words saying what it must be, on every route that takes it.

Before, such an entry was refused as a feature slotserve lacks, telling the client to leave out a field
it never sent: "'messages.0.content.0.type' is not supported by slotserve's /v1/messages (user content
blocks: text, tool_result; not None); leave it out" (a Messages block, a system block, a tool_result's
content; a Responses item, part and tool alike, "built-in tools such as None need OpenAI's servers"); a
chat part of no or an unknown type was a 501 "'messages.0.content' is not supported by slotserve; leave
it out", naming the whole content; a list holding a string where objects go (chat's ``content``, the
Responses ``input``, the Messages ``system``) was pydantic's error of the union's first member, "Input
should be a valid string (got list)"; and ``/tokenize`` read a chat part of any type as text (an image
part with a ``text`` key counted as that text), where the chat route refused it. Over the gateway's
handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_json_in_strings import handlers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import error_of, served  # noqa: E402

C, T, R, M, K = "/v1/chat/completions", "/tokenize", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC = (M, K)
BASE = {C: {"model": "m", "max_tokens": 2}, T: {"model": "m"}, R: {"model": "m", "max_output_tokens": 2},
        M: {"model": "m", "max_tokens": 2}, K: {"model": "m"}}
USE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]
CALL = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]


def chat(part) -> dict:
    return {"messages": [{"role": "user", "content": [part]}]}


def blocks(*content, system=None) -> dict:
    return {"messages": [{"role": "user", "content": list(content)}], **({} if system is None else {"system": system})}


def result_content(block) -> dict:
    return {"messages": USE + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                              "content": [block]}]}]}


def parts(part) -> dict:
    return {"input": [{"role": "user", "content": [part]}]}


# (routes, the body's fields, the field the 400 names, its code, words the message holds)
MALFORMED = [
    *[((C, T), chat(part), field, code, says) for part, field, code, says in [
        ({"text": "hi"}, "messages.0.content.0.type", "missing_required_parameter", 'needs a "type"'),
        ({"type": None, "text": "hi"}, "messages.0.content.0.type", "invalid_type", 'must be a string (text); got null'),
        ({"type": 5, "text": "hi"}, "messages.0.content.0.type", "invalid_type", "got 5"),
        ({"type": "foo", "text": "hi"}, "messages.0.content.0.type", "invalid_value", "not 'foo'"),
        ({"type": "text"}, "messages.0.content.0.text", "missing_required_parameter", "needs a string 'text'"),
        ({"type": "text", "text": 5}, "messages.0.content.0.text", "invalid_type", "needs a string 'text'")]],
    ((C, T), {"messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content", "invalid_type",
     'content must be a string or a list of content parts (objects); content[0] is "hi"'),
    ((C, T), {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_type",
     "content must be a string or a list of content parts; got 5"),
    *[(ANTHROPIC, body, field, None, says) for body, field, says in [
        (blocks({"text": "hi"}), "messages.0.content.0.type",
         'a content block needs a "type" saying what it is (user content blocks: text, tool_result)'),
        (blocks({"type": None, "text": "hi"}), "messages.0.content.0.type", "got null"),
        (blocks("hi"), "messages.0.content.0", 'a content block must be an object whose "type" says what it is'),
        ({"messages": USE[:1] + [{"role": "assistant", "content": [7]}]}, "messages.1.content.0",
         "(assistant content blocks: text, tool_use, thinking); got 7"),
        (blocks({"type": "text", "text": "hi"}, system=[{"text": "be brief"}]), "system.0.type",
         '"type" saying what it is (text blocks only here)'),
        (blocks({"type": "text", "text": "hi"}, system=["be brief"]), "system",
         'system must be a string or a list of text blocks (objects); system[0] is "be brief"'),
        (result_content({"text": "x"}), "messages.2.content.0.content.0.type", 'needs a "type"'),
        (result_content("x"), "messages.2.content.0.content.0", "must be an object")]],
    *[((R,), body, field, code, says) for body, field, code, says in [
        (parts({"text": "hi"}), "input.0.content.0.type", "missing_required_parameter",
         'a content part needs a "type" saying what it is (input_text or output_text)'),
        (parts("hi"), "input.0.content.0", "invalid_type", "must be an object"),
        ({"input": [{"type": None, "role": "user", "content": "hi"}]}, "input.0.type", "invalid_type", "got null"),
        ({"input": ["hi"]}, "input", "invalid_type",
         'input must be a string or a list of input items (objects); input[0] is "hi"'),
        ({"input": 5}, "input", "invalid_type", "input must be a string or a list of input items; got 5"),
        ({"input": CALL + [{"type": "function_call_output", "call_id": "c", "output": [{"text": "x"}]}]},
         "input.2.output.0.type", "missing_required_parameter", 'needs a "type"'),
        ({"input": "hi", "tools": [{"name": "f", "parameters": {"type": "object"}}]}, "tools.0.type",
         "missing_required_parameter", 'a tool needs a "type" saying what it is (function tools)'),
        ({"input": "hi", "tools": [{"type": None, "name": "f"}]}, "tools.0.type", "invalid_type", "got null")]],
]
CASES = [(path, body, field, code, says) for paths, body, field, code, says in MALFORMED for path in paths]


@pytest.fixture(scope="module")
def http():
    client = OutputClient()
    with served(handlers(client), client) as h:
        yield h


@pytest.mark.parametrize("path, body, field, code, says", CASES,
                         ids=[f"{p}:{f}:{i}" for i, (p, _, f, _, _) in enumerate(CASES)])
def test_a_malformed_entry_is_a_400_naming_it(http, path, body, field, code, says):
    r = http.post(path, json={**BASE[path], **body})
    if path in ANTHROPIC:  # (Anthropic's shape: no param, the message starts with the field)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}:") or message.startswith(f"{field} "), message
    else:
        e = error_of(r, 400)
        assert e["param"] == field and (code is None or e["code"] == code), e
        message = e["message"]
    assert says in message and "not supported" not in message and "leave it out" not in message, message


@pytest.mark.parametrize("path", [C, T])
@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file", "refusal"])
def test_a_chat_part_of_openais_that_slotserve_does_not_serve_is_a_501_naming_its_type(http, path, kind):
    # (an image part holding a "text" key was read as that text by /tokenize, a 200)
    e = error_of(http.post(path, json={**BASE[path], **chat({"type": kind, kind: {}, "text": "describe"})}), 501)
    assert (e["param"], e["code"]) == ("messages.0.content.0.type", "unsupported"), e
    assert e["message"].startswith(f"{kind} content parts are not supported by slotserve"), e


@pytest.mark.parametrize("path, body", [
    (M, blocks({"type": "image", "source": {}})),
    (R, parts({"type": "input_image", "image_url": "x"})),
    (R, {"input": [{"type": "item_reference", "id": "x"}]}),
    (R, {"input": "hi", "tools": [{"type": "web_search"}]}),
])
def test_a_well_formed_entry_slotserve_does_not_serve_is_still_refused_as_unsupported(http, path, body):
    r = http.post(path, json={**BASE[path], **body})
    assert r.status_code == 400 and "is not supported by slotserve" in r.text, r.text


@pytest.mark.parametrize("path, body", [
    (C, chat({"type": "text", "text": "plain"})),
    (T, chat({"type": "text", "text": "plain"})),
    (M, blocks({"type": "text", "text": "plain"}, system=[{"type": "text", "text": "be brief"}])),
    (K, blocks({"type": "text", "text": "plain"}, system=[{"type": "text", "text": "be brief"}])),
    (R, parts({"type": "input_text", "text": "plain"})),
    (R, {"input": [{"role": "user", "content": "plain"}]}),  # (an item without a type is a message)
])
def test_well_formed_entries_are_served(http, path, body):
    r = http.post(path, json={**BASE[path], **body})
    assert r.status_code == 200, r.text
