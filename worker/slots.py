"""The running batch: which request occupies which slot, and when each one must stop.

A slot is one row of the model's batch (and, for slot-aware models, one
per-slot KV cache). :class:`SlotTable` keeps the occupied slots as parallel
lists in *batch order* -- ``reqs[i]`` owns ``seqs[i]`` -- so one model call
reads them as they are and one ``map`` appends a token to every sequence. A
freed entry is swap-removed (the last entry moves into its place), so
admitting and freeing cost O(1) per request and nothing is rebuilt per
iteration (when half the batch or more ends at once, the lists are rebuilt
from those that stay instead: cheaper per request).

Termination is checked per batch, not per token, wherever it can be:

- stop tokens: one ``in`` or ``isdisjoint`` of the new tokens against the
  stop tokens in use; only on a hit are the slots visited;
- ``max_tokens``: requests are bucketed by the iteration in which they
  reach it, so an iteration looks at its own bucket only;
- stop sequences: only requests that have them are visited (one
  :class:`~worker.request.StopMatcher` step each);
- text (stop strings, text streaming): only requests whose text the engine
  follows are visited (one :class:`~worker.text.TextStream` step each), so
  requests without text stops pay nothing for them.

``min_tokens`` (vLLM's): for a slot-aware model, a request that has fewer
than ``min_tokens`` output tokens (resumed ones count) and has stop tokens
gets a ``SlotInput.sampling`` carrying them (``SamplingParams.min_tokens`` /
``min_tokens_stops``): the model's sampler masks them to -inf, so a model
with logits never produces one early, and the row is not plain greedy (no
screened head, no drafts) while the mask applies. Once it reaches
``min_tokens`` its sampling is set back to the request's own (only the
requests still held are visited: plain rows pay nothing). The termination
rule stays for every model: a stop token, stop sequence or stop string
before ``min_tokens`` does not end the request. It is what holds a model
without logits to ``min_tokens`` (SimulatedLLM, scripted and stateless
``next_tokens`` models: nothing can be masked, so they may emit a stop
token early and it is ignored); stop sequences and stop strings are never
masked, for any model (as vLLM: their matches before ``min_tokens`` are
passed over).

A slot-aware model's step (:class:`~worker.models.base.StepOutput`) is read
by :meth:`SlotTable.take`: its ``tokens`` as they are when every slot got
one (the usual step: one C-level scan finds no None), else one pass over
the slots without a token that sets aside the failures; the further tokens
of a drafted slot wait in ``pending`` (:meth:`SlotTable.next_round` gives
them, one more iteration each). Every iteration's tokens, the first and the
drafted ones, go through the one :meth:`SlotTable.append` with every check.

Logprobs (slot-aware models with ``gives_logprobs``): a request that asks
has its slot's ``SlotInput.logprobs`` / ``prompt_logprobs`` set (the latter
only without resume tokens) and is kept in a list of its own, the only
requests visited for them: after each model step, each of them that got
tokens takes its entry's ``logprobs`` (the first now, the others with the
pending tokens of a speculative step, dropped with them) and, once, its
``prompt_logprobs``; both before that iteration's ``on_token``. Requests
that do not ask pay one empty-list check per iteration.
"""

from __future__ import annotations

from collections import deque

from protocol.enums import FinishReason
from worker.errors import ModelError
from protocol.request import GREEDY
from worker.models.base import BatchPlan, SlotInput, StepOutput
from worker.planner import NO_CHUNKS, NOT_STARTED, Prefill
from worker.request import Request, RequestState

_NO_TOKENS: list[int] = []  # what a free slot's SlotInput points at (drops the old sequence)
_exhaust = deque(maxlen=0).extend  # runs an iterator at C speed, keeps nothing
_NOBODY: frozenset = frozenset()  # append(): no request was skipped
_RUNNING = RequestState.RUNNING
_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH


