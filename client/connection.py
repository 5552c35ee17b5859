"""The client's I/O thread: it alone owns the DEALER socket to the broker.

Other threads hand it work through a lock-protected outbox and wake it with
a byte on a pipe (``os.pipe``, polled together with the socket), so no socket
is ever touched by two threads. Requests submitted in a burst leave in
batched ``submit`` messages; every received message is decoded here and
passed to ``on_message`` (the client's dispatcher queue), never run here.

One message never takes the connection down. A message that cannot be sent
-- over the broker's frame limit (announced in its ``welcome``) even when
split per request, or refused by the encoder -- ends just the requests it
carries: ``on_message`` receives an :class:`~protocol.messages.Error`
naming them, as if the broker had refused them. A frame from the broker
that cannot be decoded ends the requests it names the same way (and they
are cancelled at the broker). Only a failure of the loop itself (the
socket) ends the connection, and then ``on_failure`` is told, so the client
can end every request instead of leaving them waiting.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import Callable

import zmq

from protocol.codec import decode, peek_request_ids
from protocol.defaults import MAX_MESSAGE_BYTES
from protocol.endpoints import set_ipv6
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.framing import fit, request_ids
from protocol.liveness import StallWatch
from protocol.messages import BROKER_TO_CLIENT, Bye, Cancel, Envelope, Error, Heartbeat, Message, Submit, Welcome
from protocol.waits import Event

log = logging.getLogger(__name__)

_RETRY_MS = 20  # retry interval for frames the socket could not take yet (no peer connected)

DEADLINE_GRACE_HEARTBEATS = 3
"""Heartbeat intervals the broker must have been silent before the client ends a request whose
deadline passed itself (:meth:`~client.core.ClientCore.overdue`): the broker's own liveness windows
are at least 3 intervals, so a broker silent that long is taken for gone, as it takes its peers.
The window against which :class:`Connection` times its own stalls."""

MAX_REQUESTS_PER_SUBMIT = 2048
"""Requests per ``submit`` message: large enough to amortise per-message cost,
small enough that the broker starts dispatching early in a long burst."""


class Connection:
    """A DEALER connection to the broker's frontend, run on a daemon I/O thread.

    - ``address``: the broker's client endpoint (``tcp://host:port``).
    - ``model``: the model of ``submit`` messages (may be set later, before
      the first :meth:`submit`).
    - ``on_message(msg)``: called on the I/O thread for every decoded message
      (and for the errors above); must only enqueue.
    - ``heartbeat_interval_s``: a heartbeat goes out when nothing else was
      sent for this long (seconds); once the broker's ``welcome`` announces
      its interval, that one (or this, if shorter): the broker's liveness
      window is counted in its own interval.
    - ``curve``: ``(public, secret, broker_public)`` CURVE keys (z85 bytes),
      or None for a plain connection.
    - ``on_failure(exc)``: called once if the I/O loop itself fails (the
      connection is then dead).
    - ``on_tick(now, heard_s, interval_s)``: called on the I/O thread at every turn of its loop,
      at least once a heartbeat interval whatever the broker does (``now``: the monotonic clock;
      ``heard_s``: when a frame last came from the broker, or when the loop's latest stall ended,
      if later: a turn that came more than :class:`~protocol.liveness.StallWatch`'s threshold
      after the previous one, against :data:`DEADLINE_GRACE_HEARTBEATS` intervals -- the process
      was suspended or starved, heard nothing, and the broker gets a fresh window, unless the
      previous stall gave it one and it said nothing since;
      ``interval_s``: the heartbeat interval); must be quick.
    - ``clock``: the monotonic clock the loop reads (seconds; :func:`time.monotonic`, a test's own).

    Thread-safe: :meth:`submit`, :meth:`cancel`, :meth:`send`, :meth:`close`.
    """

    def __init__(self, address: str, model: str | None, on_message: Callable[[Message], None], *,
                 heartbeat_interval_s: float, name: str = "client",
                 curve: tuple[bytes, bytes, bytes] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_tick: Callable[[float, float, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self._clock = clock
        self.model = model
        self.identity = uuid.uuid4().bytes  # stable across reconnects: the broker's key for us
        self.heartbeat_interval_s = heartbeat_interval_s
        self._own_heartbeat_s = heartbeat_interval_s
        self.max_send_bytes = MAX_MESSAGE_BYTES
        """The largest frame the broker decodes (bytes), from its welcome."""
        self._max_recv_bytes = MAX_MESSAGE_BYTES
        self._curve = curve
        self.last_recv_s = clock()
        self._stalls = StallWatch(DEADLINE_GRACE_HEARTBEATS * heartbeat_interval_s, self.last_recv_s,
                                  period_s=heartbeat_interval_s)
        self._on_message = on_message
        self._on_failure = on_failure
        self._on_tick = on_tick
        self._lock = threading.Lock()
        self._entries: list[Envelope] = []
        self._cancels: list = []
        self._other: list[Message] = []
        self._woken = False
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"slotserve-{name}-io", daemon=True)
        self._ready = Event()  # (the constructor waits on it: protocol.waits)
        self._error: BaseException | None = None
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ any thread

    def submit(self, entries: list[Envelope]) -> None:
        with self._lock:
            self._entries.extend(entries)
            self._wake()

    def cancel(self, request_ids: list) -> None:
        with self._lock:
            self._cancels.extend(request_ids)
            self._wake()

    def send(self, msg: Message) -> None:
        with self._lock:
            self._other.append(msg)
            self._wake()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send ``bye``, stop the I/O thread, close the socket (waits up to ``timeout_s``)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake()
        self._thread.join(timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:  # under self._lock
        if not self._woken:
            self._woken = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            # Outgoing: bounded by what the caller submitted (the caller's own
            # memory). Incoming: read as fast as it comes; the broker bounds it.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_MESSAGE_BYTES)
            if self._curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
            set_ipv6(sock, self.address, bind=False)
            sock.connect(self.address)
        except Exception as e:  # noqa: BLE001 -- reported to the constructor's caller
            self._error = ValueError(f"cannot connect to {self.address!r}: {e}")
            sock.close(0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        linger_ms = 0
        try:
            self._loop(sock)
            linger_ms = 200  # let the goodbye leave; never hang on a dead broker
        except Exception as e:  # noqa: BLE001 -- the loop itself failed: tell the client, which ends every request
            log.exception("client I/O thread failed")
            if self._on_failure is not None:
                try:
                    self._on_failure(e)
                except Exception:  # noqa: BLE001
                    log.exception("client failed to handle the end of its connection")
        finally:
            sock.close(linger_ms)
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_sent = 0.0
        # Frames not yet taken by the socket: a DEALER blocks a send while it
        # has no connected peer (broker down, or a refused CURVE handshake);
        # they wait here, in order, and the loop stays responsive (close()).
        backlog: deque[bytes] = deque()
        while True:
            wait_ms = max(0.0, (last_sent + self.heartbeat_interval_s - self._clock()) * 1000)
            if backlog:
                wait_ms = min(wait_ms, _RETRY_MS)
            events = dict(poller.poll(wait_ms))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            with self._lock:
                entries, self._entries = self._entries, []
                cancels, self._cancels = self._cancels, []
                other, self._other = self._other, []
                self._woken = False
                closing = self._closing
            out: list[bytes] = []
            for m in other:
                self._frame(m, out)
            for i in range(0, len(entries), MAX_REQUESTS_PER_SUBMIT):
                self._frame(Submit(self.model, tuple(entries[i:i + MAX_REQUESTS_PER_SUBMIT])), out)
            if cancels:
                self._frame(Cancel(tuple(cancels)), out)
            if closing:
                self._frame(Bye("client closed"), out)
            now = self._clock()
            if (stalled_s := self._stalls.stalled(now)) is not None:
                log.warning("this client was stalled for %.1f s (suspended or starved): the broker gets a fresh "
                            "liveness window", stalled_s)
                if self._stalls.excuses(self.last_recv_s):  # (once: a slow client still judges its broker)
                    self.last_recv_s = now
            if not out and not backlog and now - last_sent >= self.heartbeat_interval_s:
                self._frame(Heartbeat(), out)
            backlog.extend(out)
            while backlog:
                try:
                    sock.send(backlog[0], zmq.NOBLOCK)
                except zmq.Again:
                    break
                backlog.popleft()
                last_sent = now
            if closing:
                return
            if sock in events:
                self._receive(sock)
            if self._on_tick is not None:
                self._on_tick(now, self.last_recv_s, self.heartbeat_interval_s)

    def _frame(self, msg: Message, out: list[bytes]) -> None:
        """Append ``msg``'s frames to ``out``, split to fit the broker's limit;
        a request that cannot be sent even alone ends with an error."""
        framed = fit(msg, self.max_send_bytes)
        for data, _ in framed.frames:
            out.append(data)
        for part, code, reason in framed.refused:
            ids = request_ids(part)
            if not ids:
                log.error("cannot send a %s message: %s", type(part).__name__, reason)
                continue
            self._deliver(Error(code, f"the client could not send this request: {reason}", tuple(ids)))

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(1024):
            try:
                data = sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.last_recv_s = self._clock()
            try:
                msg = decode(data, BROKER_TO_CLIENT, self._max_recv_bytes)
            except ProtocolError as e:
                ids = peek_request_ids(data)
                if e.code is ErrorCode.UNSUPPORTED_VERSION and not ids:
                    # the broker speaks another protocol version (its refusal of our hello comes in
                    # its version): the client raises it at once, before any welcome
                    self._deliver(Error(e.code, f"the broker speaks another protocol version ({e.message})"))
                    continue
                log.warning("dropping a bad message from the broker (%s); it named %d requests", e, len(ids))
                if ids:  # their tokens or endings were in it: end them here, stop them there
                    self._deliver(Error(e.code, f"a message from the broker about this request could not be "
                                                f"read: {e.message}", tuple(ids)))
                    with self._lock:
                        self._cancels.extend(ids)
                        self._wake()
                continue
            if type(msg) is Welcome:
                self._welcomed(msg)
            self._deliver(msg)

    def _welcomed(self, msg: Welcome) -> None:
        """Adopt the broker's frame limit and heartbeat period."""
        self.max_send_bytes = msg.max_message_bytes
        self._max_recv_bytes = max(MAX_MESSAGE_BYTES, msg.max_message_bytes)
        self.heartbeat_interval_s = min(self._own_heartbeat_s, msg.heartbeat_interval_s)
        self._stalls.window_s = DEADLINE_GRACE_HEARTBEATS * self.heartbeat_interval_s
        self._stalls.period_s = self.heartbeat_interval_s

    def _deliver(self, msg: Message) -> None:
        try:
            self._on_message(msg)
        except Exception:  # noqa: BLE001 -- the client's own guard failed too: keep serving the others
            log.exception("client failed to take a %s message", type(msg).__name__)
