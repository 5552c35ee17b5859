"""Property test of the broker core: random interleavings of submits, worker
iterations, cancels, worker deaths and registrations. Invariants: credits are
never exceeded; every accepted request ends exactly once; a client's tokens
for a request are exactly the positions 0, 1, 2, ... (no gap, no duplicate),
however often it migrated."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import BrokerConfig
from broker.core import BrokerCore
from broker.outbox import Side
from tests.support.messages import envelope
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import (
    Assign, Bye, Cancel, Finished, Iteration, ModelInfo, Register, Results, Submit,
)

CLIENTS = (b"c0", b"c1")
OPS = ("submit", "iterate", "iterate", "iterate", "cancel", "kill", "bye", "register", "tick")


class Sim:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.core = BrokerCore(BrokerConfig(heartbeat_interval_s=0.1, worker_liveness_s=1.0,
                                            client_liveness_s=1e9, max_queue=40, max_attempts=1000),
                               "b", self.now)
        self.workers: dict[bytes, dict] = {}   # identity -> {key: [max_tokens, position]}
        self.cancelled_at_worker: dict[bytes, set] = {}
        self.limits: dict[bytes, int] = {}
        self.next_worker = 0
        self.next_rid = {c: 0 for c in CLIENTS}
        self.tokens: dict[tuple, list[int]] = {}
        self.ends: dict[tuple, list] = {}
        self.max_tokens: dict[tuple, int] = {}

    def apply(self, sends) -> None:
        for s in sends:
            m = s.message
            if s.side is Side.BACKEND and s.identity in self.workers:
                held = self.workers[s.identity]
                if isinstance(m, Assign):
                    for spec in m.requests:
                        assert spec.request_id not in held
                        held[spec.request_id] = [spec.params.max_tokens, len(spec.resume_tokens)]
                    assert len(held) <= self.limits[s.identity], "credits exceeded"
                elif isinstance(m, Cancel):
                    self.cancelled_at_worker[s.identity].update(m.request_ids)
            elif s.side is Side.FRONTEND and isinstance(m, Results):
                for rid, t in zip(m.ids, m.tokens):
                    self.tokens.setdefault((s.identity, rid), []).append(t)
                for f in m.finished:
                    self.ends.setdefault((s.identity, f.request_id), []).append(f)

    def register(self) -> None:
        w = b"w%d" % self.next_worker
        self.next_worker += 1
        slots = self.rng.randint(1, 4)
        self.workers[w] = {}
        self.cancelled_at_worker[w] = set()
        self.limits[w] = slots + self.rng.randint(0, 2)
        self.apply(self.core.on_backend(w, Register("m", slots, self.limits[w], ModelInfo(), w.decode()), self.now))

    def step(self, op: str) -> None:
        rng = self.rng
        self.now += 0.05
        if op == "register" or (op in ("iterate", "kill", "bye") and not self.workers):
            self.register()
        elif op == "submit":
            c = rng.choice(CLIENTS)
            specs = []
            for _ in range(rng.randint(1, 6)):
                rid = self.next_rid[c]
                self.next_rid[c] += 1
                mt = rng.randint(1, 8)
                self.max_tokens[(c, rid)] = mt
                specs.append(envelope(rid, [1], mt, priority=rng.randint(-1, 1)))
            self.apply(self.core.on_frontend(c, Submit("m", specs), self.now))
        elif op == "cancel":
            c = rng.choice(CLIENTS)
            if self.next_rid[c]:
                self.apply(self.core.on_frontend(c, Cancel([rng.randrange(self.next_rid[c])]), self.now))
        elif op == "iterate":
            w = rng.choice(list(self.workers))
            held = self.workers[w]
            ids, toks, fin = [], [], []
            for key in list(held):
                if key in self.cancelled_at_worker[w]:
                    fin.append(Finished(key, FinishReason.CANCELLED))
                    del held[key]
                    continue
                mt, pos = held[key]
                ids.append(key)
                toks.append(pos)            # token value = its position: gaps/duplicates show
                held[key][1] = pos + 1
                if pos + 1 >= mt:
                    fin.append(Finished(key, FinishReason.LENGTH))
                    del held[key]
            self.apply(self.core.on_backend(w, Iteration(ids, toks, [], fin), self.now))
        elif op in ("kill", "bye"):
            w = rng.choice(list(self.workers))
            del self.workers[w]
            if op == "bye":
                self.apply(self.core.on_backend(w, Bye(), self.now))
            else:
                self.now += 1.5             # silent past the liveness window
                for other in self.workers:  # the others stay alive
                    self.core.workers.get(other).last_seen_s = self.now
                self.apply(self.core.tick(self.now))
        elif op == "tick":
            for other in self.workers:
                self.core.workers.get(other).last_seen_s = self.now
            self.apply(self.core.tick(self.now))

    def drain(self) -> None:
        if not self.workers:
            self.register()
        for _ in range(500):
            if not self.core.jobs:
                return
            for w in list(self.workers):
                self.step("iterate")
        raise AssertionError("work did not drain")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(OPS), min_size=5, max_size=60))
def test_random_interleavings_keep_the_invariants(seed, ops):
    sim = Sim(seed)
    sim.register()  # the model is known from here on (later all its workers may die)
    for op in ops:
        sim.step(op)
        for w, held in sim.workers.items():
            assert len(sim.core.workers.get(w).inflight) <= sim.limits[w]
    sim.drain()
    for key, mt in sim.max_tokens.items():
        ends = sim.ends.get(key, [])
        assert len(ends) == 1, (key, ends)           # exactly one ending per request
        f = ends[0]
        toks = sim.tokens.get(key, [])
        assert toks == list(range(len(toks)))          # no gap, no duplicate across migrations
        if f.finish_reason is FinishReason.LENGTH:
            assert len(toks) == mt
        else:
            assert f.finish_reason is FinishReason.CANCELLED or f.code is ErrorCode.QUEUE_FULL
    assert not sim.core.jobs and not sim.core._by_client
