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
import re

import pytest

from gateway.tool_parsers import PARSERS, parser_class
from gateway.tool_stream import merged
from gateway.tools import ToolPlan, apply_tool_calls, parse_tool_calls

FUNCTIONS = {
    "get_weather": {"name": "get_weather", "description": "", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"},
        "metric": {"type": ["boolean", "null"]}, "hours": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["city"]}},
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
        # text between the tags that is no parameter is read past (its arguments broke off there: '{"zone": "utc"'),
        # a </tool_call> ends a call that left </function> out, as vLLM's parser finds parameters by their tags
        "broken": ("<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\noops</tool_call>\nok",
                   ("ok", [("get_time", '{"zone": "utc"}')])),
        "stray_text": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nand then\n"
                       "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                       (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        "nameless": ("<tool_call>\n<function=get_time>\n<parameter=</function>\n</tool_call>",
                     (None, [("get_time", "{}")])),
        "long_name": ("<function=get_time>\n<parameter=" + "z" * 300 + "\n<parameter=zone>\nutc\n</parameter>\n"
                      "</function>", (None, [("get_time", '{"zone": "utc"}')])),
        # a parameter given again: its first value stands (the object had the key twice: '{"city": "Paris", "city"...')
        "twice": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=city>\n"
                  "Rome\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                  (None, [("get_weather", '{"city": "Paris", "days": 2}')])),
        # the model ended inside a typed value: closed there (its arguments were '{"city": "Paris", "days": ')
        "ended_in_value": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                           "<parameter=days>\n3", (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        # a value without its </parameter> ends at the next <parameter=, </function> or </tool_call>, as vLLM's
        # parser reads it: it ran on to the next </parameter> ('{"city": "Paris\\n<parameter=days>\\n3"}'), or to the
        # output's end ('{"days": "3\\n</function>\\n</tool_call>"}', finish stop)
        "no_param_end": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
                         "</parameter>\n</function>\n</tool_call>",
                         (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        "no_param_end_typed": ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n<parameter=city>\nParis\n"
                               "</function>\n</tool_call>", (None, [("get_weather", '{"days": 3, "city": "Paris"}')])),
        "no_param_end_in_block": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>\nok",
                                  ("ok", [("get_weather", '{"city": "Paris"}')])),
        "no_param_end_no_tag": ("<function=get_time>\n<parameter=zone>\nutc</function>\nok",
                                ("ok", [("get_time", '{"zone": "utc"}')])),
        "no_param_end_twice": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                               "<parameter=city>\nRome\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                               (None, [("get_weather", '{"city": "Paris", "days": 2}')])),
        # typed values in Python's spelling, as Qwen3-Coder's template writes the history's (Jinja's | string), and a
        # type in anyOf (pydantic's Optional[int]): they were strings ('{"metric": "True", "hours": "4"}')
        "python_literals": ("<tool_call>\n<function=get_weather>\n<parameter=metric>\nTrue\n</parameter>\n"
                            "<parameter=detail>\n{'a': [None, False]}\n</parameter>\n<parameter=days>\nNone\n"
                            "</parameter>\n<parameter=hours>\n4\n</parameter>\n</function>\n</tool_call>",
                            (None, [("get_weather", '{"metric": true, "detail": {"a": [null, false]}, "days": null, '
                                                    '"hours": 4}')])),
    },
    "openai": {  # gpt-oss's harmony (openai/harmony docs/format.md); the stop tokens <|call|>, <|return|> are no text
        "first": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
                  (None, [("get_weather", '{"city":"Paris"}')])),
        "preamble": ('**Plan**: check.<|start|>assistant<|channel|>commentary to=functions.get_time<|constrain|>json'
                     '<|message|>{}<|call|>', ("**Plan**: check.", [("get_time", "{}")])),
        "recipient_first": (f' to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}',
                            (None, [("get_weather", WEATHER)])),
        "two": (f'<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>'
                '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|> {"zone": "utc"}\n',
                (None, [("get_weather", WEATHER), ("get_time", '{"zone": "utc"}')])),
        "raw_with_analysis": ('<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>'
                              'commentary to=functions.get_time <|constrain|>json<|message|>{}',
                              ("<|channel|>analysis<|message|>Need the time.<|end|>", [("get_time", "{}")])),
        "junk_after_args": ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "utc"} '
                            'oops<|call|>Then.', ("Then.", [("get_time", '{"zone": "utc"}')])),
        "plain": ("It is sunny; to=be or not.", ("It is sunny; to=be or not.", [])),
        "unknown": ("<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}",
                    ("<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}", [])),
        "builtin": ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}',
                    ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}', [])),
        "not_json": ("Hi.<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>now",
                     ("Hi.<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>now", [])),
        "broken": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa',
                   (None, [("get_weather", '{"city": "Pa')])),
        # a marker that ends the message before the arguments close ends them (they held it and every message after)
        "marker_in_args": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"'
                           '<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json'
                           '<|message|>{}<|call|>', (None, [("get_weather", '{"city": "Paris"'), ("get_time", "{}")])),
        "end_in_string": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa'
                          '<|end|>Then.', ("Then.", [("get_weather", '{"city": "Pa')])),
    },
    "pythonic": {  # Llama 3.2's: "[func_name1(params_name1=params_value1, params_name2=params_value2...), ...]"
        "one": ('[get_weather(city="Paris", days=3)]', (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
        "two": ("[get_weather(city='Pa,ris)\"', days=[1, {'n': (2, -3.5)}], metric=None, detail={\"a\": True}), "
                "get_time()]",
                (None, [("get_weather", '{"city": "Pa,ris)\\"", "days": [1, {"n": [2, -3.5]}], "metric": null, '
                                        '"detail": {"a": true}}'), ("get_time", "{}")])),
        "python_tag": ('<|python_tag|>[get_time(zone="UTC",)]', (None, [("get_time", '{"zone": "UTC"}')])),
        "json_literals": (' [get_weather(city="Oslo", metric=true, days=0x10)]\nDone.',
                          ("Done.", [("get_weather", '{"city": "Oslo", "metric": true, "days": 16}')])),
        "triple_quotes": ('[get_weather(city="""multi\nline \'\' ok""")]',
                          (None, [("get_weather", '{"city": "multi\\nline \'\' ok"}')])),
        "plain": ("It is [sunny] in Paris (mostly).", ("It is [sunny] in Paris (mostly).", [])),
        "mention": ("Call [get_time()] later.", ("Call [get_time()] later.", [])),
        "json_answer": ('["Paris", "Rome"]', ('["Paris", "Rome"]', [])),
        "unknown": ("[nope(x=1)]", ("[nope(x=1)]", [])),
        # a call that breaks the syntax is no call (its arguments were the text before the break: '{"city": "Paris",
        # "days": ', '{' for [get_time(1)]): the answer's first makes the answer content, whole; a later one is dropped
        "broken": ('[get_weather(city="Paris", days=three)]', ('[get_weather(city="Paris", days=three)]', [])),
        "positional": ("[get_time('utc')]", ("[get_time('utc')]", [])),
        "positional_after": ("[get_time(zone='utc', 2)]", ("[get_time(zone='utc', 2)]", [])),
        "starred": ("<|python_tag|>[get_time(**zones)]", ("<|python_tag|>[get_time(**zones)]", [])),
        "twice": ("[get_time(zone='a', zone='b')]", ("[get_time(zone='a', zone='b')]", [])),
        "wrong_bracket": ("[get_time(zone='a']", ("[get_time(zone='a']", [])),
        "ended_inside": ("[get_time(zone='a'", ("[get_time(zone='a'", [])),
        "broken_second": ("[get_time(zone='a'), get_weather(1)] Done.", (None, [("get_time", '{"zone": "a"}')])),
    },
}
ALL = [(parser, case) for parser, cases in CASES.items() for case in cases]
ARGS_CUT = {("openai", "broken"), ("openai", "marker_in_args"), ("openai", "end_in_string")}  # (JSON cut off)
CUT_SHORT = ARGS_CUT | {("qwen3_coder", "ended_in_value")}  # calls their message or the output ended inside: "stop"
BARE_CASES = {  # read with bare=True (no response_format): what the family's models write without the marker
    "mistral": {
        "bare_two": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
                     (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
        "bare_then_text": (' \n[{"name": "get_time", "arguments": {"zone": "utc"}}] Done.',
                           ("Done.", [("get_time", '{"zone": "utc"}')])),
        "bare_json_answer": ('[{"city": "Paris"}]', ('[{"city": "Paris"}]', [])),
        "bare_list": ("[1, 2]", ("[1, 2]", [])),
        "bare_unknown": ('[{"name": "nope", "arguments": {}}]', ('[{"name": "nope", "arguments": {}}]', [])),
        "bare_mid_answer": ('Here: [{"name": "get_time", "arguments": {}}]',
                            ('Here: [{"name": "get_time", "arguments": {}}]', [])),
        "marked_after_bare_text": ('[x] [TOOL_CALLS]get_time[ARGS]{}', ("[x]", [("get_time", "{}")])),
    },
}


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
        if (parser, case) not in ARGS_CUT:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("parser, case", [(p, c) for p, cases in BARE_CASES.items() for c in cases])
def test_what_the_family_writes_without_its_marker_is_read_only_when_bare(parser, case):
    text, (content, calls) = BARE_CASES[parser][case]
    got_content, got_calls = parse_tool_calls(text, FUNCTIONS, bare=True, parser=parser)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    if not case.startswith("marked"):  # (under a response_format: the answer is the user's JSON)
        assert parse_tool_calls(text, FUNCTIONS, parser=parser) == (text, [])


def every_cutting(text: str) -> list[list[int]]:
    """One cut anywhere, a cut at every character, and 30 random cuttings."""
    cuttings = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    rng = random.Random(0)
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3))) for _ in range(30)]
    return cuttings


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("parser, case, bare", [(p, c, False) for p, c in ALL] +
                         [(p, c, True) for p, cases in BARE_CASES.items() for c in cases])
