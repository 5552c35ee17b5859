"""The gateway's ``usage`` block, through its handlers with a scripted broker
client: no sockets, no processes (the live-cluster tests are test_openai_sdk.py and test_http.py).

A text or chat prompt's length is known only once a worker has tokenised it;
the client learns it with the request's end. A request that ended before any
worker saw it (its ``timeout_s`` passed in the broker's queue) brings none.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from client.handle import ClientHandle  # noqa: E402
from gateway import GatewayConfig  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from protocol.messages import ModelInfo  # noqa: E402
from protocol.request import RequestParams  # noqa: E402

QUEUED = None
"""An outcome: the request's deadline passed in the broker's queue (no worker saw it)."""


class ScriptedClient:
    """A stand-in for :class:`client.Client`: request ``i`` (in submission order)
    ends on another thread with ``outcomes[i]``: ``QUEUED``, or ``(prompt_tokens,
    tokens[, cached_tokens])`` for one that ran (finish_reason ``length``)."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = list(outcomes)
        self.threads: list[threading.Thread] = []

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, **options):
        params = RequestParams(prompt, max_tokens, **options)
        h = ClientHandle(len(self.threads), params, callback, on_token, time.monotonic(), None)
        t = threading.Thread(target=self._end, args=(h, self.outcomes.pop(0)))
        self.threads.append(t)
        t.start()
        return h

    def _end(self, h: ClientHandle, outcome) -> None:
        if outcome is QUEUED:
            h._end(FinishReason.DEADLINE, None, None, time.monotonic())
        else:
            h._prompt_tokens, tokens, *cached = outcome
            h._cached_tokens = cached[0] if cached else 0  # (what a worker without a prefix cache reports)
            h.first_token_s = time.monotonic()
            h._tokens.extend(tokens)
            h._text.append("x" * len(tokens))
            if h.on_token is not None:
                h.on_token(tokens[-1])
            h._end(FinishReason.LENGTH, None, None, time.monotonic())
        h.callback((h.prompt or []) + h.tokens)
        h._done = True

    def cancel(self, request_id) -> None:
        pass


class ScriptedLink:
    """A stand-in for :class:`gateway.link.BrokerConnections`: one model with a tokenizer."""

    def __init__(self, client: ScriptedClient) -> None:
        self.client = client

    async def client_for(self, model: str) -> ScriptedClient:
        return self.client

    def model_info(self, model: str) -> ModelInfo:
        return ModelInfo(vocab_size=1000, max_seq_len=None, eos_token_ids=(0,), has_tokenizer=True)


def post(outcomes: list, path: str, body: dict) -> tuple[dict, GatewayMetrics]:
    """``body`` answered by the gateway's handlers over a :class:`ScriptedClient`; the
    JSON answer (for a stream: its last chunk, the usage one) and the metrics."""
    client, metrics = ScriptedClient(outcomes), GatewayMetrics()
    gen = Generate(GatewayConfig(), ScriptedLink(client), metrics)
    app = Starlette(routes=[Route("/v1/completions", gen.completions, methods=["POST"]),
                            Route("/v1/chat/completions", gen.chat_completions, methods=["POST"])])
    with TestClient(app) as http:
        r = http.post(path, json={"model": "m", "max_tokens": 4, **body})
    for t in client.threads:
        t.join(10)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json(), metrics
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    return last, metrics


TEXT = {"prompt": "hello world"}
CHAT = {"messages": [{"role": "user", "content": "hello"}]}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("path, fields", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompt_no_worker_saw_has_no_usage_not_zero_prompt_tokens(path, fields, stream):
    # usage.prompt_tokens was 0 (total_tokens 0) for a prompt that has tokens
    out, _ = post([QUEUED], path, {**fields, **(STREAM if stream else {})})
    assert out["usage"] is None


@pytest.mark.parametrize("path, fields", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompts_length_comes_from_any_of_its_choices(path, fields, stream):
    # only the first choice of each prompt was read: 0 when it was the one that never ran
    out, metrics = post([QUEUED, (7, [1, 2, 3])], path, {**fields, "n": 2, **(STREAM if stream else {})})
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert metrics.prompt_tokens.labels("m")._value.get() == 7


def test_the_same_text_twice_has_one_length():
    out, _ = post([QUEUED, (5, [1]), (6, [1, 2])], "/v1/completions", {"prompt": ["hi", "hi", "other"]})
    assert out["usage"] == {"prompt_tokens": 5 + 5 + 6, "completion_tokens": 3, "total_tokens": 19,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_token_id_prompt_no_worker_saw_still_counts():
    out, _ = post([QUEUED], "/v1/completions", {"prompt": [5, 6, 7]})
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, fields", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_openais_prompt_tokens_details_counted_once_per_prompt(path, fields, stream):
    # n=2: the prompt counts once, with its first choice's cache hit (the second hit what the first stored)
    out, metrics = post([(40, [1, 2], 32), (40, [3], 48)], path, {**fields, "n": 2, **(STREAM if stream else {})})
    assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                            "prompt_tokens_details": {"cached_tokens": 32}}
    assert metrics.cached_tokens.labels("m")._value.get() == 32 and metrics.prompt_tokens.labels("m")._value.get() == 40


def test_cached_tokens_of_several_prompts_add_up_and_an_unknown_count_is_0():
    out, _ = post([(20, [1], 16), (30, [1], None), (9, [1], 0)], "/v1/completions", {"prompt": ["a", "b", "c"]})
    assert out["usage"]["prompt_tokens"] == 59 and out["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def test_metrics_count_completion_tokens_when_usage_is_null():
    out, metrics = post([QUEUED, (4, [1, 2])], "/v1/completions", {"prompt": ["a", "b"]})
    assert out["usage"] is None
    assert metrics.completion_tokens.labels("m")._value.get() == 2
    assert metrics.prompt_tokens.labels("m")._value.get() == 0
