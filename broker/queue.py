"""One model's request queue in the broker: FIFO with priorities and aging, a
migration lane at the head, a bound, and lazy removal.

Order: the same rule as the engine's scheduler (``worker/scheduler.py``; the
broker may not import ``worker``, so the rule is restated here). The ``s``-th
request submitted to this queue gets the rank ``s + priority *
aging_window``; the lowest rank runs first. Within one priority level that is
FIFO; a lower priority value (vLLM's convention: lower runs first) goes ahead
of requests submitted fewer than ``aging_window`` submissions per priority
step before it; and waiting ages a request (newer arrivals get larger ranks),
so nothing starves: a request is overtaken by at most ``(p - q_min) *
aging_window`` later requests. Counting in submissions, not wall time, keeps
the order deterministic; with the default window (1000) a burst of fewer
than 1000 requests is served in strict priority order. Because a rank never
changes, a binary heap keeps the order in O(log n) per operation.

Requeued (migrated) requests go to a separate head lane served before the
heap, in the order they were requeued: they were already admitted, and the
client is mid-stream on them.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Iterator, Protocol, TypeVar

DEFAULT_AGING_WINDOW = 1000
"""Submissions per priority level of aging (the engine's default too)."""


class Queueable(Protocol):
    """What the queue needs from an entry: a mutable ``queue_seq``, the entry's
    ticket while it is queued (None when it is not)."""

    queue_seq: int | None


T = TypeVar("T", bound=Queueable)


class RequestQueue(Generic[T]):
    """Priority queue of jobs with a bound (``max_size`` jobs, head lane excluded).

    An entry is queued while its ``queue_seq`` equals the ticket the queue
    gave it; :meth:`remove` clears the ticket and the stale heap entry is
    skipped when it surfaces (lazy deletion keeps removal O(1)).
    """

    def __init__(self, max_size: int, aging_window: int = DEFAULT_AGING_WINDOW) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if type(aging_window) is not int or aging_window < 1:
            raise ValueError(f"aging_window must be an int >= 1, got {aging_window!r}")
        self.max_size = max_size
        self.aging_window = aging_window
        self._submitted = 0
        self._heap: list[tuple[int, int, T]] = []
        self._head: deque[tuple[int, T]] = deque()
        self._next_seq = 0
        self._live = 0  # queued entries (heap + head), stale ones excluded

    def __len__(self) -> int:
        return self._live

    def full(self) -> bool:
        return self._live >= self.max_size

    def push(self, job: T, priority: int) -> bool:
        """Queue ``job`` by rank; False (nothing queued) when the queue is full."""
        if self._live >= self.max_size:
            return False
        seq = self._ticket(job)
        s = self._submitted
        self._submitted = s + 1
        heapq.heappush(self._heap, (s + priority * self.aging_window, seq, job))
        return True

    def push_head(self, job: T) -> None:
        """Queue ``job`` ahead of every ranked entry (migration); ignores the bound,
        since the job was admitted once already and must not be lost."""
        self._head.append((self._ticket(job), job))

    def pop(self) -> T | None:
        """Remove and return the next job, or None when empty."""
        while self._head:
            seq, job = self._head.popleft()
            if job.queue_seq == seq:
                return self._take(job)
        while self._heap:
            _, seq, job = heapq.heappop(self._heap)
            if job.queue_seq == seq:
                return self._take(job)
        return None

    def remove(self, job: T) -> bool:
        """Drop ``job`` if it is queued here (cancel, deadline); True if it was."""
        if job.queue_seq is None:
            return False
        job.queue_seq = None
        self._live -= 1
        self._compact()
        return True

    def __iter__(self) -> Iterator[T]:
        """Live jobs, head lane first, heap in no particular order."""
        for seq, job in self._head:
            if job.queue_seq == seq:
                yield job
        for _, seq, job in self._heap:
            if job.queue_seq == seq:
                yield job

    def _ticket(self, job: T) -> int:
        assert job.queue_seq is None, "a job is queued at most once"
        seq = self._next_seq
        self._next_seq += 1
        job.queue_seq = seq
        self._live += 1
        return seq

    def _take(self, job: T) -> T:
        job.queue_seq = None
        self._live -= 1
        return job

    def _compact(self) -> None:
        # Keeps memory bounded when many queued jobs are removed (a client
        # cancelling a large batch): rebuild once stale entries dominate.
        if len(self._heap) > 64 and len(self._heap) > 4 * self._live:
            self._heap = [e for e in self._heap if e[2].queue_seq == e[1]]
            heapq.heapify(self._heap)
            self._head = deque(e for e in self._head if e[1].queue_seq == e[0])
