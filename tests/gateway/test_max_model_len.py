"""--max-model-len through real processes: a worker serving the tiny text model (the slotserve
runner, a bf16 KV cache) with ``max_model_len`` 64 under its trained 512 tells the broker and the
gateway 64, and refuses a longer request on every entry point as it refuses one past the context:
the wire code ``context_length_exceeded`` (Python client) and HTTP 400 in OpenAI's shape. (The
in-process engine's ContextLengthError: tests/models/test_max_model_len.py.)"""

from __future__ import annotations

import re

import httpx
import pytest

pytest.importorskip("transformers")

from client import Client  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from protocol.errors import ContextLengthError  # noqa: E402
from tests.support.gateway import start_cluster  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402
from worker.models import ModelOptions  # noqa: E402

LIMIT = 64
MESSAGE = f"exceeds the served context of {LIMIT} tokens (--max-model-len)"


@pytest.fixture(scope="module")
def cluster(text_model):
    options = ModelOptions(max_model_len=LIMIT, kv_cache_dtype="bf16", prefix_cache_mb=0)
    c = start_cluster((WorkerConfig(model=text_model, num_slots=2, model_options=options),),
                      gateway=GatewayConfig(port=0), models=(text_model,))
    try:
        yield c
    finally:
        c.stop()


def test_the_limit_is_the_models_max_model_len(cluster, text_model):
    (entry,) = [m for m in httpx.get(cluster.http_url + "/v1/models", timeout=10).json()["data"]
                if m["id"] == text_model]
    assert entry["max_model_len"] == LIMIT
    # what runs: the worker's precision (auto -> fp32 for this tiny full-precision model), its linears
    # and its KV cache's element type (the fixture's kv_cache_dtype)
    assert entry["runs"].startswith("fp32: ") and entry["runs"].endswith("; KV cache bf16"), entry["runs"]


def test_the_python_client_gets_the_wire_code(cluster, text_model):
    with Client(cluster.frontend, model=text_model) as c:
        with pytest.raises(ContextLengthError, match=re.escape(MESSAGE)):  # token ids: counted by the client
            c.submit_request(list(range(1, 41)), LIMIT - 39)
        h = c.submit_request("hello world " * 8, LIMIT - 1)  # text: counted by the worker
        with pytest.raises(ContextLengthError, match=r"^max_tokens \(64\) leaves no room for the prompt"):
            c.submit_request("hello world " * 8, LIMIT)  # (a budget no prompt fits beside: before it is counted)
        h.result(timeout=60)
        assert h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert MESSAGE in h.error.message
        fits = c.submit_request(list(range(1, 41)), LIMIT - 40)
        fits.result(timeout=60)
        assert fits.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and fits.tokens


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"prompt": list(range(1, 41))}, "prompt"),
    ("/v1/completions", {"prompt": "hello world " * 8}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 8}]}, "messages"),
])
def test_http_is_400_context_length_exceeded(cluster, text_model, path, fields, param):
    r = httpx.post(cluster.http_url + path, json={"model": text_model, "max_tokens": LIMIT - 1, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["type"], e["code"], e["param"]) == ("invalid_request_error", "context_length_exceeded", param), e
    assert MESSAGE in e["message"]


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": list(range(1, 57))}),  # 56 ids + the default 16 > 64
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 8}]}),  # + 1024 > 64
])
def test_a_default_budget_is_what_the_context_leaves(cluster, text_model, path, fields):
    """Kind "every default budget" (issue 33): a request without max_tokens whose prompt fits gets
    the rest of the context, not a 400 for prompt + the gateway's default; one that fills it, a 400."""
    r = httpx.post(cluster.http_url + path, json={"model": text_model, "ignore_eos": True, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == LIMIT and choice["finish_reason"] == "length"
    full = {"prompt": list(range(1, LIMIT + 1))} if "prompt" in fields else \
        {"messages": [{"role": "user", "content": "hello world " * 40}]}
    r = httpx.post(cluster.http_url + path, json={"model": text_model, **full}, timeout=60)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["code"] == "context_length_exceeded" and "leaves no room" in e["message"], e


def test_the_python_client_may_ask_for_a_clamped_budget(cluster, text_model):
    with Client(cluster.frontend, model=text_model) as c:
        h = c.submit_request(list(range(1, 41)), 1000, clamp_max_tokens=True, stop_token=None)
        h.result(timeout=60)
        assert h.finish_reason is FinishReason.LENGTH and len(h.tokens) == LIMIT - 40
