"""Tool calling under hostile or careless bodies (gateway/tools.py, gateway/generate.py,
protocol/tools.py): each malformed part of ``tools``, ``tool_choice`` or an assistant message's
``tool_calls`` is an OpenAI-shaped 400 naming the field, never a 500 and never silently dropped,
and a worker's refusal of the grammar built from the tools names ``tools``. Over the handlers app
with a scripted broker client (tests/support/scripted.py), no sockets."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.tokenizer import Tokenizers  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from protocol.request import RequestParams  # noqa: E402
from protocol.tools import check_tool_calls  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import RefusingClient, ScriptedClient, ScriptedLink, handlers_app  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
COMPILE_ERROR = "structured grammar does not compile: failed to compile JSON schema: Invalid type: objectx"


@pytest.fixture
def http():
    client = RefusingClient(COMPILE_ERROR)
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as c:
        c.scripted = client  # what was submitted: c.scripted.submitted
        yield c
    for t in client.threads:
        t.join(10)


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4, **body})


def history(call: dict) -> list[dict]:
    """A chat whose assistant turn made ``call`` (its result answered), then a user turn."""
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and?"}]


def good_call(**over) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
    return {**call, **over}


@pytest.mark.parametrize("name", [["get_weather"], {"a": 1}, 7, None])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_naming_a_non_string_is_a_400(http, name, stream):
    # a list or an object as the name was unhashable: 500 'Internal Server Error'
    e = error_of(chat(http, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": name}},
                      stream=stream), 400)
    said = "Missing required parameter" if name is None else "tool_choice.function.name must be a string"
    assert e["param"] == "tool_choice.function.name" and e["message"].startswith(said), e  # (was "... not in tools")


@pytest.mark.parametrize("tool, param", [
    ({**WEATHER, "extra": 1}, "tools.0.extra"),  # was accepted and dropped
    ({"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}, "tools.0.function.strict"),
    ({"type": "function", "function": {**WEATHER["function"], "strict": 1}}, "tools.0.function.strict"),
])
def test_a_malformed_tool_definition_is_a_400_naming_it(http, tool, param):
    e = error_of(chat(http, tools=[tool]), 400)
    assert e["param"] == param and e["type"] == "invalid_request_error"


def test_strict_true_or_false_is_taken(http):
    for strict in (True, False):
        r = chat(http, tools=[{"type": "function", "function": {**WEATHER["function"], "strict": strict}}])
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("call, param", [
    (good_call(type="other"), "messages.1.tool_calls.0.type"),   # was rendered as a function call
    (good_call(id=5), "messages.1.tool_calls.0.id"),             # was replaced by ""
    (good_call(id=["c1"]), "messages.1.tool_calls.0.id"),
    (good_call(function={"name": "get_weather", "arguments": '{"city": NaN}'}),
     "messages.1.tool_calls.0.function.arguments"),              # NaN is not JSON: was accepted
    (good_call(function={"name": "get_weather", "arguments": '{"t": -Infinity}'}),
     "messages.1.tool_calls.0.function.arguments"),
])
def test_a_malformed_tool_call_in_the_history_is_a_400_naming_it(http, call, param):
    e = error_of(chat(http, tools=[WEATHER], messages=history(call)), 400)
    assert e["param"] == param


def test_a_call_given_as_an_object_or_without_id_and_type_is_taken(http):
    as_object = good_call(function={"name": "get_weather", "arguments": {"city": "Zürich"}})
    bare = {"function": {"name": "get_weather", "arguments": "{}"}}
    for call in (as_object, bare):
        assert chat(http, tools=[WEATHER], messages=history(call)).status_code == 200
    object_call, bare_call = (p.prompt[1].tool_calls[0] for p in http.scripted.submitted)
    assert object_call.arguments == '{"city": "Zürich"}' and bare_call == ("", "get_weather", "{}")


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
     "messages.1.tool_call_id"),                                                  # no call at all
    (history(good_call(id="c2")), "messages.2.tool_call_id"),                      # another call's id
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
      {"role": "assistant", "content": None, "tool_calls": [good_call()]}], "messages.1.tool_call_id"),  # call after
])
def test_a_tool_message_answering_no_earlier_call_is_a_400(http, messages, param):
    # was taken and rendered as the result of a call the model never made (OpenAI refuses it)
    e = error_of(chat(http, tools=[WEATHER], messages=messages), 400)
    assert (e["param"], e["code"]) == (param, "invalid_value") and "'c1'" in e["message"], e
    assert not http.scripted.submitted


def test_tool_messages_answering_the_calls_before_them_are_taken(http):
    two = [good_call(), good_call(id="c2")]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": two},
                {"role": "tool", "tool_call_id": "c2", "content": "1"},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]  # (in any order)
    assert chat(http, tools=[WEATHER], messages=messages).status_code == 200
    # a call answered after another message is not (OpenAI's rule: tests/gateway/test_unanswered_calls.py)
    late = messages[:3] + [{"role": "user", "content": "and?"}, messages[3]]
    e = error_of(chat(http, tools=[WEATHER], messages=late), 400)
    assert e["param"] == "messages.1.tool_calls" and "'c1'" in e["message"], e


@pytest.mark.parametrize("arguments", ["", "  ", None, "absent"])
def test_a_call_without_arguments_in_the_history_is_taken_as_empty(http, arguments):
    """Kind "a history field a client may leave empty" (issue 33): a call without arguments sent
    as "" (what some clients send), blank, null or left out is ``{}``, not a 400."""
    fn = {"name": "get_weather"} if arguments == "absent" else {"name": "get_weather", "arguments": arguments}
    r = chat(http, tools=[WEATHER], messages=history(good_call(function=fn)))
    assert r.status_code == 200, r.text
    assert http.scripted.submitted[-1].prompt[1].tool_calls[0].arguments == "{}"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_grammar_the_worker_refuses_names_tools(http, choice, stream):
    # the worker's compile error names 'structured', which the body does not have: param was None;
    # the one function the grammar calls is named (tests/gateway/test_tool_schema_shapes.py: several)
    e = error_of(chat(http, tools=[WEATHER], tool_choice=choice, stream=stream), 400)
    assert e["param"] == "tools.0.function.parameters" and e["code"] == "bad_request"
    assert "does not compile" in e["message"]


def test_a_response_format_the_worker_refuses_still_names_response_format(http):
    e = error_of(chat(http, tools=[WEATHER], response_format={"type": "json_object"}), 400)
    assert e["param"] == "response_format"


@pytest.mark.parametrize("args", ['{"a": NaN}', '{"a": Infinity}', {"a": float("nan")}])
def test_the_wire_check_refuses_non_json_arguments(args):
    with pytest.raises(ValueError, match="JSON text of an object"):
        check_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}], "m")
    assert check_tool_calls([["c", "f", '{"a": 1.5e300}']], "m")[0].arguments == '{"a": 1.5e300}'


# ---------------------------------------------------------------------- a stop string or token cutting a call

CUT = {  # output text as a stop string leaves it (stop ["}"], ["Paris"]; an EOS mid-call), and whether whole
    "brace": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"', False),
    "value": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "', False),
    "second": ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"ci', False),
    "close-tag": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', True),  # (its close tag)
    "whole": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
}


class Writes(ScriptedClient):
    """Writes ``CUT[last message's content][0]``, 4 characters a token, and ends ``stop``."""

    def _script(self, h) -> None:
        text = CUT[h.params.prompt[-1].content][0]
        h._prompt_tokens = 5
        h.first_token_s = time.monotonic()
        for i in range(0, len(text), 4):
            h._tokens.append(1)
            h._text.append(text[i:i + 4])
            if h.on_token is not None:
                h.on_token(1)
        h._end(FinishReason.STOP, "}", None, time.monotonic())
        h.callback(h.tokens)
        h._done = True


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_call_cut_by_a_stop_string_is_not_reported_whole(name):
    # finish_reason was tool_calls with arguments '{"city": "Paris"' (measured on smollm2-135m, stop ["}"])
    client, whole = Writes(), CUT[name][1]
    body = {"model": "m", "messages": [{"role": "user", "content": name}], "max_tokens": 60, "tools": [WEATHER]}
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        answer = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
        events = [line[6:] for line in text.split("\n") if line.startswith("data: {")]
    for t in client.threads:
        t.join(10)
    assert answer["message"]["tool_calls"] and answer["finish_reason"] == ("tool_calls" if whole else "stop")
    streamed = [c["finish_reason"] for e in events for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert streamed == [answer["finish_reason"]]
    for call in answer["message"]["tool_calls"][:-1] if not whole else answer["message"]["tool_calls"]:
        json.loads(call["function"]["arguments"])  # the calls it reports whole are JSON


def test_a_tool_grammar_too_large_to_submit_names_tools(http):
    # 1,500 small tools (191 KB, under the tools limit) make a required grammar over the spec limit:
    # the client's refusal named 'structured', which the body does not have
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(1500)]
    e = error_of(chat(http, tools=tools, tool_choice="required"), 400)
    assert e["param"] == "tools" and "characters" in e["message"]
    assert chat(http, tools=tools).status_code == 200  # auto: no grammar


def test_a_response_format_too_large_to_submit_names_response_format(http):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12000)}}
    e = error_of(chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                 400)
    assert e["param"] == "response_format.json_schema.schema" and "characters" in e["message"]  # (held)


