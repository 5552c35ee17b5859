"""The worker process: one :class:`~worker.BatchInferenceEngine` linked to a broker.

Two threads, each owning its sockets:

- the **main thread** runs the engine (:class:`WorkerProcess`):
  ``wait_for_work`` -> ``step`` -> one ``iteration`` message with the new
  tokens of every slot, the requests that ended and so the credits returned
  -> appended to an outbox, and the I/O thread woken over an inproc PAIR
  socket (one wake-up per empty -> non-empty transition).
- the **I/O thread** (:mod:`worker.link`) owns the DEALER socket to the
  broker's backend: registration, heartbeats, assigned requests and
  cancellations (handed to :meth:`WorkerProcess.assign` /
  :meth:`~WorkerProcess.cancel`), and the outbox's iterations, encoded and sent.

Ready means warm: the model is announced as loading first, then loaded and
warmed up (:mod:`worker.warmup`, unless ``WorkerConfig.warmup`` is off or
the model is stateless), and only then registered, so the broker (and
through it ``/health`` and ``Client.wait_for_model``) lists it as served
once its first requests run at full speed.

Engine request ids are the broker's keys tagged with a registration epoch:
after a re-registration (broker restart or lost contact) everything of the
old epoch is cancelled and its output dropped, so stale work never reaches
the new broker.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import os
import threading
import time
import uuid

import zmq

from protocol.curve import load_peer_keys
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import error_code
from protocol.messages import EmbeddingVector, Envelope, Finished, Iteration, Logprobs, ModelInfo, \
    PrefixCacheUsage, Rejected, Started, Text
from worker.admission import Admission
from worker.config import WorkerConfig
from worker.engine import BatchInferenceEngine
from worker.errors import LoadInterrupted, ModelFileError, ModelLoadError
from worker.link import READY, STOP, WAKE, serve_broker
from worker.warmup import needs_warmup, warm_up

log = logging.getLogger(__name__)

_EPOCH_SHIFT = 48  # engine id = key + (epoch << 48): broker keys stay far below 2**48


class _Live:
    """One assigned request inside the worker.

    ``tokens`` collects this iteration's tokens (its ``append`` is the
    engine's ``on_token``: no Python frame per token), and on a model with a
    tokenizer ``texts`` the text the engine released meanwhile (its
    ``on_text``; :mod:`worker.text`); ``handle`` is set by the I/O thread under
    the submit lock. For a request that asks for logprobs, ``scored`` counts
    the entries of ``handle.logprobs`` sent so far and ``prompt_sent`` says
    whether its ``prompt_logprobs`` were.
    """

    __slots__ = ("key", "eid", "handle", "tokens", "texts", "stale", "_done", "scored", "prompt_sent")

    def __init__(self, key: int, eid: int, done: list[int]) -> None:
        self.key = key
        self.eid = eid
        self._done = done
        self.handle = None
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.stale = False
        self.scored = 0
        self.prompt_sent = False

    def on_end(self, seq: list[int]) -> None:
        """The engine's completion callback: note the end; ``_collect`` reports it."""
        self._done.append(self.eid)


