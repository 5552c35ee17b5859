"""One request's state inside the engine, its public handle, and stop-sequence matching.

:class:`RequestHandle` is the public API of what ``submit_request``
returns; the object itself is a :class:`Request`, the engine's per-request
state (a subclass: one object per request rather than a state object plus a
wrapper, as submission cost is per request). :class:`Request` is
deliberately plain (``__slots__``, no properties): the engine touches it in
its per-iteration loop. ``submit_options`` holds ``submit_request``'s
keyword options and their defaults.
"""

from __future__ import annotations

import enum
import inspect
import threading
from typing import Callable, Sequence

from protocol.enums import FinishReason
from protocol.validation import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, ValidRequest
from worker.models.base import GREEDY, SamplingParams


class _EngineDefault:
    """Marker for "stop_token not given": use the engine's default (None means *no* stop token)."""

    def __repr__(self) -> str:
        return "<engine default>"


ENGINE_DEFAULT = _EngineDefault()


def submit_options(*, stop_token=ENGINE_DEFAULT, stop_sequences=(),
                   on_token: Callable[[int], object] | None = None, priority=0, timeout_s=None,
                   request_id=None, temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P, top_k=0,
                   seed=None, resume_tokens=()) -> tuple:
    """``submit_request``'s keyword options, in this order, defaults applied.

    Raises TypeError, worded as for ``submit_request``, for an unknown name.
    """
    return (stop_token, stop_sequences, on_token, priority, timeout_s, request_id,
            temperature, top_p, top_k, seed, resume_tokens)


submit_options.__qualname__ = "BatchInferenceEngine.submit_request"  # names it in TypeErrors


def submit_signature(method: Callable) -> inspect.Signature:
    """``method(self, ..., **options)``'s signature with ``**options`` spelled out."""
    sig = inspect.signature(method)
    return sig.replace(parameters=[*list(sig.parameters.values())[:-1],
                                   *inspect.signature(submit_options).parameters.values()])


class RequestState(enum.Enum):
    """Lifecycle: QUEUED -> RUNNING -> FINISHED, or QUEUED/RUNNING -> ENDING -> FINISHED.

    ENDING: cancel, deadline or a failed ``on_token`` decided the end; the
    engine carries it out at the start of its next iteration.
    """

    QUEUED = "queued"
    RUNNING = "running"
    ENDING = "ending"
    FINISHED = "finished"


_QUEUED = RequestState.QUEUED
_new = object.__new__


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
    - ``done()``, ``result(timeout)``: see below.

    Handles are :class:`Request` objects; only the names above are public
    (``request_id`` and ``error`` are plain attributes of the request).
    """

    __slots__ = ()

    @property
    def prompt(self: Request) -> list[int]:
        return list(self.seq[: self.prompt_len])

    @property
    def tokens(self: Request) -> list[int]:
        return list(self.seq[self.prompt_len:])

    @property
    def finish_reason(self: Request) -> FinishReason | None:
        return self.reason if self.state is RequestState.FINISHED else None

    @property
    def stop_reason(self: Request) -> int | tuple[int, ...] | None:
        """What stopped a ``"stop"`` request: the stop token (int) or the stop
        sequence (tuple) that matched, as vLLM's ``stop_reason``; else None."""
        return self.stop_match if self.state is RequestState.FINISHED and self.reason is \
            FinishReason.STOP else None

    def done(self: Request) -> bool:
        """True once the request ended and its completion callback has returned."""
        return self.delivered

    def result(self: Request, timeout: float | None = None) -> list[int]:
        """Block until done; return the final sequence (prompt + generated tokens).

        ``timeout`` in seconds (None waits forever: someone must be running
        the engine). Raises ``TimeoutError`` when it passes first. For every
        ending -- check ``finish_reason`` and ``error`` -- the sequence holds
        the tokens produced until then. Called from the request's own
        completion callback it returns at once.
        """
        c = self.completion
        if not self.delivered and not (c.delivering is self
                                       and c.delivering_thread == threading.get_ident()):
            with c.cond:
                c.waiters += 1
                try:
                    if not c.cond.wait_for(lambda: self.delivered, timeout):
                        raise TimeoutError(
                            f"request {self.request_id!r} not done after {timeout} s"
                        )
                finally:
                    c.waiters -= 1
        return list(self.seq)

    @property
    def _req(self) -> Request:
        """The request itself (handles used to wrap it; kept for code that reached in)."""
        return self

    def __repr__(self: Request) -> str:
        return (f"RequestHandle(request_id={self.request_id!r}, "
                f"tokens={len(self.seq) - self.prompt_len}, "
                f"finish_reason={self.finish_reason})")


