"""Reasoning output (issue 33, item 2; gateway/reasoning.py): a thinking model's ``<think>...</think>``
split off the answer into ``reasoning_content`` / ``reasoning``, for both parsers, on the parser alone
at every cut of the output, and end to end through the ``openai`` SDK over the scripted client of
tests/gateway/test_tools_stream.py: whole and streamed answers say the same, tool calls are read in
the answer only, and the thinking is never an empty delta."""

from __future__ import annotations

import random

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.reasoning import ThinkStream, split_reasoning  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_tools_stream import BARE, OUTPUTS, TOOLS, OutputClient  # noqa: E402
from tests.support.scripted import ScriptedLink, handlers_app  # noqa: E402

THINK = "Two and two.\nThat makes four."
CASES = {  # output -> (parser -> (reasoning, answer))
    f"<think>\n{THINK}\n</think>\n\nThe answer is 4.": {
        "qwen3": (f"\n{THINK}\n", "The answer is 4."), "deepseek_r1": (f"\n{THINK}\n", "The answer is 4.")},
    f"{THINK}\n</think>\n\nThe answer is 4.": {  # R1: the template opened it
        "qwen3": (None, f"{THINK}\n</think>\n\nThe answer is 4."), "deepseek_r1": (f"{THINK}\n", "The answer is 4.")},
    "The answer is 4.": {"qwen3": (None, "The answer is 4."), "deepseek_r1": ("The answer is 4.", "")},
    f"<think>{THINK}": {"qwen3": (THINK, ""), "deepseek_r1": (THINK, "")},  # cut while thinking
    "<thinking> is a tag </think> here": {"qwen3": (None, "<thinking> is a tag </think> here"),
                                          "deepseek_r1": ("<thinking> is a tag ", "here")},
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", sorted(CASES))
def test_the_split_and_every_cut_of_it(text, parser):
    assert split_reasoning(text, parser) == CASES[text][parser]
    rng = random.Random(0)
    cuttings = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 2))) for _ in range(30)]
    for cuts in cuttings:
        stream = ThinkStream(parser)
        pieces = []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            pieces += stream.feed(text[a:b])
        pieces += stream.finish()
        assert all(t for _, t in pieces)
        reasoning = "".join(t for k, t in pieces if k == "reasoning") or None
        assert (reasoning, "".join(t for k, t in pieces if k == "content")) == CASES[text][parser], cuts


def test_an_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="reasoning_parser"):
        GatewayConfig(reasoning_parser="gpt-oss")
    with pytest.raises(ValueError):
        ThinkStream("none")


THOUGHT = "<think>\nI should call get_time.\n</think>\n\n"


@pytest.fixture
def sdk(monkeypatch):
    outputs = {"think_call": THOUGHT + OUTPUTS["one"], "think_text": THOUGHT + "It is noon.",
               "think_bare": THOUGHT + BARE["bare_one"]}
    monkeypatch.setitem(OUTPUTS, "think_call", outputs["think_call"])
    monkeypatch.setitem(OUTPUTS, "think_text", outputs["think_text"])
    monkeypatch.setitem(OUTPUTS, "think_bare", outputs["think_bare"])
    client = OutputClient()
    config = GatewayConfig(reasoning_parser="qwen3")
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client), config)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("name", ["think_call", "think_text", "think_bare"])
def test_whole_and_streamed_answers_split_the_thinking_alike(sdk, name):
    kw = dict(model="m", messages=[{"role": "user", "content": name}], max_tokens=100, tools=TOOLS)
    whole = sdk.chat.completions.create(**kw).choices[0]
    assert whole.message.model_extra["reasoning_content"] == "\nI should call get_time.\n"
    assert whole.message.model_extra["reasoning"] == whole.message.model_extra["reasoning_content"]
    reasoning, content, calls = [], [], {}
    for k, chunk in enumerate(sdk.chat.completions.create(**kw, stream=True)):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert k == 0 or extra.get("reasoning_content") or delta.content or delta.tool_calls \
            or chunk.choices[0].finish_reason, chunk
        reasoning += [extra["reasoning_content"]] if extra.get("reasoning_content") else []
        content += [delta.content] if delta.content else []
        for tc in delta.tool_calls or []:
            calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
    assert "".join(reasoning) == whole.message.model_extra["reasoning_content"]
    assert ("".join(content) or None) == whole.message.content
    assert list(calls.values()) == [c.function.arguments for c in whole.message.tool_calls or []]
    if name == "think_text":
        assert whole.message.content == "It is noon." and not whole.message.tool_calls
    else:
        assert whole.message.tool_calls and whole.finish_reason == "tool_calls"  # read in the answer


# ---------------------------------------------------------------------- chat_template_kwargs and reasoning_effort


