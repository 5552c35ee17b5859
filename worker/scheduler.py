"""Scheduling: the order queued requests are admitted in, when (the policy), and
the ledger of requests in flight (:class:`InFlight`).

Queue order (DESIGN.md): FIFO; with priorities, lower value first and FIFO
within a level; aging so that nothing starves.

Aging is counted in submissions, not wall time, so it is deterministic and
testable. A request with priority ``p`` that is the ``s``-th submission gets
the sort key ``s + p * aging_window``; the queue admits the smallest key,
and among equal keys the earliest submission. Equivalently, a waiting request's
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
from typing import Callable

from protocol.enums import FinishReason
from worker.errors import DuplicateRequestError, ModelError, QueueFullError
from worker.request import Request, RequestState

QUEUED, RUNNING, ENDING, FINISHED = (RequestState.QUEUED, RequestState.RUNNING,
                                     RequestState.ENDING, RequestState.FINISHED)

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

    Two sorted stores, the answer is the smaller head: a deque for requests
    that arrive in key order -- those whose priority is no more urgent than
    the last one's, so with equal priorities plain FIFO costs O(1) and
    computes no key -- and a heap of ``(key, s, request)`` for the rest
    (O(log n)). ``request.order`` is its submission number ``s``.
    """

    __slots__ = ("aging_window", "_fifo", "_heap", "_orders", "_live")

    def __init__(self, aging_window: int = DEFAULT_AGING_WINDOW) -> None:
        if type(aging_window) is not int or aging_window < 1:
            raise ValueError(f"aging_window must be an int >= 1, got {aging_window!r}")
        self.aging_window = aging_window
        self._fifo: deque[Request] = deque()  # keys ascending
        self._heap: list[tuple[int, int, Request]] = []
        self._orders = itertools.count()  # submission numbers
        self._live = 0  # QUEUED entries (one int: the loop reads it without the lock)

    def __len__(self) -> int:
        """Number of requests waiting (QUEUED)."""
        return self._live

    def push(self, req: Request) -> None:
        req.order = s = next(self._orders)
        fifo = self._fifo
        # A later submission with a priority no more urgent has a larger key.
        if not fifo or req.priority >= fifo[-1].priority:
            fifo.append(req)
        else:
            heapq.heappush(self._heap, (s + req.priority * self.aging_window, s, req))
        self._live += 1

    def pop(self, n: int) -> list[Request]:
        """Remove and return up to ``n`` waiting requests, best first (state still QUEUED)."""
        fifo, heap = self._fifo, self._heap
        if not heap and len(fifo) == self._live:  # plain FIFO, no ended entries to skip
            popleft = fifo.popleft
            out = [popleft() for _ in range(min(n, len(fifo)))]
        else:
            out = []
            window = self.aging_window
            while len(out) < n and (fifo or heap):
                if fifo:
                    first = fifo[0]
                    s = first.order
                    if not heap or heap[0][:2] > (s + first.priority * window, s):
                        req = fifo.popleft()
                    else:
                        req = heapq.heappop(heap)[2]
                else:
                    req = heapq.heappop(heap)[2]
                if req.state is QUEUED:
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
            self._fifo = deque(r for r in self._fifo if r.state is QUEUED and r is not req)
            self._heap = [e for e in self._heap if e[2].state is QUEUED and e[2] is not req]
            heapq.heapify(self._heap)


class Deadlines:
    """The ``timeout_s`` deadlines of queued and running requests, soonest first.

    ``heap`` holds ``(deadline, n, request)``; the engine reads it without the
    lock only to skip the check when it is empty. Lazy deletion: the entry
    of a request that ended otherwise stays until it expires, or until such
    entries outnumber the live requests (then the heap is rebuilt), so
    memory stays proportional to the requests in flight. Not thread-safe:
    the engine calls it under its lock.
    """

    __slots__ = ("heap", "_order")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # tie-break: never compare Requests

    def __bool__(self) -> bool:
        return bool(self.heap)

    def add(self, req: Request) -> None:
        heapq.heappush(self.heap, (req.deadline, next(self._order), req))

    def expired(self, now: float, num_in_flight: int) -> list[Request]:
        """Remove and return the QUEUED or RUNNING requests whose deadline is <= ``now``."""
        out = []
        heap = self.heap
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if req.state is QUEUED or req.state is RUNNING:
                out.append(req)
        if len(heap) > 64 and len(heap) > 2 * num_in_flight:
            heap[:] = [e for e in heap if e[2].state is not FINISHED]
            heapq.heapify(heap)
        return out


