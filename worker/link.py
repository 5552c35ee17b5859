"""The worker's link to the broker: the I/O thread (:func:`serve_broker`, :class:`BrokerLink`).

The I/O thread owns the DEALER socket to the broker's backend and its end of
the inproc PAIR from the main thread (:mod:`worker.process`). It announces
the model when loading starts (``loading``: requests for it wait in the
broker's queue meanwhile), registers once loaded and warmed up (model and
its served names, slots, credits),
hands assigned requests and cancellations to its worker (:class:`LinkedWorker`:
the :class:`~worker.process.WorkerProcess`, which submits them into the engine:
``submit`` is thread-safe; a text prompt to tokenise or a constraint to compile
waits for the admission thread, :mod:`worker.admission`), sends heartbeats at the broker's
interval (announced in its ``welcome``), and forwards the main thread's
iterations, split to fit the broker's frame limit. A long model step (or the
model's load) never blocks it, so heartbeats keep flowing.

The main thread wakes it with one byte on the PAIR: :data:`WAKE` (iterations
wait in the outbox; one wake-up per empty -> non-empty transition),
:data:`READY` (the model is loaded and warm: register) or :data:`STOP` (say
goodbye and end). Iterations that piled up while it was busy (fast steps) leave
merged as one message, in order.

One message never stops the worker: a frame from the broker that cannot be
decoded, or whose handling raises, refuses just the requests it assigned
(an error ending each); an iteration part that cannot be sent (too large
for the broker even alone) ends just its request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, Protocol

import zmq

from protocol.codec import decode, encode, peek_request_ids
from protocol.endpoints import set_ipv6
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.framing import fit, request_ids
from protocol.liveness import StallWatch
from protocol.messages import (
    BROKER_TO_WORKER, Assign, Bye, Cancel, Envelope, Error, Finished, Heartbeat, Iteration, Loading, Message,
    ModelInfo, PrefixCacheUsage, Register, Rejected, Welcome,
)
from worker.config import WorkerConfig

log = logging.getLogger(__name__)

WAKE, STOP, READY = b"w", b"s", b"r"
"""The main thread's signals to the I/O thread, one byte each on the inproc PAIR."""

_BROKER_BEATS_PER_WINDOW = 3  # the broker counts as lost after this many of its heartbeat intervals, at least


class LinkedWorker(Protocol):
    """What the I/O thread reads and calls of its worker: the shape of
    :class:`~worker.process.WorkerProcess` seen from here (so this module need not import it).
    The methods (each documented there) run on the I/O thread; the attributes are set before
    it starts, except ``iterations`` (an int the main thread counts up), ``goodbye`` and ``load_failed``."""

    config: WorkerConfig
    identity: bytes                                   # the DEALER's routing id
    curve_keys: tuple[bytes, bytes, bytes] | None     # (public, secret, broker's public) or None: no CURVE
    name: str                                         # shown in the broker's status and logs
    info: ModelInfo | None                            # what ``register`` says of the model (set once loaded)
    ready: bool                                       # loaded and warm when the I/O thread starts
    iterations: int                                   # engine iterations so far (heartbeats' progress)
    goodbye: str                                      # the ``bye`` message's reason
    load_failed: bool                                 # ... and whether it says the model failed to load

    def take_outbox(self) -> list[Iteration]: ...
    def assign(self, entries: tuple[Envelope | Rejected, ...]) -> list[Finished]: ...
    def cancel(self, keys: list[int]) -> list[Finished]: ...
    def holds(self, key) -> bool: ...
    def abandon(self, keys: list) -> None: ...
    def drop_all(self) -> None: ...
    def prefix_cache_usage(self) -> PrefixCacheUsage | None: ...


def serve_broker(wp: LinkedWorker, ctx: zmq.Context, pipe: zmq.Socket, stop: threading.Event,
                 admitted: zmq.Socket | None = None) -> None:
    """The I/O thread's body: link ``wp`` to the broker until the main thread
    sends :data:`STOP`. ``admitted``: its PULL end of the admission lanes' wake-ups
    (:mod:`worker.admission`: :data:`WAKE` when an ending waits in the outbox), or None.
    A failure here stops the worker (sets ``stop``), loudly; ``pipe``, ``admitted``
    and the DEALER are closed either way."""
    link = None
    try:
        link = BrokerLink(wp, ctx, pipe, admitted)
        link.loop()
    except Exception:  # noqa: BLE001 -- a dead I/O thread must stop the worker, loudly
        log.exception("worker I/O thread failed; stopping the worker")
        stop.set()
    finally:
        pipe.close(0)
        if admitted is not None:
            admitted.close(0)
        if link is not None and not link.sock.closed:
            link.sock.close(0)


