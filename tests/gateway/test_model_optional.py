"""``model`` may be left out of a request while one model is served, on every route (recent vLLM
defaults it to the served model; llama.cpp ignores it); the answer names the model. Was: a 400
``missing_required_parameter`` on /v1/* (only /tokenize and /infill took the one served). With
several served it stays a 400 naming each, in the route's own error shape.

One in-process stack per case (broker and workers on threads, the gateway's whole app), the
workers serving :class:`tests.support.scripted_text.ScriptedText` (SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.support.cluster import ThreadCluster  # noqa: E402
from tests.support.gateway import sse  # noqa: E402
from tests.support.routes import OPENAI_AND_VENDOR  # noqa: E402
from tests.support.scripted_text import TEXT, ScriptedText  # noqa: E402
from tests.support.vocab import SMOLLM2, kept_tokenizer  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402

ROUTES = OPENAI_AND_VENDOR  # path -> a body without "model"


@pytest.fixture(scope="module", params=[("m",), ("m", "n")], ids=["one model", "two models"])
def http(request):
    tok = kept_tokenizer(SMOLLM2)
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not installed")
    with ThreadCluster() as cluster:
        for name in request.param:
            cluster.add_worker(ScriptedText(tok), model=name)
        codec = HFTextCodec(tok)
        with TestClient(create_app(GatewayConfig(broker=cluster.frontend), lambda name: Tokenizer(codec))) as h:
            wait_until(lambda: len(h.get("/v1/models").json()["data"]) == len(request.param), 30,
                       "the gateway to see the models")
            yield h, request.param


def _message(r) -> str:
    err = r.json()["error"]
    return err["message"]


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_request_without_a_model(http, path):
    h, models = http
    r = h.post(path, json=ROUTES[path])
    if len(models) > 1:
        assert r.status_code == 400, r.text
        assert _message(r) == "model is required: this gateway serves several (m, n)"
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        else:
            assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "missing_required_parameter"
        return
    if path in ("/v1/embeddings", "/v1/rerank"):  # (sent to "m", a model that generates: its own 400)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported", r.text
        assert _message(r).startswith("model names a model that generates text and gives no embeddings")
        return
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/v1/messages/count_tokens":
        assert out["input_tokens"] > 0
    elif path == "/tokenize":
        assert out["count"] > 0
    else:
        assert out["model"] == "m"
        text = {"/v1/completions": lambda: out["choices"][0]["text"],
                "/v1/chat/completions": lambda: out["choices"][0]["message"]["content"],
                "/v1/responses": lambda: out["output"][-1]["content"][0]["text"],
                "/v1/messages": lambda: out["content"][0]["text"]}[path]()
        assert text == TEXT[:len(text)] and text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_without_a_model_names_the_one_served(http, path):
    h, models = http
    if len(models) > 1:
        pytest.skip("(the 400 comes before any stream: test_a_request_without_a_model)")
    chunks = sse(h, path, ROUTES[path])
    assert chunks and {c["model"] for c in chunks} == {"m"}
