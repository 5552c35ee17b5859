"""``/v1/messages`` and ``/v1/messages/count_tokens`` (gateway/messages_api.py, issue 34 item 3):
Anthropic's Messages API as a translation onto the chat path, through the official ``anthropic`` SDK.

Fast lane: the gateway's handlers over the scripted broker client of tests/gateway/test_tools_stream.py
(outputs known exactly) -- every streamed event parses into the SDK's types, the stream's blocks are
the whole answer's, calls come back as ``tool_use`` blocks and go in again as ``tool_result``,
``stop_reason`` maps, errors are Anthropic's shape naming the Messages field, ``x-api-key`` is a key;
the translation alone. Cluster: the tiny text model through real processes -- streamed text equals
the answer, ``count_tokens`` equals the answer's ``input_tokens`` (tools included), a forced tool
call round-trips.
"""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.errors import APIError  # noqa: E402
from gateway.messages_api import chat_messages  # noqa: E402
from gateway.messages_body import MAX_USER_ID_CHARS  # noqa: E402
from gateway.messages_output import stop_reason  # noqa: E402
from tests.gateway.test_tools_stream import OUTPUTS, WEATHER, OutputClient  # noqa: E402
from tests.support.scripted import KEY, ScriptedLink, messages_app  # noqa: E402

EVENTS = TypeAdapter(RawMessageStreamEvent)
TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("get_weather", "get_time")]
THOUGHT = "<think>\nI should call get_time.\n</think>\n\n"


@pytest.fixture
def scripted(monkeypatch):
    """``(sdk, http, client)``: the SDK (``x-api-key``) on the Messages handlers over :class:`OutputClient`,
    with the qwen3 reasoning parser and two outputs that think first."""
    monkeypatch.setitem(OUTPUTS, "think_call", THOUGHT + OUTPUTS["one"])
    monkeypatch.setitem(OUTPUTS, "think_text", THOUGHT + "It is noon.")
    client = OutputClient()
    with TestClient(messages_app(ScriptedLink(client), GatewayConfig(reasoning_parser="qwen3"))) as http:
        yield anthropic.Anthropic(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0), \
            http, client
    for t in client.threads:
        t.join(10)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def raw_events(http, body: dict) -> list[tuple[str, dict]]:
    """The stream's ``(event:, data:)`` pairs as sent, each data parsed strictly by the SDK's union."""
    out, kind = [], None
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == kind
                if kind != "error":
                    EVENTS.validate_python(data)
                out.append((kind, data))
    return out


@pytest.mark.parametrize("name", ["plain", "one", "two", "text_first", "cut", "think_call", "think_text"])
def test_a_stream_adds_up_to_the_answer(scripted, name):
    sdk, http, _ = scripted
    kw = dict(model="m", messages=user(name), max_tokens=9 if name == "cut" else 100, tools=TOOLS)
    whole = sdk.messages.create(**kw)
    Message.model_validate(whole.model_dump(mode="json", exclude_unset=True))  # strictly the SDK's type
    with sdk.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    events = raw_events(http, kw)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    text = lambda m: "".join(b.text for b in m.content if b.type == "text")  # noqa: E731
    shape = lambda m: [b.model_dump(exclude={"id"}) for b in m.content if b.type != "text"]  # noqa: E731
    assert text(final) == text(whole) and shape(final) == shape(whole)
    if name != "text_first":  # (text after a call: the stream's second text block, the answer's one)
        assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens == whole.usage.input_tokens == events[0][1]["message"]["usage"]["input_tokens"] > 0
    calls = [b for b in whole.content if b.type == "tool_use"]
    if name == "one":
        assert whole.stop_reason == "tool_use" and calls[0].name == "get_weather"
        assert calls[0].input == {"city": 'Paris}"', "days": [1, {"n": 2}]}
        partial = "".join(d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"
                          and d["delta"]["type"] == "input_json_delta")
        assert partial == WEATHER
    if name == "two":
        assert [c.name for c in calls] == ["get_time", "get_weather"] and calls[1].input == {"city": "Oslo"}
    if name == "cut":
        assert whole.stop_reason == "max_tokens"
    if name.startswith("think"):
        assert whole.content[0].type == "thinking" and whole.content[0].thinking == "\nI should call get_time.\n"
    if name == "think_text":
        assert text(whole) == "It is noon." and whole.stop_reason == "end_turn"


