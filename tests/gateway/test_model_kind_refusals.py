"""A request of the kind its model does not serve -- a chat, completion, response or message to an
embedding model, an embedding or rerank to a model that generates -- is a 400 ``unsupported`` naming
``model`` (its ``param``; the Messages API's message starts with it), on every route, whole and
streamed: the model the request names is at fault, not its prompt.

Before, ``param`` was the route's prompt field (``messages``, ``prompt``, ``input``, ``query``;
``/v1/messages`` said "messages: this model is an embedding model ..."), and the message spoke of the
wire's ``kind 'embed'``. One in-process stack (broker and workers on threads, the gateway's whole
app): a worker serving ``g`` (:class:`tests.support.scripted_text.ScriptedText`, SmolLM2's tokenizer)
and one serving ``e`` (an embedding stand-in)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from protocol.request import KIND_REFUSALS  # noqa: E402
from tests.support.cluster import ThreadCluster  # noqa: E402
from tests.support.scripted_text import ScriptedText  # noqa: E402
from tests.support.vocab import SMOLLM2, kept_tokenizer  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from tests.worker.test_embeddings import StandIn  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}]
GENERATION = {  # path -> a body for model e (an embedding model)
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"messages": CHAT, "max_tokens": 4},
    "/completion": {"prompt": "hi", "n_predict": 4},
}
EMBEDDING = {"/v1/embeddings": {"input": ["hi", "there"]}, "/v1/rerank": {"query": "hi", "documents": ["a", "b"]}}


@pytest.fixture(scope="module")
def http():
    tok = kept_tokenizer(SMOLLM2)
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not installed")
    with ThreadCluster() as cluster:
        cluster.add_worker(ScriptedText(tok), model="g")
        cluster.add_worker(StandIn(), model="e")
        codec = HFTextCodec(tok)
        with TestClient(create_app(GatewayConfig(broker=cluster.frontend), lambda name: Tokenizer(codec))) as h:
            wait_until(lambda: len(h.get("/v1/models").json()["data"]) == 2, 30, "the gateway to see both models")
            yield h


def _refused(r, embeds: bool, anthropic: bool) -> None:
    assert r.status_code == 400, r.text
    if anthropic:
        assert r.json()["error"] == {"type": "invalid_request_error", "message": KIND_REFUSALS[embeds]}, r.text
        return
    err = r.json()["error"]
    assert (err["param"], err["code"], err["message"]) == ("model", "unsupported", KIND_REFUSALS[embeds]), err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(GENERATION))
def test_a_generation_request_to_an_embedding_model_names_the_model(http, path, stream):
    _refused(http.post(path, json={"model": "e", **GENERATION[path], "stream": stream}), True, path == "/v1/messages")


@pytest.mark.parametrize("path", sorted(EMBEDDING))
def test_an_embedding_request_to_a_generation_model_names_the_model(http, path):
    _refused(http.post(path, json={"model": "g", **EMBEDDING[path]}), False, False)
