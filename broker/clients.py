"""The broker's decisions about clients: their submissions and cancels, and
what happens to their requests when one is lost.

A resubmission of a request id still in flight for the same client is
recognised and ignored (it is already running; its results keep flowing),
so nothing runs twice. Invariant (kept here): every accepted request ends
in exactly one ``finished`` entry to its client, unless the client is gone
-- a client the broker gives up on is told how each of its requests ended.
"""

from __future__ import annotations

from broker.config import BrokerConfig
from broker.jobs import JobTable
from broker.models import ServedModels
from broker.outbox import Outbox, Side
from broker.workers import WorkerHandler
from protocol.enums import ErrorCode, FinishReason
from protocol.framing import request_ids
from protocol.messages import Error, Finished, Hello, Message, Results, Submit
from protocol.request import RequestId


class ClientState:
    """A client seen within the liveness window (its requests in flight: ``JobTable.of_client``)."""

    __slots__ = ("identity", "name", "last_seen_s")

    def __init__(self, identity: bytes, now: float) -> None:
        self.identity = identity
        self.name = ""
        self.last_seen_s = now


class ClientHandler:
    """Handles every client event on the client table, the job table, the
    workers (dispatch) and the served models.

    ``clients``: identity -> :class:`ClientState`, the core's table (also read
    by :class:`~broker.models.ServedModels`, which tells every client).
    """

    def __init__(self, config: BrokerConfig, counters: dict[str, int], clients: dict[bytes, ClientState],
                 jobs: JobTable, workers: WorkerHandler, models: ServedModels) -> None:
        self.config = config
        self.counters = counters
        self.clients = clients
        self._jobs = jobs
        self._workers = workers
        self._models = models

    def seen(self, identity: bytes, now: float) -> ClientState:
        """The client ``identity`` (added if new), noted alive at ``now``."""
        cs = self.clients.get(identity)
        if cs is None:
            cs = self.clients[identity] = ClientState(identity, now)
        cs.last_seen_s = now
        return cs

    def hello(self, cs: ClientState, msg: Hello, now: float, out: Outbox) -> None:
        """A client introduces itself: it is told the models served and loading."""
        cs.name = msg.client_name
        out.send(Side.FRONTEND, cs.identity, self._models.welcome(now))

    def submit(self, cs: ClientState, msg: Submit, now: float, out: Outbox) -> None:
        """Queue the requests of ``msg`` (each may end at once: see
        :meth:`JobTable.admit`) and dispatch. A request for an alias is one for its model."""
        model = self._models.resolve(msg.model)
        if not self._models.known(model) and self._models.grace_over:
            self._refuse_unknown(cs, msg, out)
            return
        # A model being loaded, or (within the start-up grace) one nobody
        # serves yet: its requests wait in its queue for a worker, bounded by
        # their own deadlines and the queue's bound.
        self._jobs.admit(cs.identity, msg.requests, model, now, out,
                         lambda: self._workers.dispatch(model, now, out))
        self.counters["submitted"] += len(msg.requests)
        self._workers.dispatch(model, now, out)

    def _refuse_unknown(self, cs: ClientState, msg: Submit, out: Outbox) -> None:
        """Nobody serves or loads ``msg.model``: each request ends ``unknown_model``."""
        r = out.result(cs.identity)
        text = self._models.unknown(msg.model)
        for entry in msg.requests:
            r.finished.append(Finished(entry.request_id, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, text))
        self.counters["errors"] += len(msg.requests)

    def cancel(self, cs: ClientState, rids: list[RequestId], out: Outbox) -> None:
        """Cancel the client's requests ``rids`` (ids it does not hold are ignored)."""
        to_workers: dict[bytes, list[int]] = {}
        for rid in rids:
            job = self._jobs.find(cs.identity, rid)
            if job is not None:
                self._jobs.cancel(job, to_workers, out)
        out.cancels(to_workers)

    def lost(self, cs: ClientState, code: ErrorCode | None, out: Outbox, also: tuple[RequestId, ...] = ()) -> None:
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
        jobs = self._jobs
        keys = jobs.of_client.pop(cs.identity, {}).values()
        if keys:
            self.counters["clients_lost"] += 1
        text = self._lost_text(code)
        rids = []
        to_workers: dict[bytes, list[int]] = {}
        for key in sorted(keys):  # keys grow with arrival
            job = jobs.by_key[key]
            rids.append(job.rid)
            jobs.detach(job)  # results of a running job are dropped from now on
            if code is None:
                jobs.cancel(job, to_workers, out)
            else:
                jobs.end(job, code, text, to_workers, out)
        out.results.pop(cs.identity, None)
        out.cancels(to_workers)
        if code is ErrorCode.SLOW_CONSUMER:
            ids = tuple(dict.fromkeys(rids + list(also)))
            if ids:
                out.send(Side.FRONTEND, cs.identity, Error(code, text, ids))
        elif code is not None and rids:
            out.send(Side.FRONTEND, cs.identity, Results(finished=tuple(
                Finished(rid, FinishReason.ERROR, code, text) for rid in rids)))

    def _lost_text(self, code: ErrorCode | None) -> str | None:
        """The message of the error ending requests of a client the broker gives
        up on with ``code`` (None: the client left, nothing is said)."""
        if code is ErrorCode.SLOW_CONSUMER:
            return "the client stopped reading its results (the broker's buffer for it is full): request ended"
        if code is not None:
            return (f"no heartbeat from this client for {self.config.client_liveness_s:g} s (the broker's "
                    f"liveness window; it heartbeats every {self.config.heartbeat_interval_s:g} s): request ended")
        return None

    def unreachable(self, identity: bytes, code: ErrorCode | None, discarded: list[Message], out: Outbox) -> None:
        """See :meth:`broker.core.BrokerCore.client_unreachable`."""
        also: list[RequestId] = []
        for m in discarded:
            if type(m) is Results:
                self.counters["errors"] += len(m.finished)
            also.extend(request_ids(m))
        cs = self.clients.get(identity)
        if cs is not None:
            self.lost(cs, code, out, tuple(also))
        elif code is not None and also:
            out.send(Side.FRONTEND, identity, Error(
                code, "the client stopped reading its results: request ended", tuple(dict.fromkeys(also))))

    def check(self, now: float, out: Outbox) -> None:
        """Give up on clients silent past ``client_liveness_s`` (``client_silent``)."""
        cutoff = now - self.config.client_liveness_s
        for cs in [c for c in self.clients.values() if c.last_seen_s < cutoff]:
            self.lost(cs, ErrorCode.CLIENT_SILENT, out)

    def name(self, identity: bytes) -> str:
        """How logs name the client ``identity``: its name, else its identity's start."""
        cs = self.clients.get(identity)
        return cs.name if cs is not None and cs.name else identity.hex()[:8]
