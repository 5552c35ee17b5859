"""A sampling number outside its vendor's range is a 400 in that vendor's error shape naming the field,
whole and streamed, before anything is submitted: on /v1/chat/completions, /v1/completions and
/v1/responses OpenAI's ranges (``temperature`` [0, 2], ``top_p`` (0, 1], the penalties [-2, 2], ``n``
[1, 128], ``logprobs`` / ``top_logprobs`` [0, 20]), on /v1/messages Anthropic's (``temperature`` and
``top_p`` [0, 1], ``top_k`` >= 0, ``max_tokens`` >= 1). Was: ``temperature: 5`` served on all four
routes, ``temperature: 1.5`` and ``top_k: -1`` (vLLM's "off") on /v1/messages. Each bound itself is
served. Over the handlers apps with a scripted broker client, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.response_store import ResponseStore  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway.test_logprobs_shapes import ScriptedClient, ScriptedLink, handlers_app, letters  # noqa: E402
from tests.gateway.test_messages_api import KEY, messages_app  # noqa: E402
from tests.gateway.test_responses_api import responses_app  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
BODIES = {  # route -> (path, a body that is served, headers)
    "chat": ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 2}, {}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, {}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, {}),
    "messages": ("/v1/messages", {"model": "m", "messages": HI, "max_tokens": 2}, {"x-api-key": KEY}),
}
OPENAI = {"temperature": ([5, 2.0001, -1, -0.5], [0, 2, 0.7]),
          "top_p": ([1.5, 0, -0.1], [1, 0.5]),
          "presence_penalty": ([3, -2.5], [2, -2]),
          "frequency_penalty": ([2.01, -3], [2, -2]),
          "n": ([0, 129], [1, 2])}
# (field, bad values, served values) per route; where a field needs another beside it, ``EXTRA``
RANGES = {
    "chat": {**OPENAI, "top_logprobs": ([21, -1], [0, 20])},
    "completions": {**OPENAI, "logprobs": ([21, -1], [0, 20])},
    "responses": {"temperature": OPENAI["temperature"], "top_p": OPENAI["top_p"], "top_logprobs": ([21, -1], [0, 20]),
                  "max_output_tokens": ([0, -1], [1])},
    "messages": {"temperature": ([5, 1.0001, -1], [0, 1, 0.5]), "top_p": ([1.5, -0.5], [1, 0.5]),
                 "top_k": ([-1, -5], [0, 40]), "max_tokens": ([0, -5], [1])},
}
EXTRA = {("chat", "top_logprobs"): {"logprobs": True}}
CASES = [(route, field, v) for route, fields in RANGES.items() for field, (bad, _) in fields.items() for v in bad]
SERVED = [(route, field, v) for route, fields in RANGES.items() for field, (_, ok) in fields.items() for v in ok]


@pytest.fixture(scope="module")
def apps():
    client = ScriptedClient()
    with TestClient(handlers_app(Tokenizers(letters), ScriptedLink(client))) as openai_routes, \
            TestClient(responses_app(ScriptedLink(client), GatewayConfig(), ResponseStore(8, 60.0))) as responses, \
            TestClient(messages_app(ScriptedLink(client), GatewayConfig())) as messages:
        yield {"chat": openai_routes, "completions": openai_routes, "responses": responses,
               "messages": messages}, client
    for t in client.threads:
        t.join(10)


def post(apps, route: str, field: str, value, **more):
    http, client = apps[0][route], apps[1]
    path, body, headers = BODIES[route]
    return http.post(path, json={**body, **EXTRA.get((route, field), {}), field: value, **more}, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route, field, value", CASES)
def test_a_number_outside_the_vendor_s_range_is_a_400_naming_it(apps, route, field, value, stream):
    submitted = len(apps[1].submitted)
    r = post(apps, route, field, value, stream=stream)
    if route == "messages":  # Anthropic's shape: no param, the message starts with the field
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        error = r.json()["error"]
        assert set(error) == {"type", "message"} and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(field) and str(value) in error["message"], error
    else:
        e = error_of(r, 400)
        assert e["param"] == field and e["message"].startswith((field, f"Invalid value for '{field}'")), e
        assert str(value) in e["message"], e
    assert len(apps[1].submitted) == submitted  # refused before anything ran


@pytest.mark.parametrize("route, field, value", SERVED)
def test_each_bound_is_served(apps, route, field, value):
    r = post(apps, route, field, value)
    assert r.status_code == 200, r.text
