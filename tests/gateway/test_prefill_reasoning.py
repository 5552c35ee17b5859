"""A continued final assistant message (``continue_final_message``, Anthropic's prefill) on a model
whose replies a reasoning parser splits: the prompt ends with the message's text, not with the
generation prompt that opens the thinking (a ``deepseek_r1`` template's ``<think>``), so the reply
starts where that text ends. Was: ``deepseek_r1`` read all of ``' forty-two.'`` as reasoning (an
answer with no content; /v1/messages a thinking block and no text), and a constraint let the model
think first. Now (gateway.reasoning.continued_parser) the reply is answer unless the message's text
opens a ``<think>`` it does not close (then reasoning up to ``</think>``, as ``deepseek_r1``), on the
chat route, whole and streamed, and on /v1/messages; a harmony model (gpt-oss) refuses the
continuation (400 naming the message: the reply's channel is the template's). Over the handlers
apps with scripted broker clients, no sockets; the prompt a real template renders: the last test."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.reasoning import continued_parser, split_reasoning  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import KEY, ScriptedLink, handlers_app, messages_app  # noqa: E402

PREFILLS = {  # the final assistant message's text -> (the model's reply, its reasoning, its content)
    "The answer is": (" forty-two.", None, " forty-two."),
    "<think>Six times seven.</think>The answer is": (" forty-two.", None, " forty-two."),
    "<think>Six times": (" seven.</think>\n\nIt is forty-two.", " seven.", "It is forty-two."),
}


def test_the_reply_to_a_prefill_starts_where_its_text_ends():
    assert split_reasoning(" forty-two.", "deepseek_r1") == (" forty-two.", "")  # (a reply after the prompt)
    for parser in ("deepseek_r1", "qwen3"):
        for prefill, (reply, reasoning, content) in PREFILLS.items():
            chosen = continued_parser(parser, prefill)
            assert (split_reasoning(reply, chosen) if chosen else (None, reply)) == (reasoning, content), prefill
    with pytest.raises(ValueError, match="harmony"):
        continued_parser("openai_gptoss", "The answer is")


class _Thinks(ScriptedLink):
    """:class:`ScriptedLink` whose model thinks in ``parser``'s format (ModelInfo.reasoning)."""

    parser = "deepseek_r1"

    def model_info(self, model: str):
        return super().model_info(model)._replace(reasoning=self.parser)


def _link(parser: str, client) -> _Thinks:
    link = _Thinks(client)
    link.parser = parser
    return link


def _chat(prefill: str) -> list[dict]:
    return [{"role": "user", "content": "Six times seven?"}, {"role": "assistant", "content": prefill}]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("prefill", sorted(PREFILLS))
def test_the_chat_route_splits_a_continued_reply_from_where_the_prefill_ends(parser, prefill):
    reply, reasoning, content = PREFILLS[prefill]
    client = OutputClient({prefill: reply})
    with TestClient(handlers_app(Tokenizers(None), _link(parser, client))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        kw = dict(model="m", messages=_chat(prefill), max_tokens=100,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
        whole = sdk.chat.completions.create(**kw).choices[0].message
        said, thought = [], []
        for chunk in sdk.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            said += [delta.content] if delta.content else []
            thought += [(delta.model_extra or {}).get("reasoning_content") or ""]
        sdk.chat.completions.create(**kw, response_format={"type": "json_object"})
    for t in client.threads:
        t.join(10)
    assert (whole.model_extra.get("reasoning_content"), whole.content) == (reasoning, content), whole
    assert ("".join(thought) or None, "".join(said)) == (reasoning, content)
    # the constraint holds from the reply's first token, or after the thinking it is inside
    assert client.submitted[-1].structured.think == ("deepseek_r1" if reasoning else "")


def test_a_reply_without_a_prefill_is_split_as_before():
    client = OutputClient({"Six times seven?": "Six times seven.</think>It is forty-two."})
    with TestClient(handlers_app(Tokenizers(None), _link("deepseek_r1", client))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        message = sdk.chat.completions.create(model="m", messages=_chat("x")[:1], max_tokens=100).choices[0].message
    for t in client.threads:
        t.join(10)
    assert (message.model_extra["reasoning_content"], message.content) == ("Six times seven.", "It is forty-two.")


@pytest.mark.parametrize("prefill", sorted(p for p in PREFILLS if "</think>" not in p))  # (a closed one: a block)
def test_the_messages_api_prefill_is_text_unless_it_is_inside_the_thinking(prefill):
    reply, reasoning, content = PREFILLS[prefill]
    client = OutputClient({prefill: reply})
    with TestClient(messages_app(_link("deepseek_r1", client), GatewayConfig())) as http:
        r = http.post("/v1/messages", headers={"x-api-key": KEY}, json={
            "model": "m", "max_tokens": 100, "messages": _chat(prefill)})
    for t in client.threads:
        t.join(10)
    assert r.status_code == 200, r.text
    blocks = [(b["type"], b.get("thinking", b.get("text"))) for b in r.json()["content"]]
    assert blocks == ([("thinking", reasoning)] if reasoning else []) + [("text", content)], blocks


def test_a_harmony_model_refuses_the_continuation_naming_the_message():
    client = OutputClient({"The answer is": " forty-two."})
    with TestClient(handlers_app(Tokenizers(None), _link("openai_gptoss", client))) as http:
        e = error_of(http.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 5, "messages": _chat("The answer is"), "continue_final_message": True,
            "add_generation_prompt": False}), 400)
    assert e["param"] == "messages.1" and "harmony" in e["message"], e
    assert not client.submitted


R1_SHAPED = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}"
             "<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
"""DeepSeek-R1-Distill's shape (the generation prompt opens the thinking; its distills use Qwen2.5's
vocabulary): the repo holds no thinking model's own template."""


def test_a_real_tokenizer_renders_the_continued_prompt_ending_at_the_prefill():
    """The premise, with Qwen2.5's real tokenizer as the worker renders: the model reads the template
    as deepseek_r1's, its prompt for a new turn ends inside ``<think>``, and a continued one ends with
    the prefill's text (no ``<think>`` after it), where :func:`continued_parser` starts the reply."""
    from tests.support.vocab import QWEN, kept_tokenizer
    from worker.models.hf_text import HFTextCodec

    tok = kept_tokenizer(QWEN)
    if tok is None:
        pytest.skip("Qwen2.5's tokenizer is not installed")
    codec = HFTextCodec(tok).with_chat_template(R1_SHAPED)
    assert codec.reasoning_format == "deepseek_r1"
    assert tok.decode(codec.apply_chat_template(_chat("x")[:1])).endswith("<｜Assistant｜><think>\n")
    for prefill in PREFILLS:
        continued = tok.decode(codec.apply_chat_template(_chat(prefill), add_generation_prompt=False,
                                                         continue_final_message=True))
        assert continued.endswith("<｜Assistant｜>" + prefill), continued
        opened = prefill.rfind("<think>") > prefill.rfind("</think>")
        assert continued_parser(codec.reasoning_format, prefill) == ("deepseek_r1" if opened else None)
