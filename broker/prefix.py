"""Prefix-aware dispatch: which worker most likely holds a request's prompt prefix in its KV cache.

The broker keeps, per worker, an approximate radix tree of the prompts it
recently sent there (:class:`PrefixTree`), as SGLang's cache-aware router
does (``sgl-router``'s ``cache_aware`` policy: one approximate tree per
worker, fed by the requests routed to it, LRU-evicted to a size bound). It
is approximate: a worker's own prefix cache may have evicted what the tree
still holds, or hold what the tree forgot. We chose this over workers
reporting their block hashes (NVIDIA Dynamo's KV events) because it costs
no wire message, no protocol change and nothing on the worker's hot loop,
and works for text and chat prompts, which the broker never tokenizes: a
token-id prompt is keyed by its ids, a text prompt by its characters, a
chat prompt by a canonical rendering of its messages (role and content
with separators that cannot occur in either's boundary, so two renderings
share a prefix exactly when their message lists do, up to the last shared
message's shared characters). The three kinds live in separate trees.

The choice (:meth:`PrefixRouter.choose`), among workers with a credit that
are not suspect, is:

1. workers with a free slot before workers with only a prefetch credit, so
   a request never waits in one worker's prefetch while another's slot is
   idle;
2. then the longest expected cached prefix, counted only from
   :data:`MIN_MATCH` units (a shorter match is worth no cache block, and
   every prompt of a chat shares its first few characters);
3. then the most free slots (today's :meth:`~broker.registry.WorkerRegistry.pick`),
   then the earliest registered.

So with nothing shared (every score 0) it is exactly the credit-only
dispatch; the queue's order is never changed (the head request is always
the one dispatched, so nothing starves). Prompts shorter than
:data:`MIN_MATCH` skip the trees entirely (the zero-cost benchmark's short
prompts pay one length check).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from protocol.request import RequestParams

MIN_MATCH = 16
"""Fewest shared units (token ids, or characters for text and chat prompts) that count as a match:
a worker's cache block is 16 tokens, and a character is at most one token."""

MAX_KEY = 8192
"""Units of a prompt kept as its key (its first ones): a longer shared prefix rarely changes the choice,
and this bounds the cost of one insertion."""

TREE_UNITS = 262_144
"""Units each worker's tree holds per prompt kind before LRU leaves are evicted
(to :data:`EVICT_TO` of it): ~2 MiB of references for token ids, ~256 KiB of text."""

EVICT_TO = 0.75
"""Fraction of :data:`TREE_UNITS` an eviction brings a tree down to (so evictions are rare, amortised)."""

_RS, _US = "\x1e", "\x1f"  # record / unit separators of the chat rendering


def prompt_key(params: RequestParams) -> tuple[int, tuple | str] | None:
    """``(kind, key)`` of a request's prompt, or None when it is shorter than :data:`MIN_MATCH` units.

    ``kind``: 0 token ids (``key`` a tuple of ints), 1 text (a str), 2 chat
    messages (a str rendering). At most :data:`MAX_KEY` units.
    """
    prompt = params.prompt
    if type(prompt) is str:
        kind, key = 1, prompt
    elif type(prompt[0]) is int:
        kind, key = 0, prompt
    else:
        kind, key = 2, "".join(f"{_RS}{m.role}{_US}{m.content}" for m in prompt)
    if len(key) < MIN_MATCH:
        return None
    return kind, key[:MAX_KEY]


