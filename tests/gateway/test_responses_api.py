"""``/v1/responses`` (gateway/responses_api.py, issue 34 item 3): OpenAI's Responses API as a
translation onto the chat path, through the official ``openai`` SDK.

Fast lane: the gateway's handlers over the scripted broker client of tests/gateway/test_tools_stream.py
(outputs known exactly: text, calls, thinking) -- every streamed event parses into the SDK's types,
the stream's items are the whole answer's, calls come back as ``function_call`` items and go in again
as input items, errors name the Responses field; the input translation and the store alone.
Cluster: the tiny text model through real processes -- streamed text equals the answer, a forced
tool call round-trips, ``previous_response_id`` continues the conversation (its input grows by the
first answer), ``GET`` / ``DELETE``.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.errors import APIError  # noqa: E402
from gateway.response_store import ResponseStore, StoredResponse  # noqa: E402
from gateway.responses_api import input_messages  # noqa: E402
from tests.gateway.test_tools_stream import OUTPUTS, WEATHER, OutputClient  # noqa: E402
from tests.support.gateway import async_items, chat_chunk, error_of  # noqa: E402
from tests.support.scripted import ScriptedLink, responses_app  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
FUNCTIONS = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("get_weather", "get_time")]
THOUGHT = "<think>\nI should call get_time.\n</think>\n\n"


@pytest.fixture
def scripted(monkeypatch):
    """``(sdk, http, client)``: the SDK on the Responses handlers over :class:`OutputClient`, with the
    qwen3 reasoning parser and two outputs that think first."""
    monkeypatch.setitem(OUTPUTS, "think_call", THOUGHT + OUTPUTS["one"])
    monkeypatch.setitem(OUTPUTS, "think_text", THOUGHT + "It is noon.")
    client = OutputClient()
    app = responses_app(ScriptedLink(client), GatewayConfig(reasoning_parser="qwen3"), ResponseStore(8, 60.0))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), http, client
    for t in client.threads:
        t.join(10)


def collect(stream) -> tuple[list, dict]:
    """The stream's events (each parsed by the SDK) and its final response, asserting the order."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    for e in events:  # the SDK's own union parses every event to its own class
        assert type(EVENTS.validate_python(e.model_dump(mode="json", exclude_unset=True))) is type(e), e.type
    return events, events[-1].response


@pytest.mark.parametrize("name", ["plain", "one", "two", "text_first", "cut", "think_call", "think_text"])
def test_a_stream_adds_up_to_the_answer(scripted, name):
    sdk, _, _ = scripted
    kw = dict(model="m", input=name, max_output_tokens=9 if name == "cut" else 100, tools=FUNCTIONS)
    whole = sdk.responses.create(**kw)
    Response.model_validate(whole.model_dump(mode="json", exclude_unset=True))  # strictly the SDK's type
    events, final = collect(sdk.responses.create(**kw, stream=True))
    strip = {"id", "created_at"}
    shape = lambda r: [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}  # noqa: E731
                       for item in r.output]
    assert shape(final) == shape(whole)
    strip |= {"output", "usage"}
    assert final.model_dump(exclude=strip) == whole.model_dump(exclude=strip)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [item.type for item in whole.output] and [d.type for d in done] == added
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    calls = [item for item in whole.output if item.type == "function_call"]
    assert list(args.values()) == [c.arguments for c in calls if c.arguments]
    if name == "one":
        assert whole.status == "completed" and calls[0].name == "get_weather" and calls[0].arguments == WEATHER
        assert calls[0].call_id.startswith("call_") and whole.output_text == ""
    if name == "cut":
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
        assert events[-1].type == "response.incomplete" and whole.output[-1].status == "incomplete"
    if name.startswith("think"):
        assert whole.output[0].type == "reasoning"
        assert whole.output[0].content[0].text == "\nI should call get_time.\n"
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == whole.output[0].content[0].text
    if name == "think_text":
        assert whole.output_text == "It is noon." and [i.type for i in whole.output] == ["reasoning", "message"]