def test_every_cut_into_deltas_adds_up_to_the_whole_parse(parser, case, bare, parallel):
    text = (BARE_CASES if bare else CASES)[parser][case][0]
    content, calls = parse_tool_calls(text, FUNCTIONS, parallel, bare, parser=parser)
    whole = (content, calls_of(calls))
    for cuts in every_cutting(text):
        deltas, reason = feed_in_pieces(parser, text, cuts, parallel=parallel, bare=bare)
        got_content, got_calls = merged(deltas)
        assert (got_content, calls_of(got_calls)) == whole, cuts
        assert all(d for d in deltas), "an empty delta"
        whole_calls = calls and (parser, case) not in CUT_SHORT
        assert reason == ("tool_calls" if whole_calls else "stop"), cuts


@pytest.mark.parametrize("parser, case", [("llama3_json", "two"), ("mistral", "v3_two"), ("mistral", "v11"),
                                          ("qwen3_coder", "two_and_text"), ("pythonic", "two"), ("openai", "two")])
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


def test_a_pythonic_call_goes_out_whole_so_one_cut_by_max_tokens_is_not_sent():
    # a call went out as it was read, so one cut or broken had arguments that broke off: '{"days": 3, "city": '
    cut = {"choices": [{"finish_reason": "length", "message": {"content": '[get_weather(days=3, city="Pa'}}]}
    (choice,) = apply_tool_calls(cut, ToolPlan(FUNCTIONS, "auto", None, parser="pythonic"))["choices"]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    assert not choice["message"].get("tool_calls")  # (neither content nor a call: CallStream's cut rule)
    stream = parser_class("pythonic")(FUNCTIONS)
    assert stream.feed("[get_weather(city='Pa") == [] and stream.feed("ris', days=3") == []  # (held until its ")")
    (first, arguments) = stream.feed(")")
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}}]}
    assert stream.feed(", get_time(") == [] and stream.feed(")]") != []


