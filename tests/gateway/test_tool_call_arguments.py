"""A tool call's arguments are a whole JSON object on /v1/chat/completions, /v1/responses and /v1/messages,
whole and streamed, for the parsers that build the arguments' JSON themselves: a pythonic call that breaks
the syntax (a positional argument, a value that is no literal, a keyword given twice) was a call whose
arguments broke off where the syntax did ('[get_weather(1)]' gave arguments '{', and the Messages API a
tool_use whose input was {}); now it is no call, and the answer's text is content. Qwen3-Coder's arguments
broke off at text between its tags, or at a </tool_call> without </function>; now such text is read past
and </tool_call> ends the call. A Qwen3-Coder value without its </parameter> ran on over the next parameter
(or to the output's end); now it ends at the next <parameter=, </function> or </tool_call>, as vLLM reads it.
A Qwen3-Coder parameter given again gave the key twice (now its first value stands), and an output the
model ended inside a value left '{"city": "Paris", "days": ' (now the call is closed there). A harmony
message's end marker before its arguments closed was argument text, with every message after it; now it ends
them, as Hermes' </tool_call> or <tool_call> and Mistral's [TOOL_CALLS] there now do too. A JSON family's
arguments that closed but are no JSON object ('{"city": Paris}') ended "tool_calls" as if whole; now the call
keeps what it sent and the answer ends stop, as one a marker cut short. Over the handlers apps with a
scripted broker client (4 characters a token), no sockets."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import chat_stream, sse, vendor_routes  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402

OUTPUTS = {  # the user's message -> the model's output: (parser, output, the calls it holds, whether it is text)
    "positional": ("pythonic", "[get_weather(1)]", [], True),
    "positional_after": ("pythonic", "[get_weather(city='Paris', 2)]", [], True),
    "not_literal": ("pythonic", "[get_weather(city=paris)]", [], True),
    "twice": ("pythonic", "[get_weather(city='a', city='b')]", [], True),
    "second_broken": ("pythonic", "[get_weather(city='Paris'), get_weather(*places)]",
                      [("get_weather", {"city": "Paris"})], False),
    "whole": ("pythonic", "[get_weather(city='Paris', days=3)]", [("get_weather", {"city": "Paris", "days": 3})],
              False),
    # Qwen3-Coder's parameters: text between the tags was where the arguments broke off ('{"city": "Paris"')
    "qwen_stray": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "oops\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                   [("get_weather", {"city": "Paris", "days": 3})], False),
    "qwen_no_function_end": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                             "</parameter>\n</tool_call>", [("get_weather", {"city": "Paris"})], False),
    # a parameter given again was the key twice ('{"city": "Paris", "city": "Rome"}'); the first value stands
    "qwen_twice": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
                   [("get_weather", {"city": "Paris"})], False),
    # the model ended inside a typed value: the arguments were '{"city": "Paris", "days": '; the call is closed there
    "qwen_ended_in_value": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                            "</parameter>\n<parameter=days>\n3",
                            [("get_weather", {"city": "Paris", "days": 3})], False),
    # a value without its </parameter> ran on to the next one ('{"city": "Paris\\n<parameter=days>\\n3"}') or to the
    # output's end ('{"city": "Paris", "days": "3\\n</function>\\n</tool_call>"}'); it ends at the next tag, as in vLLM
    "qwen_no_parameter_end": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                              [("get_weather", {"city": "Paris", "days": 3})], False),
    "qwen_no_parameter_end_at_function": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                          "Paris\n</parameter>\n<parameter=days>\n3\n</function>\n</tool_call>",
                                          [("get_weather", {"city": "Paris", "days": 3})], False),
}
# a call whose message (or block) a marker ended inside its arguments: (parser, output, [(name, arguments text)]);
# its arguments were '{"city": "Pa<|call|><|start|>assistant...' to the output's end, the second call in them
# (Hermes' '{"city": "Pa</tool_call>\n<tool_call>...', Mistral's '{"city": "Pa[TOOL_CALLS]...' likewise)
CUT_SHORT = {
    "harmony_marker": ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
                       '"Pa<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                       '<|message|>{"city": "Rome"}',
                       [("get_weather", '{"city": "Pa'), ("get_weather", '{"city": "Rome"}')]),
    "hermes_marker": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa</tool_call>\n'
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                      [("get_weather", '{"city": "Pa'), ("get_weather", '{"city": "Rome"}')]),
    "mistral_marker": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa[TOOL_CALLS]get_weather[ARGS]'
                       '{"city": "Rome"}', [("get_weather", '{"city": "Pa'), ("get_weather", '{"city": "Rome"}')]),
    # arguments that closed but are no JSON object (a bare word, a "]" closing the "{"): they ended "tool_calls"
    # (/v1/messages: tool_use with the input {}), as if whole
    "harmony_no_json": ("openai", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
                        'Paris}<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>'
                        'json<|message|>{"city": "Rome"}', [("get_weather", '{"city": Paris}'),
                                                           ("get_weather", '{"city": "Rome"}')]),
    "hermes_no_json": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                       [("get_weather", '{"city": Paris}'), ("get_weather", '{"city": "Rome"}')]),
    "mistral_no_json": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"][TOOL_CALLS]get_weather[ARGS]'
                        '{"city": "Rome"}', [("get_weather", '{"city": "Paris"]'), ("get_weather", '{"city": "Rome"}')]),
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


@pytest.fixture(scope="module")
def apps():
    """``{parser: {route: TestClient}}``, over one client that writes each case's output (4 characters a token,
    ``stop``: each is shorter than the requests' 100 tokens)."""
    client = OutputClient({case: output for case, (_, output, *_) in {**OUTPUTS, **CUT_SHORT}.items()})
    parsers = sorted({p for p, *_ in [*OUTPUTS.values(), *CUT_SHORT.values()]})
    with contextlib.ExitStack() as stack:
        yield {parser: stack.enter_context(vendor_routes(
            client, Tokenizers(None), dataclasses.replace(GatewayConfig(), tool_call_parser=parser)))
            for parser in parsers}


