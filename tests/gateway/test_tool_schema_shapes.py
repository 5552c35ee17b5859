"""A tool's ``parameters`` whose shape breaks JSON Schema's rules for the parts the tool-call
grammars and parsers read (``properties`` not an object of schemas, ``required`` not a list of
names, a property's ``enum`` not a non-empty list) is a 400 naming the field on every route and
with every tool-call parser, and ``ValueError`` in the SDK; and a tool grammar the worker cannot
compile is refused in the body's words, never quoting the gateway's own grammar text. Over the
handlers apps with scripted broker clients (no sockets), and llguidance for the worker's words."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from gateway.tool_parsers import PARSERS  # noqa: E402
from protocol.request import RequestParams  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import RefusingClient, ScriptedClient, ScriptedLink, handlers_app  # noqa: E402

STRING = {"type": "string"}
# (parameters, the field named, words of the message)
BAD = {
    "properties-int": ({"type": "object", "properties": 5}, "properties", "must be an object of JSON schemas"),
    "properties-list": ({"type": "object", "properties": [STRING]}, "properties", "must be an object of JSON"),
    "property-int": ({"type": "object", "properties": {"a": 5}}, "properties", "'a' 5, which is not a JSON schema"),
    "property-null": ({"type": "object", "properties": {"a": None}}, "properties", "'a' None, which is not"),
    "required-int": ({"type": "object", "properties": {"a": STRING}, "required": 5}, "required",
                     "must be a list of property names, got 5"),
    "required-string": ({"type": "object", "properties": {"a": STRING}, "required": "a"}, "required",
                        "must be a list of property names"),
    "required-nested": ({"type": "object", "properties": {"a": STRING}, "required": [["a"]]}, "required",
                        "must be a list of property names"),
    "enum-int": ({"type": "object", "properties": {"a": {"type": "string", "enum": 5}}}, "properties",
                 "'a' the enum 5; an enum must be a non-empty list"),
    "enum-empty": ({"type": "object", "properties": {"a": {"enum": []}}}, "properties", "the enum []"),
}
GOOD = {  # JSON Schema allows these: none is refused
    "boolean-schemas": {"type": "object", "properties": {"a": True, "b": False}},
    "no-properties": {"type": "object", "required": []},
    "enum-of-objects": {"type": "object", "properties": {"a": {"enum": [{"x": 1}, [1], None]}}},
}


def chat(http, parameters: dict, **body):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 4, "tools": [tool], **body})


@pytest.fixture(scope="module", params=PARSERS)
def http(request):
    """The chat handlers over a scripted client, with one tool-call parser each."""
    client = ScriptedClient()
    config = GatewayConfig(tool_call_parser=request.param)
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client), config)) as c:
        c.scripted = client
        yield c
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_parameters_schema_is_a_400_naming_its_part(http, case, choice, stream):
    # with the qwen3_coder and pythonic parsers, tool_choice required or named was a 500
    # (AttributeError: 'int' object has no attribute 'items'; TypeError: 'int' object is not iterable)
    parameters, part, words = BAD[case]
    submitted = len(http.scripted.submitted)
    e = error_of(chat(http, parameters, tool_choice=choice, stream=stream), 400)
    field = f"tools.0.function.parameters.{part}"
    assert e["param"] == field and e["message"].startswith(field + " ") and words in e["message"], e
    assert len(http.scripted.submitted) == submitted  # refused at the edge


@pytest.mark.parametrize("case", sorted(GOOD))
def test_schemas_json_schema_allows_are_served(http, case):
    r = chat(http, GOOD[case], tool_choice="required")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_sdk_refuses_them_with_a_value_error(case):
    parameters, part, words = BAD[case]
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ValueError, match=rf"^tools\[0\]\.function\.parameters\.{part} .*{_escaped(words)}"):
        RequestParams([{"role": "user", "content": "hi"}], 4, tools=[tool])
    for ok in GOOD.values():
        RequestParams([{"role": "user", "content": "hi"}], 4,
                      tools=[{"type": "function", "function": {"name": "f", "parameters": ok}}])


def _escaped(words: str) -> str:
    import re

    return re.escape(words)


# ---------------------------------------------------------------------- the Messages and Responses routes

def test_messages_and_responses_name_their_own_fields():
    pytest.importorskip("anthropic")
    pytest.importorskip("transformers")
    from gateway.response_store import ResponseStore
    from tests.support.scripted import KEY, messages_app, responses_app

    client = ScriptedClient()
    bad = {"type": "object", "properties": {"a": STRING}, "required": 5}
    with TestClient(messages_app(ScriptedLink(client), GatewayConfig())) as http:
        for path, budget in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
            r = http.post(path, headers={"x-api-key": KEY}, json={
                "model": "m", **budget, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": bad}], "tool_choice": {"type": "any"}})
            assert r.status_code == 400 and r.json()["error"]["message"] == (
                "tools.0.input_schema.required must be a list of property names, got 5"), r.text
    with TestClient(responses_app(ScriptedLink(client), GatewayConfig(), ResponseStore(8, 60.0))) as http:
        e = error_of(http.post("/v1/responses", json={
            "model": "m", "max_output_tokens": 4, "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": bad}]}), 400)
        assert e["param"] == "tools.0.parameters.required" and e["message"].startswith("tools.0.parameters.required ")
    assert client.submitted == []


# ---------------------------------------------------------------------- a grammar the worker refuses

LARK_ERROR = ('at 2(7): failed to compile JSON schema: Invalid type: nonsense\n'
              '   1 | start: "<tool_call>\\n" call "\\n</tool_call>"\n'
              '   2 | call: %json {"x-guidance": {"item_separator": ", "}, "type": "object"}\n'
              '             ^\n')


def test_the_workers_words_leave_out_the_grammars_source():
    from worker.models.grammar import _first_lines

    assert _first_lines(LARK_ERROR) == "at 2(7): failed to compile JSON schema: Invalid type: nonsense"
    # (a regex error keeps its detail lines; it has no Lark position)
    assert _first_lines("regex parse error:\n    ((\n    ^\nerror: unclosed group") == \
        "regex parse error: (( ^ error: unclosed group"


def test_a_tool_grammar_that_does_not_compile_is_refused_without_its_text():
    # was: 'tools does not compile: at 2(7): failed to compile JSON schema: Invalid type: nonsense 1 | start:
    # "<tool_call>\n" call ... 2 | call: %json {"x-guidance": ...' (the gateway's grammar, 400 characters of it)
    pytest.importorskip("llguidance")
    from gateway.tool_grammars import call_grammar
    from protocol.structured import Constraint
    from tests.support.vocab import EOS, byte_level
    from worker.models.grammar import GrammarError, Grammars

    tok = byte_level(False)
    grammars = Grammars(tok.to_str, tok.get_vocab_size(), (tok.token_to_id(EOS),))
    fn = {"f": {"name": "f", "description": "", "parameters": {"properties": {"a": {"type": "nonsense"}}}}}
    for parser in PARSERS:
        with pytest.raises(GrammarError) as caught:
            grammars.compile(Constraint("grammar", call_grammar(fn, ["f"], parser)))
        said = str(caught.value)
        assert said.startswith("structured grammar does not compile: at ") and "|" not in said, said
        assert "x-guidance" not in said and "start" not in said, said


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools, choice, field", [
    (["f"], "required", "tools.0.function.parameters"),
    (["g", "f"], {"type": "function", "function": {"name": "f"}}, "tools.1.function.parameters"),
    (["f", "g"], "required", "tools"),
])
def test_the_refusal_names_the_functions_parameters_not_a_grammar_position(tools, choice, field, stream):
    # (the worker's words for a Lark grammar that does not compile: LARK_ERROR as _first_lines keeps it)
    client = RefusingClient("structured grammar does not compile: at 2(7): failed to compile JSON schema: "
                            "Invalid type: nonsense")
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
                "tools": [{"type": "function", "function": {"name": n}} for n in tools], "tool_choice": choice}
        e = error_of(http.post("/v1/chat/completions", json=body), 400)
    for t in client.threads:
        t.join(10)
    assert e["param"] == field and e["code"] == "bad_request"
    assert e["message"] == f"{field} does not compile: failed to compile JSON schema: Invalid type: nonsense"
