"""Prefix-aware dispatch (broker.prefix) in the socket-free core: the tree, and which worker gets a request."""

from __future__ import annotations

import random

import pytest

from broker.prefix import MIN_MATCH, PrefixTree, prompt_key
from protocol.enums import FinishReason
from protocol.messages import Finished, Iteration, Register, Submit
from protocol.request import ChatMessage, RequestParams
from tests.support.cores import C1, INFO, W1, W2, assigned, make_core
from tests.support.messages import envelope

W3 = b"worker-3"
SYSTEM = list(range(100, 164))  # a 64-token shared prefix
OTHER = list(range(500, 564))


def register(core, w, slots=2, inflight=None):
    return core.on_backend(w, Register("simulated", slots, inflight or slots, INFO, w.decode()), 0.0)


def submit(core, prompts, start=0):
    return core.on_frontend(C1, Submit("simulated", [envelope(start + i, p, 4) for i, p in enumerate(prompts)]), 0.0)


def finish(core, w, key):
    return core.on_backend(w, Iteration(ids=[key], tokens=[5], finished=[Finished(key, FinishReason.LENGTH)]), 1.0)


def where(out, *workers):
    """broker key -> worker it was assigned to."""
    return {e.request_id: w for w in workers for e in assigned(out, w)}


# ---------------------------------------------------------------------- the tree


def test_tree_matches_the_longest_inserted_prefix_for_tokens_and_text():
    t = PrefixTree()
    assert t.match((1, 2, 3)) == 0
    t.insert((1, 2, 3, 4, 5))
    t.insert((1, 2, 9))
    assert t.match((1, 2, 3, 4, 5, 6)) == 5
    assert t.match((1, 2, 3, 7)) == 3
    assert t.match((1, 2, 9, 9)) == 3
    assert t.match((2,)) == 0
    assert t.units == 6  # (1, 2) + (3, 4, 5) + (9,)
    s = PrefixTree()
    s.insert("You are a helpful assistant. Hello")
    assert s.match("You are a helpful assistant. Bye") == len("You are a helpful assistant. ")


def test_tree_against_a_brute_force_model():
    rng = random.Random(7)
    t, seen = PrefixTree(), []
    for _ in range(300):
        seq = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.5:
            t.insert(seq)
            seen.append(seq)
        want = max((next((i for i, (a, b) in enumerate(zip(s, seq)) if a != b), min(len(s), len(seq)))
                    for s in seen), default=0)
        assert t.match(seq) == want


def test_tree_stays_within_its_bound_and_evicts_the_least_recently_inserted():
    t = PrefixTree(max_units=100)
    t.insert(tuple(range(40)))                     # old
    t.insert(tuple(range(1000, 1040)))             # newer
    t.insert(tuple(range(2000, 2040)))             # newest: 120 units > 100, evict to 75
    assert t.units <= 100
    assert t.match(tuple(range(40))) == 0          # the least recent went first
    assert t.match(tuple(range(2000, 2040))) == 40
    for i in range(200):                           # many inserts: always within the bound
        t.insert(tuple(range(i * 50, i * 50 + 30)))
        assert t.units <= 100
    with pytest.raises(ValueError):
        PrefixTree(0)


def test_prompt_keys_by_kind_and_short_prompts_skip_the_trees():
    assert prompt_key(RequestParams([1, 2, 3], 4)) is None
    assert prompt_key(RequestParams(list(range(MIN_MATCH)), 4)) == (0, tuple(range(MIN_MATCH)))
    assert prompt_key(RequestParams("short", 4)) is None
    assert prompt_key(RequestParams("x" * 40, 4)) == (1, "x" * 40)
    chat = lambda *ms: RequestParams([ChatMessage(r, c) for r, c in ms], 4)
    a = prompt_key(chat(("system", "You are terse."), ("user", "Hello")))
    b = prompt_key(chat(("system", "You are terse."), ("user", "Help")))
    c = prompt_key(chat(("system", "You are terse.user"), ("user", "Hello")))
    assert a[0] == b[0] == 2
    t = PrefixTree()
    t.insert(a[1])
    assert t.match(b[1]) == len(a[1]) - 2           # shares the system message and "Hel"
    assert t.match(c[1]) < len(a[1])                 # a role boundary is not a content character


# ---------------------------------------------------------------------- dispatch


