"""Shapes other servers' clients send that were not served:

- rerank documents as Jina's and Cohere's objects, ``{"text": ...}``: a 400 ("documents must be a
  non-empty list of non-empty strings"); now ranked as their texts, another key named;
- the ``anthropic`` SDK's ``SystemMessageParam`` (``{"role": "system", "content"}`` inside
  ``messages``, a string or text blocks: its ``MessageParam`` union holds it): a 400 ("a message's
  role must be user or assistant"); now a system message in place, after the top-level ``system``;
- ``GET /models``, llama.cpp's server's other path for its list: a 404 naming ``GET /v1/models``; now
  the same body, behind the same API keys;
- ``/props`` said ``is_sleeping: true`` for a model ``unloading`` whose workers still serve it (the
  broker's on-demand state, :mod:`broker.demand`, from the moment the unload is accepted); now it is
  awake until its last worker has left.

Over the gateway's handlers with scripted broker clients and given statuses: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.drain import Drain  # noqa: E402
from gateway.llama_props import PropsEndpoint  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from protocol.enums import ModelState  # noqa: E402
from protocol.messages import DemandState  # noqa: E402
from tests.gateway.test_embeddings_shapes import http as embeddings_http  # noqa: E402,F401
from tests.gateway.test_error_field_names import BODIES, routes_app  # noqa: E402
from tests.support.gateway import GivenStatusLink, error_of, model_status  # noqa: E402
from tests.support.scripted import ScriptedClient, letters  # noqa: E402

QUERY = "north"
TEXTS = ["east", "up", "down", "north"]


@pytest.mark.parametrize("path", ["/v1/rerank"])
@pytest.mark.parametrize("documents", [[{"text": t} for t in TEXTS],
                                       [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2], {"text": TEXTS[3]}]],
                         ids=["objects", "mixed"])
def test_rerank_takes_documents_as_text_objects(embeddings_http, path, documents):  # noqa: F811
    plain = embeddings_http.post(path, json={"model": "m", "query": QUERY, "documents": TEXTS}).json()
    r = embeddings_http.post(path, json={"model": "m", "query": QUERY, "documents": documents})
    assert r.status_code == 200, r.text  # (was "documents must be a non-empty list of non-empty strings")
    assert r.json()["results"] == plain["results"] and r.json()["usage"] == plain["usage"]
    assert r.json()["results"][0]["document"] == {"text": "north"}


@pytest.mark.parametrize("document, says", [
    ({"text": "a", "image": "b"}, "documents[1] takes text alone"),
    ({"image": "b"}, "documents[1] takes text alone"),
    ({"text": 5}, "documents[1].text must be a string, got 5"),
    ({}, "documents[1].text must be a string, got null"),
    ({"text": ""}, "documents[1] must not be empty"),
    (5, "documents must be a non-empty list of documents, each a non-empty string or {\"text\": string}; "
        "documents[1] is 5"),
    ("", "documents[1] must not be empty"),
])
def test_a_document_of_another_shape_is_named(embeddings_http, document, says):  # noqa: F811
    r = embeddings_http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": ["east", document]})
    e = error_of(r, 400)
    assert e["param"] == "documents" and e["message"].startswith(says), e


@pytest.fixture
def messages_http_app():
    client = ScriptedClient()
    with TestClient(routes_app(client)) as http:
        http.scripted = client
        yield http
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("content", ["be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]],
                         ids=["string", "blocks"])
def test_the_anthropic_sdks_system_message_is_a_system_message_in_place(messages_http_app, content):
    body = {**BODIES["/v1/messages"], "system": "top", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "system", "content": content}, {"role": "user", "content": "and?"}]}
    r = messages_http_app.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text  # (was "a message's role must be user or assistant")
    prompt = messages_http_app.scripted.submitted[-1].prompt
    assert [(m.role, m.content) for m in prompt] == [("system", "top"), ("user", "hi"), ("assistant", "hello"),
                                                      ("system", "be brief"), ("user", "and?")]


@pytest.mark.parametrize("message, says", [
    ({"role": "system", "content": ""}, "messages.0.content: all messages must have non-empty content"),
    ({"role": "system", "content": [{"type": "image", "source": {}}]}, "'messages.0.content.0.type' is not supported"),
    ({"role": "system", "content": "x", "name": "a"}, "messages.0.name: Extra inputs are not permitted"),
    ({"role": "developer", "content": "x"}, "messages.0.role: a message's role must be user, assistant or system"),
])
def test_a_system_message_is_held_to_the_rules_of_text(messages_http_app, message, says):
    body = {**BODIES["/v1/messages"], "messages": [message, {"role": "user", "content": "hi"}]}
    r = messages_http_app.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), r.text


def test_get_models_is_llama_cpps_path_for_the_same_list():
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    app = create_app(GatewayConfig(broker="tcp://127.0.0.1:1", api_keys=("k",)))  # (no lifespan: no link)
    with TestClient(app) as http:
        assert http.get("/models").status_code == 401  # (behind the keys, as /v1/models is)
    routes = {r.path: r.endpoint for r in app.routes if isinstance(r, Route)}
    assert routes["/models"] == routes["/v1/models"]  # (the same handler: the same body, drain and errors)


def test_get_models_answers_the_v1_models_body():
    from gateway.app import ServiceEndpoints
    from gateway.metrics import GatewayMetrics

    link = GivenStatusLink()
    link.show({"m": model_status(workers=1)})
    service = ServiceEndpoints(link, GatewayMetrics(), Drain())
    app = Starlette(routes=[Route("/v1/models", service.models), Route("/models", service.models)])
    with TestClient(app) as http:
        one, other = http.get("/v1/models"), http.get("/models")
    assert one.status_code == other.status_code == 200, other.text
    assert [m["id"] for m in other.json()["data"]] == ["m"] and other.json()["object"] == "list"
    assert [m["id"] for m in one.json()["data"]] == [m["id"] for m in other.json()["data"]]


def _props(state: ModelState | None, workers: int, loading: int = 0) -> dict:
    link = GivenStatusLink(on_demand=("m", "n"))
    link.show({"m": model_status(workers=workers, loading=loading), "n": model_status(workers=1)},
              on_demand={} if state is None else {"m": DemandState(state)})
    app = Starlette(routes=[Route("/props", PropsEndpoint(link, Tokenizers(letters), Drain()).props)])
    with TestClient(app) as http:
        r = http.get("/props?model=m")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("state, workers, loading, sleeping", [
    (ModelState.UNLOADING, 1, 0, False),  # (was true: its worker still serves)
    (ModelState.UNLOADING, 0, 0, True),   # (its last worker has left)
    (ModelState.LOADED, 1, 0, False),
    (ModelState.LOADING, 0, 1, True),
    (ModelState.UNLOADED, 0, 0, True),
    (None, 1, 0, False),                  # (before the supervisor spoke: the workers say)
])
def test_props_is_awake_while_a_worker_serves_the_model(state, workers, loading, sleeping):
    out = _props(state, workers, loading)
    assert out["is_sleeping"] is sleeping, out
    assert out["total_slots"] == 4 * workers