class BrokerLink:
    """The I/O thread's state and loop (owns the DEALER and its PAIR end).

    Phases: *loading* (the model is loading or warming up: ``loading`` sent,
    heartbeats once the broker answered), then *registering* / *registered*
    (``register`` sent / welcomed). Heartbeats and the broker's liveness
    window follow the broker's interval from its welcome. ``clock``: the monotonic clock the
    loop reads (seconds; :func:`time.monotonic`, a test's own)."""

    def __init__(self, wp: LinkedWorker, ctx: zmq.Context, pipe: zmq.Socket, admitted: zmq.Socket | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.wp = wp
        self._clock = clock
        self.cfg = wp.config
        self.pipe = pipe
        self.admitted = admitted
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, wp.identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes)
        if wp.curve_keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = wp.curve_keys
        set_ipv6(self.sock, self.cfg.broker, bind=False)
        self.sock.connect(self.cfg.broker)
        self.broker_id: str | None = None
        self.ready = wp.ready  # loaded and warm: registered, not announced as loading
        self.model, *aliases = self.cfg.served_names  # the primary name and the aliases clients may use
        self.aliases = tuple(aliases)
        self.welcomed = False    # the broker answered our latest loading / register
        self.registered = False  # ... and it was a register: requests may come
        self.heartbeat_s = self.cfg.heartbeat_interval_s
        self.broker_liveness_s = self.cfg.broker_liveness_s
        self.max_send_bytes = self.cfg.max_message_bytes  # until the broker's welcome says its own
        self.last_sent = 0.0
        self.last_recv = clock()
        # the loop's own stalls (a frozen process): the broker's silence meanwhile does not count
        self.stalls = StallWatch(self.broker_liveness_s, self.last_recv, period_s=self.heartbeat_s)
        self.usage_sent = None      # the PrefixCacheUsage of the latest heartbeat
        self.usage_checked_s = 0.0  # when the prefix cache's numbers were last compared with it

    def send(self, msg: Message) -> None:
        """Send ``msg``, split to fit the broker's frame limit; an iteration
        part that cannot be sent even alone ends its request with an error."""
        framed = fit(msg, self.max_send_bytes)
        for data, _ in framed.frames:
            try:
                self.sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                # 100k messages unsent: the broker is not reading us. Losing this
                # message would lose tokens, so start over with a fresh registration.
                log.error("broker not reading (send buffer full): dropping all work and registering again")
                self.reregister()
                return
            self.last_sent = self._clock()
        for part, code, reason in framed.refused:
            keys = request_ids(part)
            log.error("cannot send a %s message (%s)%s", type(part).__name__, reason,
                      f": ending request {keys}" if keys else "")
            if keys and type(part) is Iteration:
                self.wp.abandon(keys)
                self.send(Iteration(finished=tuple(Finished(k, FinishReason.ERROR, code,
                                                            f"the worker could not send its output: {reason}")
                                                   for k in keys)))

    def announce(self) -> None:
        """Tell the broker the model is loading (requests for it wait meanwhile)."""
        self.welcomed = False
        self.send(Loading(self.model, self.wp.name, self.aliases))

    def register(self) -> None:
        wp = self.wp
        self.welcomed = False
        self.send(Register(self.model, self.cfg.num_slots, self.cfg.max_inflight, wp.info, wp.name,
                           self.cfg.max_message_bytes, self.aliases))

    def reregister(self) -> None:
        if not self.ready:
            self.announce()
            return
        self.wp.drop_all()
        self.registered = False
        self.register()

    def loop(self) -> None:
        """Serve until the main thread sends :data:`STOP`: the pipe, the broker's
        messages, then the liveness window and the heartbeat, each turn."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.pipe, zmq.POLLIN)
        if self.admitted is not None:
            poller.register(self.admitted, zmq.POLLIN)
        if self.ready:
            self.register()
        else:
            self.announce()
        while True:
            events = dict(poller.poll(self._wait_ms()))
            if self.pipe in events and self._from_main_thread():
                self._say_goodbye()
                return
            if self.admitted is not None and self.admitted in events:
                self._from_admission()
            if self.sock in events:
                self._receive()
            self._keep_alive()

    def _wait_ms(self) -> float:
        """How long the loop's poll may wait (milliseconds): until the next heartbeat is due once the
        broker welcomed us; before that (nothing is sent until it answers) until its window ends,
        at most a heartbeat interval. (It waited for a heartbeat that is never sent before the
        welcome: 0 ms, a busy loop of ~65,000 turns a second while the broker was down or had not
        answered yet.)"""
        now = self._clock()
        due = self.last_sent + self.heartbeat_s if self.welcomed else self.last_recv + self.broker_liveness_s
        return max(0.0, min(due - now, self.heartbeat_s)) * 1000

    def _from_main_thread(self) -> bool:
        """Read the pipe's signals and forward the iterations waiting; True when told to stop."""
        stopping = False
        while True:
            try:
                signal = self.pipe.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            stopping |= signal == STOP
            if signal == READY:
                self.ready = True
                self.register()
        self._forward(self.wp.take_outbox())
        return stopping

    def _from_admission(self) -> None:
        """Read the admission lanes' wake-ups and forward what waits in the outbox (their endings)."""
        while True:
            try:
                self.admitted.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._forward(self.wp.take_outbox())

    def _say_goodbye(self) -> None:
        try:
            self.sock.send(encode(Bye(self.wp.goodbye, self.wp.load_failed)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the broker is not reading; it will notice the silence
        self.sock.close(linger=500)  # let the goodbye leave

    def _keep_alive(self) -> None:
        """Register again after ``broker_liveness_s`` of silence from the broker;
        else heartbeat when nothing was sent for a heartbeat interval, or (a busy
        worker with a prefix cache) when its numbers changed in the last interval.
        After a stall of this loop (:attr:`stalls`: the process was suspended or starved,
        and heard nothing) the broker's silence starts over instead (a fresh window), unless the
        previous stall restarted it and the broker said nothing since."""
        now = self._clock()
        if (stalled_s := self.stalls.stalled(now)) is not None:
            log.warning("this worker was stalled for %.1f s (suspended or starved): the broker gets a fresh "
                        "liveness window", stalled_s)
            if self.stalls.excuses(self.last_recv):  # (once: a slow link still registers again)
                self.last_recv = now
        if now - self.last_recv > self.broker_liveness_s:
            log.warning("no word from the broker for %.1f s: registering again", now - self.last_recv)
            self.last_recv = now
            self.reregister()
        elif self.welcomed:
            if now - self.last_sent >= self.heartbeat_s:
                self._heartbeat(now, self.wp.prefix_cache_usage())
            elif self.registered and now - self.usage_checked_s >= self.heartbeat_s:
                self.usage_checked_s = now
                usage = self.wp.prefix_cache_usage()
                if usage != self.usage_sent:
                    self._heartbeat(now, usage)
        # Not answered yet: the Register (or Loading) waits in the DEALER's
        # queue and leaves when the broker is reachable; it is re-sent only
        # after broker_liveness_s without an answer (above).

    def _heartbeat(self, now: float, usage) -> None:
        self.usage_sent, self.usage_checked_s = usage, now
        self.send(Heartbeat(progress=self.wp.iterations, prefix_cache=usage))

    def _forward(self, its: list[Iteration]) -> None:
        """Send the main thread's iterations (of the current registration epoch)
        as one message: concatenated in order, split again only if the broker's
        limit requires. Nothing is sent before the broker welcomed our register."""
        if not self.registered:
            return
        if len(its) == 1:
            self.send(its[0])
        elif its:  # piled up while this thread was busy: one message, in order
            def joined(field: str) -> tuple:
                return tuple(itertools.chain.from_iterable(getattr(it, field) for it in its))
            self.send(Iteration(joined("ids"), joined("tokens"), joined("texts"), joined("finished"),
                                joined("started"), joined("logprobs"), joined("embeddings")))

    def _receive(self) -> None:
        for _ in range(1024):
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_recv = self._clock()
            try:
                msg = decode(data, BROKER_TO_WORKER, self.cfg.max_message_bytes)
            except ProtocolError as e:
                log.warning("dropping a bad message from the broker: %s", e)
                self._refuse(peek_request_ids(data), e.code, f"the broker's message could not be read: {e.message}")
                continue
            try:
                self._handle(msg)
            except Exception as e:  # noqa: BLE001 -- one message must not stop the worker
                log.exception("worker failed to handle a %s message", type(msg).__name__)
                if type(msg) is Assign:
                    self._refuse(request_ids(msg), ErrorCode.INTERNAL,
                                 f"the worker failed to take this request ({type(e).__name__}: {e})")

    def _refuse(self, keys: list, code: ErrorCode, message: str) -> None:
        """End the assigned requests ``keys`` that the engine does not hold
        (those the lost or failed message brought) with ``code``."""
        if not self.registered:
            return
        refused = [Finished(k, FinishReason.ERROR, code, message) for k in keys
                   if type(k) is int and not self.wp.holds(k)]
        if refused:
            self.send(Iteration(finished=tuple(refused)))

    def _handle(self, msg: Message) -> None:
        wp = self.wp
        if isinstance(msg, Assign):
            if self.registered:
                refused = wp.assign(msg.requests)
                if refused:
                    self.send(Iteration(finished=tuple(refused)))
        elif isinstance(msg, Cancel):
            ended = wp.cancel(msg.request_ids)  # (those not in the engine yet end here, at once)
            if ended and self.registered:
                self.send(Iteration(finished=tuple(ended)))
        elif isinstance(msg, Heartbeat):
            if msg.broker_id is not None and self.broker_id is not None and msg.broker_id != self.broker_id:
                log.warning("the broker restarted: registering again")
                self.reregister()
        elif isinstance(msg, Welcome):
            self._welcome(msg)
        elif isinstance(msg, Error):
            self._error(msg)

    def _welcome(self, msg: Welcome) -> None:
        """Adopt the broker's identity, frame limit and heartbeat period; a
        welcome of our register starts a fresh registration."""
        self.broker_id = msg.broker_id
        self.max_send_bytes = msg.max_message_bytes
        self.heartbeat_s = min(self.cfg.heartbeat_interval_s, msg.heartbeat_interval_s)
        self.broker_liveness_s = max(self.cfg.broker_liveness_s, _BROKER_BEATS_PER_WINDOW * msg.heartbeat_interval_s)
        self.stalls.window_s, self.stalls.period_s = self.broker_liveness_s, self.heartbeat_s
        self.welcomed = True
        if not self.ready:
            log.info("broker %s knows this worker is loading model %r", msg.broker_id[:8], self.model)
            return
        # Every welcome starts a fresh registration on the broker's side
        # (anything it assigned before is requeued there), so whatever this
        # worker still holds is void.
        self.wp.drop_all()
        self.registered = True
        log.info("registered with broker %s as %s (%d slots), serving %s", msg.broker_id[:8], self.wp.name,
                 self.cfg.num_slots, ", ".join(map(repr, self.cfg.served_names)))

    def _error(self, msg: Error) -> None:
        if msg.code is ErrorCode.NOT_REGISTERED:
            if self.welcomed:  # later ones answer messages sent before our Register / Loading
                log.warning("the broker does not know this worker (restarted?): registering again")
                self.registered = False
                self.reregister()
        else:
            log.warning("broker error: %s: %s", msg.code.value, msg.message)


def announce_dead_load(config: WorkerConfig, worker_name: str, timeout_s: float = 5.0) -> None:
    """Tell ``config``'s broker that a worker of ``config`` (named ``worker_name``) started loading
    its model, and fall silent: for a worker process that died before it could say so itself
    (SIGKILL or a crash while the process starts: its supervisor saw it end, and the broker never
    heard of it). The broker then counts that load as it counts a loader that dies after its
    ``loading``, once it is silent past ``worker_liveness_s``: a failed attempt of each request
    waiting for the model (:meth:`broker.models.ServedModels.load_died` is the broker's; this
    module only speaks the worker's side). Sent with the worker's own CURVE keys; waits at most
    ``timeout_s`` seconds for the message to leave (a broker that is down never gets it: its
    requests are resubmitted to the next one, which knows nothing of this load either)."""
    from protocol.curve import load_peer_keys

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        if config.curve_secret_file is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = load_peer_keys(
                (config.curve_secret_file, config.curve_broker_key_file), "worker")
        set_ipv6(sock, config.broker, bind=False)
        sock.connect(config.broker)
        model, *aliases = config.served_names
        sock.send(encode(Loading(model, worker_name, tuple(aliases))), zmq.NOBLOCK)
    finally:
        sock.close(linger=int(timeout_s * 1000))
