"""BatchInferenceEngine: the batched slot loop (continuous, iteration-level batching).

Each iteration (:meth:`BatchInferenceEngine.step`): end requests that were
cancelled or passed their deadline, admit queued requests into free slots,
call the model once for every occupied slot, append one token per slot,
check termination (stop token, then stop sequences, then ``max_tokens``),
run callbacks, free slots. See DESIGN.md, "The in-process engine".

Cost per token is kept near the floor of CPython: the batch lists are
persistent (:class:`~worker.slots.SlotTable`), one ``map`` appends every
token, stop tokens are checked for the whole batch with one set
operation, ``max_tokens`` is found by bucketing requests by the iteration in
which they reach it, and only requests that stream (``on_token``) or have
stop sequences are visited one by one. The lock is taken a constant number
of times per iteration, never per token.

Threads: ``submit_request``, ``cancel`` and ``wait_for_work`` may be called
from any thread, and from callbacks. ``step``/``run`` run on one thread at a
time; callbacks run on that thread, outside the engine lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

from protocol.enums import FinishReason
from protocol.validation import validate_request, validate_stop_token
from worker.callbacks import complete, stream_tokens
from worker.errors import DuplicateRequestError, ModelError, QueueFullError
from worker.models.base import SlotModel
from worker.request import Completion, Request, RequestHandle, RequestState
from worker.scheduler import DEFAULT_AGING_WINDOW, Deadlines, Policy, RequestQueue
from worker.slots import SlotTable

log = logging.getLogger(__name__)

QUEUED, RUNNING, ENDING, FINISHED = (RequestState.QUEUED, RequestState.RUNNING,
                                     RequestState.ENDING, RequestState.FINISHED)


class _EngineDefault:
    """Marker for "stop_token not given": use the engine's default (None means *no* stop token)."""

    def __repr__(self) -> str:
        return "<engine default>"


ENGINE_DEFAULT = _EngineDefault()


