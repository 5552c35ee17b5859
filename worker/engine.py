"""BatchInferenceEngine: the batched slot loop (continuous, iteration-level batching).

Each iteration (:meth:`BatchInferenceEngine.step`) is Orca's loop: end
requests that were cancelled or passed their deadline, admit queued requests
into free slots, plan the step (a slot-aware model: which slots decode, which
prompt chunks run within the model's ``prefill_budget``; :mod:`worker.planner`),
call the model once for every occupied slot, append one token per slot,
check termination (stop token, then stop sequences, then ``max_tokens``),
run callbacks, free slots. The model returns what it computed
(:class:`~worker.models.base.StepOutput`: no token for a prompt chunk that
does not end its prompt, several for a drafted slot, a failure for one slot);
several tokens are appended one iteration each, with the same checks, before
the next model call. See docs/architecture.md, "The in-process engine".

Cost per token is kept near the floor of CPython: the batch lists are
persistent (:class:`~worker.slots.SlotTable`), one ``map`` appends every
token, one C-level scan checks the stop tokens, ``max_tokens`` is found by
bucketing requests by the iteration in which they reach it, and only
requests that stream or have stop sequences are visited one by one. The
lock is taken a constant number of times per iteration, never per token,
and once per submission.

Threads: ``submit_request``, ``submit``, ``cancel`` and ``wait_for_work`` may
be called from any thread, and from callbacks. ``step``/``run`` run on one
thread at a time; callbacks run on that thread, outside the engine lock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from protocol.defaults import AGING_WINDOW
from protocol.request import DEFAULT, ModelLimits, RequestParams, check_request_id, check_stop_token
from protocol.validation import as_tokens, check_callbacks, check_vocab
from protocol.waits import condition
from worker.callbacks import complete, stream_text, stream_tokens
from protocol.errors import ContextLengthError, UnsupportedError
from worker.errors import ModelError
from worker.models.base import SlotModel
from worker.planner import NO_CHUNKS, plan_chunks
from worker.request import Completion, Request
from worker.scheduler import InFlight, Policy
from worker.slots import SlotTable
from worker.text import TextStream

log = logging.getLogger(__name__)
_NOBODY: frozenset = frozenset()  # no request was skipped (a stateless model's step)


class BatchInferenceEngine:
    """Runs many generation requests through one model, ``batch_size`` slots at a time.

    - ``model``: a stateless model (``next_tokens(sequences) -> tokens``) or a
      slot-aware :class:`~worker.models.base.SlotModel`; see
      :mod:`worker.models.base`. Its optional ``vocab_size``/``max_seq_len``
      bound what requests may ask for; with a ``tokenizer`` it takes text and
      chat prompts too.
    - ``batch_size``: number of slots (int >= 1).
    - ``stop_token``: the requests' default stop token(s): an int, a sequence
      of ints, None (no stop token) or ``"model"`` (the model's ``eos_token_ids``).
    - ``policy``: ``"continuous"`` (refill free slots every iteration) or
      ``"static"`` (admit only when all slots are free); see :class:`~worker.scheduler.Policy`.
    - ``max_queue``: bound on queued (not yet running) requests, or None.
    - ``aging_window``: priority aging, in submissions per priority level; see
      :mod:`protocol.queue` for the starvation bound.
    - ``clock``: seconds, monotonic; deadlines (``timeout_s``) and the handles'
      timings are measured on it. Tests pass a fake one; leave the default otherwise.

    Raises ValueError for bad arguments.
    """

    def __init__(self, model, batch_size: int, stop_token=None, *,
                 policy: str | Policy = "continuous", max_queue: int | None = None,
                 aging_window: int = AGING_WINDOW,
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
        self._tokenizer = getattr(model, "tokenizer", None)
        # the most text bytes one token stands for (HFTextCodec: its vocabulary read once, ~0.1 s for
        # Qwen's 151,665 entries: here at start, not in a first request), or None: _refuse_long_text
        self._token_bytes = getattr(self._tokenizer, "max_token_bytes", None)
        self._grammars = getattr(model, "grammars", None) if self._slot_aware else None  # worker.models.grammar
        self._gives_logprobs = self._slot_aware and getattr(model, "gives_logprobs", False) is True
        vocab_size = _optional_positive_int(model, "vocab_size")
        # the ids its tokenizer does not define (a padded vocabulary): a logit_bias on one is refused
        undefined = getattr(self._tokenizer, "undefined_ids", None)
        self._limits = ModelLimits(vocab_size, _optional_positive_int(model, "max_seq_len"),
                                   self._tokenizer is not None, embeds=False,
                                   undefined=undefined(vocab_size) if undefined is not None and vocab_size else ())
        if isinstance(stop_token, str) and stop_token == "model":
            stop_token = getattr(model, "eos_token_ids", None)
            if stop_token is None:
                raise ValueError('stop_token="model" needs a model with eos_token_ids')
        stops = check_stop_token(stop_token)
        if stops == DEFAULT:
            raise ValueError(f'stop_token must be an int, a list of ints, None or "model", got {stop_token!r}')
        check_vocab(stops, "stop_token", self._limits.vocab_size)
        self.stop_tokens = frozenset(stops)
        self.batch_size = batch_size
        self.max_queue = max_queue
        # (an RLock: a caller's wait that a signal's exception cuts short takes no other thread's lock: protocol.waits)
        self._lock = threading.RLock()
        self._work = condition(self._lock)  # signalled on submit and cancel
        self._waiting = 0  # threads in wait_for_work (skip notify when none)
        self._book = InFlight(aging_window, max_queue)  # guarded by _lock
        self._clock = clock
        self._active = False  # step() or run() in progress
        # Owned by the thread running step()/run(); no lock needed.
        try:  # (a batch_size no memory holds is bad input as any other: 10**12 slots)
            self._slots = SlotTable(batch_size, self._slot_aware, self.stop_tokens, self._limits.vocab_size)
            self._completion = Completion(None if self._tokenizer is None else self._tokenizer.decode)
            if self._slot_aware:
                model.bind_slots(batch_size)
        except MemoryError:
            raise ValueError(f"batch_size {batch_size}: there is not enough memory for that many slots; "
                             "use fewer") from None

    # ---- public, any thread -------------------------------------------------

    def submit_request(self, prompt, max_tokens, callback: Callable[[list[int]], object] | None = None, *,
                       on_token: Callable[[int], object] | None = None,
                       on_text: Callable[[str], object] | None = None, request_id=None, resume_tokens=(),
                       **options) -> Request:
        """Queue one request; return its handle (a :class:`~worker.request.Request`,
        whose public surface is :class:`protocol.handle.RequestHandle`).

        ``prompt``, ``max_tokens`` and the keyword ``options`` are the request's
        parameters: any field of :class:`protocol.request.RequestParams`
        (``stop_token``, ``stop_sequences``, ``priority``, ``timeout_s``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (text stop
        strings), ...; their rules, defaults and units are declared there).
        ``stop_token`` omitted: the engine's. Then, for this engine:
        ``callback(seq)`` runs exactly once at the end (``seq`` = prompt +
        generated tokens, whatever the ``finish_reason``); ``on_token(token)``
        runs for each new token, in order, before it; ``on_text(piece)``
        (models with a tokenizer) runs with each piece of newly released text
        (see :mod:`worker.text`: the pieces add up to ``handle.text``; never a
        prefix of a stop string that may still match), after that iteration's
        ``on_token`` and, for the last piece, before ``callback``;
        ``request_id`` names it (default: one is picked); ``resume_tokens``:
        tokens generated for it elsewhere -- they count toward ``max_tokens``
        and stop matching, appear in ``seq`` and ``text``, and are not passed
        to ``on_token``/``on_text`` again. ``timeout_s`` counts from now.
        Sampling parameters reach slot-aware models (``SlotInput.sampling``);
        a stateless model picks its tokens itself. ``logprobs`` /
        ``prompt_logprobs`` (models with ``gives_logprobs`` only): the handle's
        ``logprobs`` gets one entry per token generated here (resumed tokens
        have none: their caller holds them), appended before that token's
        ``on_token``, dropped with any token dropped after the request ended;
        ``prompt_logprobs`` is set before the first token's ``on_token`` (not
        for a request with ``resume_tokens``: its prompt was scored before).

        Raises ValueError on bad input (:class:`~protocol.errors.UnsupportedError`
        for text -- a text prompt, ``stop`` strings, ``on_text`` -- on a model
        without a tokenizer, and for an embedding request, ``kind`` embed; a plain ValueError naming the field for
        ``logprobs`` / ``prompt_logprobs`` on a model without ``gives_logprobs``), TypeError for an unknown option,
        DuplicateRequestError (a ValueError) when ``request_id`` is in flight,
        QueueFullError at ``max_queue``; in every case nothing is queued.
        """
        # Checked against the model too (and no **{} when there are no options: a dict less per request).
        limits = self._limits
        params = limits.build(prompt, max_tokens, **options) if options else limits.build(prompt, max_tokens)
        if options or on_token is not None or on_text is not None or request_id is not None or resume_tokens \
                or type(params.prompt) is str or type(params.prompt[0]) is not int:
            return self._submit(params, callback, on_token, on_text, request_id, resume_tokens, None, True)
        # The plain submit_request(prompt, max_tokens, callback) -- a batch job's, once per request --
        # skips the checks it has no use for (about 2 % of bench/engine.py's end-to-end time).
        check_callbacks(callback=callback)
        return self._queue(params, None, params.prompt, (), self.stop_tokens, callback, None, None, None, None)

    def submit(self, params: RequestParams, callback: Callable[[list[int]], object] | None = None, *,
               on_token: Callable[[int], object] | None = None, on_text: Callable[[str], object] | None = None,
               request_id=None, resume_tokens=(), time_left_s: float | None = None,
               prompt_ids: tuple[int, ...] | None = None) -> Request:
        """Queue a request built already (:class:`~protocol.request.RequestParams`);
        ``time_left_s`` replaces ``params.timeout_s`` when it waited elsewhere
        before (seconds from now); ``prompt_ids``: a text or chat prompt's ids as
        :meth:`prepare` returned them (not tokenised again). Otherwise, and for errors, as
        :meth:`submit_request`.
        """
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a RequestParams, got {type(params).__name__}")
        return self._submit(params, callback, on_token, on_text, request_id, resume_tokens, time_left_s, False,
                            prompt_ids)

    def needs_preparing(self, params: RequestParams) -> bool:
        """Whether :meth:`prepare` has work to do for ``params``, work that grows with what a client
        sent and holds the calling thread for seconds at the limits (a text or chat prompt to
        tokenise, a structured constraint to compile): the worker's I/O thread leaves it to another."""
        return params.structured is not None or not params.is_token_prompt

    def prepare(self, params: RequestParams) -> tuple[int, ...] | None:
        """The slow part of :meth:`submit`, on any thread, queueing nothing: compiles ``params``'
        structured constraint into the model's grammar cache, and returns a text or chat prompt's
        token ids for ``submit(..., prompt_ids=...)`` (None for a token-id prompt). Raises as
        :meth:`submit` does for these (GrammarError, ContextLengthError, UnsupportedError, ...)."""
        if params.structured is not None:
            self._compile(params)
        if params.is_token_prompt:
            return None
        return self._tokenize(params)

    def _compile(self, params: RequestParams) -> None:
        """``params.structured`` compiled (worker.models.grammar's cache): a bad spec queues nothing."""
        grammars = getattr(self.model, "grammars", None)
        if grammars is None:
            raise UnsupportedError(f"structured: this model ({type(self.model).__name__}) cannot constrain its "
                                   "output: that needs a model with logits and a tokenizer")
        grammars.compile(params.structured)  # GrammarError (bad_request) when it does not compile

    def _submit(self, params: RequestParams, callback, on_token, on_text, request_id, resume_tokens,
                time_left_s: float | None, checked: bool, prompt_ids: tuple[int, ...] | None = None) -> Request:
        """``checked``: ``params`` of token ids were checked against the model already."""
        check_callbacks(callback=callback, on_token=on_token, on_text=on_text)
        if on_text is not None and self._tokenizer is None:
            raise UnsupportedError("this model has no tokenizer: on_text needs one (use on_token)")
        if not self._gives_logprobs and (params.logprobs is not None or params.prompt_logprobs is not None):
            field = "logprobs" if params.logprobs is not None else "prompt_logprobs"
            raise ValueError(f"{field}: this model gives no logprobs (it has no logits: "
                             f"{type(self.model).__name__}); leave {field} unset")
        if params.structured is not None:  # (a cache hit after prepare)
            self._compile(params)
        prompt = params.prompt
        if type(prompt) is not str and type(prompt[0]) is int:  # token ids
            if not checked:
                self._limits.check(params)
        else:  # text or chat
            prompt = self._tokenize(params) if prompt_ids is None else prompt_ids
            self._limits.check(params, len(prompt))
        if params.clamp_max_tokens:
            params = self._limits.fit(params, len(prompt))
        resume = params.check_resume(resume_tokens, self._limits.vocab_size) if resume_tokens else ()
        stops = self.stop_tokens if params.stop_token == DEFAULT else frozenset(params.stop_token)
        if params.structured is not None:
            # The grammar's end is the output's end: it allows the model's EOS only there, so that
            # EOS stops the request even where the request's own stop tokens leave it out
            # (ignore_eos, stop_token=None), instead of being fed to a finished grammar (a 500).
            stops = stops | frozenset(self.model.grammars.eos_token_ids)
        if params.suffix is not None and params.stop_token == DEFAULT:  # a FIM middle ends at its family's end tokens
            stops = stops | frozenset(self._tokenizer.fim_stop_ids)
        timeout_s = params.timeout_s if time_left_s is None else time_left_s
        # Followed token by token only when asked (stop strings, on_text): others pay nothing for text.
        detok = None if not params.stop and on_text is None else \
            TextStream(self._tokenizer, params.stop, params.include_stop_str_in_output, resume)
        return self._queue(params, None if request_id is None else check_request_id(request_id), prompt, resume,
                           stops, callback, on_token, on_text, detok, timeout_s)

    def _queue(self, params: RequestParams, request_id, prompt: tuple[int, ...], resume: tuple[int, ...],
               stops: frozenset[int], callback, on_token, on_text, detok: TextStream | None,
               timeout_s: float | None) -> Request:
        """Make the request's state -- its own handle -- from checked values and
        queue it (the one place a :class:`~worker.request.Request` is made):
        its deadline is ``timeout_s`` from now; ``request_id`` None: one is picked."""
        now = self._clock()
        req = Request(params, request_id, prompt, resume, stops, callback, on_token, now,
                      None if timeout_s is None else now + timeout_s, self._completion)
        req.detok, req.on_text = detok, on_text
        with self._lock:
            self._book.add(req)  # picks an id when it has none
            if self._waiting:
                self._work.notify_all()
        return req

    def _tokenize(self, params: RequestParams) -> tuple[int, ...]:
        """A text or chat prompt as token ids, by the model's tokenizer (ContextLengthError first,
        untokenised, for a text whose bytes alone need more tokens than the context holds)."""
        tok = self._tokenizer
        if tok is None:
            raise UnsupportedError("this model has no tokenizer: send the prompt as token ids, not text")
        self._refuse_long_text(params, self._token_bytes)
        if params.suffix is not None:  # fill in the middle, in the model's own FIM tokens (worker/models/fim.py)
            infill = getattr(tok, "infill", None)
            if infill is None:
                raise UnsupportedError("suffix: this model's tokenizer cannot render fill in the middle; leave "
                                       "suffix out")
            ids = infill(params.prompt, params.suffix, params.input_extra)
        elif type(params.prompt) is str:
            ids = tok.encode(params.prompt)
        else:
            messages = [m.template_dict() for m in params.prompt]
            kwargs = {} if params.tools is None else {"tools": json.loads(params.tools)}  # (validated JSON)
            if params.chat_template_kwargs is not None:
                kwargs["template_kwargs"] = json.loads(params.chat_template_kwargs)
            if params.continue_final_message:  # (the prefill idiom: the output continues the final message)
                kwargs["continue_final_message"] = True
            if not params.generation_prompt:
                kwargs["add_generation_prompt"] = False
            ids = tok.apply_chat_template(messages, **kwargs)
        return as_tokens(ids, "the tokenised prompt", allow_empty=False)

    def _refuse_long_text(self, params: RequestParams, token_bytes: int | None) -> None:
        """ContextLengthError when the prompt's text (with a chat's contents and a FIM suffix) has
        more than ``max_seq_len x token_bytes`` UTF-8 bytes: at least that many tokens, whatever the
        tokenizer does (``token_bytes``: the most bytes one token stands for,
        ``HFTextCodec.max_token_bytes``; None: no bound). Tokenising 8 MB of text took 3.9 s of the
        worker's loop (a break-it pass), to refuse it anyway."""
        limit = self._limits.max_seq_len
        if limit is None or not token_bytes:
            return
        prompt = params.prompt
        texts = [prompt] if type(prompt) is str else [m.content for m in prompt if type(m.content) is str]
        nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts + [params.suffix or ""])
        at_least = -(-nbytes // token_bytes)
        if at_least > limit:  # (worded as ModelLimits.check words the exact count)
            what = "leaves no room to generate in" if params.clamp_max_tokens else "exceeds"
            raise ContextLengthError(f"prompt (at least {at_least} tokens: {nbytes} bytes of text, at most "
                                     f"{token_bytes} bytes a token) {what} the served context of {limit} "
                                     f"tokens (--max-model-len); shorten the prompt")

    def cancel(self, request_id) -> bool:
        """End a queued or running request as ``"cancelled"``; thread-safe.

        Returns True when it was queued or running (it then ends as cancelled
        at the start of the next iteration; its callback fires once with the
        tokens so far), False when it is unknown or already finished -- also
        when it finished in the iteration that is delivering its callbacks.
        ValueError for what can be no request's id (:func:`~protocol.request.check_request_id`).
        """
        request_id = check_request_id(request_id)
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
        return len(self._book.queue)

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
        """One iteration, Orca's loop: end and admit, plan, one model call, append, finish."""
        slots, book = self._slots, self._book
        if book.pending or book.deadlines.heap:  # racy reads: a miss is seen next iteration
            self._end_early()
        if slots.free and len(book.queue):
            self._admit()
        if not slots.reqs:
            return 0
        try:
            tokens, skipped = self._call_model()  # plans the step, calls the model once
        except Exception as exc:  # the model failing ends this batch, not the engine
            self._fail_batch(exc)
            return 0
        generated = 0
        try:
            while True:  # append, check, stream, finish; a drafted step's further tokens one iteration each
                self._deliver(slots.append(tokens, skipped), skipped)
                generated += len(tokens) - len(skipped)
                if not slots.pending:
                    return generated
                tokens, skipped = slots.next_round()
        except Exception as exc:  # a first token that is no token id broke the checks (the hot path does
            self._fail_batch(exc)  # not type them; callbacks' errors are caught): it ends this batch, not the engine
            return generated

    # ---- helpers -----------------------------------------------------------

    def _call_model(self) -> tuple[list, set[Request] | frozenset]:
        """Plan this iteration (:mod:`worker.planner`), call the model once, read its output:
        ``(tokens, skipped)`` for :meth:`SlotTable.append`. Requests whose row failed are
        marked to end; those that got their first token are stamped. Raises what the model
        raises, or ModelError for a reply of the wrong length."""
        slots, model = self._slots, self.model
        if not self._slot_aware:
            tokens = model.next_tokens(slots.seqs)
            if len(tokens) != len(slots.seqs):
                raise _wrong_length(tokens, slots.seqs)
            if slots.prefilling:  # their first token: time to first token
                slots.started(None, _NOBODY, self._clock())
            return tokens, _NOBODY
        plan = slots.plan
        plan.chunks = plan_chunks(slots.prefilling, getattr(model, "prefill_budget", None)) \
            if slots.prefilling else NO_CHUNKS
        if self._grammars is not None:  # constrained rows' masks are filled while the model's forward runs
            self._grammars.prefetch(plan.batch)
        out = model.step(plan)
        if len(out.tokens) != len(plan.batch):
            raise _wrong_length(out.tokens, plan.batch)
        tokens, skipped, failed = slots.take(out)
        if failed:
            with self._lock:
                for req, exc in failed:
                    self._book.row_failed(req, exc)
        if slots.prefilling:  # their first token: time to first token, and the prompt tokens the cache gave
            slots.started(out, skipped, self._clock())
        return tokens, skipped

    def _deliver(self, finished: list[Request], skipped: set[Request] | frozenset) -> None:
        """After tokens were appended: commit the finished, stream (not to the ``skipped``), end the finished."""
        slots, book = self._slots, self._book
        if finished:
            with self._lock:  # final from here: a later cancel returns False
                finished = book.commit(finished)
        if slots.streaming:
            streaming = slots.streaming if not skipped else [r for r in slots.streaming if r not in skipped]
            for req, exc in stream_tokens(streaming):
                with self._lock:
                    book.stream_failed(req, exc)
        if slots.text_streaming or slots.text_failed:
            self._stream_text(slots)
        if finished:
            self._finish(finished)

    def _begin(self) -> None:
        with self._lock:
            if self._active:
                raise RuntimeError("the engine is already running (step/run called from a "
                                   "callback or a second thread); call it from one loop only")
            self._active = True

    def _has_work(self) -> bool:
        return bool(len(self._book.queue) or self._slots.reqs or self._book.pending)

    def _admit(self) -> None:
        slots = self._slots
        n = self.policy.admissible(len(slots.free), len(slots.reqs))
        if n:
            with self._lock:
                new = self._book.admit(n)
            slots.occupy(new)

    def _stream_text(self, slots: SlotTable) -> None:
        """``on_text`` with this iteration's released text; end the requests whose
        text failed to decode, or whose ``on_text`` raised, with ``"error"``."""
        failed = slots.text_failed + stream_text(slots.text_streaming)
        slots.text_failed.clear()
        for req, exc in failed:
            log.warning("text of request %r failed", req.request_id, exc_info=exc)
            with self._lock:
                self._book.stream_failed(req, exc)

    def _end_early(self) -> None:
        """Carry out cancels, deadlines and failed streams: callbacks, then free slots."""
        with self._lock:
            ended = self._book.take_ended(self._clock)
        self._finish(ended)

    def _finish(self, ended: list[Request]) -> None:
        """Run the callbacks of FINISHED requests, then free the slots of those that had one (also
        when a callback's KeyboardInterrupt or SystemExit comes back from :func:`complete`)."""
        try:
            complete(ended, self._completion, self._clock())
        finally:
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


def _wrong_length(tokens: list, batch: list) -> ModelError:
    return ModelError(f"model returned {len(tokens)} tokens for {len(batch)} sequences")


def _optional_positive_int(model, name: str) -> int | None:
    value = getattr(model, name, None)
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"model.{name} must be None or an int >= 1, got {value!r}")
    return value