def chat(http, case: str) -> tuple[tuple, tuple]:
    """(text, [(name, arguments)]) of the whole answer and of the stream."""
    body = {"model": "m", "messages": [{"role": "user", "content": case}], "max_tokens": 100,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    whole = (c["message"]["content"] or "", [(t["function"]["name"], t["function"]["arguments"])
                                             for t in c["message"].get("tool_calls") or []])
    text, streamed, _ = chat_stream(sse(http, "/v1/chat/completions", body))
    return whole, (text, streamed)


def responses(http, case: str) -> tuple[tuple, tuple]:
    body = {"model": "m", "input": case, "max_output_tokens": 100,
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text

    def read(out):
        return ("".join(p["text"] for i in out["output"] if i["type"] == "message" for p in i["content"]),
                [(i["name"], i["arguments"]) for i in out["output"] if i["type"] == "function_call"])

    events = sse(http, "/v1/responses", body)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    streamed = read(events[-1]["response"])
    assert deltas == "".join(a for _, a in streamed[1])  # (the deltas add up to the items' arguments)
    return read(r.json()), streamed


def messages(http, case: str) -> tuple[tuple, tuple]:
    body = {"model": "m", "messages": [{"role": "user", "content": case}], "max_tokens": 100,
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}
    headers = {"x-api-key": KEY}
    r = http.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    whole = ("".join(b["text"] for b in out["content"] if b["type"] == "text"),
             [(b["name"], json.dumps(b["input"])) for b in out["content"] if b["type"] == "tool_use"])
    events = sse(http, "/v1/messages", body, headers=headers)
    text, calls = "", []
    for e in events:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            calls.append([e["content_block"]["name"], ""])
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            text += e["delta"]["text"]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            calls[-1][1] += e["delta"]["partial_json"]
    return whole, (text, [(name, json.dumps(json.loads(args))) for name, args in calls])


ROUTES = {"chat": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_a_call_s_arguments_are_a_whole_json_object_or_there_is_no_call(apps, route, case):
    parser, output, want, is_text = OUTPUTS[case]
    for text, calls in ROUTES[route](apps[parser][route], case):  # (the whole answer, then the stream)
        assert [(name, json.loads(args)) for name, args in calls] == want, (route, case, calls)
        assert text == (output if is_text else ""), (route, case, text)


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize("case", sorted(CUT_SHORT))
def test_a_marker_that_ends_a_call_inside_its_arguments_ends_them_there(apps, route, case):
    parser, _, want = CUT_SHORT[case]
    for text, calls in ROUTES[route](apps[parser][route], case):  # (the whole answer, then the stream)
        assert (text, calls) == ("", want), (route, text, calls)
    if route == "chat":  # (a call cut short: not "tool_calls")
        body = {"model": "m", "messages": [{"role": "user", "content": case}], "max_tokens": 100,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}
        (choice,) = apps[parser][route].post("/v1/chat/completions", json=body).json()["choices"]
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("case", sorted(CUT_SHORT))
def test_a_marker_that_ends_a_call_inside_its_arguments_on_the_messages_api(apps, case):
    http, headers = apps[CUT_SHORT[case][0]]["messages"], {"x-api-key": KEY}
    body = {"model": "m", "messages": [{"role": "user", "content": case}], "max_tokens": 100,
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}
    out = http.post("/v1/messages", json=body, headers=headers).json()
    assert [(b["type"], b.get("input")) for b in out["content"]] == [("tool_use", {}), ("tool_use", {"city": "Rome"})]
    assert out["stop_reason"] == "end_turn"  # (the first call's input is no object: {} as a cut call's)
    events = sse(http, "/v1/messages", body, headers=headers)
    partial = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(partial) == "".join(args for _, args in CUT_SHORT[case][2])
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["end_turn"]