class WorkerProcess:
    """A worker: its engine, the ledger of the requests the broker assigned
    (by registration epoch), and the I/O thread (:mod:`worker.link`) that
    :meth:`run` starts. Use :func:`run_worker` unless embedding.

    ``model`` (a loaded model object; tests pass their own) is set up at
    once; without it :meth:`run` loads ``config.model`` after announcing it
    to the broker, so requests for it wait instead of failing while it
    loads. Either way :meth:`run` warms the model up before registering it
    (``config.warmup``; slot-aware models only). Raises ValueError when the
    model cannot be configured (:class:`~worker.errors.ModelLoadError`,
    from :meth:`run`, when it cannot be loaded).
    """

    def __init__(self, config: WorkerConfig, model=None) -> None:
        self.config = config
        self.model = self.engine = self.tokenizer = self.info = None
        if model is not None:
            self._setup(model)
        self.name = config.name_of(os.getpid())
        self.curve_keys = None if config.curve_secret_file is None else load_peer_keys(
            (config.curve_secret_file, config.curve_broker_key_file), "worker")
        self.identity = uuid.uuid4().bytes
        self.iterations = 0
        self.ready = self.engine is not None and not self._cold()
        """The model is loaded and warm: the I/O thread registers it at once
        (otherwise it announces it as loading and registers on :data:`~worker.link.READY`)."""
        self._live: dict[int, _Live] = {}       # by engine id; guarded by _submit_lock
        self._unstarted: list[_Live] = []       # text prompts whose length is not sent yet; guarded by _submit_lock
        self._scored: list[_Live] = []          # requests that ask for logprobs; guarded by _submit_lock
        self._done: list[int] = []              # engine ids ended this iteration (main thread)
        # engine ids queued for the admission thread -> their deadline (monotonic seconds, or None), until
        # it takes them or they end (a cancel, their deadline: at once) or are dropped; guarded by _submit_lock
        self._admitting: dict[int, float | None] = {}
        self._admit_deadlines: list[tuple[float, int]] = []  # heap of (deadline_s, engine id); guarded by _submit_lock
        self._admission: Admission | None = None  # while run() runs: prepares text and structured requests
        self._submit_lock = threading.Lock()
        self._epoch = 0
        self._out_lock = threading.Lock()
        self._outbox: list[tuple[int, Iteration]] = []   # guarded by _out_lock
        self._wake_pending = False                        # guarded by _out_lock
        self.goodbye = "worker stopping"  # what the I/O thread's goodbye says (a failed load says why)
        self.load_failed = False  # ... and whether it leaves because its model failed to load (Bye.load_failed)

    def _load(self) -> None:
        """Load ``config.model`` (main thread, slow: 10-60 s for a real model on
        2 cores). Raises :class:`~worker.errors.ModelLoadError`."""
        from worker.models import load_model

        name = self.config.model
        try:
            model = load_model(name, **self.config.model_options.as_kwargs())
        except (OSError, ValueError) as e:  # HF raises OSError for names it cannot resolve
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(first if name in first else f"cannot load model {name!r}: {first}",
                                 _load_failure(self.config.served_names[0], e)) from e
        weights = getattr(model, "weights", None)
        if weights is not None and hasattr(weights, "linear_kind"):  # slotserve's runner: what it measured
            log.info("loaded %r: %s on %s, linears %s%s; %d tokens per slot, KV cache %s, %.1f MiB per slot",
                     name, weights.precision, weights.device, weights.linear_kind,
                     "" if getattr(weights, "greedy_head", None) is None else ", greedy picks through a bf16-screened head",
                     model.max_seq_len, str(model.kv_dtype).removeprefix("torch."), model.kv_bytes_per_slot / 2**20)
        try:
            self._setup(model)
        except ValueError as e:  # the options do not fit the model (a stop token outside its vocabulary, too many slots)
            raise ModelLoadError(f"cannot serve model {name!r}: {e}",
                                 f"cannot serve model {self.config.served_names[0]!r}: {e}") from e

    def _cold(self) -> bool:
        """Whether the model is to be warmed up before it is served."""
        return self.config.warmup and needs_warmup(self.model)

    def _setup(self, model) -> None:
        """The engine and what the broker is told about the model."""
        self.model = model
        stop = self.config.stop_token
        if stop == "model" and getattr(model, "eos_token_ids", None) is None:
            stop = None
        embedding_size = getattr(model, "embedding_size", None)
        if embedding_size is not None:  # an embedding model: its requests run through an EmbeddingEngine
            from worker.embeddings import EmbeddingEngine

            self.engine = EmbeddingEngine(model, self.config.num_slots)
        else:
            self.engine = BatchInferenceEngine(model, self.config.num_slots, stop)
        self.tokenizer = getattr(model, "tokenizer", None)
        self.info = ModelInfo(
            vocab_size=getattr(model, "vocab_size", None),
            max_seq_len=getattr(model, "max_seq_len", None),
            eos_token_ids=tuple(sorted(self.engine.stop_tokens)),
            has_tokenizer=self.tokenizer is not None,
            runs=runs_of(model),
            reasoning=str(getattr(self.tokenizer, "reasoning_format", "") or ""),
            chat_template=str(getattr(self.tokenizer, "chat_template_override", "") or ""),
            embedding_size=embedding_size,
            matryoshka_dims=tuple(getattr(model, "matryoshka_dims", ())),
        )

    # ------------------------------------------------------------------ main thread

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; then say goodbye (the broker migrates
        whatever this worker still held) and close. The sockets live only
        while this runs (an unused worker holds none)."""
        ctx = zmq.Context()
        pipe_addr = f"inproc://worker-{uuid.uuid4().hex}"
        io_end = ctx.socket(zmq.PAIR)
        io_end.bind(pipe_addr)
        main_end = ctx.socket(zmq.PAIR)
        main_end.connect(pipe_addr)
        admitted = ctx.socket(zmq.PULL)  # (the I/O thread's end of the admission lanes' wake-ups)
        admitted.bind(pipe_addr + "-admission")
        self._admission = Admission(ctx, pipe_addr + "-admission")
        io = threading.Thread(target=serve_broker, args=(self, ctx, io_end, stop, admitted),
                              name="slotserve-worker-io", daemon=True)
        io.start()
        try:
            if not self.ready:  # the I/O thread announced the model; heartbeats flow while it loads and warms up
                self._prepare(stop)
                if not stop.is_set():
                    self.ready = True
                    main_end.send(READY)
            self._serve(main_end, stop)
        finally:
            try:
                main_end.send(STOP, zmq.NOBLOCK)  # tells the I/O thread to say goodbye and stop
            except zmq.Again:
                pass  # the I/O thread is gone already
            io.join(10.0)
            self._admission.close()
            self._admission = None
            main_end.close(0)
            ctx.term()

    def _prepare(self, stop: threading.Event) -> None:
        """Load the model (unless it was given) and warm it up (unless it needs none). A stop asked for
        meanwhile ends both at once where ``stop`` can interrupt the main thread (its ``interrupting``,
        :meth:`slotserve.signals.SignalStopFlag.interrupting`: the CLI's and the launcher's flags):
        a load checks no flag and takes seconds to minutes (a first start builds kernels), longer than
        a process manager waits between SIGTERM and SIGKILL. Returns then with ``stop`` set, as
        :meth:`run` expects."""
        what = "load"
        interrupting = getattr(stop, "interrupting", None)
        try:
            with interrupting(LoadInterrupted) if interrupting is not None else contextlib.nullcontext():
                if self.engine is None:
                    self._load()
                if self._cold():
                    what = "warm up"
                    warm_up(self.engine, stop)
        except LoadInterrupted:
            log.info("stopped during the model's %s", what)  # (the goodbye says "worker stopping")
        except BaseException as e:
            # the goodbye reaches clients (the errors of the requests waiting, /v1/models' failed reason): the
            # served name and slotserve's words; the detail (a path, a library's text) goes to the log, with e
            name = self.config.served_names[0]
            self.goodbye = e.public if isinstance(e, ModelLoadError) else _load_failure(name, e) if what == "load" \
                else f"model {name!r} failed to warm up: an unexpected error"
            self.load_failed = True
            raise

    def _serve(self, pipe: zmq.Socket, stop: threading.Event) -> None:
        """The engine loop: step while there is work; each iteration's message
        goes to the outbox, and the I/O thread is woken when it was empty."""
        engine = self.engine
        delay_s = self.config.step_delay_ms / 1000.0
        while not stop.is_set():
            due = self._admit_deadlines[:1]  # (a racy read: a miss is seen next turn)
            if due and due[0][0] <= time.monotonic():
                late = self._expire_admitting(time.monotonic())
                if late is not None and self._post(late):
                    pipe.send(WAKE)
            if not engine.wait_for_work(0.1):
                continue
            engine.step()
            if delay_s:
                time.sleep(delay_s)  # the simulated extra model cost, not synchronisation
            self.iterations += 1
            out = self._collect()
            if out is not None and self._post(out):
                pipe.send(WAKE)

    def _post(self, out: tuple[int, Iteration]) -> bool:
        """Append ``out`` to the outbox; True when the I/O thread needs a wake-up
        (one per empty -> non-empty transition)."""
        with self._out_lock:
            self._outbox.append(out)
            wake = not self._wake_pending
            self._wake_pending = True
        return wake

    def _collect(self) -> tuple[int, Iteration] | None:
        """This iteration's ``iteration`` message, tagged with the registration
        epoch it belongs to (None when there is nothing to say)."""
        ids, tokens, texts, finished, embeddings = [], [], [], [], []
        with self._submit_lock:
            started = self._started() if self._unstarted else ()
            scores = self._scores() if self._scored else ()
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
                    if live.handle.embedding_bytes is not None:  # (an embedding request, before its ending)
                        embeddings.append(EmbeddingVector(live.key, live.handle.embedding_bytes))
                    finished.append(_finished(live.key, live.handle))
            self._done.clear()
            epoch = self._epoch
        if not (ids or finished or texts):
            return None
        return epoch, Iteration(tuple(ids), tuple(tokens), tuple(texts), tuple(finished), tuple(started),
                                tuple(scores), tuple(embeddings))

    def _scores(self) -> list[Logprobs]:
        """(Under the submit lock, before this iteration's tokens are taken) the
        logprobs of the requests that ask for them: the entries of this
        iteration's tokens (the engine appends one to ``handle.logprobs`` per
        token, before its ``on_token``) and, with the first tokens, the
        prompt's (``handle.prompt_logprobs``; a resumed request has none),
        with the prompt's ids for a text or chat prompt."""
        records, keep = [], []
        done = self._done
        for live in self._scored:
            if live.stale:
                continue
            h = live.handle
            n = len(live.tokens)
            entries: tuple = ()
            if n and h.logprobs is not None and live.scored >= 0:
                start = live.scored
                entries = tuple(h.logprobs[start:start + n])
                live.scored = start + n
                if len(entries) != n:  # (an engine that fell behind: stop, rather than misalign the rest)
                    log.error("request %s: %d tokens but %d logprob entries; sending no more of its logprobs",
                              live.key, n, len(entries))
                    entries, live.scored = (), -1
            prompt = ids = None
            if n and not live.prompt_sent and h.prompt_logprobs is not None:
                prompt, live.prompt_sent = tuple(h.prompt_logprobs), True
                if not h.params.is_token_prompt:  # (its ids, which only this worker knows)
                    ids = tuple(h.prompt)
            if entries or prompt is not None:
                records.append(Logprobs(live.key, entries, prompt, ids))
            if live.eid not in done:
                keep.append(live)
        self._scored = keep
        return records

    def _started(self) -> list[Started]:
        """(Under the submit lock, before this iteration's tokens are taken) the
        prompt lengths of the text and chat requests whose first tokens are in
        this iteration: sent with them, once (a token-id prompt's length is
        known to its client; those of the others reach it only so)."""
        started, waiting = [], []
        done = self._done
        for live in self._unstarted:
            if live.stale:
                continue
            if live.tokens:
                started.append(Started(live.key, live.handle.prompt_tokens, live.handle.cached_tokens))
            elif live.eid not in done:  # (one that ends without a token tells it with its end)
                waiting.append(live)
        self._unstarted = waiting
        return started

    # ------------------------------------------------------------------ called by the I/O thread
    # (with the attributes it reads, this is :class:`worker.link.LinkedWorker`)

    def prefix_cache_usage(self) -> PrefixCacheUsage | None:
        """The model's prefix cache now (``worker.models.llama.prefix_cache``), for heartbeats;
        None for a model without one. Read without a lock: ints the main thread updates, each
        read whole (a report may be one lookup behind; the next one catches up)."""
        cache = getattr(self.model, "prefix_cache", None)
        if cache is None:
            return None
        stats = cache.stats
        return PrefixCacheUsage(stats.queries, stats.hits, cache.used_blocks * cache.block_bytes, cache.nbytes)

    def take_outbox(self) -> list[Iteration]:
        """The iterations the main thread produced since the last call, in
        order. Those of an older registration epoch are dropped: their keys
        may now name other requests. (The epoch changes only on the I/O thread.)"""
        with self._out_lock:
            items, self._outbox = self._outbox, []
            self._wake_pending = False
        epoch = self._epoch
        return [it for e, it in items if e == epoch]

    def assign(self, entries: tuple[Envelope | Rejected, ...]) -> list[Finished]:
        """Take assigned requests (I/O thread); return the immediate endings of those refused.

        A token-id request is submitted into the engine at once. One with work that grows with what
        the client sent (a text or chat prompt to tokenise, a structured constraint to compile:
        :meth:`~worker.BatchInferenceEngine.needs_preparing`) is queued for an admission lane (one
        with a constraint on the structured lane, any other on the text lane) while :meth:`run`
        runs (:mod:`worker.admission`: seconds there sent no heartbeat), which submits it or posts
        its refusal to the outbox; without those threads, at once too."""
        refused = []
        admission = self._admission
        now = time.monotonic()
        with self._submit_lock:
            epoch = self._epoch
            for entry in entries:
                key = entry.request_id
                if type(entry) is Rejected or type(key) is not int:
                    message = entry.message if type(entry) is Rejected else "a broker key must be an int"
                    refused.append(Finished(key, FinishReason.ERROR, ErrorCode.BAD_REQUEST, message))
                elif admission is not None and self.engine.needs_preparing(entry.params):
                    self._hold(key + (epoch << _EPOCH_SHIFT), entry, now)
                    admission.put(functools.partial(self._admit, entry, epoch),
                                  "text" if entry.params.structured is None else "structured")
                else:
                    ended = self._take(entry, epoch, None, entry.time_left_s)
                    if ended is not None:
                        refused.append(ended)
        return refused

    def _hold(self, eid: int, entry: Envelope, now: float) -> None:
        """(Under the submit lock) note ``entry`` as with the admission thread: its deadline runs from
        ``now`` (``time_left_s``, else the request's ``timeout_s``), while it waits there too."""
        left = entry.time_left_s if entry.time_left_s is not None else entry.params.timeout_s
        deadline_s = None if left is None else now + left
        self._admitting[eid] = deadline_s
        if deadline_s is not None:
            heap = self._admit_deadlines
            if len(heap) > 2 * len(self._admitting) + 64:  # mostly taken or ended ones: keep those still held
                heap[:] = [e for e in heap if e[1] in self._admitting]
                heapq.heapify(heap)
            heapq.heappush(heap, (deadline_s, eid))

    def _admit(self, entry: Envelope, epoch: int) -> bool:
        """(Admission thread) prepare ``entry`` outside the submit lock, then submit it with the time
        left to its deadline. One that ended meanwhile (cancelled, past its deadline: :meth:`cancel`,
        :meth:`_expire_admitting`), was abandoned or is of an older epoch (dropped: the broker was
        told) is not prepared, or not submitted; one whose deadline passed while it was prepared ends
        ``deadline``. True when an ending was posted to the outbox and the I/O thread must wake."""
        key = entry.request_id
        eid = key + (epoch << _EPOCH_SHIFT)
        if eid not in self._admitting:  # (a racy read: one that ends now is not submitted below)
            return False
        error = ids = None
        try:
            ids = self.engine.prepare(entry.params)
        except Exception as e:  # noqa: BLE001 -- the request's own refusal, as assign's
            error = e
        with self._submit_lock:
            if eid not in self._admitting or epoch != self._epoch:
                return False
            deadline_s = self._admitting.pop(eid)
            left_s = None if deadline_s is None else deadline_s - time.monotonic()
            if error is not None:
                ended = _refusal(key, error)
            elif left_s is not None and left_s <= 0:
                ended = Finished(key, FinishReason.DEADLINE)
            else:
                ended = self._take(entry, epoch, ids, left_s)
        return ended is not None and self._post((epoch, Iteration(finished=(ended,))))

    def _expire_admitting(self, now: float) -> tuple[int, Iteration] | None:
        """(Main thread) End ``deadline`` the requests the admission thread still holds whose deadline
        is at or before ``now`` (monotonic seconds): queued behind a slow one there, or slow
        themselves, they end at their deadline as in the engine, not when that thread reaches them
        (it then drops them). The iteration that says so, or None."""
        ended = []
        with self._submit_lock:
            heap, admitting, base = self._admit_deadlines, self._admitting, self._epoch << _EPOCH_SHIFT
            while heap and heap[0][0] <= now:
                deadline_s, eid = heapq.heappop(heap)
                if admitting.get(eid) == deadline_s:  # (else taken, ended or dropped already)
                    del admitting[eid]
                    ended.append(Finished(eid - base, FinishReason.DEADLINE))
            epoch = self._epoch
        return (epoch, Iteration(finished=tuple(ended))) if ended else None

    def _take(self, entry: Envelope, epoch: int, prompt_ids: tuple[int, ...] | None,
              time_left_s: float | None) -> Finished | None:
        """(Under the submit lock) submit ``entry`` into the engine with ``time_left_s`` seconds to its
        deadline (None: the request's ``timeout_s``) and follow it; its refusal, or None."""
        key = entry.request_id
        live = _Live(key, key + (epoch << _EPOCH_SHIFT), self._done)
        try:
            live.handle = self.engine.submit(entry.params, live.on_end, on_token=live.tokens.append,
                                             on_text=live.texts.append if self.tokenizer is not None else None,
                                             request_id=live.eid, resume_tokens=entry.resume_tokens,
                                             time_left_s=time_left_s, prompt_ids=prompt_ids)
        except Exception as e:  # noqa: BLE001 -- e.g. a ValueError, QueueFullError, a tokenizer failure
            return _refusal(key, e)
        self._live[live.eid] = live
        if not entry.params.is_token_prompt:
            self._unstarted.append(live)
        if entry.params.logprobs is not None or entry.params.prompt_logprobs is not None:
            self._scored.append(live)
        return None

    def cancel(self, keys: list[int]) -> list[Finished]:
        """Cancel the requests of broker keys ``keys`` in the engine; those the admission thread still
        holds end ``cancelled`` at once (their endings are returned, for the I/O thread to send: the
        thread then drops them unprepared); unknown keys: nothing."""
        base = self._epoch << _EPOCH_SHIFT
        ended, eids = [], []
        with self._submit_lock:
            for key in keys:
                if type(key) is not int:
                    continue
                if key + base in self._admitting:
                    del self._admitting[key + base]
                    ended.append(Finished(key, FinishReason.CANCELLED))
                else:
                    eids.append(key + base)
        for eid in eids:
            self.engine.cancel(eid)
        return ended

    def holds(self, key) -> bool:
        """Whether broker key ``key`` names a request in the engine now."""
        if type(key) is not int:
            return False
        eid = key + (self._epoch << _EPOCH_SHIFT)
        return eid in self._live or eid in self._admitting

    def abandon(self, keys: list) -> None:
        """End these requests here without reporting their end (the broker was
        told already): cancel them, drop their output."""
        base = self._epoch << _EPOCH_SHIFT
        with self._submit_lock:
            lives = [self._live.get(k + base) for k in keys if type(k) is int]
            for k in keys:  # (still with the admission thread: dropped there)
                if type(k) is int:
                    self._admitting.pop(k + base, None)
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
            self._admitting.clear()  # (the admission thread drops what it still holds: an older epoch)
            self._admit_deadlines.clear()
            lives = list(self._live.values())
            for live in lives:
                live.stale = True
        for live in lives:
            self.engine.cancel(live.eid)


