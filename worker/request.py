"""One request inside the engine (its state, which is also its public handle), and
stop-sequence matching (text stop strings: :mod:`worker.text`)."""

from __future__ import annotations

import enum
import threading
from typing import Callable, Sequence

from protocol.enums import FinishReason
from protocol.handle import RequestHandle
from protocol.request import RequestId, RequestParams
from protocol.waits import condition


class RequestState(enum.Enum):
    """Lifecycle: QUEUED -> RUNNING -> FINISHED, or QUEUED/RUNNING -> ENDING -> FINISHED.

    ENDING: cancel, deadline or a failed ``on_token`` decided the end; the
    engine carries it out at the start of its next iteration.
    """

    QUEUED = "queued"
    RUNNING = "running"
    ENDING = "ending"
    FINISHED = "finished"


class StopMatcher:
    """Incremental matcher for a request's stop sequences.

    One Knuth-Morris-Pratt automaton per pattern (Knuth, Morris & Pratt,
    "Fast pattern matching in strings", SIAM J. Comput. 1977): each generated
    token advances every automaton in amortised O(1), so a match spanning
    iterations is found without re-reading the sequence, and self-overlapping
    patterns (``[1, 1, 2]`` in ``1 1 1 2``) match where a naive reset would
    miss them.
    """

    __slots__ = ("_patterns", "_failure", "_state")

    def __init__(self, patterns: Sequence[tuple[int, ...]]) -> None:
        self._patterns = tuple(patterns)
        self._failure = tuple(failure_table(p) for p in self._patterns)
        self._state = [0] * len(self._patterns)

    def feed(self, token: int) -> tuple[int, ...] | None:
        """Advance by one generated token; return the first pattern that ends at it, else None."""
        hit = None
        state = self._state
        for k, pattern in enumerate(self._patterns):
            j = state[k]
            failure = self._failure[k]
            while j and pattern[j] != token:
                j = failure[j - 1]
            if pattern[j] == token:
                j += 1
            if j == len(pattern):
                if hit is None:
                    hit = pattern
                j = failure[j - 1]
            state[k] = j
        return hit


def failure_table(pattern: Sequence) -> list[int]:
    """KMP's failure function of ``pattern`` (token ids, or a str's characters):
    ``f[i]`` = length of the longest proper prefix of ``pattern[:i+1]`` that is also its suffix."""
    f = [0] * len(pattern)
    j = 0
    for i in range(1, len(pattern)):
        while j and pattern[i] != pattern[j]:
            j = f[j - 1]
        if pattern[i] == pattern[j]:
            j += 1
        f[i] = j
    return f


