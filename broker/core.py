"""The broker's decisions, without sockets: events in, messages to send out.

:class:`BrokerCore` is fed decoded messages (with the sender's identity and
the current monotonic time) and housekeeping ticks; every method returns the
list of :class:`Send` actions to perform. :mod:`broker.server` owns the
sockets and performs them; tests drive the core directly.

Request identity: clients choose request ids, scoped per client. The core
keys each request by ``(client identity, request id)`` and gives it a broker
``int`` key, which is the only id a worker ever sees. A resubmission of an
id still in flight for the same client is recognised and ignored (it is
already running; its results keep flowing), so nothing runs twice.

Invariants (kept here, relied on by the tests):

- every accepted request ends in exactly one ``finished`` entry to its
  client (unless the client is gone);
- a worker never holds more requests than its ``max_inflight`` credits;
- a request lost with a worker goes back to the head of its queue with the
  tokens the client already has (``resume_tokens``), so the next worker
  continues from there: no gap, no duplicate.
"""

from __future__ import annotations

import enum
import heapq
import logging
from dataclasses import dataclass

from broker.config import BrokerConfig
from broker.registry import WorkerRegistry, WorkerState
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import (
    Assign, Bye, Cancel, Envelope, Error, Finished, Heartbeat, Hello, Iteration, Message, ModelInfo,
    ModelStatus, Register, Rejected, Results, Status, StatusQuery, Submit, Text, Welcome, WorkerStatus,
)
from protocol.queue import PriorityQueue
from protocol.request import RequestId, RequestParams

log = logging.getLogger(__name__)

_MAX_HUNG_REMEMBERED = 10_000  # identities of hung workers kept for probation (bounded memory)


def _unknown_model(model: str) -> str:
    return f"no worker serves model {model!r}; start one (slotserve worker --model {model}) or check the name"


class Side(enum.Enum):
    """Which broker socket a message goes out on."""

    FRONTEND = "frontend"  # clients
    BACKEND = "backend"    # workers


@dataclass(frozen=True, slots=True)
class Send:
    """An action: send ``message`` to the peer ``identity`` on socket ``side``."""

    side: Side
    identity: bytes
    message: Message


class JobState(enum.Enum):
    QUEUED = "queued"    # in its model's queue
    RUNNING = "running"  # assigned to a worker (holding one of its credits)


class Job:
    """One accepted request inside the broker.

    ``client`` is the owner's identity, or None once the client is gone (its
    results are then dropped). ``params`` are the request's, as the client
    sent them. ``tokens`` are those streamed to the client so far: a migrated
    request resumes from them. ``deadline_s`` is monotonic.
    """

    __slots__ = ("key", "client", "rid", "model", "params", "tokens", "state", "worker",
                 "deadline_s", "arrival_s", "attempts", "cancel_requested", "queue_seq", "first_token_s")

    def __init__(self, key: int, client: bytes, entry: Envelope, model: str, now: float) -> None:
        self.key = key
        self.client: bytes | None = client
        self.rid: RequestId = entry.request_id
        self.model = model
        self.params: RequestParams = entry.params
        self.tokens: list[int] = list(entry.resume_tokens)
        self.state = JobState.QUEUED
        self.worker: bytes | None = None
        timeout_s = entry.params.timeout_s if entry.time_left_s is None else entry.time_left_s
        self.deadline_s = None if timeout_s is None else now + timeout_s
        self.arrival_s = now
        self.attempts = 0
        self.cancel_requested = False
        self.queue_seq: int | None = None
        self.first_token_s: float | None = None


class ClientState:
    """A client seen within the liveness window: ``keys`` are its requests in flight."""

    __slots__ = ("identity", "name", "last_seen_s", "keys")

    def __init__(self, identity: bytes, now: float) -> None:
        self.identity = identity
        self.name = ""
        self.last_seen_s = now
        self.keys: set[int] = set()