def error_words(err: BaseException) -> str:
    """The message a ``finished`` record carries for ``err``: its own words when it is one of
    slotserve's errors, whose ``code`` (an :class:`ErrorCode`, sent beside it) already says its kind
    (``model_error`` with "model failed: RuntimeError: ...", not "ModelError: model failed: ..."),
    else its type's name first, the only clue to what failed (``KeyError: 'x'``)."""
    if error_code(err, None) is not None:
        return str(err)
    return f"{type(err).__name__}: {err}"


def _load_failure(model: str, err: BaseException) -> str:
    """What clients read of a failed load of ``model`` (its served name) that raised ``err`` (from
    :func:`worker.models.load_model`, any exception): a short cause in slotserve's words -- never
    ``err``'s text, which names the server's paths and speaks a library's internals (the log has it:
    :class:`~worker.errors.ModelLoadError`'s message) -- chosen by ``err``'s type: a
    :class:`~worker.errors.ModelFileError` (a file missing, unreadable, cut short, corrupt or not a
    model's, where the loader found it so) or an ``OSError`` (a file the system would not give):
    its files (or the ModelFileError's own ``cause``, a fault said without a path: weights that do not
    fit config.json); any other ``ValueError`` (a configuration transformers' or slotserve's checks
    refuse, options that do not fit it; transformers' validators, which wrap one): its configuration;
    else an unexpected error. Returns one line, ``"model 'x' failed to load: <cause>"``; raises nothing."""
    if isinstance(err, ModelFileError) and err.cause:
        cause = err.cause
    elif isinstance(err, (ModelFileError, OSError)):
        cause = "its files could not be read (missing, unreadable, cut short or not a model's)"
    elif isinstance(err, ValueError) or isinstance(err.__cause__, ValueError):  # (transformers' validators wrap one)
        cause = "its configuration is not valid (or the server's options for it do not fit it)"
    else:
        cause = "an unexpected error"
    return f"model {model!r} failed to load: {cause}"