class SlotTable:
    """``num_slots`` slots, each free or owned by one running request.

    - ``reqs``: running requests, batch order.
    - ``seqs``: their token lists (``reqs[i].seq``), the batch of a stateless model.
    - ``batch``: what the model is called with -- ``seqs``, or for slot-aware
      models one :class:`SlotInput` per entry (owned by its slot and reused,
      so an iteration allocates nothing).
    - ``free``: free slot indices, a stack (slot 0 first, then the latest freed).
    - ``streaming``: running requests with an ``on_token`` callback.
    - ``plan``: a slot-aware model's :class:`BatchPlan` (``batch`` is ``batch``;
      the engine sets ``chunks`` each iteration), None for a stateless model.
    - ``prefilling``: running requests that have had no token yet, with
      their :class:`~worker.planner.Prefill` (what the planner reads;
      :meth:`started` stamps their first token and drops them).
    - ``iteration``: number of token-appending iterations so far (each
      :meth:`next_round` counts as one).
    - ``pending``: tokens a model step returned beyond each slot's first
      (speculative decoding), still to append (:meth:`next_round`).

    Stop tokens: most requests share the engine's ``default_stop`` set, so
    only the other sets are counted; ``_stop_any`` is their union with the
    default, a superset of the stop tokens in use (a token of it that no
    running request stops on only costs a look at its slot).

    Invariants: ``len(reqs) + len(free) == num_slots``; ``reqs[i].pos == i``;
    ``_custom_stops[s]`` = number of running requests whose stop set ``s`` is
    not ``default_stop``.
    """

    __slots__ = ("num_slots", "reqs", "seqs", "free", "batch", "plan", "streaming", "prefilling", "iteration",
                 "_inputs", "_slot_inputs", "_due", "_default_stop", "_custom_stops",
                 "_stop_any", "_stop_one", "_matching", "_holding", "_texting", "text_streaming", "text_failed",
                 "pending", "_scoring", "pending_scores", "vocab_size")

    def __init__(self, num_slots: int, slot_aware: bool,
                 default_stop: frozenset[int] = frozenset(), vocab_size: int | None = None) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size  # the model's, None: unknown (token ids a model returns are checked against it)
        self.reqs: list[Request] = []
        self.seqs: list[list[int]] = []
        self.free = list(range(num_slots - 1, -1, -1))
        self._slot_inputs = [SlotInput(slot=i, tokens=_NO_TOKENS) for i in range(num_slots)]
        self._inputs: list[SlotInput] | None = [] if slot_aware else None
        self.batch: list = self.seqs if self._inputs is None else self._inputs
        self.plan = None if self._inputs is None else BatchPlan(self._inputs, NO_CHUNKS)
        self.streaming: list[Request] = []
        self.prefilling: dict[Request, Prefill] = {}
        self.iteration = 0
        self._due: dict[int, list[Request]] = {}  # iteration -> requests reaching max_tokens
        self._default_stop = default_stop
        self._custom_stops: dict[frozenset[int], int] = {}
        self._stop_any = default_stop
        self._stop_one: int | None = None  # the token, when _stop_any has exactly one
        self._matching: list[Request] = []  # running requests with stop sequences
        self._holding: list[Request] = []   # running requests under their min_tokens mask
        self._texting: list[Request] = []   # running requests whose text is followed (req.detok)
        self.text_streaming: list[Request] = []  # running requests with on_text
        self.text_failed: list[tuple[Request, Exception]] = []  # detokenising raised (this iteration)
        self.pending: dict[Request, list[int]] = {}  # more tokens of one model step (next_round)
        self._scoring: list[Request] = []  # running requests with logprobs or prompt_logprobs (slot-aware)
        self.pending_scores: dict[Request, list] = {}  # the logprobs entries of the pending tokens
        self._update_stops()

    def occupy(self, new: list[Request]) -> None:
        """Give each request in ``new`` a free slot (the caller checked there are enough)."""
        free, reqs, seqs, inputs = self.free, self.reqs, self.seqs, self._inputs
        due, default_stop, it = self._due, self._default_stop, self.iteration - 1
        for pos, req in enumerate(new, len(reqs)):
            slot = free.pop()
            req.slot, req.pos = slot, pos
            req.seq = seq = list(req.seq)  # the list that grows (a tuple while queued)
            seqs.append(seq)
            if inputs is not None:
                si = self._slot_inputs[slot]
                si.tokens, si.sampling, si.prompt_len = seq, req.params.sampling, req._prompt_tokens
                inputs.append(si)
                if req.params.min_tokens > len(seq) - req._prompt_tokens and req.stop_tokens:
                    si.sampling = si.sampling._replace(min_tokens=req.params.min_tokens,
                                                       min_tokens_stops=tuple(sorted(req.stop_tokens)))
                    self._holding.append(req)
                params = req.params
                if params.logprobs is not None or params.prompt_logprobs is not None:
                    si.logprobs = params.logprobs
                    si.prompt_logprobs = params.prompt_logprobs if len(seq) == req._prompt_tokens else None
                    self._scoring.append(req)
            # Its k-th new token is appended in iteration (now + k - 1).
            at = it + req.to_generate
            bucket = due.get(at)
            if bucket is None:
                due[at] = [req]
            else:
                bucket.append(req)
            if req.stop_tokens is not default_stop:
                self._count_stops(req.stop_tokens, 1)
            if req.matcher is not None:
                self._matching.append(req)
            if req.on_token is not None:
                self.streaming.append(req)
            if req.detok is not None:
                self._texting.append(req)
                if req.on_text is not None:
                    self.text_streaming.append(req)
            self.prefilling[req] = NOT_STARTED
        reqs.extend(new)

    def vacate(self, gone: list[Request]) -> None:
        """Free the slots of those in ``gone`` that have one (ended requests).

        Few leaving: each is swap-removed from the batch lists (the last entry
        moves into its place). Half the batch or more: the lists are rebuilt
        once from those that stay, which is cheaper per request.
        """
        reqs = self.reqs
        if 2 * len(gone) >= len(reqs):
            self._release(gone)
            reqs[:] = [req for req in reqs if req.slot is not None]  # same list objects:
            self.seqs[:] = [req.seq for req in reqs]                 # `batch` is one of them
            if self._inputs is not None:
                self._inputs[:] = [self._slot_inputs[req.slot] for req in reqs]
            for pos, req in enumerate(reqs):
                req.pos = pos
            return
        seqs, inputs = self.seqs, self._inputs
        for req in gone:
            pos = req.pos
            if pos is None:  # ended while queued
                continue
            moved = reqs.pop()
            seq = seqs.pop()
            if moved is not req:
                reqs[pos] = moved
                seqs[pos] = seq
                moved.pos = pos
            if inputs is not None:
                si = inputs.pop()
                if moved is not req:
                    inputs[pos] = si
        self._release(gone)

    def _release(self, gone: list[Request]) -> None:
        """Give back the slots of those in ``gone`` that have one (the caller fixes the lists)."""
        free, inputs, default_stop = self.free, self._inputs, self._default_stop
        for req in gone:
            slot = req.slot
            if slot is None:  # ended while queued
                continue
            free.append(slot)
            req.pos = req.slot = None
            if self.prefilling:
                self.prefilling.pop(req, None)
            if self.pending:
                self.pending.pop(req, None)
                if self.pending_scores:
                    self.pending_scores.pop(req, None)
            if inputs is not None:
                si = self._slot_inputs[slot]
                if si.sampling.min_tokens_stops:
                    self._holding.remove(req)
                si.tokens, si.sampling, si.prompt_len = _NO_TOKENS, GREEDY, 0
                if self._scoring and req in self._scoring:
                    self._scoring.remove(req)
                    si.logprobs = si.prompt_logprobs = None
            if req.stop_tokens is not default_stop:
                self._count_stops(req.stop_tokens, -1)
            if req.matcher is not None:
                self._matching.remove(req)
                req.matcher = None
            if req.on_token is not None:
                self.streaming.remove(req)
                req.on_token = None
            if req.detok is not None:  # (kept: it holds the request's text)
                self._texting.remove(req)
                if req.on_text is not None:
                    self.text_streaming.remove(req)
                    req.on_text = None

    def _count_stops(self, stops: frozenset[int], delta: int) -> None:
        counts = self._custom_stops
        n = counts.get(stops, 0) + delta
        if n:
            counts[stops] = n
        else:
            del counts[stops]
        if n == 0 or n == delta:  # a set entered or left: the union changes
            self._update_stops()

    def _update_stops(self) -> None:
        self._stop_any = self._default_stop.union(*self._custom_stops)
        self._stop_one = next(iter(self._stop_any)) if len(self._stop_any) == 1 else None

    def take(self, out: StepOutput) -> tuple[list, set[Request] | frozenset, list | tuple]:
        """Read a slot-aware model's step: return ``(tokens, skipped, failed)`` for :meth:`append`.

        ``tokens``: ``out.tokens`` as it is (a slot's first token, None for
        none: those requests are ``skipped``); a slot's further tokens
        (``out.more``) go to ``pending`` (:meth:`next_round`). ``failed``: the
        ``(request, error)`` pairs for the engine to end with ``"error"``: the
        slots in ``out.errors``, a decoding slot (not in ``plan.chunks``)
        that got no token, and a slot whose entry breaks the contract
        (:meth:`_vet`; its tokens are then dropped). The scoring requests that
        got a token take their logprobs entries.

        Raises ModelError when ``out.more`` or ``out.errors`` names no batch
        entry (the reply cannot be pinned on one request: the engine fails
        the batch, as when the model raises).
        """
        tokens, errors = out.tokens, out.errors
        if out.more or errors or self._scoring:  # (the usual step has none of them: nothing to vet)
            tokens, errors = self._vet(out)
        if out.more:
            reqs, pending = self.reqs, self.pending
            for i, more in out.more.items():
                if more and tokens[i] is not None:
                    pending[reqs[i]] = more[::-1]  # reversed: pop() takes the next
        if None in tokens:  # (a C-level scan; the usual step has a token for every slot)
            skipped, failed = self._no_token(tokens, errors)
        else:
            skipped, failed = _NOBODY, ()
        if self._scoring:
            self._take_scores(out, skipped)
        return tokens, skipped, failed

    def _vet(self, out: StepOutput) -> tuple[list, dict[int, BaseException]]:
        """``out``'s tokens and errors, with every batch entry that breaks the contract failed
        (its tokens None, a ModelError saying what was wrong): an error next to a token (the
        error wins) or one that is no exception, further tokens without a first token or that
        are not a list of token ids (ints in ``[0, vocab_size)``), and the scores of
        :meth:`_vet_scores`. Raises ModelError for a key of ``out.more`` / ``out.errors`` that
        is no batch index (the reply cannot be pinned on one request)."""
        tokens, errors, n = list(out.tokens), dict(out.errors or ()), len(self.reqs)
        for field, keys in (("errors", errors), ("more", out.more or ())):
            for i in keys:
                if type(i) is not int or not 0 <= i < n:
                    raise ModelError(f"StepOutput.{field} names batch index {i!r}; the batch has {n} entries")
        for i, exc in errors.items():
            tokens[i] = None
            if not isinstance(exc, BaseException):
                errors[i] = ModelError(f"the model failed for batch entry {i}: {exc!r}")
        vocab = self.vocab_size
        for i, more in (out.more or {}).items():
            if tokens[i] is None:
                if more and i not in errors:
                    errors[i] = ModelError(f"the model gave further tokens for batch entry {i} but no first token")
            elif type(more) is not list or not all(type(t) is int and 0 <= t and (vocab is None or t < vocab)
                                                   for t in more):
                errors[i] = ModelError(f"the model's further tokens for batch entry {i} are not a list of token "
                                       f"ids (ints in [0, {vocab})): {more!r}")
                tokens[i] = None
        if self._scoring:
            self._vet_scores(out, tokens, errors)
        return tokens, errors

    def _vet_scores(self, out: StepOutput, tokens: list, errors: dict[int, BaseException]) -> None:
        """Fail (in ``tokens`` and ``errors``, as :meth:`_vet`) each scoring request that got
        tokens with ``logprobs`` entries that are not a list of one per token (``tokens[i]`` and
        ``more[i]``), or, with its first token, ``prompt_logprobs`` not a list of one per prompt token."""
        entries, prompts, more = out.logprobs or {}, out.prompt_logprobs or {}, out.more or {}
        for req in self._scoring:
            i = req.pos
            if tokens[i] is None:
                continue
            if req.logprobs is not None:
                got, want = entries.get(i), 1 + len(more.get(i) or ())
                if type(got) is not list or len(got) != want:
                    errors[i] = ModelError(f"the model gave {len(got) if type(got) is list else got!r} logprobs "
                                           f"entries for batch entry {i}'s {want} tokens (a list of one per token)")
                    tokens[i] = None
                    continue
            if self._slot_inputs[req.slot].prompt_logprobs is not None:
                got, want = prompts.get(i), self._slot_inputs[req.slot].prompt_len
                if type(got) is not list or len(got) != want:
                    errors[i] = ModelError(f"the model gave {len(got) if type(got) is list else got!r} "
                                           f"prompt_logprobs entries for batch entry {i}'s {want} prompt tokens "
                                           "(a list of one per token)")
                    tokens[i] = None

    def _no_token(self, tokens: list, errors: dict[int, BaseException] | None
                  ) -> tuple[set[Request], list[tuple[Request, BaseException]]]:
        """The requests whose slot got no token (``tokens[i]`` None), and those of them that
        failed: in ``errors``, or decoding (not in ``plan.chunks``)."""
        reqs, chunks, errors = self.reqs, self.plan.chunks, errors or NO_CHUNKS
        skipped: set[Request] = set()
        failed: list[tuple[Request, BaseException]] = []
        for i in [i for i, tok in enumerate(tokens) if tok is None]:
            req = reqs[i]
            skipped.add(req)
            if i in errors:
                failed.append((req, errors[i]))
            elif i not in chunks:
                failed.append((req, ModelError("the model returned no token for a slot that was decoding")))
        return skipped, failed

    def _take_scores(self, out: StepOutput, skipped: set[Request] | frozenset) -> None:
        """The scoring requests that got tokens take their logprobs entries (see the module docstring)."""
        pending, prompts, entries = self.pending_scores, out.prompt_logprobs, out.logprobs
        for req in self._scoring:
            if skipped and req in skipped:
                continue
            i, si = req.pos, self._slot_inputs[req.slot]
            if si.prompt_logprobs is not None and prompts and i in prompts:  # (asked, and not taken yet)
                req.prompt_logprobs = prompts[i]
                si.prompt_logprobs = None
            if req.logprobs is not None:
                scored = entries[i]
                req.logprobs.append(scored[0])
                if len(scored) > 1:
                    pending[req] = scored[:0:-1]  # reversed, as pending's tokens

    def started(self, out: StepOutput | None, skipped: set[Request] | frozenset, now: float) -> None:
        """After a model step: the ``prefilling`` requests that got their first token (all of
        them for a stateless model: ``out`` None) get their time to first token (``now``) and
        their cached prompt tokens, and leave ``prefilling``; the others advance by their chunk."""
        prefilling = self.prefilling
        if out is None:  # a stateless model: every request got its first token
            for req in prefilling:
                req.first_token_s, req._cached_tokens = now, 0
            prefilling.clear()
            return
        chunks, cached = self.plan.chunks, out.cached_tokens or NO_CHUNKS
        for req, prefill in list(prefilling.items()):
            if skipped and req in skipped:
                prefilling[req] = prefill.advanced(chunks.get(req.pos, 0), cached.get(req.pos), len(req.seq))
                continue
            req.first_token_s = now
            req._cached_tokens = cached.get(req.pos, prefill.cached)
            del prefilling[req]

    def append(self, tokens: list, skipped: set[Request] | frozenset = _NOBODY) -> list[Request]:
        """Append ``tokens[i]`` to ``seqs[i]`` (None for the ``skipped``: no token this
        iteration); return the requests this finishes. The one way tokens are appended.

        Checks in the order stop token, stop sequences, stop strings,
        ``max_tokens``; the first that fires sets ``req.reason``. Stops count
        only from the request's ``min_tokens``-th generated token on (a model
        with logits never gives a stop token earlier: see the module
        docstring). Only RUNNING requests with no reason yet can finish; states are left for
        the engine to commit. A request whose text fails to decode is put in
        ``text_failed`` (the engine ends it with an error). A ``skipped``
        request is not checked, and its ``max_tokens`` bucket moves one
        iteration on (it generated nothing in this one).
        """
        if skipped:
            for seq, tok in zip(self.seqs, tokens):
                if tok is not None:
                    seq.append(tok)
            self._defer(skipped)
        else:
            _exhaust(map(list.append, self.seqs, tokens))
        return self._check(tokens, skipped)

    def _defer(self, skipped: set[Request]) -> None:
        """Move each ``skipped`` request's ``max_tokens`` bucket one iteration on. A request's
        bucket is ``iteration - 1 + tokens left`` (its k-th next token comes in iteration
        ``iteration + k - 1``)."""
        due, it = self._due, self.iteration
        for req in skipped:
            left = req.params.max_tokens - req.num_generated
            bucket = due.get(it - 1 + left)
            if bucket is not None and req in bucket:
                bucket.remove(req)
                due.setdefault(it + left, []).append(req)

    def next_round(self) -> tuple[list, set[Request]]:
        """The next of each request's ``pending`` tokens, as one more iteration for
        :meth:`append`: ``(tokens, skipped)``.

        Requests with none left (or that ended already) get no token: they are
        ``skipped``. A request's leftover tokens (and logprobs entries) are
        dropped once it ends (a stop, ``max_tokens``, a cancel): tokens past
        the end are never appended.
        """
        pending, scores = self.pending, self.pending_scores
        tokens: list = [None] * len(self.reqs)
        skipped: set[Request] = set()
        for i, req in enumerate(self.reqs):
            more = pending.get(req)
            if more and req.reason is None and req.state is _RUNNING:
                tokens[i] = more.pop()
                entries = scores.get(req) if scores else None
                if entries:
                    req.logprobs.append(entries.pop())
                if not more:
                    del pending[req]
                    if entries is not None:
                        del scores[req]
                continue
            if more is not None:
                del pending[req]
                if scores:
                    scores.pop(req, None)
            skipped.add(req)
        return tokens, skipped

    def _lift(self) -> None:
        """The held requests that reached ``min_tokens`` get their own sampling back (no mask)."""
        held = [req for req in self._holding if req.num_generated >= req.params.min_tokens]
        for req in held:
            self._holding.remove(req)
            self._slot_inputs[req.slot].sampling = req.params.sampling

    def _check(self, tokens: list, skipped: set[Request] | frozenset) -> list[Request]:
        """Termination checks after an append (see :meth:`append`); ``skipped`` got no token."""
        reqs = self.reqs
        it = self.iteration
        self.iteration = it + 1
        if self._holding:
            self._lift()
        finished: list[Request] = []
        stop, one = self._stop_any, self._stop_one
        # One C-level scan of the new tokens; `in` on a list beats isdisjoint for one token.
        if stop and (one in tokens if one is not None else not stop.isdisjoint(tokens)):
            for i in [i for i, t in enumerate(tokens) if t in stop]:
                req = reqs[i]
                t = tokens[i]
                if t in req.stop_tokens and req.state is _RUNNING and req.num_generated >= req.params.min_tokens:
                    # stop_reason, as vLLM's: the id of a stop token the request named (its own
                    # stop_token), None for the model's end tokens applied by default (EOS, a
                    # grammar's end, a FIM middle's end): "None ... including encountering the EOS token".
                    named = req.params.stop_token
                    req.reason, req.stop_match = _STOP, t if type(named) is tuple and t in named else None
                    finished.append(req)
        for req in self._matching:
            if skipped and req in skipped:
                continue
            matched = req.matcher.feed(req.seq[-1])
            if matched is not None and req.reason is None and req.state is _RUNNING \
                    and req.num_generated >= req.params.min_tokens:
                req.reason, req.stop_match = _STOP, matched
                finished.append(req)
        for req in self._texting:
            if skipped and req in skipped:
                continue
            live = req.reason is None and req.state is _RUNNING and req.num_generated >= req.params.min_tokens
            try:
                matched = req.detok.feed(req.seq[-1], live)
            except Exception as exc:  # a tokenizer failing on one request ends that request only
                self.text_failed.append((req, exc))
                continue
            if matched is not None:
                req.reason, req.stop_match = _STOP, matched
                finished.append(req)
        for req in self._due.pop(it, ()):  # (RUNNING: still in its slot; FINISHED ones left)
            if req.reason is None and req.state is _RUNNING and not (skipped and req in skipped):
                req.reason = _LENGTH
                finished.append(req)
        return finished
