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
