"""The ``structured`` request field (protocol/structured.py): what the edge accepts, refuses and
normalises, before any model sees it."""

import json

import pytest

from protocol.codec import decode, encode
from protocol.messages import Envelope, Submit
from protocol.request import ModelLimits, RequestParams as P
from protocol.structured import JSON_OBJECT, MAX_CHOICES, MAX_SPEC_CHARS, Constraint
from protocol.errors import UnsupportedError


@pytest.mark.parametrize("value, kind, spec", [
    ({"json_schema": {"type": "object", "properties": {"b": {}, "a": {}}}}, "json_schema",
     '{"type":"object","properties":{"b":{},"a":{}}}'),  # compact, key order kept
    ({"json": '{"type": "integer"}'}, "json_schema", '{"type":"integer"}'),  # vLLM's name, JSON text
    ({"regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    (("choice", '["a"]'), "choice", '["a"]'),  # as off the wire
    ({"grammar": 'start: "x"'}, "grammar", 'start: "x"'),
    ({"lark": 'start: "x"'}, "grammar", 'start: "x"'),
    ({"gbnf": 'root ::= "x"'}, "gbnf", 'root ::= "x"'),
    ({"json_object": True}, "json_object", ""),
])
def test_accepted_constraints_are_normalised(value, kind, spec):
    got = P([1], 2, structured=value).structured
    assert got == Constraint(kind, spec) and type(got) is Constraint


@pytest.mark.parametrize("value, words", [
    ({"json_schema": [1, 2]}, "JSON object"),
    ({"json_schema": True}, "JSON object"),
    ({"json_schema": "{nope"}, "structured json_schema is not valid JSON at line 1 column 2: expected an object's "
                               "key in double quotes"),  # (was json's words: "Expecting property name ...")
    ({"json_schema": '{"a":\n 1 2}'}, "is not valid JSON at line 2 column 4: expected ',' or a closing bracket"),
    ({"json_schema": '{"a": 1' + "0" * 5000 + "}"}, "structured json_schema holds an integer of more than"),
    ({"json_schema": {"x": float("nan")}}, "json_schema.x is NaN, which is no JSON number"),
    ({"choice": []}, "empty list"),
    ({"choice": ["a", ""]}, "choice[1]"),
    ({"choice": ["a", 3]}, "choice[1]"),
    ({"choice": "a"}, "list of strings"),
    ({"choice": ["x"] * (MAX_CHOICES + 1)}, "at most"),
    ({"regex": ""}, "empty"),
    ({"grammar": "   "}, "blank"),
    ({"gbnf": 5}, "must be a str"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "at most"),
    ({"xml": "x"}, "kind must be one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one key"),
    ({"json_object": "x"}, "takes no spec"),
    ("regex", "map {kind: spec}"),
    (("regex",), "map {kind: spec}"),
])
def test_bad_constraints_are_refused_naming_the_field(value, words):
    with pytest.raises(ValueError, match="structured") as ei:
        P([1], 2, structured=value)
    assert words in str(ei.value)


def test_the_sampling_carries_the_constraint_and_explicit_stop_tokens():
    plain = P([1], 2)
    assert plain.sampling.structured is None and plain.sampling.is_plain_greedy
    p = P([1], 2, structured={"regex": "a+"})
    assert p.sampling.structured == Constraint("regex", "a+") and p.sampling.constrained
    assert not p.sampling.is_plain_greedy  # no screened head, no drafts
    assert p.sampling.structured_stops == ()  # the serving side's default stops
    assert P([1], 2, stop_token=[9, 4], structured={"regex": "a+"}).sampling.structured_stops == (4, 9)
    hot = P([1], 2, temperature=0.8, seed=3, structured={"regex": "a+"}).sampling
    assert hot.temperature == 0.8 and hot.seed == 3 and hot.structured is not None


def test_a_constraint_travels_the_wire_and_a_model_without_tokenizer_refuses_it():
    p = P([1], 2, structured={"json_schema": {"type": "object"}})
    back = decode(encode(Submit("m", [Envelope(1, p)]))).requests[0].params
    assert back == p and type(back.structured) is Constraint
    with pytest.raises(UnsupportedError, match="tokenizer"):
        ModelLimits(100, None, has_tokenizer=False).check(p)
    ModelLimits(100, None, has_tokenizer=True).check(p)


def test_a_jsonl_row_takes_the_field():
    row = json.loads('{"prompt": [1], "max_tokens": 3, "structured": {"choice": ["a", "b"]}}')
    assert P.from_mapping(row).structured == Constraint("choice", '["a", "b"]')
    assert P([1], 2, structured={"json_object": True}).structured is JSON_OBJECT


def _nested(levels: int) -> dict:
    value: dict = {"a": None}
    inner = value
    for _ in range(levels):
        inner["a"] = {"a": None}
        inner = inner["a"]
    return value


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("options, field", [
    ({"structured": {"json_schema": _nested(5000)}}, "structured json_schema"),
    ({"structured": {"json": "[" * 5000 + "]" * 5000}}, "structured json_schema"),
    ({"chat_template_kwargs": {"x": _nested(5000)}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": _nested(5000)}}}}]}, "tools"),
])
def test_json_nested_past_python_s_limit_is_told_in_our_words(options, field):
    # Python's json said it: 'structured json_schema is not valid JSON: maximum recursion depth exceeded while
    # decoding a JSON array from a unicode string' (on /v1/chat/completions too), '... while encoding a JSON object'
    with pytest.raises(ValueError) as e:
        P(CHAT, 4, **options)
    message = str(e.value)
    assert message.startswith(f"{field} nests arrays and objects more than 200 levels deep"), message
    assert "recursion" not in message


DEEP_TEXT = "[" * 5000 + "]" * 5000
CALLED = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _called(arguments) -> list[dict]:
    """A chat whose assistant message called ``f`` with ``arguments`` (JSON text, or a mapping)."""
    return CHAT + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": arguments}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}]


@pytest.mark.parametrize("prompt, options, says", [
    (CHAT, {"tools": '[{"type": "function", "function": {"name": "f"}}, ' + DEEP_TEXT + "]"},
     "tools nests arrays and objects more than 200 levels deep"),
    (CHAT, {"chat_template_kwargs": '{"x": ' + DEEP_TEXT + "}"},
     "chat_template_kwargs nests arrays and objects more than 200 levels deep"),
    (CHAT, {"structured": {"choice": DEEP_TEXT}},
     "structured choice nests arrays and objects more than 200 levels deep"),
    (_called(_nested(5000)), {"tools": CALLED},
     "chat message 1 tool_calls[0] arguments nests arrays and objects more than 200 levels deep"),
    (_called('{"a": ' + DEEP_TEXT + "}"), {"tools": CALLED},
     "chat message 1 tool_calls[0] arguments must be the JSON text of an object; this one nests arrays and objects "
     "more than 200 levels deep"),
    (CHAT + [{"role": "user", "content": _nested(5000)}], {},
     "chat message 1 content must be a string or a list of text parts; got an object"),
])
def test_json_text_and_values_nested_past_python_s_limit_are_told_so_in_every_field(prompt, options, says):
    # the text forms said what they are not ('tools must be a JSON list of tool definitions', 'chat_template_kwargs
    # must be a JSON object of template variables', 'structured choice ... got a str that is no JSON list', 'arguments
    # must be the JSON text of an object': each is one, too deep to read), a mapping of arguments too, and a message
    # holding such a value raised Python's RecursionError from echo ('maximum recursion depth exceeded while getting
    # the repr of an object'), no ValueError
    with pytest.raises(ValueError) as e:
        P(prompt, 4, **options)
    message = str(e.value)
    assert message.startswith(says) and "recursion" not in message, message


def _levels(n: int) -> object:
    """A JSON value nesting ``n`` levels of arrays (``[[1]]`` for 2)."""
    value: object = 1
    for _ in range(n):
        value = [value]
    return value


def _deep_fields(n: int) -> dict[str, tuple[list, dict]]:
    """Each field of a request that holds JSON of its own, its value ``n`` levels deep: (prompt, options)."""
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": _levels(n - 4)}}}]
    return {
        "tools": (CHAT, {"tools": tool}), "tools as text": (CHAT, {"tools": json.dumps(tool)}),
        "chat_template_kwargs": (CHAT, {"chat_template_kwargs": {"x": _levels(n - 1)}}),
        "chat_template_kwargs as text": (CHAT, {"chat_template_kwargs": json.dumps({"x": _levels(n - 1)})}),
        "json_schema": (CHAT, {"structured": {"json_schema": {"x": _levels(n - 1)}}}),
        "json_schema as text": (CHAT, {"structured": {"json": json.dumps({"x": _levels(n - 1)})}}),
        "arguments": (_called({"a": _levels(n - 1)}), {"tools": CALLED}),
        "arguments as text": (_called(json.dumps({"a": _levels(n - 1)})), {"tools": CALLED}),
    }


@pytest.mark.parametrize("field", sorted(_deep_fields(8)))
def test_every_field_of_json_nests_at_most_max_json_depth_levels(field):
    # the HTTP body's bound (200 levels): past it, tools were taken to ~990 levels (Python's recursion limit) and the
    # worker's template render then failed in Python's words ('maximum recursion depth exceeded', from about 480)
    from protocol.validation import MAX_JSON_DEPTH, json_depth

    prompt, options = _deep_fields(MAX_JSON_DEPTH)[field]
    P(prompt, 4, **options)  # (at the bound: taken)
    prompt, options = _deep_fields(MAX_JSON_DEPTH + 1)[field]
    with pytest.raises(ValueError, match=f"nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"):
        P(prompt, 4, **options)
    assert json_depth(_levels(MAX_JSON_DEPTH)) == MAX_JSON_DEPTH and json_depth({"a": 1}) == 1 and json_depth(1) == 0
