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
from broker.registry import LoadingWorker, WorkerRegistry, WorkerState
from protocol.codec import encode
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.framing import Refused, request_ids
from protocol.messages import (
    Assign, Bye, Cancel, Envelope, Error, Finished, Heartbeat, Hello, Iteration, Loading, Message, ModelInfo,
    ModelStatus, Register, Rejected, Results, Status, StatusQuery, Submit, Text, Welcome, WorkerStatus,
)
from protocol.queue import PriorityQueue
from protocol.request import RequestId, RequestParams

log = logging.getLogger(__name__)

_MAX_HUNG_REMEMBERED = 10_000  # identities of hung workers kept for probation (bounded memory)

_COUNTER = {FinishReason.STOP: "completed", FinishReason.LENGTH: "completed", FinishReason.CANCELLED: "cancelled",
            FinishReason.DEADLINE: "deadline", FinishReason.ERROR: "errors"}
"""The counter each ending counts toward."""


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
    request resumes from them. ``deadline_s`` is monotonic. ``verdict``: the
    ``(code, message)`` of an error ending the broker decided while the
    request was running (its worker is told to cancel it; when the worker
    reports the end, it ends with this error, whatever the worker says).
    """

    __slots__ = ("key", "client", "rid", "model", "params", "tokens", "state", "worker",
                 "deadline_s", "arrival_s", "attempts", "cancel_requested", "queue_seq", "first_token_s",
                 "verdict")

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
        self.verdict: tuple[ErrorCode, str] | None = None


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
            "tokens_out", "bad_messages", "control_too_large", "internal_errors")
"""Names of the totals reported in ``status`` (all since broker start).
``bad_messages``: frames received that could not be decoded;
``control_too_large``: control messages (welcome, status, error: none names a
request) not sent because they exceed their receiver's frame limit -- a
peer configured with too small a ``max_message_bytes``, not a broker fault;
``internal_errors``: broker bugs (a handler or housekeeping pass raised). An
ending counts (``completed``, ``cancelled``, ``deadline``, ``errors``) once
it is handed to its client's socket: one the socket loop has to hold back
(the client is not reading) is taken out again until it leaves
(:meth:`BrokerCore.count_endings`), and one it discards counts as an error."""


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
        self._models_view = self._models_now()  # what clients were last told (welcome)
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
            out.send(Side.FRONTEND, identity, self._welcome(now))
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
        if not self._known(model) and self._grace_over:
            r = out.result(cs.identity)
            text = self._unknown_model(model)
            for entry in msg.requests:
                r.finished.append(Finished(entry.request_id, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, text))
            self.counters["errors"] += len(msg.requests)
            return
        # A model being loaded, or (within the start-up grace) one nobody
        # serves yet: its requests wait in its queue for a worker, bounded by
        # their own deadlines and the queue's bound.
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

    def _end_job(self, job: Job, code: ErrorCode, message: str, to_workers: dict[bytes, list[int]],
                 out: _Outbox) -> None:
        """End ``job`` with an error the broker decided: at once when queued;
        when running, its worker is told to cancel it and it ends with this
        error when the worker reports the end (it keeps its credit till then)."""
        if job.state is JobState.QUEUED:
            self.queues[job.model].remove(job)
            self._finish(job, FinishReason.ERROR, code, message, out)
            return
        job.verdict = (code, message)
        if not job.cancel_requested:
            job.cancel_requested = True
            to_workers.setdefault(job.worker, []).append(job.key)

    def _detach(self, job: Job) -> None:
        """Stop routing ``job``'s output to its client (it was told the ending)."""
        if job.client is not None:
            del self._by_client[(job.client, job.rid)]
            cs = self.clients.get(job.client)
            if cs is not None:
                cs.keys.discard(job.key)
            job.client = None

    def _client_lost(self, cs: ClientState, code: ErrorCode | None, out: _Outbox,
                     also: tuple[RequestId, ...] = ()) -> None:
        """Forget a client: end its queued and running requests.

        ``code`` None: the client left (``bye``): its requests are
        cancelled, nothing is sent. Otherwise the broker decided -- the
        client stopped reading (``slow_consumer``: one ``error`` names every
        request ended, ``also`` included: those whose endings were in frames
        discarded unsent), or it missed its heartbeats (``client_silent``:
        one ``error`` ending per request, in case it was only stalled) --
        and each request ends with that error code.
        """
        del self.clients[cs.identity]
        if cs.keys:
            self.counters["clients_lost"] += 1
        if code is ErrorCode.SLOW_CONSUMER:
            text = "the client stopped reading its results (the broker's buffer for it is full): request ended"
        elif code is not None:
            text = (f"no heartbeat from this client for {self.config.client_liveness_s:g} s (the broker's "
                    f"liveness window; it heartbeats every {self.config.heartbeat_interval_s:g} s): request ended")
        rids = []
        to_workers: dict[bytes, list[int]] = {}
        for key in sorted(cs.keys):  # keys grow with arrival
            job = self.jobs[key]
            rids.append(job.rid)
            self._detach(job)  # results of a running job are dropped from now on
            if code is None:
                self._cancel_job(job, to_workers, out)
            else:
                self._end_job(job, code, text, to_workers, out)
        cs.keys.clear()
        out.results.pop(cs.identity, None)
        for w, keys in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(keys)))
        if code is ErrorCode.SLOW_CONSUMER:
            ids = tuple(dict.fromkeys(rids + list(also)))
            if ids:
                out.send(Side.FRONTEND, cs.identity, Error(code, text, ids))
        elif code is not None and rids:
            out.send(Side.FRONTEND, cs.identity, Results(finished=tuple(
                Finished(rid, FinishReason.ERROR, code, text) for rid in rids)))

    def client_unreachable(self, identity: bytes, code: ErrorCode | None,
                           discarded: list[Message] = ()) -> list[Send]:
        """The socket loop could not deliver to a client: it is gone (``code``
        None), or it stopped reading and its buffer bound was hit
        (``slow_consumer``). ``discarded``: the messages for it the loop threw
        away unsent (their endings already taken out of the counters, see
        :meth:`count_endings`): their endings count as errors, and with a
        ``code`` the client is told that each request they name ended with it."""
        out = _Outbox()
        also: list[RequestId] = []
        for m in discarded:
            if type(m) is Results:
                self.counters["errors"] += len(m.finished)
            also.extend(request_ids(m))
        cs = self.clients.get(identity)
        if cs is not None:
            self._client_lost(cs, code, out, tuple(also))
        elif code is not None and also:
            out.send(Side.FRONTEND, identity, Error(
                code, "the client stopped reading its results: request ended", tuple(dict.fromkeys(also))))
        return out.done()

    def count_endings(self, finished: tuple[Finished, ...], sign: int) -> None:
        """Take endings out of the counters (``sign`` -1: the socket loop holds
        their message back) or put them back (+1: it left). The loop calls
        both within one pass, so nobody reading the counters between passes
        ever sees one ending counted twice or a counter go down."""
        c = self.counters
        for f in finished:
            c[_COUNTER[f.finish_reason]] += sign

    def undeliverable(self, side: Side, identity: bytes, refused: list[Refused], now: float) -> list[Send]:
        """Parts of messages the socket loop could not send (one request each:
        too large for the receiver even alone, or not encodable; see
        :func:`protocol.framing.fit`): each request named ends with the part's
        error code, and nothing else is touched. A part naming no request
        (a status, a welcome) is only logged."""
        out = _Outbox()
        to_workers: dict[bytes, list[int]] = {}
        for part, code, reason in refused:
            ids = request_ids(part)
            if not ids:
                if code is ErrorCode.TOO_LARGE:
                    self._control_too_large(side, identity, part, out)
                else:  # a message of the broker's own the encoder refuses: a bug
                    self.counters["internal_errors"] += 1
                    log.error("cannot send a %s to %s %s: %s", type(part).__name__, side.value,
                              identity.hex()[:8], reason)
                continue
            text = f"the broker could not send this request's {type(part).__name__.lower()} message: {reason}"
            if side is Side.FRONTEND:
                self._fail_for_client(identity, ids, code, text, part, to_workers, out)
            elif type(part) is Assign:
                self._fail_on_worker(identity, ids, code, text, to_workers, out, cancel=False)
            else:
                log.error("cannot send a %s to worker %s: %s", type(part).__name__, identity.hex()[:8], reason)
        for w, keys in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(keys)))
        for model in {w.model for w in (self.workers.get(identity),) if w is not None}:
            self._dispatch(model, now, out)
        return out.done()

    def _control_too_large(self, side: Side, identity: bytes, msg: Message, out: _Outbox) -> None:
        """``msg``, a control message naming no request (a welcome listing many
        models, a status), exceeds the frame limit of the peer it is for, so it
        cannot go. The peer's limit is too small for the control traffic (or,
        for clients and loading workers, which announce none, the broker's own
        ``--max-message-bytes``): a configuration fault, counted in
        ``control_too_large``, logged with the remedy. The peer is told in a
        short ``error`` (well within the smallest limit any peer may have,
        ``MIN_MESSAGE_BYTES``); nobody else is affected."""
        self.counters["control_too_large"] += 1
        limit = self.peer_limit(side, identity)
        size = _encoded_size(msg)
        what = type(msg).__name__.lower()
        w = self.workers.get(identity) if side is Side.BACKEND else None
        if w is not None:
            peer, fix = f"worker {w.name}", "that worker"
        elif side is Side.BACKEND:
            peer, fix = f"worker {identity.hex()[:8]}", "the broker (it is the limit used for loading workers)"
        else:
            cs = self.clients.get(identity)
            peer = f"client {cs.name if cs is not None and cs.name else identity.hex()[:8]}"
            fix = "the broker (clients are sent at most the broker's own limit)"
        log.warning("cannot send a %s of %d bytes to %s: over its frame limit of %d bytes (max_message_bytes); "
                    "raise --max-message-bytes on %s", what, size, peer, limit, fix)
        if type(msg) is not Error:  # (an error that does not fit is not answered with another)
            out.send(side, identity, Error(ErrorCode.TOO_LARGE, (
                f"the broker's {what} message ({size} bytes) exceeds the frame limit of {limit} bytes "
                f"(max_message_bytes) it must keep to for you: raise --max-message-bytes on {fix}")))

    def handling_failed(self, side: Side, identity: bytes, msg: Message | None, error: BaseException,
                        now: float) -> list[Send]:
        """Handling ``msg`` raised ``error`` (a bug): every request it names ends
        with ``internal``, so that none waits forever; the rest of the broker
        carries on. ``msg`` None: nothing to attribute."""
        self.counters["internal_errors"] += 1
        out = _Outbox()
        ids = [] if msg is None else request_ids(msg)
        if not ids:
            return []
        text = f"the broker failed handling this request ({type(error).__name__}: {error}); please report it"
        to_workers: dict[bytes, list[int]] = {}
        if side is Side.FRONTEND:
            self._client(identity, now)
            self._fail_for_client(identity, ids, ErrorCode.INTERNAL, text, None, to_workers, out)
        else:
            self._fail_on_worker(identity, ids, ErrorCode.INTERNAL, text, to_workers, out, cancel=True)
        for w, keys in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(keys)))
        w = self.workers.get(identity) if side is Side.BACKEND else None
        if w is not None:
            self._dispatch(w.model, now, out)
        return out.done()

    def _fail_for_client(self, identity: bytes, rids: list[RequestId], code: ErrorCode, text: str,
                         part: Message | None, to_workers: dict[bytes, list[int]], out: _Outbox) -> None:
        """End the client's requests ``rids`` with ``code``, telling it now. A
        request the broker no longer holds ended in ``part`` (a message that was
        not delivered): its ending is recounted as this error."""
        finished = {f.request_id: f for f in getattr(part, "finished", ())}
        for rid in rids:
            key = self._by_client.get((identity, rid))
            if key is not None:
                job = self.jobs[key]
                self._detach(job)
                self._end_job(job, code, text, to_workers, out)
            else:
                f = finished.get(rid)
                if f is not None:
                    if f.finish_reason is FinishReason.ERROR:
                        # Its error ending itself could not be sent: give up
                        # rather than try forever (the client keeps waiting).
                        log.error("cannot send the ending of request %r to client %s: %s", rid,
                                  identity.hex()[:8], text)
                        continue
                    self.counters[_COUNTER[f.finish_reason]] -= 1
                    self.counters["errors"] += 1
            out.result(identity).finished.append(Finished(rid, FinishReason.ERROR, code, text))

    def _fail_on_worker(self, identity: bytes, keys: list, code: ErrorCode, text: str,
                        to_workers: dict[bytes, list[int]], out: _Outbox, *, cancel: bool) -> None:
        """End the requests ``keys`` held by worker ``identity`` with ``code`` now
        (their credits come back); ``cancel``: the worker may still run them."""
        w = self.workers.get(identity)
        for key in keys:
            job = self.jobs.get(key) if type(key) is int else None
            if w is None or job is None or job.worker != identity:
                continue
            w.inflight.discard(key)
            if cancel:
                to_workers.setdefault(identity, []).append(key)
            self._finish(job, FinishReason.ERROR, code, text, out)

    # ------------------------------------------------------------------ workers

    def on_backend(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded worker message."""
        out = _Outbox()
        if isinstance(msg, Register):
            self._register(identity, msg, now, out)
            return out.done()
        if isinstance(msg, Loading):
            self._loading(identity, msg, now, out)
            return out.done()
        w = self.workers.get(identity)
        if w is None:
            lw = self.workers.loading.get(identity)
            if lw is not None:  # heartbeats while loading; or it gave up (bye)
                lw.last_seen_s = now
                if isinstance(msg, Bye):
                    log.warning("worker %s stopped while loading model %r: %s", lw.name, lw.model, msg.reason)
                    self._loader_gone(lw, out)
            elif not isinstance(msg, Bye):
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

    def on_backend_error(self, identity: bytes, err: ProtocolError, keys: list = (), now: float = 0.0) -> list[Send]:
        """A worker sent an undecodable message: answer with its code. The
        requests it named (``keys``, as far as they could be read) that this
        worker holds end with that code (and are cancelled there): their
        tokens or endings were in the lost message."""
        self.counters["bad_messages"] += 1
        out = _Outbox()
        out.send(Side.BACKEND, identity, Error(err.code, err.message))
        to_workers: dict[bytes, list[int]] = {}
        self._fail_on_worker(identity, list(keys), err.code,
                             f"the worker's message about this request was refused: {err.message}",
                             to_workers, out, cancel=True)
        for w, ks in to_workers.items():
            out.send(Side.BACKEND, w, Cancel(tuple(ks)))
        w = self.workers.get(identity)
        if to_workers and w is not None:
            self._dispatch(w.model, now, out)
        return out.done()

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
        welcome = self._welcome(now, msg)
        if _encoded_size(welcome) > msg.max_message_bytes:
            self._refuse_registration(identity, msg, welcome, out)
            return
        self.workers.loading.pop(identity, None)  # loaded
        w = WorkerState(identity, msg.model, msg.num_slots, msg.max_inflight, msg.info, msg.worker_name, now,
                        max_message_bytes=msg.max_message_bytes)
        if identity in self._hung:
            # Found hung before: on probation until its progress moves past
            # the value it was stuck at.
            w.suspect = True
            w.progress = self._hung[identity]
        self.workers.add(w)
        self.models[msg.model] = msg.info
        self._queue(msg.model)
        out.send(Side.BACKEND, identity, welcome)
        self._dispatch(msg.model, now, out)
        self._tell_clients(now, out)

    def _refuse_registration(self, identity: bytes, msg: Register, welcome: Welcome, out: _Outbox) -> None:
        """The worker's frame limit is smaller than its ``welcome`` (which lists
        every model served), so it could never complete its
        registration: it gets no requests, is told why in a short ``error``
        (it registers again after its liveness window, and fits once its limit
        is raised or fewer models are served), and the operator is told what
        to do. Counted in ``control_too_large``; nobody else is affected, but
        a model it alone was loading is no longer waited for."""
        self.counters["control_too_large"] += 1
        limit, size = msg.max_message_bytes, _encoded_size(welcome)
        log.warning("worker %s cannot register model %r: the broker's welcome (%d bytes, %d models) exceeds its "
                    "frame limit of %d bytes (max_message_bytes); raise --max-message-bytes on that worker "
                    "(to %d or more)", msg.worker_name or identity.hex()[:8], msg.model, size,
                    len(welcome.models), limit, size)
        out.send(Side.BACKEND, identity, Error(ErrorCode.TOO_LARGE, (
            f"the broker's welcome ({size} bytes) exceeds this worker's frame limit of {limit} bytes "
            f"(max_message_bytes), so it cannot register: raise --max-message-bytes on this worker "
            f"(to {size} or more)")))
        lw = self.workers.loading.get(identity)
        if lw is not None:
            self._loader_gone(lw, out, f"the worker loading it ({lw.name}) cannot register (its "
                                       "max_message_bytes is too small for the broker's welcome)")

    def _loading(self, identity: bytes, msg: Loading, now: float, out: _Outbox) -> None:
        """A worker starts loading ``msg.model``: until it registers (or stops,
        or falls silent), requests for that model wait in its queue."""
        old = self.workers.get(identity)
        if old is not None:  # it restarted its model: whatever it held is void
            self._worker_lost(old, now, out, failed=False)
        self.workers.loading[identity] = LoadingWorker(identity, msg.model, msg.worker_name, now)
        self._queue(msg.model)
        log.info("worker %s is loading model %r", msg.worker_name, msg.model)
        out.send(Side.BACKEND, identity, self._welcome(now))
        self._tell_clients(now, out)

    def _loader_gone(self, lw: LoadingWorker, out: _Outbox, why: str | None = None) -> None:
        """A worker stopped loading without registering (it left, fell silent
        or could not register: ``why``). If nobody serves or loads its model
        now and the start-up grace is over, the requests waiting for it end
        ``unknown_model``."""
        del self.workers.loading[lw.identity]
        if self._grace_over:
            self._fail_unknown_models(out, why or f"the worker loading it ({lw.name}) stopped")
        self._tell_clients(lw.last_seen_s, out)

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
            if job.verdict is not None:  # the broker ended it already (the worker's word comes after)
                self._finish(job, FinishReason.ERROR, *job.verdict, out)
            else:
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
            if job.verdict is not None:
                self._finish(job, FinishReason.ERROR, *job.verdict, out)
            elif job.cancel_requested or job.client is None:
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
        self.counters[_COUNTER[reason]] += 1
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

    def peer_limit(self, side: Side, identity: bytes) -> int:
        """The largest frame ``identity`` decodes (bytes): clients, this broker's
        own limit; a worker, what it registered."""
        if side is Side.BACKEND:
            w = self.workers.get(identity)
            if w is not None:
                return w.max_message_bytes
        return self.config.max_message_bytes

    def _known(self, model: str) -> bool:
        """Requests for ``model`` wait for a worker: one registered it once, or one is loading it."""
        return model in self.models or any(lw.model == model for lw in self.workers.loading.values())

    def _models_now(self) -> tuple[dict[str, ModelInfo], tuple[str, ...]]:
        loading = tuple(sorted(set(self.workers.loading_models()) - set(self.models)))
        return dict(self.models), loading

    def _unknown_model(self, model: str) -> str:
        served, loading = self._models_now()
        return (f"no worker serves or loads model {model!r} (served: {', '.join(sorted(served)) or 'none'}; "
                f"loading: {', '.join(loading) or 'none'}); start one (slotserve worker --model {model}) "
                "or check the name")

    def _welcome(self, now: float, registering: Register | None = None) -> Welcome:
        """The welcome to send now; with ``registering``, the one its worker gets
        once its registration is accepted (its model served, with its info)."""
        models, loading = self._models_now()
        if registering is not None:
            models[registering.model] = registering.info
            loading = tuple(m for m in loading if m != registering.model)
        grace_left = 0.0 if self._grace_over else max(0.0, self.config.register_grace_s - (now - self.started_s))
        return Welcome(self.broker_id, self.config.heartbeat_interval_s, models, self.config.max_message_bytes,
                       loading, grace_left)

    def _tell_clients(self, now: float, out: _Outbox) -> None:
        """The models served or loading changed: send every client a fresh
        ``welcome`` (so ``Client.wait_for_model`` waits without asking)."""
        view = self._models_now()
        if view == self._models_view:
            return
        self._models_view = view
        welcome = self._welcome(now)
        for identity in self.clients:
            out.send(Side.FRONTEND, identity, welcome)

    # ------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> list[Send]:
        """Periodic work: end the start-up grace, end queued requests past their
        deadline, drop dead or hung workers (migrating their requests) and
        silent clients (cancelling theirs), and send heartbeats once per interval."""
        out = _Outbox()
        if not self._grace_over and now - self.started_s >= self.config.register_grace_s:
            self._grace_over = True
            self._fail_unknown_models(out, "the broker's start-up grace is over")
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
            self._client_lost(cs, ErrorCode.CLIENT_SILENT, out)
        if now >= self._next_heartbeat_s:
            self._next_heartbeat_s = now + self.config.heartbeat_interval_s
            hb = Heartbeat(broker_id=self.broker_id)
            for w in self.workers:
                out.send(Side.BACKEND, w.identity, hb)
            for identity in self.workers.loading:
                out.send(Side.BACKEND, identity, hb)
            for identity in self.clients:
                out.send(Side.FRONTEND, identity, hb)
        return out.done()

    def _check_workers(self, now: float, out: _Outbox) -> None:
        """Migrate the requests of dead workers (silent past ``worker_liveness_s``)
        and hung ones (heartbeating, but no progress past ``worker_hung_s``)."""
        cutoff = now - self.config.worker_liveness_s
        for w in self.workers.silent_since(cutoff):
            self._worker_lost(w, now, out, failed=True)
        for lw in [x for x in self.workers.loading.values() if x.last_seen_s < cutoff]:
            log.warning("worker %s fell silent while loading model %r", lw.name, lw.model)
            self._loader_gone(lw, out)
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

    def _fail_unknown_models(self, out: _Outbox, why: str) -> None:
        """End requests still waiting for a model that no worker registered or
        loads (``unknown_model``; ``why``: what changed, for the message)."""
        for model in [m for m in self.queues if not self._known(m)]:
            q = self.queues.pop(model)
            text = f"{why}: {self._unknown_model(model)}"
            while (job := q.pop()) is not None:
                self._finish(job, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, text, out)

    def status(self, now: float) -> Status:
        """A snapshot for ``slotserve status``."""
        models = {}
        loading = self.workers.loading_models()
        for name in sorted(set(self.queues) | set(self.models) | set(loading)):
            ws = self.workers.for_model(name)
            q = self.queues.get(name)
            models[name] = ModelStatus(
                queued=len(q) if q is not None else 0,
                running=sum(len(w.inflight) for w in ws),
                workers=len(ws),
                slots_busy=sum(min(len(w.inflight), w.num_slots) for w in ws),
                slots_total=sum(w.num_slots for w in ws),
                loading=loading.get(name, 0),
            )
        workers = tuple(WorkerStatus(w.name, w.model, w.num_slots, len(w.inflight), w.iterations, w.suspect)
                        for w in self.workers)
        return Status(self.broker_id, now - self.started_s, models, workers, len(self.clients),
                      dict(self.counters))


def _encoded_size(msg: Message) -> int:
    """``msg``'s length on the wire (bytes); 0 when it cannot be encoded (the
    socket loop finds and reports that itself)."""
    try:
        return len(encode(msg))
    except Exception:  # noqa: BLE001 -- see above
        return 0