@pytest.mark.parametrize("extra", [{"tools": [WEATHER], "tool_choice": "required"},
                                   {"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"choice": ["yes", "no"]}}])
def test_min_tokens_with_a_constraint_is_a_400(http, extra):
    # past the constraint's end only EOS is allowed, which min_tokens masks: on smollm2-135m
    # tool_choice required + min_tokens 40 was a 500 model_error 'NonFiniteLogits' after 20 s
    e = error_of(chat(http, min_tokens=3, **extra), 400)
    assert e["param"] == "min_tokens" and "structured" in e["message"]
    reached = error_of(chat(http, min_tokens=0, **extra), 400)  # (submitted: the scripted worker's refusal)
    assert reached["code"] == "bad_request" and "does not compile" in reached["message"]


def test_min_tokens_with_a_constraint_is_a_value_error_in_process():
    from protocol.request import RequestParams
    from protocol.structured import Constraint

    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        RequestParams([1, 2], 8, min_tokens=2, structured=Constraint("regex", "a+"))
    assert RequestParams([1, 2], 8, min_tokens=2).min_tokens == 2


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": ["object", "null"]}, {"type": "array"}])
def test_parameters_that_are_not_an_objects_schema_are_a_400(http, params):
    # on smollm2-135m, tool_choice required with {"type": "string"} wrote '"arguments": "{{weather_data}}"',
    # which is no call: the answer was content and no tool_calls, finish length
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    for choice in ("required", "auto"):
        e = error_of(chat(http, tools=[tool], tool_choice=choice), 400)
        assert e["param"] == "tools.0.function.parameters" and "object" in e["message"]
    with pytest.raises(ValueError, match="parameters must be the JSON schema of an object"):
        RequestParams([{"role": "user", "content": "hi"}], 4, tools=[tool])


def test_a_required_call_of_an_untyped_schema_has_object_arguments():
    from gateway.tools import _call_grammar

    grammar = _call_grammar({"f": {"name": "f", "parameters": {}}, "g": {"name": "g", "parameters": {
        "properties": {"a": {"type": "string"}}}}}, ["f", "g"]).spec
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert [c["properties"]["arguments"]["type"] for c in schema["anyOf"]] == ["object", "object"]


DEEP = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"  # valid JSON, nested past Python's recursion limit


def test_arguments_nested_past_the_recursion_limit_are_a_400(http):
    # json.loads raised RecursionError, which is no ValueError: 500 'Internal Server Error'
    call = good_call(function={"name": "get_weather", "arguments": DEEP})
    e = error_of(chat(http, tools=[WEATHER], messages=history(call)), 400)
    assert e["param"] == "messages.1.tool_calls.0.function.arguments"
    # (it said 'must be the JSON text of an object' alone, which it is: too deep to read, as the schema's words say)
    assert e["message"] == ("a tool call's arguments must be the JSON text of an object; this one nests arrays and "
                            "objects more than 200 levels deep; slotserve reads at most 200: flatten it"), e
    with pytest.raises(ValueError, match="JSON text of an object; this one nests arrays and objects more than 200"):
        check_tool_calls([["c", "f", DEEP]], "m")


def test_a_structured_spec_nested_past_the_recursion_limit_is_a_400(http):
    from protocol.structured import check_structured

    for spec in ({"json_schema": DEEP}, {"choice": "[" * 5000 + "]" * 5000}):
        with pytest.raises(ValueError):
            check_structured(spec)
    e = error_of(chat(http, structured_outputs={"json": DEEP}), 400)
    assert e["param"].startswith("structured_outputs"), e
    assert "nests arrays and objects more than 200 levels" in e["message"], e
    assert "recursion depth" not in e["message"], e  # (Python's words: 'maximum recursion depth exceeded while ...')


def test_a_tool_without_the_function_wrapper_is_told_the_shape_it_needs(http):
    """The message shows the expected shape with single braces (its format string once left
    ``}}}}`` in the text)."""
    e = error_of(chat(http, tools=[{"name": "f", "parameters": {"type": "object"}}]), 400)
    assert e["param"] == "tools.0"
    assert e["message"].endswith('{"type": "function", "function": {name, description, parameters}}'), e["message"]
