"""The request queue: priorities with aging, a head lane, a bound, lazy removal.

One implementation, used by the engine (queued requests of one engine) and
by the broker (queued requests of one model).

Order (docs/architecture.md, "The in-process engine"): FIFO; with
priorities, lower value first (vLLM's convention) and FIFO within a level;
aging so that nothing starves. Aging is
counted in pushes, not wall time, so it is deterministic and testable: the
``s``-th request pushed (counting every push) gets the rank ``s + priority * aging_window``;
the lowest rank leaves first, ties in push order. Equivalently, a waiting
request's priority improves by one level for every ``aging_window`` requests
pushed after it. The bound this gives:

    A request of priority ``p`` can be overtaken only by requests pushed
    fewer than ``(p - q) * aging_window`` pushes after it, where ``q`` is
    the overtaker's priority. So it is overtaken by at most
    ``(p - q_min) * aging_window - 1`` later requests in total, and waits
    for at most that many plus the requests already ahead of it.

With the default window (1000) a burst of fewer than 1000 requests is always
served in strict priority order. The key shift is the classic "aging" of
priority schedulers (e.g. Silberschatz, *Operating System Concepts*, ch. 5);
the form here is linear in submissions.

Requests pushed with :meth:`PriorityQueue.push_head` (the broker's
migrated requests: already admitted once, their client mid-stream) leave
before every ranked one, in the order they came.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Protocol, TypeVar

from protocol.defaults import AGING_WINDOW


class Queueable(Protocol):
    """What the queue needs of an item: a ``queue_seq`` attribute it may set
    (the item's ticket while queued, None otherwise)."""

    queue_seq: int | None


T = TypeVar("T", bound=Queueable)


class PriorityQueue(Generic[T]):
    """Queued items by rank (see the module docstring); not thread-safe.

    - ``aging_window``: pushes per priority level of aging (int >= 1).
    - ``max_size``: bound on ranked items (``push`` refuses beyond it; the head
      lane is not bounded: what goes there was admitted once already), or None.

    An item is queued while its ``queue_seq`` holds the ticket the queue gave
    it; :meth:`remove` clears it and the stale entry is skipped when it
    surfaces (removal O(1); stale entries are purged once they dominate). An
    item removed is not pushed again (the engine and the broker end it).
    Two sorted stores hold the ranked items, and the next one is the smaller
    head: a deque for items that arrive in rank order -- with equal
    priorities, plain FIFO at O(1) -- and a heap for the rest (O(log n)).
    The deque holds the items themselves, their ranks in a second deque
    beside it: no tuple per request (each queued request used to carry one,
    and the garbage collector with it; measured on bench/engine.py).
    """

    __slots__ = ("aging_window", "max_size", "_pushed", "_fifo", "_fifo_ranks", "_heap", "_head", "_live")

    def __init__(self, aging_window: int = AGING_WINDOW, max_size: int | None = None) -> None:
        if type(aging_window) is not int or aging_window < 1:
            raise ValueError(f"aging_window must be an int >= 1, got {aging_window!r}")
        if max_size is not None and (type(max_size) is not int or max_size < 1):
            raise ValueError(f"max_size must be None or an int >= 1, got {max_size!r}")
        self.aging_window = aging_window
        self.max_size = max_size
        self._pushed = 0  # pushes so far: the next ticket, and the s of the next rank
        self._fifo: deque[T] = deque()            # items, ascending (rank, ticket)
        self._fifo_ranks: deque[int] = deque()    # their ranks
        self._heap: list[tuple[int, int, T]] = []
        self._head: deque[tuple[int, T]] = deque()       # (ticket, item)
        self._live = 0  # queued items, stale entries excluded

    def __len__(self) -> int:
        """Number of items queued."""
        return self._live

    def full(self) -> bool:
        """True when ``push`` would refuse."""
        return self.max_size is not None and self._live >= self.max_size

    def push(self, item: T, priority: int) -> bool:
        """Queue ``item`` by rank; False (nothing queued) when the queue is full."""
        if self.max_size is not None and self._live >= self.max_size:
            return False
        ticket = item.queue_seq = self._pushed  # (as _ticket does; inline: once per request)
        self._pushed = ticket + 1
        self._live += 1
        rank = ticket + priority * self.aging_window
        ranks = self._fifo_ranks
        if not ranks or rank >= ranks[-1]:  # arrives in rank order (e.g. the same priority): O(1)
            self._fifo.append(item)
            ranks.append(rank)
        else:
            heapq.heappush(self._heap, (rank, ticket, item))
        return True

    def push_many(self, items: list[T], priority: int) -> bool:
        """:meth:`push` each of ``items`` with ``priority``, in order; False (nothing queued) when
        they do not all fit. Items arriving in rank order (the queue's common case: one priority)
        join the FIFO store in two ``extend`` calls, their tickets given in one tight loop: a
        broker's ``submit`` queues hundreds at once."""
        n = len(items)
        if self.max_size is not None and self._live + n > self.max_size:
            return False
        ranks = self._fifo_ranks
        start = self._pushed
        first = start + priority * self.aging_window  # (ranks grow by one per push: in order if the first is)
        if ranks and first < ranks[-1]:
            for item in items:
                self.push(item, priority)
            return True
        for ticket, item in enumerate(items, start):
            item.queue_seq = ticket
        self._pushed = start + n
        self._live += n
        self._fifo.extend(items)
        ranks.extend(range(first, first + n))
        return True

    def push_head(self, item: T) -> None:
        """Queue ``item`` ahead of every ranked item (after earlier head items)."""
        self._head.append((self._ticket(item), item))

    def pop(self) -> T | None:
        """Remove and return the next item, or None when empty."""
        head, fifo, heap = self._head, self._fifo, self._heap
        while head:
            ticket, item = head.popleft()
            if item.queue_seq == ticket:
                return self._take(item)
        ranks = self._fifo_ranks
        while fifo or heap:
            if fifo and fifo[0].queue_seq is None:  # removed: drop the stale entry
                fifo.popleft()
                ranks.popleft()
            elif fifo and (not heap or (ranks[0], fifo[0].queue_seq) < heap[0][:2]):
                ranks.popleft()
                return self._take(fifo.popleft())
            else:
                _, ticket, item = heapq.heappop(heap)
                if item.queue_seq == ticket:
                    return self._take(item)
        return None

    def pop_many(self, n: int) -> list[T]:
        """Remove and return up to ``n`` items, best first."""
        if self._head or self._heap:
            out = []
            while len(out) < n and self._live:
                out.append(self.pop())
            return out
        out, fifo, ranks = [], self._fifo, self._fifo_ranks  # plain FIFO, the common case
        while fifo and len(out) < n:
            ranks.popleft()
            item = fifo.popleft()
            if item.queue_seq is not None:
                item.queue_seq = None
                out.append(item)
        self._live -= len(out)
        return out

    def remove(self, item: T) -> bool:
        """Drop ``item`` if it is queued here (cancel, deadline); True if it was."""
        if item.queue_seq is None:
            return False
        item.queue_seq = None
        self._live -= 1
        stored = len(self._fifo) + len(self._heap) + len(self._head)
        if stored > 64 and stored > 4 * self._live:  # mostly stale: rebuild (bounded memory)
            live = [(i, r) for i, r in zip(self._fifo, self._fifo_ranks) if i.queue_seq is not None]
            self._fifo = deque(i for i, _ in live)
            self._fifo_ranks = deque(r for _, r in live)
            self._heap = [e for e in self._heap if e[2].queue_seq == e[1]]
            heapq.heapify(self._heap)
            self._head = deque(e for e in self._head if e[1].queue_seq == e[0])
        return True

    def __iter__(self):
        """Queued items: head lane first, then the ranked ones in no particular order."""
        for ticket, item in self._head:
            if item.queue_seq == ticket:
                yield item
        for item in self._fifo:
            if item.queue_seq is not None:
                yield item
        for _, ticket, item in self._heap:
            if item.queue_seq == ticket:
                yield item

    def _ticket(self, item: T) -> int:
        """The item's ticket (``queue_seq``); an item is queued at most once at a time."""
        ticket = item.queue_seq = self._pushed
        self._pushed = ticket + 1
        self._live += 1
        return ticket

    def _take(self, item: T) -> T:
        item.queue_seq = None
        self._live -= 1
        return item
