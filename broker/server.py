"""The broker's socket loop: two ROUTER sockets around a :class:`BrokerCore`.

The loop receives frames, decodes them (a bad frame gets an error reply with
its code), hands messages to the core, and performs the :class:`Send`
actions the core returns. One thread owns both sockets.

No silent drops: both ROUTERs set ``ROUTER_MANDATORY``, so sending to a peer
that is gone raises ``EHOSTUNREACH`` (the core then forgets the client, or
migrates the worker's requests), and a send that would block at the
high-water mark raises ``EAGAIN`` instead of being discarded. Such messages
wait in a per-peer buffer, flushed in order on later passes; a peer whose
buffer passes ``max_pending_per_peer`` is failed (a client's requests end
with ``slow_consumer``, a worker is treated as dead). Memory stays bounded
by ``send_hwm + max_pending_per_peer`` messages per peer.

Whatever discards frames accounts for every request they name: the core
ends each one exactly once (a ``slow_consumer`` error naming them all,
those whose endings were in the discarded frames included), and an ending
counts in ``status`` only once its frame left (see
:meth:`BrokerCore.count_endings`), so a discarded one is never counted
``completed``.

Every frame is kept within its receiver's limit (:func:`protocol.framing.fit`
splits a message per request); a request too large alone ends ``too_large``.
A control message naming no request (a welcome, a status) that does not fit
is the receiver's misconfiguration, not a broker fault: see
:meth:`BrokerCore.undeliverable`.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import Callable

import zmq

from broker.config import BrokerConfig
from broker.core import BrokerCore
from broker.outbox import Send, Side
from protocol.codec import decode, encode, peek_request_ids
from protocol.curve import load_key_pair
from protocol.endpoints import bind_error, set_ipv6
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.framing import fit
from protocol.liveness import StallWatch
from protocol.messages import CLIENT_TO_BROKER, WORKER_TO_BROKER, Error, Message, Results

log = logging.getLogger(__name__)

_RECV_BATCH = 512  # messages drained per socket per pass (keeps both sockets served)
_ZAP_DOMAIN = {Side.FRONTEND: "slotserve-clients", Side.BACKEND: "slotserve-workers"}
_BIND_WHAT = {Side.FRONTEND: "the broker's client endpoint (--frontend)",
              Side.BACKEND: "the broker's worker endpoint (--backend)"}  # what a BindError names


class BrokerServer:
    """Owns the broker's sockets; use as a context manager, then :meth:`serve`.

    Binding happens in the constructor, so :attr:`frontend` and :attr:`backend`
    hold the actual endpoints (a ``*`` port resolved) before serving starts.
    Raises :class:`~protocol.endpoints.BindError` (an OSError) naming the endpoint or metrics port
    that cannot be bound (another process listens there, a host that is not this machine's).
    ``clock``: the monotonic clock its loop reads (seconds; :func:`time.monotonic`, a test's own).
    """

    def __init__(self, config: BrokerConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.broker_id = uuid.uuid4().hex
        self._ctx = zmq.Context()
        self._sockets: dict[Side, zmq.Socket] = {}
        self._auth = None
        try:
            curve = self._start_auth() if config.curve_secret_file is not None else None
            for side, endpoint in ((Side.FRONTEND, config.frontend), (Side.BACKEND, config.backend)):
                s = self._ctx.socket(zmq.ROUTER)
                self._sockets[side] = s
                if curve is not None:
                    # Each socket authenticates against its own ZAP domain, so
                    # the frontend admits client keys only and the backend
                    # worker keys only (zmq.auth keeps one allow-list per domain).
                    s.curve_server = True
                    s.curve_publickey, s.curve_secretkey = curve
                    s.zap_domain = _ZAP_DOMAIN[side].encode()
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                s.setsockopt(zmq.SNDHWM, config.send_hwm)
                s.setsockopt(zmq.RCVHWM, config.send_hwm)
                # Hard cap well above the polite limit: between the two a peer
                # gets a too_large reply; past this zmq drops the connection.
                s.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message_bytes)
                set_ipv6(s, endpoint, bind=True)
                try:
                    s.bind(endpoint)
                except zmq.ZMQError as e:
                    raise bind_error(_BIND_WHAT[side], endpoint, e.errno, e.strerror) from None
        except Exception:
            self.close()
            raise
        self.frontend = self._sockets[Side.FRONTEND].getsockopt(zmq.LAST_ENDPOINT).decode()
        self.backend = self._sockets[Side.BACKEND].getsockopt(zmq.LAST_ENDPOINT).decode()
        self.core = BrokerCore(config, self.broker_id, clock())
        self.metrics = None
        if config.metrics_port is not None:
            from broker.metrics import BrokerMetrics

            try:
                self.metrics = BrokerMetrics(config.metrics_port, config.metrics_host)
            except Exception:
                self.close()
                raise
            self.core.record_timings = True
        # Frames a peer's socket would not take yet, in order, each with its
        # message (so what a discarded frame carried can be accounted for).
        self._pending: dict[tuple[Side, bytes], deque[tuple[bytes, Message]]] = {}
        self._work: deque[Send] = deque()

    def __enter__(self) -> "BrokerServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_auth(self) -> tuple[bytes, bytes]:
        """Start the ZAP authenticator (a thread owning its own socket) with one
        allow-list per side; return the broker's (public, secret) key pair.
        Raises ValueError when a key file or directory is missing or unreadable."""
        from zmq.auth.thread import ThreadAuthenticator

        cfg = self.config
        public, secret = load_key_pair(cfg.curve_secret_file, "the broker")
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        for side, d in ((Side.FRONTEND, cfg.curve_clients_dir), (Side.BACKEND, cfg.curve_workers_dir)):
            if not os.path.isdir(d):
                raise ValueError(f"CURVE allow-list directory {d!r} does not exist")
            self._auth.configure_curve(domain=_ZAP_DOMAIN[side], location=d)
        return public, secret

    def close(self) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
            self.metrics = None
        for s in self._sockets.values():
            s.close(linger=0)
        self._sockets.clear()
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    # ------------------------------------------------------------------ loop

    def serve(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set (checked at least every ``tick_s``).

        One message's failure never ends the loop: a message whose handling
        raises ends the requests it names with ``internal``
        (:meth:`BrokerCore.handling_failed`); a failed housekeeping pass is
        logged, counted and tried again on the next tick. A turn that comes late (the broker was
        stalled: suspended, SIGSTOPped, starved; :class:`~protocol.liveness.StallWatch`, against the
        shorter liveness window) restarts every peer's silence timer before the tick judges them
        (:meth:`BrokerCore.restart_silence_timers`), each one that the previous stall did not restart."""
        front = self._sockets[Side.FRONTEND]
        back = self._sockets[Side.BACKEND]
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        cfg = self.config
        tick_s = cfg.tick_s
        clock = self._clock
        next_tick = clock()
        stalls = StallWatch(min(cfg.worker_liveness_s, cfg.client_liveness_s), next_tick, period_s=tick_s)
        log.info("broker %s serving clients on %s, workers on %s", self.broker_id[:8], self.frontend, self.backend)
        while not stop.is_set():
            now = clock()
            if (stalled_s := stalls.stalled(now)) is not None:
                log.warning("the broker was stalled for %.1f s (suspended or starved): every worker and client "
                            "gets a fresh liveness window", stalled_s)
                self.core.restart_silence_timers(now, stalls.previous_s)
            if now >= next_tick:
                next_tick = now + tick_s
                try:
                    self._perform(self.core.tick(now))
                    if self.metrics is not None:
                        self.metrics.update(self.core, now)
                except Exception:  # noqa: BLE001 -- a bug must not stop the broker
                    self.core.counters["internal_errors"] += 1
                    log.exception("broker housekeeping failed; continuing")
            wait_s = 0.001 if self._pending else max(0.0, next_tick - now)
            events = dict(poller.poll(wait_s * 1000))
            if back in events:
                self._drain(back, Side.BACKEND)
            if front in events:
                self._drain(front, Side.FRONTEND)
            if self._pending:
                self._flush()

    def _drain(self, sock: zmq.Socket, side: Side) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = self._clock()
            identity = frames[0]
            if len(frames) != 2:
                err = ProtocolError(ErrorCode.MALFORMED, f"expected one frame per message, got {len(frames) - 1}")
                self._perform([Send(side, identity, Error(err.code, err.message))])
                continue
            self._handle(side, identity, frames[1], now)

    def _handle(self, side: Side, identity: bytes, data: bytes, now: float) -> None:
        core = self.core
        front = side is Side.FRONTEND
        msg = None
        try:
            try:
                msg = decode(data, CLIENT_TO_BROKER if front else WORKER_TO_BROKER, self.config.max_message_bytes)
            except ProtocolError as e:
                log.warning("bad message from %s %s: %s", "client" if front else "worker", identity.hex()[:8], e)
                on_error = core.on_frontend_error if front else core.on_backend_error
                self._perform(on_error(identity, e, peek_request_ids(data), now))
                return
            self._perform((core.on_frontend if front else core.on_backend)(identity, msg, now))
        except Exception as e:  # noqa: BLE001 -- a bug must not take every client's requests down
            log.exception("broker failed to handle a %s message; ending the requests it names", side.value)
            try:
                self._perform(core.handling_failed(side, identity, msg, e, now))
            except Exception:  # noqa: BLE001 -- the loop goes on whatever happens
                log.exception("broker failed to end the requests of a message it could not handle")

    # ------------------------------------------------------------------ sending

    def _perform(self, sends: list[Send]) -> None:
        """Send each message, split to fit its receiver's frame limit; failures
        feed the core, whose answers are sent too."""
        work = self._work
        work.extend(sends)
        core = self.core
        while work:
            s = work.popleft()
            side, identity, msg = s.side, s.identity, s.message
            limit = core.peer_limit(side, identity)
            try:
                data = encode(msg)
            except Exception:  # noqa: BLE001 -- fit() below finds the request that cannot be encoded
                data = None
            if data is not None and len(data) <= limit:
                self._send(side, identity, data, msg)
                continue
            framed = fit(msg, limit)  # the rare path: split per request
            for data, part in framed.frames:
                self._send(side, identity, data, part)
            if framed.refused:
                work.extend(core.undeliverable(side, identity, framed.refused, self._clock()))

    def _send(self, side: Side, identity: bytes, data: bytes, msg: Message) -> None:
        key = (side, identity)
        buf = self._pending.get(key)
        if buf is not None:  # keep order behind what is already waiting
            self._hold(msg)
            buf.append((data, msg))
            if len(buf) > self.config.max_pending_per_peer:
                self._overflow(side, identity)
            return
        try:
            self._sockets[side].send_multipart((identity, data), zmq.NOBLOCK)
        except zmq.Again:
            self._hold(msg)
            self._pending[key] = deque(((data, msg),))
        except zmq.ZMQError as e:
            self._hold(msg)
            self._unreachable(side, identity, None, [msg], e)

    def _hold(self, msg: Message) -> None:
        """``msg`` waits (or is lost): its endings stop counting until it leaves."""
        if type(msg) is Results and msg.finished:
            self.core.count_endings(msg.finished, -1)

    def _flush(self) -> None:
        core = self.core
        for key in list(self._pending):
            side, identity = key
            buf = self._pending.get(key)
            if buf is None:
                continue  # failed meanwhile
            sock = self._sockets[side]
            try:
                while buf:
                    data, msg = buf[0]
                    sock.send_multipart((identity, data), zmq.NOBLOCK)
                    buf.popleft()
                    if type(msg) is Results and msg.finished:
                        core.count_endings(msg.finished, +1)  # it left: its endings count
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                del self._pending[key]
                self._unreachable(side, identity, None, [m for _, m in buf], e)
                continue
            del self._pending[key]
        if self._work:
            self._perform([])

    def _overflow(self, side: Side, identity: bytes) -> None:
        log.warning("%s %s stopped reading (%d messages buffered): failing it", side.value,
                    identity.hex()[:8], self.config.max_pending_per_peer)
        buf = self._pending.pop((side, identity))
        self._unreachable(side, identity, ErrorCode.SLOW_CONSUMER, [m for _, m in buf])

    def _unreachable(self, side: Side, identity: bytes, code: ErrorCode | None, discarded: list[Message],
                     error: zmq.ZMQError | None = None) -> None:
        """Messages for ``identity`` were discarded unsent (``discarded``, their
        endings already out of the counters): the core accounts for every
        request they name and fails the peer (a client: its requests end;
        a worker: its requests migrate)."""
        if error is not None and error.errno != zmq.EHOSTUNREACH:
            log.error("cannot send to %s %s (%s): treating it as gone", side.value, identity.hex()[:8], error)
        if side is Side.FRONTEND:
            self._work.extend(self.core.client_unreachable(identity, code, discarded))
        else:
            self._work.extend(self.core.worker_unreachable(identity, self._clock()))


GC_THRESHOLDS = (100_000, 20, 20)
"""The garbage collector's thresholds in a broker's process (:func:`gc.set_threshold`; CPython's are
(700, 10, 10)). A broker holds every request it queued (its job, parameters and tokens: tens of
thousands under a burst), which the default thresholds traverse again and again as the heap grows:
measured on the core fed 40,000 requests at once without sockets, 12.5 -> 10.9 us per request (10.7
with the collector off) at (10,000, 20, 20), load 8.5. A first generation of 100,000 lets most of a
burst's requests end before a collection finds them (``python -m bench.broker_profile``'s replay:
3 % fewer instructions, callgrind; median 7.46 -> 6.96 us a request, alternated in one process).
Collections are rarer, not skipped: cycles are still freed."""


def tune_gc() -> None:
    """Set this process's garbage-collector thresholds to :data:`GC_THRESHOLDS`. For the shell of a
    process that runs a broker (``slotserve broker``, a local cluster's broker child), not called by
    :func:`run_broker`: the thresholds are the whole interpreter's."""
    gc.set_threshold(*GC_THRESHOLDS)


def run_broker(config: BrokerConfig, *, stop: threading.Event | None = None,
               on_ready: Callable[[str, str], None] | None = None) -> None:
    """Run a broker until ``stop`` is set (forever when None).

    ``on_ready(frontend, backend)`` is called once both sockets are bound,
    with the actual endpoints. Raises :class:`~protocol.endpoints.BindError` if binding fails.
    """
    stop = stop or threading.Event()
    with BrokerServer(config) as server:
        if on_ready is not None:
            on_ready(server.frontend, server.backend)
        server.serve(stop)
