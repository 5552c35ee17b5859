"""gpt-oss's harmony format (issue 33: "gpt-oss channels where the template says so"; gateway/harmony.py):
the reasoning parser ``openai_gptoss`` and the tool-call parser ``openai`` on output in the format as
OpenAI's harmony docs (openai/harmony ``docs/format.md``) give it, at every cut, alone and one after
the other as the gateway runs them; the markers, special tokens of gpt-oss's tokenizer, decoded as
text by the worker's codec (and the stop tokens not), and read as text by the grammars (the
``tool_choice`` grammar in harmony's syntax, a constraint after harmony thinking), on a byte-level
vocabulary holding them as gpt-oss's does; detection from the template; and end to end through the
``openai`` SDK over the scripted client of tests/gateway/test_tools_stream.py."""

from __future__ import annotations

import random

import pytest

from gateway.reasoning import split_reasoning, think_stream
from gateway.tool_parsers import detect_parser, parser_class
from gateway.tool_stream import merged
from gateway.tools import parse_tool_calls

FUNCTIONS = {
    "get_weather": {"name": "get_weather", "description": "", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}},
    "get_time": {"name": "get_time", "description": "", "parameters": {"type": "object", "properties": {}}},
}
ANALYSIS = 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
CASES = {  # output -> (reasoning, answer) as openai_gptoss splits it
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.":
        (ANALYSIS, "2 + 2 = 4."),
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>":
        (ANALYSIS, "4"),  # (a worker that kept the stop token's text)
    "<|channel|>final<|message|>Hi there.": (None, "Hi there."),
    "<|channel|>analysis<|message|>Still thinking": ("Still thinking", ""),  # cut while thinking
    "Hello, world.": (None, "Hello, world."),  # not in the format: answer, as written
    "assistants help <|message|> you": (None, "assistants help <|message|> you"),
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>**Plan**: look it up.<|end|>" + CALL:
        ("One.Two.", "**Plan**: look it up." + CALL),  # (a preamble is answer; the call passes on whole)
    "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json"
    "<|message|>{}<|call|>": ("Need it.", "<|start|>assistant to=functions.get_time<|channel|>commentary json"
                                          "<|message|>{}<|call|>"),
    "<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|end|>": ('{"query": "x"}', ""),
}
PIPELINE = {  # raw output -> (reasoning, content, calls) through openai_gptoss then the openai tool parser
    f"<|channel|>analysis<|message|>Need the weather.<|end|>{CALL}":
        ("Need the weather.", None, [("get_weather", '{"city":"Paris"}')]),
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>":
        ("x", "Checking.", [("get_time", "{}")]),
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo", "days": 2}':
        (None, None, [("get_weather", '{"city": "Oslo", "days": 2}')]),
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.":
        (ANALYSIS, "2 + 2 = 4.", []),
    "<|channel|>final<|message|>Use <|start|> to open a message.":
        (None, "Use <|start|> to open a message.", []),
    # a call message that ends before its arguments close: they end there (they held the marker and the answer after)
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Pa<|end|><|start|>assistant<|channel|>final<|message|>Done.':
        ("x", "Done.", [("get_weather", '{"city": "Pa')]),
}
CUT_SHORT = {text for text, (_, _, calls) in PIPELINE.items() if any(not a.endswith("}") for _, a in calls)}


def cuttings(text: str) -> list[list[int]]:
    """One cut anywhere, a cut at every character, and 30 random cuttings."""
    out = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    rng = random.Random(0)
    out += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3))) for _ in range(30)]
    return out


def split_in_pieces(text: str, cuts: list[int]) -> list[tuple[str, str]]:
    think = think_stream("openai_gptoss")
    pieces = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        pieces += think.feed(text[a:b])
    return pieces + think.finish()


@pytest.mark.parametrize("text", sorted(CASES))
def test_the_channels_split_and_every_cut_of_it(text):
    assert split_reasoning(text, "openai_gptoss") == CASES[text]
    for cuts in cuttings(text):
        pieces = split_in_pieces(text, cuts)
        assert all(t for _, t in pieces)
        reasoning = "".join(t for k, t in pieces if k == "reasoning") or None
        assert (reasoning, "".join(t for k, t in pieces if k == "content")) == CASES[text], cuts


