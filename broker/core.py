"""The broker's decisions, without sockets: events in, messages to send out.

:class:`BrokerCore` is fed decoded messages (with the sender's identity and
the current monotonic time) and housekeeping ticks; every method returns the
list of :class:`~broker.outbox.Send` actions to perform. :mod:`broker.server`
owns the sockets and performs them; tests drive the core directly.

The core only routes each event to the part it concerns, all sharing one
set of counters:

- :mod:`broker.clients`: submissions, cancels, clients lost;
- :mod:`broker.workers`: registration and loading, iterations, dispatch to
  credits, workers lost or hung (their state in :mod:`broker.registry`);
- :mod:`broker.jobs`: the requests held, their queues, and how each ends;
- :mod:`broker.models`: the models served or loading, and the welcomes;
- :mod:`broker.demand`: the models on demand's states and the orders for them (the supervisor's);
- :mod:`broker.failures`: frames that do not decode, parts that cannot be
  sent, handlers that raise: the requests they name end with a code;
- :mod:`broker.outbox`: what one event sends.

Each part's module states the invariants it keeps: every accepted request
ends in exactly one ``finished`` entry to its client (unless the client is
gone); a worker never holds more requests than its ``max_inflight``
credits; a request lost with a worker resumes on the next one with the
tokens the client already has (no gap, no duplicate).
"""

from __future__ import annotations

from broker.clients import ClientHandler, ClientState
from broker.config import BrokerConfig
from broker.demand import DemandBoard
from broker.failures import FailureHandler
from broker.jobs import ENDING_COUNTER, JobTable
from broker.models import ServedModels
from broker.outbox import Outbox, Send, Side
from broker.registry import WorkerRegistry
from broker.workers import WorkerHandler
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.framing import Refused
from protocol.messages import (
    Bye, Cancel, Demand, Finished, Heartbeat, Hello, Iteration, Loading, Message, ModelOrder, ModelStatus,
    Register, Status, StatusQuery, Submit, WorkerStatus,
)
from protocol.request import RequestId

__all__ = ["COUNTERS", "BrokerCore"]

COUNTERS = ("submitted", "dispatched", "completed", "cancelled", "deadline", "errors",
            "queue_full", "requeued", "duplicates", "workers_lost", "workers_left", "workers_hung", "clients_lost",
            "tokens_out", "bad_messages", "control_too_large", "internal_errors")
