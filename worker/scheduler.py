"""Scheduling: when queued requests are admitted (the policy), and the ledger of
requests in flight (:class:`InFlight`). The order they are admitted in is
:class:`protocol.queue.PriorityQueue`'s (priorities, FIFO within a level, aging),
shared with the broker.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import Callable

from protocol.enums import FinishReason
from protocol.queue import PriorityQueue
from worker.errors import DuplicateRequestError, ModelError, QueueFullError
from worker.request import Request, RequestState

QUEUED, RUNNING, ENDING, FINISHED = (RequestState.QUEUED, RequestState.RUNNING,
                                     RequestState.ENDING, RequestState.FINISHED)


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
        self.queue: PriorityQueue[Request] = PriorityQueue(aging_window, max_queue)
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
        if not self.queue.push(req, req.params.priority):
            raise QueueFullError(f"queue is full ({self.max_queue} requests waiting); retry later")
        by_id[rid] = req
        if req.deadline is not None:
            self.deadlines.add(req)

    def cancel(self, request_id) -> bool:
        """Mark a QUEUED or RUNNING request to end as cancelled; False when there is none."""
        req = self.by_id.get(request_id)
        if req is None or req.state is not QUEUED and req.state is not RUNNING:
            return False
        self.queue.remove(req)  # (when queued)
        req.state = ENDING
        self.pending.append((req, FinishReason.CANCELLED, None))
        return True

    def admit(self, n: int) -> list[Request]:
        """Take up to ``n`` queued requests, best first, and mark them RUNNING."""
        new = self.queue.pop_many(n)
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
        if req._error is None:
            req._error = error

    def take_ended(self, clock: Callable[[], float]) -> list[Request]:
        """Carry out the pending ends and the deadlines passed on ``clock``; return those requests.

        They become FINISHED with their reason and leave ``by_id``; the
        engine then runs their callbacks and frees their slots.
        """
        pending = self.pending
        if self.deadlines:
            for req in self.deadlines.expired(clock(), len(self.by_id)):
                self.queue.remove(req)  # (when queued)
                pending.append((req, FinishReason.DEADLINE, None))
        ended = []
        for req, reason, error in pending:
            if req.state is not FINISHED:
                req.state, req.reason = FINISHED, reason
                if req._error is None:
                    req._error = error
                del self.by_id[req.request_id]
                ended.append(req)
        pending.clear()
        return ended
