"""A frozen worker (SIGSTOP: alive, silent) is killed and restarted by the launcher's supervise loop,
and the request the broker requeued from it is served by the new one (a break-it pass froze the only
worker: its requeued request waited forever, since only a process that exits was restarted)."""

from __future__ import annotations

import contextlib
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

BROKER = {"frontend": ANY_PORT, "backend": ANY_PORT, "heartbeat_interval_s": 0.1, "worker_liveness_s": 0.6}


def _one_worker(**options) -> ClusterConfig:
    """One fixed simulated worker (2 slots), heartbeats every 0.1 s, silent after 0.6 s."""
    workers = (WorkerConfig(num_slots=2, step_delay_ms=5.0, heartbeat_interval_s=0.1, broker_liveness_s=5.0,
                            **options),)
    return ClusterConfig(BrokerConfig(**BROKER), workers, start_timeout_s=60.0, stop_timeout_s=5.0)


def _two_models_room_for_one() -> ClusterConfig:
    """Two simulated models on demand (``model-a``, ``model-b``), room for one loaded at a time."""
    on_demand = tuple(WorkerConfig(model="simulated", served_model_names=(name,), num_slots=2, step_delay_ms=5.0,
                                   heartbeat_interval_s=0.1, broker_liveness_s=5.0, warmup=False)
                      for name in ("model-a", "model-b"))
    return ClusterConfig(BrokerConfig(**BROKER, register_grace_s=0.5), (), on_demand=on_demand, max_loaded_models=1,
                         start_timeout_s=60.0, stop_timeout_s=5.0)


@contextlib.contextmanager
def _supervised(config: ClusterConfig):
    """The cluster of ``config`` with its launcher's supervise loop on a thread (polling every 0.1 s) for
    the block."""
    with LocalCluster(config) as cluster:
        stop = threading.Event()
        supervisor = threading.Thread(target=cluster.supervise, args=(stop.is_set,), kwargs={"poll_s": 0.1},
                                      daemon=True)
        supervisor.start()
        try:
            yield cluster
        finally:
            stop.set()
            supervisor.join(30)


def _kill_if_left(process) -> None:
    """(A test that failed: no stopped process is left behind.)"""
    if process is not None and process.is_alive():
        os.kill(process.pid, signal.SIGKILL)


def test_a_frozen_worker_is_restarted_and_its_requeued_request_served():
    with _supervised(_one_worker()) as cluster:
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
            _kill_if_left(frozen)


def test_a_frozen_worker_of_a_model_on_demand_is_killed_and_the_model_loads_again():
    """Models on demand: a frozen worker (SIGSTOP) is killed as a fixed one is, forgotten (not as a
    failed load), and its model loads again for the request the broker requeued; with room for one
    model, the other model's request is served too (a break-it pass: both waited forever, the frozen
    worker holding the only place)."""
    with _supervised(_two_models_room_for_one()) as cluster:
        frozen = None
        try:
            with Client(cluster.frontend, model="model-a") as c, Client(cluster.frontend, model="model-b") as cb:
                assert c.submit_request([1, 2], 3, stop_token=None).result(timeout=60)  # model-a loads
                frozen = cluster.loaded_on_demand["model-a"]
                wait_until(lambda: cluster._listed.get("model-a", (None,))[0] == frozen.pid, 20,
                           "the launcher to see model-a's worker listed")
                os.kill(frozen.pid, signal.SIGSTOP)
                h = c.submit_request([1, 2, 3], 20, stop_token=None)
                other = cb.submit_request([4, 5], 5, stop_token=None)
                assert h.result(timeout=60) and h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 20
                assert other.result(timeout=60) and other.finish_reason is FinishReason.LENGTH
            assert not frozen.is_alive()
        finally:
            _kill_if_left(frozen)