def test_a_request_goes_to_the_worker_that_got_its_prefix():
    core = make_core()
    register(core, W1, slots=4)
    register(core, W2, slots=4)
    out = submit(core, [SYSTEM + [1], OTHER + [1]])
    first = where(out, W1, W2)
    assert first == {0: W1, 1: W2}                  # nothing shared yet: most free slots, then the first
    # Each worker now has 3 free slots; the next request follows its prefix, whichever order.
    out = submit(core, [OTHER + [2], SYSTEM + [2]], start=2)
    assert where(out, W1, W2) == {2: W2, 3: W1}


def test_with_nothing_shared_dispatch_is_credit_only():
    """Random unrelated prompts, short and long, submitted and finished in random order: the
    prefix-aware core assigns every request to the same worker as the credit-only one."""
    rng = random.Random(3)
    cores = [make_core(), make_core(prefix_routing=False)]
    for c in cores:
        register(c, W1, slots=3, inflight=4)
        register(c, W2, slots=2, inflight=3)
        register(c, W3, slots=4, inflight=5)
    keys, running = 0, {}
    for _ in range(30):
        # distinct first ids: no two prompts share even a one-token prefix
        prompts = [[1000 * (keys + i) + rng.randrange(1000)] + [rng.randrange(50) for _ in range(rng.randint(0, 40))]
                   for i in range(rng.randint(1, 4))]
        outs = [submit(c, prompts, start=keys) for c in cores]
        keys += len(prompts)
        got = [where(o, W1, W2, W3) for o in outs]
        assert got[0] == got[1]
        running.update(got[0])
        for k in rng.sample(sorted(running), k=min(len(running), rng.randint(0, 3))):
            w = running.pop(k)
            got = [where(finish(c, w, k), W1, W2, W3) for c in cores]
            assert got[0] == got[1]
            running.update(got[0])


def test_a_free_slot_is_never_left_idle_for_a_prefix_in_a_prefetch_queue():
    core = make_core()
    register(core, W1, slots=1, inflight=3)
    register(core, W2, slots=1, inflight=3)
    out = submit(core, [SYSTEM + [1]])
    assert where(out, W1, W2) == {0: W1}
    # W1's slot is taken (only prefetch credits left), W2's is free: W2 gets the request, prefix or not.
    out = submit(core, [SYSTEM + [2]], start=1)
    assert where(out, W1, W2) == {1: W2}
    # Now both slots are busy: the prefix decides between the prefetch credits.
    out = submit(core, [OTHER + [3], SYSTEM + [3]], start=2)
    assert set(where(out, W1, W2).values()) <= {W1, W2} and len(where(out, W1, W2)) == 2


def test_queue_order_is_kept_and_every_request_is_dispatched():
    """A run of requests sharing one prefix fills the holder first, then the others; none waits
    while any worker has a credit (no starvation), and the keys go out in arrival order."""
    core = make_core()
    register(core, W1, slots=2)
    register(core, W2, slots=2)
    submit(core, [SYSTEM + [0]])                      # W1 holds the prefix
    out = submit(core, [SYSTEM + [i] for i in range(1, 6)], start=1)
    got = where(out, W1, W2)
    assert sorted(got) == [1, 2, 3] and got[1] == W1  # the holder's last slot first, then W2's two
    assert list(core.queues["simulated"]) != [] and len(core.queues["simulated"]) == 2
    out = finish(core, W2, 2)                         # a W2 slot frees: the queue's head goes there
    assert where(out, W1, W2) == {4: W2}


def test_a_lost_worker_takes_its_tree_with_it():
    core = make_core()
    register(core, W1, slots=4)
    register(core, W2, slots=4)
    submit(core, [SYSTEM + [0], OTHER + [0]])
    prefixes = core._workers.prefixes
    assert prefixes.units(W1) > 0 and prefixes.units(W2) > 0
    register(core, W1, slots=4)                       # re-registered: what it held is void
    assert prefixes.units(W1) == 0 and prefixes.units(W2) > 0
    # (W1's request went back to the queue and on to W2, the only worker then: nothing recorded)
    out = submit(core, [OTHER + [5]], start=10)
    assert list(where(out, W1, W2).values()) == [W2]  # W2 still has OTHER (W1 has more free slots)
    out = submit(core, [SYSTEM + [5]], start=11)
    assert list(where(out, W1, W2).values()) == [W1]  # nobody is known to hold SYSTEM: most free slots


def test_prefix_routing_off_and_its_check():
    assert make_core(prefix_routing=False)._workers.prefixes is None
    with pytest.raises(ValueError, match="prefix_routing"):
        make_core(prefix_routing=1)