def test_tool_results_go_back_in_and_stop_sequences_map(scripted):
    sdk, _, client = scripted
    first = sdk.messages.create(model="m", messages=user("two"), max_tokens=100, tools=TOOLS, system="Be brief.")
    history = user("two") + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                             {"role": "user", "content": [
                                 *({"type": "tool_result", "tool_use_id": b.id, "content": "42"}
                                   for b in first.content if b.type == "tool_use"),
                                 {"type": "text", "text": "plain"}]}]
    second = sdk.messages.create(model="m", messages=history, max_tokens=100, tools=TOOLS, stop_sequences=["really"])
    prompt = client.submitted[-1].prompt
    assert [m.role for m in prompt] == ["user", "assistant", "tool", "tool", "user"]
    assert [c.id for c in prompt[1].tool_calls] == [b.id for b in first.content if b.type == "tool_use"]
    assert json.loads(prompt[1].tool_calls[1].arguments) == {"city": "Oslo"}
    assert client.submitted[-1].stop == ("really",)
    assert stop_reason("stop", "really", ["really"]) == ("stop_sequence", "really")
    assert stop_reason("stop", 2, ["really"]) == ("end_turn", None)
    assert second.stop_reason in ("end_turn", "stop_sequence")


def test_output_config_format_is_structured_output(scripted):
    sdk, http, client = scripted
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sdk.messages.create(model="m", messages=user("plain"), max_tokens=100,
                        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert client.submitted[-1].structured is not None
    r = http.post("/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "m", "messages": user("plain"), "max_tokens": 5, "output_config": {"format": {"type": "yaml"}}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("output_config.format")


def test_count_tokens_is_the_rendered_prompt(scripted):
    sdk, _, client = scripted
    count = sdk.messages.count_tokens(model="m", messages=user("hello world"), system="be brief")
    sdk.messages.create(model="m", messages=user("plain"), max_tokens=100)
    # the letters tokenizer: one token per character of "sbe brief.uhello world.a" (role initial, content, '.')
    assert count.input_tokens == len("sbe brief.uhello world.a")


def test_count_tokens_takes_output_config_and_cache_control_as_anthropics_does(scripted):
    """Anthropic's count_tokens takes ``output_config`` and ``cache_control`` (its
    ``MessageCountTokensParams``): they were refused as unknown fields. The format is checked as
    /v1/messages checks it and changes no count (a grammar, not prompt text)."""
    sdk, _, _ = scripted
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plain = sdk.messages.count_tokens(model="m", messages=user("hello world")).input_tokens
    assert sdk.messages.count_tokens(model="m", messages=user("hello world"), cache_control={"type": "ephemeral"},
                                     output_config={"format": {"type": "json_schema", "schema": schema},
                                                    "effort": "low"}).input_tokens == plain


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("output_config, message", [
    ({"format": {"type": "yaml"}}, 'output_config.format must be {"type": "json_schema", "schema": {...}}'),
    # the chat path's checks, named by the Messages field alone (was "output_config.format.schema:
    # response_format.json_schema.schema json_schema must be ...": the chat field and the request's kind too)
    ({"format": {"type": "json_schema", "schema": 5}},
     "output_config.format.schema must be a JSON schema, a JSON object; got an integer 5"),
    ({"format": {"type": "json_schema", "schema": "{"}},
     "output_config.format.schema is not valid JSON at line 1 column 2: expected an object's key in double quotes"),
    ({"format": {"type": "json_schema", "schema": '{"enum": ["\\ud800"]}'}},  # (counted: 200 before)
     "output_config.format.schema is not valid JSON: it contains an unpaired surrogate escape '\\ud800' at line 1 "
     "column 12 (half of a UTF-16 surrogate pair, which is no character); write the character itself, or both "
     "halves of its pair"),
    ({"foo": 1}, "output_config.foo: Extra inputs are not permitted (output_config takes format and effort)"),
    ({"effort": "extreme"}, "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'; "
                            'got "extreme"'),
    ({"effort": 3}, "output_config.effort: Input should be"),
    ("json", "output_config: Input should be an object (format, effort)"),
])
def test_output_config_is_checked_alike_by_a_message_and_a_count(scripted, path, output_config, message):
    _, http, client = scripted
    body = {"model": "m", "messages": user("plain"), "output_config": output_config,
            **({"max_tokens": 5} if path == "/v1/messages" else {})}
    r = http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"].startswith(message), \
        r.json()
    assert "response_format" not in r.text and "json_schema json_schema" not in r.text
    assert not client.threads  # refused before anything was submitted


@pytest.mark.parametrize("path, body, status, kind, field", [
    ("/v1/messages", {"messages": user("plain")}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 5, "tools": [{"type": "web_search_20250305",
                                                                             "name": "web_search"}]},
     400, "invalid_request_error", "tools.0.type"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     400, "invalid_request_error", "messages.0.content.0.type"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 5, "tools": [{"name": "bad name", "input_schema": {}}]},
     400, "invalid_request_error", "tools.0.name"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 5, "tool_choice": {"type": "tool", "name": "f"},
                      "tools": TOOLS}, 400, "invalid_request_error", "tool_choice"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 5, "stop_sequences": ["a", "b", "c", "d", "e"]},
     400, "invalid_request_error", "stop_sequences"),
    ("/v1/messages", {"messages": user("plain"), "max_tokens": 5, "mcp_servers": []}, 400, "invalid_request_error",
     "mcp_servers"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "developer", "content": "x"}]}, 400, "invalid_request_error",
     "messages.0.role"),  # (system is the SDK's SystemMessageParam: taken, tests/gateway/test_vendor_shapes_served.py)
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                 "content": "1"}]}], "max_tokens": 5},
     400, "invalid_request_error", "messages.0.content.0.tool_use_id"),  # (answers no tool_use: was taken)
    ("/v1/messages/count_tokens", {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "1"}]}]},
     400, "invalid_request_error", "messages.1.content.0.tool_use_id"),
])
def test_errors_are_anthropic_shaped_naming_the_field(scripted, path, body, status, kind, field):
    _, http, _ = scripted
    r = http.post(path, json={"model": "m", **body}, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert r.json()["error"]["type"] == kind and field in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("metadata, message", [
    ({"foo": "x"}, "metadata.foo: Extra inputs are not permitted"),
    ({"user_id": "u-1", "session_id": "s"}, "metadata.session_id: Extra inputs are not permitted"),
    ({"user_id": 5}, "metadata.user_id: Input should be a valid string or null; got 5"),
    ({"user_id": ["u-1"]}, "metadata.user_id: Input should be a valid string or null"),
    ({"user_id": "x" * (MAX_USER_ID_CHARS + 1)},
     f"metadata.user_id: String should have at most {MAX_USER_ID_CHARS} characters, got {MAX_USER_ID_CHARS + 1}"),
    ("u-1", "metadata: Input should be an object with one key, user_id"),
])
def test_metadata_is_checked_as_anthropic_checks_it(scripted, metadata, message):
    """``metadata`` is Anthropic's ``Metadata``: one key, ``user_id``, a string of at most 256
    characters or null; anything else is a 400 whose message starts with the field at fault."""
    _, http, client = scripted
    body = {"model": "m", "max_tokens": 5, "messages": user("plain"), "metadata": metadata}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"].startswith(message), \
        r.json()
    assert "response_format" not in r.text and "json_schema json_schema" not in r.text
    assert not client.threads  # refused before anything was submitted


def test_metadata_within_anthropics_bounds_is_taken_and_count_tokens_takes_none(scripted):
    sdk, http, _ = scripted
    for metadata in ({"user_id": "x" * MAX_USER_ID_CHARS}, {"user_id": None}, {}):
        assert sdk.messages.create(model="m", messages=user("plain"), max_tokens=5, metadata=metadata).content
    # Anthropic's count_tokens has no metadata field: refused by name, as any unknown field
    r = http.post("/v1/messages/count_tokens", json={"model": "m", "messages": user("plain"),
                                                     "metadata": {"user_id": "u-1"}}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["message"] == "metadata: Extra inputs are not permitted", r.text


def test_an_unknown_field_is_refused_in_anthropics_words(scripted):
    """Anthropic answers an unknown body field with ``"<field>: Extra inputs are not permitted"``
    (the OpenAI routes keep OpenAI's ``Unrecognized request argument supplied``: test_http.py)."""
    _, http, _ = scripted
    for path, body in (("/v1/messages", {"model": "m", "max_tokens": 5, "messages": user("plain"), "foo": 1}),
                       ("/v1/messages/count_tokens", {"model": "m", "messages": user("plain"), "foo": 1})):
        r = http.post(path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "foo: Extra inputs are not permitted"}}, (path, r.text)


def test_a_chat_path_error_names_the_messages_field_once(scripted):
    """An error the chat path finds in a translated message names the block it came from (a chat
    message's index and keys are not the body's), and a message that names its field already is not
    prefixed again."""
    _, http, _ = scripted
    bad_call = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "not a name", "input": {}}]}]
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": bad_call},
                  headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "messages.1.content.0.name: a tool_use block's name must be 1-64 letters, digits, '_' or '-', got 'not a "
        "name'"), r.text
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, headers={"x-api-key": KEY})
    assert r.json()["error"]["message"].startswith("'messages.0.content.0.type' is not supported"), r.text


