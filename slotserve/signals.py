"""Stop flags that signal handlers may set, and the parent watch of child processes.

A signal handler here only records that a stop was asked for (STYLE rule 9):
it assigns one attribute and takes no lock. (``threading.Event.set`` takes
the Event's lock, and a handler runs on the main thread between two
bytecodes, possibly while that same thread holds the lock inside
``Event.wait``: a deadlock.) Loops notice the flag at their next tick, or at
once through the wakeup pipe that :func:`signal.set_wakeup_fd` writes to.
The one exception, :meth:`SignalStopFlag.interrupting`, also raises on the
main thread, for a model load that checks no flag (a worker's); a stop that
another thread finds (:func:`watch_parent`: the parent is gone) reaches such a
load through :meth:`SignalStopFlag.interrupt_main`, a real SIGTERM delivered
to the main thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for_handles

log = logging.getLogger(__name__)

_SIGHUP = getattr(signal, "SIGHUP", None)  # POSIX only
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, _SIGHUP) if s is not None)
"""The signals that ask a slotserve command to stop: Ctrl-C, ``kill PID``, a
closed terminal (or a process manager's reload/stop)."""

PARENT_GONE = "parent gone"
"""The reason :func:`watch_parent` sets a child's stop flag with."""


class SignalStopFlag:
    """``is_set()`` / ``set(reason)``, like ``threading.Event`` but safe to set
    from a signal handler (no lock) and remembering the first reason given
    (a signal number or a short text). It also counts how often it was set:
    :meth:`repeated` (a second Ctrl-C) asks for a stop at once, where the
    first one lets work in flight finish (the HTTP gateway's drain)."""

    __slots__ = ("reason", "count", "_interrupt")

    def __init__(self) -> None:
        self.reason: int | str | None = None
        self.count = 0  # a handler and a thread setting it at once may lose one count, never the stop
        self._interrupt: type[BaseException] | None = None  # raised by set() on the main thread (interrupting)

    def set(self, reason: int | str = "stop") -> None:
        if self.reason is None:
            self.reason = reason
        self.count += 1
        interrupt = self._interrupt
        if interrupt is not None and threading.current_thread() is threading.main_thread():
            self._interrupt = None  # once: the unwinding (a build's subprocess killed, a lock released) runs on
            raise interrupt(f"stop asked for ({self.reason})")

    @contextmanager
    def interrupting(self, exc: type[BaseException]) -> Iterator[None]:
        """While inside, a stop set on the main thread -- a signal handler's -- also raises ``exc``
        (with a message naming the reason) there, once, as Python's default Ctrl-C raises
        KeyboardInterrupt; raises it at once when the flag is set already. For a step that checks no
        flag and may take minutes, a model's load (C code, a kernel build's compiler subprocess, a lock
        wait): it then ends at the interpreter's next bytecode, or at once from a blocking call that a
        signal interrupts (a read, a wait, a lock), its ``finally`` blocks and context managers run. The
        one place a handler does more than set the flag (STYLE rule 9): nothing else can end such a
        step cleanly. A set from another thread raises nothing by itself: that thread then calls
        :meth:`interrupt_main` (:func:`watch_parent` does)."""
        self._interrupt = exc  # (before the look at the flag: a thread that sets it meanwhile sees this)
        try:
            if self.is_set():
                raise exc(f"stop asked for ({self.reason})")
            yield
        finally:
            self._interrupt = None

    def interrupt_main(self) -> bool:
        """From another thread, after :meth:`set`: while the main thread is inside :meth:`interrupting`,
        deliver SIGTERM to the main thread itself (``signal.pthread_kill``), whose handler -- which must
        set this flag, as :func:`child_signals`' does -- then raises there; a blocking call the main
        thread is in (a subprocess's wait, a read, a lock, a sleep) returns at once (EINTR) to let it.
        (A signal sent to the process may be taken by another thread, leaving the main thread's call
        blocked; ``_thread.interrupt_main`` wakes no blocking call at all.) Returns whether it sent one:
        not outside :meth:`interrupting`, nor where SIGTERM has no Python handler (it would end the
        process). The handler's set counts, so the flag is then :meth:`repeated`: stop at once."""
        if self._interrupt is None or not callable(signal.getsignal(signal.SIGTERM)):
            return False
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        return True

    def is_set(self) -> bool:
        return self.reason is not None

    def repeated(self) -> bool:
        """Whether a stop was asked for more than once (stop at once)."""
        return self.count > 1

    @property
    def signum(self) -> int | None:
        """The signal that set the flag, or None (not set, or set for another reason)."""
        return self.reason if isinstance(self.reason, int) else None


class StopSignals:
    """A context manager for a command's main thread: SIGINT, SIGTERM and
    SIGHUP set :attr:`flag` (with the signal number) and write to a wakeup
    pipe (:meth:`fileno`) so a waiting loop wakes at once.

    A signal that was ignored when the command started stays ignored, as
    shells and tools expect (``nohup`` ignores SIGHUP; a background job of a
    non-interactive shell, and some job runners, ignore SIGINT). Outside the
    main thread (where Python allows no handlers) nothing is installed. The
    previous handlers and wakeup fd are restored on exit.
    """

    def __init__(self) -> None:
        self.flag = SignalStopFlag()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._previous: dict[int, object] = {}
        self._previous_fd: int | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._r)
        os.close(self._w)

    def stop_hint(self) -> str:
        """How to stop the command, for its banner: "Ctrl-C stops." where SIGINT reaches it, else
        which signal does -- SIGINT ignored when the command started (a background job of a
        script: ``slotserve up ... &``) would make "Ctrl-C stops" untrue, and the command deaf to
        it without a word."""
        if signal.SIGINT in self._previous or not self._previous:  # (not the main thread: none installed)
            return "Ctrl-C stops."
        return (f"SIGINT is ignored in this process (started in the background by a script), so Ctrl-C does not "
                f"stop it; SIGTERM does (kill {os.getpid()}).")

    def again_hint(self) -> str:
        """How to cut a started stop short, for the "stopping" line: "Ctrl-C again" where SIGINT reaches
        the command, else "SIGTERM again" (SIGINT ignored when it started: "Ctrl-C again" would be
        untrue, as :meth:`stop_hint` says in the banner)."""
        if signal.SIGINT in self._previous or not self._previous:
            return "Ctrl-C again: at once"
        return f"SIGTERM again (kill {os.getpid()}): at once"

    def _on_signal(self, signum, frame) -> None:  # only sets the flag
        self.flag.set(signum)

    def is_set(self) -> bool:
        return self.flag.is_set()

    def fileno(self) -> int:
        """The read end of the wakeup pipe: readable after a signal or :meth:`wake`."""
        return self._r

    def wake(self) -> None:
        """Wake whoever waits on :meth:`fileno` (from any thread)."""
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full of wake-ups already, or closed at exit

    def drain(self) -> None:
        """Empty the wakeup pipe (after a wait returned because of it)."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout_s: float | None) -> None:
        """Block until a signal, a :meth:`wake` or ``timeout_s`` seconds."""
        if wait_for_handles([self._r], timeout_s):
            self.drain()


def child_signals(stop: SignalStopFlag) -> None:
    """In a launched child: SIGTERM sets ``stop`` (a second one makes it
    :meth:`~SignalStopFlag.repeated`); SIGINT and SIGHUP are ignored, because the
    parent decides when its children stop (a Ctrl-C or a hang-up reaches the
    whole process group; the parent then lets the gateway drain while the
    workers and the broker still serve, and stops them in order: gateway,
    workers, broker)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _SIGHUP is not None:
        signal.signal(_SIGHUP, signal.SIG_IGN)


