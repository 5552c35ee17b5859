"""Waits that an exception raised by a signal's handler may cut short without harm to the thread that
woke them: the condition variables and events a caller's thread waits on (a handle's ``result()``,
``Client.run()`` and ``status()``, ``wait_for_work()``), shared by the engine and the client.

``threading.Condition.wait`` releases its lock, waits to be woken, then takes the lock back. On a plain
``threading.Lock`` (``threading.Event``'s too) that last step is ``Lock.acquire()``, which a signal
interrupts: when the handler raises -- Ctrl-C's KeyboardInterrupt in a script or a notebook cell, a
worker's LoadInterrupted on SIGTERM (:meth:`slotserve.signals.SignalStopFlag.interrupting`), a test
runner's timeout -- the exception leaves ``wait`` without the lock, and the waiter's ``with`` block
then releases the lock that the thread which woke it holds (any thread may release a plain lock). That
thread's next ``wait`` raises "RuntimeError: cannot wait on un-acquired lock", its ``notify`` "cannot
notify on un-acquired lock", its ``with`` exit "release unlocked lock", and what the lock guards runs
unguarded meanwhile (a request submitted while the engine steps). On an ``RLock`` the lock is taken
back whole, signals or not (its ``_acquire_restore`` retries), the handler's exception is raised once
the waiter holds it again, and a release by a thread that does not hold it raises there, never
stealing another's. So those condition variables are on RLocks (:func:`condition`), and their events
are :class:`Event` (tests/support/interrupted_wait.py makes that moment happen).
"""

from __future__ import annotations

import threading

__all__ = ["Event", "condition"]


def condition(lock: threading.RLock | None = None) -> threading.Condition:
    """A condition variable on ``lock`` (an ``RLock``; None: a new one), for waits a caller's thread
    makes (see the module docstring)."""
    return threading.Condition(threading.RLock() if lock is None else lock)


class Event:
    """``threading.Event``'s ``set``, ``clear``, ``is_set`` and ``wait(timeout_s)`` (seconds; None:
    no limit; returns whether it is set), on :func:`condition`'s RLock rather than a plain lock: a
    ``wait`` that a signal's exception cuts short never releases the lock of the thread setting it."""

    __slots__ = ("_cond", "_flag")

    def __init__(self) -> None:
        self._cond = condition()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._flag, timeout_s)
