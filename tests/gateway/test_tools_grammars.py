"""Kind "every grammar over a syntax whose markers are special tokens in some tokenizer, for every
family's parser" (issue 33, item 5): the ``tool_choice: "required"`` / named-function grammar of each
parser (gateway/tool_grammars.py), compiled as the worker compiles it (worker/models/grammar.py
``Grammars``), takes the tokens a tokenizer writes for a call in that syntax:

- on a byte-level vocabulary with no added tokens (the tiny test models': every marker is bytes);
- on one where the markers are single added tokens, special as in Mistral's (``[TOOL_CALLS]``,
  ``[ARGS]``) and Llama 3's (``<|python_tag|>``) tokenizers, or plain as in Qwen's
  (``<tool_call>``; ``<function=`` too): the fault of issue 33 was a grammar that allowed such a
  token by its text and refused it when fed; a special marker llguidance would not read as text;
- on the real Qwen2.5-Coder tokenizer (where a GGUF install left it on disk) for ``hermes`` and
  ``qwen3_coder``.

And the worker decodes a special marker as its text (worker/models/tool_markers.py), so the
parser of the same family reads the constrained output as the call.
"""

from __future__ import annotations

import json

import pytest

llguidance = pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("torch")

from gateway.tool_grammars import call_grammar  # noqa: E402
from gateway.tool_parsers import PARSERS  # noqa: E402
from gateway.tools import parse_tool_calls  # noqa: E402
from protocol.structured import Constraint  # noqa: E402
from tests.support.vocab import EOS, NO_QWEN, PLAIN, SPECIAL, byte_level, qwen_tokenizer  # noqa: E402
from worker.models.grammar import Grammars  # noqa: E402

FUNCTIONS = {
    "get_weather": {"name": "get_weather", "description": "", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}},
    "get_time": {"name": "get_time", "description": "", "parameters": {"type": "object", "properties": {}}},
}
CITY = "Paris </b>\nor Rome"  # (a tag and a newline inside a text value)
CALLS = {  # parser -> calls of get_weather in its syntax, as the grammar's JSON style writes them
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
                    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'],
    "openai": ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'],
    "pythonic": ['[get_weather(city="Paris", days=3)]', '<|python_tag|>[get_weather(city="Paris", unit="c")]'],
    "qwen3_coder": [f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{CITY}\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>"],
}
TOKENIZERS = {"bytes": lambda: byte_level(False), "markers": lambda: byte_level(True), "qwen2.5": qwen_tokenizer}


def matcher(tok, grammar: str):
    eos = tok.token_to_id(EOS) if tok.token_to_id(EOS) is not None else tok.token_to_id("<|im_end|>")
    grammars = Grammars(tok.to_str, tok.get_vocab_size(), (eos,))
    return grammars.compile(Constraint("grammar", grammar)).deep_copy()


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    made = TOKENIZERS[request.param]()
    if made is None:
        pytest.skip(NO_QWEN)
    made.kind = request.param
    return made


@pytest.mark.parametrize("names", [["get_weather"], ["get_time", "get_weather"]], ids=["named", "required"])
@pytest.mark.parametrize("parser", PARSERS)
def test_the_grammar_takes_the_tokens_of_a_call_in_its_syntax(tok, parser, names):
    if tok.kind == "qwen2.5" and parser not in ("hermes", "qwen3_coder"):
        pytest.skip("Qwen's vocabulary has no Mistral or Llama markers")
    grammar = call_grammar(FUNCTIONS, names, parser)
    single = []
    for text in CALLS[parser]:
        ids = tok.encode(text, add_special_tokens=False).ids
        single += [m for m in SPECIAL + PLAIN if m in text and tok.token_to_id(m) in ids]
        m = matcher(tok, grammar)
        assert m.consume_tokens(ids), (text, m.get_error())
        assert m.is_accepting() and not m.is_error()
        # ... and what the grammar let through is the call, for the family's parser
        content, calls = parse_tool_calls(text, FUNCTIONS, parser=parser)
        assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    if tok.kind == "markers" and parser != "openai":  # the case this test is for: a marker is one token, as the
        # model writes it (harmony's, special in gpt-oss's tokenizer: tests/gateway/test_harmony.py, whose
        # vocabulary's <|end|> is a harmony marker, not this one's EOS)
        assert single, "no marker was a single token"


@pytest.mark.parametrize("parser", PARSERS)
def test_the_grammar_refuses_another_function_and_plain_text(parser):
    tok = byte_level(True)
    grammar = call_grammar(FUNCTIONS, ["get_time"], parser)
    for text in CALLS[parser][:1] + ["It is sunny."]:
        m = matcher(tok, grammar)
        assert not m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) or not m.is_accepting()


QWEN_HEAD = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"


@pytest.mark.parametrize("value", ["a <parameter=days>\n3", "a </function> b", "a</parameter>b", "x </tool_call>"])
def test_the_qwen3_coder_grammar_keeps_the_tags_that_end_a_value_out_of_a_text_value(value):
    # the parser ends a value at such a tag (as vLLM's does, with or without </parameter>), so a forced call whose
    # text value held one was read as another call than the grammar let through ('{"city": "a", "days": 3}')
    tok, grammar = byte_level(True), call_grammar(FUNCTIONS, ["get_weather"], "qwen3_coder")
    for text, taken in ((f"{QWEN_HEAD}{value}\n</parameter>\n</function>\n</tool_call>", False),
                        (f"{QWEN_HEAD}{value.replace('<', '< ')}\n</parameter>\n</function>\n</tool_call>", True)):
        m = matcher(tok, grammar)
        assert bool(m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()) is taken


def test_the_qwen3_coder_grammar_asks_json_of_a_type_in_any_of():
    # pydantic's Optional[int] (anyOf) was a text value: the forced call's '4' came back as the string "4"
    functions = {"f": {"name": "f", "parameters": {"type": "object", "required": ["n"], "properties": {
        "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
    tok, grammar = byte_level(True), call_grammar(functions, ["f"], "qwen3_coder")
    for value, want in (("4", 4), ("null", None), ("four", "refused")):
        text = f"<tool_call>\n<function=f>\n<parameter=n>\n{value}\n</parameter>\n</function>\n</tool_call>"
        m = matcher(tok, grammar)
        taken = m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()
        assert bool(taken) is (want != "refused"), value
        if taken:
            (call,) = parse_tool_calls(text, functions, parser="qwen3_coder")[1]
            assert json.loads(call["function"]["arguments"]) == {"n": want}


def test_a_special_marker_is_decoded_as_its_text_and_eos_is_not():
    """worker/models/tool_markers.py through the worker's codec: without it, ``[TOOL_CALLS]`` (special)
    vanished from the output text, and a Mistral call the grammar forced came back as content."""
    transformers = pytest.importorskip("transformers")
    from worker.models.hf_text import HFTextCodec

    tok = byte_level(True)
    codec = HFTextCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    text = CALLS["mistral"][1]
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    assert tok.decode(ids) == text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")  # (skip_special_tokens)
    assert codec.decode(ids) == text
    stream = codec.decoder(())
    assert "".join(stream.step(i) for i in ids) == text
    content, calls = parse_tool_calls(codec.decode(ids), FUNCTIONS, parser="mistral")
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
