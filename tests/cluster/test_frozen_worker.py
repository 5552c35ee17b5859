"""A frozen worker (SIGSTOP: alive, silent) is killed and restarted by the launcher's supervise loop,
and the request the broker requeued from it is served by the new one (a break-it pass froze the only
worker: its requeued request waited forever, since only a process that exits was restarted)."""

from __future__ import annotations

import os
import signal
import threading

from broker import BrokerConfig
from client import Client
from protocol.messages import FinishReason
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from tests.support.waits import wait_until
from worker.config import WorkerConfig


def test_a_frozen_worker_is_restarted_and_its_requeued_request_served():
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1, worker_liveness_s=0.6)
    workers = (WorkerConfig(num_slots=2, step_delay_ms=5.0, heartbeat_interval_s=0.1, broker_liveness_s=5.0),)
    with LocalCluster(ClusterConfig(broker, workers, start_timeout_s=60.0, stop_timeout_s=5.0)) as cluster:
        stop = threading.Event()
        supervisor = threading.Thread(target=cluster.supervise, args=(stop.is_set,), kwargs={"poll_s": 0.1},
                                      daemon=True)
        supervisor.start()
        frozen = cluster.worker_processes[0]
        try:
            with Client(cluster.frontend) as c:
                wait_until(lambda: cluster._listed.get(0, (None,))[0] == frozen.pid, 20,
                           "the launcher to see the worker listed")
                os.kill(frozen.pid, signal.SIGSTOP)
                h = c.submit_request([1, 2, 3], 20, stop_token=None)
                assert h.result(timeout=60) and h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 20
                st = c.status()
            assert st.counters["workers_lost"] >= 1
            assert not frozen.is_alive() and cluster.worker_processes[0].pid != frozen.pid
        finally:
            stop.set()
            supervisor.join(30)
            if frozen.is_alive():  # (the test failed: do not leave a stopped process behind)
                os.kill(frozen.pid, signal.SIGKILL)