class _ResultsDraft:
    """The parts of one client's ``results`` message while an event is handled."""

    __slots__ = ("ids", "tokens", "texts", "finished")

    def __init__(self) -> None:
        self.ids: list[RequestId] = []
        self.tokens: list[int] = []
        self.texts: list[Text] = []
        self.finished: list[Finished] = []


class _Outbox:
    """Collects one event's sends; results are grouped into one message per client."""

    __slots__ = ("sends", "results")

    def __init__(self) -> None:
        self.sends: list[Send] = []
        self.results: dict[bytes, _ResultsDraft] = {}

    def result(self, client: bytes) -> _ResultsDraft:
        r = self.results.get(client)
        if r is None:
            r = self.results[client] = _ResultsDraft()
        return r

    def send(self, side: Side, identity: bytes, message: Message) -> None:
        self.sends.append(Send(side, identity, message))

    def done(self) -> list[Send]:
        for client, r in self.results.items():
            self.sends.append(Send(Side.FRONTEND, client, Results(
                tuple(r.ids), tuple(r.tokens), tuple(r.texts), tuple(r.finished))))
        return self.sends


COUNTERS = ("submitted", "dispatched", "completed", "cancelled", "deadline", "errors",
            "queue_full", "requeued", "duplicates", "workers_lost", "workers_hung", "clients_lost",
            "tokens_out", "bad_messages", "internal_errors")
"""Names of the totals reported in ``status`` (all since broker start)."""