class Request(RequestHandle):
    """One accepted request: the engine's state of it, and the handle
    ``submit_request`` returns.

    To callers it is a :class:`protocol.handle.RequestHandle` (the surface the
    client SDK's handles share); ``prompt`` is always token ids here (a text
    prompt as the engine tokenised it), and ``text``, when the model has a
    tokenizer, is the decode of ``tokens`` (special tokens left out), cut at a
    matched stop string; while the request runs, only its released part when
    the engine follows its text (``detok``), else None without a tokenizer.
    Its other attributes are the engine's, touched in the per-iteration loop
    (``__slots__``, plain attributes):

    - ``seq``: the request's tokens: prompt (``usage.prompt_tokens`` of them), then resume tokens, then generated
      ones. While it waits it is a tuple (the prompt's own, when nothing was
      resumed); :meth:`SlotTable.occupy <worker.slots.SlotTable.occupy>` turns
      it into the list the model reads and the engine appends to.
    - ``to_generate``: new tokens still to generate (``max_tokens`` minus resumed ones).
    - ``stop_tokens``: the stop token ids in force (the engine's default unless
      the request gave its own).
    - ``slot``/``pos``: its slot and its index in the batch lists while running, else None.
    - ``queue_seq``: its ticket while queued (:class:`protocol.queue.PriorityQueue`).
    - ``deadline``: on the engine's clock, or None.
    - ``detok``: its :class:`~worker.text.TextStream` when the engine follows its
      text token by token (stop strings, ``on_text``), else None; ``on_text``: the
      caller's text callback, or None.

    One object per request, not a state object behind a handle: submission is
    per request, and bench/engine.py's end-to-end target (>= 5x the naive
    engine) needs it lean; a handle object of its own cost about 7 % of a
    plain request's submit + run (instructions, measured with callgrind).
    """

    __slots__ = ("seq", "to_generate", "stop_tokens", "matcher", "on_token", "callback", "deadline", "state",
                 "reason", "stop_match", "slot", "pos", "queue_seq", "detok", "on_text", "_completion")

    def __init__(self, params: RequestParams, request_id: RequestId | None, prompt: tuple[int, ...],
                 resume: tuple[int, ...], stop_tokens: frozenset[int],
                 callback: Callable[[list[int]], object] | None, on_token: Callable[[int], object] | None,
                 submitted_s: float, deadline: float | None, completion: Completion) -> None:
        RequestHandle.__init__(self, request_id, params, submitted_s, len(prompt))
        self.seq = prompt + resume if resume else prompt
        self.to_generate = params.max_tokens - len(resume)
        self.stop_tokens = stop_tokens
        self.matcher = None
        if params.stop_sequences:
            self.matcher = StopMatcher(params.stop_sequences)
            for t in resume:  # resumed tokens take part in matching
                self.matcher.feed(t)
        self.on_token = on_token
        self.callback = callback
        self.deadline = deadline
        self.state = RequestState.QUEUED
        self.reason: FinishReason | None = None
        self.stop_match: int | tuple[int, ...] | str | None = None  # what stopped it (stop_reason)
        self.slot: int | None = None
        self.pos: int | None = None
        self.queue_seq: int | None = None
        self.detok = None
        self.on_text: Callable[[str], object] | None = None
        self._completion = completion

    @property
    def prompt(self) -> list[int]:
        return list(self.seq[:self._prompt_tokens])

    @property
    def tokens(self) -> list[int]:
        return list(self.seq[self._prompt_tokens:])

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, resumed ones included (the engine's count for stop rules)."""
        return len(self.seq) - self._prompt_tokens

    @property
    def text(self) -> str | None:
        detok = self.detok
        if detok is not None:
            return detok.text
        detokenize = self._completion.detokenize
        return None if detokenize is None else detokenize(self.tokens)

    def _wait(self, timeout: float | None) -> None:
        c = self._completion
        if c.delivering is self and c.delivering_thread == threading.get_ident():
            return  # called from its own completion callback
        with c.cond:
            c.waiters += 1
            try:
                if not c.cond.wait_for(self.done, timeout):
                    raise TimeoutError(f"request {self.request_id!r} not done after {timeout} s")
            finally:
                c.waiters -= 1


class Completion:
    """Lets ``Request.result`` block until a request is done, without polling;
    ``detokenize`` is the model's tokenizer's ``decode`` (None without one),
    for the requests' ``text``.

    One per engine. After every terminal callback the engine reads
    ``waiters`` without the lock and calls :meth:`notify` when it is nonzero,
    so an engine nobody waits on pays one integer read per finished request.
    No wakeup is lost: a waiter increments ``waiters`` under ``cond`` before
    it checks ``done()``, and the engine marks the handle done before it
    reads ``waiters``.
    """

    __slots__ = ("cond", "waiters", "delivering", "delivering_thread", "detokenize")

    def __init__(self, detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.detokenize = detokenize
        self.cond = condition()  # (on an RLock: a result() cut short by a signal takes no other's lock, protocol.waits)
        self.waiters = 0
        # The request whose completion callback is running, and on which thread:
        # result() called from inside that callback must return, not wait on itself.
        self.delivering: Request | None = None
        self.delivering_thread = 0

    def notify(self) -> None:
        if self.waiters:
            with self.cond:
                self.cond.notify_all()