class _Counted(str):
    """A text that counts how many times its characters are read (``looked``, by index or slice)."""

    looked = 0

    def __getitem__(self, key):
        _Counted.looked += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize("value", ["'" + "ab" * 1000 + "', days=3)", '"""' + "x'\\'" * 400 + '""")',
                                   "[1, (2, ')'), {'k': \"]\"}] " * 80 + ")"])
def test_a_pythonic_value_is_searched_for_its_end_once_however_it_is_fed(value):
    # its end was searched from the value's start at every delta: time quadratic in its length (a 32 kB string fed 4
    # characters a delta took ~23 s of CPU, on the gateway's event loop); each character is now read once (counted,
    # not timed), and the end found is the one the whole text gives, however the text is cut
    from gateway.tool_pythonic import _ValueScan

    want = _ValueScan(0).end(value)
    assert want is not None and value[want] in ",)"
    for step in (1, 4, 13):
        scan, _Counted.looked, got = _ValueScan(0), 0, None
        for n in range(step, len(value) + step, step):
            got = scan.end(_Counted(value[:n]))
            if got is not None:
                break
        assert got == want and _Counted.looked <= 3 * len(value), (step, got, _Counted.looked)


@pytest.mark.parametrize("value", ["''", "'''a'''", "'a\\'b'", "''''''", '"a""b"', "[')', (']',)]", "'''x''' "])
def test_a_pythonic_value_cut_anywhere_ends_where_the_whole_text_says(value):
    from gateway.tool_pythonic import _ValueScan

    text = value + ", days=1)"
    want = _ValueScan(0).end(text)
    assert text[want:].startswith(", days"), (value, want)
    for cut in range(1, len(text)):  # (the text so far at the cut, then all of it)
        scan = _ValueScan(0)
        assert next(e for e in (scan.end(text[:c]) for c in (cut, len(text))) if e is not None) == want, (value, cut)


