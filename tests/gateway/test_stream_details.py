"""Stream details (issue 22, item 6), as ported from vLLM's and llama.cpp's tests:
a chat stream's first chunk is the role chunk ``{"role": "assistant", "content": ""}``;
with ``continuous_usage_stats`` every chunk, the first included, carries ``usage``;
a body declared as anything but JSON is refused (400, OpenAI's error shape, as vLLM)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

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
from tests.support.gateway import error_of, sse, start_cluster  # noqa: E402
from tests.support.reference import simulated_reference  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say hello."}]
ROLE_DELTA = {"role": "assistant", "content": ""}


@pytest.fixture(scope="module")
def cluster(text_model):
    workers = (WorkerConfig(model="simulated", num_slots=4), WorkerConfig(model=text_model, num_slots=4))
    c = start_cluster(workers, gateway=GatewayConfig(port=0), models=("simulated", text_model))
    try:
        yield c
    finally:
        c.stop()


# ---------------------------------------------------------------------- the role chunk


def test_the_first_chat_chunk_is_the_role_chunk_through_the_sdk(oai, text_model):
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=12, temperature=0)
    plain = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    first = chunks[0].choices[0]
    # before: the first chunk already carried the first content (role and text together)
    assert (first.index, first.delta.role, first.delta.content, first.finish_reason) == (0, "assistant", "", None)
    assert first.token_ids == []
    assert all(c.delta.role is None for ch in chunks[1:] for c in ch.choices)
    assert "".join(c.delta.content or "" for ch in chunks[1:] for c in ch.choices) == plain.choices[0].message.content
    assert [t for ch in chunks for c in ch.choices for t in c.token_ids] == plain.choices[0].token_ids


def test_the_first_chat_chunk_is_the_role_chunk_over_raw_http(cluster, text_model):
    body = {"model": text_model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2}
    with httpx.Client(base_url=cluster.http_url, timeout=60) as http:
        events = sse(http, "/v1/chat/completions", body, done=True)
    # one role chunk per choice, first, as vLLM sends them; nothing generated in them
    for i, e in enumerate(events[:2]):
        assert e["object"] == "chat.completion.chunk" and "usage" not in e
        assert e["choices"] == [{"index": i, "delta": ROLE_DELTA, "logprobs": None, "finish_reason": None,
                                 "stop_reason": None, "token_ids": []}]
    rest = [c for e in events[2:] for c in e["choices"]]
    assert rest and all("role" not in c["delta"] for c in rest)
    assert sorted(c["index"] for c in rest if c["finish_reason"] is not None) == [0, 1]
    assert len({e["id"] for e in events}) == 1


def test_completions_have_no_role_chunk(cluster):
    body = {"model": "simulated", "prompt": [4, 5], "max_tokens": 5}
    with httpx.Client(base_url=cluster.http_url, timeout=60) as http:
        events = sse(http, "/v1/completions", body, done=True)
    tokens = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert tokens == simulated_reference([4, 5], 5)[0] and events[0]["choices"][0]["token_ids"] != []


# ---------------------------------------------------------------------- continuous usage


def test_continuous_usage_is_on_every_completion_chunk_the_first_included(oai):
    chunks = list(oai.completions.create(model="simulated", prompt=[4, 5, 6], max_tokens=7, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True}))
    sent = 0
    for ch in chunks[:-1]:
        sent += sum(len(c.token_ids) for c in ch.choices)
        assert ch.usage is not None and (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (3, sent)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sent == 7


class KnownPromptClient:
    """A stand-in for :class:`client.Client` whose requests know their prompt's length
    (``prompt_tokens``) before their first token, and stream ``tokens`` one by one."""

    def __init__(self, prompt_tokens: int, tokens: list[int]) -> None:
        self.prompt_tokens, self.tokens = prompt_tokens, tokens
        self.threads: list[threading.Thread] = []

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, **options):
        h = ClientHandle(len(self.threads), RequestParams(prompt, max_tokens, **options), callback, on_token,
                         time.monotonic(), None)
        h._prompt_tokens = self.prompt_tokens
        t = threading.Thread(target=self._run, args=(h,))
        self.threads.append(t)
        t.start()
        return h

    def _run(self, h: ClientHandle) -> None:
        for t in self.tokens:
            h.first_token_s = h.first_token_s or time.monotonic()
            h._tokens.append(t)
            h._text.append(f"<{t}>")
            h.on_token(t)
            time.sleep(0.002)  # a few separate chunks
        h._end(FinishReason.LENGTH, None, None, time.monotonic())
        h.callback(h.tokens)
        h._done = True

    def cancel(self, request_id) -> None:
        pass


class OneModelLink:
    def __init__(self, client) -> None:
        self.client = client

    async def client_for(self, model: str):
        return self.client

    def model_info(self, model: str) -> ModelInfo:
        return ModelInfo(vocab_size=1000, max_seq_len=None, eos_token_ids=(0,), has_tokenizer=True)


def test_continuous_usage_is_on_every_chat_chunk_the_role_chunk_included():
    # a prompt whose length is known before the first token: the role chunk says 0 completion tokens
    client = KnownPromptClient(prompt_tokens=9, tokens=[11, 12, 13, 14])
    gen = Generate(GatewayConfig(), OneModelLink(client), GatewayMetrics())
    app = Starlette(routes=[Route("/v1/chat/completions", gen.chat_completions, methods=["POST"])])
    with TestClient(app) as http:
        events = sse(http, "/v1/chat/completions", {
            "model": "m", "messages": MESSAGES, "max_tokens": 4, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, done=True)
    for t in client.threads:
        t.join(10)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [ROLE_DELTA, ROLE_DELTA]
    for e in events[:2]:
        assert e["usage"] == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    sent = 0
    for e in events[2:-1]:
        sent += sum(len(c["token_ids"]) for c in e["choices"])
        assert e["usage"] == {"prompt_tokens": 9, "completion_tokens": sent, "total_tokens": 9 + sent,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert sent == 8 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_continuous_usage_is_on_every_chunk_of_a_real_chat(oai, text_model):
    chunks = list(oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True,
                                                                           "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chunks)


# ---------------------------------------------------------------------- bodies that are not JSON by their Content-Type


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x", "application/jsonl", ""])
@pytest.mark.parametrize("stream", [False, True])
def test_a_body_declared_as_not_json_is_refused(cluster, content_type, stream):
    # before: served as if it were JSON (vLLM answers 400 "Only 'application/json' is allowed")
    body = json.dumps({"model": "simulated", "prompt": [1, 2], "max_tokens": 3, "stream": stream}).encode()
    r = httpx.post(cluster.http_url + "/v1/completions", content=body, headers={"content-type": content_type})
    e = error_of(r, 400)
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", None, "unsupported_media_type")
    assert "application/json" in e["message"]


def test_curl_d_style_form_bodies_are_refused_on_both_endpoints(cluster, text_model):
    for path, body in (("/v1/completions", {"model": "simulated", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": text_model, "messages": MESSAGES, "max_tokens": 2})):
        r = httpx.post(cluster.http_url + path, data={"body": json.dumps(body)})  # what `curl -d` sends
        assert error_of(r, 400)["code"] == "unsupported_media_type"


def test_the_sdk_gets_bad_request_for_a_form_content_type(oai, text_model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=2,
                                    extra_headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert e.value.code == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", "application/json ; charset=utf-8", None])
def test_json_bodies_with_charset_or_no_content_type_are_served(cluster, content_type):
    body = json.dumps({"model": "simulated", "prompt": [1, 2], "max_tokens": 3}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(cluster.http_url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == simulated_reference([1, 2], 3)[0]
