"""``/tokenize`` of a chat with tools is that chat's prompt (breaker): the assistant's
``tool_calls``, ``tool`` messages, ``tools`` and ``tool_choice`` are rendered as the worker renders
the chat request (the Hermes format for a template without tools, the template's own for one with
them), so ``count`` is the chat's ``prompt_tokens``. Before, /tokenize dropped the calls, passed
``tool`` messages to the template raw and refused ``tools``: 60 tokens for a SmolLM2 chat whose
prompt is 90. The chat side is the handlers app over a scripted client (what the gateway
submitted is rendered as the worker's engine renders it); the tokenizer is the tiny model's."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from gateway.tokenizer import Tokenizer, Tokenizers  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from tests.gateway.test_tools_template import TOOLS_TEMPLATE  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import ScriptedClient, ScriptedLink, handlers_app  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402

ZONE = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": ZONE}}]
HISTORY = [{"role": "user", "content": "What time is it?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12:00 é"},
           {"role": "user", "content": "Thanks. And in Paris?"}]


class Chats(ScriptedClient):
    """Records what the gateway submits (``submitted``) and ends each request at once with one token."""

    def _script(self, h) -> None:
        h.first_token_s = time.monotonic()
        h._prompt_tokens = 1
        h._tokens.append(1)
        h._text.append("a")
        h._end(FinishReason.STOP, None, None, time.monotonic())
        h.callback(h.tokens)
        h._done = True


@pytest.fixture(scope="module", params=["hermes", "template"])
def setup(request, tiny_text_dir):
    """``(http, client, codec)``: the handlers app whose tokenizer is the tiny model's (its own template,
    which has no tools, or one that renders them), the scripted client, and the worker's codec."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    if request.param == "template":
        tok.chat_template = TOOLS_TEMPLATE
    codec = HFTextCodec(tok)
    client = Chats()
    tokenizers = Tokenizers(lambda name: Tokenizer(codec, tok) if name == "m" else None)
    with TestClient(handlers_app(tokenizers, ScriptedLink(client))) as http:
        yield http, client, codec
    for t in client.threads:
        t.join(10)


def worker_prompt(codec, params) -> list[int]:
    """The chat prompt's ids as the worker's engine renders a request (worker/engine.py)."""
    messages = [m.template_dict() for m in params.prompt]
    return codec.apply_chat_template(messages) if params.tools is None else \
        codec.apply_chat_template(messages, tools=json.loads(params.tools))


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"},
                                   {"tools": TOOLS, "tool_choice": "auto"}], ids=["calls", "tools", "none", "auto"])
def test_tokenize_counts_the_chat_requests_prompt(setup, extra):
    http, client, codec = setup
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": HISTORY, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    chat = worker_prompt(codec, client.submitted[-1])
    t = http.post("/tokenize", json={"model": "m", "messages": HISTORY, **extra})
    assert t.status_code == 200, t.text
    assert t.json()["tokens"] == chat and t.json()["count"] == len(chat)
    text = codec.decode(chat, skip_special_tokens=False)
    assert "get_time" in text and "12:00 é" in text  # the call and its result are in the prompt
    bare = http.post("/tokenize", json={"model": "m", "messages": HISTORY}).json()["count"]
    assert (len(chat) > bare) is ("tools" in extra and extra.get("tool_choice") != "none")  # the tools shown


def test_without_the_generation_prompt_the_calls_are_still_rendered(setup):
    http, _, codec = setup
    bare = http.post("/tokenize", json={"model": "m", "messages": HISTORY, "add_generation_prompt": False}).json()
    full = http.post("/tokenize", json={"model": "m", "messages": HISTORY}).json()
    assert full["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < full["count"]
    text = codec.decode(bare["tokens"], skip_special_tokens=False)
    assert "get_time" in text and "12:00 é" in text


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": HISTORY, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"messages": HISTORY, "tools": TOOLS, "tool_choice": "bogus"}, "tool_choice"),
    ({"messages": [HISTORY[0], {**HISTORY[1], "tool_calls": [{"function": {"name": "get_time", "arguments": "[]"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"prompt": "hello", "tools": TOOLS}, "tools"),
    ({"messages": [HISTORY[0], {**HISTORY[2], "tool_call_id": "call_9"}]}, "messages.1.tool_call_id"),  # no call 9
])
def test_malformed_tool_parts_are_a_400_naming_them(setup, body, param):
    http, _, _ = setup
    assert error_of(http.post("/tokenize", json={"model": "m", **body}), 400)["param"] == param


def test_add_special_tokens_puts_the_tokenizers_own_around_the_chat(tiny_text_dir):
    # transformers tokenizes the chat with add_special_tokens=False itself: passing it as a tokenizer
    # kwarg was a TypeError, so add_special_tokens: true (and add_generation_prompt: false) was always a 400
    from tokenizers import processors

    tok = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    eos = tok.convert_tokens_to_ids("<eos>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<eos> $A <eos>",
                                                                         special_tokens=[("<eos>", eos)])
    tokenizers = Tokenizers(lambda name: Tokenizer(HFTextCodec(tok), tok))
    with TestClient(handlers_app(tokenizers, ScriptedLink(ScriptedClient()))) as http:
        plain = http.post("/tokenize", json={"model": "m", "messages": HISTORY, "tools": TOOLS}).json()
        wrapped = http.post("/tokenize", json={"model": "m", "messages": HISTORY, "tools": TOOLS,
                                               "add_special_tokens": True}).json()
    assert wrapped["tokens"] == [eos] + plain["tokens"] + [eos]