@pytest.mark.parametrize("reason", ["stop", "length"])
@pytest.mark.parametrize("text", ["[get_time(1)]", "[get_time(zone=x)]", "[get_time(zone='a', 2)]",
                                  "[get_time(zone='a'), get_weather(*c)]", "[get_time(zone='a', zone='b')]"])
def test_a_pythonic_call_s_arguments_are_a_json_object_however_the_text_is_cut(text, reason):
    # '[get_time(1)]' was a call of get_time whose arguments were '{': no JSON (and the Messages API's input {})
    whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser="pythonic", reason=reason)
    assert whole_content in (text, None, "") and [name for name, _ in calls_of(whole_calls)] in ([], ["get_time"])
    for n in range(1, len(text) + 1):  # (the output cut after n characters, fed a character at a time)
        stream = parser_class("pythonic")(FUNCTIONS)
        deltas = [d for k in range(n) for d in stream.feed(text[k])]
        content, calls = merged(deltas + stream.finish(reason)[0])
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls), (n, calls)
        assert content in ("", None, text[:n]) or content == text[:n].lstrip(), (n, content)


QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\"ris\n</parameter>\n<parameter=days>\n12\n"
             "</parameter>\n<parameter=city>\nRome\n</parameter>\n<parameter=detail>\n{\"a\": [1]}\n</parameter>\n"
             "</function>\n</tool_call>")


def streamed(parser: str, text: str, reason: str) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """``text`` fed a character at a time, ending ``reason``: (content, calls, finish reason)."""
    stream = parser_class(parser)(FUNCTIONS)
    deltas = [d for c in text for d in stream.feed(c)]
    more, said = stream.finish(reason)
    assert all(deltas + more), "an empty delta"
    content, calls = merged(deltas + more)
    return content, calls_of(calls), said


def test_a_qwen3_coder_call_the_output_ended_inside_is_a_json_object_unless_max_tokens_cut_it():
    # ended inside a value, between parameters or in a parameter given again, the arguments broke off
    # ('{"city": "Pa\\"ris", "days": '); a stop (the model's end, a stop string) now closes the call there, its last
    # value as far as it was written, as vLLM's parser reads it; max_tokens keeps what was sent (e1b80a0's rule)
    whole = json.loads(parse_tool_calls(QWEN_CALL, FUNCTIONS, parser="qwen3_coder")[1][0]["function"]["arguments"])
    assert whole == {"city": 'Pa"ris', "days": 12, "detail": {"a": [1]}}
    for n in range(QWEN_CALL.index("<parameter="), QWEN_CALL.index("</function>")):
        text = QWEN_CALL[:n]
        content, calls, said = streamed("qwen3_coder", text, "stop")
        whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser="qwen3_coder", reason="stop")
        assert (content, calls) == (whole_content, calls_of(whole_calls)) and said == "stop", n
        ((name, arguments),) = calls
        value = json.loads(arguments)
        assert name == "get_weather" and isinstance(value, dict) and set(value) <= set(whole), (n, value)
        assert 'Pa"ris'.startswith(value.get("city", "")), (n, value)  # (the first value stands, never Rome)
        _, cut, said = streamed("qwen3_coder", text, "length")
        assert said == "length" and cut[0][0] == "get_weather", (n, cut)
        with pytest.raises(ValueError):  # (cut, not closed)
            json.loads(cut[0][1])


