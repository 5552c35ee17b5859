"""The synchronous client: the engine's API, served by a slotserve cluster.

A thin shell over :class:`~client.core.ClientCore`, which keeps the request
ledger and makes every decision about requests (their ids, their endings,
what to resubmit after a broker restart, which cancels are pending) without
sockets. This module owns the threads and performs the core's outcomes:
the caller's threads submit; the I/O thread (:mod:`client.connection`)
owns the socket; a dispatcher thread applies incoming results to handles and
runs ``on_token``, ``on_text`` and ``callback`` -- never on the socket thread, so a slow
callback cannot stall the connection, and a callback may call
``submit_request`` or ``cancel``. Calls into the core are made under one
lock (``_lock``), except applying tokens (see :mod:`client.core`); callbacks
run outside it.

Failures stay with the requests they concern: a message that cannot be
sent or read, or whose handling raises, ends the requests it names with an
error (a code and a message on each handle) and nothing else; if the
connection itself fails, every request ends with an error and the client
refuses new ones. No request is left waiting. A request with a ``timeout_s``
ends ``deadline`` at its deadline even when the broker does not end it (the
broker is gone or frozen: silent for ``DEADLINE_GRACE_HEARTBEATS`` heartbeat
intervals), with the tokens received, and is cancelled there.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from client.connection import DEADLINE_GRACE_HEARTBEATS, Connection
from client.core import ClientCore, Outcome
from client.errors import BrokerUnavailable, RemoteError, UnknownModelError
from client.handle import ClientHandle
from protocol import defaults
from protocol.codec import encode
from protocol.curve import load_peer_keys
from protocol.endpoints import check_endpoint
from protocol.enums import ErrorCode, ModelAction
from protocol.messages import (
    Demand, Envelope, Error, Heartbeat, Hello, ModelInfo, ModelOrder, Results, Status, StatusQuery, Submit, Welcome,
)
from protocol.enums import RequestKind
from protocol.request import DEFAULT, ModelLimits, RequestParams, check_request_id, check_stop_token
from protocol.validation import as_seconds, as_text, check_callbacks, echo
from protocol.waits import Event, condition

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = defaults.CLIENT_ENDPOINT

_SHUTDOWN = object()
_SIZE_SLACK = 4096  # bytes: a request's fields other than its prompt and stop sequences take less
_LONGEST_ID = 2**64 - 1  # the request id that takes the most bytes as an int (a str id is checked apart)


def _limits(info: ModelInfo | None) -> ModelLimits | None:
    """The submit-time checks for a model the broker described (None: not served yet)."""
    return None if info is None else ModelLimits(info.vocab_size, info.max_seq_len, info.has_tokenizer,
                                                 info.embedding_size is not None)


_REFUSALS = (ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNAUTHORIZED, ErrorCode.TOO_LARGE)
"""Error codes that, answering a client's hello, mean the broker cannot serve it."""