def test_calls_go_back_in_as_items_and_the_store_continues(scripted):
    sdk, _, client = scripted
    first = sdk.responses.create(model="m", input="two", instructions="Be brief.", tools=FUNCTIONS,
                                 max_output_tokens=100)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "42"} for c in calls]
    second = sdk.responses.create(model="m", input=outputs + [{"role": "user", "content": "plain"}],
                                  previous_response_id=first.id, tools=FUNCTIONS, max_output_tokens=100)
    assert second.previous_response_id == first.id and second.output_text.strip() == OUTPUTS["plain"].strip()
    prompt = client.submitted[-1].prompt  # the chat the chat path got: the first turn, its calls, the outputs
    assert [m.role for m in prompt] == ["user", "assistant", "tool", "tool", "user"]  # (instructions not carried)
    assert [c.id for c in prompt[1].tool_calls] == [c.call_id for c in calls]
    # the same conversation sent whole, as items, renders the same chat
    items = [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls]
    sdk.responses.create(model="m", input=items + outputs + [{"role": "user", "content": "plain"}], store=False,
                         tools=FUNCTIONS, max_output_tokens=100)
    assert client.submitted[-1].prompt == prompt


def test_get_delete_and_unknown_ids(scripted):
    sdk, http, _ = scripted
    r = sdk.responses.create(model="m", input="plain", max_output_tokens=100)
    assert sdk.responses.retrieve(r.id).output_text == r.output_text
    sdk.responses.delete(r.id)
    assert error_of(http.get(f"/v1/responses/{r.id}"), 404)["code"] == "response_not_found"
    assert error_of(http.delete(f"/v1/responses/{r.id}"), 404)["code"] == "response_not_found"
    body = {"model": "m", "input": "plain", "previous_response_id": r.id}
    err = error_of(http.post("/v1/responses", json=body), 400)
    assert (err["param"], err["code"]) == ("previous_response_id", "previous_response_not_found")
    unstored = sdk.responses.create(model="m", input="plain", max_output_tokens=100, store=False)
    assert error_of(http.get(f"/v1/responses/{unstored.id}"), 404)


