"""A chat completion's budget below 1 is a 400 naming the field the client gave, whole and streamed,
and nothing is submitted (OpenAI and vLLM refuse ``max_tokens: 0`` on chat; /v1/responses and
/v1/messages refuse it too). Was: ``max_tokens: 0`` or ``max_completion_tokens: 0`` ran as the
completions route's ``echo`` case (one token generated and dropped), a 200 with empty content and
``finish_reason: "length"``; ``max_completion_tokens: -1`` was refused as "max_tokens must be >= 1"
with ``param: "max_tokens"``, a field the body did not hold. Over the gateway's handlers and a
scripted client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import ScriptedClient, ScriptedLink, handlers_app, letters  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def chat():
    client = ScriptedClient()
    with TestClient(handlers_app(Tokenizers(letters), ScriptedLink(client))) as http:
        yield http, client
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"logprobs": True}])
@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_completion_tokens", 0),
                                          ("max_tokens", -1), ("max_completion_tokens", -1)])
def test_a_chat_budget_below_1_is_a_400_naming_its_field(chat, field, value, extra, stream):
    http, client = chat
    body = {"model": "m", "messages": MESSAGES, field: value, "stream": stream, **extra}
    e = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert e["param"] == field and e["message"] == f"{field} must be >= 1, got {value}", e
    assert client.submitted == []


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_budget_of_1_is_served(chat, field):
    http, client = chat
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, field: 1})
    assert r.status_code == 200, r.text
    assert [p.max_tokens for p in client.submitted] == [1]
    assert r.json()["choices"][0]["finish_reason"] == "length"