@pytest.mark.parametrize("text", sorted(PIPELINE))
def test_reasoning_then_tool_calls_at_every_cut(text):
    """As the gateway streams a choice: the reasoning parser's answer pieces into the tool-call parser."""
    reasoning, answer = split_reasoning(text, "openai_gptoss")
    content, calls = parse_tool_calls(answer, FUNCTIONS, parser="openai")
    want = PIPELINE[text]
    assert (reasoning, content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == want
    for cuts in cuttings(text):
        tools = parser_class("openai")(FUNCTIONS)
        deltas, thought = [], []
        think = think_stream("openai_gptoss")
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            for kind, piece in think.feed(text[a:b]):
                thought += [piece] if kind == "reasoning" else []
                deltas += tools.feed(piece) if kind == "content" else []
        for kind, piece in think.finish():
            thought += [piece] if kind == "reasoning" else []
            deltas += tools.feed(piece) if kind == "content" else []
        more, reason = tools.finish("stop")
        got_content, got_calls = merged(deltas + more)
        assert ("".join(thought) or None, got_content,
                [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == want, cuts
        assert all(deltas + more) and reason == ("tool_calls" if want[2] and text not in CUT_SHORT else "stop")


def test_parallel_tool_calls_false_drops_a_second_call_message():
    text = CALL + "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}<|call|>Done."
    content, calls = parse_tool_calls(text, FUNCTIONS, parallel=False, parser="openai")
    assert content == "Done." and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_headers_in_either_order_and_with_or_without_constrain():
    from gateway.harmony import Header, parse_header

    assert parse_header("<|channel|>commentary to=functions.f <|constrain|>json") == Header("commentary", "functions.f")
    assert parse_header("assistant to=functions.f<|channel|>commentary json").function == "f"
    assert parse_header("assistant<|channel|>final") == Header("final", "")
    assert parse_header("<|channel|>analysis").kind == "reasoning"
    for not_one in ("", "assistant", "hello world", "<|channel|>final\nmore", "<|channel|>a" + "b" * 300):
        assert parse_header(not_one) is None, not_one


# ---------------------------------------------------------------------- detection from the template

GPT_OSS_TEMPLATE = (  # excerpts of gpt-oss's published chat template, as its tool-call and channel parts read
    '{%- if message.channel %}{{- "<|start|>assistant<|channel|>" + message.channel + "<|message|>" }}'
    '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
    '{{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}'
    '{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}')


def test_auto_and_the_models_reasoning_format_read_harmony_from_the_template():
    transformers = pytest.importorskip("transformers")
    from worker.models.hf_text import HFTextCodec

    assert detect_parser(GPT_OSS_TEMPLATE) == "openai"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=harmony_vocabulary())
    tok.chat_template = GPT_OSS_TEMPLATE
    assert HFTextCodec(tok).reasoning_format == "openai_gptoss"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert HFTextCodec(tok).reasoning_format == ""
    assert HFTextCodec(tok).with_chat_template(GPT_OSS_TEMPLATE).reasoning_format == "openai_gptoss"


# ---------------------------------------------------------------------- markers as special tokens (worker side)

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
STOPS = ["<|return|>", "<|call|>"]  # gpt-oss's stop tokens (with <|endoftext|>)


def harmony_vocabulary(markers: list[str] = HARMONY):
    """A byte-level BPE vocabulary (every byte a token, no merges) with ``markers`` and the stop
    tokens as special added tokens, as gpt-oss's o200k_harmony holds them."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(sorted(set(bytes_to_unicode().values())))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(STOPS + markers)
    return tok


def test_the_worker_decodes_harmony_markers_as_text_and_the_stop_tokens_not():
    """Without it, ``<|channel|>`` and the rest (special) vanished from the output text, and neither
    parser could tell analysis from final: gpt-oss's thinking came back as its answer."""
    transformers = pytest.importorskip("transformers")
    from worker.models.hf_text import HFTextCodec

    tok = harmony_vocabulary()
    codec = HFTextCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    text = "<|channel|>analysis<|message|>Hm.<|end|>" + CALL
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|call|>")]
    assert tok.token_to_id("<|channel|>") in ids and len(ids) < len(text)  # (the markers are single tokens)
    assert codec.decode(ids) == text
    stream = codec.decoder(())
    assert "".join(stream.step(i) for i in ids) == text
    assert split_reasoning(codec.decode(ids), "openai_gptoss") == ("Hm.", CALL)


def test_end_stays_special_in_a_vocabulary_without_harmony_s_channel():
    """``<|end|>`` is Phi-3's end of turn: kept as text only where ``<|channel|>`` says harmony."""
    transformers = pytest.importorskip("transformers")
    from worker.models.hf_text import HFTextCodec
    from worker.models.tool_markers import kept_markers

    assert "<|end|>" not in kept_markers(["<|end|>", "<|user|>"])
    assert "<|end|>" in kept_markers(["<|end|>", "<|channel|>"])
    tok = harmony_vocabulary(["<|end|>"])
    codec = HFTextCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    assert codec.decode(tok.encode("Hi.<|end|>", add_special_tokens=False).ids) == "Hi."


def matcher(tok, constraint):
    pytest.importorskip("llguidance")
    pytest.importorskip("torch")
    from worker.models.grammar import Grammars

    grammars = Grammars(tok.to_str, tok.get_vocab_size(), tuple(tok.token_to_id(s) for s in STOPS))
    return grammars.compile(constraint).deep_copy()


def takes(tok, constraint, text: str) -> bool:
    m = matcher(tok, constraint)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()


@pytest.mark.parametrize("names", [["get_weather"], ["get_time", "get_weather"]], ids=["named", "required"])
def test_the_tool_grammar_takes_a_call_after_any_thinking_as_gpt_oss_writes_it(names):
    from gateway.tool_grammars import call_grammar
    from protocol.structured import Constraint

    tok = harmony_vocabulary()
    grammar = Constraint("grammar", call_grammar(FUNCTIONS, names, "openai"))
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}'
    thought = "<|channel|>analysis<|message|>Weather: call it. <|channel|> is a word here.<|end|><|start|>assistant"
    for text in (call, thought + call, thought + thought + call):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.token_to_id("<|message|>") in ids
        assert takes(tok, grammar, text), text
        reasoning, answer = split_reasoning(text, "openai_gptoss")
        content, calls = parse_tool_calls(answer, FUNCTIONS, parser="openai")
        assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city": "Paris", "days": 3}']
    for bad in (thought + "<|channel|>final<|message|>Sunny.", call.replace("get_weather", "get_news"),
                "<|channel|>analysis<|message|>a<|end|>b<|end|><|start|>assistant" + call, call + " and more"):
        assert not takes(tok, grammar, bad), bad


def test_a_constraint_after_harmony_thinking_holds_the_final_answer():
    from protocol.structured import check_structured

    tok = harmony_vocabulary()
    c = check_structured(["json_schema", '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}',
                          "openai_gptoss"])
    final = '<|channel|>final<|message|>{"a": 1}'
    assert takes(tok, c, final) and takes(tok, c, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant" + final)
    assert not takes(tok, c, '{"a": 1}') and not takes(tok, c, '<|channel|>final<|message|>{"b": 1}')
    assert split_reasoning("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant" + final,
                           "openai_gptoss") == ("Think.", '{"a": 1}')


# ---------------------------------------------------------------------- end to end through the openai SDK

SCRIPTED = {  # user message -> what the scripted model writes
    "harmony_call": f"<|channel|>analysis<|message|>Need the weather.<|end|>{CALL}",
    "harmony_preamble": "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>"
                        "Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json"
                        "<|message|>{}",
    "harmony_text": f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>"
                    "2 + 2 = 4.",
}


@pytest.fixture
def harmony_sdk(monkeypatch):
    """``(sdk, client)``: the SDK on handlers whose model says it thinks in harmony's channels
    (ModelInfo.reasoning, as its worker reads gpt-oss's template) and a gateway reading harmony's calls."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from gateway.config import GatewayConfig
    from gateway.tokenizer import Tokenizers
    from tests.gateway import test_tools_stream
    from tests.support.scripted import ScriptedLink, handlers_app

    class HarmonyLink(ScriptedLink):
        def model_info(self, model: str):
            return super().model_info(model)._replace(reasoning="openai_gptoss")

    for name, text in SCRIPTED.items():
        monkeypatch.setitem(test_tools_stream.OUTPUTS, name, text)
    client = test_tools_stream.OutputClient()
    with TestClient(handlers_app(Tokenizers(None), HarmonyLink(client), GatewayConfig(tool_call_parser="openai"))) \
            as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), client
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("name, reasoning, content, calls", [
    ("harmony_call", "Need the weather.", None, [("get_weather", '{"city":"Paris"}')]),
    ("harmony_preamble", "x", "Checking.", [("get_time", "{}")]),
    ("harmony_text", ANALYSIS, "2 + 2 = 4.", []),
])
def test_whole_and_streamed_answers_say_the_same(harmony_sdk, name, reasoning, content, calls):
    from tests.gateway.test_tools_stream import TOOLS

    sdk, _ = harmony_sdk
    kw = dict(model="m", messages=[{"role": "user", "content": name}], max_tokens=200, tools=TOOLS)
    whole = sdk.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert (whole.message.model_extra["reasoning_content"], whole.message.content, got) == (reasoning, content, calls)
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    thought, said, streamed = [], [], {}
    for chunk in sdk.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        thought += [(delta.model_extra or {}).get("reasoning_content") or ""]
        said += [delta.content or ""]
        for tc in delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, [tc.function.name, ""])
            entry[1] += tc.function.arguments or ""
    assert ("".join(thought), "".join(said) or None, [tuple(v) for _, v in sorted(streamed.items())]) == \
        (reasoning, content, calls)


def test_harmony_s_tool_grammar_thinks_itself_and_a_response_format_thinks_in_harmony(harmony_sdk):
    """The constraint's ``think`` (protocol.structured): ``openai_gptoss`` for a response_format (the
    worker lets the model think, then holds the final channel), none for harmony's tool grammar,
    which has the analysis messages in its own syntax."""
    from tests.gateway.test_tools_stream import TOOLS

    sdk, client = harmony_sdk
    kw = dict(model="m", messages=[{"role": "user", "content": "harmony_text"}], max_tokens=200)
    sdk.chat.completions.create(**kw, response_format={"type": "json_object"})
    sdk.chat.completions.create(**kw, tools=TOOLS, tool_choice="required")
    json_object, tools = (p.structured for p in client.submitted)
    assert (json_object.kind, json_object.think) == ("json_object", "openai_gptoss")
    assert (tools.kind, tools.think) == ("grammar", "") and tools.spec.startswith("start: ANALYSIS*")