def _common(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of ``a`` and ``b`` (binary search over C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("label", "children", "parent", "used")

    def __init__(self, label: Sequence, parent: _Node | None, used: int) -> None:
        self.label = label  # the edge from the parent (a tuple slice or str slice)
        self.children: dict = {}  # first unit of a child's label -> child
        self.parent = parent
        self.used = used  # logical clock of the last insertion or match through it


class PrefixTree:
    """A radix tree of sequences (tuples of ints, or strs) with LRU eviction of leaves.

    ``max_units``: total label length (units) kept; past it, least recently
    used leaves are removed until :data:`EVICT_TO` of it remains. Memory
    is O(units stored). :meth:`match` and :meth:`insert` cost O(depth + log(len))
    slice comparisons.
    """

    def __init__(self, max_units: int = TREE_UNITS) -> None:
        if type(max_units) is not int or max_units < 1:
            raise ValueError(f"max_units must be an int >= 1, got {max_units!r}")
        self.max_units = max_units
        self.units = 0
        self._clock = 0
        self._root = _Node((), None, 0)

    def match(self, seq: Sequence) -> int:
        """Length of the longest prefix of ``seq`` in the tree (recency is only moved by :meth:`insert`)."""
        node, at = self._root, 0
        while at < len(seq):
            child = node.children.get(seq[at])
            if child is None:
                break
            label = child.label
            k = _common(label, seq[at:at + len(label)])
            at += k
            if k < len(label):
                break
            node = child
        return at

    def insert(self, seq: Sequence) -> None:
        """Add ``seq`` (every prefix of it then matches); evicts LRU leaves past ``max_units``."""
        self._clock += 1
        clock = self._clock
        node, at = self._root, 0
        while at < len(seq):
            child = node.children.get(seq[at])
            if child is None:
                node.children[seq[at]] = _Node(seq[at:], node, clock)
                self.units += len(seq) - at
                break
            label = child.label
            k = _common(label, seq[at:at + len(label)])
            child.used = clock
            if k < len(label):  # split the edge at k
                mid = _Node(label[:k], node, clock)
                node.children[seq[at]] = mid
                child.label, child.parent = label[k:], mid
                mid.children[label[k]] = child
                child = mid
            node, at = child, at + k
        if self.units > self.max_units:
            self._evict(int(self.max_units * EVICT_TO))

    def _evict(self, target: int) -> None:
        """Remove least recently used leaves until at most ``target`` units remain."""
        heap = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.parent is not None:
                heap.append((n.used, id(n), n))
        heapq.heapify(heap)
        while heap and self.units > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.label[0]]
            self.units -= len(leaf.label)
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.used, id(parent), parent))


class PrefixRouter:
    """Per worker (by identity), a :class:`PrefixTree` per prompt kind of what was sent there.

    ``tree_units``: each tree's bound (see :class:`PrefixTree`).
    """

    def __init__(self, tree_units: int = TREE_UNITS) -> None:
        self.tree_units = tree_units
        self._trees: dict[bytes, tuple[PrefixTree, PrefixTree, PrefixTree]] = {}

    def choose(self, workers: Sequence, key: tuple[int, Sequence] | None):
        """The worker (a :class:`~broker.registry.WorkerState`) to send a request keyed ``key``
        (from :func:`prompt_key`) to, or None when none of ``workers`` has a credit; see the module
        docstring for the order. ``workers`` in registration order."""
        best, best_rank = None, None
        for w in workers:
            if w.credits <= 0 or w.suspect:
                continue
            score = 0
            if key is not None:
                trees = self._trees.get(w.identity)
                if trees is not None:
                    score = trees[key[0]].match(key[1])
                    if score < MIN_MATCH:
                        score = 0
            free = w.free_slots
            rank = (free > 0, score, free)
            if best_rank is None or rank > best_rank:
                best, best_rank = w, rank
        return best

    def sent(self, identity: bytes, key: tuple[int, Sequence] | None) -> None:
        """Record that a request keyed ``key`` went to the worker ``identity``."""
        if key is None:
            return
        trees = self._trees.get(identity)
        if trees is None:
            n = self.tree_units
            trees = self._trees[identity] = (PrefixTree(n), PrefixTree(n), PrefixTree(n))
        trees[key[0]].insert(key[1])

    def forget(self, identity: bytes) -> None:
        """The worker left (or re-registered, dropping its cache): drop its trees."""
        self._trees.pop(identity, None)

    def units(self, identity: bytes) -> int:
        """Units held for the worker ``identity`` over its trees (0 if none)."""
        trees = self._trees.get(identity)
        return sum(t.units for t in trees) if trees else 0
