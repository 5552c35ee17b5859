"""``/v1/embeddings`` and ``/v1/rerank`` (gateway/embeddings.py) over the handlers alone, no sockets:
a stand-in client embeds through an in-process :class:`~worker.embeddings.EmbeddingEngine` with a
weightless model of a Matryoshka kind. Response shapes (float and base64, ``dimensions`` cut and
renormalised, ``usage``), rerank's order, ``top_n`` and documents, and each malformed body an
OpenAI-shaped 400 naming its field. (The real model through real processes: test_embeddings_http.py.)"""

from __future__ import annotations

import base64
import math
import re
import struct
import threading

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from client.errors import RemoteError  # noqa: E402
from gateway.drain import Drain  # noqa: E402
from gateway.embeddings import MAX_INPUTS, EmbeddingEndpoints  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from protocol.embedding import pack  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from protocol.messages import ModelInfo  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from worker.embeddings import EmbeddingEngine  # noqa: E402

VECTORS = {"north": [0.0, 1.0, 0.0, 0.0], "up": [0.0, 0.8, 0.6, 0.0], "east": [1.0, 0.0, 0.0, 0.0],
           "down": [0.0, -1.0, 0.0, 0.0]}


class Compass:
    """A weightless embedding model: a word's vector is :data:`VECTORS`'; token ids are the words' indexes."""

    embedding_size = 4
    vocab_size = len(VECTORS)
    max_seq_len = 3
    matryoshka_dims = (2, 4)
    tokenizer = True

    def tokenize(self, text: str) -> list[int]:
        return [list(VECTORS).index(w) for w in text.split()]

    def embed(self, prompts):
        words = list(VECTORS.values())
        return [pack([sum(words[t][i] for t in p) for i in range(4)]) for p in prompts]


class EngineClient:
    """The gateway's view of a client: ``embed(prompt, callback)``, through an engine stepped on a
    thread of its own (as a worker's main thread does) until :meth:`stop`."""

    def __init__(self) -> None:
        self.engine = EmbeddingEngine(Compass(), 8)
        self.cancelled: list = []
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._serve)
        self._loop.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.engine.wait_for_work(0.05):
                self.engine.step()

    def stop(self) -> None:
        self._stop.set()
        self._loop.join(10)

    def embed(self, prompt, callback):
        return self.engine.submit_request(prompt, callback)

    def cancel(self, request_id) -> bool:
        self.cancelled.append(request_id)
        return self.engine.cancel(request_id)


class Link:
    """A stand-in for the gateway's broker link: one model, ``m``, a Matryoshka one (2 or 4 values)."""

    def __init__(self) -> None:
        self.client = EngineClient()

    async def client_for(self, model: str) -> EngineClient:
        return self.client

    def model_info(self, model: str) -> ModelInfo:
        return ModelInfo(vocab_size=4, max_seq_len=3, has_tokenizer=True, embedding_size=4, matryoshka_dims=(2, 4))


METRICS = GatewayMetrics()


