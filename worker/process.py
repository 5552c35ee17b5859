"""The worker process: one :class:`~worker.BatchInferenceEngine` linked to a broker.

Two threads, each owning its sockets:

- the **I/O thread** owns the DEALER socket to the broker's backend. It
  registers (model, slots, credits), submits assigned requests straight into
  the engine (``submit_request`` is thread-safe), forwards cancellations,
  sends heartbeats, and forwards each iteration's message. A long model step
  never blocks it, so heartbeats keep flowing.
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
from protocol.codec import decode, encode
from protocol.curve import load_peer_keys
from protocol.endpoints import set_ipv6
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import (
    BROKER_TO_WORKER, Assign, Bye, Cancel, Envelope, Error, Finished, Heartbeat, Iteration, ModelInfo,
    Register, Rejected, Text, Welcome,
)
from worker.engine import BatchInferenceEngine
from worker.models.options import ModelOptions

log = logging.getLogger(__name__)

DEFAULT_BROKER = defaults.WORKER_ENDPOINT
_WAKE, _STOP = b"w", b"s"  # main thread -> I/O thread signals on the inproc PAIR
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
    - ``heartbeat_interval_s``: seconds between heartbeats when idle.
    - ``broker_liveness_s``: no word from the broker for this long (seconds)
      -> drop all work and register again.
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
        if type(self.max_message_bytes) is not int or self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be an int >= 1, got {self.max_message_bytes!r}")
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

    ``model`` overrides loading ``config.model`` (tests pass their own).
    Raises ValueError when the model cannot be loaded or configured.
    """

    def __init__(self, config: WorkerConfig, model=None) -> None:
        self.config = config
        if model is None:
            from worker.errors import ModelLoadError
            from worker.models import load_model

            try:
                model = load_model(config.model, **config.model_options.as_kwargs())
            except (OSError, ValueError) as e:  # HF raises OSError for names it cannot resolve
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ModelLoadError(first if config.model in first else
                                     f"cannot load model {config.model!r}: {first}") from e
        self.model = model
        stop = config.stop_token
        if stop == "model" and getattr(model, "eos_token_ids", None) is None:
            stop = None
        self.engine = BatchInferenceEngine(model, config.num_slots, stop)
        self.tokenizer = getattr(model, "tokenizer", None)
        self.info = ModelInfo(
            vocab_size=getattr(model, "vocab_size", None),
            max_seq_len=getattr(model, "max_seq_len", None),
            eos_token_ids=tuple(sorted(self.engine.stop_tokens)),
            has_tokenizer=self.tokenizer is not None,
        )
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
        engine = self.engine
        try:
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
    """The I/O thread's state and loop (owns the DEALER and its PAIR end)."""

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
        self.registered = False
        self.last_sent = 0.0
        self.last_recv = time.monotonic()

    def send(self, msg_or_bytes) -> None:
        data = msg_or_bytes if isinstance(msg_or_bytes, (bytes, zmq.Frame)) else encode(msg_or_bytes)
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            # 100k messages unsent: the broker is not reading us. Losing this
            # message would lose tokens, so start over with a fresh registration.
            log.error("broker not reading (send buffer full): dropping all work and registering again")
            self.reregister()
            return
        self.last_sent = time.monotonic()

    def register(self) -> None:
        wp = self.wp
        self.send(Register(self.cfg.model, self.cfg.num_slots, self.cfg.max_inflight, wp.info, wp.name))

    def reregister(self) -> None:
        self.wp.drop_all()
        self.registered = False
        self.register()

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.pipe, zmq.POLLIN)
        hb = self.cfg.heartbeat_interval_s
        self.register()
        while True:
            events = dict(poller.poll(max(0.0, self.last_sent + hb - time.monotonic()) * 1000))
            if self.pipe in events:
                stopping = False
                while True:
                    try:
                        stopping |= self.pipe.recv(zmq.NOBLOCK) == _STOP
                    except zmq.Again:
                        break
                self._forward(self.wp.take_outbox())
                if stopping:
                    try:
                        self.sock.send(encode(Bye("worker stopping")), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the broker is not reading; it will notice the silence
                    self.sock.close(linger=500)  # let the goodbye leave
                    return
            if self.sock in events:
                self._receive()
            now = time.monotonic()
            if now - self.last_recv > self.cfg.broker_liveness_s:
                log.warning("no word from the broker for %.1f s: registering again", now - self.last_recv)
                self.last_recv = now
                self.reregister()
            elif now - self.last_sent >= hb and self.registered:
                self.send(Heartbeat(progress=self.wp.iterations))
            # Not registered yet: the Register waits in the DEALER's queue and
            # leaves when the broker is reachable; it is re-sent only after
            # broker_liveness_s without an answer (above).

    def _forward(self, items: list[tuple[int, Iteration]]) -> None:
        """Send the main thread's iterations as one message (concatenated in
        order). Output of an older registration epoch is dropped: its keys may
        now name other requests."""
        epoch = self.wp._epoch
        its = [it for e, it in items if e == epoch and self.registered]
        if len(its) == 1:
            self.send(its[0])
        elif its:  # piled up while this thread was busy: one message, in order
            def joined(field: str) -> tuple:
                return tuple(itertools.chain.from_iterable(getattr(it, field) for it in its))
            self.send(Iteration(joined("ids"), joined("tokens"), joined("texts"), joined("finished")))

    def _receive(self) -> None:
        wp = self.wp
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
                continue
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
                # Every welcome starts a fresh registration on the broker's
                # side (anything it assigned before is requeued there), so
                # whatever this worker still holds is void.
                wp.drop_all()
                self.broker_id = msg.broker_id
                self.registered = True
                log.info("registered with broker %s as %s (%d slots)", msg.broker_id[:8], wp.name,
                         self.cfg.num_slots)
            elif isinstance(msg, Error):
                if msg.code is ErrorCode.NOT_REGISTERED:
                    if self.registered:  # later ones answer messages sent before our Register
                        log.warning("the broker does not know this worker (restarted?): registering again")
                        self.reregister()
                else:
                    log.warning("broker error: %s: %s", msg.code.value, msg.message)


def run_worker(config: WorkerConfig, *, stop: threading.Event | None = None, model=None) -> None:
    """Run a worker until ``stop`` is set (forever when None).

    Loads ``config.model`` unless ``model`` is given. Raises ValueError when
    the model cannot be loaded.
    """
    WorkerProcess(config, model).run(stop or threading.Event())
