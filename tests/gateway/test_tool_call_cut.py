"""A forced tool call (``tool_choice`` required or a named function) cut by ``max_tokens`` before its
arguments began is neither content nor a call on /v1/chat/completions, /v1/responses and /v1/messages,
whole and streamed: the answer said ``'<tool_call>\\n{"name":'`` as its text (OpenAI never shows its call
syntax; the parsers drop a call's start that the output cut off, gateway/call_stream.py). Cut after the
arguments began, it is the call with the arguments so far, as before; the finish is ``length``
(``incomplete``, ``max_tokens``). Over the handlers apps with the scripted broker client of
tests/gateway/test_tools_stream.py (4 characters a token), no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_tools_stream import OUTPUTS, TOKEN_CHARS, OutputClient  # noqa: E402
from tests.support.gateway import chat_stream, sse, vendor_routes  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402

ARGS_AT = OUTPUTS["one"].index('"arguments": ') + len('"arguments": ')  # where the call's arguments begin
BEFORE = sorted({1, 3, 5, ARGS_AT // TOKEN_CHARS})  # max_tokens that cut the call before its arguments
AFTER = ARGS_AT // TOKEN_CHARS + 2  # one that cuts it inside them
MARKUP = ("<tool", "{\"name\"", "get_weather")
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def apps():
    """``{route: TestClient}`` over one :class:`OutputClient`."""
    with vendor_routes(OutputClient(), Tokenizers(None)) as routes:
        yield routes


def chat(http, max_tokens: int, choice) -> tuple[tuple, tuple]:
    """(text, calls, finish) of the whole answer and of the stream."""
    body = {"model": "m", "messages": [{"role": "user", "content": "one"}], "max_tokens": max_tokens,
            "tools": OPENAI_TOOLS, "tool_choice": choice}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"].get("tool_calls") or []]
    whole = (c["message"]["content"] or "", calls, c["finish_reason"])
    return whole, chat_stream(sse(http, "/v1/chat/completions", body))


def responses(http, max_tokens: int, choice) -> tuple[tuple, tuple]:
    body = {"model": "m", "input": "one", "max_output_tokens": max_tokens, "tool_choice": choice,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    text = "".join(p["text"] for item in out["output"] if item["type"] == "message" for p in item["content"])
    calls = [(i["name"], i["arguments"]) for i in out["output"] if i["type"] == "function_call"]
    events = sse(http, "/v1/responses", body)
    streamed_text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    streamed_calls = [(i["name"], i["arguments"]) for i in final["output"] if i["type"] == "function_call"]
    return (text, calls, out["status"]), (streamed_text, streamed_calls, final["status"])


def messages(http, max_tokens: int, choice) -> tuple[tuple, tuple]:
    body = {"model": "m", "messages": [{"role": "user", "content": "one"}], "max_tokens": max_tokens,
            "tool_choice": choice, "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    headers = {"x-api-key": KEY}
    r = http.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    text = "".join(b["text"] for b in out["content"] if b["type"] == "text")
    calls = [b["name"] for b in out["content"] if b["type"] == "tool_use"]
    events = sse(http, "/v1/messages", body, headers=headers)
    streamed_text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                            and e["delta"]["type"] == "text_delta")
    streamed_calls = [e["content_block"]["name"] for e in events if e["type"] == "content_block_start"
                      and e["content_block"]["type"] == "tool_use"]
    stop = next(e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta")
    return (text, calls, out["stop_reason"]), (streamed_text, streamed_calls, stop)


ROUTES = {  # route -> (how to call it, its forced choices, what a cut says)
    "chat": (chat, ["required", {"type": "function", "function": {"name": "get_weather"}}], "length"),
    "responses": (responses, ["required", {"type": "function", "name": "get_weather"}], "incomplete"),
    "messages": (messages, [{"type": "any"}, {"type": "tool", "name": "get_weather"}], "max_tokens"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_forced_call_cut_before_its_arguments_shows_no_markup(apps, route):
    call, choices, cut = ROUTES[route]
    for choice in choices:
        for max_tokens in BEFORE:
            whole, streamed = call(apps[route], max_tokens, choice)
            assert whole == streamed, (choice, max_tokens)
            text, calls, finish = whole
            assert (text, calls, finish) == ("", [], cut), (choice, max_tokens)  # was '<tool_call>\n{"name":'
        whole, streamed = call(apps[route], AFTER, choice)  # cut inside the arguments: the call so far
        assert whole == streamed and whole[2] == cut and not any(m in whole[0] for m in MARKUP), whole
        assert [c if isinstance(c, str) else c[0] for c in whole[1]] == ["get_weather"], whole