def use(name="get_time", id_="t1", input_="{}"):
    """A ``tool_use`` block as JSON text (``input_`` too: a number such as 1e400 goes as written)."""
    return f'{{"type": "tool_use", "id": {json.dumps(id_)}, "name": {json.dumps(name)}, "input": {input_}}}'


def result(id_="t1"):
    return f'{{"type": "tool_result", "tool_use_id": {json.dumps(id_)}, "content": "1"}}'


TEXT = '{"type": "text", "text": "x"}'
HUGE = '{"n": 1e400}'  # (a float's infinity once parsed: no JSON once written out again)
OUT_OF_RANGE = ("a number in this tool_use block's input is no JSON number: NaN, Infinity, or one past a double's "
                "range (about 1.8e308: 1e400 reads as infinity); send it within range, or as a string")
CHAT_ERRORS = {  # a history the chat path cannot carry -> (the Messages field named, the words after it: the
    # Messages API's, not the chat's -- "a tool call's arguments", "a tool message needs the tool_call_id")
    # (the chat: system, user, assistant a + calls, tool results, user text; its indexes are not the client's)
    "a tool_use block's name": (f'[{TEXT}, {use()}, {use("not a name", "t2")}]', f'[{result()}]',
                                "messages.1.content.2.name", "a tool_use block's name must be 1-64 letters, digits, "
                                "'_' or '-', got 'not a name'"),
    "an empty name": (f'[{use("")}]', f'[{result()}]', "messages.1.content.0.name",
                      "a tool_use block's name must be 1-64 letters, digits, '_' or '-', got ''"),
    "a name with a newline after it": (f'[{use("get_time" + chr(10))}]', f'[{result()}]', "messages.1.content.0.name",
                                       "a tool_use block's name must be 1-64 letters, digits, '_' or '-', got "
                                       "'get_time\\n'"),
    "an input past a double's range": (f'[{TEXT}, {use(input_=HUGE)}]', f'[{result()}]',
                                       "messages.1.content.1.input", OUT_OF_RANGE),
    "an input below a double's range": (f'[{use(input_=HUGE.replace("1e400", "-1e400"))}]', f'[{result()}]',
                                        "messages.1.content.0.input", OUT_OF_RANGE),
    "an input holding NaN": (f'[{use(input_=HUGE.replace("1e400", "NaN"))}]', f'[{result()}]',
                             "messages.1.content.0.input", OUT_OF_RANGE),
    "a tool_use_id longer than a tool_call_id": (f'[{use()}, {use(id_="c" * 300)}]',
                                                 f'[{result()}, {result("c" * 300)}, {TEXT}]',
                                                 "messages.2.content.1.tool_use_id", "a tool_result block's "
                                                 "tool_use_id must be the id of the tool_use block it answers, 1 to "
                                                 "256 characters; got 300"),
    "an empty tool_use_id": (f'[{use()}]', f'[{TEXT}, {result("")}]', "messages.2.content.1.tool_use_id",
                             "a tool_result block's tool_use_id must be the id of the tool_use block it answers, 1 "
                             "to 256 characters; got 0"),
    "an empty tool_use id": (f'[{use(id_="")}]', f'[{TEXT}, {result("")}]', "messages.1.content.0.id",
                             "a tool_use block's id must not be empty: it is what its tool_result's tool_use_id "
                             "names"),
}