class HeldOutputClient(OutputClient):
    """:class:`OutputClient` whose requests start writing only once ``release`` is set (``started``:
    one has been submitted), so a response is in progress as long as a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def _script(self, h) -> None:
        self.started.set()
        assert self.release.wait(10)
        super()._script(h)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("delete, dropped", [(False, False), (True, False), (True, True), (False, True)])
def test_a_response_in_progress_is_answered_deleted_and_not_continued(monkeypatch, stream, delete, dropped):
    """While a response was generated, GET answered 404 'not found (never stored, deleted, or dropped
    ...)', previous_response_id the same, and DELETE 404 -- after which the response was stored
    anyway when it ended. Now GET answers it in progress (OpenAI's status), previous_response_id is
    refused as still in progress, and DELETE deletes it: it is not stored when it ends, also where
    its running entry was then ``dropped`` by the store's age bound (it was stored: the deletion went
    with the entry); one dropped but not deleted is stored when it ends."""
    ids = iter(["resp_held", "resp_2", "resp_3"])  # (the held response's id first)
    monkeypatch.setattr("gateway.responses_api.new_id", lambda prefix, sep="-": next(ids) if prefix == "resp" else "x")
    rid = "resp_held"
    client = HeldOutputClient()
    now = [0.0]
    store = ResponseStore(8, 10.0, clock=lambda: now[0])
    app = responses_app(ScriptedLink(client), GatewayConfig(), store)
    body = {"model": "m", "input": "plain", "max_output_tokens": 100, "stream": stream}
    with TestClient(app) as http, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, "/v1/responses", json=body)
        assert client.started.wait(10)
        running = http.get(f"/v1/responses/{rid}")
        assert running.status_code == 200 and Response.model_validate(running.json()).status == "in_progress"
        err = error_of(http.post("/v1/responses", json={"model": "m", "input": "plain",
                                                        "previous_response_id": rid}), 400)
        assert (err["param"], err["code"]) == ("previous_response_id", "previous_response_in_progress")
        if delete:
            assert http.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response.deleted",
                                                                  "deleted": True}
            assert error_of(http.get(f"/v1/responses/{rid}"), 404)["code"] == "response_not_found"
        if dropped:  # older than the age bound: forgotten as running
            now[0] = 10.5
            assert error_of(http.get(f"/v1/responses/{rid}"), 404)["code"] == "response_not_found"
        client.release.set()
        done = answer.result(10)
        assert done.status_code == 200 and rid in done.text
        got = http.get(f"/v1/responses/{rid}")
        if delete:
            assert error_of(got, 404)["code"] == "response_not_found"
        else:
            assert got.status_code == 200 and got.json()["status"] == "completed"
        assert store.running(rid) is None
    for t in client.threads:
        t.join(10)


def test_a_running_response_that_fails_or_loses_its_client_is_not_kept():
    import asyncio

    from gateway.responses import STREAM_END
    from gateway.responses_api import ResponsesTranslation

    store = ResponseStore(4, 60.0)
    failed = ResponsesTranslation(store)
    failed.chat_body(b'{"model": "m", "input": "hi"}')
    assert store.running(failed.id)["status"] == "in_progress"
    failed.error(APIError(404, "no such model", code="model_not_found"))
    assert store.running(failed.id) is None and store.get(failed.id) is None

    gone = ResponsesTranslation(store)
    gone.chat_body(b'{"model": "m", "input": "hi", "stream": true}')

    async def read_two():  # the client goes away after two events: the stream is closed
        events = gone.events(async_items(chat_chunk({"role": "assistant", "content": ""}),
                                         chat_chunk({"content": "Hel"}), STREAM_END))
        got = [await events.__anext__(), await events.__anext__(), await events.__anext__()]
        await events.aclose()
        return got

    assert len(asyncio.run(read_two())) == 3
    assert store.running(gone.id) is None and store.get(gone.id) is None
    unstored = ResponsesTranslation(store)
    unstored.chat_body(b'{"model": "m", "input": "hi", "store": false}')
    assert store.running(unstored.id) is None


def test_running_responses_are_bounded_as_stored_ones():
    now = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: now[0])
    runs = []
    for i in range(3):
        runs.append(store.begin(f"r{i}", {"id": f"r{i}"}))
        now[0] += 1.0
    assert store.running("r0") is None and store.running("r2") == {"id": "r2"}
    now[0] = 11.5  # r1 began at 1.0
    assert store.running("r1") is None and store.running("r2") == {"id": "r2"}
    assert store.delete("r2") and not store.delete("r2") and store.running("r2") is None
    store.end(runs[2], StoredResponse({}, ()))
    assert store.get("r2") is None  # deleted while it ran: not stored
    r3 = store.begin("r3", {"id": "r3"})
    store.end(r3, None)  # failed: nothing stored
    assert store.running("r3") is None and not store.delete("r3") and store.get("r3") is None
    old = store.begin("r4", {"id": "r4"})
    again = store.begin("r4", {"id": "r4"})  # the id begun anew: the old run's end leaves the new one be
    store.end(old, None)
    assert store.running("r4") == {"id": "r4"}
    store.end(again, StoredResponse({"id": "r4"}, ()))
    assert store.running("r4") is None and store.get("r4").response == {"id": "r4"}


@pytest.mark.parametrize("bound", ["count", "age"])
@pytest.mark.parametrize("delete", [True, False])
def test_a_running_response_dropped_by_the_bounds_is_stored_unless_it_was_deleted(bound, delete):
    """A response deleted while it ran, whose running entry the count or age bound then dropped, was
    stored when it ended (the deletion went with the entry); now it is not, whatever the bounds did.
    One dropped but not deleted is stored when it ends (as before the store held running ones)."""
    import asyncio

    from gateway.responses import STREAM_END
    from gateway.responses_api import ResponsesTranslation

    now = [0.0]
    store = ResponseStore(1, 10.0, clock=lambda: now[0])
    first = ResponsesTranslation(store)
    first.chat_body(b'{"model": "m", "input": "hi", "stream": true}')
    if delete:
        assert store.delete(first.id) and store.running(first.id) is None
    if bound == "count":  # another response begins: the one running slot is its
        other = ResponsesTranslation(store)
        other.chat_body(b'{"model": "m", "input": "hi", "stream": true}')
        assert store.running(other.id)["status"] == "in_progress"
    else:
        now[0] = 10.5
    assert store.running(first.id) is None and not store.delete(first.id)  # dropped: unknown now

    async def read_all():
        return [e async for e in first.events(async_items(chat_chunk({"role": "assistant", "content": "Hel"}),
                                                          chat_chunk({"content": "lo"}, "stop"), STREAM_END))]

    assert b"response.completed" in asyncio.run(read_all())[-1]
    stored = store.get(first.id)
    if delete:
        assert stored is None and len(store) == 0
    else:
        assert stored.response["status"] == "completed" and stored.messages[-1]["content"] == "Hello"
    if bound == "count":  # the other one still runs, unharmed
        assert store.running(other.id)["status"] == "in_progress"


@pytest.mark.parametrize("extra, param, code", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "unsupported_parameter"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role", "invalid_value"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name", "invalid_value"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FUNCTIONS}, "tool_choice", "invalid_value"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"frequency": 1}, "frequency", "unknown_parameter"),
    ({"input": None}, "input", "missing_required_parameter"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "[1]"}]},
     "input.0.arguments", "invalid_value"),  # (was "input": the chat path's check, its message index not the item's)
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input.0.call_id",
     "invalid_value"),  # (answers no call: was taken)
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{}"}]},
     "input.0.call_id", "invalid_value"),  # (the call comes after its output)
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "bad name",
                                                   "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"}], "instructions": "Be brief."},
     "input.1.name", "invalid_value"),  # (the chat path's check: its message index -- 2 -- as the item's; was "input")
    ({"input": [{"type": "function_call", "call_id": "c" * 300, "name": "get_time", "arguments": "{}"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call_output", "call_id": "c" * 300, "output": "1"}]},
     "input.2.call_id", "invalid_value"),  # (the chat path's: a tool_call_id is at most 256 characters)
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),  # OpenAI's bounds: 16 keys,
    ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),                    # keys of 64 characters,
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),                   # values of 512
])
def test_bad_bodies_are_400_naming_the_responses_field(scripted, extra, param, code):
    _, http, _ = scripted
    err = error_of(http.post("/v1/responses", json={"model": "m", "input": "plain", **extra}), 400)
    assert err["param"] == param and (code is None or err["code"] == code), err


def test_a_bad_schema_is_named_by_the_responses_field_alone(scripted):
    """The chat path's check words it with the chat field ("response_format.json_schema.schema
    json_schema must be ...", param text.format.schema): the message names the Responses field."""
    _, http, client = scripted
    err = error_of(http.post("/v1/responses", json={"model": "m", "input": "plain", "text": {
        "format": {"type": "json_schema", "name": "x", "schema": 5}}}), 400)
    assert (err["param"], err["message"]) == \
        ("text.format.schema", "text.format.schema must be a JSON schema, a JSON object; got an integer 5"), err
    assert not client.submitted


