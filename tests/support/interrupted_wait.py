"""A wait on the main thread cut short by a signal's exception while another thread holds the lock
the wait must take back: the interrupted waiter must release nothing that is not its own.

``threading.Condition.wait`` releases its lock, waits to be woken, then takes the lock back. On a
plain ``threading.Lock`` that last step is ``Lock.acquire()``, which a signal interrupts: when the
signal's handler raises (Ctrl-C's KeyboardInterrupt, pytest-timeout's "Timeout", a worker's
LoadInterrupted on SIGTERM: :meth:`slotserve.signals.SignalStopFlag.interrupting`), the exception
leaves ``wait`` without the lock, and the waiter's ``with`` block then releases the lock that the
thread which woke it holds (a plain lock may be released by any thread). That thread's next
``wait`` on it raises "RuntimeError: cannot wait on un-acquired lock", its ``notify`` "cannot notify
on un-acquired lock", its own ``with`` exit "release unlocked lock", and what it guards runs unguarded
meanwhile. On an ``RLock`` the lock is taken back whole (its ``_acquire_restore`` waits through
signals) and the handler's exception is raised once the waiter holds it again.

:func:`interrupt_a_wait` makes that moment happen on purpose, with no sleep: the other thread takes the
lock, wakes the waiter, waits until the main thread's innermost frame is ``Condition.wait`` taking its
lock back, sends SIGUSR1 to the main thread (whose handler raises :class:`Interrupted`), waits until
the signal has reached it (the wakeup fd: :func:`signal.set_wakeup_fd`), and only then lets the lock go.
"""

from __future__ import annotations

import inspect
import os
import select
import signal
import sys
import threading
from typing import Callable

import pytest

from tests.support.waits import wait_until

_SOURCE, _FIRST = inspect.getsourcelines(threading.Condition.wait)
_RESTORE = _FIRST + next(i for i, line in enumerate(_SOURCE) if "self._acquire_restore(" in line)
"""The line of ``Condition.wait`` that takes its lock back (where an RLock's C ``_acquire_restore`` runs)."""


class Interrupted(Exception):
    """What the signal's handler raises on the main thread."""


def _raise(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


def _waiting(frame, cond: threading.Condition) -> bool:
    """Whether the main thread's innermost frame ``frame`` waits in ``cond.wait`` (not another
    condition's: ``Thread.start`` waits on one too)."""
    return frame is not None and frame.f_code is threading.Condition.wait.__code__ \
        and frame.f_locals.get("self") is cond


def _taking_back(frame, cond: threading.Condition) -> bool:
    """Whether ``frame`` is ``cond.wait`` taking its lock back: in a plain lock's ``_acquire_restore``
    (Python code), or at the line that calls an RLock's (C code)."""
    return frame is not None and frame.f_locals.get("self") is cond and (
        frame.f_code is threading.Condition._acquire_restore.__code__
        or (frame.f_code is threading.Condition.wait.__code__ and frame.f_lineno == _RESTORE))


def interrupt_a_wait(cond: threading.Condition, wait: Callable[[], object],
                     wake: Callable[[], object] | None = None) -> None:
    """Call ``wait()`` -- a call that waits on ``cond`` (a condition variable, or an event's) -- on the
    main thread, and interrupt it as the module docstring says while another thread holds ``cond``'s
    lock, having woken the waiter (``wake()`` under the lock; default ``cond.notify_all()``). Asserts
    that the main thread gets :class:`Interrupted` itself, no RuntimeError, and that the other thread
    kept its lock until it let it go (its ``with`` block ends without error). POSIX only (signals to a
    thread)."""
    main = threading.main_thread().ident
    assert threading.get_ident() == main, "signal handlers run on the main thread only"
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous = signal.signal(signal.SIGUSR1, _raise)
    errors: list[BaseException] = []

    def other() -> None:
        sent = False
        try:
            wait_until(lambda: _waiting(sys._current_frames().get(main), cond), 10, "the main thread to wait")
            with cond:
                (wake or cond.notify_all)()
                wait_until(lambda: _taking_back(sys._current_frames().get(main), cond), 10,
                           "the main thread to wait for the lock back")
                signal.pthread_kill(main, signal.SIGUSR1)
                sent = True
                assert select.select([read_end], [], [], 10)[0], "the signal did not reach the main thread"
                held = cond._is_owned()  # (this thread's, on an RLock; anyone's, on a plain lock)
            assert held, "the interrupted waiter released the lock this thread held"
        except BaseException as e:  # noqa: BLE001 -- the test reports it
            errors.append(e)
            if not sent:  # (the main thread would wait on: end its wait)
                signal.pthread_kill(main, signal.SIGUSR1)

    t = threading.Thread(target=other, name="holds-the-lock")
    t.start()
    try:
        with pytest.raises(Interrupted):
            wait()
    finally:
        t.join(20)
        signal.signal(signal.SIGUSR1, previous)
        signal.set_wakeup_fd(previous_fd)
        os.close(read_end)
        os.close(write_end)
    assert not t.is_alive(), "the thread holding the lock did not end"
    assert not errors, errors