@pytest.mark.parametrize("path, stream", [("/v1/messages", False), ("/v1/messages", True),
                                          ("/v1/messages/count_tokens", None)])
@pytest.mark.parametrize("name", sorted(CHAT_ERRORS))
def test_a_chat_path_error_about_a_message_names_the_block_the_client_sent(scripted, name, path, stream):
    """Each check of the chat path that a translated message can fail names the Messages field it came
    from -- the block of a tool_use or tool_result, its key in Anthropic's words -- where it named the
    chat's message and keys (``messages: ...``, or ``messages[1].tool_calls[0].function.arguments``:
    the system prompt, the text before a call and the results split off shift the index), whole or
    streamed, and in ``count_tokens``; and says what is wrong in the Messages API's words (the block
    is checked before the chat path: "a tool_use block's name", a number out of range, not "a tool
    call's arguments must be the JSON text of an object" for an object whose number is ``1e400``)."""
    _, http, client = scripted
    calls, results, field, words = CHAT_ERRORS[name]
    messages = f'[{{"role": "user", "content": "x"}}, {{"role": "assistant", "content": {calls}}}, ' \
               f'{{"role": "user", "content": {results}}}]'
    extra = "" if stream is None else f', "max_tokens": 5, "stream": {json.dumps(stream)}'
    r = http.post(path, content=f'{{"model": "m", "system": "Be brief.", "messages": {messages}{extra}}}',
                  headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{field}: {words}"}}, r.text
    assert not client.threads  # refused before anything was submitted


def test_every_chat_field_of_a_message_is_named_as_the_field_it_came_from():
    """Every chat message's field, as the Messages field it came from: ``system``, a message whose
    content is a string, an assistant message's text and each ``tool_use`` block (a call's keys in
    Anthropic's words), each ``tool_result`` block, the user's text after its results; in the param
    and the message's words, whole and in a stream's ``error`` event. A field no message holds keeps
    the chat path's renaming (``messages``)."""
    import asyncio

    from gateway.messages_api import MessagesTranslation, renamed_to_messages
    from gateway.responses import STREAM_END
    from tests.support.gateway import async_items, chat_chunk

    tr = MessagesTranslation()
    tr.chat_body(json.dumps({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                             "stream": True, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "let me see"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                                          {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "2"},
                                     {"type": "text", "text": "and"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "1"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t3", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3", "content": "3"}]},
    ]}).encode())
    # the chat: system, hi, let me see + t1 + t2, tool t2, tool t1, and, t3, tool t3
    for param, message, want_param, want_message in [
        ("messages.0.content", "messages[0].content is bad", "system", "system is bad"),
        ("messages.1.content", "messages.1.content is bad", "messages.0.content", "messages.0.content is bad"),
        ("messages.1.role", "bad", "messages.0.role", "messages.0.role: bad"),
        ("messages.2.content", "bad", "messages.1.content", "messages.1.content: bad"),
        ("messages.2.tool_calls.1.function.arguments", "messages[2].tool_calls[1].function.arguments is bad",
         "messages.1.content.3.input", "messages.1.content.3.input is bad"),
        ("messages.2.tool_calls.0.function.name", "bad", "messages.1.content.2.name", "messages.1.content.2.name: bad"),
        ("messages.2.tool_calls.0.id", "bad", "messages.1.content.2.id", "messages.1.content.2.id: bad"),
        ("messages.2.tool_calls.1.type", "bad", "messages.1.content.3.type", "messages.1.content.3.type: bad"),
        ("messages.2.tool_calls.1", "bad", "messages.1.content.3", "messages.1.content.3: bad"),
        ("messages.2.tool_calls", "bad", "messages.1.content.2", "messages.1.content.2: bad"),
        ("messages.3.tool_call_id", "bad", "messages.2.content.0.tool_use_id", "messages.2.content.0.tool_use_id: bad"),
        ("messages.4.content", "bad", "messages.2.content.2.content", "messages.2.content.2.content: bad"),
        ("messages.5.content", "bad", "messages.2.content", "messages.2.content: bad"),
        ("messages.6.tool_calls.0.function.arguments", "bad", "messages.3.content.0.input",
         "messages.3.content.0.input: bad"),
        ("messages.6", "bad", "messages.3", "messages.3: bad"),
        ("messages.7.tool_call_id", "bad", "messages.4.content.0.tool_use_id", "messages.4.content.0.tool_use_id: bad"),
        ("messages.8.content", "messages.8.content is bad", "messages", "messages is bad"),  # (no message 8)
        ("messages", "messages is bad", "messages", "messages is bad"),
        ("stop", "stop is bad", "stop_sequences", "stop_sequences is bad"),
    ]:
        e = renamed_to_messages(APIError(400, message, param=param), tr.origins)
        assert (e.param, e.message) == (want_param, want_message), param
        tr.on_chat_path = True
        assert json.loads(tr.error(APIError(400, message, param=param)).body)["error"]["message"] == want_message

        async def run():
            stream = async_items(chat_chunk({"role": "assistant", "content": ""}), APIError(400, message, param=param),
                                 STREAM_END)
            return [e async for e in tr.events(stream)]

        last = asyncio.run(run())[-1].decode().split("\n")
        assert last[0] == "event: error" and json.loads(last[1][len("data: "):])["error"]["message"] == want_message