"""Names of the totals reported in ``status`` (all since broker start).
``workers_lost``: workers that died or hung (their requests count an attempt);
``workers_left``: workers that left cleanly (stopped, drained, unloaded on
demand, or re-registered: their requests move on without counting one);
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
    """All broker state and decisions. Not thread-safe: one loop drives it.

    State, for the socket loop, metrics and tests to read: ``workers`` (the
    :class:`~broker.registry.WorkerRegistry`), ``clients`` (identity ->
    :class:`~broker.clients.ClientState`), ``jobs`` (broker key -> job),
    ``queues`` (model -> its queue), ``models`` (model -> info, every model
    ever registered), ``demand`` (the models on demand's :class:`~broker.demand.DemandBoard`) and
    ``counters`` (:data:`COUNTERS`).
    """

    def __init__(self, config: BrokerConfig, broker_id: str, now: float) -> None:
        self.config = config
        self.broker_id = broker_id
        self.started_s = now
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.workers = WorkerRegistry()
        self.clients: dict[bytes, ClientState] = {}
        self._jobs = JobTable(config, self.counters)
        self._models = ServedModels(config, broker_id, now, self.workers, self._jobs, self.clients)
        self._workers = WorkerHandler(config, self.counters, self.workers, self._jobs, self._models)
        self._clients = ClientHandler(config, self.counters, self.clients, self._jobs, self._workers, self._models)
        self._failures = FailureHandler(self.counters, self.workers, self._jobs, self._clients, self._workers,
                                        self.peer_limit)
        self.jobs = self._jobs.by_key
        self.queues = self._jobs.queues
        self.models = self._models.served
        self.demand = DemandBoard(config.on_demand_models, broker_id, self._models.resolve,
                                  self._models.load_failures)
        self._next_heartbeat_s = now

    @property
    def _by_client(self) -> dict:
        """``(client identity, request id)`` -> broker key of every job attached to its client (a copy; tests read it)."""
        return self._jobs.by_client

    @property
    def record_timings(self) -> bool:
        """Keep broker-side TTFT / latency samples for :meth:`take_timings` (on
        only while someone collects them: metrics on)."""
        return self._jobs.record_timings

    @record_timings.setter
    def record_timings(self, on: bool) -> None:
        self._jobs.record_timings = on

    # ------------------------------------------------------------------ events

    def on_frontend(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded client message."""
        out = Outbox()
        clients = self._clients
        cs = clients.seen(identity, now)  # every message, a heartbeat too, says the client is alive
        if isinstance(msg, Submit):
            clients.submit(cs, msg, now, out)
        elif isinstance(msg, Cancel):
            clients.cancel(cs, msg.request_ids, out)
        elif isinstance(msg, Hello):
            clients.hello(cs, msg, now, out)
        elif isinstance(msg, StatusQuery):
            out.send(Side.FRONTEND, identity, self.status(now, msg.query))
        elif isinstance(msg, ModelOrder):  # (answered by the status it makes: its state shows at once)
            self.demand.order(msg)
            out.send(Side.FRONTEND, identity, self.status(now, msg.query))
        elif isinstance(msg, Demand):
            self.demand.said(msg)
        elif isinstance(msg, Bye):
            clients.lost(cs, None, out)
        return out.done()

    def on_frontend_error(self, identity: bytes, err: ProtocolError, request_ids: list[RequestId],
                          now: float) -> list[Send]:
        """A client sent an undecodable message: answer with its code, naming any
        request ids it carried (the client ends those requests with the error)."""
        return self._failures.bad_client_frame(identity, err, request_ids, now)

    def on_backend(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded worker message."""
        out = Outbox()
        workers = self._workers
        if isinstance(msg, Register):
            workers.register(identity, msg, now, out)
        elif isinstance(msg, Loading):
            workers.loading(identity, msg, now, out)
        elif (w := self.workers.get(identity)) is None:
            workers.unregistered(identity, msg, now, out)
        else:
            w.last_seen_s = now
            if isinstance(msg, Iteration):
                workers.iteration(w, msg, now, out)
            elif isinstance(msg, Heartbeat):
                workers.heartbeat(w, msg, now, out)
            elif isinstance(msg, Bye):
                workers.lost(w, now, out, failed=False)
        return out.done()

    def on_backend_error(self, identity: bytes, err: ProtocolError, keys: list = (), now: float = 0.0) -> list[Send]:
        """A worker sent an undecodable message: answer with its code. The
        requests it named (``keys``, as far as they could be read) that this
        worker holds end with that code (and are cancelled there): their
        tokens or endings were in the lost message."""
        out = Outbox()
        self._failures.bad_worker_frame(identity, err, keys, now, out)
        return out.done()

    def restart_silence_timers(self, now: float, since_s: float = float("-inf")) -> None:
        """The broker's own loop was stalled until ``now`` (suspended, SIGSTOPped, starved: its socket
        loop's :class:`~protocol.liveness.StallWatch` saw a turn come late), so it heard nobody
        meanwhile and nobody's silence counts: every worker's, loader's and client's silence timer,
        every worker's progress timer (``worker_hung_s``) and the start-up grace
        (``register_grace_s``) restart at ``now``, each a fresh window -- each that started after
        ``since_s``, the previous stall's end (:meth:`StallWatch.excuses
        <protocol.liveness.StallWatch.excuses>`: a slow broker, stalled at every turn, still
        judges a silent peer). Sends nothing."""
        self.workers.heard_all(now, since_s)
        for cs in self.clients.values():
            if cs.last_seen_s > since_s:
                cs.last_seen_s = now
        self._models.restart_grace(now, since_s)

    def tick(self, now: float) -> list[Send]:
        """Periodic work: end the start-up grace, end queued requests past their
        deadline, drop dead or hung workers (migrating their requests) and
        silent clients (cancelling theirs), and send heartbeats once per interval."""
        out = Outbox()
        self._models.end_grace(now, out)
        self._jobs.expire(now, out)
        self._workers.check(now, out)
        self._clients.check(now, out)
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

    # ------------------------------------------------------------------ what the socket loop could not do

    def client_unreachable(self, identity: bytes, code: ErrorCode | None,
                           discarded: list[Message] = ()) -> list[Send]:
        """The socket loop could not deliver to a client: it is gone (``code``
        None), or it stopped reading and its buffer bound was hit
        (``slow_consumer``). ``discarded``: the messages for it the loop threw
        away unsent (their endings already taken out of the counters, see
        :meth:`count_endings`): their endings count as errors, and with a
        ``code`` the client is told that each request they name ended with it."""
        out = Outbox()
        self._clients.unreachable(identity, code, discarded, out)
        return out.done()

    def worker_unreachable(self, identity: bytes, now: float) -> list[Send]:
        """The socket loop could not deliver to a worker: treat it as dead."""
        out = Outbox()
        w = self.workers.get(identity)
        if w is not None:
            self._workers.lost(w, now, out, failed=True)
        return out.done()

    def count_endings(self, finished: tuple[Finished, ...], sign: int) -> None:
        """Take endings out of the counters (``sign`` -1: the socket loop holds
        their message back) or put them back (+1: it left). The loop calls
        both within one pass, so nobody reading the counters between passes
        ever sees one ending counted twice or a counter go down."""
        c = self.counters
        for f in finished:
            c[ENDING_COUNTER[f.finish_reason]] += sign

    def undeliverable(self, side: Side, identity: bytes, refused: list[Refused], now: float) -> list[Send]:
        """Parts of messages the socket loop could not send (one request each:
        too large for the receiver even alone, or not encodable; see
        :func:`protocol.framing.fit`): each request named ends with the part's
        error code, and nothing else is touched. A part naming no request
        (a status, a welcome) is only logged."""
        out = Outbox()
        self._failures.undeliverable(side, identity, refused, now, out)
        return out.done()

    def handling_failed(self, side: Side, identity: bytes, msg: Message | None, error: BaseException,
                        now: float) -> list[Send]:
        """Handling ``msg`` raised ``error`` (a bug): every request it names ends
        with ``internal``, so that none waits forever; the rest of the broker
        carries on. ``msg`` None: nothing to attribute."""
        out = Outbox()
        self._failures.handling_failed(side, identity, msg, error, now, out)
        return out.done()

    # ------------------------------------------------------------------ reading

    def peer_limit(self, side: Side, identity: bytes) -> int:
        """The largest frame ``identity`` decodes (bytes): clients, this broker's
        own limit; a worker, what it registered."""
        if side is Side.BACKEND:
            w = self.workers.get(identity)
            if w is not None:
                return w.max_message_bytes
        return self.config.max_message_bytes

    def take_timings(self, kind: str) -> list[float]:
        """Samples of ``"ttft"`` or ``"latency"`` (seconds) since the last call."""
        return self._jobs.take(kind)

    def status(self, now: float, query: int = 0) -> Status:
        """A snapshot for ``slotserve status``; ``query``: the number of the query it answers (its ``query``)."""
        models = {}
        loading = self.workers.loading_models()
        # (a model on demand by its own name: its aliases are listed as such, a request queued under one by it)
        for name in sorted(set(self.queues) | set(self.models) | set(loading) | set(self.demand.primaries())):
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
        workers = tuple(WorkerStatus(w.name, w.model, w.num_slots, len(w.inflight), w.iterations, w.suspect,
                                     w.prefix_cache)
                        for w in self.workers)
        on_demand = self.demand.states(models) if self.config.on_demand_models else {}
        return Status(self.broker_id, now - self.started_s, models, workers, len(self.clients),
                      dict(self.counters), {**self.demand.aliases(), **self._models.known_aliases()},
                      {lw.name: lw.model for lw in self.workers.loading.values()}, on_demand, self.demand.pending(),
                      query)
