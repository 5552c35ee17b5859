"""A request that leaves ``model`` out while no broker answers (``slotserve serve`` started before
``slotserve up``, or with a wrong ``--broker``) was answered 503 "no worker serves a model right now;
retry, or name the model": it blamed the workers and told the client to name a model, and a request
naming one was answered "no slotserve broker answers at ...". Now every route that defaults the
model says that no broker answers, where and what to do, as a request naming a model is answered.

The gateway's whole app over a broker address nobody listens on; no process, no model."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402
from tests.support.routes import CHAT, LLAMA_NATIVE, OPENAI_AND_VENDOR  # noqa: E402

ROUTES = {**OPENAI_AND_VENDOR, **LLAMA_NATIVE}  # path -> a body without "model"


@pytest.fixture(scope="module")
def http():
    broker = f"tcp://127.0.0.1:{free_port()}"
    with TestClient(create_app(GatewayConfig(broker=broker, connect_timeout_s=0.5))) as h:
        yield h, broker


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_without_a_model_says_no_broker_answers(http, path, stream):
    h, broker = http
    body = dict(ROUTES[path])
    if stream:
        if path in ("/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/tokenize"):
            pytest.skip("(no stream on this route)")
        body["stream"] = True
    r = h.post(path, json=body)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == (f"no slotserve broker answers at {broker}; start one (`slotserve up`) "
                                            "or check the gateway's --broker")
    assert r.headers["retry-after"] == "1"


def test_a_request_naming_a_model_says_the_same(http):
    h, broker = http
    r = h.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 8})
    assert r.status_code == 503 and r.json()["error"]["message"].startswith(f"no slotserve broker answers at {broker}")