class BrokerCore:
    """All broker state and decisions. Not thread-safe: one loop drives it."""

    def __init__(self, config: BrokerConfig, broker_id: str, now: float) -> None:
        self.config = config
        self.broker_id = broker_id
        self.started_s = now
        self.workers = WorkerRegistry()
        self.models: dict[str, ModelInfo] = {}       # every model ever registered
        self.queues: dict[str, PriorityQueue[Job]] = {}
        self.jobs: dict[int, Job] = {}
        self.clients: dict[bytes, ClientState] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._by_client: dict[tuple[bytes, RequestId], int] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline_s, key) of queued jobs
        self._next_key = 0
        self._hung: dict[bytes, int | None] = {}  # identity -> progress when found hung
        self._grace_over = config.register_grace_s == 0
        self._next_heartbeat_s = now
        # Broker-side TTFT / latency samples (seconds), kept only while
        # someone collects them (metrics on): see take_timings().
        self.record_timings = False
        self._timings: dict[str, list[float]] = {"ttft": [], "latency": []}

    # ------------------------------------------------------------------ clients

    def on_frontend(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded client message."""
        out = _Outbox()
        cs = self._client(identity, now)
        if isinstance(msg, Submit):
            self._submit(cs, msg, now, out)
        elif isinstance(msg, Cancel):
            self._cancel(cs, msg.request_ids, out)
        elif isinstance(msg, Hello):
            cs.name = msg.client_name
            out.send(Side.FRONTEND, identity, self._welcome())
        elif isinstance(msg, StatusQuery):
            out.send(Side.FRONTEND, identity, self.status(now))
        elif isinstance(msg, Bye):
            self._client_lost(cs, None, out)
        # Heartbeat: _client() already noted that the client is alive.
        return out.done()

    def on_frontend_error(self, identity: bytes, err: ProtocolError, request_ids: list[RequestId],
                          now: float) -> list[Send]:
        """A client sent an undecodable message: answer with its code, naming any
        request ids it carried (the client ends those requests with the error)."""
        self.counters["bad_messages"] += 1
        self._client(identity, now)
        ids = tuple(r for r in request_ids if (identity, r) not in self._by_client)
        return [Send(Side.FRONTEND, identity, Error(err.code, err.message, ids))]

    def _client(self, identity: bytes, now: float) -> ClientState:
        cs = self.clients.get(identity)
        if cs is None:
            cs = self.clients[identity] = ClientState(identity, now)
        cs.last_seen_s = now
        return cs

    def _submit(self, cs: ClientState, msg: Submit, now: float, out: _Outbox) -> None:
        model = msg.model
        if model not in self.models and self._grace_over:
            r = out.result(cs.identity)
            for entry in msg.requests:
                r.finished.append(Finished(entry.request_id, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL,
                                           _unknown_model(model)))
            self.counters["errors"] += len(msg.requests)
            return
        # Within the start-up grace an unknown model's requests wait for a
        # worker (after a broker restart, workers re-register shortly).
        q = self._queue(model)
        for entry in msg.requests:
            ck = (cs.identity, entry.request_id)
            if ck in self._by_client:
                self.counters["duplicates"] += 1  # a resubmission: already running, run once
                continue
            if type(entry) is Rejected:  # its parameters are invalid: it alone fails
                self.counters["errors"] += 1
                out.result(cs.identity).finished.append(Finished(
                    entry.request_id, FinishReason.ERROR, ErrorCode.BAD_REQUEST, entry.message))
                continue
            key = self._next_key
            self._next_key = key + 1
            job = Job(key, cs.identity, entry, model, now)
            if q.full():
                self._dispatch(model, now, out)  # free credits may make room
            if not q.push(job, job.params.priority):
                self.counters["queue_full"] += 1
                out.result(cs.identity).finished.append(Finished(
                    entry.request_id, FinishReason.ERROR, ErrorCode.QUEUE_FULL,
                    f"model {model!r} has {q.max_size} requests queued; retry later"))
                continue
            self.jobs[key] = job
            self._by_client[ck] = key
            cs.keys.add(key)
            if job.deadline_s is not None:
                heapq.heappush(self._deadlines, (job.deadline_s, key))
        self.counters["submitted"] += len(msg.requests)
        self._dispatch(model, now, out)

    def _cancel(self, cs: ClientState, rids: list[RequestId], out: _Outbox) -> None:
        to_workers: dict[bytes, list[int]] = {}
        for rid in rids:
            key = self._by_client.get((cs.identity, rid))
            if key is not None:
                self._cancel_job(self.jobs[key], to_workers, out)
        for w, keys in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(keys)))

    def _cancel_job(self, job: Job, to_workers: dict[bytes, list[int]], out: _Outbox) -> None:
        if job.state is JobState.QUEUED:
            self.queues[job.model].remove(job)
            self._finish(job, FinishReason.CANCELLED, None, None, out)
        elif not job.cancel_requested:
            # The worker frees the slot on its next iteration and reports the
            # ending; until then the job keeps its credit.
            job.cancel_requested = True
            to_workers.setdefault(job.worker, []).append(job.key)

    def _client_lost(self, cs: ClientState, code: ErrorCode | None, out: _Outbox, *, silent: bool = False) -> None:
        """Forget a client: cancel its queued and running requests.

        With ``code`` (e.g. ``slow_consumer``) the client is told which of its
        requests were ended, in case it is still there to read it. With
        ``silent`` (it missed its heartbeats) each request gets a
        ``cancelled`` ending, so a client that was only stalled, not gone,
        still sees exactly one ending per request.
        """
        del self.clients[cs.identity]
        if cs.keys:
            self.counters["clients_lost"] += 1
        rids = []
        to_workers: dict[bytes, list[int]] = {}
        for key in list(cs.keys):
            job = self.jobs[key]
            rids.append(job.rid)
            del self._by_client[(cs.identity, job.rid)]
            job.client = None  # results of a running job are dropped from now on
            self._cancel_job(job, to_workers, out)
        cs.keys.clear()
        out.results.pop(cs.identity, None)
        for w, keys in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(keys)))
        if code is not None:
            out.send(Side.FRONTEND, cs.identity, Error(
                code, "the client stopped reading its results; its requests were cancelled", tuple(rids)))
        elif silent and rids:
            text = (f"no heartbeat from this client for {self.config.client_liveness_s} s: "
                    "its requests were cancelled")
            out.send(Side.FRONTEND, cs.identity, Results(finished=tuple(
                Finished(rid, FinishReason.CANCELLED, None, text) for rid in rids)))

    def client_unreachable(self, identity: bytes, code: ErrorCode | None) -> list[Send]:
        """The socket loop could not deliver to a client (gone, or its buffer
        bound was hit: ``code`` says which error to leave for it)."""
        out = _Outbox()
        cs = self.clients.get(identity)
        if cs is not None:
            self._client_lost(cs, code, out)
        return out.done()

    # ------------------------------------------------------------------ workers

    def on_backend(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded worker message."""
        out = _Outbox()
        if isinstance(msg, Register):
            self._register(identity, msg, now, out)
            return out.done()
        w = self.workers.get(identity)
        if w is None:
            if not isinstance(msg, Bye):
                out.send(Side.BACKEND, identity, Error(
                    ErrorCode.NOT_REGISTERED, "this broker does not know you (restarted?): register again"))
            return out.done()
        w.last_seen_s = now
        if isinstance(msg, Iteration):
            w.progress_s = now
            if w.suspect:
                self._recovered(w, now, out)
            self._iteration(w, msg, now, out)
        elif isinstance(msg, Heartbeat):
            p = msg.progress
            if p is not None:
                if w.progress is not None and p != w.progress:
                    w.progress_s = now
                    if w.suspect:
                        self._recovered(w, now, out)
                w.progress = p
        elif isinstance(msg, Bye):
            self._worker_lost(w, now, out, failed=False)
        return out.done()

    def on_backend_error(self, identity: bytes, err: ProtocolError) -> list[Send]:
        """A worker sent an undecodable message: answer with its code."""
        self.counters["bad_messages"] += 1
        return [Send(Side.BACKEND, identity, Error(err.code, err.message))]

    def worker_unreachable(self, identity: bytes, now: float) -> list[Send]:
        """The socket loop could not deliver to a worker: treat it as dead."""
        out = _Outbox()
        w = self.workers.get(identity)
        if w is not None:
            self._worker_lost(w, now, out, failed=True)
        return out.done()

    def _register(self, identity: bytes, msg: Register, now: float, out: _Outbox) -> None:
        old = self.workers.get(identity)
        if old is not None:
            # The worker re-registered: it dropped whatever it held.
            self._worker_lost(old, now, out, failed=False)
        w = WorkerState(identity, msg.model, msg.num_slots, msg.max_inflight, msg.info, msg.worker_name, now)
        if identity in self._hung:
            # Found hung before: on probation until its progress moves past
            # the value it was stuck at.
            w.suspect = True
            w.progress = self._hung[identity]
        self.workers.add(w)
        self.models[msg.model] = msg.info
        self._queue(msg.model)
        out.send(Side.BACKEND, identity, self._welcome())
        self._dispatch(msg.model, now, out)

    def _iteration(self, w: WorkerState, msg: Iteration, now: float, out: _Outbox) -> None:
        jobs = self.jobs
        me = w.identity
        results = out.results
        n = 0
        for key, tok in zip(msg.ids, msg.tokens):
            job = jobs.get(key)
            if job is None or job.worker != me:
                continue  # stale: the job migrated or ended meanwhile
            if job.first_token_s is None:
                job.first_token_s = now
                if self.record_timings:
                    self._timings["ttft"].append(now - job.arrival_s)
            job.tokens.append(tok)
            n += 1
            client = job.client
            if client is not None:
                r = results.get(client)
                if r is None:
                    r = results[client] = _ResultsDraft()
                r.ids.append(job.rid)
                r.tokens.append(tok)
        self.counters["tokens_out"] += n
        if n:
            w.iterations += 1
        for key, text in msg.texts:
            job = jobs.get(key)
            if job is not None and job.worker == me and job.client is not None:
                out.result(job.client).texts.append(Text(job.rid, text))
        for f in msg.finished:
            job = jobs.get(f.request_id)
            if job is None or job.worker != me:
                continue
            w.inflight.discard(job.key)  # the credit comes back
            if self.record_timings:
                self._timings["latency"].append(now - job.arrival_s)
            self._finish(job, f.finish_reason, f.code, f.message, out, f.prompt_tokens, f.stop_reason)
        if msg.finished:
            self._dispatch(w.model, now, out)

    def _recovered(self, w: WorkerState, now: float, out: _Outbox) -> None:
        """A suspect worker made progress again: it may take requests."""
        log.warning("worker %s, found hung before, is making progress again", w.name)
        w.suspect = False
        self._hung.pop(w.identity, None)
        self._dispatch(w.model, now, out)

    def _worker_lost(self, w: WorkerState, now: float, out: _Outbox, *, failed: bool) -> None:
        """Remove a worker; migrate its requests to the head of their queue.

        ``failed``: it died or hung (counts toward each request's
        ``max_attempts``), rather than leaving or re-registering cleanly."""
        self.workers.remove(w.identity)
        self.counters["workers_lost"] += 1
        q = self._queue(w.model)
        for key in sorted(w.inflight):  # keys grow with arrival: keep arrival order
            job = self.jobs[key]
            job.state = JobState.QUEUED
            job.worker = None
            if failed:
                job.attempts += 1
            if job.cancel_requested or job.client is None:
                self._finish(job, FinishReason.CANCELLED, None, None, out)
            elif job.attempts >= self.config.max_attempts:
                self._finish(job, FinishReason.ERROR, ErrorCode.WORKER_FAILED,
                             f"the request was lost with {job.attempts} failed workers; "
                             "check the workers' logs", out)
            else:
                self.counters["requeued"] += 1
                q.push_head(job)
        w.inflight.clear()
        self._dispatch(w.model, now, out)

    # ------------------------------------------------------------------ shared

    def _queue(self, model: str) -> PriorityQueue[Job]:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = PriorityQueue(self.config.aging_window, self.config.max_queue)
        return q

    def _dispatch(self, model: str, now: float, out: _Outbox) -> None:
        """Assign queued requests of ``model`` to workers with credits, one
        ``assign`` message per worker."""
        q = self.queues.get(model)
        if not q:
            return
        assigns: dict[bytes, list[Envelope]] = {}
        pick = self.workers.pick
        while len(q):
            w = pick(model)
            if w is None:
                break
            job = q.pop()
            timeout_s = None
            if job.deadline_s is not None:
                timeout_s = job.deadline_s - now
                if timeout_s <= 0:
                    self._finish(job, FinishReason.DEADLINE, None, None, out)
                    continue
            job.state = JobState.RUNNING
            job.worker = w.identity
            if not w.inflight:
                w.progress_s = now  # the hung clock starts when it gets work
            w.inflight.add(job.key)
            # The worker knows the request by its broker key, with the time
            # left and the tokens the client already has beside its parameters.
            entry = Envelope(job.key, job.params, tuple(job.tokens), timeout_s)
            entries = assigns.get(w.identity)
            if entries is None:
                entries = assigns[w.identity] = []
            entries.append(entry)
        for identity, entries in assigns.items():
            self.counters["dispatched"] += len(entries)
            out.send(Side.BACKEND, identity, Assign(tuple(entries)))

    def _finish(self, job: Job, reason: FinishReason, code: ErrorCode | None, message: str | None,
                out: _Outbox, prompt_tokens: int | None = None, stop_reason=None) -> None:
        """End a job: forget it and tell its client (if still there)."""
        del self.jobs[job.key]
        c = self.counters
        if reason is FinishReason.ERROR:
            c["errors"] += 1
        elif reason is FinishReason.CANCELLED:
            c["cancelled"] += 1
        elif reason is FinishReason.DEADLINE:
            c["deadline"] += 1
        else:
            c["completed"] += 1
        if job.client is not None:
            del self._by_client[(job.client, job.rid)]
            cs = self.clients.get(job.client)
            if cs is not None:
                cs.keys.discard(job.key)
            out.result(job.client).finished.append(
                Finished(job.rid, reason, code, message, prompt_tokens, stop_reason))

    def take_timings(self, kind: str) -> list[float]:
        """Samples of ``"ttft"`` or ``"latency"`` (seconds) since the last call."""
        out, self._timings[kind] = self._timings[kind], []
        return out

    def _welcome(self) -> Welcome:
        return Welcome(self.broker_id, self.config.heartbeat_interval_s, dict(self.models))

    # ------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> list[Send]:
        """Periodic work: end the start-up grace, end queued requests past their
        deadline, drop dead or hung workers (migrating their requests) and
        silent clients (cancelling theirs), and send heartbeats once per interval."""
        out = _Outbox()
        if not self._grace_over and now - self.started_s >= self.config.register_grace_s:
            self._grace_over = True
            self._fail_unknown_models(out)
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, key = heapq.heappop(dl)
            job = self.jobs.get(key)
            if job is not None and job.state is JobState.QUEUED:
                self.queues[job.model].remove(job)
                self._finish(job, FinishReason.DEADLINE, None, None, out)
        self._check_workers(now, out)
        cutoff = now - self.config.client_liveness_s
        for cs in [c for c in self.clients.values() if c.last_seen_s < cutoff]:
            self._client_lost(cs, None, out, silent=True)
        if now >= self._next_heartbeat_s:
            self._next_heartbeat_s = now + self.config.heartbeat_interval_s
            hb = Heartbeat(broker_id=self.broker_id)
            for w in self.workers:
                out.send(Side.BACKEND, w.identity, hb)
            for identity in self.clients:
                out.send(Side.FRONTEND, identity, hb)
        return out.done()

    def _check_workers(self, now: float, out: _Outbox) -> None:
        """Migrate the requests of dead workers (silent past ``worker_liveness_s``)
        and hung ones (heartbeating, but no progress past ``worker_hung_s``)."""
        for w in self.workers.silent_since(now - self.config.worker_liveness_s):
            self._worker_lost(w, now, out, failed=True)
        hung_s = self.config.worker_hung_s
        if hung_s is None:
            return
        for w in self.workers.hung_since(now - hung_s):
            # Alive but stuck: its requests move on. Its next message finds it
            # unknown; it registers afresh (dropping the stale work) and stays
            # on probation until its progress moves.
            log.warning("worker %s holds %d requests but completed no iteration for %.1f s: "
                        "treating it as hung", w.name, len(w.inflight), now - w.progress_s)
            self.counters["workers_hung"] += 1
            if len(self._hung) < _MAX_HUNG_REMEMBERED:
                self._hung[w.identity] = w.progress
            self._worker_lost(w, now, out, failed=True)

    def _fail_unknown_models(self, out: _Outbox) -> None:
        """The start-up grace is over: end requests still waiting for a model
        that no worker registered (``unknown_model``)."""
        for model in [m for m in self.queues if m not in self.models]:
            q = self.queues.pop(model)
            while (job := q.pop()) is not None:
                self._finish(job, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, _unknown_model(model), out)

    def status(self, now: float) -> Status:
        """A snapshot for ``slotserve status``."""
        models = {}
        for name in sorted(set(self.queues) | set(self.models)):
            ws = self.workers.for_model(name)
            q = self.queues.get(name)
            models[name] = ModelStatus(
                queued=len(q) if q is not None else 0,
                running=sum(len(w.inflight) for w in ws),
                workers=len(ws),
                slots_busy=sum(min(len(w.inflight), w.num_slots) for w in ws),
                slots_total=sum(w.num_slots for w in ws),
            )
        workers = tuple(WorkerStatus(w.name, w.model, w.num_slots, len(w.inflight), w.iterations, w.suspect)
                        for w in self.workers)
        return Status(self.broker_id, now - self.started_s, models, workers, len(self.clients),
                      dict(self.counters))
