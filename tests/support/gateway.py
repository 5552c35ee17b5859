"""Shared pieces of the HTTP gateway tests: a cluster with a gateway, waiting on conditions."""

from __future__ import annotations

import re
import threading
import time

import httpx

from broker import BrokerConfig
from client import Client
from gateway import GatewayConfig
from slotserve.launcher import ClusterConfig, LocalCluster
from worker import BatchInferenceEngine, SimulatedLLM
from worker.process import WorkerConfig

ANY_PORT = "tcp://127.0.0.1:*"


def wait_until(cond, timeout_s: float = 20.0, what: str = "condition"):
    """Poll ``cond`` until it returns something true (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.01)


def start_cluster(workers: tuple[WorkerConfig, ...], *, max_queue: int = 100_000,
                  gateway: GatewayConfig | None = None, models: tuple[str, ...] = ("simulated",)) -> LocalCluster:
    """A broker, ``workers`` and a gateway on free ports; returns once ``/health``
    lists every model in ``models``. The caller stops it."""
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, max_queue=max_queue, heartbeat_interval_s=0.2)
    cfg = ClusterConfig(broker, workers, start_timeout_s=120.0, gateway=gateway or GatewayConfig(port=0))
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        def healthy():
            r = httpx.get(cluster.http_url + "/health", timeout=5)
            return r.status_code == 200 and set(models) <= set(r.json()["models"])
        wait_until(healthy, 60, "the gateway's /health")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def broker_status(cluster: LocalCluster):
    with Client(cluster.frontend, name="test-status") as c:
        return c.status()


def simulated_reference(prompt: list[int], max_tokens: int, **kw) -> tuple[list[int], str]:
    """Tokens and finish reason of the in-process engine (the worker's default stop token is 0)."""
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=1, stop_token=0)
    h = engine.submit_request(prompt, max_tokens, **kw)
    engine.run()
    return h.tokens, h.finish_reason.value


def metric(url: str, name: str, **labels) -> float:
    """One sample of the gateway's /metrics (0.0 when absent)."""
    text = httpx.get(url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