QWEN_UNCLOSED = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa<ris\n<parameter=days>\n12\n"
                 "<parameter=detail>\n{\"a\": \"</x>\"}\n</function>\n</tool_call>")


def test_a_qwen3_coder_value_without_its_end_tag_ends_at_the_next_tag_however_the_text_is_cut():
    # a value the model left without </parameter> ran on to the next </parameter> or the output's end, the tags
    # after it in its text ('{"city": "Pa<ris\\n<parameter=days>\\n12\\n<parameter=detail>..."}'); vLLM's parser
    # ends it at the next <parameter= or </function>, less the newline before it
    whole_content, whole_calls = parse_tool_calls(QWEN_UNCLOSED, FUNCTIONS, parser="qwen3_coder")
    assert whole_content is None
    assert [(n, json.loads(a)) for n, a in calls_of(whole_calls)] == [
        ("get_weather", {"city": "Pa<ris", "days": 12, "detail": {"a": "</x>"}})]
    for n in range(QWEN_UNCLOSED.index("<parameter="), len(QWEN_UNCLOSED) + 1):  # (every prefix, a character a delta)
        text = QWEN_UNCLOSED[:n]
        content, calls, said = streamed("qwen3_coder", text, "stop")
        whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser="qwen3_coder", reason="stop")
        assert (content, calls) == (whole_content, calls_of(whole_calls)), n
        ((name, arguments),) = calls
        value = json.loads(arguments)
        assert not any(tag in str(v) for v in value.values() for tag in ("<parameter=", "</function>")), (n, value)
        assert 'Pa<ris'.startswith(value.get("city", "")), (n, value)
        assert said == ("tool_calls" if n >= QWEN_UNCLOSED.index("</function>") + len("</function>") else "stop"), n


@pytest.mark.parametrize("text", [QWEN_UNCLOSED, QWEN_CALL], ids=["unclosed", "whole"])
def test_a_qwen3_coder_call_in_the_real_qwen_vocabulary_s_tokens_reads_as_the_whole_text(text):
    """The Qwen3-Coder cases fed as a real Qwen2.5 tokenizer's pieces (``<tool_call>`` one special
    token, ``<parameter=`` several plain ones), each piece a delta as the worker decodes them, every
    prefix ending ``stop``: the same content and calls as the whole text's parse."""
    from tests.support.vocab import NO_QWEN, qwen_tokenizer

    tok = qwen_tokenizer()
    if tok is None:
        pytest.skip(NO_QWEN)
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == text and "<tool_call>" in pieces  # (one token, as the model writes it)
    for n in range(1, len(pieces) + 1):
        stream = parser_class("qwen3_coder")(FUNCTIONS)
        deltas = [d for piece in pieces[:n] for d in stream.feed(piece)]
        more, _ = stream.finish("stop")
        content, calls = merged(deltas + more)
        whole_content, whole_calls = parse_tool_calls("".join(pieces[:n]), FUNCTIONS, parser="qwen3_coder",
                                                      reason="stop")
        assert (content, calls_of(calls)) == (whole_content, calls_of(whole_calls)), n
        for _, arguments in calls_of(calls):
            assert isinstance(json.loads(arguments), dict), (n, arguments)


