"""Tool calling on /v1/chat/completions (gateway/tools.py) through the ``openai`` SDK: ``required`` and
a named function are enforced by the grammar (the tiny model's output is gibberish, so a valid call
is the constraint's doing), the answer has ``message.tool_calls`` and ``finish_reason: tool_calls``,
a stream says the same as the non-streamed answer, ``tool`` messages go in the history, and the
messages, the Hermes rendering and the parsing hold on their own."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from gateway.errors import APIError  # noqa: E402
from gateway.tools import ToolPlan, apply_tool_calls, parse_tool_calls, render_messages  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["utc", "cet"]}}}}}]
MESSAGES = [{"role": "user", "content": "hello world"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def text_model(long_text_model):
    """The tiny text model with a longer context: the tiny tokenizer spends ~900 tokens on the tools' prompt."""
    return long_text_model


def check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_valid_call(oai, text_model):
    r = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=80, temperature=0,
                                    tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, set(SCHEMAS))


def test_a_named_function_is_the_one_called(oai, text_model):
    r = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=2,
                                    tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, {"get_time"})


def test_a_stream_says_what_the_answer_says(oai, text_model):
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=80, temperature=0, tools=TOOLS,
              tool_choice="required")
    whole = oai.chat.completions.create(**kw).choices[0]
    calls, reasons, roles = {}, [], []
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage.completion_tokens > 0
            continue
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert roles == ["assistant"] and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_messages_in_the_history_and_none(oai, text_model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = oai.chat.completions.create(model=text_model, messages=history, max_tokens=6, temperature=0, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=6, temperature=0)
    none = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=6, temperature=0,
                                       tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content  # tools not shown


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"tools": TOOLS[:1], "tool_choice": "required",
      "messages": MESSAGES, "max_tokens": 4}, None),  # (a valid one: 200)
])
def test_malformed_tools_are_400_naming_the_field(cluster, text_model, extra, param):
    body = {"model": text_model, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, **extra}
    r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=60)
    if param is None:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"  # cut before the call closed
        return
    assert error_of(r, 400)["param"] == param


# ---------------------------------------------------------------------- rendering and parsing alone


def test_messages_carry_tool_calls_and_hermes_renders_them():
    class Raw:
        def __init__(self, tool_calls=None, tool_call_id=None):
            self.tool_calls, self.tool_call_id = tool_calls, tool_call_id

    from worker.models.hermes import hermes_messages
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    raw = [Raw(), Raw(), Raw([{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]), Raw(tool_call_id="c")]
    out = render_messages(msgs, raw)
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert out[3] == {"role": "tool", "content": "42", "tool_call_id": "c"}  # the worker renders it (template or Hermes)
    for bad in ("{", "[1]"):
        with pytest.raises(APIError):
            render_messages(msgs[:3], [Raw(), Raw(), Raw([{"function": {"name": "f", "arguments": bad}}])])
    tools = [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}]
    template_msgs = [{"role": m["role"], "content": m["content"]} for m in out[:2]] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42"}]
    hermes = hermes_messages(template_msgs, tools)
    assert hermes[0]["role"] == "system" and hermes[0]["content"].startswith("Be brief.")
    assert "<tools>" in hermes[0]["content"] and '"name": "f"' in hermes[0]["content"]
    assert hermes[2] == {"role": "assistant",
                         "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert hermes[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert hermes_messages(template_msgs[1:2], None) == template_msgs[1:2]


def test_parsing_keeps_text_and_unknown_blocks():
    fns = {"f": {}, "g": {}}
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "zz", ' \
           '"arguments": {}}</tool_call><tool_call>{"name": "g", "parameters": {"y": "é"}}</tool_call>'
    content, calls = parse_tool_calls(text, fns)
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"y": "é"}
    assert content == 'Sure.\n<tool_call>{"name": "zz", "arguments": {}}</tool_call>'
    assert parse_tool_calls("no calls", fns) == ("no calls", [])
    cut = {"choices": [{"finish_reason": "length", "message": {"content": text[:text.index('"x"') + 3]}}]}
    (choice,) = apply_tool_calls(cut, ToolPlan(fns, "auto", None))["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("f", '{"x"')]  # cut as the stream would have sent it