def test_keys_by_either_header_and_a_refusal_in_anthropic_shape(scripted):
    sdk, http, _ = scripted
    body = {"model": "m", "messages": user("plain"), "max_tokens": 5}
    assert http.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url="http://testserver", api_key="sk-wrong", http_client=http,
                            max_retries=0).messages.create(**body)


def test_a_failure_after_the_start_is_an_error_event():
    import asyncio

    from gateway.messages_api import MessagesTranslation
    from gateway.responses import STREAM_END
    from tests.support.gateway import async_items, chat_chunk

    tr = MessagesTranslation()
    tr.chat_body(b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": true}')

    async def run():
        stream = async_items(chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hel"}),
                             APIError(503, "no worker", code="unavailable"), STREAM_END)
        return [e async for e in tr.events(stream)]

    events = [e.decode().split("\n") for e in asyncio.run(run())]
    assert [head for head, *_ in events] == ["event: message_start", "event: content_block_start",
                                             "event: content_block_delta", "event: error"]
    assert json.loads(events[-1][1][len("data: "):]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "no worker"}}
    assert json.loads(events[0][1][len("data: "):])["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}


def test_blocks_become_chat_messages():
    assert chat_messages([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "1"}]}]},
    ]) == [
        {"role": "system", "content": "ab"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
    ]
    with pytest.raises(APIError) as e:
        chat_messages(None, [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}])
    assert e.value.param == "messages.0.content.0.type"
    with pytest.raises(APIError) as e:  # a result before its call answers none
        chat_messages(None, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]}])
    assert (e.value.status, e.value.param) == (400, "messages.0.content.0.tool_use_id")
    assert "unexpected `tool_use_id` found in `tool_result` blocks: t1" in e.value.message


