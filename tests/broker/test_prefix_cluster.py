"""Prefix-aware dispatch through a real broker and two real workers (threads, real sockets)."""

from __future__ import annotations

import pytest

from client import Client
from tests.support.cluster import ThreadCluster
from tests.support.waits import wait_until
from worker import SimulatedLLM

PREFIX = list(range(1, 65))  # 64 shared tokens


@pytest.mark.parametrize("routing", [True, False])
def test_a_request_sharing_a_running_requests_prefix_joins_its_worker(routing):
    """Two 4-slot workers; A runs (long), then B with A's prefix: prefix-aware dispatch sends B to A's
    worker (it has a free slot), credit-only dispatch to the idle one (more free slots)."""
    with ThreadCluster(heartbeat_interval_s=0.1, prefix_routing=routing) as cl:
        for i in range(2):
            cl.add_worker(SimulatedLLM(stop_rate=0.0), num_slots=4, step_delay_ms=5, name=f"w{i}")
        with Client(cl.frontend) as c:
            c.wait_for_model(10)
            wait_until(lambda: len(c.status().workers) == 2, 10, "two workers registered")
            a = c.submit_request(PREFIX + [7], 100_000, stop_token=None)
            wait_until(lambda: sum(w.inflight for w in c.status().workers) == 1, 10, "A running")
            b = c.submit_request(PREFIX + [8, 9], 100_000, stop_token=None)
            busy = wait_until(lambda: (s := sorted(w.inflight for w in c.status().workers)) and sum(s) == 2 and s,
                              10, "B running")
            assert busy == ([0, 2] if routing else [1, 1])
            for h in (a, b):
                c.cancel(h.request_id)
                h.result(timeout=10)
