"""The worker process: one :class:`~worker.BatchInferenceEngine` linked to a broker.

Two threads, each owning its sockets:

- the **I/O thread** owns the DEALER socket to the broker's backend. It
  announces the model when loading starts (``loading``: requests for it
  wait in the broker's queue meanwhile), registers once loaded (model,
  slots, credits), submits assigned requests straight into the engine
  (``submit_request`` is thread-safe), forwards cancellations, sends
  heartbeats at the broker's interval (announced in its ``welcome``), and
  forwards each iteration's message, split to fit the broker's frame limit.
  A long model step (or the model's load) never blocks it, so heartbeats
  keep flowing.
- the **main thread** runs the engine: ``wait_for_work`` -> ``step`` -> one
  ``iteration`` message with the new tokens of every slot, the requests that
  ended and so the credits returned -> appended to an outbox, and the I/O
  thread woken over an inproc PAIR socket (one wake-up per empty -> non-empty
  transition). The I/O thread encodes and sends; iterations that piled up
  while it was busy (fast steps) leave merged as one message, in order.

Engine request ids are the broker's keys tagged with a registration epoch:
after a re-registration (broker restart or lost contact) everything of the
old epoch is cancelled and its output dropped, so stale work never reaches
the new broker.

One message never stops the worker: a frame from the broker that cannot be
decoded, or whose handling raises, refuses just the requests it assigned
(an error ending each); an iteration part that cannot be sent (too large
for the broker even alone) ends just its request.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from protocol import defaults
from protocol.codec import decode, encode, peek_request_ids
from protocol.curve import load_peer_keys
from protocol.endpoints import set_ipv6
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.framing import fit, request_ids
from protocol.messages import (
    BROKER_TO_WORKER, Assign, Bye, Cancel, Envelope, Error, Finished, Heartbeat, Iteration, Loading, Message,
    ModelInfo, Register, Rejected, Text, Welcome,
)
from worker.engine import BatchInferenceEngine
from worker.models.options import ModelOptions

log = logging.getLogger(__name__)

DEFAULT_BROKER = defaults.WORKER_ENDPOINT
_WAKE, _STOP, _LOADED = b"w", b"s", b"l"  # main thread -> I/O thread signals on the inproc PAIR
_BROKER_BEATS_PER_WINDOW = 3  # the broker counts as lost after this many of its heartbeat intervals, at least
_EPOCH_SHIFT = 48  # engine id = key + (epoch << 48): broker keys stay far below 2**48


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything :func:`run_worker` needs.

    - ``broker``: the broker's worker endpoint (default ``tcp://127.0.0.1:5556``).
    - ``model``: model name, passed to :func:`worker.models.load_model`
      (``"simulated"`` = ``SimulatedLLM()`` with its defaults); also the name
      clients ask for.
    - ``num_slots``: the engine's batch size (slots).
    - ``prefetch``: requests the broker may assign beyond the free slots, so a
      freed slot is refilled on the next iteration without waiting a round
      trip (default: ``max(1, num_slots // 4)``).
    - ``step_delay_ms``: extra cost per iteration in milliseconds (simulates
      a slower model; 0 = none).
    - ``stop_token``: the default stop token for requests that give none:
      ``"model"`` (the model's EOS tokens, if it has them), an int, or None.
    - ``heartbeat_interval_s``: seconds between heartbeats when idle, until
      the broker's welcome announces its interval; then the broker's (or
      this, if shorter): the broker's liveness window counts in its interval.
    - ``broker_liveness_s``: no word from the broker for this long (seconds;
      at least 3 of the broker's heartbeat intervals) -> drop all work and
      register again.
    - ``name``: shown in ``slotserve status`` (default ``host:pid``).
    - ``curve_secret_file`` / ``curve_broker_key_file``: this worker's CURVE
      secret key file and the broker's public key file (``slotserve keygen``
      makes both; see :mod:`protocol.curve`); set both to talk CURVE, or neither.
    - ``max_message_bytes``: larger frames from the broker are refused
      (ZeroMQ drops the connection past 4x this; the decoder refuses above it).
    - ``model_options``: device, precision, runner, prefill chunk and threads
      for a real model (:class:`~worker.models.options.ModelOptions`).
    """

    broker: str = DEFAULT_BROKER
    model: str = "simulated"
    num_slots: int = 8
    prefetch: int | None = None
    step_delay_ms: float = 0.0
    stop_token: int | str | None = "model"
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    broker_liveness_s: float = 5.0
    name: str = ""
    curve_secret_file: str | None = None
    curve_broker_key_file: str | None = None
    max_message_bytes: int = defaults.MAX_MESSAGE_BYTES
    model_options: ModelOptions = ModelOptions()

    def __post_init__(self) -> None:
        if not isinstance(self.broker, str) or "://" not in self.broker:
            raise ValueError(f"broker must be a ZeroMQ endpoint like tcp://127.0.0.1:5556, got {self.broker!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty name, got {self.model!r}")
        if type(self.num_slots) is not int or self.num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {self.num_slots!r}")
        if self.prefetch is not None and (type(self.prefetch) is not int or self.prefetch < 0):
            raise ValueError(f"prefetch must be None or an int >= 0, got {self.prefetch!r}")
        if isinstance(self.step_delay_ms, bool) or not isinstance(self.step_delay_ms, (int, float)) \
                or not self.step_delay_ms >= 0:
            raise ValueError(f"step_delay_ms must be a number of milliseconds >= 0, got {self.step_delay_ms!r}")
        if not (self.stop_token is None or self.stop_token == "model"
                or (type(self.stop_token) is int and self.stop_token >= 0)):
            raise ValueError(f"stop_token must be 'model', None or a token id >= 0, got {self.stop_token!r}")
        for n in ("heartbeat_interval_s", "broker_liveness_s"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{n} must be a number of seconds > 0, got {v!r}")
        if (self.curve_secret_file is None) != (self.curve_broker_key_file is None):
            raise ValueError("CURVE needs both curve_secret_file and curve_broker_key_file, or neither")
        if type(self.max_message_bytes) is not int or self.max_message_bytes < defaults.MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be an int >= {defaults.MIN_MESSAGE_BYTES}, "
                             f"got {self.max_message_bytes!r}")
        if not isinstance(self.model_options, ModelOptions):
            raise ValueError(f"model_options must be a ModelOptions, got {self.model_options!r}")
        if self.broker_liveness_s <= self.heartbeat_interval_s:
            raise ValueError("broker_liveness_s must exceed heartbeat_interval_s")

    @property
    def max_inflight(self) -> int:
        """Credits announced to the broker: slots plus prefetch."""
        prefetch = max(1, self.num_slots // 4) if self.prefetch is None else self.prefetch
        return self.num_slots + prefetch


class _Live:
    """One assigned request inside the worker.

    ``tokens`` collects this iteration's tokens (its ``append`` is the
    engine's ``on_token``: no Python frame per token), and on a model with a
    tokenizer ``texts`` the text the engine released meanwhile (its
    ``on_text``; :mod:`worker.text`); ``handle`` is set by the I/O thread under
    the submit lock.
    """

    __slots__ = ("key", "eid", "handle", "tokens", "texts", "stale", "_done")

    def __init__(self, key: int, eid: int, done: list[int]) -> None:
        self.key = key
        self.eid = eid
        self._done = done
        self.handle = None
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.stale = False

    def on_end(self, seq: list[int]) -> None:
        """The engine's completion callback: note the end; ``_collect`` reports it."""
        self._done.append(self.eid)


class WorkerProcess:
    """A worker: engine + I/O thread. Use :func:`run_worker` unless embedding.

    ``model`` (a loaded model object; tests pass their own) is set up at
    once; without it :meth:`run` loads ``config.model`` after announcing it
    to the broker, so requests for it wait instead of failing while it
    loads. Raises ValueError when the model cannot be configured
    (:class:`~worker.errors.ModelLoadError`, from :meth:`run`, when it
    cannot be loaded).
    """

    def __init__(self, config: WorkerConfig, model=None) -> None:
        self.config = config
        self.model = self.engine = self.tokenizer = self.info = None
        if model is not None:
            self._setup(model)
        self.name = config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.curve_keys = None if config.curve_secret_file is None else load_peer_keys(
            (config.curve_secret_file, config.curve_broker_key_file), "worker")
        self.identity = uuid.uuid4().bytes
        self.iterations = 0
        self._live: dict[int, _Live] = {}       # by engine id; guarded by _submit_lock
        self._done: list[int] = []              # engine ids ended this iteration (main thread)
        self._submit_lock = threading.Lock()
        self._epoch = 0
        self._out_lock = threading.Lock()
        self._outbox: list[tuple[int, Iteration]] = []   # guarded by _out_lock
        self._wake_pending = False                        # guarded by _out_lock
        self._ctx: zmq.Context | None = None  # created by run(): an unused worker holds no sockets
        self._pipe_addr = f"inproc://worker-{uuid.uuid4().hex}"
        self._bye = "worker stopping"  # what the goodbye says (a failed load says why)

    def _load(self) -> None:
        """Load ``config.model`` (main thread, slow: 10-60 s for a real model on
        2 cores). Raises :class:`~worker.errors.ModelLoadError`."""
        from worker.errors import ModelLoadError
        from worker.models import load_model

        name = self.config.model
        try:
            model = load_model(name, **self.config.model_options.as_kwargs())
        except (OSError, ValueError) as e:  # HF raises OSError for names it cannot resolve
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(first if name in first else f"cannot load model {name!r}: {first}") from e
        weights = getattr(model, "weights", None)
        if weights is not None and hasattr(weights, "linear_kind"):  # slotserve's runner: what it measured
            log.info("loaded %r: %s on %s, linears %s%s", name, weights.precision, weights.device, weights.linear_kind,
                     "" if getattr(weights, "greedy_head", None) is None else ", greedy picks through a bf16-screened head")
        self._setup(model)

    def _setup(self, model) -> None:
        """The engine and what the broker is told about the model."""
        self.model = model
        stop = self.config.stop_token
        if stop == "model" and getattr(model, "eos_token_ids", None) is None:
            stop = None
        self.engine = BatchInferenceEngine(model, self.config.num_slots, stop)
        self.tokenizer = getattr(model, "tokenizer", None)
        self.info = ModelInfo(
            vocab_size=getattr(model, "vocab_size", None),
            max_seq_len=getattr(model, "max_seq_len", None),
            eos_token_ids=tuple(sorted(self.engine.stop_tokens)),
            has_tokenizer=self.tokenizer is not None,
        )

    # ------------------------------------------------------------------ main thread

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; then say goodbye (the broker migrates
        whatever this worker still held) and close."""
        self._ctx = zmq.Context()
        io_end = self._ctx.socket(zmq.PAIR)
        io_end.bind(self._pipe_addr)
        main_end = self._ctx.socket(zmq.PAIR)
        main_end.connect(self._pipe_addr)
        io = threading.Thread(target=self._io_thread, args=(io_end, stop), name="slotserve-worker-io", daemon=True)
        io.start()
        delay_s = self.config.step_delay_ms / 1000.0
        try:
            if self.engine is None:  # the I/O thread announced the model; heartbeats flow while it loads
                try:
                    self._load()
                except BaseException as e:
                    self._bye = f"cannot load model {self.config.model!r}: {e}"
                    raise
                main_end.send(_LOADED)
            engine = self.engine
            while not stop.is_set():
                if not engine.wait_for_work(0.1):
                    continue
                engine.step()
                if delay_s:
                    time.sleep(delay_s)  # the simulated extra model cost, not synchronisation
                self.iterations += 1
                out = self._collect()
                if out is not None:
                    with self._out_lock:
                        self._outbox.append(out)
                        wake = not self._wake_pending
                        self._wake_pending = True
                    if wake:
                        main_end.send(_WAKE)
        finally:
            try:
                main_end.send(_STOP, zmq.NOBLOCK)  # tells the I/O thread to say goodbye and stop
            except zmq.Again:
                pass  # the I/O thread is gone already
            io.join(10.0)
            main_end.close(0)
            self._ctx.term()

    def _collect(self) -> tuple[int, Iteration] | None:
        """This iteration's ``iteration`` message, tagged with the registration
        epoch it belongs to (None when there is nothing to say)."""
        ids, tokens, texts, finished = [], [], [], []
        with self._submit_lock:
            for live in self._live.values():
                toks = live.tokens
                if toks:
                    if not live.stale:
                        ids.extend([live.key] * len(toks))
                        tokens.extend(toks)
                    toks.clear()
                if live.texts:  # (with its tokens: the pieces are a function of the tokens sent so far)
                    if not live.stale:
                        texts.append(Text(live.key, "".join(live.texts)))
                    live.texts.clear()
            for eid in self._done:
                live = self._live.pop(eid)
                if not live.stale:
                    finished.append(_finished(live.key, live.handle))
            self._done.clear()
            epoch = self._epoch
        if not (ids or finished or texts):
            return None
        return epoch, Iteration(tuple(ids), tuple(tokens), tuple(texts), tuple(finished))

    def take_outbox(self) -> list[tuple[int, Iteration]]:
        """(I/O thread) everything the main thread produced since the last call."""
        with self._out_lock:
            items, self._outbox = self._outbox, []
            self._wake_pending = False
        return items

    # ------------------------------------------------------------------ I/O thread

    def _io_thread(self, pipe: zmq.Socket, stop: threading.Event) -> None:
        io = None
        try:
            io = _WorkerIO(self, pipe)
            io.loop()
        except Exception:  # noqa: BLE001 -- a dead I/O thread must stop the worker, loudly
            log.exception("worker I/O thread failed; stopping the worker")
            stop.set()
        finally:
            pipe.close(0)
            if io is not None and not io.sock.closed:
                io.sock.close(0)

    def assign(self, entries: tuple[Envelope | Rejected, ...]) -> list[Finished]:
        """Submit assigned requests into the engine (I/O thread); return the
        immediate endings of those it refused."""
        refused = []
        text = self.tokenizer is not None  # then every request streams its text (token-id prompts too)
        with self._submit_lock:
            epoch_base = self._epoch << _EPOCH_SHIFT
            for entry in entries:
                key = entry.request_id
                if type(entry) is Rejected or type(key) is not int:
                    message = entry.message if type(entry) is Rejected else "a broker key must be an int"
                    refused.append(Finished(key, FinishReason.ERROR, ErrorCode.BAD_REQUEST, message))
                    continue
                live = _Live(key, key + epoch_base, self._done)
                try:
                    live.handle = self.engine.submit(entry.params, live.on_end, on_token=live.tokens.append,
                                                     on_text=live.texts.append if text else None,
                                                     request_id=live.eid,
                                                     resume_tokens=entry.resume_tokens,
                                                     time_left_s=entry.time_left_s)
                except ValueError as e:  # bad_request, or the error's own code (unsupported, duplicate)
                    refused.append(Finished(key, FinishReason.ERROR, getattr(e, "code", ErrorCode.BAD_REQUEST),
                                            str(e)))
                    continue
                except Exception as e:  # noqa: BLE001 -- e.g. QueueFullError, a tokenizer failure
                    refused.append(Finished(key, FinishReason.ERROR, getattr(e, "code", ErrorCode.INTERNAL),
                                            f"{type(e).__name__}: {e}"))
                    continue
                self._live[live.eid] = live
        return refused

    def cancel(self, keys: list[int]) -> None:
        base = self._epoch << _EPOCH_SHIFT
        for key in keys:
            if type(key) is int:
                self.engine.cancel(key + base)

    def holds(self, key) -> bool:
        """Whether broker key ``key`` names a request in the engine now."""
        return type(key) is int and (key + (self._epoch << _EPOCH_SHIFT)) in self._live

    def abandon(self, keys: list) -> None:
        """End these requests here without reporting their end (the broker was
        told already): cancel them, drop their output."""
        base = self._epoch << _EPOCH_SHIFT
        with self._submit_lock:
            lives = [self._live.get(k + base) for k in keys if type(k) is int]
            for live in lives:
                if live is not None:
                    live.stale = True
        for live in lives:
            if live is not None:
                self.engine.cancel(live.eid)

    def drop_all(self) -> None:
        """Forget every request (the broker that assigned them is gone): cancel
        them in the engine and mark their output stale; new keys get a new epoch."""
        with self._submit_lock:
            self._epoch += 1
            lives = list(self._live.values())
            for live in lives:
                live.stale = True
        for live in lives:
            self.engine.cancel(live.eid)


def _finished(key: int, handle) -> Finished:
    reason = handle.finish_reason
    code = message = None
    if reason is FinishReason.ERROR:
        err = handle.error
        code = getattr(err, "code", None)
        if not isinstance(code, ErrorCode):
            code = ErrorCode.INTERNAL
        message = f"{type(err).__name__}: {err}" if err is not None else "failed"
    return Finished(key, reason, code, message, handle.usage.prompt_tokens, handle.stop_reason)


class _WorkerIO:
    """The I/O thread's state and loop (owns the DEALER and its PAIR end).

    Phases: *loading* (the model is loading: ``loading`` sent, heartbeats
    once the broker answered), then *registering* / *registered*
    (``register`` sent / welcomed). Heartbeats and the broker's liveness
    window follow the broker's interval from its welcome."""

    def __init__(self, wp: WorkerProcess, pipe: zmq.Socket) -> None:
        self.wp = wp
        self.cfg = wp.config
        self.pipe = pipe
        self.sock = wp._ctx.socket(zmq.DEALER)
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
        self.loaded = wp.engine is not None
        self.welcomed = False    # the broker answered our latest loading / register
        self.registered = False  # ... and it was a register: requests may come
        self.heartbeat_s = self.cfg.heartbeat_interval_s
        self.broker_liveness_s = self.cfg.broker_liveness_s
        self.max_send_bytes = self.cfg.max_message_bytes  # until the broker's welcome says its own
        self.last_sent = 0.0
        self.last_recv = time.monotonic()

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
            self.last_sent = time.monotonic()
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
        self.send(Loading(self.cfg.model, self.wp.name))

    def register(self) -> None:
        wp = self.wp
        self.welcomed = False
        self.send(Register(self.cfg.model, self.cfg.num_slots, self.cfg.max_inflight, wp.info, wp.name,
                           self.cfg.max_message_bytes))

    def reregister(self) -> None:
        if not self.loaded:
            self.announce()
            return
        self.wp.drop_all()
        self.registered = False
        self.register()

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.pipe, zmq.POLLIN)
        if self.loaded:
            self.register()
        else:
            self.announce()
        while True:
            events = dict(poller.poll(max(0.0, self.last_sent + self.heartbeat_s - time.monotonic()) * 1000))
            if self.pipe in events:
                stopping = False
                while True:
                    try:
                        signal = self.pipe.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    stopping |= signal == _STOP
                    if signal == _LOADED:
                        self.loaded = True
                        self.register()
                self._forward(self.wp.take_outbox())
                if stopping:
                    try:
                        self.sock.send(encode(Bye(self.wp._bye)), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the broker is not reading; it will notice the silence
                    self.sock.close(linger=500)  # let the goodbye leave
                    return
            if self.sock in events:
                self._receive()
            now = time.monotonic()
            if now - self.last_recv > self.broker_liveness_s:
                log.warning("no word from the broker for %.1f s: registering again", now - self.last_recv)
                self.last_recv = now
                self.reregister()
            elif now - self.last_sent >= self.heartbeat_s and self.welcomed:
                self.send(Heartbeat(progress=self.wp.iterations))
            # Not answered yet: the Register (or Loading) waits in the DEALER's
            # queue and leaves when the broker is reachable; it is re-sent only
            # after broker_liveness_s without an answer (above).

    def _forward(self, items: list[tuple[int, Iteration]]) -> None:
        """Send the main thread's iterations as one message (concatenated in
        order; split again only if the broker's limit requires). Output of an
        older registration epoch is dropped: its keys may now name other requests."""
        epoch = self.wp._epoch
        its = [it for e, it in items if e == epoch and self.registered]
        if len(its) == 1:
            self.send(its[0])
        elif its:  # piled up while this thread was busy: one message, in order
            def joined(field: str) -> tuple:
                return tuple(itertools.chain.from_iterable(getattr(it, field) for it in its))
            self.send(Iteration(joined("ids"), joined("tokens"), joined("texts"), joined("finished")))

    def _receive(self) -> None:
        for _ in range(1024):
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_recv = time.monotonic()
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

    def _welcome(self, msg: Welcome) -> None:
        """Adopt the broker's identity, frame limit and heartbeat period."""
        self.broker_id = msg.broker_id
        self.max_send_bytes = msg.max_message_bytes
        self.heartbeat_s = min(self.cfg.heartbeat_interval_s, msg.heartbeat_interval_s)
        self.broker_liveness_s = max(self.cfg.broker_liveness_s, _BROKER_BEATS_PER_WINDOW * msg.heartbeat_interval_s)
        self.welcomed = True

    def _handle(self, msg: Message) -> None:
        wp = self.wp
        if isinstance(msg, Assign):
            if self.registered:
                refused = wp.assign(msg.requests)
                if refused:
                    self.send(Iteration(finished=tuple(refused)))
        elif isinstance(msg, Cancel):
            wp.cancel(msg.request_ids)
        elif isinstance(msg, Heartbeat):
            if msg.broker_id is not None and self.broker_id is not None and msg.broker_id != self.broker_id:
                log.warning("the broker restarted: registering again")
                self.reregister()
        elif isinstance(msg, Welcome):
            self._welcome(msg)
            if not self.loaded:
                log.info("broker %s knows this worker is loading model %r", msg.broker_id[:8], self.cfg.model)
                return
            # Every welcome starts a fresh registration on the broker's
            # side (anything it assigned before is requeued there), so
            # whatever this worker still holds is void.
            wp.drop_all()
            self.registered = True
            log.info("registered with broker %s as %s (%d slots)", msg.broker_id[:8], wp.name, self.cfg.num_slots)
        elif isinstance(msg, Error):
            if msg.code is ErrorCode.NOT_REGISTERED:
                if self.welcomed:  # later ones answer messages sent before our Register / Loading
                    log.warning("the broker does not know this worker (restarted?): registering again")
                    self.registered = False
                    self.reregister()
            else:
                log.warning("broker error: %s: %s", msg.code.value, msg.message)


def run_worker(config: WorkerConfig, *, stop: threading.Event | None = None, model=None) -> None:
    """Run a worker until ``stop`` is set (forever when None).

    Loads ``config.model`` unless ``model`` is given. Raises ValueError when
    the model cannot be loaded.
    """
    WorkerProcess(config, model).run(stop or threading.Event())
