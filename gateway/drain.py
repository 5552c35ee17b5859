"""Stopping without dropping anyone: the gateway's drain state and its in-flight registry.

:func:`gateway.server.run` drives it from the stop flag:

1. :meth:`Drain.begin`: from now on a new generation request or
   ``/v1/models`` gets 503 in OpenAI's shape, with ``Retry-After`` and
   ``Connection: close`` (:data:`REFUSED`), and ``/health`` 503 ``draining``,
   so a load balancer sends new work elsewhere. The requests already in
   flight go on.
2. :meth:`Drain.wait_idle`: they get up to ``shutdown_timeout_s`` to finish.
3. :meth:`Drain.end_all`: each one still open is ended (its ``end``, the
   abort event of :class:`AbortableCall`): a stream sends what it has, then a
   final ``{"error": ...}`` event and ``data: [DONE]``; a request not
   answered yet answers 503; their broker requests are cancelled.

A second stop signal skips what is left of step 2.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, TypeVar

T = TypeVar("T")

TICK_S = 0.1
"""How often a wait here looks at the caller's ``halt`` flag (a signal handler sets
it; nothing can wake the loop for it), as uvicorn's own main loop ticks."""

REFUSED = ("the gateway is shutting down and takes no new requests; retry (another replica, or this one once "
           "restarted)")
"""The 503 message of a request that arrives while the gateway drains."""


def deadline_passed(timeout_s: float) -> str:
    """The message of a request ended because the drain's ``timeout_s`` ran out."""
    return (f"the gateway is shutting down and this request did not finish within its shutdown timeout of "
            f"{timeout_s:g} s (--shutdown-timeout-s): it was cancelled; retry")


END_GRACE_S = 2.0
"""Seconds the requests ended at shutdown get to send their last words (a 503, or a
stream's error event and ``[DONE]``: milliseconds, unless a client stopped reading);
:func:`gateway.server.run` then closes a connection still busy."""

HALTED = "the gateway was stopped at once (a second stop signal): this request was cancelled; retry"
"""The message of a request ended by a second stop signal."""

PARENT_GONE = ("the gateway was stopped at once (the process that started it, slotserve up, is gone, and its "
               "broker and workers with it): this request was cancelled; retry")
"""The message of a request ended because the gateway's parent process is gone (``slotserve up``
killed): no drain, nothing could finish."""


async def unless_ended(aw: Awaitable[T], ended: asyncio.Event) -> tuple[bool, T | None]:
    """``(True, aw's result)``; or, when ``ended`` is set first (the drain ended the request it serves,
    :meth:`AbortableCall.end`), ``(False, None)`` with ``aw`` cancelled (and awaited). For the waits of a
    request in flight that look at no abort event (its body, the broker link, the tokenizer's work): the
    drain's end reached them only once they were over, after the server's grace (:data:`END_GRACE_S`) had
    cut the request with no answer. ``aw``'s exception is raised; a cancel of the caller cancels ``aw``
    and goes on."""
    work = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(ended.wait())
    try:
        await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        stop.cancel()
    if work.done():
        return True, work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # (the caller's own cancel, not the one just sent)
            raise
    except Exception:  # noqa: BLE001 -- what failed as it was cancelled: the request is ended anyway
        pass
    return False, None


class AbortableCall(Protocol):
    """A request being served: :meth:`end` aborts it (event loop only; once; it then answers
    503, or ends its stream with an error event, and cancels its broker requests)."""

    def end(self, message: str) -> None: ...


def _never() -> bool:
    return False


class Drain:
    """The draining flag and the requests in flight (event loop only)."""

    __slots__ = ("draining", "ending", "_calls", "_idle")

    def __init__(self) -> None:
        self.draining = False
        """True from :meth:`begin` on: new requests are refused."""
        self.ending: str | None = None
        """Once :meth:`end_all` ran: its message (a request added later is ended at once)."""
        self._calls: set[AbortableCall] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def begin(self) -> int:
        """Refuse new requests from now on; returns how many are in flight."""
        self.draining = True
        return len(self._calls)

    def add(self, call: AbortableCall) -> None:
        """``call`` is in flight until :meth:`discard`."""
        self._calls.add(call)
        self._idle.clear()
        if self.ending is not None:
            call.end(self.ending)

    def discard(self, call: AbortableCall) -> None:
        """``call`` is over (answered, its stream ended, or its client gone); a no-op if not added."""
        self._calls.discard(call)
        if not self._calls:
            self._idle.set()

    def end_all(self, message: str) -> int:
        """End every request in flight with ``message``; returns how many."""
        self.ending = message
        calls = list(self._calls)
        for c in calls:
            c.end(message)
        return len(calls)

    async def wait_idle(self, timeout_s: float, halt: Callable[[], bool] = _never) -> bool:
        """Wait until nothing is in flight (True), or until ``timeout_s`` seconds passed
        or ``halt()`` turned true (False; ``halt`` is looked at every :data:`TICK_S`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._idle.is_set():
            left = deadline - loop.time()
            if left <= 0 or halt():
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), min(TICK_S, left))
            except TimeoutError:
                pass
        return True
