"""Scheduling: continuous vs static refilling, priorities, aging, admission limits, ids."""

from __future__ import annotations

import random

import pytest

from worker import BatchInferenceEngine, DuplicateRequestError, QueueFullError, SimulatedLLM
from worker import DEFAULT_AGING_WINDOW
from worker.scheduler import Policy


def _engine(batch_size, policy="continuous", **kw):
    return BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size, policy=policy, **kw)


@pytest.mark.parametrize("policy, calls", [("continuous", 6), ("static", 10)])
def test_exact_model_calls_continuous_vs_static(policy, calls):
    # Slots: 2. A needs 1 token, B 5, C 5.
    # continuous: C takes A's slot at iteration 2 -> ends at iteration 6.
    # static: C waits for B to finish (iteration 5), then runs 5 more.
    engine = _engine(2, policy)
    for n in (1, 5, 5):
        engine.submit_request([1], n)
    engine.run()
    assert engine.model.calls == calls
    assert engine.model.sequences == 11  # same tokens either way, different iterations


def test_batch_sizes_seen_by_the_model_continuous_vs_static():
    sizes = {}
    for policy in ("continuous", "static"):
        model = SimulatedLLM(stop_rate=0.0)
        seen = []
        inner = model.next_tokens
        model.next_tokens = lambda seqs, inner=inner, seen=seen: seen.append(len(seqs)) or inner(seqs)
        engine = BatchInferenceEngine(model, 3, policy=policy)
        for n in (2, 4, 6, 1, 1, 1, 3):
            engine.submit_request([1], n)
        engine.run()
        sizes[policy] = seen
    # continuous: every freed slot is refilled at once while work waits.
    assert sizes["continuous"] == [3, 3, 3, 3, 3, 2, 1]
    # static: the batch [2,4,6] drains to one slot before [1,1,1] may start, then [3].
    assert sizes["static"] == [3, 3, 2, 2, 1, 1, 3, 1, 1, 1]


def test_policy_enum_and_bad_policy():
    assert _engine(1, Policy.STATIC).policy is Policy.STATIC
    with pytest.raises(ValueError, match="policy"):
        _engine(1, "greedy")


def _admission_order(engine, submissions):
    """Submit (priority, label) pairs before running; return labels in completion order."""
    order = []
    for prio, label in submissions:
        engine.submit_request([1], 1, priority=prio, callback=lambda seq, l=label: order.append(l))
    engine.run()
    return order


def test_fifo_by_default():
    assert _admission_order(_engine(1), [(0, i) for i in range(20)]) == list(range(20))


def test_lower_priority_value_first_fifo_within_a_level():
    subs = [(5, "a"), (1, "b"), (3, "c"), (1, "d"), (0, "e"), (-2, "f"), (3, "g")]
    assert _admission_order(_engine(1), subs) == ["f", "e", "b", "d", "c", "g", "a"]


def test_default_aging_never_reorders_a_short_burst():
    rng = random.Random(7)
    n = DEFAULT_AGING_WINDOW - 1
    subs = [(rng.randint(0, 3), i) for i in range(n)]
    expected = [label for _, label in sorted(subs, key=lambda s: (s[0], s[1]))]
    assert _admission_order(_engine(4), subs) == expected


def test_aging_bound_is_exact():
    # Window 10: a priority-5 request is overtaken by at most (5 - 0) * 10 - 1 = 49
    # later priority-0 requests, however many keep coming.
    subs = [(5, "low")] + [(0, i) for i in range(200)]
    order = _admission_order(_engine(1, aging_window=10), subs)
    assert order.index("low") == 49
    assert order[:49] == list(range(49)) and order[50:] == list(range(49, 200))


def test_aging_under_a_stream_submitted_from_callbacks():
    # A stream of urgent requests, each submitted when the previous one finishes,
    # never lets the queue empty; the low-priority request still gets through.
    engine = _engine(1, aging_window=4)
    order = []

    def urgent(seq):
        order.append("urgent")
        if len(order) < 100:
            engine.submit_request([1], 1, priority=-3, callback=urgent)

    engine.submit_request([1], 1, priority=-3, callback=urgent)  # submission 0
    engine.submit_request([1], 1, priority=3, callback=lambda seq: order.append("low"))  # 1
    engine.run()
    # Overtaken only by submissions 2 .. 1 + (3 - -3) * 4 - 1 = 24, i.e. 23 of them,
    # after the one urgent request that was ahead of it anyway.
    assert order.index("low") == 1 + 23
    assert order.count("urgent") == 99 and len(order) == 100


def test_bad_aging_window():
    with pytest.raises(ValueError, match="aging_window"):
        _engine(1, aging_window=0)


def test_max_queue_raises_at_once_and_queues_nothing():
    engine = _engine(1, max_queue=2)
    engine.submit_request([1], 1)
    engine.submit_request([2], 1)
    with pytest.raises(QueueFullError) as info:
        engine.submit_request([3], 1, request_id="x")
    assert info.value.code == "queue_full"
    assert engine.num_queued == 2
    engine.step()  # one admitted -> room for one more
    h = engine.submit_request([3], 1, request_id="x")  # the refused id was never taken
    engine.run()
    assert h.finish_reason == "length" and engine.model.calls == 3


def test_duplicate_request_id_in_flight_is_rejected_then_reusable():
    engine = _engine(2)
    a = engine.submit_request([1], 3, request_id="r1")
    with pytest.raises(DuplicateRequestError) as info:
        engine.submit_request([2], 3, request_id="r1")
    assert isinstance(info.value, ValueError) and info.value.code == "duplicate_request"
    assert engine.num_queued == 1
    engine.step()
    with pytest.raises(ValueError, match="already queued or running"):
        engine.submit_request([2], 3, request_id="r1")  # running counts too
    engine.run()
    b = engine.submit_request([2], 3, request_id="r1")  # finished: the id is free again
    engine.run()
    assert a.finish_reason == b.finish_reason == "length" and a.result() != b.result()


def test_auto_request_ids_are_unique_and_avoid_caller_ids():
    engine = _engine(2)
    engine.submit_request([1], 1, request_id="req-1")
    ids = {engine.submit_request([1], 1).request_id for _ in range(5)} | {"req-1"}
    assert len(ids) == 6
    engine.run()


def test_int_request_ids_and_cancel_by_int():
    engine = _engine(1)
    engine.submit_request([1], 5, request_id=7)
    h = engine.submit_request([1], 5, request_id=8)
    assert engine.cancel(8) is True and engine.cancel("8") is False
    engine.run()
    assert h.finish_reason == "cancelled"


def test_batch_size_and_max_queue_validated():
    for bad in (0, -1, 1.5, "2", True, None):
        with pytest.raises(ValueError, match="batch_size"):
            BatchInferenceEngine(SimulatedLLM(), bad)
    with pytest.raises(ValueError, match="max_queue"):
        _engine(1, max_queue=0)
    with pytest.raises(ValueError, match="next_tokens"):
        BatchInferenceEngine(object(), 1)