@pytest.mark.parametrize("prop, text", [
    ({"type": "string"}, True), (None, True), ({"description": "x"}, True), ({"type": ["string", "null"]}, True),
    ({"type": "integer"}, False), ({"type": ["integer", "null"]}, False), ({"type": ["integer", "string"]}, True),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, False), ({"oneOf": [{"type": "number"}]}, False),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, True),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, True),  # (of several types it takes none, as a type list)
    ({"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}, True), ({"anyOf": "x"}, True)])
def test_a_qwen3_coder_parameter_s_type_is_its_schema_s_or_its_branches(prop, text):
    # a type in anyOf (pydantic's Optional[int]) was no type: the value a string ('{"hours": "4"}'), as vLLM reads it
    from gateway.tool_xml import param_is_text

    function = {"name": "f", "parameters": {"type": "object", "properties": {} if prop is None else {"p": prop}}}
    assert param_is_text(function, "p") is text


HARMONY_ARGS = '{"city": "Pa<ris", "days": [3]}'


@pytest.mark.parametrize("marker", ["<|call|>", "<|end|>", "<|return|>", ""])
def test_a_harmony_marker_before_the_arguments_close_ends_them(marker):
    # '{"city": "Pa<|call|>' was the call's arguments, and the messages after the marker with them (their calls lost);
    # a message's end marker ends it there (vLLM reads the tokens so), and the call was cut short: "stop"
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    second = "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    for n in range(1, len(HARMONY_ARGS) + 1):
        text = head + HARMONY_ARGS[:n] + marker + second
        content, calls, said = streamed("openai", text, "stop")
        whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser="openai", reason="stop")
        assert (content, calls) == (whole_content, calls_of(whole_calls)), n
        assert content is None and calls == [("get_weather", HARMONY_ARGS[:n]), ("get_time", "{}")], (n, calls)
        assert said == ("tool_calls" if n == len(HARMONY_ARGS) else "stop"), n


JSON_ARGS = '{"city": "Pa<ris", "days": [3]}'
# case -> (parser, the call up to its arguments, a marker after them, the next call): the marker, or the next call's
# own, ends the arguments before they close, as harmony's do (test above)
MARKED = {
    "hermes_end": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ', "</tool_call>",
                   '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "hermes_next": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ', "",
                    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "mistral_v11": ("mistral", "[TOOL_CALLS]get_weather[ARGS]", "", "[TOOL_CALLS]get_time[ARGS]{}"),
    "mistral_array": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ', "",
                      '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
}
_MARKERS = re.compile(r"(</?tool_call>|\[TOOL_CALLS\])")


@pytest.mark.parametrize("case", sorted(MARKED))
def test_a_json_family_s_marker_before_the_arguments_close_ends_them(case):
    # '{"city": "Pa</tool_call>\n<tool_call>\n{"name": "get_time"...' was the first call's arguments to the output's
    # end, the second call lost in them (Mistral's [TOOL_CALLS] likewise), as harmony's markers were: Qwen2.5's and
    # Mistral's markers are special tokens, and vLLM's parsers end the call at them; the call was cut short: "stop"
    parser, head, marker, second = MARKED[case]
    for n in range(1, len(JSON_ARGS)):  # (every point inside the arguments)
        text = head + JSON_ARGS[:n] + marker + second
        content, calls, said = streamed(parser, text, "stop")
        whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser=parser, reason="stop")
        assert (content, calls) == (whole_content, calls_of(whole_calls)), n
        assert content is None and calls == [("get_weather", JSON_ARGS[:n]), ("get_time", "{}")], (n, calls)
        assert said == "stop", n
        stream = parser_class(parser)(FUNCTIONS)  # (each marker one piece, as a vocabulary with it as a token gives it)
        deltas = [d for part in _MARKERS.split(text) for piece in ([part] if _MARKERS.fullmatch(part) else part)
                  for d in stream.feed(piece)]
        more, said = stream.finish("stop")
        assert (merged(deltas + more)[0], calls_of(merged(deltas + more)[1]), said) == (content, calls, "stop"), n


# parser -> (what its tool_choice grammar makes the model write, the marker a call starts with): one whole call
FORCED = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "<tool_call>"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|python_tag|>"),
    "llama3_json_untagged": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "{"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "[TOOL_CALLS]"),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "[TOOL_CALLS]"),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", "<tool_call>"),
    "openai": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
               "<|channel|>"),
    "pythonic": ('[get_weather(city="Paris")]', "["),
    "pythonic_tagged": ('<|python_tag|>[get_weather(city="Paris")]', "<|python_tag|>"),
}


def _parser(case: str) -> str:
    return case.rsplit("_", 1)[0] if case.endswith(("_untagged", "_v11", "_tagged")) else case


