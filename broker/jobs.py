"""The requests the broker holds (:class:`Job`) and how each one ends.

Request identity: clients choose request ids, scoped per client. The broker
keys each request by ``(client identity, request id)`` and gives it a broker
``int`` key, which is the only id a worker ever sees. Keys grow with
arrival, so sorting keys restores arrival order.

Invariant (kept here): a job ends only through :meth:`JobTable.finish`,
which forgets it everywhere and counts the ending once; its client, while
attached, gets exactly one ``finished`` entry.
"""

from __future__ import annotations

import enum
import heapq
import operator
from itertools import repeat
from typing import Callable, Sequence

from broker.config import BrokerConfig
from broker.outbox import Outbox
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import Envelope, Finished, Rejected
from protocol.queue import PriorityQueue
from protocol.request import RequestId, RequestParams
from protocol.validation import echo

ENDING_COUNTER = {FinishReason.STOP: "completed", FinishReason.LENGTH: "completed",
                  FinishReason.CANCELLED: "cancelled", FinishReason.DEADLINE: "deadline",
                  FinishReason.ERROR: "errors"}
"""The counter (of ``BrokerCore.counters``) each ending counts toward."""

_count_of = operator.countOf
_tuple_new = tuple.__new__  # a record built without its Python __new__ (its fields given in full)
_PRIORITY = RequestParams._fields.index("priority")  # (read by position per request: no property call)
_TIMEOUT = RequestParams._fields.index("timeout_s")


class JobState(enum.Enum):
    """Where a job is."""

    QUEUED = "queued"    # in its model's queue
    RUNNING = "running"  # assigned to a worker (holding one of its credits)


# Members as module constants for the per-request paths: reading one off its class costs
# ~0.1-0.2 us on CPython 3.11 (an enum member is a descriptor there), a global ~10 ns.
QUEUED, RUNNING = JobState.QUEUED, JobState.RUNNING


class Job:
    """One accepted request inside the broker.

    ``client`` is the owner's identity, or None once the client is gone (its
    results are then dropped). ``params`` are the request's, as the client
    sent them. ``tokens`` are those streamed to the client so far: a migrated
    request resumes from them. ``deadline_s`` is monotonic; ``first_token_s`` (monotonic) is
    noted only while TTFT samples are kept (``JobTable.record_timings``). ``verdict``: the
    ``(code, message)`` of an error ending the broker decided while the
    request was running (its worker is told to cancel it; when the worker
    reports the end, it ends with this error, whatever the worker says). ``worker``: the
    identity of the worker running it, None while it is queued (its :attr:`state`).
    """

    __slots__ = ("key", "client", "rid", "model", "params", "tokens", "worker",
                 "deadline_s", "arrival_s", "attempts", "cancel_requested", "queue_seq", "first_token_s",
                 "verdict")

    def __init__(self, key: int, client: bytes, entry: Envelope, model: str, now: float) -> None:
        rid, params, resume_tokens, time_left_s = entry  # (one unpacking, not a field read each)
        self.key = key
        self.client: bytes | None = client
        self.rid: RequestId = rid
        self.model = model
        self.params: RequestParams = params
        self.tokens: list[int] = list(resume_tokens) if resume_tokens else []
        self.worker: bytes | None = None
        timeout_s = params[_TIMEOUT] if time_left_s is None else time_left_s
        self.deadline_s = None if timeout_s is None else now + timeout_s
        self.arrival_s = now
        self.attempts = 0
        self.cancel_requested = False
        self.queue_seq: int | None = None
        self.first_token_s: float | None = None
        self.verdict: tuple[ErrorCode, str] | None = None

    @property
    def state(self) -> JobState:
        """Queued until a worker holds it (one field says both: no state to keep in step)."""
        return QUEUED if self.worker is None else RUNNING


