"""One request inside the engine: its state, its public handle, stop-sequence matching.

:class:`Request` is the engine's per-request state, touched in the
per-iteration loop (``__slots__``, plain attributes). :class:`EngineHandle` is
what ``submit_request`` returns: the public surface shared with the client
SDK's handles (:class:`protocol.handle.RequestHandle`), read from the request.
"""

from __future__ import annotations

import enum
import threading
from typing import Callable, Sequence

from protocol.enums import FinishReason
from protocol.handle import RequestHandle
from protocol.request import RequestId, RequestParams


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
        self._failure = tuple(_failure_table(p) for p in self._patterns)
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


def _failure_table(pattern: tuple[int, ...]) -> list[int]:
    """``f[i]`` = length of the longest proper prefix of ``pattern[:i+1]`` that is also its suffix."""
    f = [0] * len(pattern)
    j = 0
    for i in range(1, len(pattern)):
        while j and pattern[i] != pattern[j]:
            j = f[j - 1]
        if pattern[i] == pattern[j]:
            j += 1
        f[i] = j
    return f


class Request:
    """Engine-side state of one accepted request.

    - ``seq``: the request's tokens: prompt, then resume tokens, then generated
      ones. While it waits it is a tuple (the prompt's own, when nothing was
      resumed); :meth:`SlotTable.occupy <worker.slots.SlotTable.occupy>` turns
      it into the list the model reads and the engine appends to.
    - ``to_generate``: new tokens still to generate (``max_tokens`` minus resumed ones).
    - ``stop_tokens``: the stop token ids in force (the engine's default unless
      the request gave its own).
    - ``slot``/``pos``: its slot and its index in the batch lists while running, else None.
    - ``queue_seq``: its ticket while queued (:class:`protocol.queue.PriorityQueue`).
    - ``deadline``: on the engine's clock, or None.
    - ``handle``: its :class:`EngineHandle` until it has been delivered.
    """

    __slots__ = ("params", "request_id", "handle", "seq", "prompt_len", "to_generate", "stop_tokens", "matcher",
                 "on_token", "callback", "sampling", "deadline", "state", "reason", "stop_match", "error",
                 "slot", "pos", "queue_seq")

    def __init__(self, params: RequestParams, request_id: RequestId | None, prompt: tuple[int, ...],
                 resume: tuple[int, ...], stop_tokens: frozenset[int],
                 callback: Callable[[list[int]], object] | None,
                 on_token: Callable[[int], object] | None, deadline: float | None) -> None:
        self.params = params
        self.request_id = request_id
        self.handle: EngineHandle | None = None
        self.seq = prompt + resume if resume else prompt
        self.prompt_len = len(prompt)
        self.to_generate = params.max_tokens - len(resume)
        self.stop_tokens = stop_tokens
        self.matcher = None
        if params.stop_sequences:
            self.matcher = StopMatcher(params.stop_sequences)
            for t in resume:  # resumed tokens take part in matching
                self.matcher.feed(t)
        self.on_token = on_token
        self.callback = callback
        self.sampling = params.sampling
        self.deadline = deadline
        self.state = RequestState.QUEUED
        self.reason: FinishReason | None = None
        self.stop_match: int | tuple[int, ...] | None = None  # what stopped it (stop_reason)
        self.error: BaseException | None = None
        self.slot: int | None = None
        self.pos: int | None = None
        self.queue_seq: int | None = None


class EngineHandle(RequestHandle):
    """The handle ``BatchInferenceEngine.submit_request`` returns; see
    :class:`protocol.handle.RequestHandle` for its attributes.

    ``prompt`` is always token ids here (a text prompt as the engine tokenised
    it); ``text`` is the decode of ``tokens`` (special tokens left out) for
    text and chat prompts, else None.
    """

    __slots__ = ("_request", "_completion", "_detokenize")

    def __init__(self, request: Request, submitted_s: float, completion: Completion,
                 detokenize: Callable[[list[int]], str] | None) -> None:
        super().__init__(request.request_id, request.params, submitted_s)
        self._request = request
        self._completion = completion
        self._detokenize = detokenize
        self._prompt_tokens = request.prompt_len

    @property
    def prompt(self) -> list[int]:
        r = self._request
        return list(r.seq[:r.prompt_len])

    @property
    def tokens(self) -> list[int]:
        r = self._request
        return list(r.seq[r.prompt_len:])

    @property
    def text(self) -> str | None:
        return None if self._detokenize is None else self._detokenize(self.tokens)

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
    """Lets ``EngineHandle.result`` block until a request is done, without polling.

    One per engine. After every terminal callback the engine reads
    ``waiters`` without the lock and calls :meth:`notify` when it is nonzero,
    so an engine nobody waits on pays one integer read per finished request.
    No wakeup is lost: a waiter increments ``waiters`` under ``cond`` before
    it checks ``done()``, and the engine marks the handle done before it
    reads ``waiters``.
    """

    __slots__ = ("cond", "waiters", "delivering", "delivering_thread")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.waiters = 0
        # The handle whose completion callback is running, and on which thread:
        # result() called from inside that callback must return, not wait on itself.
        self.delivering: EngineHandle | None = None
        self.delivering_thread = 0

    def notify(self) -> None:
        if self.waiters:
            with self.cond:
                self.cond.notify_all()