@pytest.fixture
def recorded():
    """``(sdk, client)``: the openai SDK on the handlers over a :class:`ScriptedClient`, which keeps
    every submitted request's params (``client.submitted``)."""
    from tests.support.scripted import ScriptedClient

    client = ScriptedClient()
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), client
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("body, sent", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, '{"enable_thinking":false}'),
    ({"reasoning_effort": "low"}, '{"reasoning_effort":"low"}'),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}},
     '{"reasoning_effort":"low","x":1}'),  # (the kwargs name the variable themselves: they win, as in vLLM)
    ({}, None),
    ({"chat_template_kwargs": {}}, None),
])
def test_chat_template_kwargs_and_reasoning_effort_reach_the_request(recorded, body, sent):
    sdk, client = recorded
    sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                extra_body=body)
    assert client.submitted[-1].chat_template_kwargs == sent


@pytest.mark.parametrize("body, param, says", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "object of chat template variables"),
    ({"chat_template_kwargs": {"x": 1}, "reasoning_effort": "extreme"}, "reasoning_effort", "one of"),
    ({"reasoning_effort": 3}, "reasoning_effort", "one of"),
])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(recorded, body, param, says):
    sdk, client = recorded
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body=body)
    assert err.value.body["param"] == param and says in err.value.body["message"]
    assert not client.submitted


def test_chat_template_kwargs_on_a_text_prompt_are_a_400(recorded):
    sdk, client = recorded
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"chat_template_kwargs": {"x": 1}})
    assert err.value.status_code == 400 and not client.submitted


# ---------------------------------------------------------------------- the model's own parser (ModelInfo.reasoning)


class _ThinkingLink(ScriptedLink):
    """:class:`ScriptedLink` whose model says it thinks as Qwen3 does (ModelInfo.reasoning)."""

    def model_info(self, model: str):
        return super().model_info(model)._replace(reasoning="qwen3")


@pytest.mark.parametrize("option, split", [(None, True), ("none", False), ("deepseek_r1", True)])
def test_the_models_own_format_is_the_default_and_the_option_overrides_it(monkeypatch, option, split):
    monkeypatch.setitem(OUTPUTS, "think_text", THOUGHT + "It is noon.")
    whole, streamed = _think_text_whole_and_streamed(_ThinkingLink, GatewayConfig(reasoning_parser=option))
    assert whole.content == streamed
    if split:
        assert whole.content == "It is noon." and whole.model_extra["reasoning_content"].strip() == \
            "I should call get_time."
    else:
        assert whole.content == THOUGHT + "It is noon." and not whole.model_extra.get("reasoning_content")


@pytest.mark.parametrize("option, think", [(None, "qwen3"), ("none", ""), ("deepseek_r1", "deepseek_r1")])
def test_a_constraint_applies_after_the_thinking_of_the_models_parser(option, think):
    """Structured outputs and tool grammars apply to the answer: the request's constraint says the
    thinking format (protocol.structured ``think``; the worker's grammar lets the model think first,
    tests/models/test_structured_after_thinking.py)."""
    from tests.support.scripted import ScriptedClient

    client = ScriptedClient()
    with TestClient(handlers_app(Tokenizers(None), _ThinkingLink(client), GatewayConfig(reasoning_parser=option))) \
            as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    response_format={"type": "json_object"})
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    tools=TOOLS, tool_choice="required")
        sdk.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"guided_regex": "[0-9]+"})
    for t in client.threads:
        t.join(10)
    chat_json, chat_tools, text = (p.structured for p in client.submitted)
    assert (chat_json.kind, chat_json.think) == ("json_object", think)
    assert (chat_tools.kind, chat_tools.think) == ("grammar", think)
    assert text.think == ""  # a text completion has no chat template, so no thinking format


def test_a_parser_name_this_gateway_does_not_know_from_a_worker_is_no_parser(monkeypatch):
    """``ModelInfo.reasoning`` is what a worker says (a newer one may name a parser this gateway lacks):
    an unknown name is no parser -- the answer is whole, not a 500 on every chat."""
    class FutureLink(ScriptedLink):
        def model_info(self, model: str):
            return super().model_info(model)._replace(reasoning="future_parser")

    monkeypatch.setitem(OUTPUTS, "think_text", THOUGHT + "It is noon.")
    whole, streamed = _think_text_whole_and_streamed(FutureLink, GatewayConfig())
    assert whole.content == streamed == THOUGHT + "It is noon."


def _think_text_whole_and_streamed(link_class, config: GatewayConfig):
    """The chat answer to ``think_text`` through the SDK, whole (its message) and streamed (the
    content deltas joined), from a gateway over ``link_class(OutputClient())`` with ``config``."""
    client = OutputClient()
    with TestClient(handlers_app(Tokenizers(None), link_class(client), config)) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        kw = dict(model="m", messages=[{"role": "user", "content": "think_text"}], max_tokens=100)
        whole = sdk.chat.completions.create(**kw).choices[0].message
        streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(**kw, stream=True))
    for t in client.threads:
        t.join(10)
    return whole, streamed
