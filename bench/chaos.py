"""Chaos: a live cluster under fault injection, every request checked; longer here than in CI.

A broker and several simulated workers (a per-step delay) run as child
processes; one client submits thousands of requests; a killer thread
SIGKILLs a random worker and starts a replacement every ``kill_interval_s``,
and SIGKILLs and restarts the broker ``broker_kills`` times. Every request
must end exactly once, with exactly the tokens of a fault-free in-process
engine run of the same ``SimulatedLLM`` (:func:`fault_free`), streamed
without gap or duplicate.

The driver (:func:`run_chaos`) is shared with ``tests/cluster/test_chaos.py``
(short, in CI); run as a script it runs longer (many requests, workers
SIGKILLed and replaced every second, the broker SIGKILLed and restarted
several times), prints a summary table per run and writes
``bench/results/chaos.json``.

    python -m bench.chaos                     # 20,000 requests, 3 broker kills
    python -m bench.chaos --runs 5 --requests 4000 --broker-kills 1
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from bench.common import ANY_PORT, RESULTS, machine_record, write_results
from broker import BrokerConfig
from client import BrokerUnavailable, Client
from protocol.enums import FinishReason
from slotserve.launcher import ClusterConfig, LocalCluster
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig


@dataclass(frozen=True)
class ChaosConfig:
    """``requests`` submitted at once; ``workers`` x ``slots`` with
    ``step_delay_ms`` per iteration; a worker killed every
    ``kill_interval_s``; the broker killed ``broker_kills`` times, first
    after ``first_broker_kill_s`` and then every ``broker_kill_every_s``.
    ``max_attempts`` is raised: a SIGKILL is not the request's fault, and
    the point is that nothing is lost (the default 3 is for poison requests)."""

    requests: int = 2000
    workers: int = 3
    slots: int = 8
    step_delay_ms: float = 3.0
    kill_interval_s: float = 1.0
    broker_kills: int = 1
    first_broker_kill_s: float = 2.5
    broker_kill_every_s: float = 4.0
    max_attempts: int = 1000
    seed: int = 0
    timeout_s: float = 120.0


@dataclass
class ChaosResult:
    requests: int
    completed_once: int = 0
    mismatches: int = 0
    duplicate_callbacks: int = 0
    missing: int = 0
    stream_errors: int = 0
    worker_kills: int = 0
    broker_kills: int = 0
    migrations: int = 0
    resubmissions: int = 0
    duplicates_recognised: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return self.completed_once == self.requests and not (self.mismatches or self.duplicate_callbacks
                                                             or self.missing or self.stream_errors)

    def as_dict(self) -> dict:
        return asdict(self)


def make_requests(n: int, seed: int) -> list[tuple[list[int], int, dict]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 8))]
        kw = {"stop_token": None} if rng.random() < 0.5 else {}
        reqs.append((prompt, rng.randrange(5, 40), kw))
    return reqs


def fault_free(requests, *, batch_size: int = 8) -> list[tuple[list[int], FinishReason]]:
    """``(tokens, finish_reason)`` per ``(prompt, max_tokens, options)`` of ``requests``: one
    in-process engine run over SimulatedLLM with the worker's default stop token (0), no broker,
    no faults -- what the cluster must return (SimulatedLLM is a pure function of the sequence,
    so the batch size changes nothing)."""
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=batch_size, stop_token=0)
    handles = [engine.submit_request(prompt, max_tokens, **options) for prompt, max_tokens, options in requests]
    engine.run()
    return [(h.tokens, h.finish_reason) for h in handles]


def run_chaos(cfg: ChaosConfig, expected=None) -> ChaosResult:
    reqs = make_requests(cfg.requests, cfg.seed)
    expected = expected if expected is not None else fault_free(reqs)
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1, worker_liveness_s=0.5,
                          client_liveness_s=10.0, max_attempts=cfg.max_attempts)
    worker = WorkerConfig(num_slots=cfg.slots, step_delay_ms=cfg.step_delay_ms, heartbeat_interval_s=0.1,
                          broker_liveness_s=1.0)
    res = ChaosResult(cfg.requests)
    calls = [0] * cfg.requests
    streamed: list[list[int]] = [[] for _ in range(cfg.requests)]
    rng = random.Random(cfg.seed + 1)
    with LocalCluster(ClusterConfig(broker, (worker,) * cfg.workers, start_timeout_s=60.0)) as cluster, \
            Client(cluster.frontend, heartbeat_interval_s=0.1, connect_timeout_s=30.0, name="chaos") as c:
        done = threading.Event()
        requeued_before: list[int] = []

        def counters():
            try:
                return c.status(timeout_s=2.0).counters
            except BrokerUnavailable:
                return None

        def killer():
            t0 = time.monotonic()
            next_broker_kill = t0 + cfg.first_broker_kill_s
            while not done.wait(cfg.kill_interval_s):
                i = rng.randrange(cfg.workers)
                p = cluster.worker_processes[i]
                os.kill(p.pid, signal.SIGKILL)
                cluster.restart_worker(i)
                res.worker_kills += 1
                if res.broker_kills < cfg.broker_kills and time.monotonic() >= next_broker_kill:
                    st = counters()
                    if st is not None:
                        requeued_before.append(st["requeued"])
                        res.duplicates_recognised += st["duplicates"]
                    os.kill(cluster.broker_process.pid, signal.SIGKILL)
                    cluster.restart_broker()
                    res.broker_kills += 1
                    next_broker_kill = time.monotonic() + cfg.broker_kill_every_s

        t0 = time.monotonic()
        hs = []
        for i, (p, m, kw) in enumerate(reqs):
            hs.append(c.submit_request(p, m, lambda seq, i=i: calls.__setitem__(i, calls[i] + 1),
                                       on_token=streamed[i].append, **kw))
        k = threading.Thread(target=killer, name="chaos-killer", daemon=True)
        k.start()
        try:
            c.run(timeout=cfg.timeout_s)
        except TimeoutError as e:
            res.notes.append(str(e))
        finally:
            done.set()
            k.join(60)
        res.wall_s = time.monotonic() - t0
        st = counters()
        if st is not None:
            res.migrations = sum(requeued_before) + st["requeued"]
            res.duplicates_recognised += st["duplicates"]
        res.resubmissions = c.resubmitted
    for i, h in enumerate(hs):
        if calls[i] == 0:
            res.missing += 1
            continue
        if calls[i] > 1:
            res.duplicate_callbacks += 1
        if (h.tokens, h.finish_reason) != expected[i]:
            res.mismatches += 1
            if len(res.notes) < 5:
                res.notes.append(f"request {i}: got {h.finish_reason} {h.tokens} ({h.error}), "
                                 f"expected {expected[i]}")
        elif calls[i] == 1:
            res.completed_once += 1
        if streamed[i] != h.tokens:
            res.stream_errors += 1
    return res


COLUMNS = ("requests", "completed_once", "mismatches", "duplicate_callbacks", "missing", "stream_errors",
           "worker_kills", "broker_kills", "migrations", "resubmissions", "wall_s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--step-delay-ms", type=float, default=3.0)
    ap.add_argument("--broker-kills", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args(argv)
    machine = machine_record()
    cfg = ChaosConfig(requests=args.requests, workers=args.workers, slots=args.slots,
                      step_delay_ms=args.step_delay_ms, broker_kills=args.broker_kills, timeout_s=900.0)
    expected = fault_free(make_requests(cfg.requests, cfg.seed))
    runs = []
    print(" ".join(f"{c:>14}" for c in ("run",) + COLUMNS))
    for r in range(args.runs):
        res = run_chaos(cfg, expected)
        d = res.as_dict()
        runs.append(d)
        print(" ".join([f"{r + 1:>14}"] + [f"{d[c]:>14.1f}" if c == "wall_s" else f"{d[c]:>14}"
                                           for c in COLUMNS]), flush=True)
        for note in res.notes:
            print("   ", note)
    ok = all(d["completed_once"] == d["requests"] and d["mismatches"] == 0 and d["missing"] == 0
             and d["duplicate_callbacks"] == 0 and d["stream_errors"] == 0 for d in runs)
    print(f"\nall runs: every request exactly once with the fault-free tokens: {'yes' if ok else 'NO'}")
    write_results(RESULTS / "chaos.json", {"config": asdict(cfg), "runs": runs, "ok": ok}, machine)


if __name__ == "__main__":
    main()