def watch_parent(stop: SignalStopFlag, grace_s: float) -> threading.Thread | None:
    """In a child started by :mod:`multiprocessing`: when the parent process
    is gone, however it ended (SIGKILL included), set ``stop``, and if the
    process is still alive ``grace_s`` seconds later, end it with
    ``os._exit(1)``. Returns the watching (daemon) thread, or None when this
    process has no multiprocessing parent.

    Where the main thread is inside ``stop``'s :meth:`~SignalStopFlag.interrupting`
    (a worker loading its model or building its kernels, which checks no flag
    and may take minutes), it is also interrupted at once
    (:meth:`~SignalStopFlag.interrupt_main`: ``stop`` must be the flag that
    SIGTERM's handler sets, :func:`child_signals`'), as by the SIGTERM the
    parent can no longer send: the load ends cleanly (a build's processes
    killed, locks released) well before ``grace_s``. Anywhere else the loops
    notice ``stop`` at their next tick, as before.

    Why the parent sentinel and not ``prctl(PR_SET_PDEATHSIG)``: the sentinel
    is the read end of a pipe whose write end only the parent holds, so it
    turns readable exactly when the parent *process* is gone; PDEATHSIG fires
    when the parent *thread* that forked the child exits (a cluster started
    from a short-lived thread would lose its children), is Linux-only, and
    needs a native helper. A thread cannot be killed by a busy main thread
    either: it only needs the GIL, which model code releases in its kernels.
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return None

    def watch() -> None:
        wait_for_handles([parent.sentinel])
        log.warning("the parent process %s is gone: stopping", parent.pid)
        stop.set(PARENT_GONE)
        if stop.interrupt_main():
            log.info("interrupting the main thread's model load (SIGTERM to it)")
        time.sleep(grace_s)  # a deadline, not synchronisation: the main thread exits first when it can
        log.error("did not stop within %.1f s of the parent's end: exiting", grace_s)
        os._exit(1)

    t = threading.Thread(target=watch, name="slotserve-parent-watch", daemon=True)
    t.start()
    return t