class InFlight:
    """Every request the engine accepted and has not finished: by id, queued, with deadlines.

    The engine's lifecycle bookkeeping; not thread-safe (the engine calls it
    under its lock). ``by_id`` holds QUEUED, RUNNING and ENDING requests --
    what ``cancel`` and the duplicate-id check see; a request leaves it
    exactly when it becomes FINISHED. ``pending`` holds the ends decided
    between iterations (cancel, deadline, a failed model call or
    ``on_token``), which the engine carries out at the start of the next one.
    """

    __slots__ = ("by_id", "queue", "deadlines", "pending", "max_queue", "_ids")

    def __init__(self, aging_window: int, max_queue: int | None) -> None:
        self.by_id: dict[object, Request] = {}
        self.queue = RequestQueue(aging_window)
        self.deadlines = Deadlines()
        self.pending: list[tuple[Request, FinishReason, BaseException | None]] = []
        self.max_queue = max_queue
        self._ids = map("req-{}".format, itertools.count())  # "req-0", "req-1", ...

    def add(self, req: Request) -> None:
        """Give ``req`` an id when it has none, and queue it.

        Raises DuplicateRequestError when its id is in flight, QueueFullError
        at ``max_queue``; nothing changes then.
        """
        by_id = self.by_id
        rid = req.request_id
        if rid is None:
            rid = next(self._ids)
            while rid in by_id:  # a caller may have picked this form of id
                rid = next(self._ids)
            req.request_id = rid
        elif rid in by_id:
            raise DuplicateRequestError(f"request_id {rid!r} is already queued or running; "
                                        "use a new id, or cancel the old request first")
        if self.max_queue is not None and len(self.queue) >= self.max_queue:
            raise QueueFullError(f"queue is full ({self.max_queue} requests waiting); retry later")
        by_id[rid] = req
        self.queue.push(req)
        if req.deadline is not None:
            self.deadlines.add(req)

    def cancel(self, request_id) -> bool:
        """Mark a QUEUED or RUNNING request to end as cancelled; False when there is none."""
        req = self.by_id.get(request_id)
        if req is None or req.state is not QUEUED and req.state is not RUNNING:
            return False
        if req.state is QUEUED:
            self.queue.discard(req)
        req.state = ENDING
        self.pending.append((req, FinishReason.CANCELLED, None))
        return True

    def admit(self, n: int) -> list[Request]:
        """Take up to ``n`` queued requests, best first, and mark them RUNNING."""
        new = self.queue.pop(n)
        for req in new:
            req.state = RUNNING
        return new

    def commit(self, finished: list[Request]) -> list[Request]:
        """Make an iteration's finishes final (a later cancel returns False); return them.

        A request cancelled while the model ran ends as cancelled instead
        (its cancel already returned True): it is left out.
        """
        by_id = self.by_id
        all_final = True
        for req in finished:
            if req.state is RUNNING:
                req.state = FINISHED
                del by_id[req.request_id]
            else:  # ENDING: cancelled while the model ran
                req.reason = None
                all_final = False
        return finished if all_final else [req for req in finished if req.state is FINISHED]

    def fail(self, running: list[Request], exc: Exception) -> ModelError:
        """The model raised ``exc``: mark the RUNNING ones of ``running`` to end with
        ``"error"``; return the error they carry (a ModelError caused by ``exc``)."""
        error = exc
        if not isinstance(exc, ModelError):
            error = ModelError(f"model failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        for req in running:
            if req.state is RUNNING:  # a cancelled one stays cancelled (cancel said so)
                self.pending.append((req, FinishReason.ERROR, error))
        return error

    def row_failed(self, req: Request, error: BaseException) -> None:
        """The model failed for ``req`` alone (its batch row): it ends with ``"error"``, its
        neighbours go on. ``error`` becomes a ModelError (its ``__cause__`` when wrapped)."""
        if not isinstance(error, ModelError):
            wrapped = ModelError(f"model failed for this request: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self.stream_failed(req, error)

    def stream_failed(self, req: Request, error: Exception) -> None:
        """``on_token`` raised: ``req`` ends with ``"error"`` (now, if it just finished)."""
        if req.state is RUNNING:
            req.state = ENDING
            self.pending.append((req, FinishReason.ERROR, error))
        elif req.state is FINISHED:
            req.reason = FinishReason.ERROR
        if req.error is None:
            req.error = error

    def take_ended(self, clock: Callable[[], float]) -> list[Request]:
        """Carry out the pending ends and the deadlines passed on ``clock``; return those requests.

        They become FINISHED with their reason and leave ``by_id``; the
        engine then runs their callbacks and frees their slots.
        """
        pending = self.pending
        if self.deadlines:
            for req in self.deadlines.expired(clock(), len(self.by_id)):
                if req.state is QUEUED:
                    self.queue.discard(req)
                pending.append((req, FinishReason.DEADLINE, None))
        ended = []
        for req, reason, error in pending:
            if req.state is not FINISHED:
                req.state, req.reason = FINISHED, reason
                if req.error is None:
                    req.error = error
                del self.by_id[req.request_id]
                ended.append(req)
        pending.clear()
        return ended
