"""The ASGI app (Starlette): OpenAI's endpoints over one shared broker link.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: generation
  (:mod:`gateway.generate`), plain or streamed as server-sent events.
- ``POST /v1/responses`` (``GET`` / ``DELETE /v1/responses/{id}``): OpenAI's Responses API
  (:mod:`gateway.responses_api`); ``POST /v1/messages`` and ``/v1/messages/count_tokens``:
  Anthropic's Messages API (:mod:`gateway.messages_api`); both translations onto the chat path.
- ``POST /infill``: code infilling in llama.cpp's shape (:mod:`gateway.infill`); ``POST /completion``
  (and ``/completions``): llama.cpp's native completion (:mod:`gateway.llama_completion`); ``GET /props``:
  llama.cpp's server properties of a model (:mod:`gateway.llama_props`).
- ``POST /v1/embeddings``, ``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``): embeddings and
  bi-encoder reranking with an embedding model (:mod:`gateway.embeddings`).
- ``POST /tokenize``, ``POST /detokenize``: vLLM's tokenizer endpoints
  (:mod:`gateway.tokenize`), with the model's tokenizer (:mod:`gateway.tokenizer`).
- ``GET /v1/models``: models with a worker now, and those whose first worker is loading
  (``"status": {"value": "loading"}``; every model says its state where some load on demand);
  ``GET /v1/models/{model}``: one of them, by any name listed; ``GET /models``, llama.cpp's path, the same
  list as ``GET /v1/models``.
  ``GET /health``: 200 when the
  broker answers and some worker serves a model, else 503. ``GET /metrics``:
  Prometheus text (:mod:`gateway.metrics`).
- Anything else: 404 / 405 in OpenAI's error shape; the 404 of a route of llama.cpp's or Ollama's own
  API names the route to call here (:mod:`gateway.foreign_routes`).

With ``config.api_keys`` every ``/v1/*`` request (and ``/tokenize``, ``/detokenize``, llama.cpp's routes) needs
one of them as ``Authorization: Bearer KEY``, and with ``config.metrics_api_keys``
``/metrics`` too (:mod:`gateway.auth`); ``/health`` is always open.

While the gateway stops, ``app.state.drain`` (:mod:`gateway.drain`) is
draining: every route but ``/health`` and ``/metrics`` answers a new request 503 (``Retry-After``,
``Connection: close``) and keeps one in flight in the drain until it is answered -- generation and
embeddings by themselves, the others through :class:`gateway.drain_gate.DrainGate` --; ``/health``
answers 503 ``{"status": "draining"}``, ``/metrics`` stays as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from gateway.auth import APIKeys
from gateway.config import GatewayConfig
from gateway.drain import REFUSED, Drain
from gateway.drain_gate import DrainGate
from gateway.embeddings import EmbeddingEndpoints
from gateway.errors import APIError, shutting_down
from gateway.foreign_routes import instead
from gateway.generate import Generate
from gateway.infill import InfillEndpoint
from gateway.llama_completion import LlamaCompletionEndpoint
from gateway.llama_props import PropsEndpoint
from gateway.link import BrokerConnections, listing_order
from gateway.messages_api import MessagesEndpoints
from gateway.metrics import GatewayMetrics
from gateway.model_control import ModelControl
from gateway.responses import error_response, json_response
from gateway.responses_api import ResponsesEndpoints
from gateway.response_store import ResponseStore
from gateway.tokenize import TokenizeEndpoints
from gateway.tokenizer import Loader, Tokenizers
from protocol.messages import Status

log = logging.getLogger(__name__)


class ServiceEndpoints:
    """The endpoints that generate nothing: models, health, metrics."""

    def __init__(self, link: BrokerConnections, metrics: GatewayMetrics, drain: Drain) -> None:
        self.link = link
        self.metrics = metrics
        self.drain = drain

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: ``{"object": "list", "data": [model, ...]}`` (:meth:`_listing`)."""
        try:
            data, _ = await self._listing()
        except APIError as e:
            return error_response(e)
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (OpenAI's retrieve, the SDK's ``client.models.retrieve``, as
        Ollama serves it): the entry ``GET /v1/models`` lists under that name, any name it lists (a
        primary name or an alias, ``/`` included, served, loading or on demand); another name is
        the 404 ``model_not_found`` every route answers, and draining the 503 of ``/v1/models``."""
        name = request.path_params["model"]
        try:
            data, st = await self._listing()
        except APIError as e:
            return error_response(e)
        for entry in data:
            if entry["id"] == name:
                return json_response(entry)
        return error_response(self.link.model_not_found(name, st))

    async def _listing(self) -> tuple[list[dict], Status]:
        """The models a request may name, in ``GET /v1/models``'s order (each primary name, then its
        aliases), each ``{"id", "object": "model", "created", "owned_by"}`` with its ``status``
        where some model loads on demand or it is not loaded, its ``max_model_len`` (tokens) and
        ``runs`` where its workers said them; and the broker status they come from. Raises
        :class:`APIError`: 503 while draining or when no broker answers."""
        if self.drain.draining:
            raise shutting_down(REFUSED)
        st = await self.link.refresh()
        data = []
        states = self.link.model_states(st)
        for name in listing_order(states, self.link.aliases(st)):
            info = self.link.model_info(name)
            entry = {"id": name, "object": "model", "created": self.link.started_s, "owned_by": "slotserve"}
            # llama.cpp's router mode says each model's state; elsewhere a model says it only while its
            # first worker loads (the 404 lists it as loading: a model named here is not unknown)
            if self.link.config.on_demand_models or states[name] != "loaded":
                entry["status"] = _status_entry(states[name], self.link.demand_state(name, st))
            if info is not None and info.max_seq_len is not None:
                entry["max_model_len"] = info.max_seq_len
            if info is not None and info.runs:
                entry["runs"] = info.runs  # precision and kernels (a field of slotserve's own)
            data.append(entry)
        return data, st

    async def health(self, request: Request) -> Response:
        if self.drain.draining:  # a load balancer's probe: send new work elsewhere
            e = shutting_down("the gateway is shutting down (draining the requests in flight)")
            return json_response({"status": "draining", "reason": e.message}, 503, e.headers)
        if not self.link.broker_ok:  # the last poll (each status_interval_s) got no answer: say so at once
            return json_response({"status": "unavailable", "reason": self.link.no_broker().message}, 503)
        try:
            st = await self.link.refresh()
        except APIError as e:
            return json_response({"status": "unavailable", "reason": e.message}, 503)
        served = self.link.served(st)
        on_demand = list(self.link.config.on_demand_models)
        if not served and not on_demand:
            return json_response({"status": "unavailable", "reason": "the broker answers but no worker serves a model"},
                                 503)
        if not on_demand:
            return json_response({"status": "ok", "models": served})
        # models loaded on a request's demand: ready with none loaded, as llama.cpp's router and Ollama are
        # (else a readiness probe would never send the request that loads one)
        return json_response({"status": "ok", "models": served, "on_demand": on_demand})

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.link.config.on_demand_models:
            if self.link.broker_ok:  # (a fresh status, as /v1/models reads: a state changes at once)
                try:
                    await self.link.refresh()
                except APIError:
                    pass  # the last status, then
            self.metrics.set_model_states(self.link.model_states())
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


def _status_entry(state: str, demand) -> dict:
    """A ``GET /v1/models`` entry's ``status``, llama.cpp's router's: ``{"value": state}``, and for a
    model on demand whose last load failed (``demand``: its :class:`~protocol.messages.DemandState`,
    None for another model) ``"failed": true`` with the worker's ``"exit_code"`` where there was a
    process (llama.cpp's) and ``"reason"`` (slotserve's own: what went wrong, in words)."""
    entry: dict = {"value": state}
    if demand is not None and demand.failed and state == "unloaded":
        entry["failed"] = True
        if demand.exit_code is not None:
            entry["exit_code"] = demand.exit_code
        if demand.reason:
            entry["reason"] = demand.reason
    return entry


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 in OpenAI's shape, with the headers it gave them; a 405's ``Allow`` lists
    the methods of every route at the path (RFC 9110 section 15.5.6: a 405 must say them; Starlette
    names the first route's only, and the exception's headers were dropped: no ``Allow`` at all)."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if exc.status_code == 404 and (words := instead(request.url.path)) is not None:
        message += f" ({words})"  # a route of llama.cpp's or Ollama's own API: the one to call here
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    return error_response(APIError(exc.status_code, message, headers=headers,
                                   code="not_found" if exc.status_code == 404 else "method_not_allowed"))


def allowed_methods(request: Request) -> list[str]:
    """The methods the app's routes take at ``request``'s path, in the routes' order (GET's HEAD with it)."""
    methods: dict[str, None] = {}
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] != Match.NONE:
            methods.update(dict.fromkeys(sorted(route.methods, key=lambda m: (m == "HEAD", m))))
    return list(methods)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("gateway handler failed", exc_info=exc)
    return error_response(APIError(500, f"internal gateway error: {type(exc).__name__}", code="internal"))


async def _prefetch_tokenizers(link: BrokerConnections, tokenizers: Tokenizers, interval_s: float) -> None:
    """Load the tokenizers in the background as soon as their models are known: the one of
    ``--tokenizer`` at once, else each served model's as the broker's status first lists it."""
    if tokenizers.name is not None:
        tokenizers.prefetch(tokenizers.name)
        return
    while True:
        st = link.status
        if st is not None:
            for name, m in st.models.items():
                if m.workers > 0:
                    tokenizers.prefetch(name)
        await asyncio.sleep(interval_s)


def create_app(config: GatewayConfig, load_tokenizer: Loader | None = None) -> Starlette:
    """The gateway's ASGI app. Its lifespan connects to ``config.broker``
    (retrying in the background) and closes the connections at shutdown.
    ``app.state.drain`` is its :class:`~gateway.drain.Drain`, for the server that stops it.

    ``load_tokenizer(name) -> Tokenizer | None``: the CLI's tokenizer loader
    (:mod:`gateway.tokenizer`; ``name`` is ``config.tokenizer``, else each
    served model's name), run on a thread in the background from the start;
    None: no tokenizer (token strings ``"token_id:N"``, ``/tokenize`` 400). ``POST /models/load`` and
    ``/models/unload`` reach the supervisor of the models on demand through the broker
    (:mod:`gateway.model_control`)."""
    link = BrokerConnections(config)
    metrics = GatewayMetrics()
    drain = Drain()
    tokenizers = Tokenizers(load_tokenizer, config.tokenizer, names_of=link.names_of)
    generate = Generate(config, link, metrics, drain, tokenizers)
    service = ServiceEndpoints(link, metrics, drain)
    tokenize = TokenizeEndpoints(link, tokenizers, config.max_body_bytes)
    responses = ResponsesEndpoints(generate, ResponseStore(config.responses_store_max,
                                                           config.responses_store_max_age_s))
    messages = MessagesEndpoints(generate, tokenize)
    control = ModelControl(link, config.max_body_bytes)
    embeddings = EmbeddingEndpoints(link, drain, config.max_body_bytes, metrics)
    llama = LlamaCompletionEndpoint(generate)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await link.start()
        prefetch = None
        if load_tokenizer is not None:
            prefetch = asyncio.create_task(_prefetch_tokenizers(link, tokenizers, config.status_interval_s))
        try:
            yield
        finally:
            if prefetch is not None:
                prefetch.cancel()
            await link.close()

    drained = [  # (the routes that take part in the drain themselves: in its registry from start to end)
        Route("/v1/completions", generate.completions, methods=["POST"]),
        Route("/v1/chat/completions", generate.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/infill", InfillEndpoint(generate).infill, methods=["POST"]),
        *(Route(path, llama.handle, methods=["POST"]) for path in ("/completion", "/completions")),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        *(Route(path, embeddings.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
    ]
    routes = drained + [  # (the others are taken into the drain by DrainGate)
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/props", PropsEndpoint(link, tokenizers, drain).props, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/models", service.models, methods=["GET"]),  # (llama.cpp's server lists its models at both)
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/models/load", control.load, methods=["POST"]),
        Route("/models/unload", control.unload, methods=["POST"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_endpoint, methods=["GET"]),
    ]
    middleware = []
    if config.allowed_origins:  # (outside the key check: a preflight carries no key)
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                                     allow_methods=list(config.allowed_methods),
                                     allow_headers=list(config.allowed_headers)))
    if config.api_keys or config.metrics_api_keys:  # no keys: no per-request check at all
        middleware.append(Middleware(APIKeys, api_keys=config.api_keys, metrics_api_keys=config.metrics_api_keys))
    # (inside the key check: a caller without a key learns nothing, draining or not)
    middleware.append(Middleware(DrainGate, drain=drain, own=frozenset(r.path for r in drained)))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.link = link
    app.state.drain = drain
    return app