class BatchInferenceEngine:
    """Runs many generation requests through one model, ``batch_size`` slots at a time.

    - ``model``: a stateless model (``next_tokens(sequences) -> tokens``) or a
      slot-aware :class:`~worker.models.base.SlotModel`; see
      :mod:`worker.models.base`. Its optional ``vocab_size``/``max_seq_len``
      bound what requests may ask for.
    - ``batch_size``: number of slots (int >= 1).
    - ``stop_token``: the requests' default stop token(s): an int, a sequence
      of ints, None (no stop token) or ``"model"`` (the model's ``eos_token_ids``).
    - ``policy``: ``"continuous"`` (refill free slots every iteration) or
      ``"static"`` (admit only when all slots are free); see :class:`~worker.scheduler.Policy`.
    - ``max_queue``: bound on queued (not yet running) requests, or None.
    - ``aging_window``: priority aging, in submissions per priority level; see
      :mod:`worker.scheduler` for the starvation bound.
    - ``clock``: seconds, monotonic; deadlines (``timeout_s``) are measured on
      it. Tests pass a fake one; leave the default otherwise.

    Raises ValueError for bad arguments.
    """

    def __init__(self, model, batch_size: int, stop_token=None, *,
                 policy: str | Policy = "continuous", max_queue: int | None = None,
                 aging_window: int = DEFAULT_AGING_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if max_queue is not None and (type(max_queue) is not int or max_queue < 1):
            raise ValueError(f"max_queue must be None or an int >= 1, got {max_queue!r}")
        self._slot_aware = isinstance(model, SlotModel)
        if not self._slot_aware and not callable(getattr(model, "next_tokens", None)):
            raise ValueError("model must have next_tokens(sequences) or bind_slots/step/release_slot")
        try:
            self.policy = Policy(policy)
        except ValueError:
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}") from None
        self.model = model
        self._vocab_size = _optional_positive_int(model, "vocab_size")
        self._max_seq_len = _optional_positive_int(model, "max_seq_len")
        if isinstance(stop_token, str) and stop_token == "model":
            stop_token = getattr(model, "eos_token_ids", None)
            if stop_token is None:
                raise ValueError('stop_token="model" needs a model with eos_token_ids')
        self.stop_tokens = validate_stop_token(stop_token, vocab_size=self._vocab_size)
        self.batch_size = batch_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # signalled on submit and cancel
        self._waiting = 0  # threads in wait_for_work (skip notify when none)
        self._queue = RequestQueue(aging_window)  # guarded by _lock
        self._in_flight: dict[object, Request] = {}  # queued, running or ending; by id
        self._pending: list[tuple[Request, FinishReason, BaseException | None]] = []
        self._deadlines = Deadlines()
        self._ids = itertools.count()
        self._clock = clock
        self._active = False  # step() or run() in progress
        # Owned by the thread running step()/run(); no lock needed.
        self._slots = SlotTable(batch_size, self._slot_aware)
        self._completion = Completion()
        if self._slot_aware:
            model.bind_slots(batch_size)

    # ---- public, any thread -------------------------------------------------

    def submit_request(self, prompt, max_tokens, callback: Callable[[list[int]], object] | None = None,
                       *, stop_token=ENGINE_DEFAULT, stop_sequences=(),
                       on_token: Callable[[int], object] | None = None, priority=0,
                       timeout_s=None, request_id=None, temperature=0.0, top_p=1.0,
                       top_k=0, seed=None, resume_tokens=()) -> RequestHandle:
        """Queue one request; return its :class:`~worker.request.RequestHandle`.

        Fields and their rules: :func:`protocol.validation.validate_request`.
        ``callback(seq)`` runs exactly once at the end (``seq`` = prompt +
        generated tokens, whatever the ``finish_reason``); ``on_token(token)``
        runs for each new token, in order, before it. ``resume_tokens``: tokens
        generated for this request elsewhere -- they count toward
        ``max_tokens`` and stop-sequence matching, appear in ``seq``, and are
        not passed to ``on_token`` again. ``timeout_s`` counts from now.
        Sampling parameters reach slot-aware models (``SlotInput.sampling``);
        a stateless model picks its tokens itself.

        Raises ValueError on bad input, DuplicateRequestError (a ValueError)
        when ``request_id`` is in flight, QueueFullError at ``max_queue``; in
        every case nothing is queued.
        """
        v = validate_request(
            prompt, max_tokens, stop_token=stop_token,
            use_default_stop=stop_token is ENGINE_DEFAULT, stop_sequences=stop_sequences,
            priority=priority, timeout_s=timeout_s, request_id=request_id,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            resume_tokens=resume_tokens, vocab_size=self._vocab_size,
            max_seq_len=self._max_seq_len)
        req = Request(v, self.stop_tokens, callback, on_token)
        if v.timeout_s is not None:
            req.deadline = self._clock() + v.timeout_s
        with self._lock:
            self._enqueue(req)
        return RequestHandle(req, self._completion)

    def cancel(self, request_id) -> bool:
        """End a queued or running request as ``"cancelled"``; thread-safe.

        Returns True when it was queued or running (it then ends as cancelled
        at the start of the next iteration; its callback fires once with the
        tokens so far), False when it is unknown or already finished -- also
        when it finished in the iteration that is delivering its callbacks.
        """
        with self._lock:
            req = self._in_flight.get(request_id)
            if req is None or req.state is not QUEUED and req.state is not RUNNING:
                return False
            if req.state is QUEUED:
                self._queue.discard(req)
            req.state = ENDING
            self._pending.append((req, FinishReason.CANCELLED, None))
            if self._waiting:
                self._work.notify_all()
        return True

    def wait_for_work(self, timeout_s: float | None) -> bool:
        """Block (no spinning) until a request is queued, running or ending, or
        ``timeout_s`` seconds pass; return whether there is work. Thread-safe."""
        with self._work:
            self._waiting += 1
            try:
                return self._work.wait_for(self._has_work, timeout_s)
            finally:
                self._waiting -= 1

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._slots.reqs)

    @property
    def num_free_slots(self) -> int:
        return len(self._slots.free)

    # ---- the loop (one thread at a time) -----------------------------------

    def run(self) -> None:
        """Step until the queue is empty and every slot is free.

        Raises RuntimeError when called while ``step``/``run`` is executing
        (from a callback or another thread).
        """
        self._begin()
        try:
            while self._has_work():
                self._iterate()
        finally:
            self._active = False

    def step(self) -> int:
        """Run one iteration; return the number of tokens generated (0 when idle).

        Raises RuntimeError when called while ``step``/``run`` is executing.
        """
        self._begin()
        try:
            return self._iterate()
        finally:
            self._active = False

    def _iterate(self) -> int:
        if self._pending or self._deadlines:  # racy reads: a miss is seen next iteration
            self._end_early()
        self._admit()
        batch = self._slots.batch
        if not batch:
            return 0
        try:
            tokens = self.model.step(batch) if self._slot_aware else self.model.next_tokens(batch)
            if len(tokens) != len(batch):
                raise ModelError(f"model returned {len(tokens)} tokens for {len(batch)} sequences")
        except Exception as exc:  # the model failing ends this batch, not the engine
            self._fail_batch(exc)
            return 0
        finished = self._slots.append(tokens)
        if finished:
            finished = self._commit(finished)
        if self._slots.streaming:
            for req, exc in stream_tokens(self._slots.streaming):
                self._stream_failed(req, exc)
        complete(finished, self._completion)
        for req in finished:
            self._vacate(req)
        return len(tokens)

    # ---- helpers -----------------------------------------------------------

    def _begin(self) -> None:
        with self._lock:
            if self._active:
                raise RuntimeError("the engine is already running (step/run called from a "
                                   "callback or a second thread); call it from one loop only")
            self._active = True

    def _has_work(self) -> bool:
        return bool(len(self._queue) or self._slots.reqs or self._pending)

    def _enqueue(self, req: Request) -> None:
        """Under the lock: give ``req`` an id, check admission, queue it."""
        rid = req.request_id
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while rid in self._in_flight:
                rid = f"req-{next(self._ids)}"
            req.request_id = rid
        elif rid in self._in_flight:
            raise DuplicateRequestError(f"request_id {rid!r} is already queued or running; "
                                        "use a new id, or cancel the old request first")
        if self.max_queue is not None and len(self._queue) >= self.max_queue:
            raise QueueFullError(f"queue is full ({self.max_queue} requests waiting); retry later")
        self._in_flight[rid] = req
        self._queue.push(req)
        if req.deadline is not None:
            self._deadlines.add(req)
        if self._waiting:
            self._work.notify_all()

    def _admit(self) -> None:
        slots = self._slots
        n = self.policy.admissible(len(slots.free), len(slots.reqs))
        if not n or not len(self._queue):
            return
        with self._lock:
            new = self._queue.pop(n)
            for req in new:
                req.state = RUNNING
        for req in new:
            slots.occupy(req)

    def _commit(self, finished: list[Request]) -> list[Request]:
        """Under the lock, make this iteration's finishes final (a later cancel returns False).

        A request cancelled while the model ran ends as cancelled instead
        (its cancel already returned True); drop it here.
        """
        with self._lock:
            out = []
            for req in finished:
                if req.state is RUNNING:
                    req.state = FINISHED
                    del self._in_flight[req.request_id]
                    out.append(req)
                else:
                    req.reason = None
        return out

    def _end_early(self) -> None:
        """Carry out cancels, deadlines and failed streams: callbacks, then free slots."""
        ended = []
        with self._lock:
            if self._deadlines:
                for req in self._deadlines.expired(self._clock(), len(self._in_flight)):
                    if req.state is QUEUED:
                        self._queue.discard(req)
                    self._pending.append((req, FinishReason.DEADLINE, None))
            for req, reason, error in self._pending:
                if req.state is not FINISHED:
                    req.state, req.reason = FINISHED, reason
                    if req.error is None:
                        req.error = error
                    del self._in_flight[req.request_id]
                    ended.append(req)
            self._pending.clear()
        complete(ended, self._completion)
        for req in ended:
            if req.slot is not None:
                self._vacate(req)

    def _fail_batch(self, exc: Exception) -> None:
        """The model raised: every running request ends with ``"error"``."""
        if not isinstance(exc, ModelError):
            err = ModelError(f"model failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            exc = err
        log.error("model call failed; ending %d requests", len(self._slots.reqs), exc_info=exc)
        with self._lock:
            for req in self._slots.reqs:
                if req.state is RUNNING:  # a cancelled one stays cancelled (cancel said so)
                    self._pending.append((req, FinishReason.ERROR, exc))
        self._end_early()

    def _stream_failed(self, req: Request, exc: Exception) -> None:
        """``on_token`` raised: the request ends with ``"error"`` (at once if it just finished)."""
        with self._lock:
            if req.state is RUNNING:
                req.state = ENDING
                self._pending.append((req, FinishReason.ERROR, exc))
            elif req.state is FINISHED:
                req.reason = FinishReason.ERROR
            if req.error is None:
                req.error = exc

    def _vacate(self, req: Request) -> None:
        """Free ``req``'s slot and forget its per-iteration bookkeeping."""
        slot = self._slots.vacate(req)
        if self._slot_aware:
            try:
                self.model.release_slot(slot)
            except Exception:
                log.exception("model.release_slot(%d) raised", slot)


def _optional_positive_int(model, name: str) -> int | None:
    value = getattr(model, name, None)
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"model.{name} must be None or an int >= 1, got {value!r}")
    return value