def sample(name: str, labels: str) -> float:
    """One sample of :data:`METRICS` as ``/metrics`` renders it (0.0 when absent)."""
    text = METRICS.render()
    m = re.search(rf"^{name}{{{labels}}} (\S+)$", text.decode() if isinstance(text, bytes) else text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def http():
    link = Link()
    endpoints = EmbeddingEndpoints(link, Drain(), 1 << 20, METRICS)
    app = Starlette(routes=[Route("/v1/embeddings", endpoints.embeddings, methods=["POST"]),
                            Route("/v1/rerank", endpoints.rerank, methods=["POST"])])
    try:
        with TestClient(app) as client:
            yield client
    finally:
        link.client.stop()


def test_float_base64_and_usage(http):
    before = sample("slotserve_http_prompt_tokens_total", 'model="m"')
    r = http.post("/v1/embeddings", json={"model": "m", "input": ["north", "east up"]}).json()
    assert sample("slotserve_http_prompt_tokens_total", 'model="m"') == before + 3  # (usage, in the metrics)
    assert sample("slotserve_http_requests_total", 'endpoint="/v1/embeddings",status="200"') >= 1
    assert r["object"] == "list" and r["model"] == "m"
    assert [d["embedding"] for d in r["data"]] == [[0.0, 1.0, 0.0, 0.0], pytest.approx([1.0, 0.8, 0.6, 0.0])]
    assert [(d["object"], d["index"]) for d in r["data"]] == [("embedding", 0), ("embedding", 1)]
    assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    b = http.post("/v1/embeddings", json={"model": "m", "input": "east up", "encoding_format": "base64"}).json()
    assert list(struct.unpack("<4f", base64.b64decode(b["data"][0]["embedding"]))) == r["data"][1]["embedding"]
    ids = http.post("/v1/embeddings", json={"model": "m", "input": [2, 1]}).json()  # one token-id list
    assert ids["data"][0]["embedding"] == r["data"][1]["embedding"] and len(ids["data"]) == 1


def test_dimensions_cut_a_matryoshka_embedding_and_renormalise_it(http):
    r = http.post("/v1/embeddings", json={"model": "m", "input": "east up", "dimensions": 2}).json()
    x, y = r["data"][0]["embedding"]
    assert (x, y) == (pytest.approx(1 / math.sqrt(1.64)), pytest.approx(0.8 / math.sqrt(1.64)))
    assert len(http.post("/v1/embeddings", json={"model": "m", "input": "up", "dimensions": 4}).json()["data"][0]
               ["embedding"]) == 4
    e = error_of(http.post("/v1/embeddings", json={"model": "m", "input": "up", "dimensions": 3}), 400)
    assert e["param"] == "dimensions" and "2, 4" in e["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "input": ""}, "input", "empty"),
    ({"model": "m", "input": []}, "input", "empty list"),
    ({"model": "m", "input": ["north", ""]}, "input", "input[1] must not be empty"),
    ({"model": "m", "input": [[1], []]}, "input", "input[1] must not be an empty list"),
    ({"model": "m", "input": ["north", [1]]}, "input", "not a mix"),
    ({"model": "m", "input": [1, 2.5]}, "input", "input[1] is 2.5"),
    ({"model": "m", "input": {"text": "north"}}, "input", "input must be a string"),
    ({"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"model": "m", "input": "north", "encoding_format": "hex"}, "encoding_format", "float"),
    ({"model": "m", "input": "north", "truncate": True}, "truncate", "Unrecognized"),
    ({"model": "m"}, "input", "Missing required parameter"),  # (no model: the one served, test_model_optional)
    ({"model": "m", "input": "north up east down"}, "input",
     "input (4 tokens) exceeds the 3 tokens this model embeds at most (the model's own limit, or a lower "
     "--max-model-len); shorten it or split it into several inputs"),
    ({"model": "m", "input": [9]}, "input", "vocabulary"),
])
def test_malformed_embedding_bodies_are_400s_naming_the_field(http, body, param, words):
    e = error_of(http.post("/v1/embeddings", json=body), 400)
    assert e["param"] == param and words in e["message"], e
    if "empty" in words:
        assert e["code"] == "invalid_value"
    if "embeds at most" in words:  # (OpenAI's code)
        assert e["code"] == "context_length_exceeded"


class WorkerSideClient(EngineClient):
    """:class:`EngineClient` as a worker refuses text: what the engine refuses at submission ends the
    request with that error's code (``context_length_exceeded``, ...) as a :class:`RemoteError`, as
    worker/process.py answers it, instead of raising in the gateway."""

    def embed(self, prompt, callback):
        try:
            return super().embed(prompt, callback)
        except ValueError as e:
            return RefusedHandle(RemoteError(getattr(e, "code", ErrorCode.BAD_REQUEST), str(e)))


class RefusedHandle:
    """A request a worker refused: ended ``error`` with ``error``."""

    def __init__(self, error: RemoteError) -> None:
        self.request_id, self.finish_reason, self.error = None, FinishReason.ERROR, error
        self.embedding_bytes = self.prompt_tokens = None


@pytest.mark.parametrize("side", [EngineClient, WorkerSideClient], ids=["client-side", "worker-side"])
@pytest.mark.parametrize("path, fields, param, says", [
    ("/v1/embeddings", {"input": ["north", "east", "north up east down"]}, "input",
     "input[2] (4 tokens) exceeds the 3 tokens this model embeds at most (the model's own limit, or a lower "
     "--max-model-len); shorten it or split it into several inputs"),
    ("/v1/embeddings", {"input": [[0], [1, 2, 3, 0]]}, "input",
     "input[1] (4 tokens) exceeds the 3 tokens this model embeds at most"),
    ("/v1/embeddings", {"input": [[0], [1], [9]]}, "input", "input[2] contains token id 9, outside the model's "
     "vocabulary [0, 4)"),
    ("/v1/embeddings", {"input": [[0], [-1]]}, "input", "input[1] contains negative token id -1"),
    ("/v1/embeddings", {"input": ["north", "  "]}, "input", "input[1]: the tokenised prompt must not be empty"),
    ("/v1/embeddings", {"input": [9]}, "input", "input contains token id 9, outside"),  # (one list: "input")
    ("/v1/embeddings", {"input": "north up east down"}, "input", "input (4 tokens) exceeds the 3 tokens this model embeds at most"),
    ("/v1/rerank", {"query": "north", "documents": ["east", "north up east down"]}, "documents",
     "documents[1] (4 tokens) exceeds the 3 tokens this model embeds at most"),
    ("/v1/rerank", {"query": "north up east down", "documents": ["east"]}, "query",
     "query (4 tokens) exceeds the 3 tokens this model embeds at most"),
    ("/v1/rerank", {"query": "north", "documents": ["east", "  "]}, "documents",
     "documents[1]: the tokenised prompt must not be empty"),
    ("/v1/rerank", {"query": " ", "documents": ["east"]}, "query", "query: the tokenised prompt must not be empty"),
])
def test_an_error_about_one_entry_names_its_index(side, path, fields, param, says):
    """The over-length message said "input (N tokens)" for any entry of a list: which one was
    left to guess. Either side's refusal (the client's for token ids, the worker's for text) names it,
    with the same code: ``context_length_exceeded``, else ``invalid_value`` (the worker's was
    ``bad_request``, its wire code, where the client's was ``invalid_value`` for the same check)."""
    link = Link()
    link.client.stop()
    link.client = side()
    endpoints = EmbeddingEndpoints(link, Drain(), 1 << 20, GatewayMetrics())
    app = Starlette(routes=[Route("/v1/embeddings", endpoints.embeddings, methods=["POST"]),
                            Route("/v1/rerank", endpoints.rerank, methods=["POST"])])
    try:
        with TestClient(app) as http:
            e = error_of(http.post(path, json={"model": "m", **fields}), 400)
    finally:
        link.client.stop()
    assert e["param"] == param and e["message"].startswith(says), e
    assert e["code"] == ("context_length_exceeded" if "embeds at most" in says else "invalid_value"), e
    assert e["type"] == "invalid_request_error"


def test_rerank_orders_by_cosine_similarity(http):
    body = {"model": "m", "query": "north", "documents": ["east", "up", "down", "north"]}
    r = http.post("/v1/rerank", json=body).json()
    assert [x["index"] for x in r["results"]] == [3, 1, 0, 2]
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx([1.0, 0.8, 0.0, -1.0])
    assert r["results"][0]["document"] == {"text": "north"} and r["usage"] == {"total_tokens": 5}
    top = http.post("/v1/rerank", json={**body, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == [3, 1] and "document" not in top["results"][0]
    for bad, param in (({"top_n": 0}, "top_n"), ({"query": ""}, "query"), ({"documents": []}, "documents"),
                       ({"documents": ["north", 3]}, "documents"), ({"query": "north up east down"}, "query"),
                       ({"documents": ["north", "up up up up"]}, "documents")):
        assert error_of(http.post("/v1/rerank", json={**body, **bad}), 400)["param"] == param
    e = error_of(http.post("/v1/rerank", json={**body, "top_n": -int("9" * 300)}), 400)  # (was echoed whole)
    assert e["param"] == "top_n" and e["message"].endswith("9" * 100 + "… (301 characters)"), e


class GeneratingLink:
    """A stand-in link to one generation model, ``g``: its info has no embedding size, and its client
    refuses an embedding at submission as the SDK does (:class:`protocol.request.ModelLimits`)."""

    def __init__(self) -> None:
        from protocol.request import ModelLimits, RequestKind, RequestParams

        limits = ModelLimits(4, 3, True, embeds=False)

        class Refusing:
            def embed(self, prompt, callback):
                limits.check(RequestParams(prompt, 1, kind=RequestKind.EMBED))

        self.client = Refusing()

    async def client_for(self, model: str):
        return self.client

    def model_info(self, model: str) -> ModelInfo:
        return ModelInfo(vocab_size=4, max_seq_len=3, has_tokenizer=True)


@pytest.mark.parametrize("dimensions", [None, 0, 2, 384])
def test_dimensions_for_a_generation_model_get_its_kinds_refusal(dimensions):
    # was, with dimensions: 'dimensions 0: model `g` gives embeddings of None values and is no Matryoshka model ...'
    endpoints = EmbeddingEndpoints(GeneratingLink(), Drain(), 1 << 20, METRICS)
    app = Starlette(routes=[Route("/v1/embeddings", endpoints.embeddings, methods=["POST"])])
    with TestClient(app) as client:
        body = {"model": "g", "input": "up", **({} if dimensions is None else {"dimensions": dimensions})}
        e = error_of(client.post("/v1/embeddings", json=body), 400)
    assert e["code"] == "unsupported" and e["param"] == "model", e
    assert e["message"].startswith("model names a model that generates text and gives no embeddings") and \
        "None" not in e["message"]


def test_dimensions_before_the_model_is_known_say_so():
    from gateway.embeddings import _dimensions
    from gateway.errors import APIError

    with pytest.raises(APIError) as caught:
        _dimensions(2, None, "m")
    assert caught.value.param == "dimensions" and "not known yet" in caught.value.message
    assert "None" not in caught.value.message


class HeldClient:
    """A stand-in client whose embeddings do not end (a long batch on the worker) until :meth:`release`:
    ``embed`` hands out open handles; ``cancel`` notes the id."""

    def __init__(self) -> None:
        self.cancelled: list = []
        self.held: list = []

    @property
    def submitted(self) -> int:
        return len(self.held)

    def embed(self, prompt, callback):
        handle = RefusedHandle(None)
        handle.request_id, handle.finish_reason = len(self.held) + 1, None
        self.held.append((handle, callback))
        return handle

    def cancel(self, request_id) -> bool:
        self.cancelled.append(request_id)
        return True

    def release(self) -> None:
        """End every request held (``stop``, a vector each), as the worker would."""
        for handle, callback in self.held:
            handle.embedding_bytes, handle.prompt_tokens, handle.finish_reason = pack([1.0, 0, 0, 0]), 1, \
                FinishReason.STOP
            callback([])


@pytest.mark.parametrize("path, fields", [("/v1/embeddings", {"input": ["north", "up"]}),
                                          ("/v1/rerank", {"query": "north", "documents": ["up"]})])
def test_a_drain_waits_for_an_embedding_request_and_ends_it_with_503(path, fields):
    """An embeddings or rerank request in flight is in the drain's registry, as a generation request
    is: the drain counts it (and waits for it), and ending it answers 503 with the drain's message and
    cancels its requests. A break-it pass: a rerank in flight when ``slotserve up`` got SIGTERM was not
    counted, so the gateway stopped at once; uvicorn cancelled it 2 s later, logging "Exception in ASGI
    application" with a traceback, and its client lost the connection with no answer."""
    from tests.support.gateway import wait_until

    link = Link()
    link.client.stop()
    link.client = HeldClient()
    drain = Drain()
    endpoints = EmbeddingEndpoints(link, drain, 1 << 20, GatewayMetrics())
    app = Starlette(routes=[Route(path, endpoints.embeddings if path == "/v1/embeddings" else endpoints.rerank,
                                  methods=["POST"])])
    answers: list = []
    with TestClient(app) as http:
        asking = threading.Thread(target=lambda: answers.append(http.post(path, json={"model": "m", **fields})))
        asking.start()
        try:
            wait_until(lambda: link.client.submitted == 2, 10, "the request's embeddings submitted")
            assert drain.in_flight == 1, "the request in flight is not in the drain's registry"
            assert http.portal.call(drain.begin) == 1
            refused = error_of(http.post(path, json={"model": "m", **fields}), 503)  # a new one, while draining
            assert "takes no new requests" in refused["message"]
            assert http.portal.call(drain.end_all, "the gateway is stopping: test") == 1
            asking.join(10)
        finally:
            link.client.release()  # (a request the drain failed to end ends now: the test fails, not hangs)
            asking.join(10)
    e = error_of(answers[0], 503)
    assert e["message"] == "the gateway is stopping: test" and e["code"] == "unavailable", e
    assert answers[0].headers["connection"] == "close" and sorted(link.client.cancelled) == [1, 2]
    assert drain.in_flight == 0