def _refusal(key: int, err: BaseException) -> Finished:
    """The ending of broker key ``key``'s request that the engine refused with ``err``: a ValueError's
    code is ``bad_request`` (or its own: unsupported, duplicate), any other's ``internal``."""
    if isinstance(err, ValueError):
        return Finished(key, FinishReason.ERROR, error_code(err, ErrorCode.BAD_REQUEST), str(err))
    return Finished(key, FinishReason.ERROR, error_code(err, ErrorCode.INTERNAL), error_words(err))


def _finished(key: int, handle) -> Finished:
    """The ``finished`` record of broker key ``key``'s ended request (an error
    ending carries its error's code, else ``internal``)."""
    reason = handle.finish_reason
    code = message = None
    if reason is FinishReason.ERROR:
        err = handle.error
        code = error_code(err, ErrorCode.INTERNAL)
        message = error_words(err) if err is not None else "failed"
    return Finished(key, reason, code, message, handle.prompt_tokens, handle.stop_reason, handle.cached_tokens)


def run_worker(config: WorkerConfig, *, stop: threading.Event | None = None, model=None) -> None:
    """Run a worker until ``stop`` is set (forever when None).

    Loads ``config.model`` unless ``model`` is given. Raises ValueError when
    the model cannot be loaded.
    """
    WorkerProcess(config, model).run(stop or threading.Event())


def runs_of(model) -> str:
    """What ``model`` runs as, for ``ModelInfo.runs``: slotserve's runner gives its precision and
    linear kinds, then its KV cache's element type (``"gguf: Q4_K x 169, Q6_K x 29 (compiled kernel,
    AMX-BF16); KV cache fp16"``), an embedding model its own ``runs`` (``"fp32: transformers BertModel, mean pooling, normalised"``); ``""`` otherwise."""
    weights = getattr(model, "weights", None)
    if weights is None or not hasattr(weights, "linear_kind"):
        runs = getattr(model, "runs", "") if getattr(model, "embedding_size", None) is not None else ""
        return runs[:200] if isinstance(runs, str) else ""
    from worker.models.llama import kv_dtype_name

    kv = kv_dtype_name(model.kv_dtype) if getattr(model, "kv_dtype", None) is not None else ""
    return (f"{weights.precision}: {weights.linear_kind}"[:180] + (f"; KV cache {kv}" if kv else ""))[:200]
