"""A route of llama.cpp's or Ollama's own API that the gateway does not serve is a 404 that names
the route to call here (found by a newcomer pass with llama-server habits: ``GET /slots``,
``POST /embedding`` answered only ``... : Not Found``); any other unknown route keeps its 404, and a
served route's 405 is unchanged (llama.cpp's ``/completion`` and ``/props`` are served now:
tests/gateway/test_llama_completion.py). The app runs in this process, its broker link never started
(an unknown route never reaches it)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.foreign_routes import instead

# (method, path as the other server's client sends it, what the 404 must name)
FOREIGN = [
    ("POST", "/embedding", "POST /v1/embeddings"),
    ("POST", "/embeddings", "POST /v1/embeddings"),
    ("GET", "/slots", "slotserve status"),
    ("GET", "/slots?fail_on_no_slot=1", "slotserve status"),
    ("POST", "/slots/0?action=save", "prefix cache"),
    ("GET", "/v1/health", "GET /health"),
    ("POST", "/apply-template", "POST /tokenize"),
    ("POST", "/reranking", "POST /v1/rerank"),
    ("POST", "/v1/reranking", "POST /v1/rerank"),
    ("GET", "/slots/", "slotserve status"),
    ("POST", "/api/chat", "POST /v1/chat/completions"),
    ("POST", "/api/generate", "POST /v1/completions"),
    ("GET", "/api/tags", "GET /v1/models"),
    ("POST", "/api/embed", "POST /v1/embeddings"),
]


@pytest.fixture(scope="module")
def http():
    return TestClient(create_app(GatewayConfig(broker="tcp://127.0.0.1:1")))  # (no lifespan: no link)


@pytest.mark.parametrize("method, path, names", FOREIGN, ids=[f"{m} {p}" for m, p, _ in FOREIGN])
def test_a_route_of_llama_cpp_or_ollama_names_the_one_to_call(http, method, path, names):
    r = http.request(method, path, json={"prompt": "x"} if method == "POST" else None)
    assert r.status_code == 404, r.text
    e = r.json()["error"]
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", None, "not_found"), e
    route = path.partition("?")[0]
    assert e["message"].startswith(f"{method} {route}: Not Found (") and e["message"].endswith(")"), e
    assert names in e["message"], e


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/completion/x"),
                                          ("GET", "/apis/chat"), ("GET", "/v1/slots")])
def test_any_other_unknown_route_keeps_its_404(http, method, path):
    r = http.request(method, path)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"{method} {path}: Not Found"
    assert instead(path) is None


def test_a_served_route_with_another_method_keeps_its_405(http):
    for method, path in (("GET", "/infill"), ("GET", "/tokenize"), ("GET", "/models/load"), ("GET", "/completion"),
                         ("GET", "/completions"), ("POST", "/props")):
        r = http.request(method, path)
        assert r.status_code == 405, (path, r.text)
        e = r.json()["error"]
        assert e["code"] == "method_not_allowed" and e["message"] == f"{method} {path}: Method Not Allowed", e


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"), ("GET", "/tokenize", "POST"),
    ("POST", "/v1/models", "GET, HEAD"), ("POST", "/metrics", "GET, HEAD"), ("DELETE", "/health", "GET, HEAD"),
    ("POST", "/v1/responses/resp_x", "GET, HEAD, DELETE"), ("PUT", "/v1/models/m", "GET, HEAD")])
def test_a_405_says_the_methods_its_path_takes(http, method, path, allow):
    """RFC 9110 section 15.5.6: a 405 carries ``Allow``. Starlette's own was dropped with its exception's
    headers; and it named the first route's methods only (``/v1/responses/{id}`` takes GET and DELETE)."""
    r = http.request(method, path)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert r.headers.get("allow") == allow, r.headers
