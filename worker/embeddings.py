"""EmbeddingEngine: embedding requests through an embedding model, a batch per step.

An embedding is one prefill with a pooling step and no decode (docs/architecture.md, "Models on
demand"): a request takes a slot for one step. Each :meth:`EmbeddingEngine.step` ends the
requests that were cancelled or passed their deadline, takes up to ``batch_size`` queued requests
(FIFO: the broker already ordered them by priority), embeds them in one call of the model
(:meth:`~worker.models.embedder.EmbeddingModel.embed`, which sorts them by length and pads per
forward), and ends each ``stop`` with its vector on the handle (``embedding_bytes``), then runs the
callbacks. The model raising ends that step's requests ``error`` (``model_error``), not the engine.

Its surface is the one :class:`~worker.process.WorkerProcess` drives of
:class:`~worker.engine.BatchInferenceEngine` (``submit``, ``cancel``, ``wait_for_work``, ``step``,
``stop_tokens``), so a worker serves an embedding model through the same broker, queues and credits
as a generation model. Generation requests (``kind`` generate) are refused at submission with
:class:`~protocol.errors.UnsupportedError` (``unsupported`` on the wire), as a generation engine
refuses embedding requests.

Threads: ``submit``, ``submit_request``, ``cancel`` and ``wait_for_work`` from any thread; ``step``
and ``run`` from one thread at a time, which runs the callbacks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable

from protocol.enums import FinishReason, RequestKind
from protocol.errors import UnsupportedError
from protocol.handle import RequestHandle
from protocol.request import ModelLimits, RequestParams, check_request_id
from protocol.validation import as_tokens, check_callbacks
from protocol.waits import Event, condition
from worker.errors import DuplicateRequestError, ModelError

log = logging.getLogger(__name__)


class EmbeddingRequest(RequestHandle):
    """One embedding request in the engine, and its handle (:class:`protocol.handle.RequestHandle`):
    ``embedding`` / ``embedding_bytes`` once it ended ``stop``; ``prompt`` its token ids; no tokens."""

    __slots__ = ("prompt_ids", "callback", "deadline_s", "ending", "_event")

    def __init__(self, request_id, params: RequestParams, prompt_ids: tuple[int, ...], callback, now: float,
                 deadline_s: float | None) -> None:
        super().__init__(request_id, params, now, len(prompt_ids))
        self.prompt_ids = prompt_ids
        self.callback = callback
        self.deadline_s = deadline_s
        self.ending: FinishReason | None = None  # cancelled: carried out at the next step
        self._event = Event()  # (result() waits on it: protocol.waits)

    @property
    def prompt(self) -> list[int]:
        return list(self.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        return []

    @property
    def text(self) -> str | None:
        return None

    def _wait(self, timeout: float | None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not done after {timeout} s")


class EmbeddingEngine:
    """Runs embedding requests through ``model`` (an :class:`~worker.models.embedder.EmbeddingModel`,
    or any object with ``embed(prompts) -> list[bytes]``, ``embedding_size``, and optionally
    ``vocab_size``, ``max_seq_len``, ``tokenizer`` / ``tokenize(text)``), ``batch_size`` requests a
    step. ``clock``: seconds, monotonic (deadlines, timings). ValueError for a bad ``batch_size``."""

    def __init__(self, model, batch_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not callable(getattr(model, "embed", None)):
            raise ValueError("model must have embed(prompts) -> list of float32 bytes")
        self.model = model
        self.batch_size = batch_size
        self.stop_tokens: frozenset[int] = frozenset()  # (no token is generated)
        self._tokenize = getattr(model, "tokenize", None) if getattr(model, "tokenizer", None) is not None else None
        self._limits = ModelLimits(getattr(model, "vocab_size", None), getattr(model, "max_seq_len", None),
                                   self._tokenize is not None, embeds=True)
        self._clock = clock
        # (an RLock: a caller's wait that a signal's exception cuts short takes no other thread's lock: protocol.waits)
        self._lock = threading.RLock()
        self._work = condition(self._lock)
        self._queue: deque[EmbeddingRequest] = deque()      # guarded by _lock
        self._live: dict[object, EmbeddingRequest] = {}     # queued or running, by id; guarded by _lock
        self._ids = itertools.count()
        self._active = False

    # ---- any thread

    def submit_request(self, prompt, callback: Callable[[list[int]], object] | None = None, *, request_id=None,
                       **options) -> EmbeddingRequest:
        """Queue the embedding of ``prompt`` (token ids, or text for a model with a tokenizer); return
        its handle. ``options``: ``priority``, ``timeout_s`` (the fields an embedding request takes,
        :class:`~protocol.request.RequestParams`). ``callback(prompt ids)`` runs once at the end.
        Raises as :meth:`submit`."""
        return self.submit(RequestParams(prompt, 1, kind=RequestKind.EMBED, **options), callback,
                           request_id=request_id)

    def submit(self, params: RequestParams, callback: Callable[[list[int]], object] | None = None, *,
               on_token: Callable | None = None, on_text: Callable | None = None, request_id=None,
               resume_tokens=(), time_left_s: float | None = None,
               prompt_ids: tuple[int, ...] | None = None) -> EmbeddingRequest:
        """Queue a request built already. ``on_token`` / ``on_text`` are accepted and never called (an
        embedding has no token); ``time_left_s`` replaces ``params.timeout_s`` (seconds from now);
        ``prompt_ids``: a text prompt's ids as :meth:`prepare` returned them.

        Raises :class:`~protocol.errors.UnsupportedError` for a generation request (or text for a
        model without a tokenizer), :class:`~protocol.errors.ContextLengthError` for a prompt over
        ``max_seq_len``, DuplicateRequestError for a ``request_id`` in flight, ValueError for other
        bad input; nothing is queued then."""
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a RequestParams, got {type(params).__name__}")
        check_callbacks(callback=callback, on_token=on_token, on_text=on_text)
        if params.kind != RequestKind.EMBED:
            self._limits.check(params)  # (says so: UnsupportedError)
        if resume_tokens:
            raise ValueError("resume_tokens: an embedding request has no tokens to resume")
        prompt = params.prompt
        if type(prompt) is str:
            prompt = self.prepare(params) if prompt_ids is None else prompt_ids
        self._limits.check(params, len(prompt))
        rid = None if request_id is None else check_request_id(request_id)
        timeout_s = params.timeout_s if time_left_s is None else time_left_s
        now = self._clock()
        with self._lock:
            if rid is None:
                rid = next(self._ids)
                while rid in self._live:
                    rid = next(self._ids)
            elif rid in self._live:
                raise DuplicateRequestError(f"request_id {rid!r} is already queued or running")
            req = EmbeddingRequest(rid, params, prompt, callback, now, None if timeout_s is None else now + timeout_s)
            self._live[rid] = req
            self._queue.append(req)
            self._work.notify_all()
        return req

    def needs_preparing(self, params: RequestParams) -> bool:
        """Whether :meth:`prepare` has work to do (a text prompt to tokenise: time that grows with
        the text, which the worker's I/O thread leaves to another)."""
        return type(params.prompt) is str

    def prepare(self, params: RequestParams) -> tuple[int, ...] | None:
        """A text prompt's token ids (None for token ids), on any thread, queueing nothing; raises
        UnsupportedError without a tokenizer, ValueError for a text that tokenises to nothing."""
        if type(params.prompt) is not str:
            return None
        if self._tokenize is None:
            raise UnsupportedError("this model has no tokenizer: send the prompt as token ids, not text")
        return as_tokens(self._tokenize(params.prompt), "the tokenised prompt", allow_empty=False)

    def cancel(self, request_id) -> bool:
        """End a queued request as ``cancelled`` at the next step; False when unknown or ended.
        ValueError for what can be no request's id (:func:`~protocol.request.check_request_id`)."""
        request_id = check_request_id(request_id)
        with self._lock:
            req = self._live.get(request_id)
            if req is None or req.ending is not None:
                return False
            req.ending = FinishReason.CANCELLED
            self._work.notify_all()
        return True

    def wait_for_work(self, timeout_s: float | None) -> bool:
        """Block until a request is queued or ``timeout_s`` seconds pass; return whether one is."""
        with self._work:
            return self._work.wait_for(lambda: bool(self._queue), timeout_s)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return 0  # (between steps: a step's requests end within it)

    @property
    def num_free_slots(self) -> int:
        return self.batch_size

    # ---- one thread

    def run(self) -> None:
        """Step until the queue is empty."""
        while self._queue:
            self.step()

    def step(self) -> int:
        """Embed up to ``batch_size`` queued requests (ending the cancelled and the overdue among
        them); return how many were embedded. RuntimeError when called while a step runs."""
        with self._lock:
            if self._active:
                raise RuntimeError("the engine is already running (step/run called from a callback or a "
                                   "second thread); call it from one loop only")
            self._active = True
            batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
        try:
            now = self._clock()
            ended, todo = [], []
            for req in batch:
                if req.ending is None and req.deadline_s is not None and now >= req.deadline_s:
                    req.ending = FinishReason.DEADLINE
                (ended if req.ending is not None else todo).append(req)
            if todo:
                try:
                    vectors = self.model.embed([r.prompt_ids for r in todo])
                    if len(vectors) != len(todo):
                        raise ModelError(f"model returned {len(vectors)} embeddings for {len(todo)} prompts")
                except Exception as exc:  # the model failing ends this step's requests, not the engine
                    log.error("embedding step failed; ending %d requests", len(todo), exc_info=exc)
                    error = exc if isinstance(exc, ModelError) else ModelError(f"{type(exc).__name__}: {exc}")
                    for req in todo:
                        req.ending, req._error = FinishReason.ERROR, error
                else:
                    for req, vector in zip(todo, vectors):
                        req.embedding_bytes, req.ending = vector, FinishReason.STOP
            self._finish(batch)
            return len(todo)
        finally:
            self._active = False

    def _finish(self, reqs: list[EmbeddingRequest]) -> None:
        """Record each ending (``req.ending``), then run the callbacks; a raising callback is the request's error."""
        now = self._clock()
        with self._lock:
            for req in reqs:
                self._live.pop(req.request_id, None)
                req.first_token_s = now if req.ending is FinishReason.STOP else None
                req._end(req.ending, None, req._error, now)
        for req in reqs:
            if req.callback is not None:
                try:
                    req.callback(list(req.prompt_ids))
                except Exception as exc:  # noqa: BLE001 -- recorded on its handle, as the generation engine does
                    log.warning("callback of request %r raised", req.request_id, exc_info=exc)
                    if req._error is None:
                        req._error = exc
            req._done = True
            req._event.set()
