"""Messages that failed: a frame a peer sent that does not decode, a part of a
broker message the socket loop could not send, a message whose handling
raised (a broker bug).

Each is the per-call failure channel (STYLE.md 5) and touches nothing else:
every request the failed message names ends with the code saying why (the
requests stay accounted for: exactly one ending each), and a control
message naming no request is answered or logged with the remedy.
"""

from __future__ import annotations

import logging
from typing import Callable

from broker.clients import ClientHandler
from broker.jobs import ENDING_COUNTER, JobTable
from broker.outbox import Outbox, Send, Side, encoded_size
from broker.registry import WorkerRegistry
from broker.workers import WorkerHandler
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.framing import Refused, request_ids
from protocol.messages import Assign, Error, Finished, Message
from protocol.request import RequestId

log = logging.getLogger(__name__)


class FailureHandler:
    """Ends what failed messages name, on the job table, the clients and the
    workers. ``peer_limit(side, identity)``: the receiver's frame limit
    (:meth:`broker.core.BrokerCore.peer_limit`)."""

    def __init__(self, counters: dict[str, int], registry: WorkerRegistry, jobs: JobTable,
                 clients: ClientHandler, workers: WorkerHandler, peer_limit: Callable[[Side, bytes], int]) -> None:
        self.counters = counters
        self.registry = registry
        self._jobs = jobs
        self._clients = clients
        self._workers = workers
        self._peer_limit = peer_limit

    def bad_client_frame(self, identity: bytes, err: ProtocolError, request_ids: list[RequestId],
                         now: float) -> list[Send]:
        """See :meth:`broker.core.BrokerCore.on_frontend_error`."""
        self.counters["bad_messages"] += 1
        self._clients.seen(identity, now)
        ids = tuple(r for r in request_ids if self._jobs.find(identity, r) is None)
        return [Send(Side.FRONTEND, identity, Error(err.code, err.message, ids))]

    def bad_worker_frame(self, identity: bytes, err: ProtocolError, keys: list, now: float, out: Outbox) -> None:
        """See :meth:`broker.core.BrokerCore.on_backend_error`."""
        self.counters["bad_messages"] += 1
        out.send(Side.BACKEND, identity, Error(err.code, err.message))
        to_workers: dict[bytes, list[int]] = {}
        self._fail_on_worker(identity, list(keys), err.code,
                             f"the worker's message about this request was refused: {err.message}",
                             to_workers, out, cancel=True)
        out.cancels(to_workers)
        w = self.registry.get(identity)
        if to_workers and w is not None:
            self._workers.dispatch(w.model, now, out)

    def undeliverable(self, side: Side, identity: bytes, refused: list[Refused], now: float, out: Outbox) -> None:
        """See :meth:`broker.core.BrokerCore.undeliverable`."""
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
        out.cancels(to_workers)
        for model in {w.model for w in (self.registry.get(identity),) if w is not None}:
            self._workers.dispatch(model, now, out)

    def _control_too_large(self, side: Side, identity: bytes, msg: Message, out: Outbox) -> None:
        """``msg``, a control message naming no request (a welcome listing many
        models, a status), exceeds the frame limit of the peer it is for, so it
        cannot go. The peer's limit is too small for the control traffic (or,
        for clients and loading workers, which announce none, the broker's own
        ``--max-message-bytes``): a configuration fault, counted in
        ``control_too_large``, logged with the remedy. The peer is told in a
        short ``error`` (well within the smallest limit any peer may have,
        ``MIN_MESSAGE_BYTES``); nobody else is affected."""
        self.counters["control_too_large"] += 1
        limit = self._peer_limit(side, identity)
        size = encoded_size(msg)
        what = type(msg).__name__.lower()
        w = self.registry.get(identity) if side is Side.BACKEND else None
        if w is not None:
            peer, fix = f"worker {w.name}", "that worker"
        elif side is Side.BACKEND:
            peer, fix = f"worker {identity.hex()[:8]}", "the broker (it is the limit used for loading workers)"
        else:
            peer = f"client {self._clients.name(identity)}"
            fix = "the broker (clients are sent at most the broker's own limit)"
        log.warning("cannot send a %s of %d bytes to %s: over its frame limit of %d bytes (max_message_bytes); "
                    "raise --max-message-bytes on %s", what, size, peer, limit, fix)
        if type(msg) is not Error:  # (an error that does not fit is not answered with another)
            out.send(side, identity, Error(ErrorCode.TOO_LARGE, (
                f"the broker's {what} message ({size} bytes) exceeds the frame limit of {limit} bytes "
                f"(max_message_bytes) it must keep to for you: raise --max-message-bytes on {fix}")))

    def handling_failed(self, side: Side, identity: bytes, msg: Message | None, error: BaseException,
                        now: float, out: Outbox) -> None:
        """See :meth:`broker.core.BrokerCore.handling_failed`."""
        self.counters["internal_errors"] += 1
        ids = [] if msg is None else request_ids(msg)
        if not ids:
            return
        text = f"the broker failed handling this request ({type(error).__name__}: {error}); please report it"
        to_workers: dict[bytes, list[int]] = {}
        if side is Side.FRONTEND:
            self._clients.seen(identity, now)
            self._fail_for_client(identity, ids, ErrorCode.INTERNAL, text, None, to_workers, out)
        else:
            self._fail_on_worker(identity, ids, ErrorCode.INTERNAL, text, to_workers, out, cancel=True)
        out.cancels(to_workers)
        w = self.registry.get(identity) if side is Side.BACKEND else None
        if w is not None:
            self._workers.dispatch(w.model, now, out)

    def _fail_for_client(self, identity: bytes, rids: list[RequestId], code: ErrorCode, text: str,
                         part: Message | None, to_workers: dict[bytes, list[int]], out: Outbox) -> None:
        """End the client's requests ``rids`` with ``code``, telling it now. A
        request the broker no longer holds ended in ``part`` (a message that was
        not delivered): its ending is recounted as this error."""
        finished = {f.request_id: f for f in getattr(part, "finished", ())}
        for rid in rids:
            job = self._jobs.find(identity, rid)
            if job is not None:
                self._jobs.detach(job)
                self._jobs.end(job, code, text, to_workers, out)
            else:
                f = finished.get(rid)
                if f is not None:
                    if f.finish_reason is FinishReason.ERROR:
                        # Its error ending itself could not be sent: give up
                        # rather than try forever (the client keeps waiting).
                        log.error("cannot send the ending of request %r to client %s: %s", rid,
                                  identity.hex()[:8], text)
                        continue
                    self.counters[ENDING_COUNTER[f.finish_reason]] -= 1
                    self.counters["errors"] += 1
            out.result(identity).finished.append(Finished(rid, FinishReason.ERROR, code, text))

    def _fail_on_worker(self, identity: bytes, keys: list, code: ErrorCode, text: str,
                        to_workers: dict[bytes, list[int]], out: Outbox, *, cancel: bool) -> None:
        """End the requests ``keys`` held by worker ``identity`` with ``code`` now
        (their credits come back); ``cancel``: the worker may still run them."""
        w = self.registry.get(identity)
        for key in keys:
            job = self._jobs.by_key.get(key) if type(key) is int else None
            if w is None or job is None or job.worker != identity:
                continue
            w.inflight.discard(key)
            if cancel:
                to_workers.setdefault(identity, []).append(key)
            self._jobs.finish(job, FinishReason.ERROR, code, text, out)
