"""Each family's tool-call parser (gateway/tool_parsers.py, gateway/tool_xml.py) on text in its models'
own syntax -- calls as the published chat templates render them (Llama 3.1's "JSON based tool
calling", Mistral 7B Instruct v0.3's ``[TOOL_CALLS] [...]`` and the v11+ templates'
``[TOOL_CALLS]name[ARGS]{...}``, Qwen3-Coder's ``<function=...>`` XML) -- with the guarantees
Hermes' parser has: the deltas of every way of cutting an output add up to its whole parse,
``parallel_tool_calls: false`` keeps the first call, plain text stays text, a marker mentioned
where it starts no call stays text."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_parsers import PARSERS, parser_class
from gateway.tool_stream import merged
from gateway.tools import ToolPlan, apply_tool_calls, parse_tool_calls

FUNCTIONS = {
    "get_weather": {"name": "get_weather", "description": "", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"},
        "metric": {"type": ["boolean", "null"]}}, "required": ["city"]}},
    "get_time": {"name": "get_time", "description": "", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}},
}
WEATHER = '{"city": "Paris}\\"", "days": [1, {"n": 2}]}'  # (braces and an escaped quote inside a string)

# parser -> case -> (the model's output, its parse: (content, [(name, arguments)]))
CASES = {
    "llama3_json": {  # Llama 3.1's template: '{"name": "' + name + '", "parameters": ' + arguments|tojson + "}"
        "one": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
                (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        "python_tag": ('<|python_tag|>{"name": "get_time", "parameters": {}}', (None, [("get_time", "{}")])),
        "two": (f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", "arguments": {{}}}}',
                (None, [("get_weather", WEATHER), ("get_time", "{}")])),
        "typed": (' {"type": "function", "name": "get_time", "parameters": {"zone": "utc"}}\nDone.',
                  ("Done.", [("get_time", '{"zone": "utc"}')])),
        "plain": ("It is sunny in Paris; take a hat.", ("It is sunny in Paris; take a hat.", [])),
        "mention": ('Call {"name": "get_time", "parameters": {}} later.',
                    ('Call {"name": "get_time", "parameters": {}} later.', [])),
        "json_answer": ('{"city": "Paris", "temperature": 21}', ('{"city": "Paris", "temperature": 21}', [])),
        "builtin": ('<|python_tag|>brave_search.call(query="weather")',
                    ('<|python_tag|>brave_search.call(query="weather")', [])),
        "unknown": ('{"name": "nope", "parameters": {}}', ('{"name": "nope", "parameters": {}}', [])),
    },
    "mistral": {  # v0.3: '[TOOL_CALLS] [' + {"name", "arguments", "id"} ... ']'; v11+: '[TOOL_CALLS]' + name + '[ARGS]' + args
        "v3": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "a1B2c3D4e"}]',
               (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        "v3_two": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", '
                   '"arguments": {"zone": "utc"}}]', (None, [("get_weather", WEATHER), ("get_time", '{"zone": "utc"}')])),
        "v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
                (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
        "v13_call_id": (f'Let me check. [TOOL_CALLS]get_weather[CALL_ID]x7Yz9Q2rT[ARGS]{WEATHER}',
                        ("Let me check.", [("get_weather", WEATHER)])),
        "no_args_tag": ('[TOOL_CALLS]get_time{"zone": "cet"}', (None, [("get_time", '{"zone": "cet"}')])),
        "plain": ("It is sunny [in] Paris.", ("It is sunny [in] Paris.", [])),
        "mention": ("Models write [TOOL_CALLS] before a call.", ("Models write [TOOL_CALLS] before a call.", [])),
        "unknown": ('[TOOL_CALLS]nope[ARGS]{}', ('[TOOL_CALLS]nope[ARGS]{}', [])),
        "broken": ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"} oops', (None, [("get_time",
                                                                                                  '{"zone": "utc"}')])),
    },
    "qwen3_coder": {  # Qwen3-Coder's template: <tool_call>\n<function=N>\n<parameter=P>\nV\n</parameter>\n</function>\n</tool_call>
        "one": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis \"<b>\" {x}\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n<parameter=detail>\n{\"hourly\": [1, 2]}\n</parameter>\n"
                "<parameter=metric>\nnull\n</parameter>\n</function>\n</tool_call>",
                (None, [("get_weather", '{"city": "Paris \\"<b>\\" {x}", "days": 3, "detail": {"hourly": [1, 2]}, '
                                        '"metric": null}')])),
        "two_and_text": ("I'll look.\n\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n"
                         "<function=get_weather>\n<parameter=city>\nline one\nline two\n\n</parameter>\n"
                         "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>\nDone.",
                         ("I'll look.\nDone.", [("get_time", "{}"),
                                                ("get_weather", '{"city": "line one\\nline two\\n", "days": "three"}')])),
        # a string value that is empty, or whose end tag follows it without a newline
        "empty_value": ("<tool_call>\n<function=get_time>\n<parameter=zone>\n</parameter>\n</function>\n</tool_call>",
                        (None, [("get_time", '{"zone": ""}')])),
        "tight_end": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</parameter>\n</function>\n"
                      "</tool_call>", (None, [("get_weather", '{"city": "Paris"}')])),
        "no_tag": ("<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>",
                   (None, [("get_time", '{"zone": "utc"}')])),
        "plain": ("Use <b>bold</b> or a <tool>.", ("Use <b>bold</b> or a <tool>.", [])),
        "unknown": ("<tool_call>\n<function=nope>\n</function>\n</tool_call>",
                    ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", [])),
        "broken": ("<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\noops</tool_call>\nok",
                   ("ok", [("get_time", '{"zone": "utc"')])),
    },
}
ALL = [(parser, case) for parser, cases in CASES.items() for case in cases]


def calls_of(calls: list) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def feed_in_pieces(parser: str, text: str, cuts: list[int], **options) -> tuple[list[dict], str]:
    stream = parser_class(parser)(FUNCTIONS, **options)
    deltas = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        deltas += stream.feed(text[a:b])
    more, reason = stream.finish("stop")
    return deltas + more, reason


@pytest.mark.parametrize("parser, case", ALL)
def test_the_parse_of_the_family_s_own_syntax(parser, case):
    text, (content, calls) = CASES[parser][case]
    got_content, got_calls = parse_tool_calls(text, FUNCTIONS, parser=parser)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for call in got_calls:
        assert call["type"] == "function" and call["id"]
        if case != "broken":
            json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("parser, case", ALL)
def test_every_cut_into_deltas_adds_up_to_the_whole_parse(parser, case, parallel):
    text = CASES[parser][case][0]
    content, calls = parse_tool_calls(text, FUNCTIONS, parallel, parser=parser)
    whole = (content, calls_of(calls))
    cuttings = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]  # one cut anywhere; every char
    rng = random.Random(0)
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3))) for _ in range(30)]
    for cuts in cuttings:
        deltas, reason = feed_in_pieces(parser, text, cuts, parallel=parallel)
        got_content, got_calls = merged(deltas)
        assert (got_content, calls_of(got_calls)) == whole, cuts
        assert all(d for d in deltas), "an empty delta"
        whole_calls = calls and case != "broken" or (parser, case) == ("mistral", "broken")
        assert reason == ("tool_calls" if whole_calls else "stop"), cuts


@pytest.mark.parametrize("parser, case", [("llama3_json", "two"), ("mistral", "v3_two"), ("mistral", "v11"),
                                          ("qwen3_coder", "two_and_text")])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, case):
    text, (content, calls) = CASES[parser][case]
    got_content, got_calls = parse_tool_calls(text, FUNCTIONS, parallel=False, parser=parser)
    assert calls_of(got_calls) == calls[:1]
    assert got_content == ("I'll look.\nDone." if parser == "qwen3_coder" else None)


def test_mistral_call_ids_are_nine_letters_and_digits():
    # Mistral's templates and mistral-common refuse other ids in the history the next turn sends back
    _, calls = parse_tool_calls(CASES["mistral"]["v11"][0], FUNCTIONS, parser="mistral")
    for call in calls:
        assert len(call["id"]) == 9 and call["id"].isalnum()


def test_a_qwen3_coder_string_value_streams_as_it_is_written():
    stream = parser_class("qwen3_coder")(FUNCTIONS)
    assert stream.feed("Sure <tool") == [{"content": "Sure"}]
    head, brace = stream.feed("_call>\n<function=get_weather>\n")
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert brace == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert stream.feed("<parameter=city>\nPa") == [{"tool_calls": [{"index": 0, "function": {"arguments": '"city": "'}}]},
                                                    {"tool_calls": [{"index": 0, "function": {"arguments": "Pa"}}]}]
    assert stream.feed('r"is\n</para') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'r\\"is'}}]}]
    close, key = stream.feed("meter>\n<parameter=days>\n12")  # a typed value goes out whole, at its end
    assert close == {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}
    assert key == {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": '}}]}
    assert stream.feed("\n</parameter>\n</function>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "12"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.finish("stop") == ([], "tool_calls")


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"),
])
def test_a_call_cut_by_max_tokens_stays_cut_and_says_length(parser, text):
    cut = {"choices": [{"finish_reason": "length", "message": {"content": text}}]}
    (choice,) = apply_tool_calls(cut, ToolPlan(FUNCTIONS, "auto", None, parser=parser))["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].endswith('"city": "Pa')


def test_every_parser_has_a_name_and_an_unknown_one_is_refused():
    assert PARSERS == ("hermes", "llama3_json", "mistral", "qwen3_coder")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        parser_class("llama")
