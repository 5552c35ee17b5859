"""The broker's Prometheus endpoint reports queue, slots, request events,
tokens and latency histograms (broker, worker and client in threads here)."""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from broker import BrokerConfig, BrokerServer
from client import Client
from tests.support.waits import wait_until
from worker.config import WorkerConfig
from worker.process import run_worker


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_endpoint_reports_the_broker_state():
    cfg = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", metrics_port=0, tick_s=0.01)
    stop = threading.Event()
    with BrokerServer(cfg) as server:
        threads = [threading.Thread(target=server.serve, args=(stop,)),
                   threading.Thread(target=run_worker, args=(WorkerConfig(broker=server.backend, num_slots=3),),
                                    kwargs={"stop": stop})]
        for t in threads:
            t.start()
        try:
            with Client(server.frontend) as c:
                c.wait_for_model(10)
                hs = [c.submit_request([i + 1, 2], 5, stop_token=None) for i in range(20)]
                c.run(timeout=30)
            port = server.metrics.port
            def completed():
                m = scrape(port)
                return m if m.get(("slotserve_requests_total", (("event", "completed"),))) == 20 else None
            m = wait_until(completed, 10, "20 completed requests in the metrics", show=lambda: scrape(port),
                           pause_s=0.02)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    model = (("model", "simulated"),)
    assert m[("slotserve_slots_total", model)] == 3 and m[("slotserve_workers", model)] == 1
    assert m[("slotserve_queue_depth", model)] == 0
    assert m[("slotserve_requests_total", (("event", "submitted"),))] == 20
    assert m[("slotserve_tokens_total", ())] == 100
    assert m[("slotserve_ttft_seconds_count", ())] == 20
    assert m[("slotserve_request_latency_seconds_count", ())] == 20
    assert m[("slotserve_request_latency_seconds_sum", ())] >= m[("slotserve_ttft_seconds_sum", ())] > 0


def test_a_name_the_status_no_longer_lists_has_no_series():
    """A request for an alias nobody has announced yet (within the start-up grace) queues under that name,
    which the status lists with its queue; once a worker registers the alias, its requests join the
    model's queue and the name is no longer listed. Its series went on saying the last value seen
    (``slotserve_queue_depth{model="alias"} 1`` for good, and its slots and workers) while nothing
    waited under it; now a name the status no longer lists has no series, as the prefix-cache ones."""
    from broker.metrics import BrokerMetrics
    from protocol.messages import Register, Submit
    from tests.support.cores import C1, INFO, W1, make_core
    from tests.support.messages import envelope

    core = make_core(register_grace_s=10.0)
    metrics = BrokerMetrics(0)
    try:
        core.on_frontend(C1, Submit("alias", [envelope("r", [1], 5)]), 0.1)
        metrics.update(core, 0.1)
        depth = lambda model: metrics.registry.get_sample_value("slotserve_queue_depth", {"model": model})  # noqa: E731
        assert depth("alias") == 1
        core.on_backend(W1, Register("m", 2, 2, INFO, "w1", aliases=("alias",)), 0.2)
        metrics.update(core, 0.2)
        assert "alias" not in core.status(0.2).models and depth("m") == 0
        for name in ("slotserve_queue_depth", "slotserve_slots_busy", "slotserve_slots_total", "slotserve_workers"):
            assert metrics.registry.get_sample_value(name, {"model": "alias"}) is None, name  # (was 1, 0, 0, 0)
    finally:
        metrics.close()
