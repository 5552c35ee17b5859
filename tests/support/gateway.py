"""Shared pieces of the HTTP gateway tests: a cluster with a gateway (on the
shared harness, :mod:`tests.support.cluster`), its status and metrics."""

from __future__ import annotations

import functools
import re

import httpx

from broker import BrokerConfig
from client import Client
from gateway import GatewayConfig
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from tests.support.reference import simulated_reference  # noqa: F401 -- the gateway tests' reference
from tests.support.waits import wait_until as _wait_until
from worker.process import WorkerConfig

# The gateway tests' conditions are HTTP calls: polled every 10 ms.
wait_until = functools.partial(_wait_until, pause_s=0.01)


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


def metric(url: str, name: str, **labels) -> float:
    """One sample of the gateway's /metrics (0.0 when absent)."""
    text = httpx.get(url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
