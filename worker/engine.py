"""BatchInferenceEngine: the batched slot loop (continuous, iteration-level batching).

Each iteration (:meth:`BatchInferenceEngine.step`): end requests that were
cancelled or passed their deadline, admit queued requests into free slots,
call the model once for every occupied slot, append one token per slot,
check termination (stop token, then stop sequences, then ``max_tokens``),
run callbacks, free slots. See DESIGN.md, "The in-process engine".

Cost per token is kept near the floor of CPython: the batch lists are
persistent (:class:`~worker.slots.SlotTable`), one ``map`` appends every
token, one C-level scan checks the stop tokens, ``max_tokens`` is found by
bucketing requests by the iteration in which they reach it, and only
requests that stream or have stop sequences are visited one by one. The
lock is taken a constant number of times per iteration, never per token,
and once per submission; a plain ``submit_request(prompt, n, callback)``
takes a short path (see there).

Threads: ``submit_request``, ``cancel`` and ``wait_for_work`` may be called
from any thread, and from callbacks. ``step``/``run`` run on one thread at a
time; callbacks run on that thread, outside the engine lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from protocol.validation import (token_id_set, validate_plain_request, validate_request,
                                 validate_stop_token)
from worker.callbacks import complete, stream_tokens
from worker.errors import ModelError
from worker.models.base import SlotModel
from worker.request import (ENGINE_DEFAULT, Completion, Request, RequestHandle, submit_options,
                            submit_signature)
from worker.scheduler import DEFAULT_AGING_WINDOW, InFlight, Policy
from worker.slots import SlotTable

log = logging.getLogger(__name__)
_ints_only = frozenset((int,)).issuperset  # every item of the iterable is an int (the usual step)


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
        self._token_ids = token_id_set(self._vocab_size)  # faster prompt checks
        if isinstance(stop_token, str) and stop_token == "model":
            stop_token = getattr(model, "eos_token_ids", None)
            if stop_token is None:
                raise ValueError('stop_token="model" needs a model with eos_token_ids')
        self.stop_tokens = validate_stop_token(stop_token, vocab_size=self._vocab_size)
        self.batch_size = batch_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self._work = threading.Condition(self._lock)  # signalled on submit and cancel
        self._waiting = 0  # threads in wait_for_work (skip notify when none)
        self._book = InFlight(aging_window, max_queue)  # guarded by _lock
        # Aliases of the ledger's parts, read racily by the loop (a miss is seen next iteration).
        self._queue, self._pending, self._deadline_heap = (
            self._book.queue, self._book.pending, self._book.deadlines.heap)
        self._clock = clock
        self._active = False  # step() or run() in progress
        # Owned by the thread running step()/run(); no lock needed.
        self._slots = SlotTable(batch_size, self._slot_aware, self.stop_tokens)
        self._completion = Completion()
        if self._slot_aware:
            model.bind_slots(batch_size)

    # ---- public, any thread -------------------------------------------------

    def submit_request(self, prompt, max_tokens, callback: Callable[[list[int]], object] | None = None,
                       **options) -> RequestHandle:
        """Queue one request; return its :class:`~worker.request.RequestHandle`.

        Keyword options (defaults): ``stop_token`` (the engine's),
        ``stop_sequences=()``, ``on_token=None``, ``priority=0``,
        ``timeout_s=None``, ``request_id=None``, ``temperature=0.0``,
        ``top_p=1.0``, ``top_k=0``, ``seed=None``, ``resume_tokens=()``; their
        rules: :func:`protocol.validation.validate_request`.
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
        # Options come as **options: CPython fills each omitted keyword-only parameter
        # with a dict lookup, and the plain submit_request(prompt, n, callback) is the
        # per-request hot path (the else branch). submit_options() checks the names.
        if options:
            (stop_token, stop_sequences, on_token, priority, timeout_s, request_id, temperature,
             top_p, top_k, seed, resume_tokens) = submit_options(**options)
            v = validate_request(  # by position: keywords cost a name match each
                prompt, max_tokens, stop_token, stop_token is ENGINE_DEFAULT, stop_sequences,
                priority, timeout_s, request_id, temperature, top_p, top_k, seed,
                resume_tokens, self._vocab_size, self._max_seq_len, self._token_ids)
            req = Request(v, self.stop_tokens, callback, on_token, self._completion)
            if v.timeout_s is not None:
                req.deadline = self._clock() + v.timeout_s
        else:
            p, n = validate_plain_request(prompt, max_tokens, self._vocab_size,
                                          self._max_seq_len, self._token_ids)
            req = Request.plain(p, n, self.stop_tokens, callback, self._completion)
        self._acquire()  # (acquire/release: half the cost of `with` on this per-request path)
        try:
            self._book.add(req)
            if self._waiting:
                self._work.notify_all()
        finally:
            self._release()
        return req  # a Request is its own RequestHandle

    def cancel(self, request_id) -> bool:
        """End a queued or running request as ``"cancelled"``; thread-safe.

        Returns True when it was queued or running (it then ends as cancelled
        at the start of the next iteration; its callback fires once with the
        tokens so far), False when it is unknown or already finished -- also
        when it finished in the iteration that is delivering its callbacks.
        """
        with self._lock:
            if not self._book.cancel(request_id):
                return False
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
            while self._iterate() or self._has_work():
                pass
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
        slots = self._slots
        if self._pending or self._deadline_heap:  # racy reads: a miss is seen next iteration
            self._end_early()
        if slots.free and len(self._queue):
            self._admit()
        batch = slots.batch
        if not batch:
            return 0
        try:
            tokens = self.model.step(batch) if self._slot_aware else self.model.next_tokens(batch)
            if len(tokens) != len(batch):
                raise ModelError(f"model returned {len(tokens)} tokens for {len(batch)} sequences")
        except Exception as exc:  # the model failing ends this batch, not the engine
            self._fail_batch(exc)
            return 0
        skipped = None
        if self._slot_aware and not _ints_only(map(type, tokens)):  # (a C-level scan)
            finished, skipped, failed = slots.append_some(tokens)
            if failed:
                with self._lock:
                    for req, exc in failed:
                        self._book.row_failed(req, exc)
        else:
            finished = slots.append(tokens)
        if finished:
            self._acquire()
            try:  # final from here: a later cancel returns False
                finished = self._book.commit(finished)
            finally:
                self._release()
        if slots.streaming:
            streaming = slots.streaming if not skipped else [r for r in slots.streaming if r not in skipped]
            for req, exc in stream_tokens(streaming):
                with self._lock:
                    self._book.stream_failed(req, exc)
        if finished:
            self._finish(finished)
        return len(tokens) if skipped is None else len(tokens) - len(skipped)

    # ---- helpers -----------------------------------------------------------

    def _begin(self) -> None:
        with self._lock:
            if self._active:
                raise RuntimeError("the engine is already running (step/run called from a "
                                   "callback or a second thread); call it from one loop only")
            self._active = True

    def _has_work(self) -> bool:
        return bool(len(self._queue) or self._slots.reqs or self._pending)

    def _admit(self) -> None:
        slots = self._slots
        n = self.policy.admissible(len(slots.free), len(slots.reqs))
        if n:
            with self._lock:
                new = self._book.admit(n)
            slots.occupy(new)

    def _end_early(self) -> None:
        """Carry out cancels, deadlines and failed streams: callbacks, then free slots."""
        with self._lock:
            ended = self._book.take_ended(self._clock)
        self._finish(ended)

    def _finish(self, ended: list[Request]) -> None:
        """Run the callbacks of FINISHED requests, then free the slots of those that had one."""
        complete(ended, self._completion)
        freed = [req.slot for req in ended if req.slot is not None] if self._slot_aware else ()
        self._slots.vacate(ended)
        for slot in freed:
            try:
                self.model.release_slot(slot)
            except Exception:
                log.exception("model.release_slot(%d) raised", slot)

    def _fail_batch(self, exc: Exception) -> None:
        """The model raised: every running request ends with ``"error"``."""
        with self._lock:
            err = self._book.fail(self._slots.reqs, exc)
        log.error("model call failed; ending %d requests", len(self._slots.reqs), exc_info=err)
        self._end_early()


# submit_request takes **options (see there); help() and inspect show the documented signature.
BatchInferenceEngine.submit_request.__signature__ = submit_signature(  # type: ignore[attr-defined]
    BatchInferenceEngine.submit_request)


def _optional_positive_int(model, name: str) -> int | None:
    value = getattr(model, name, None)
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"model.{name} must be None or an int >= 1, got {value!r}")
    return value
