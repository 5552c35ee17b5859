"""Dispatch chooses each request's worker inline (issue 30: once per request); the choice is
:meth:`~broker.registry.WorkerRegistry.pick`'s, request after request: most free slots, earliest
registered on ties, never a worker without a credit or one on probation. Checked against ``pick``
itself, replayed on a copy of the workers, for random workers, loads and queues (with and without
prefix routing, whose short prompts leave the choice to the credits)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.outbox import Side
from broker.registry import WorkerRegistry
from protocol.messages import Assign, Register, Submit
from tests.support.cores import INFO, make_core
from tests.support.messages import envelope

WORKER = st.tuples(st.integers(1, 6), st.integers(0, 4), st.booleans())  # slots, prefetch, on probation


@settings(max_examples=200, deadline=None)
@given(st.lists(WORKER, min_size=1, max_size=4), st.lists(st.integers(0, 6), min_size=4, max_size=4),
       st.integers(1, 30), st.booleans())
def test_each_request_goes_where_pick_would_send_it(workers, held, n, prefix_routing):
    core = make_core(prefix_routing=prefix_routing, register_grace_s=0)
    ids = [f"w{i}".encode() for i in range(len(workers))]
    for i, (slots, prefetch, _) in enumerate(workers):
        core.on_backend(ids[i], Register("m", slots, slots + prefetch, INFO), 0.0)
    # Some requests already running, then some workers found hung (on probation).
    core.on_frontend(b"c", Submit("m", tuple(envelope(f"pre{i}", [1, 2, 3], 4) for i in range(sum(held)))), 0.0)
    for i, w in enumerate(core.workers):
        extra = sorted(w.inflight)[held[i]:] if i < len(held) else []
        for key in extra:  # (keep held[i] of what the first submit gave it: they finish elsewhere)
            w.inflight.discard(key)
        w.suspect = workers[i][2]
    expect = copy.deepcopy(core.workers)
    sends = core.on_frontend(b"c", Submit("m", tuple(envelope(i, [1, 2, 3], 4) for i in range(n))), 0.0)
    got = {s.identity: [e.request_id for e in s.message.requests] for s in sends
           if s.side is Side.BACKEND and isinstance(s.message, Assign)}
    want: dict[bytes, list[int]] = {}
    for key in sorted(key for keys in got.values() for key in keys):  # (keys grow with arrival: queue order)
        w = WorkerRegistry.pick(expect, "m")
        assert w is not None, "assigned to a worker without a credit"
        want.setdefault(w.identity, []).append(key)
        w.inflight.add(key)
    assert got == want
    if len(core.queues["m"]):  # what waits has no worker pick would take
        assert WorkerRegistry.pick(expect, "m") is None
