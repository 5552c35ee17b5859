"""Integration: liveness, client loss and cancellation through a real broker
process. A hung worker (heartbeats, no iterations) loses its requests to a
healthy one, with the tokens so far; a slow one (long steps) keeps them; a
client that goes silent has its requests cancelled and slots freed; cancels
and deadlines that cross a dispatch end each request exactly once.

Workers with test-only models (a step that blocks on an event, a step that
takes long) run as threads of this process, each a full worker with its own
sockets and I/O thread; the broker and a healthy worker are child processes.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from broker import BrokerConfig
from client import Client
from protocol.codec import encode
from protocol.enums import FinishReason
from protocol.messages import Heartbeat, Submit
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT, ThreadWorker, registered
from tests.support.messages import envelope
from tests.support.reference import simulated_references
from tests.support.waits import wait_until
from worker import SimulatedLLM
from worker.config import WorkerConfig

HUNG_S = 2.0


@pytest.fixture(scope="module")
def cluster():
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1, worker_liveness_s=0.5,
                          client_liveness_s=2.0, worker_hung_s=HUNG_S)
    healthy = WorkerConfig(num_slots=8, step_delay_ms=1.0, heartbeat_interval_s=0.1, broker_liveness_s=2.0)
    with LocalCluster(ClusterConfig(broker, (healthy,), start_timeout_s=60.0)) as c:
        yield c


class HangingSim(SimulatedLLM):
    """SimulatedLLM whose step blocks (a stuck GPU kernel, a deadlock) after
    ``hang_after`` iterations, until ``release`` is set."""

    def __init__(self, hang_after: int):
        super().__init__()
        self.hang_after = hang_after
        self.calls = 0
        self.release = threading.Event()
        self.hanging = threading.Event()

    def next_tokens(self, sequences):
        self.calls += 1
        if self.calls > self.hang_after:
            self.hanging.set()
            self.release.wait()
        return super().next_tokens(sequences)


class SlowSim(SimulatedLLM):
    """SimulatedLLM with a legitimately long step (``step_s`` seconds)."""

    def __init__(self, step_s: float):
        super().__init__()
        self.step_s = step_s

    def next_tokens(self, sequences):
        time.sleep(self.step_s)  # the model's cost, not synchronisation
        return super().next_tokens(sequences)


def thread_worker(backend: str, model, slots: int) -> ThreadWorker:
    """A worker on a thread of this process: 0.1 s heartbeats, no prefetch, named after ``model``."""
    return ThreadWorker(backend, model, num_slots=slots, heartbeat_interval_s=0.1, broker_liveness_s=2.0,
                        name=f"thread-{id(model):x}", prefetch=0)


def test_slow_step_is_not_hung_and_keeps_its_requests(cluster):
    reqs = [([i + 1, 2, 3], 3, {"stop_token": None}) for i in range(3)]
    expected = simulated_references(reqs, batch_size=4)
    with Client(cluster.frontend, heartbeat_interval_s=0.2) as c, thread_worker(cluster.backend, SlowSim(0.8), slots=16) as w:
        wait_until(lambda: registered(c, w.name), what="the slow worker to register")
        before = c.status().counters
        # 16 free slots beat the healthy worker's 8: all three go to the slow one.
        hs = [c.submit_request(p, m, **kw) for p, m, kw in reqs]
        c.run(timeout=30)
        after = c.status().counters
        busy = [x for x in c.status().workers if x.name == w.name][0]
    assert [(h.tokens, h.finish_reason) for h in hs] == expected
    # Steps of 0.8 s, longer than the 0.5 s liveness window: never dead, never hung.
    assert after["workers_lost"] == before["workers_lost"] and after["requeued"] == before["requeued"]
    assert busy.iterations >= 3


def test_hung_worker_loses_its_requests_to_a_healthy_one_with_tokens_so_far(cluster):
    reqs = [([i + 5, 7], 30, {"stop_token": None}) for i in range(4)]
    expected = simulated_references(reqs, batch_size=4)
    streamed = {i: [] for i in range(len(reqs))}
    model = HangingSim(hang_after=5)
    with Client(cluster.frontend, heartbeat_interval_s=0.2) as c, thread_worker(cluster.backend, model, slots=16) as w:
        wait_until(lambda: registered(c, w.name), what="the hanging worker to register")
        before = c.status().counters
        hs = [c.submit_request(p, m, on_token=streamed[i].append, **kw) for i, (p, m, kw) in enumerate(reqs)]
        assert model.hanging.wait(20)
        c.run(timeout=30)
        st = c.status()
        suspect = [x for x in st.workers if x.name == w.name]
    assert [(h.tokens, h.finish_reason) for h in hs] == expected
    for i, h in enumerate(hs):
        assert streamed[i] == h.tokens           # the migration: no gap, no duplicate
    assert st.counters["workers_hung"] >= before["workers_hung"] + 1
    assert st.counters["requeued"] >= before["requeued"] + 4
    # It heartbeat, was told it is unknown and registered again: on probation, idle.
    assert all(x.suspect and x.inflight == 0 for x in suspect)


def test_request_hung_on_max_attempts_workers_ends_with_worker_failed(cluster):
    # The healthy worker is kept busy, so the request lands only on hanging ones.
    models = [HangingSim(hang_after=1) for _ in range(3)]
    with Client(cluster.frontend, heartbeat_interval_s=0.2) as c:
        # 8 slots + 2 prefetch credits: 10 endless requests fill it.
        blockers = [c.submit_request([9, i + 1], 100_000, stop_token=None) for i in range(10)]
        wait_until(lambda: c.status().models["simulated"].running == 10, what="the healthy worker to be full")
        workers = [thread_worker(cluster.backend, m, slots=1) for m in models]
        try:
            for w in workers:
                w.__enter__()
            wait_until(lambda: all(registered(c, w.name) for w in workers), what="hanging workers")
            h = c.submit_request([1, 2, 3], 20, stop_token=None)
            wait_until(h.done, 30, "the request to end", show=lambda: (c.status(), h.tokens))
        finally:
            for b in blockers:
                c.cancel(b.request_id)
            for w in workers:
                w.__exit__()
        c.run(timeout=30)
    assert h.finish_reason is FinishReason.ERROR and h.error.code == "worker_failed"
    assert sum(m.calls >= 1 for m in models) == 3  # it hung on each of the three


def test_silent_client_has_queued_and_running_requests_cancelled(cluster):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(cluster.frontend)
    try:
        with Client(cluster.frontend, heartbeat_interval_s=0.2) as c:
            before = c.status().counters["clients_lost"]
            # 20 endless requests: 10 run (8 slots + 2 prefetch), 10 wait in the queue.
            raw.send(encode(Submit("simulated", [envelope(i, [i + 1], 1_000_000, stop_token=None)
                                                 for i in range(20)])))

            def running_while_heartbeating():
                raw.send(encode(Heartbeat()))   # alive until we have seen its requests run
                m = c.status().models["simulated"]
                return m.running == 10 and m.queued == 10

            wait_until(running_while_heartbeating, what="the raw client's requests to run", show=c.status)
            # Now the raw client says nothing more (no heartbeats): after the
            # liveness window its requests are cancelled and the slots freed.
            wait_until(lambda: c.status().counters["clients_lost"] > before, what="the silent client to be dropped")
            wait_until(lambda: (lambda m: m.running == 0 and m.queued == 0 and m.slots_busy == 0)(
                c.status().models["simulated"]), 5, "the slots to be freed")
            hs = [c.submit_request([i + 1, 2], 5) for i in range(20)]
            c.run(timeout=20)
        assert all(h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for h in hs)
    finally:
        raw.close(0)


def test_cancels_and_deadlines_crossing_dispatch_end_each_request_exactly_once(cluster):
    rng = random.Random(7)
    reqs = [([rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))], rng.randrange(1, 40),
             {"stop_token": None if rng.random() < 0.5 else 0}) for _ in range(300)]
    expected = simulated_references(reqs, batch_size=4)
    modes = [rng.randrange(4) for _ in reqs]
    calls = {i: 0 for i in range(len(reqs))}
    streamed = {i: [] for i in range(len(reqs))}
    with Client(cluster.frontend, heartbeat_interval_s=0.2) as c:
        hs = []

        def on_token(i, t, cancel_at):
            streamed[i].append(t)
            if len(streamed[i]) == cancel_at:
                c.cancel(hs[i].request_id)      # from the callback thread, mid-stream

        for i, (p, m, kw) in enumerate(reqs):
            mode = modes[i]
            extra = {"timeout_s": 0.002} if mode == 3 else {}
            cancel_at = rng.randrange(1, 4) if mode == 2 else -1
            hs.append(c.submit_request(p, m, lambda seq, i=i: calls.__setitem__(i, calls[i] + 1),
                                       on_token=lambda t, i=i, k=cancel_at: on_token(i, t, k), **kw, **extra))
            if mode == 1:
                c.cancel(hs[i].request_id)      # crosses the dispatch on its way
        c.run(timeout=60)
        st = c.status().models["simulated"]
        late = [c.cancel(h.request_id) for h in hs[:10]]
    assert all(n == 1 for n in calls.values())  # exactly one terminal callback each
    assert late == [False] * 10                 # a cancel after the end changes nothing
    assert st.running == 0 and st.queued == 0   # no credit or queue entry leaked
    counts = {}
    for i, h in enumerate(hs):
        tokens, reason = expected[i]
        assert streamed[i] == h.tokens and h.error is None
        assert h.tokens == tokens[:len(h.tokens)]
        if h.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
            assert modes[i] in ((1, 2) if h.finish_reason is FinishReason.CANCELLED else (3,))
        else:
            assert (h.tokens, h.finish_reason) == (tokens, reason)
        counts[h.finish_reason] = counts.get(h.finish_reason, 0) + 1
    assert counts.get(FinishReason.CANCELLED, 0) > 0
