"""The one request queue (protocol.queue), used by the engine and the broker:
priorities, FIFO within a level, aging, the head lane, the bound, lazy removal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.queue import PriorityQueue


class Item:
    def __init__(self, name):
        self.name = name
        self.queue_seq = None

    def __repr__(self):
        return f"Item({self.name!r})"


def test_fifo_within_priority_and_priority_first():
    q = PriorityQueue(max_size=100)
    items = [Item(n) for n in "abcde"]
    for it, prio in zip(items, [0, 0, -1, 1, 0]):
        assert q.push(it, prio)
    assert [q.pop().name for _ in range(5)] == ["c", "a", "b", "e", "d"]
    assert q.pop() is None and len(q) == 0


def test_aging_bounds_overtaking():
    q = PriorityQueue(aging_window=3)
    low = Item("low")
    q.push(low, 1)                       # rank 0 + 3
    for i in range(5):
        q.push(Item(f"u{i}"), 0)         # ranks 1..5
    # Only requests submitted fewer than 3 submissions after it overtake it.
    assert [q.pop().name for _ in range(6)] == ["u0", "u1", "low", "u2", "u3", "u4"]


def test_head_lane_bound_and_lazy_removal():
    q = PriorityQueue(max_size=2)
    a, b, c, d = (Item(n) for n in "abcd")
    assert q.push(a, 0) and q.push(b, 0)
    assert q.full() and not q.push(c, 0) and c.queue_seq is None  # full: refused, nothing queued
    q.push_head(d)                                                 # migration ignores the bound
    assert len(q) == 3 and {i.name for i in q} == {"a", "b", "d"}
    assert q.remove(a) and not q.remove(a)
    assert [q.pop().name, q.pop().name] == ["d", "b"]
    assert q.pop() is None


def test_compacts_after_mass_removal():
    q = PriorityQueue()
    items = [Item(i) for i in range(1000)]
    for it in items:
        q.push(it, 0)
    for it in items[:990]:
        q.remove(it)
    assert len(q) == 10 and len(q._fifo) + len(q._heap) < 100
    assert [i.name for i in q.pop_many(20)] == list(range(990, 1000))


def test_rejects_bad_config():
    for kw in ({"max_size": 0}, {"aging_window": 0}, {"aging_window": 1.5}):
        with pytest.raises(ValueError):
            PriorityQueue(**kw)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "head", "pop", "remove"]), st.integers(-3, 3),
                          st.integers(1, 4)), max_size=120),
       st.integers(1, 5))
def test_matches_a_sorted_list_oracle(ops, window):
    q = PriorityQueue(aging_window=window)
    ranked = []  # (rank, push number, item) of queued ranked items
    head = []    # queued head-lane items, in order
    n = 0        # pushes so far, head-lane ones included
    for op, prio, k in ops:
        if op == "push":
            it = Item(n)
            assert q.push(it, prio)
            ranked.append((n + prio * window, n, it))
            n += 1
        elif op == "head":
            it = Item(f"h{n}")
            q.push_head(it)
            head.append(it)
            n += 1
        elif op == "pop":
            got = q.pop_many(k)
            ranked.sort(key=lambda e: e[:2])
            want = (head + [e[2] for e in ranked])[:k]
            assert got == want
            head = [i for i in head if i not in got]
            ranked = [e for e in ranked if e[2] not in got]
        else:
            queued = head + [e[2] for e in ranked]
            if queued:
                victim = queued[k % len(queued)]
                assert q.remove(victim)
                head = [i for i in head if i is not victim]
                ranked = [e for e in ranked if e[2] is not victim]
        assert len(q) == len(head) + len(ranked)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.integers(-1, 1)),
                          st.tuples(st.just("many"), st.integers(-1, 1), st.integers(0, 4)),
                          st.just(("pop",)), st.just(("head",))), max_size=12),
       st.sampled_from([None, 3, 8]))
def test_push_many_is_push_of_each(ops, bound):
    """``push_many(items, p)`` queues as ``push(item, p)`` of each (the same order out, the same
    tickets), or nothing at all when they do not all fit."""
    def run(many):
        q, names, out = PriorityQueue(aging_window=2, max_size=bound), iter(range(1000)), []
        for op in ops:
            if op[0] == "push":
                out.append(q.push(Item(next(names)), op[1]))
            elif op[0] == "many":
                items = [Item(next(names)) for _ in range(op[2])]
                if many:
                    out.append(q.push_many(items, op[1]))
                else:
                    fits = bound is None or len(q) + len(items) <= bound
                    out.append(fits and all([q.push(it, op[1]) for it in items]))
            elif op[0] == "pop":
                it = q.pop()
                out.append(None if it is None else it.name)
            else:
                q.push_head(Item(next(names)))
        while (it := q.pop()) is not None:
            out.append(it.name)
        return out, len(q)

    assert run(True) == run(False)