@pytest.mark.parametrize("case", sorted(FORCED))
def test_a_call_cut_before_its_arguments_is_neither_content_nor_a_call(case):
    # a forced call cut by max_tokens was its markup as the answer's content ('<tool_call>\n{"name":'), in
    # every family; now, however it is cut, the content has none of it (OpenAI never shows its call syntax)
    parser, (text, marker) = _parser(case), FORCED[case]
    for n in range(1, len(text)):
        for reason, forced in (("length", True), ("stop", True), ("length", False)):
            if not forced and n < len(marker):  # (auto: a marker's start may be text, "a <", and stays content)
                continue
            content, calls = parse_tool_calls(text[:n], FUNCTIONS, bare=parser == "llama3_json", parser=parser,
                                              reason=reason, forced=forced)
            assert content in ("", None), (n, reason, forced, content)
            assert [c["function"]["name"] for c in calls] in ([], ["get_weather"]), (n, calls)
            stream = parser_class(parser)(FUNCTIONS, bare=parser == "llama3_json", forced=forced)
            deltas = [d for k in range(n) for d in stream.feed(text[k])]  # (a character a delta)
            more, said = stream.finish(reason)
            assert said in (reason, "tool_calls") and all(deltas + more), (n, deltas + more)
            got_content, got_calls = merged(deltas + more)
            assert (got_content, calls_of(got_calls)) == (content, calls_of(calls)), (n, reason, forced)


# parser -> (two calls, the second a parallel call of get_time, as the family writes them; what starts the second)
TWO_CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>', "\n<tool_call>"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
                    '{"zone": "utc"}}', "; "),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                '"arguments": {"zone": "utc"}}]', "}, "),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}',
                    "}[TOOL_CALLS]"),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n"
                    "</tool_call>", "\n<tool_call>"),
    "openai": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
               '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
               '{"zone": "utc"}<|call|>', "<|start|>"),
    "pythonic": ('[get_weather(city="Paris"), get_time(zone="utc")]', ", "),
}


@pytest.mark.parametrize("case", sorted(TWO_CALLS))
def test_parallel_calls_cut_in_the_second_call_s_header_are_the_first_call_alone(case):
    # harmony's second call cut right after its <|start|> answered '<|start|>' as the content beside the first call
    # (forced or not, whole and streamed): the marker alone was taken for a message that is no call
    parser, (text, second) = _parser(case), TWO_CALLS[case]
    start = text.index(second) + len(second)
    args = text.index("zone")  # (where the second call's arguments begin: cut before, it is no call yet)
    for n in range(start, args):
        for reason, forced in (("length", True), ("stop", True), ("length", False)):
            content, calls = parse_tool_calls(text[:n], FUNCTIONS, bare=parser == "llama3_json", parser=parser,
                                              reason=reason, forced=forced)
            assert content in ("", None), (n, reason, forced, content)
            assert calls_of(calls)[0] == ("get_weather", '{"city": "Paris"}'), (n, calls)
            assert [c["function"]["name"] for c in calls[1:]] in ([], ["get_time"]), (n, calls)
            stream = parser_class(parser)(FUNCTIONS, bare=parser == "llama3_json", forced=forced)
            deltas = [d for k in range(n) for d in stream.feed(text[k])]
            more, _ = stream.finish(reason)
            got_content, got_calls = merged(deltas + more)
            assert (got_content, calls_of(got_calls)) == (content, calls_of(calls)), (n, reason, forced)


@pytest.mark.parametrize("case", sorted(FORCED))
def test_the_whole_call_or_a_stop_in_auto_is_read_as_before(case):
    parser, (text, marker) = _parser(case), FORCED[case]
    content, calls = parse_tool_calls(text, FUNCTIONS, bare=parser == "llama3_json", parser=parser, forced=True,
                                      reason="stop")
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]
    head = text[:text.index("get_weather") + 7]  # "...get_wea": the name not yet whole
    assert parse_tool_calls(head, FUNCTIONS, bare=parser == "llama3_json", parser=parser, reason="stop") == (head, [])
    assert parse_tool_calls(marker[:2], FUNCTIONS, parser=parser, reason="length") == (marker[:2], []) or \
        marker[:2] in ("[", "{")  # (auto: a marker's start stays content; "[" and "{" are markers whole)


