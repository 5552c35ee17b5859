"""Scheduling: the order queued requests are admitted in, and when (the policy).

Queue order (DESIGN.md): FIFO; with priorities, lower value first and FIFO
within a level; aging so that nothing starves.

Aging is counted in submissions, not wall time, so it is deterministic and
testable. A request with priority ``p`` that is the ``s``-th submission gets
the sort key ``s + p * aging_window``; the queue admits the smallest key
(ties cannot happen: ``s`` is unique). Equivalently, a waiting request's
priority improves by one level for every ``aging_window`` requests submitted
after it. The bound this gives:

    A request of priority ``p`` can be overtaken only by requests submitted
    fewer than ``(p - q) * aging_window`` submissions after it, where ``q`` is
    the overtaker's priority. So it is overtaken by at most
    ``(p - q_min) * aging_window - 1`` later requests in total (``q_min`` the
    most urgent priority among them), and waits for at most that many
    admissions plus the requests already ahead of it when it arrived.

With the default window (1000) a burst of fewer than 1000 requests is
always served in strict priority order; aging only matters for sustained
streams of more urgent work. The same key-shift idea is the classic
"aging" of priority schedulers (e.g. Silberschatz, *Operating System
Concepts*, ch. 5); the form here is linear in submissions.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque

from worker.request import Request, RequestState

DEFAULT_AGING_WINDOW = 1000
"""Submissions per priority level of aging (see the module docstring for the bound)."""


class Policy(str, enum.Enum):
    """When queued requests may enter free slots.

    - ``CONTINUOUS``: every iteration, into any free slot (iteration-level
      batching, Yu et al., "Orca", OSDI 2022).
    - ``STATIC``: only when every slot is free; the batch then runs until its
      last request ends (classic request-level batching).
    """

    CONTINUOUS = "continuous"
    STATIC = "static"

    def admissible(self, num_free: int, num_running: int) -> int:
        """How many queued requests may be admitted now."""
        if self is Policy.STATIC and num_running:
            return 0
        return num_free


class RequestQueue:
    """Queued requests by priority with aging; see the module docstring.

    Not thread-safe: the engine calls it under its lock. Removal of a queued
    request (cancel, deadline) is lazy: :meth:`discard` only fixes the count,
    and :meth:`pop` skips entries that are no longer QUEUED.

    Two sorted stores, the answer is the smaller head: a deque for entries
    that arrive in key order -- every entry when all priorities are equal,
    so plain FIFO costs O(1) -- and a heap for the rest (O(log n)).
    """

    __slots__ = ("aging_window", "_fifo", "_heap", "_submitted", "_live")

    def __init__(self, aging_window: int = DEFAULT_AGING_WINDOW) -> None:
        if type(aging_window) is not int or aging_window < 1:
            raise ValueError(f"aging_window must be an int >= 1, got {aging_window!r}")
        self.aging_window = aging_window
        self._fifo: deque[tuple[int, int, Request]] = deque()  # keys ascending
        self._heap: list[tuple[int, int, Request]] = []
        self._submitted = 0
        self._live = 0

    def __len__(self) -> int:
        """Number of requests waiting (QUEUED)."""
        return self._live

    def push(self, req: Request) -> None:
        s = self._submitted
        self._submitted = s + 1
        entry = (s + req.priority * self.aging_window, s, req)
        if not self._fifo or entry[0] >= self._fifo[-1][0]:
            self._fifo.append(entry)  # (equal keys: the later s sorts after, as it should)
        else:
            heapq.heappush(self._heap, entry)
        self._live += 1

    def pop(self, n: int) -> list[Request]:
        """Remove and return up to ``n`` waiting requests, best first (state still QUEUED)."""
        out: list[Request] = []
        fifo, heap = self._fifo, self._heap
        while len(out) < n and (fifo or heap):
            if heap and (not fifo or heap[0] < fifo[0]):
                req = heapq.heappop(heap)[2]
            else:
                req = fifo.popleft()[2]
            if req.state is RequestState.QUEUED:
                out.append(req)
        self._live -= len(out)
        return out

    def discard(self, req: Request) -> None:
        """Account for a QUEUED request that is being ended elsewhere (lazy removal).

        The caller changes its state away from QUEUED; when the queue holds
        mostly such dead entries it is compacted, so memory stays
        proportional to the live requests.
        """
        self._live -= 1
        if len(self._fifo) + len(self._heap) > 64 + 2 * self._live:
            keep = [e for e in self._fifo if e[2].state is RequestState.QUEUED and e[2] is not req]
            self._fifo = deque(keep)
            self._heap = [e for e in self._heap
                          if e[2].state is RequestState.QUEUED and e[2] is not req]
            heapq.heapify(self._heap)


class Deadlines:
    """The ``timeout_s`` deadlines of queued and running requests, soonest first.

    A heap with lazy deletion: the entry of a request that ended otherwise
    stays until it expires, or until such entries outnumber the live
    requests (then the heap is rebuilt), so memory stays proportional to the
    requests in flight. Not thread-safe: the engine calls it under its lock.
    """

    __slots__ = ("_heap", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # tie-break: never compare Requests

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.deadline, next(self._order), req))

    def expired(self, now: float, num_in_flight: int) -> list[Request]:
        """Remove and return the QUEUED or RUNNING requests whose deadline is <= ``now``."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if req.state is RequestState.QUEUED or req.state is RequestState.RUNNING:
                out.append(req)
        if len(heap) > 64 and len(heap) > 2 * num_in_flight:
            heap[:] = [e for e in heap if e[2].state is not RequestState.FINISHED]
            heapq.heapify(heap)
        return out
