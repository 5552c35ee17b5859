"""Chaos (in CI, well under a minute): workers SIGKILLed and replaced every
second and the broker SIGKILLed and restarted while a client runs four
thousand requests; every request ends exactly once with exactly the tokens
of a fault-free in-process run (the driver is ``bench/chaos.py``'s, the
expected tokens :func:`tests.support.reference.simulated_references`)."""

from __future__ import annotations

from bench.chaos import ChaosConfig, make_requests, run_chaos
from tests.support.reference import simulated_references


def test_chaos_every_request_exactly_once_with_fault_free_tokens():
    cfg = ChaosConfig(requests=4000, workers=3, slots=8, step_delay_ms=3.0, kill_interval_s=1.0,
                      broker_kills=1, first_broker_kill_s=2.5, timeout_s=90.0)
    res = run_chaos(cfg, simulated_references(make_requests(cfg.requests, cfg.seed)))
    print(res.as_dict())
    assert res.notes == [] and res.ok(), res.as_dict()
    assert res.worker_kills >= 3 and res.broker_kills == 1
    assert res.migrations > 0 and res.resubmissions > 0