class Request(RequestHandle):
    """Engine-side state of one accepted request; to callers, its :class:`RequestHandle`.

    ``seq`` is the request's tokens: prompt, then resume tokens, then
    generated tokens. While it waits it is a tuple (a tuple of ints costs the
    garbage collector nothing once it has seen it, and thousands may wait);
    :meth:`SlotTable.occupy <worker.slots.SlotTable.occupy>` turns it into
    the list the model reads by reference and the engine appends to, so
    nothing rebuilds it per iteration. ``slot``/``pos`` are its slot and its
    index in the engine's batch lists while running, else None. ``order``
    is its submission number, set by :class:`~worker.scheduler.RequestQueue`.
    """

    __slots__ = ("request_id", "seq", "prompt_len", "to_generate", "stop_tokens", "matcher",
                 "on_token", "callback", "priority", "order", "deadline", "sampling", "state",
                 "reason", "stop_match", "error", "slot", "pos", "delivered", "completion")

    def __init__(self, v: ValidRequest, default_stop_tokens: frozenset[int],
                 callback: Callable[[list[int]], object] | None,
                 on_token: Callable[[int], object] | None,
                 completion: Completion | None = None) -> None:
        """Engine state of a validated request; ``completion`` is the engine's.

        Raises ValueError when ``callback`` or ``on_token`` is not callable.
        """
        if callback is not None and not callable(callback):
            raise ValueError(f"callback must be callable or None, got {type(callback).__name__}")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be callable or None, got {type(on_token).__name__}")
        (prompt, max_tokens, stop_tokens, stop_sequences, priority, _, request_id,
         temperature, top_p, top_k, seed, resume) = v  # one unpack: this runs per request
        n = len(prompt)
        self.request_id = request_id
        self.seq = (*prompt, *resume) if resume else tuple(prompt)  # our own copy
        self.prompt_len = n
        self.to_generate = max_tokens - len(resume) if resume else max_tokens  # new tokens
        self.stop_tokens = default_stop_tokens if stop_tokens is None else stop_tokens
        if stop_sequences:
            self.matcher = StopMatcher(stop_sequences)
            for t in resume:  # resumed tokens take part in matching
                self.matcher.feed(t)
        else:
            self.matcher = None
        self.on_token = on_token
        self.callback = callback
        self.priority = priority
        self.deadline: float | None = None  # on the engine's clock; the engine sets it
        if temperature or top_p != 1.0 or top_k or seed is not None:
            self.sampling = SamplingParams(temperature, top_p, top_k, seed)
        else:
            self.sampling = GREEDY
        self.state = _QUEUED
        self.reason: FinishReason | None = None
        self.stop_match: int | tuple[int, ...] | None = None  # what stopped it (stop_reason)
        self.error: BaseException | None = None
        self.slot: int | None = None
        self.pos: int | None = None
        self.delivered = False  # terminal callback has run (done())
        self.completion = completion

    @staticmethod  # (not a classmethod: that builds a bound method per call)
    def plain(prompt: list[int], max_tokens: int, stop_tokens: frozenset[int],
              callback: Callable[[list[int]], object] | None,
              completion: Completion) -> Request:
        """A request whose options are all at their defaults, from its validated
        prompt and ``max_tokens`` (no :class:`ValidRequest` to build and unpack:
        this is the per-request path of a plain ``submit_request(prompt, n,
        callback)``). Sets the same fields as ``__init__`` -- keep the two in step.

        Raises ValueError when ``callback`` is not callable.
        """
        if callback is not None and not callable(callback):
            raise ValueError(f"callback must be callable or None, got {type(callback).__name__}")
        self = _new(Request)
        self.request_id = None
        self.seq = tuple(prompt)
        self.prompt_len = len(prompt)
        self.to_generate = max_tokens
        self.stop_tokens = stop_tokens
        self.matcher = self.on_token = None
        self.callback = callback
        self.priority = 0
        self.deadline = None
        self.sampling = GREEDY
        self.state = _QUEUED
        self.reason = self.stop_match = self.error = self.slot = self.pos = None
        self.delivered = False
        self.completion = completion
        return self


class Completion:
    """Lets ``RequestHandle.result`` block until a request is done, without polling.

    One per engine. After every terminal callback the engine reads
    ``waiters`` without the lock and calls :meth:`notify` when it is nonzero,
    so an engine nobody waits on pays one integer read per finished request.
    No wakeup is lost: a waiter increments ``waiters`` under ``cond`` before
    it checks ``delivered``, and the engine sets ``delivered`` before it
    reads ``waiters``.
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