class JobTable:
    """Every job the broker holds and the queues of those waiting.

    - ``by_key``: broker key -> job; ``of_client``: client identity -> the
      jobs still attached to that client, request id -> broker key (one
      table per client: no ``(client, request id)`` tuple built per lookup);
      :attr:`by_client` is a flat copy, for reading.
    - ``queues``: model -> the queued jobs of that model.
    - ``record_timings``: keep TTFT / latency samples (seconds) for
      :meth:`take`; on only while someone collects them (metrics on).
    """

    def __init__(self, config: BrokerConfig, counters: dict[str, int]) -> None:
        self.config = config
        self.counters = counters
        self.by_key: dict[int, Job] = {}
        self.of_client: dict[bytes, dict[RequestId, int]] = {}
        self.queues: dict[str, PriorityQueue[Job]] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline_s, key) of queued jobs
        self._next_key = 0
        self.record_timings = False
        self.timings: dict[str, list[float]] = {"ttft": [], "latency": []}

    def queue(self, model: str) -> PriorityQueue[Job]:
        """``model``'s queue (created empty if need be)."""
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = PriorityQueue(self.config.aging_window, self.config.max_queue)
        return q

    def merge(self, name: str, model: str, out: Outbox) -> None:
        """The jobs queued under ``name`` (before it was known as an alias of
        ``model``) join ``model``'s queue, in their order, after its own; one
        that finds it full ends ``queue_full``."""
        q = self.queues.pop(name, None)
        if not q:
            return
        into = self.queue(model)
        while (job := q.pop()) is not None:
            job.model = model
            if not into.push(job, job.params.priority):
                self.finish(job, FinishReason.ERROR, ErrorCode.QUEUE_FULL,
                            f"model {echo(model)} has {into.max_size} requests queued; retry later", out)

    @property
    def by_client(self) -> dict[tuple[bytes, RequestId], int]:
        """``(client identity, request id)`` -> broker key of every attached job (a copy)."""
        return {(client, rid): key for client, attached in self.of_client.items() for rid, key in attached.items()}

    def find(self, client: bytes, rid: RequestId) -> Job | None:
        """The job ``rid`` of ``client`` still attached to it, or None."""
        attached = self.of_client.get(client)
        key = None if attached is None else attached.get(rid)
        return None if key is None else self.by_key[key]

    def admit(self, client: bytes, entries: tuple[Envelope, ...], model: str, now: float, out: Outbox,
              make_room: Callable[[], None]) -> None:
        """Queue and hold a job for each of a client's ``entries`` for ``model``,
        except: a request id the client has in flight is a resubmission
        (already running, run once: counted in ``duplicates``); a
        :class:`~protocol.messages.Rejected` entry (invalid parameters) ends
        ``bad_request``; one that finds its queue full even after
        ``make_room()`` (a dispatch to free credits) ends ``queue_full``. The
        submit hot path: the whole message at once when it can (:meth:`_admit_all`), else one
        loop, no call per request."""
        q = self.queue(model)
        attached = self.of_client.get(client)
        if attached is None:
            attached = self.of_client[client] = {}
        if not self._admit_all(client, entries, attached, q, model, now):
            self._admit_each(client, entries, attached, q, model, now, out, make_room)

    def _admit_all(self, client: bytes, entries: tuple[Envelope, ...], attached: dict[RequestId, int],
                   q: PriorityQueue[Job], model: str, now: float) -> bool:
        """:meth:`admit`'s common case in a few passes over the whole message, each at C speed
        where it can be: every entry a valid request under a new id, of one priority, and room
        in the queue for all. False (nothing done) otherwise: :meth:`_admit_each` then decides
        entry by entry."""
        n = len(entries)
        if not n or _count_of(map(type, entries), Envelope) != n:  # (a Rejected entry ends alone)
            return False
        rids = [e[0] for e in entries]
        if not attached.keys().isdisjoint(rids) or len(set(rids)) != n:  # (a duplicate is counted, once)
            return False
        priorities = {e[1][_PRIORITY] for e in entries}
        if len(priorities) != 1:
            return False
        start = self._next_key
        keys = range(start, start + n)
        jobs = list(map(Job, keys, repeat(client, n), entries, repeat(model, n), repeat(now, n)))
        if not q.push_many(jobs, priorities.pop()):  # (full: make_room, entry by entry)
            return False
        self._next_key = start + n
        self.by_key.update(zip(keys, jobs))
        attached.update(zip(rids, keys))
        deadlines = [(job.deadline_s, job.key) for job in jobs if job.deadline_s is not None]
        for d in deadlines:
            heapq.heappush(self._deadlines, d)
        return True

    def _admit_each(self, client: bytes, entries: tuple[Envelope, ...], attached: dict[RequestId, int],
                    q: PriorityQueue[Job], model: str, now: float, out: Outbox,
                    make_room: Callable[[], None]) -> None:
        """:meth:`admit` one entry at a time."""
        push = q.push
        by_key = self.by_key
        for entry in entries:
            rid = entry[0]
            if rid in attached:
                self.counters["duplicates"] += 1
                continue
            if type(entry) is Rejected:  # its parameters are invalid: it alone fails
                self.counters["errors"] += 1
                out.result(client).finished.append(Finished(
                    entry.request_id, FinishReason.ERROR, ErrorCode.BAD_REQUEST, entry.message))
                continue
            key = self._next_key
            self._next_key = key + 1
            job = Job(key, client, entry, model, now)
            priority = entry[1][_PRIORITY]
            if not push(job, priority):  # (False when full: nothing queued)
                make_room()
                if not push(job, priority):
                    self.counters["queue_full"] += 1
                    out.result(client).finished.append(Finished(
                        entry.request_id, FinishReason.ERROR, ErrorCode.QUEUE_FULL,
                        f"model {echo(model)} has {q.max_size} requests queued; retry later"))
                    continue
            by_key[key] = job
            attached[rid] = key
            if job.deadline_s is not None:
                heapq.heappush(self._deadlines, (job.deadline_s, key))

    def finish(self, job: Job, reason: FinishReason, code: ErrorCode | None, message: str | None,
               out: Outbox, prompt_tokens: int | None = None, stop_reason=None,
               cached_tokens: int | None = None) -> None:
        """End a job: forget it and tell its client (if still there); ``prompt_tokens``,
        ``stop_reason`` and ``cached_tokens`` as the worker's :class:`Finished` says."""
        self.finish_all((job,), (_tuple_new(Finished, (job.rid, reason, code, message, prompt_tokens, stop_reason,
                                                        cached_tokens)),), out)

    def finish_all(self, jobs: Sequence[Job], endings: Sequence[Finished], out: Outbox) -> None:
        """:meth:`finish` each of ``jobs`` (each once, in order) with its entry of ``endings``, the
        :class:`Finished` its client gets (naming the job's request id). One loop for the endings
        a worker reports in an iteration (once per request: no call each, the tables at hand, the
        last client's kept, as an iteration's endings mostly go to few clients)."""
        by_key, of_client, counters, results = self.by_key, self.of_client, self.counters, out.results
        last = attached = add = None
        for job, ending in zip(jobs, endings):
            del by_key[job.key]
            counters[ENDING_COUNTER[ending[1]]] += 1
            client = job.client
            if client is not None:  # (detach, inline)
                if client != last:
                    attached = of_client.get(client)  # (None: the client is being forgotten, ClientHandler.lost)
                    draft = results.get(client)  # (out.result(client), inline)
                    if draft is None:
                        draft = out.result(client)
                    last, add = client, draft.finished.append
                if attached is not None:
                    del attached[job.rid]
                job.client = None
                add(ending)

    def finish_queued(self, job: Job, reason: FinishReason, code: ErrorCode | None, message: str | None,
                      out: Outbox) -> None:
        """Take a queued job out of its queue and end it."""
        self.queues[job.model].remove(job)
        self.finish(job, reason, code, message, out)

    def detach(self, job: Job) -> None:
        """Stop routing ``job``'s output to its client (it was told the ending)."""
        client = job.client
        if client is not None:
            attached = self.of_client.get(client)
            if attached is not None:  # (None: the client is being forgotten, ClientHandler.lost)
                del attached[job.rid]
            job.client = None

    def cancel(self, job: Job, to_workers: dict[bytes, list[int]], out: Outbox) -> None:
        """Cancel ``job``: at once when queued; when running, its worker is told
        (gathered in ``to_workers``) and it ends when the worker reports it."""
        if job.state is JobState.QUEUED:
            self.finish_queued(job, FinishReason.CANCELLED, None, None, out)
        elif not job.cancel_requested:
            # The worker frees the slot on its next iteration and reports the
            # ending; until then the job keeps its credit.
            job.cancel_requested = True
            to_workers.setdefault(job.worker, []).append(job.key)

    def end(self, job: Job, code: ErrorCode, message: str, to_workers: dict[bytes, list[int]],
            out: Outbox) -> None:
        """End ``job`` with an error the broker decided: at once when queued;
        when running, its worker is told to cancel it and it ends with this
        error when the worker reports the end (it keeps its credit till then)."""
        if job.state is JobState.QUEUED:
            self.finish_queued(job, FinishReason.ERROR, code, message, out)
            return
        job.verdict = (code, message)
        if not job.cancel_requested:
            job.cancel_requested = True
            to_workers.setdefault(job.worker, []).append(job.key)

    def expire(self, now: float, out: Outbox) -> None:
        """End the queued jobs whose deadline has passed (``deadline``)."""
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, key = heapq.heappop(dl)
            job = self.by_key.get(key)
            if job is not None and job.state is JobState.QUEUED:
                self.finish_queued(job, FinishReason.DEADLINE, None, None, out)

    def take(self, kind: str) -> list[float]:
        """Samples of ``"ttft"`` or ``"latency"`` (seconds) since the last call."""
        out, self.timings[kind] = self.timings[kind], []
        return out
