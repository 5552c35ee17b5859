"""Prometheus metrics for the broker (prometheus-client, its own registry).

Exported on ``http://<metrics_host>:<metrics_port>/metrics`` when
``BrokerConfig.metrics_port`` is set. The broker loop updates the metrics on
each housekeeping tick from :class:`~broker.core.BrokerCore`'s state; the
HTTP thread only reads them (prometheus-client's metrics are thread-safe).

- ``slotserve_queue_depth{model}``: requests waiting in the broker.
- ``slotserve_slots_busy{model}`` / ``slotserve_slots_total{model}``: slots
  holding a request / registered, over that model's workers.
- ``slotserve_workers{model}``: registered workers.
  (These four for each model of the broker's ``status``: a name it no longer lists -- requests queued
  under an alias before its worker announced it, which then joined its model's queue -- has none.)
- ``slotserve_requests_total{event}``: submitted, completed, cancelled,
  deadline, errors, queue_full, requeued, duplicates (monotonic).
- ``slotserve_tokens_total``: generated tokens routed to clients.
- ``slotserve_workers_lost_total``: workers that died or hung.
- ``slotserve_workers_left_total``: workers that left cleanly (stopped, drained, a
  model unloaded on demand), not an alert.
- ``slotserve_ttft_seconds`` / ``slotserve_request_latency_seconds``: time to
  first token and end-to-end latency as the broker sees them (arrival of the
  submit to the routing of the first token / the ending).
- ``slotserve_prefix_cache_queries_total{model, worker}`` /
  ``slotserve_prefix_cache_hits_total{model, worker}``: tokens looked up in a
  worker's prefix cache / found there (vLLM's ``prefix_cache_queries`` and
  ``prefix_cache_hits``; hit rate = hits / queries), as the worker counts them
  since it started (its heartbeats report them, so they follow a worker within
  a heartbeat interval; a restarted worker starts again from 0, a counter reset).
- ``slotserve_prefix_cache_used_bytes{model, worker}`` /
  ``slotserve_prefix_cache_budget_bytes{model, worker}``: bytes of the blocks a
  worker's prefix cache holds / its budget. Workers without a prefix cache
  have none of these four series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from broker.core import BrokerCore
from protocol.endpoints import bind_error
from protocol.messages import PrefixCacheUsage, Status

_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_EVENTS = ("submitted", "completed", "cancelled", "deadline", "errors", "queue_full", "requeued", "duplicates")


class BrokerMetrics:
    """The broker's metrics and their HTTP endpoint. Call :meth:`update` from the
    broker loop; :meth:`close` stops the endpoint. Raises
    :class:`~protocol.endpoints.BindError` when ``host:port`` cannot be bound."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("slotserve_queue_depth", "Requests waiting in the broker", ["model"], registry=r)
        self.slots_busy = Gauge("slotserve_slots_busy", "Slots holding a request", ["model"], registry=r)
        self.slots_total = Gauge("slotserve_slots_total", "Slots registered", ["model"], registry=r)
        self.workers = Gauge("slotserve_workers", "Registered workers", ["model"], registry=r)
        self.requests = Counter("slotserve_requests", "Request events since broker start", ["event"], registry=r)
        self.tokens = Counter("slotserve_tokens", "Generated tokens routed to clients", registry=r)
        self.workers_lost = Counter("slotserve_workers_lost", "Workers that died or hung", registry=r)
        self.workers_left = Counter("slotserve_workers_left", "Workers that left cleanly (stopped, drained, unloaded)",
                                    registry=r)
        self.ttft = Histogram("slotserve_ttft_seconds", "Time to first token seen by the broker",
                              buckets=_BUCKETS_S, registry=r)
        self.latency = Histogram("slotserve_request_latency_seconds", "Submit to ending, seen by the broker",
                                 buckets=_BUCKETS_S, registry=r)
        self._last = {}
        self._models: set[str] = set()  # the models with series (the last status's)
        self.prefix_caches = PrefixCacheCollector()
        r.register(self.prefix_caches)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=r)
        except OSError as e:  # taken, or a host not this machine's (socket.gaierror for a name)
            raise bind_error("the broker's metrics endpoint (--metrics-port)", f"{host}:{port}", e.errno,
                             e.strerror or str(e)) from None
        self.port = self._server.server_port

    def update(self, core: BrokerCore, now: float) -> None:
        st = core.status(now)
        for name, m in st.models.items():
            self.queue_depth.labels(name).set(m.queued)
            self.slots_busy.labels(name).set(m.slots_busy)
            self.slots_total.labels(name).set(m.slots_total)
            self.workers.labels(name).set(m.workers)
        for name in self._models.difference(st.models):  # (a name no longer listed: an alias's queue merged)
            for gauge in (self.queue_depth, self.slots_busy, self.slots_total, self.workers):
                gauge.remove(name)
        self._models = set(st.models)
        c = st.counters
        for event in _EVENTS:
            self.requests.labels(event).inc(c[event] - self._last.get(event, 0))
        self.tokens.inc(c["tokens_out"] - self._last.get("tokens_out", 0))
        self.workers_lost.inc(c["workers_lost"] - self._last.get("workers_lost", 0))
        self.workers_left.inc(c["workers_left"] - self._last.get("workers_left", 0))
        self._last = dict(c)
        for v in core.take_timings("ttft"):
            self.ttft.observe(v)
        for v in core.take_timings("latency"):
            self.latency.observe(v)
        self.prefix_caches.update(st)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PrefixCacheCollector:
    """The workers' prefix-cache series (see the module docstring), from the latest
    ``status`` snapshot: the workers report cumulative counts, which are exposed as they
    are (a ``Counter`` would need the deltas); a worker that left has no series."""

    def __init__(self) -> None:
        self._caches: dict[tuple[str, str], PrefixCacheUsage] = {}  # replaced whole: read by the HTTP thread

    def update(self, st: Status) -> None:
        caches: dict[tuple[str, str], PrefixCacheUsage] = {}
        for w in st.workers:
            if w.prefix_cache is not None:
                key = (w.model, w.name)
                old = caches.get(key)  # (two workers of one name: one series, their sums)
                caches[key] = w.prefix_cache if old is None else PrefixCacheUsage(*map(sum, zip(old, w.prefix_cache)))
        self._caches = caches

    def collect(self):
        caches, labels = self._caches, ["model", "worker"]
        queries = CounterMetricFamily("slotserve_prefix_cache_queries", "Tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("slotserve_prefix_cache_hits", "Tokens found in the prefix cache (of queries)",
                                   labels=labels)
        used = GaugeMetricFamily("slotserve_prefix_cache_used_bytes", "Bytes of the blocks the prefix cache holds",
                                 labels=labels)
        budget = GaugeMetricFamily("slotserve_prefix_cache_budget_bytes", "The prefix cache's budget in bytes",
                                   labels=labels)
        for key, u in caches.items():
            queries.add_metric(key, u.queries)
            hits.add_metric(key, u.hits)
            used.add_metric(key, u.used_bytes)
            budget.add_metric(key, u.budget_bytes)
        return [queries, hits, used, budget]