def test_a_worker_frozen_while_it_loads_its_model_on_demand_is_killed_and_the_model_loads_again(tmp_path, monkeypatch):
    """A model's worker on demand frozen (SIGSTOP) during its load, which the broker then drops as
    silent, is killed as a registered one is, and its model loads again for the request that waits;
    with room for one model, the other model's request is served too (a break-it pass: the launcher
    watched only registered workers, so the frozen loader was never killed, /v1/models said the model
    unloaded while its process held its place, and every request for either model waited forever)."""
    import psutil

    from slotserve import launcher
    from tests.support import held_load

    fifo = str(tmp_path / "load")
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # the load waits on the FIFO until the test lets go
    monkeypatch.setenv(held_load.HELD_FIFO_ENV, fifo)
    monkeypatch.setattr(launcher, "worker_main", held_load.held_launched_worker_main)
    with _supervised(_two_models_room_for_one()) as cluster:
        frozen = None
        try:
            with Client(cluster.frontend, model="model-a") as c, Client(cluster.frontend, model="model-b") as cb:
                h = c.submit_request([1, 2, 3], 20, stop_token=None)  # model-a loads (held)
                wait_until(lambda: "model-a" in cluster.loaded_on_demand, 30, "model-a's worker to start")
                frozen = cluster.loaded_on_demand["model-a"]
                wait_until(lambda: held_load.load_child(psutil.Process(frozen.pid), fifo) is not None, 30,
                           "model-a's load to be under way")
                wait_until(lambda: cluster._listed.get("model-a", (None,))[0] == frozen.pid, 20,
                           "the launcher to see model-a's worker listed while it loads")
                os.kill(frozen.pid, signal.SIGSTOP)
                os.unlink(fifo)  # the next load reads an empty file: it goes through at once
                (tmp_path / "load").write_bytes(b"")
                os.close(writer)  # (the frozen load's child reads to its end and exits)
                writer = None
                other = cb.submit_request([4, 5], 5, stop_token=None)
                assert h.result(timeout=60) and h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 20
                assert other.result(timeout=60) and other.finish_reason is FinishReason.LENGTH
            assert not frozen.is_alive()
        finally:
            if writer is not None:
                os.close(writer)
            _kill_if_left(frozen)


def test_a_restarted_worker_frozen_while_it_loads_is_killed_and_started_again(tmp_path, monkeypatch):
    """The same for a fixed worker: one started again after a crash that freezes during its load is
    killed and started again, and the request that waits is served (was: never killed, the only
    worker's requests waited forever)."""
    import psutil

    from slotserve import launcher
    from tests.support import held_load

    gate = tmp_path / "load"
    gate.write_bytes(b"")  # the first load goes through at once
    monkeypatch.setenv(held_load.HELD_FIFO_ENV, str(gate))
    monkeypatch.setattr(launcher, "worker_main", held_load.held_launched_worker_main)
    writer = frozen = None
    with _supervised(_one_worker(warmup=False)) as cluster:
        try:
            gate.unlink()
            os.mkfifo(gate)
            writer = os.open(gate, os.O_RDWR)  # the next load waits on it
            first = cluster.worker_processes[0]
            os.kill(first.pid, signal.SIGKILL)  # crashed: started again, its load held
            wait_until(lambda: cluster.worker_processes and cluster.worker_processes[0].pid != first.pid, 30,
                       "the worker to be started again")
            frozen = cluster.worker_processes[0]
            wait_until(lambda: held_load.load_child(psutil.Process(frozen.pid), str(gate)) is not None, 30,
                       "its load to be under way")
            wait_until(lambda: cluster._listed.get(0, (None,))[0] == frozen.pid, 20,
                       "the launcher to see the worker listed while it loads")
            os.kill(frozen.pid, signal.SIGSTOP)
            gate.unlink()
            gate.write_bytes(b"")
            os.close(writer)
            writer = None
            with Client(cluster.frontend, model="simulated") as c:
                h = c.submit_request([1, 2, 3], 20, stop_token=None)
                assert h.result(timeout=60) and h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 20
            assert not frozen.is_alive()
        finally:
            if writer is not None:
                os.close(writer)
            _kill_if_left(frozen)
