"""Chaos (in CI, well under a minute): workers SIGKILLed and replaced every
second and the broker SIGKILLed and restarted while a client runs four
thousand requests; every request ends exactly once with exactly the tokens
of a fault-free in-process run (see ``tests/support/chaos.py``)."""

from __future__ import annotations

from tests.support.chaos import ChaosConfig, run_chaos


def test_chaos_every_request_exactly_once_with_fault_free_tokens():
    res = run_chaos(ChaosConfig(requests=4000, workers=3, slots=8, step_delay_ms=3.0, kill_interval_s=1.0,
                                broker_kills=1, first_broker_kill_s=2.5, timeout_s=90.0))
    print(res.as_dict())
    assert res.notes == [] and res.ok(), res.as_dict()
    assert res.worker_kills >= 3 and res.broker_kills == 1
    assert res.migrations > 0 and res.resubmissions > 0