BAD_CALLS = {  # an output whose call the chat path refuses when it is replayed -> (max_output_tokens, the words)
    "lone_escape": (100, "is not valid JSON: it contains an unpaired surrogate escape '\\ud800' at line 1 column 11 "
                         "(half of a UTF-16 surrogate pair, which is no character); write the character itself, or "
                         "both halves of its pair"),
    "cut": (20, ": a tool call's arguments must be the JSON text of an object"),  # (cut inside its arguments)
}
STORED_HINT = ("; previous_response_id replays the stored response as it is: send that conversation as input items "
               "instead (store: false), with this item corrected")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_a_stored_call_the_chat_path_refuses_is_named_as_the_stored_item(scripted, monkeypatch, name, stream):
    """A call the model wrote that the chat path refuses once it is history (its arguments escape a
    lone surrogate, or were cut): continuing its response by ``previous_response_id`` is a 400 whose
    message names the stored response's output item (was: ``messages[3].tool_calls[0]...``, the chat's
    message index, which instructions and the earlier turns shift; or no item at all)."""
    sdk, http, client = scripted
    monkeypatch.setitem(OUTPUTS, "lone_escape", '<tool_call>{"name": "get_time", "arguments": {"zone": "\\ud800"}}'
                                                '</tool_call>')
    max_tokens, words = BAD_CALLS[name]
    first = sdk.responses.create(model="m", input="plain", max_output_tokens=100)
    second = sdk.responses.create(model="m", input=name, previous_response_id=first.id, tools=FUNCTIONS,
                                  max_output_tokens=max_tokens)
    (k, call), = [(k, item) for k, item in enumerate(second.output) if item.type == "function_call"]
    assert k == (1 if name == "cut" else 0)  # (the cut answer's text comes first)
    submitted = len(client.submitted)
    r = http.post("/v1/responses", json={
        "model": "m", "previous_response_id": second.id, "tools": FUNCTIONS, "instructions": "Be brief.",
        "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "1"}], "stream": stream})
    err = error_of(r, 400)
    assert err["param"] == "input" and err["type"] == "invalid_request_error", err
    where = f"output[{k}].arguments of stored response {second.id}"
    assert err["message"] == where + (" " if name == "lone_escape" else "") + words + STORED_HINT, err
    assert len(client.submitted) == submitted  # refused before anything was submitted


def test_a_chat_messages_error_names_the_item_it_came_from():
    """Every chat message's field, as the item it came from: this request's input items (a message
    item, a function_call item joined to the assistant message before it, a function_call_output
    item), the instructions, and the stored conversation's items (input and output, with the id of
    the response that held them). A field no item holds keeps the chat path's renaming ("input")."""
    from gateway.responses_api import ResponsesTranslation

    store = ResponseStore(4, 60.0)
    first = ResponsesTranslation(store)
    first.chat_body(json.dumps({"model": "m", "input": [
        {"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs", "summary": []},
        {"role": "assistant", "content": "let me see"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]}).encode())
    first.answer({"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
    later = ResponsesTranslation(store)
    later.chat_body(json.dumps({"model": "m", "instructions": "Be brief.", "previous_response_id": first.id,
                                "input": [{"type": "function_call_output", "call_id": "c3", "output": "3"},
                                          {"type": "function_call", "call_id": "c4", "name": "f", "arguments": "{}"},
                                          {"type": "function_call_output", "call_id": "c4", "output": "4"},
                                          {"role": "user", "content": "more"}]}).encode())
    later.on_chat_path = True
    # the chat: instructions, hi, let me see + c1 + c2, tool c2, tool c1, ok + c3 (output 0, 1), tool c3, c4,
    # tool c4, more
    stored = f" of stored response {first.id}"
    for param, message, want_param, want_message in [
        ("messages.0.content", "messages[0].content is bad", "instructions", "instructions is bad"),
        ("messages.1.content", "messages.1.content is bad", "input", f"input[0].content{stored} is bad"),
        ("messages.2.tool_calls.1.function.arguments", "bad", "input", f"input[4].arguments{stored}: bad"),
        ("messages.2.tool_calls", "bad", "input", f"input[3]{stored}: bad"),
        ("messages.2.role", "bad", "input", f"input[2].role{stored}: bad"),
        ("messages.3.tool_call_id", "bad", "input", f"input[5].call_id{stored}: bad"),
        ("messages.4.tool_call_id", "bad", "input", f"input[6].call_id{stored}: bad"),
        ("messages.5.content", "bad", "input", f"output[0].content{stored}: bad"),
        ("messages.5.tool_calls.0.id", "bad", "input", f"output[1].call_id{stored}: bad"),
        ("messages.6.content", "bad", "input.0.output", "input[0].output: bad"),
        ("messages.7.tool_calls.0.function.name", "bad", "input.1.name", "input[1].name: bad"),
        ("messages.7", "bad", "input.1", "input[1]: bad"),
        ("messages.8.tool_call_id", "bad", "input.2.call_id", "input[2].call_id: bad"),
        ("messages.9.content.0", "bad", "input.3.content", "input[3].content: bad"),
        ("messages.10.content", "messages.10.content is bad", "input", "input is bad"),  # (no message 10)
        ("messages", "messages is bad", "input", "input is bad"),
        ("max_tokens", "max_tokens is bad", "max_output_tokens", "max_output_tokens is bad"),
    ]:
        body = json.loads(later.error(APIError(400, message, param=param)).body)["error"]
        hint = STORED_HINT if stored in want_message else ""
        assert (body["param"], body["message"]) == (want_param, want_message + hint), param


def test_an_output_answering_no_call_says_so_as_openai_does(scripted):
    _, http, client = scripted
    first = {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}"}
    body = {"model": "m", "tools": FUNCTIONS, "max_output_tokens": 100, "store": False,
            "input": [first, {"type": "function_call_output", "call_id": "call_b", "output": "1"}]}
    err = error_of(http.post("/v1/responses", json=body), 400)
    assert err["message"] == "No tool call found for function call output with call_id call_b.", err
    assert err["param"] == "input.1.call_id" and not client.submitted


def test_metadata_at_openais_bounds_is_echoed(scripted):
    sdk, _, _ = scripted
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 keys of 64 characters, values of 512
    assert sdk.responses.create(model="m", input="plain", max_output_tokens=100, metadata=metadata).metadata == metadata


def test_structured_output_reaches_the_chat_path(scripted):
    sdk, _, client = scripted
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sdk.responses.create(model="m", input="plain", max_output_tokens=100,
                         text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert client.submitted[-1].structured is not None
    sdk.responses.create(model="m", input="plain", max_output_tokens=100, text={"format": {"type": "text"}})
    assert client.submitted[-1].structured is None


def test_reasoning_effort_reaches_the_template(scripted):
    sdk, _, client = scripted
    sdk.responses.create(model="m", input="plain", max_output_tokens=100, reasoning={"effort": "low"})
    assert client.submitted[-1].chat_template_kwargs == '{"reasoning_effort":"low"}'
    sdk.responses.create(model="m", input="plain", max_output_tokens=100, reasoning={"summary": "auto"})
    assert client.submitted[-1].chat_template_kwargs is None


# ---------------------------------------------------------------------- the translation and the store alone


def sse_events(raw: list[bytes]) -> list[dict]:
    out = []
    for event in raw:
        head, data = event.decode().split("\n", 1)
        out.append(json.loads(data[len("data: "):]))
        assert head == "event: " + out[-1]["type"]
    return out


def test_a_failure_after_the_start_ends_the_stream_with_response_failed():
    import asyncio

    from gateway.responses import STREAM_END
    from gateway.responses_api import ResponsesTranslation

    tr = ResponsesTranslation(ResponseStore(4, 60.0))
    tr.chat_body(b'{"model": "m", "input": "hi", "stream": true}')
    failure = APIError(500, "the model failed", code="internal")

    async def run():
        stream = async_items(chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hel"}), failure,
                             STREAM_END)
        return [e async for e in tr.events(stream)]

    events = sse_events(asyncio.run(run()))
    assert [e["type"] for e in events][-4:] == ["response.output_text.done", "response.content_part.done",
                                               "response.output_item.done", "response.failed"]
    failed = EVENTS.validate_python(events[-1])
    assert failed.response.status == "failed" and failed.response.error.message == "the model failed"
    assert failed.response.output[0].content[0].text == "Hel" and len(tr.store) == 0  # (a failure is not stored)



def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    assert input_messages([
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        call, {**call, "call_id": "c2"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        call, {"type": "function_call_output", "call_id": "c1", "output": "3"},  # (a call made again, answered again)
    ]) == [
        {"role": "system", "content": "rules"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    with pytest.raises(APIError) as e:
        input_messages([{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}])
    assert e.value.param == "input.0.call_id"
    # an output answers a call of the conversation it continues (previous_response_id's), or none: a 400
    output = {"type": "function_call_output", "call_id": "c9", "output": "1"}
    earlier = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert input_messages([output], earlier) == [{"role": "tool", "tool_call_id": "c9", "content": "1"}]
    with pytest.raises(APIError) as e:
        input_messages([output], [{"role": "user", "content": "hi"}])
    assert e.value.param == "input.0.call_id" and e.value.status == 400


def test_the_store_is_bounded_by_count_and_age():
    now = [0.0]
    store = ResponseStore(3, 10.0, clock=lambda: now[0])
    entry = StoredResponse({}, ())
    for i in range(4):
        store.put(f"r{i}", entry)
        now[0] += 1.0
    assert store.get("r0") is None and [store.get(f"r{i}") for i in (1, 2, 3)] == [entry] * 3  # the oldest went
    now[0] = 11.5  # r1 was stored at 1.0: 10.5 s ago
    assert store.get("r1") is None and store.get("r2") is entry and len(store) == 2
    store.put("r2", entry)  # stored again: the newest, aged from now
    now[0] = 13.5
    assert store.get("r3") is None and store.get("r2") is entry
    assert store.delete("r2") and not store.delete("r2") and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(0, 1.0)
    with pytest.raises(ValueError):
        ResponseStore(1, 0)


# ---------------------------------------------------------------------- the tiny model through real processes


@pytest.fixture(scope="module")
def text_model(long_text_model):
    """The tiny text model with a longer context: the tools' prompt takes ~900 of its tokens."""
    return long_text_model


def test_live_stream_equals_the_answer_and_the_conversation_continues(oai, text_model):
    kw = dict(model=text_model, input="hello world", max_output_tokens=6, temperature=0)
    whole = oai.responses.create(**kw)
    assert whole.status == "incomplete" and whole.output_text and whole.usage.output_tokens == 6
    with oai.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == whole.output_text
    nxt = oai.responses.create(model=text_model, input="and again", previous_response_id=whole.id,
                               max_output_tokens=2, temperature=0)
    alone = oai.responses.create(model=text_model, input="and again", max_output_tokens=2, temperature=0)
    # the second prompt holds the first turn and its answer: more tokens than the new input alone
    assert nxt.usage.input_tokens > alone.usage.input_tokens + whole.usage.output_tokens - 2


def test_live_forced_call_round_trips(oai, text_model):
    tools = [{"type": "function", "name": "get_time", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet"]}}}}]
    r = oai.responses.create(model=text_model, input="hello world", tools=tools, max_output_tokens=80,
                             temperature=0, tool_choice={"type": "function", "name": "get_time"})
    (call,) = [item for item in r.output if item.type == "function_call"] or [r.model_dump()]
    assert r.status == "completed", (r.output, r.usage)
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")
    again = oai.responses.create(model=text_model, previous_response_id=r.id, tools=tools, max_output_tokens=3,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert again.usage.input_tokens > r.usage.input_tokens


def test_live_errors_are_openai_shaped(cluster, text_model):
    r = httpx.post(cluster.http_url + "/v1/responses", timeout=30,
                   json={"model": text_model, "input": "x", "tools": [{"type": "file_search"}]})
    assert error_of(r, 400)["param"] == "tools.0.type"
    r = httpx.post(cluster.http_url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=30)
    assert error_of(r, 404)["param"] == "model"