@pytest.mark.parametrize("parser, answer", [
    ("hermes", '<tool_call>{"name": "Alice", "age": 3}'), ("llama3_json", '{"name": "Alice", "age": 3}'),
    ("mistral", '[{"name": "Alice", "age": 3}]'), ("qwen3_coder", "<function=Alice> and"),
    ("pythonic", "[Alice(age=3)]")])
def test_an_answer_that_names_no_function_stays_content_however_cut(parser, answer):
    # once its name is no function's start, it is content at once (it was held up to 64 characters), so a cut
    # there keeps it
    at = answer.index("Alice") + 1
    for n in range(at, len(answer) + 1):
        got = parse_tool_calls(answer[:n], FUNCTIONS, bare=True, parser=parser, reason="length")
        assert got == (answer[:n], []), n
    stream = parser_class(parser)(FUNCTIONS, bare=True)
    assert merged(stream.feed(answer[:at]))[0], "the answer was held back"


@pytest.mark.parametrize("value, want", [("'a\\nb'", '"a\\nb"'), ("1e999", None), ("1j", None), ("b'x'", None),
                                         ("f(x)", None), ("__import__('os')", None), ("{1: 2}", None),
                                         ("[" * 5000 + "]" * 5000, None), ("-.5", "-0.5"), ("(1,)", "[1]"),
                                         ("{'a': null}", '{"a": null}'), ("'\\d'", '"\\\\d"')])
def test_a_pythonic_value_is_read_as_a_literal_never_run(value, want):
    from gateway.call_stream import literal_json

    assert literal_json(value) == want


def test_every_parser_has_a_name_and_an_unknown_one_is_refused():
    assert PARSERS == ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "openai")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        parser_class("llama")


# parser -> the call up to its arguments, and after them: arguments that close but are no JSON object follow
NO_JSON_CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]get_weather[ARGS]", ""),
    "openai": ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>", "<|call|>"),
}
NO_JSON_ARGS = ['{"city": Paris}', '{"city": "Paris"]', '{"a": [1}]', '{"city" "Paris"}', '{"city": "Paris",}', "{]"]


@pytest.mark.parametrize("parser", sorted(NO_JSON_CALLS))
def test_a_json_family_s_arguments_that_close_as_no_json_object_are_no_whole_call(parser):
    # _scan closes the arguments at the bracket that ends their depth, so '{"city": Paris}' or '{"city": "x"]' was a
    # whole call: "tool_calls" (and /v1/messages read its input as {}, stop_reason tool_use); now it is broken, as one
    # a marker cut short: it keeps what it sent, "stop"
    head, tail = NO_JSON_CALLS[parser]
    for args in NO_JSON_ARGS + ['{"city": "Paris"}']:
        text = head + args + tail
        content, calls, said = streamed(parser, text, "stop")
        whole_content, whole_calls = parse_tool_calls(text, FUNCTIONS, parser=parser, reason="stop")
        assert (content, calls) == (whole_content, calls_of(whole_calls)) == (None, [("get_weather", args)]), args
        assert said == ("tool_calls" if args == '{"city": "Paris"}' else "stop"), args


def test_a_mistral_marker_before_a_name_no_function_has_is_content_however_the_text_is_cut():
    # '[TOOL_CALLS]hi[' read whole waited on '[' (it may start [ARGS]) and dropped the rest at a forced choice's end,
    # where read a character at a time 'h' already said no call: the marker and the rest were content
    for text in ("ok[TOOL_CALLS]hi[", "ok[TOOL_CALLS]hi[ARGS]", "ok[TOOL_CALLS]hi[CALL_ID]x"):
        for forced in (False, True):
            stream = parser_class("mistral")(FUNCTIONS, forced=forced)
            deltas = [d for c in text for d in stream.feed(c)]
            more, said = stream.finish("length")
            whole = parse_tool_calls(text, FUNCTIONS, parser="mistral", reason="length", forced=forced)
            assert merged(deltas + more) == whole, (text, forced)
            # (content, marker and all; a forced choice drops a marker's start at the end: "[" may be [TOOL_CALLS]'s)
            assert whole == (text[:-1] if forced and text.endswith("[") else text, []), (text, forced)
