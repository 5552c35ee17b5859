"""A key of a message, input item, content block or content part that the vendor's API does not
have is a 400 naming it on ``/v1/messages`` (and ``count_tokens``) and ``/v1/responses``, as
Anthropic's and OpenAI's own APIs answer (``messages.0.name: Extra inputs are not permitted``,
``Unknown parameter: 'input[0].namespace'.``), as an unknown top-level key was already; the
vendor's keys that change nothing here are checked as typed.

Before, each was taken silently, and what it meant was lost: ``{"role": "user", "content": "hi",
"name": "bob"}`` answered 200; a ``tool_result`` whose ``contents`` held the tool's answer (for
``content``) showed the model an empty result; an assistant item with a chat message's
``tool_calls`` dropped its calls; ``citations: 5`` or ``"status": "done"`` on a replayed item were
served. Over the gateway's handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_json_in_strings import handlers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import served  # noqa: E402

M, K, R = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
USE = {"type": "tool_use", "id": "a", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "a", "content": "sunny"}
TEXT = {"type": "text", "text": "hi"}
THINKING = {"type": "thinking", "thinking": "hmm", "signature": "s"}


def called(use: dict = USE, result: dict = RESULT) -> list[dict]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]}]


MESSAGES = [  # (messages, system, the field named, what it says the object takes)
    ([{"role": "user", "content": "hi", "name": "bob"}], None, "messages.0.name", "role and content"),
    ([{"role": "user", "content": [{**TEXT, "foo": 1}]}], None, "messages.0.content.0.foo",
     "type, text, cache_control and citations"),
    (called(use={**USE, "index": 0}), None, "messages.1.content.0.index",  # (LangChain's, in Anthropic's report)
     "type, id, name, input, cache_control, caller and toolset_name"),
    (called(result={"type": "tool_result", "tool_use_id": "a", "contents": "sunny"}), None,
     "messages.2.content.0.contents", "type, tool_use_id, content, is_error, cache_control and toolset_name"),
    (called(result={**RESULT, "content": [{**TEXT, "foo": 1}]}), None, "messages.2.content.0.content.0.foo",
     "type, text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{**THINKING, "foo": 1}, TEXT]},
      {"role": "user", "content": "go"}], None, "messages.1.content.0.foo", "type, thinking and signature"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x", "foo": 1}, TEXT]},
      {"role": "user", "content": "go"}], None, "messages.1.content.0.foo", "type and data"),
    ([{"role": "user", "content": "hi"}], [{**TEXT, "foo": 1}], "system.0.foo", "type, text"),
]


@pytest.fixture(scope="module")
def http():
    client = OutputClient(defaultdict(lambda: "ok"))  # (whatever the last message says)
    with served(handlers(client), client) as h:
        yield h


def post(http, path: str, messages: list[dict], system=None, stream: bool = False):
    body = {"model": "m", "messages": messages, **({"system": system} if system is not None else {})}
    if path == M:
        body.update(max_tokens=2, stream=stream)
    return http.post(path, json=body)


@pytest.mark.parametrize("path, stream", [(M, False), (M, True), (K, False)], ids=["whole", "streamed", "count"])
@pytest.mark.parametrize("messages, system, field, takes", MESSAGES, ids=[m[2] for m in MESSAGES])
def test_an_unknown_key_of_a_message_or_block_is_anthropics_400(http, path, messages, system, field, takes, stream):
    r = post(http, path, messages, system, stream)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    said = r.json()["error"]["message"]
    assert said.startswith(f"{field}: Extra inputs are not permitted ("), said
    assert takes.split(",")[0] in said


WRONG_TYPES = [  # (messages, the field named)
    ([{"role": "user", "content": [{**TEXT, "citations": 5}]}], "messages.0.content.0.citations"),
    ([{"role": "user", "content": [{**TEXT, "citations": [1]}]}], "messages.0.content.0.citations"),
    (called(use={**USE, "caller": "me"}), "messages.1.content.0.caller"),
    (called(use={**USE, "toolset_name": 3}), "messages.1.content.0.toolset_name"),
    (called(result={**RESULT, "toolset_name": []}), "messages.2.content.0.toolset_name"),
]


@pytest.mark.parametrize("path", [M, K])
@pytest.mark.parametrize("messages, field", WRONG_TYPES, ids=[f for _, f in WRONG_TYPES])
def test_an_unused_key_of_another_type_is_a_400(http, path, messages, field):
    r = post(http, path, messages)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field} must be "), r.text


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{**TEXT, "citations": None, "cache_control": {"type": "ephemeral"}}]}],
    [{"role": "user", "content": [{**TEXT, "citations": [{"type": "char_location", "cited_text": "x"}]}]}],
    called(use={**USE, "caller": {"type": "direct"}, "toolset_name": None}, result={**RESULT, "toolset_name": "t"}),
    called(use={**USE, "caller": None}),  # (an answer's block dumped whole, model_dump(): its unset fields null)
    called(result={**RESULT, "content": [{**TEXT, "citations": None}], "is_error": False}),
], ids=["citations null", "citations", "caller", "caller null", "result content"])
def test_anthropics_own_keys_are_served(http, messages):
    for path in (M, K):
        assert post(http, path, messages).status_code == 200, post(http, path, messages).text


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
ASK = {"type": "message", "role": "user", "content": "hi"}

ITEMS = [  # (input, the field named)
    ([{**ASK, "name": "bob"}], "input.0.name"),
    ([{"role": "user", "content": "hi", "foo": 1}], "input.0.foo"),  # (an easy message: no type)
    ([ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}], "input.1.tool_calls"),
    ([{**ASK, "content": [{"type": "input_text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
     "input.0.content.0.cache_control"),
    ([ASK, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "foo": 1}]}],
     "input.1.content.0.foo"),
    ([ASK, {**CALL, "foo": 1}, OUTPUT], "input.1.foo"),
    ([ASK, CALL, {"type": "function_call_output", "call_id": "c1", "output": "x", "content": "sunny"}], "input.2.content"),
    ([ASK, {"type": "reasoning", "id": "rs_1", "summary": [], "foo": 1}], "input.1.foo"),
]


def respond(http, items: list[dict], stream: bool = False):
    return http.post(R, json={"model": "m", "input": items, "max_output_tokens": 2, "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("items, field", ITEMS, ids=[f"{f}:{i}" for i, (_, f) in enumerate(ITEMS)])
def test_an_unknown_key_of_an_input_item_or_part_is_openais_400(http, items, field, stream):
    r = respond(http, items, stream)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["param"], e["code"]) == (field, "unknown_parameter"), e
    assert e["message"].startswith(f"Unknown parameter: '{field}' ("), e


@pytest.mark.parametrize("items, field, says", [
    ([{**ASK, "status": "done"}], "input.0.status", "Invalid value: 'done'. Supported values are: 'in_progress'"),
    ([{**ASK, "phase": "last"}], "input.0.phase", "Invalid value: 'last'."),
    ([{**ASK, "id": 5}], "input.0.id", "Invalid type for 'input.0.id': expected a string, but got a number instead."),
    ([ASK, {**CALL, "caller": "me"}, OUTPUT], "input.1.caller", "Invalid type for 'input.1.caller': expected an object"),
    ([ASK, {"type": "reasoning", "summary": {}}], "input.1.summary", "Invalid type for 'input.1.summary': expected an "
                                                                     "array, but got an object instead."),
    ([{**ASK, "content": [{"type": "input_text", "text": "hi", "prompt_cache_breakpoint": 1}]}],
     "input.0.content.0.prompt_cache_breakpoint", "Invalid type"),
])
def test_an_unused_key_of_another_type_or_value_is_openais_400(http, items, field, says):
    e = respond(http, items).json()["error"]
    assert e["param"] == field and e["message"].startswith(says), e


def test_the_keys_of_a_replayed_output_are_served(http):
    """What a response's own ``output`` carries (ids, statuses, annotations, logprobs, phase, a reasoning
    item's content), sent back as input: served."""
    items = [ASK,
             {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed", "encrypted_content": None,
              "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "phase": None,
              "content": [{"type": "output_text", "text": "x", "annotations": [], "logprobs": []}]},
             {**CALL, "id": "fc_1", "status": "completed", "namespace": "n", "caller": {"type": "direct"}},
             {**OUTPUT, "id": None, "status": None, "name": "f"},
             {**ASK, "content": [{"type": "input_text", "text": "go", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]
    r = respond(http, items)
    assert r.status_code == 200, r.text