class _Overdue:
    """Inbox item: ``handles`` (with callbacks) passed their deadline while the broker was silent."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[ClientHandle]) -> None:
        self.handles = handles


class _Failed:
    """Inbox item: handling ``message`` on the I/O thread raised ``error``."""

    __slots__ = ("message", "error")

    def __init__(self, message, error: BaseException) -> None:
        self.message = message
        self.error = error


class _Broken(_Failed):
    """Inbox item: the connection itself failed (``error``); ``message`` is None."""


class Client:
    """Submit generation requests to a slotserve broker; results come back on handles.

    - ``address``: the broker's client endpoint (default ``tcp://127.0.0.1:5555``); one that can
      never work (a port past 65535, ``tcp://256.1.1.1:5``, another transport: see
      :func:`protocol.endpoints.check_endpoint`) is a ValueError at once, a broker not up yet is
      waited for (``connect_timeout_s``).
    - ``model``: the model name workers registered, or one of its aliases
      (their ``--served-model-name``). None (default): the broker's only
      model, when exactly one is served, loading or loaded on demand; with
      several (models on demand too, loaded or not), submitting raises
      ValueError listing them (``status()`` works either way).
    - ``stop_token``: default stop token(s) for this client's requests: an
      int, a list of ints, None (none) or :data:`~protocol.request.DEFAULT`
      (the worker's: the model's EOS tokens or its ``--stop-token``).
    - ``connect_timeout_s``: seconds to wait for the broker's welcome;
      :class:`BrokerUnavailable` after that.
    - ``heartbeat_interval_s``: seconds between heartbeats while idle until the
      broker's welcome announces its interval; then the broker's (or this,
      if shorter): the broker ends the requests of a client silent for its
      liveness window, counted in its interval.
    - ``name``: shown in broker logs and thread names.
    - ``curve``: talk CURVE (encrypted, authenticated) to a broker that
      requires it: a ``slotserve keygen`` directory (its ``client.key_secret``
      and ``broker.key`` are used), or a ``(secret_key_file,
      broker_public_key_file)`` pair; None (default) for a plain connection.

    Use as a context manager (``close()`` on exit). Raises ValueError on bad
    arguments, :class:`BrokerUnavailable` when no broker answers within
    ``connect_timeout_s``, and :class:`RemoteError` at once when the broker
    cannot take this client (code ``unsupported_version``: it speaks another
    protocol version; ``too_large``: the hello, or the broker's welcome, is
    over a frame limit -- the message says which ``--max-message-bytes`` to
    raise).
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, model: str | None = None,
                 stop_token=DEFAULT, connect_timeout_s: float = 10.0,
                 heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S, name: str = "client",
                 curve=None) -> None:
        if model is not None:
            model = as_text(model, "model", allow_empty=False)  # (these travel on the wire too)
        name = as_text(name, "name")
        as_seconds(connect_timeout_s, "connect_timeout_s")
        as_seconds(heartbeat_interval_s, "heartbeat_interval_s")
        check_endpoint(address, bind=False, name="address")
        curve_keys = None if curve is None else load_peer_keys(curve, "client")
        self.address = address
        self.model: str | None = model
        """This client's model (None until resolved: see ``model=``)."""
        self.stop_token = check_stop_token(stop_token)
        self.models: dict[str, ModelInfo] = {}
        """Models served (workers registered them), from the broker's last welcome:
        every name they are served under, aliases included (with their model's info)."""
        self.loading: tuple[str, ...] = ()
        """Models being loaded by a worker, from the broker's last welcome (their aliases too)."""
        self.aliases: dict[str, str] = {}
        """Alias -> the primary name of its model, from the broker's last welcome."""
        self.on_demand: tuple[str, ...] = ()
        """Models the broker's supervisor loads when a request names them, loaded now or not (every
        name each is served under), from the broker's last welcome."""
        self._grace_end_s = 0.0  # monotonic end of the broker's start-up grace (unknown models wait till then)
        self._models_changed = threading.Condition()
        self._limits: ModelLimits | None = None  # this client's model's, once a worker registered it
        self._core = ClientCore(owner=self)  # the ledger and the decisions; called under _lock only
        self._ledger = self._core.ledger  # (read directly on the hot paths)
        # (an RLock: a run() or result() a signal's exception cuts short takes no other thread's lock: protocol.waits)
        self._lock = threading.RLock()
        self._idle = condition(self._lock)  # a request settled
        self._waiters = 0  # threads in handle.result(): completions notify only then
        self._delivering: ClientHandle | None = None
        self._welcomed = Event()  # (protocol.waits' events: the constructor and status() wait on them)
        self._refused: RemoteError | None = None  # the broker refused us (e.g. another protocol version)
        self._status_lock = threading.Lock()
        self._status_reply: Status | None = None
        self._status_event = Event()
        self._queries = 0  # status queries and model orders sent (their numbers, from 1: Status.query)
        self._asking = 0  # the number of the one whose answer _ask waits for (an earlier one's answer is not it)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_expiry_s = 0.0  # (I/O thread) when to look for overdue requests next
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"slotserve-{name}-callbacks",
                                            daemon=True)
        self._conn = Connection(address, model, self._on_io_message, heartbeat_interval_s=heartbeat_interval_s,
                                name=name, curve=curve_keys, on_failure=self._on_connection_failed,
                                on_tick=self._on_tick)
        # The dispatcher starts once _conn exists: the connection's I/O thread may hear a welcome (the
        # broker answers its first heartbeat) before Connection() has returned; the message waits in
        # the inbox. (Started before, the welcome's handler once read a _conn not yet assigned, under
        # load in CI: the model never resolved and every submit was refused as malformed.)
        self._dispatcher.start()
        self._conn.send(Hello(name))
        welcomed = self._welcomed.wait(connect_timeout_s)
        if self._refused is not None:
            self.close()
            raise self._refused
        if not welcomed:
            self.close()
            raise BrokerUnavailable(f"no slotserve broker answered at {address} within {connect_timeout_s} s; "
                                    "start one with `slotserve broker` or `slotserve up` (a broker that requires CURVE "
                                    "also stays silent to clients without keys: pass curve= / --curve-dir)")

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ public API

    def submit_request(self, prompt, max_tokens, callback: Callable[[list], object] | None = None, *,
                       on_token: Callable[[int], object] | None = None,
                       on_text: Callable[[str], object] | None = None, request_id=None,
                       **options) -> ClientHandle:
        """Send one request; return its :class:`~client.handle.ClientHandle` at once.

        The engine's ``submit_request``, served by the cluster: ``prompt``,
        ``max_tokens`` and the keyword ``options`` are the request's
        parameters, any field of :class:`protocol.request.RequestParams`
        (rules, defaults and units are declared there). For models with a
        tokenizer ``prompt`` may also be a ``str`` or chat messages
        (``[{"role": str, "content": str}, ...]``, rendered with the model's
        chat template by the worker). ``stop_token`` omitted: the client's
        default. ``timeout_s`` counts from now. ``callback(seq)`` (prompt +
        generated tokens) runs exactly once at the end, whatever the
        ``finish_reason``; ``on_token(token)`` runs per token, in order;
        ``on_text(piece)`` (models with a tokenizer) with each piece of text
        the worker released, after the tokens that came with it -- the pieces
        add up to ``handle.text`` and never show a prefix of a stop string
        (``stop``) that may still match. All run on the client's callback thread.

        Raises ValueError on bad input (anything the wire could not carry
        included; :class:`~protocol.errors.UnsupportedError` for text -- a
        text prompt, ``stop`` strings -- when the model is known to have no
        tokenizer) or a ``request_id`` already in flight on this client,
        TypeError for an unknown option, RuntimeError after ``close()``; in
        every case nothing is sent.
        """
        return self.submit(RequestParams(prompt, max_tokens, **options), callback, on_token=on_token,
                           on_text=on_text, request_id=request_id)

    def embed(self, prompt, callback: Callable[[list], object] | None = None, *, request_id=None,
              **options) -> ClientHandle:
        """Send one embedding request (``kind`` embed) for a model that embeds (a worker serving an
        embedding model, :mod:`worker.embeddings`); return its handle at once: :meth:`submit_request`
        for embeddings. ``prompt``: text, or token ids (used as given: no special token is added);
        ``options``: ``priority``, ``timeout_s``. ``callback(prompt ids)`` runs once at the end.
        Once it ended ``stop``, ``handle.embedding`` is the vector (floats; ``embedding_bytes`` the
        little-endian float32 bytes), ``handle.usage.prompt_tokens`` its length in tokens; a request
        that failed has ``finish_reason`` ``error`` and ``handle.error`` a
        :class:`~client.RemoteError` with its code (``unsupported`` from a generation model,
        ``context_length_exceeded`` for a prompt over the model's ``max_seq_len``)::

            with Client(model="all-minilm-l6-v2") as c:
                hs = [c.embed(text) for text in ["a cat", "a dog"]]
                c.run()  # (or h.result() for each)
                vectors = [h.embedding for h in hs]

        Raises as :meth:`submit_request` (ValueError for a generation option, which an embedding
        does not take; UnsupportedError when the model is known to generate)."""
        return self.submit(RequestParams(prompt, 1, kind=RequestKind.EMBED, **options), callback,
                           request_id=request_id)

    def submit(self, params: RequestParams, callback: Callable[[list], object] | None = None, *,
               on_token: Callable[[int], object] | None = None, on_text: Callable[[str], object] | None = None,
               request_id=None) -> ClientHandle:
        """Send a request built already (:class:`~protocol.request.RequestParams`);
        otherwise as :meth:`submit_request`."""
        if params.stop_token == DEFAULT and self.stop_token != DEFAULT:
            params = params._replace(stop_token=self.stop_token)  # the client's default (a new object)
        check_callbacks(callback=callback, on_token=on_token, on_text=on_text)
        if self.model is None:
            self._resolve_model(wait=False)
        limits = self._limits
        if limits is not None:
            limits.check(params)
        self._check_size(params)
        rid = None if request_id is None else check_request_id(request_id)
        with self._lock:
            h, entry = self._core.submit(params, callback, on_token=on_token, on_text=on_text, request_id=rid,
                                         now=time.monotonic())
        self._conn.submit([entry])
        return h

    def cancel(self, request_id) -> bool:
        """Ask the cluster to end a request as ``"cancelled"``.

        Returns True when it is in flight (its callback then fires once,
        with the tokens so far, unless it finished anyway meanwhile), False
        when unknown, already ended or already cancelled (as the engine's).
        ValueError for what can be no request's id (:func:`~protocol.request.check_request_id`).
        """
        request_id = check_request_id(request_id)
        with self._lock:
            if not self._core.cancel(request_id):
                return False
        self._conn.cancel([request_id])
        return True

    def run(self, timeout: float | None = None) -> None:
        """Block until every request submitted through this client has ended
        and its callback has returned.

        ``timeout`` in seconds (None: no limit); raises ``TimeoutError`` when it
        passes first, RuntimeError when called from a callback (it would wait
        on itself).
        """
        self._not_on_dispatcher("run()")
        with self._idle:
            if not self._idle.wait_for(lambda: self._core.in_flight == 0, timeout):
                raise TimeoutError(f"{self._core.in_flight} requests still running after {timeout} s")

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        return self._core.in_flight

    @property
    def broker_id(self) -> str | None:
        """The id of the broker last heard from (a new one after it restarted)."""
        return self._core.broker_id

    @property
    def resubmitted(self) -> int:
        """Requests resubmitted after broker restarts (a counter, for tests and benchmarks)."""
        return self._core.resubmitted

    def status(self, timeout_s: float = 5.0) -> Status:
        """The broker's :class:`~protocol.messages.Status` (queues, workers, slots,
        counters). Raises :class:`BrokerUnavailable` after ``timeout_s`` seconds,
        RuntimeError when the client is closed (by another thread too, while this waits)."""
        return self._ask(StatusQuery(), timeout_s)

    def _ask(self, query: StatusQuery | ModelOrder, timeout_s: float) -> Status:
        """Send ``query`` and wait for the :class:`Status` that answers it (one at a time): the one that
        carries its number (``query``), not an earlier query's answer that came after that one timed out."""
        self._not_on_dispatcher(f"{'status' if type(query) is StatusQuery else 'order'}()")
        with self._status_lock:
            self._queries += 1
            query = dataclasses.replace(query, query=self._queries)
            self._asking = self._queries
            self._status_event.clear()
            self._raise_if_closed()
            self._conn.send(query)
            if not self._status_event.wait(timeout_s):
                what = ("a status query" if type(query) is StatusQuery
                        else f"the order to {query.action} {query.model!r}")
                raise BrokerUnavailable(f"the broker did not answer {what} within {timeout_s} s")
            self._raise_if_closed()  # close() woke us: no answer will come
            return self._status_reply

    def order(self, action: ModelAction | str, model: str, timeout_s: float = 5.0) -> Status:
        """Load or unload ``model``, a model on demand (``POST /models/load|unload``: ``action``
        ``"load"`` or ``"unload"``, :class:`~protocol.enums.ModelAction`): the broker keeps the order
        for its supervisor and answers its :class:`~protocol.messages.Status`, whose ``on_demand``
        shows the model's state with the order (``loading``, ``unloading``). The order is taken,
        not done: a later status says when it is. Raises ValueError for another ``action``, or a
        ``model`` that is not on demand at this broker (its welcome's ``on_demand``: nothing is
        sent, or the broker did not keep it); :class:`BrokerUnavailable` and RuntimeError as
        :meth:`status`."""
        try:
            action = ModelAction(action)
        except ValueError:
            raise ValueError(f"action must be 'load' or 'unload', got {action!r}") from None
        if not isinstance(model, str) or model not in self.on_demand:
            raise ValueError(f"model {model!r} is not loaded on demand at this broker (models on demand: "
                             f"{', '.join(self.on_demand) or 'none'})")
        st = self._ask(ModelOrder(model, action), timeout_s)
        if not any(o.model == model and o.action is action for o in st.orders):
            raise ValueError(f"the broker did not take the order to {action} model {model!r}: it is not a model on "
                             "demand there")
        return st

    def tell_demand(self, msg: Demand) -> None:
        """Send the supervisor's :class:`~protocol.messages.Demand` (the models on demand's states, the
        orders it took) to the broker, which answers nothing. RuntimeError when the client is closed."""
        self._raise_if_closed()
        self._conn.send(msg)

    def _raise_if_closed(self) -> None:
        """RuntimeError once :meth:`close` began: what waits on the broker ends then, not at its timeout."""
        if self._ledger.closed:
            raise RuntimeError("this client is closed")

    def wait_for_model(self, timeout_s: float = 30.0) -> ModelInfo | None:
        """Block until a worker serving this client's model has registered
        (one that is loading it is waited for); return its
        :class:`~protocol.messages.ModelInfo`.

        Waits on the broker's welcomes (it sends a fresh one to every client
        when the models served or loading change), asking again only with a
        backoff (1, 2, 4, 8 s): it never spins. Without ``model=``: waits for
        the broker's only model. Returns None for a model the broker loads on
        demand that no worker serves or loads now (:attr:`on_demand`): its
        first request loads it, and waits in the queue meanwhile. Raises
        :class:`UnknownModelError` (a ValueError) at once when no worker serves
        or loads the model, nor would on demand, and the broker's start-up
        grace is over (the message lists the models served, loading and on
        demand), ValueError when no ``model=`` was given and several are
        served, ``TimeoutError`` after ``timeout_s`` seconds, RuntimeError when the
        client is closed (by another thread too, while this waits).
        """
        self._not_on_dispatcher("wait_for_model()")
        deadline = time.monotonic() + timeout_s
        backoff_s = 1.0
        ask_s = time.monotonic() + backoff_s
        with self._models_changed:
            while True:
                self._raise_if_closed()
                model = self.model if self.model is not None else self._resolve_model(wait=True)
                if model is not None and model in self.models:
                    return self.models[model]
                if model is not None and model in self.on_demand and model not in self.loading:
                    return None  # (loaded by its first request: nothing else would load it)
                now = time.monotonic()
                if model is not None and model not in self.loading and now >= self._grace_end_s:
                    raise UnknownModelError(model, self.address, self.models, self.loading, self.on_demand)
                if now >= deadline:
                    state = "is still loading" if model in self.loading else "has no worker yet"
                    raise TimeoutError(f"model {echo(model) if model else '(any)'} {state} after {timeout_s:g} s")
                if now >= ask_s:  # in case a change was missed (a broker restart): ask, less and less often
                    self._conn.send(Hello())
                    backoff_s = min(2 * backoff_s, 8.0)
                    ask_s = now + backoff_s
                wake = min(deadline, ask_s)
                if self._grace_end_s > now:
                    wake = min(wake, self._grace_end_s)
                self._models_changed.wait(wake - now)

    def _resolve_model(self, *, wait: bool) -> str | None:
        """This client's model when none was given: the broker's only one (served,
        loading or on demand: with several models on demand, one loaded is not
        the only one). None when there is none yet and ``wait``; ValueError when
        there are several, or none and not ``wait``."""
        # (one model, several names: its aliases)
        names = sorted({self.aliases.get(n, n) for n in (*self.models, *self.loading, *self.on_demand)})
        if len(names) == 1:
            self.model = self._conn.model = names[0]
            self._limits = _limits(self.models.get(names[0]))
            return names[0]
        if names:
            raise ValueError(f"the broker at {self.address} serves several models ({', '.join(names)}): "
                             "pass model= to Client")
        if not wait:
            raise ValueError(f"no worker serves or loads a model at {self.address} yet: pass model= to Client, "
                             "or call wait_for_model() first")
        return None

    def _check_size(self, params: RequestParams) -> None:
        """ValueError when the request alone would exceed the broker's frame
        limit (its ``max_message_bytes``, from the welcome). A cheap upper
        bound first (bytes per token, per character); encoding only when the
        bound comes near the limit."""
        p = params.prompt
        if type(p) is str:
            n = 4 * len(p)  # UTF-8: 1 to 4 bytes a character
        elif type(p[0]) is int:
            n = 9 * len(p)  # msgpack: 1 to 9 bytes a token id
        else:  # chat messages
            n = sum(4 * (len(m.role) + len(m.content)) + 16 for m in p)
        for stop in params.stop_sequences:
            n += 9 * len(stop) + 5
        if params.suffix is not None:  # fill in the middle: the text after the gap and other files' chunks
            n += 4 * (len(params.suffix) + sum(len(f) + len(t) + 8 for f, t in params.input_extra))
        limit = self._conn.max_send_bytes
        if n + _SIZE_SLACK <= limit:
            return
        # Near the limit: the exact size, unless the prompt alone is surely over (1 byte a character or token).
        size = len(p) if type(p) is str and len(p) > limit else \
            len(encode(Submit(self.model or "", (Envelope(_LONGEST_ID, params),))))
        if size > limit:
            raise ValueError(f"this request takes at least {size:,} bytes on the wire, more than the broker accepts in one "
                             f"message ({limit:,} bytes, its max_message_bytes): shorten the prompt, or raise the "
                             "broker's --max-message-bytes")

    def close(self) -> None:
        """Leave: the broker cancels what is still running; those handles end
        as ``"cancelled"`` (callbacks fire once). Idempotent."""
        with self._lock:
            if not self._core.close():
                return
        self._status_event.set()  # a status() or wait_for_model() waiting on the broker raises now
        with self._models_changed:
            self._models_changed.notify_all()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
        self._inbox.put(_SHUTDOWN)
        if threading.current_thread() is not self._dispatcher:
            self._dispatcher.join(10.0)

    # ------------------------------------------------------------------ I/O thread

    def _on_io_message(self, msg) -> None:
        """Called on the I/O thread for each message. Requests without
        callbacks are finished right here (one thread hop less on the way to
        a waiting ``result()``/``run()``); everything else goes, in order, to
        the callback thread."""
        try:
            if isinstance(msg, Results):
                msg = self._apply_plain(msg)
                if msg is None:
                    return
            elif type(msg) is Error and msg.request_ids:
                with self._lock:
                    self._core.io_refused(msg)
            self._inbox.put(msg)
        except Exception as e:  # noqa: BLE001 -- the callback thread ends the requests it names
            log.exception("client failed to handle a %s message", type(msg).__name__)
            with self._lock:
                self._core.io_failed(msg, e)
            self._inbox.put(_Failed(msg, e))

    def _apply_plain(self, msg: Results) -> Results | None:
        """Apply ``msg`` to handles with no callback, ``on_token`` or ``on_text``;
        return the rest (None when nothing is left)."""
        now = time.monotonic()
        rest, endings = self._core.apply_plain(msg, now)
        if endings:
            with self._lock:
                if self._core.end_plain(endings, now):
                    self._wake_waiters()
        return rest

    def _on_tick(self, now: float, heard_s: float, interval_s: float) -> None:
        """(I/O thread, every turn of its loop) End the requests whose deadline passed while the
        broker is silent (:meth:`~client.core.ClientCore.overdue`), once a heartbeat interval:
        those without callbacks here (this thread alone applies their results), the others on the
        callback thread, in order after the news it holds for them."""
        if now < self._next_expiry_s:
            return
        self._next_expiry_s = now + interval_s
        try:
            with self._lock:
                due = self._core.overdue(now, heard_s, DEADLINE_GRACE_HEARTBEATS * interval_s)
            if not due:
                return
            plain, others = [], []
            for h in due:
                (plain if h.callback is None and h.on_token is None and h.on_text is None else others).append(h)
            if plain:
                self._call(self._core.expire, plain, now)  # (nothing to deliver: they have no callback)
            if others:
                self._inbox.put(_Overdue(others))
        except Exception:  # noqa: BLE001 -- the I/O loop must survive it; the next turn looks again
            log.exception("client failed to end the requests past their deadline")

    def _on_connection_failed(self, error: BaseException) -> None:
        """(I/O thread, its last act) the connection is dead: end everything."""
        self._inbox.put(_Broken(None, error))

    # ------------------------------------------------------------------ dispatcher thread

    def _dispatch_loop(self) -> None:
        get = self._inbox.get
        core = self._core
        while True:
            msg = get()
            try:
                if isinstance(msg, Results):
                    self._on_results(msg)
                elif msg is _SHUTDOWN:
                    self._call(core.abandon, time.monotonic())
                    return
                elif isinstance(msg, Heartbeat):
                    if msg.broker_id is not None:
                        self._call(core.broker_seen, msg.broker_id, time.monotonic())
                elif isinstance(msg, Welcome):
                    self._on_welcome(msg)
                elif isinstance(msg, Error):
                    self._on_error(msg)
                elif isinstance(msg, Status):
                    if msg.query == self._asking:  # (else a late answer to a query that timed out: dropped)
                        self._status_reply = msg
                        self._status_event.set()
                elif isinstance(msg, _Overdue):
                    self._call(core.expire, msg.handles, time.monotonic())
                elif isinstance(msg, _Broken):
                    self._call(core.broken, msg.error, time.monotonic())
                elif isinstance(msg, _Failed):
                    self._call(core.failed, msg.message, msg.error, time.monotonic())
            except Exception as e:  # noqa: BLE001 -- one bad message must not stop the client
                log.exception("client failed to handle %s", type(msg).__name__)
                self._call(core.failed, msg, e, time.monotonic())

    def _on_welcome(self, msg: Welcome) -> None:
        with self._models_changed:
            aliases = msg.aliases
            self.aliases = aliases
            self.models = {**msg.models, **{a: msg.models[m] for a, m in aliases.items() if m in msg.models}}
            self.loading = msg.loading + tuple(sorted(a for a, m in aliases.items() if m in msg.loading))
            self.on_demand = msg.on_demand
            self._grace_end_s = time.monotonic() + msg.register_grace_s
            self._limits = _limits(self.models.get(self.model) if self.model is not None else None)
            if self.model is None and len(set(msg.models) | set(msg.loading) | set(msg.on_demand)) == 1:
                self._resolve_model(wait=True)
            self._models_changed.notify_all()
        self._call(self._core.broker_seen, msg.broker_id, time.monotonic())
        self._welcomed.set()

    def _on_error(self, msg: Error) -> None:
        # Before the welcome, an error naming no request answers our hello: the
        # broker cannot take us (another protocol version, or a hello or
        # welcome over a frame limit); the constructor raises it at once
        # rather than waiting for a welcome that will not come.
        if msg.code in _REFUSALS and not self._welcomed.is_set():
            self._refused = RemoteError(msg.code, f"the broker refused this client: {msg.message}")
            self._welcomed.set()  # wakes the constructor, which raises it
            return
        self._call(self._core.error, msg, time.monotonic())

    def _on_results(self, msg: Results) -> None:
        """Deliver ``msg`` (its requests have callbacks): streaming calls in
        order, then endings; a streaming callback that raises ends its
        request with that exception as error, and cancels it."""
        core = self._core
        now = time.monotonic()
        for h, fn, value in core.stream(msg, now):
            if fn is None:
                with self._lock:
                    run = core.finish(h, value, now)
                    if not run:
                        self._wake_waiters()
                if run:
                    self._deliver(h)
                continue
            try:
                fn(value)
            except BaseException as e:  # noqa: BLE001 -- the request ends with it as error (_deliver: why Base)
                log.warning("%s of request %r raised", "on_token" if fn is h.on_token else "on_text", h.request_id,
                            exc_info=e)
                self._call(core.stream_failed, h, e)

    # ------------------------------------------------------------------ performing the core's outcomes

    def _call(self, method: Callable[..., Outcome], *args) -> None:
        """Call a core ``method`` under the lock, then perform its :class:`Outcome`."""
        with self._lock:
            out = method(*args)
            if out.settled:
                self._wake_waiters()
        if out.hello:
            self._conn.send(Hello())  # the new broker's models (its welcome)
        if out.submit:
            self._conn.submit(out.submit)
        if out.cancel:
            self._conn.cancel(out.cancel)
        for h in out.deliver:
            self._deliver(h)

    def _deliver(self, h: ClientHandle) -> None:
        """Run the completion callback of ``h`` (ended already), then settle it.
        An exception it raises is recorded on the handle, as in the engine; so are ``SystemExit``
        and ``KeyboardInterrupt`` (``sys.exit()`` in a callback): on this thread, the client's
        callback thread, they would end no program, only the thread that delivers every result
        (a break-it pass: every later request then waited forever)."""
        self._delivering = h
        error = None
        try:
            h.callback(h.result())
        except BaseException as e:  # noqa: BLE001 -- recorded on the handle
            log.warning("callback of request %r raised", h.request_id, exc_info=e)
            error = e
        finally:
            self._delivering = None
        with self._lock:
            self._core.settle(h, error)
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        """(Under the lock) requests settled: wake ``result()`` and ``run()``."""
        if self._waiters or not self._ledger.in_flight:
            self._idle.notify_all()

    # ------------------------------------------------------------------ handles

    def _has_tokenizer(self) -> bool:
        """For handles: whether this client's model is known to have a tokenizer."""
        info = self.models.get(self.model)
        return info is not None and info.has_tokenizer

    def _wait_done(self, h: ClientHandle, timeout: float | None) -> None:
        """For ``handle.result()``: block until ``h`` is done (TimeoutError)."""
        with self._idle:
            self._waiters += 1
            try:
                if not self._idle.wait_for(lambda: h._done, timeout):
                    raise TimeoutError(f"request {h.request_id!r} not done after {timeout} s")
            finally:
                self._waiters -= 1

    def _delivering_now(self, h: ClientHandle) -> bool:
        """For ``handle.result()``: True when called from ``h``'s own callback;
        RuntimeError when called for another unfinished request from the
        callback thread (which is the thread that would finish it)."""
        if threading.current_thread() is self._dispatcher:
            if self._delivering is h:
                return True
            raise RuntimeError(f"result() of unfinished request {h.request_id!r} called from a callback "
                               "would deadlock; use its own callback instead")
        return False

    def _not_on_dispatcher(self, what: str) -> None:
        if threading.current_thread() is self._dispatcher:
            raise RuntimeError(f"{what} called from a callback would deadlock")

