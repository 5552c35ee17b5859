"""One request's state inside the engine, its public handle, and stop-sequence matching.

:class:`Request` is internal and deliberately plain (``__slots__``, no
properties): the engine touches it in its per-iteration loop.
:class:`RequestHandle` is what ``submit_request`` returns.
"""

from __future__ import annotations

import enum
import threading
from typing import Callable, Sequence

from protocol.enums import FinishReason
from protocol.validation import ValidRequest
from worker.models.base import GREEDY, SamplingParams


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
    """Engine-side state of one accepted request (not public API).

    ``seq`` is the request's one token list: prompt, then resume tokens, then
    generated tokens; the model reads it by reference, the engine appends to
    it, nothing rebuilds it. ``slot``/``pos`` are its slot and its index in
    the engine's batch lists while running, else None.
    """

    __slots__ = ("request_id", "seq", "prompt_len", "limit", "stop_tokens", "matcher",
                 "on_token", "callback", "priority", "deadline", "sampling", "state",
                 "reason", "stop_reason", "error", "slot", "pos", "done")

    def __init__(self, v: ValidRequest, default_stop_tokens: frozenset[int],
                 callback: Callable[[list[int]], object] | None,
                 on_token: Callable[[int], object] | None) -> None:
        """Engine state of a validated request.

        Raises ValueError when ``callback`` or ``on_token`` is not callable.
        """
        if callback is not None and not callable(callback):
            raise ValueError(f"callback must be callable or None, got {type(callback).__name__}")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be callable or None, got {type(on_token).__name__}")
        (prompt, max_tokens, stop_tokens, stop_sequences, priority, _, request_id,
         temperature, top_p, top_k, seed, resume) = v  # one unpack: this runs per request
        self.request_id = request_id
        self.seq = prompt + resume  # the request's own list from here on
        self.prompt_len = n = len(prompt)
        self.limit = n + max_tokens  # len(seq) at which max_tokens is reached
        self.stop_tokens = default_stop_tokens if stop_tokens is None else stop_tokens
        self.matcher = None
        if stop_sequences:
            self.matcher = StopMatcher(stop_sequences)
            for t in resume:  # resumed tokens take part in matching
                self.matcher.feed(t)
        self.on_token = on_token
        self.callback = callback
        self.priority = priority
        self.deadline: float | None = None  # on the engine's clock; the engine sets it
        self.sampling = GREEDY
        if temperature or top_p != 1.0 or top_k or seed is not None:
            self.sampling = SamplingParams(temperature, top_p, top_k, seed)
        self.state = RequestState.QUEUED
        self.reason: FinishReason | None = None
        self.stop_reason: int | tuple[int, ...] | None = None
        self.error: BaseException | None = None
        self.slot: int | None = None
        self.pos: int | None = None
        self.done = False  # terminal callback has run


class Completion:
    """Lets ``RequestHandle.result`` block until a request is done, without polling.

    One per engine. The engine calls :meth:`notify` after every terminal
    callback; it touches the condition only while somebody waits, so an engine
    nobody waits on pays one integer read per finished request.
    """

    __slots__ = ("cond", "waiters", "delivering", "delivering_thread")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.waiters = 0
        # The request whose completion callback is running, and on which thread:
        # result() called from inside that callback must return, not wait on itself.
        self.delivering: Request | None = None
        self.delivering_thread = 0

    def notify(self) -> None:
        if self.waiters:
            with self.cond:
                self.cond.notify_all()


class RequestHandle:
    """The caller's view of a submitted request; safe to read from any thread.

    - ``request_id``: the caller's id, or the one the engine picked.
    - ``prompt``: the prompt token ids (a copy).
    - ``tokens``: tokens generated so far, including ``resume_tokens`` (a copy).
    - ``finish_reason``: None until the request ends, then a
      :class:`~protocol.enums.FinishReason`.
    - ``stop_reason``: for ``"stop"``, the stop token or stop sequence that matched.
    - ``error``: None, or the exception that ended the request (model error,
      raising ``on_token``) or that its completion callback raised.
    """

    __slots__ = ("_req", "_completion")

    def __init__(self, request: Request, completion: Completion) -> None:
        self._req = request
        self._completion = completion

    @property
    def request_id(self):
        return self._req.request_id

    @property
    def prompt(self) -> list[int]:
        return self._req.seq[: self._req.prompt_len]

    @property
    def tokens(self) -> list[int]:
        return self._req.seq[self._req.prompt_len:]

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._req.reason if self._req.state is RequestState.FINISHED else None

    @property
    def stop_reason(self) -> int | tuple[int, ...] | None:
        """What stopped a ``"stop"`` request: the stop token (int) or the stop
        sequence (tuple) that matched, as vLLM's ``stop_reason``; else None."""
        req = self._req
        return req.stop_reason if req.state is RequestState.FINISHED and req.reason is \
            FinishReason.STOP else None

    @property
    def error(self) -> BaseException | None:
        return self._req.error

    def done(self) -> bool:
        """True once the request ended and its completion callback has returned."""
        return self._req.done

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; return the final sequence (prompt + generated tokens).

        ``timeout`` in seconds (None waits forever: someone must be running
        the engine). Raises ``TimeoutError`` when it passes first. For every
        ending -- check ``finish_reason`` and ``error`` -- the sequence holds
        the tokens produced until then. Called from the request's own
        completion callback it returns at once.
        """
        req = self._req
        c = self._completion
        if not req.done and not (c.delivering is req
                                 and c.delivering_thread == threading.get_ident()):
            with c.cond:
                c.waiters += 1
                try:
                    if not c.cond.wait_for(lambda: req.done, timeout):
                        raise TimeoutError(
                            f"request {req.request_id!r} not done after {timeout} s"
                        )
                finally:
                    c.waiters -= 1
        return list(req.seq)

    def __repr__(self) -> str:
        return (f"RequestHandle(request_id={self.request_id!r}, "
                f"tokens={len(self._req.seq) - self._req.prompt_len}, "
                f"finish_reason={self.finish_reason})")

