"""Prometheus metrics of the gateway (prometheus-client, its own registry), served at ``/metrics``.

- ``slotserve_http_requests_total{endpoint, status}``: requests answered on the model routes
  (completions, chat, responses, messages, llama.cpp's completion and infill, embeddings, rerank),
  by endpoint path and status code (``499``: the client disconnected first); not ``/tokenize``,
  ``/health``, ``/metrics``, ``/v1/models``, ``/props``, nor a request refused before its route (401, 404).
- ``slotserve_http_requests_in_flight``: HTTP requests being handled now.
- ``slotserve_http_ttft_seconds{endpoint}``: arrival of the HTTP request to
  its first generated token (streamed or not).
- ``slotserve_http_request_latency_seconds{endpoint}``: arrival to the end of
  the generation (end to end, as the gateway sees it).
- ``slotserve_http_prompt_tokens_total{model}`` / ``slotserve_http_completion_tokens_total{model}``:
  tokens in the ``usage`` the gateway reported (completion tokens also when
  ``usage`` was null because a prompt's length was unknown; embeddings and
  rerank count their inputs' tokens as prompt tokens).
- ``slotserve_http_cached_tokens_total{model}``: of those prompt tokens, the ones
  reported as ``usage.prompt_tokens_details.cached_tokens`` (taken from a worker's
  prefix cache); the broker's ``slotserve_prefix_cache_*`` series count per worker.
- ``slotserve_model_loaded{model}``: with models on demand (``slotserve up`` with several models),
  1 while the model is loaded, 0 while it is loading, unloading or unloaded (set at each scrape from
  the broker's status, as ``/v1/models`` says them; a model ``/v1/models`` no longer lists has no
  series).
- ``slotserve_model_state{model, state}``: alike, 1 for the model's state now and 0 for the others
  (``unloaded``, ``loading``, ``loaded``, ``unloading``: :class:`~protocol.enums.ModelState`), so that a
  load or an unload shows from the moment it is accepted.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.enums import ModelState

_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """The gateway's metrics; :meth:`render` gives the Prometheus text format."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("slotserve_http_requests", "Requests answered on the model routes (generation, "
                                "embeddings, rerank; not /tokenize, /health, nor a 401 or 404 before a route)",
                                ["endpoint", "status"],
                                registry=r)
        self.in_flight = Gauge("slotserve_http_requests_in_flight", "HTTP requests being handled", registry=r)
        self.ttft = Histogram("slotserve_http_ttft_seconds", "HTTP request arrival to first generated token",
                              ["endpoint"], buckets=_BUCKETS_S, registry=r)
        self.latency = Histogram("slotserve_http_request_latency_seconds",
                                 "HTTP request arrival to the end of generation", ["endpoint"],
                                 buckets=_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("slotserve_http_prompt_tokens", "Prompt tokens reported in usage", ["model"],
                                     registry=r)
        self.completion_tokens = Counter("slotserve_http_completion_tokens",
                                         "Completion tokens reported in usage", ["model"], registry=r)
        self.cached_tokens = Counter("slotserve_http_cached_tokens",
                                     "Prompt tokens reported as cached in usage (prompt_tokens_details)", ["model"],
                                     registry=r)

        self.model_loaded = Gauge("slotserve_model_loaded",
                                  "1 while a worker serves the model (models on demand), else 0", ["model"], registry=r)
        self.model_state = Gauge("slotserve_model_state",
                                 "1 for the model's state now (models on demand: unloaded, loading, loaded, "
                                 "unloading), 0 for the others", ["model", "state"], registry=r)
        self._children: dict[tuple, object] = {}

    def set_model_states(self, states: dict[str, str]) -> None:
        """``slotserve_model_loaded`` and ``slotserve_model_state`` from ``{model: state}`` (a
        :class:`~protocol.enums.ModelState` value): a model no longer listed (one whose first worker
        failed to load it, or whose workers all left) loses its series, rather than keeping the last
        value it had (a 1 for a model no worker serves)."""
        for model, state in states.items():
            self._child(self.model_loaded, model).set(1 if state == "loaded" else 0)
            for s in ModelState:
                self._child(self.model_state, model, s.value).set(1 if state == s.value else 0)
        for key in [k for k in self._children if k[0] in (id(self.model_loaded), id(self.model_state))
                    and k[1] not in states]:
            (self.model_loaded if key[0] == id(self.model_loaded) else self.model_state).remove(*key[1:])
            del self._children[key]

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, cached (labels() takes a lock and builds a key each call)."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def observe(self, endpoint: str, status: int, ttft_s: float | None = None, latency_s: float | None = None,
                model: str | None = None, prompt_tokens: int | None = None,
                completion_tokens: int | None = None, cached_tokens: int | None = None) -> None:
        """Record one answered HTTP request (token counts: None when not known)."""
        self._child(self.requests, endpoint, str(status)).inc()
        if ttft_s is not None:
            self._child(self.ttft, endpoint).observe(ttft_s)
        if latency_s is not None:
            self._child(self.latency, endpoint).observe(latency_s)
        if model is not None:
            if prompt_tokens is not None:
                self._child(self.prompt_tokens, model).inc(prompt_tokens)
                if cached_tokens:
                    self._child(self.cached_tokens, model).inc(cached_tokens)
            if completion_tokens is not None:
                self._child(self.completion_tokens, model).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
