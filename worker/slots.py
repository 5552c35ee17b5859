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

Logprobs (slot-aware models with ``gives_logprobs``): a request that asks
has its slot's ``SlotInput.logprobs`` / ``prompt_logprobs`` set (the latter
only without resume tokens) and is kept in a list of its own, the only
requests visited for them: after each model step, each of them that got
tokens takes its slot's ``scored`` entries (the first now, the others with
the pending tokens of a speculative step, dropped with them) and, once, its
``prompt_scored``; both before that iteration's ``on_token``. Requests that
do not ask pay one empty-list check per iteration.
"""

from __future__ import annotations

from collections import deque

from protocol.enums import FinishReason
from worker.errors import ModelError
from worker.models.base import GREEDY, SlotInput
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
    - ``admitted``: requests admitted since the last ``append`` (the engine
      stamps their first token's time, then clears it).
    - ``iteration``: number of token-appending iterations so far (each of
      :meth:`append_pending`'s counts as one).
    - ``pending``: tokens a model step returned beyond each slot's first
      (speculative decoding), still to append (:meth:`append_pending`).

    Stop tokens: most requests share the engine's ``default_stop`` set, so
    only the other sets are counted; ``_stop_any`` is their union with the
    default, a superset of the stop tokens in use (a token of it that no
    running request stops on only costs a look at its slot).

    Invariants: ``len(reqs) + len(free) == num_slots``; ``reqs[i].pos == i``;
    ``_custom_stops[s]`` = number of running requests whose stop set ``s`` is
    not ``default_stop``.
    """

    __slots__ = ("num_slots", "reqs", "seqs", "free", "batch", "streaming", "admitted", "iteration",
                 "_inputs", "_slot_inputs", "_due", "_default_stop", "_custom_stops",
                 "_stop_any", "_stop_one", "_matching", "_holding", "_texting", "text_streaming", "text_failed",
                 "pending", "_scoring", "pending_scores")

    def __init__(self, num_slots: int, slot_aware: bool,
                 default_stop: frozenset[int] = frozenset()) -> None:
        self.num_slots = num_slots
        self.reqs: list[Request] = []
        self.seqs: list[list[int]] = []
        self.free = list(range(num_slots - 1, -1, -1))
        self._slot_inputs = [SlotInput(slot=i, tokens=_NO_TOKENS) for i in range(num_slots)]
        self._inputs: list[SlotInput] | None = [] if slot_aware else None
        self.batch: list = self.seqs if self._inputs is None else self._inputs
        self.streaming: list[Request] = []
        self.admitted: list[Request] = []
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
        self.pending: dict[Request, list[int]] = {}  # more tokens of one model step (append_pending)
        self._scoring: list[Request] = []  # running requests with logprobs or prompt_logprobs (slot-aware)
        self.pending_scores: dict[Request, list] = {}  # the logprobs entries of the pending tokens
        self._update_stops()

    def cached_tokens(self, req: Request) -> int:
        """The prompt tokens the model took from its prefix cache for running ``req``
        (``SlotInput.cached_tokens``, read with its first token); 0 for a stateless model."""
        if self._inputs is None or req.slot is None:
            return 0
        return self._slot_inputs[req.slot].cached_tokens or 0

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
                si.cached_tokens = None
                inputs.append(si)
                if req.params.min_tokens > len(seq) - req._prompt_tokens and req.stop_tokens:
                    si.sampling = si.sampling._replace(min_tokens=req.params.min_tokens,
                                                       min_tokens_stops=tuple(sorted(req.stop_tokens)))
                    self._holding.append(req)
                params = req.params
                if params.logprobs is not None or params.prompt_logprobs is not None:
                    si.logprobs, si.scored, si.prompt_scored = params.logprobs, None, None
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
        reqs.extend(new)
        self.admitted.extend(new)

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
                    si.logprobs = si.prompt_logprobs = si.scored = si.prompt_scored = None
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

    def append(self, tokens: list[int]) -> list[Request]:
        """Append ``tokens[i]`` to ``seqs[i]``; return the requests this finishes.

        Checks in the order stop token, stop sequences, stop strings,
        ``max_tokens``; the first that fires sets ``req.reason``. Stops count
        only from the request's ``min_tokens``-th generated token on (a model
        with logits never gives a stop token earlier: see the module
        docstring). Only RUNNING requests with no reason yet can finish; states are left for
        the engine to commit. A request whose text fails to decode is put in
        ``text_failed`` (the engine ends it with an error).
        """
        _exhaust(map(list.append, self.seqs, tokens))
        if self._scoring:
            self._take_scores(_NOBODY)
        return self._check(tokens, _NOBODY)

    def _take_scores(self, skipped: set[Request] | frozenset) -> None:
        """The scoring requests that got tokens take their slots' entries (see the module docstring)."""
        inputs, pending = self._slot_inputs, self.pending_scores
        for req in self._scoring:
            if skipped and req in skipped:
                continue
            si = inputs[req.slot]
            prompt = si.prompt_scored
            if prompt is not None:
                req.prompt_logprobs = prompt
                si.prompt_scored = si.prompt_logprobs = None
            if req.logprobs is not None:
                scored, si.scored = si.scored, None
                req.logprobs.append(scored[0])
                if len(scored) > 1:
                    pending[req] = scored[:0:-1]  # reversed, as pending's tokens

    def append_some(self, tokens: list) -> tuple[list[Request], set[Request], list[tuple[Request, BaseException]]]:
        """:meth:`append` for a batch where some entries carry no token (slot-aware models only).

        ``tokens[i]`` is a token, None (no token this iteration: the model
        has not finished the slot's prefill), an exception (this slot's
        computation failed) or a non-empty list of tokens (several tokens
        at once, speculative decoding): its first is appended now, the
        others go to ``pending`` for :meth:`append_pending`. Returns
        ``(finished, skipped, failed)``:
        ``skipped`` is every request that got no token (it is not checked for
        termination and streams nothing), ``failed`` the ``(request, error)``
        pairs for the engine to end with ``"error"``.

        A None defers the request's ``max_tokens`` bucket by one iteration.
        It is only valid before the request's first token in this slot (the
        bucket of a request with no token yet is ``iteration - 1 +
        to_generate``); later it is reported as a failure.
        """
        reqs, seqs, due, it = self.reqs, self.seqs, self._due, self.iteration
        skipped: set[Request] = set()
        failed: list[tuple[Request, BaseException]] = []
        firsts = None
        for i, tok in enumerate(tokens):
            if type(tok) is list:
                if firsts is None:
                    firsts = list(tokens)  # (the checks below scan single tokens)
                if tok:
                    firsts[i] = tok[0]
                    if len(tok) > 1:
                        self.pending[reqs[i]] = tok[:0:-1]  # reversed: pop() takes the next
                    tok = tok[0]
                else:
                    firsts[i] = tok = ModelError("the model returned an empty list of tokens for a slot")
            if tok is not None and not isinstance(tok, BaseException):
                seqs[i].append(tok)
                continue
            req = reqs[i]
            skipped.add(req)
            if tok is None:
                bucket = due.get(it - 1 + req.to_generate)
                if bucket is not None and req in bucket:
                    bucket.remove(req)
                    due.setdefault(it + req.to_generate, []).append(req)
                    continue
                tok = ModelError("the model returned no token for a slot that had already produced tokens")
            failed.append((req, tok))
        if self._scoring:
            self._take_scores(skipped)
        return self._check(tokens if firsts is None else firsts, skipped), skipped, failed

    def append_pending(self) -> tuple[list[Request], set[Request], int]:
        """Append the next of each request's ``pending`` tokens as one more iteration
        (:meth:`append`'s checks); return ``(finished, skipped, appended)``.

        Requests with none left (or that ended already) get no token: they are
        ``skipped`` and their ``max_tokens`` bucket moves one iteration on.
        A request's leftover tokens are dropped once it ends (a stop, or
        ``max_tokens``): tokens past the end are never appended.
        """
        reqs, seqs, pending, due, it = self.reqs, self.seqs, self.pending, self._due, self.iteration
        tokens: list = [None] * len(reqs)
        skipped: set[Request] = set()
        appended = 0
        for i, req in enumerate(reqs):
            more = pending.get(req)
            if more and req.reason is None and req.state is _RUNNING:
                tokens[i] = tok = more.pop()
                seqs[i].append(tok)
                appended += 1
                scores = self.pending_scores.get(req) if self.pending_scores else None
                if scores:
                    req.logprobs.append(scores.pop())
                if not more:
                    del pending[req]
                    if scores is not None:
                        del self.pending_scores[req]
                continue
            if more is not None:
                del pending[req]
                if self.pending_scores:
                    self.pending_scores.pop(req, None)
            skipped.add(req)
            left = req.params.max_tokens - req.num_generated  # its bucket: it - 1 + left
            bucket = due.get(it - 1 + left)
            if bucket is not None and req in bucket:
                bucket.remove(req)
                due.setdefault(it + left, []).append(req)
        return self._check(tokens, skipped), skipped, appended

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
                if tokens[i] in req.stop_tokens and req.state is _RUNNING \
                        and req.num_generated >= req.params.min_tokens:
                    req.reason, req.stop_match = _STOP, tokens[i]
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