# ---------------------------------------------------------------------- the tiny model through real processes


@pytest.fixture(scope="module")
def text_model(long_text_model):
    """The tiny text model with a longer context: the tools' prompt takes ~900 of its tokens."""
    return long_text_model


@pytest.fixture(scope="module")
def claude(cluster):
    """The official ``anthropic`` SDK pointed at the module's ``cluster`` gateway (no retries)."""
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="unused", max_retries=0) as c:
        yield c


LIVE_TOOLS = [{"name": "get_time", "description": "The time in a zone", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}]


def test_live_stream_equals_the_answer_and_count_tokens_the_prompt(claude, text_model):
    kw = dict(model=text_model, messages=user("hello world"), max_tokens=6, system="Be brief.",
              extra_body={"temperature": 0})  # (this SDK's create has no temperature: Claude picks its own)
    whole = claude.messages.create(**kw)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 6
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert claude.messages.count_tokens(model=text_model, messages=kw["messages"],
                                        system="Be brief.").input_tokens == whole.usage.input_tokens
    stop = whole.content[0].text[2:4]  # a piece of the known output: the same request stops at it
    stopped = claude.messages.create(**kw, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stop not in stopped.content[0].text and whole.content[0].text.startswith(stopped.content[0].text)
    with claude.messages.stream(**kw, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == (
        "stop_sequence", stop, stopped.content[0].text)
    with_tools = claude.messages.create(**kw, tools=LIVE_TOOLS)
    assert with_tools.stop_reason in ("max_tokens", "tool_use", "end_turn")
    assert claude.messages.count_tokens(model=text_model, messages=kw["messages"], system="Be brief.",
                                        tools=LIVE_TOOLS).input_tokens == with_tools.usage.input_tokens
    assert with_tools.usage.input_tokens > whole.usage.input_tokens


def test_live_forced_call_round_trips(claude, text_model):
    r = claude.messages.create(model=text_model, messages=user("hello world"), max_tokens=80,
                               extra_body={"temperature": 0},
                               tools=LIVE_TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and call.name == "get_time" and call.input["zone"] in ("utc", "cet")
    again = claude.messages.create(model=text_model, max_tokens=3, tools=LIVE_TOOLS, messages=user("hello world") + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}])
    assert again.usage.input_tokens > r.usage.input_tokens


def test_live_schema_the_worker_cannot_compile_names_the_messages_field(cluster, text_model):
    """The worker's words for it ("structured json_schema does not compile: ...") name the body's
    field alone: was "output_config.format.schema: structured json_schema does not compile: ..."."""
    r = httpx.post(cluster.http_url + "/v1/messages", timeout=60, json={
        "model": text_model, "messages": user("x"), "max_tokens": 5,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["message"].startswith("output_config.format.schema does not compile: "), r.text


def test_live_unknown_model_is_anthropic_shaped(claude, cluster):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", messages=user("x"), max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error" and "model" in e.value.body["error"]["message"]
    r = httpx.post(cluster.http_url + "/v1/messages", json={"model": "nope", "messages": user("x")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
