"""Blocking calls the gateway's event loop waits for, on daemon threads.

The loop's default executor (``run_in_executor(None, ...)``, ``asyncio.to_thread``) is no place for a
call that may block for long: the loop's close joins that executor's threads, and so does the
interpreter's exit, so a gateway stopping -- its parent gone included -- waited for it, past the grace
its parent gives it (then its parent watch ended it with ``os._exit(1)``). A daemon thread is abandoned
at exit instead, its result unread: :func:`on_a_daemon_thread` (one thread per call, for rare calls),
:data:`TOKENIZER_THREADS` (a bounded pool, for the tokenizer's work on each request).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading


def on_a_daemon_thread(fn, *args, name: str) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread of its own (named ``name``), as a future of the running loop:
    its result, or the exception it raised. For calls that may block for seconds or minutes and that
    the process need not finish before it exits: one that waits on the broker (a connect, a status
    query: up to ``connect_timeout_s``), a tokenizer's load (a download: minutes). When the loop has
    closed meanwhile, the result is dropped (nobody waits any more)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 -- the awaiting coroutine raises it
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the event loop is closed: nobody waits any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class DaemonPool:
    """At most ``size`` daemon threads (named ``name-N``, started as work comes) running calls for event
    loops: the default executor's bound on threads, without its join at the loop's close and at exit.
    For the tokenizer's work on a request's text (``/tokenize`` of a large body: tens of seconds), which
    the process need not finish once the request it serves was answered or ended: on the default
    executor a gateway stopping waited for it past its drain (``slotserve up`` then killed it, and
    ``slotserve serve`` did not exit until it was done)."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._pending = 0  # submitted and not finished

    def run(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on one of the threads, as a future of the running loop (its result, or the
        exception it raised; dropped when the loop has closed meanwhile). Waits for a free thread
        when all ``size`` are busy."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._pending += 1
            start = self._pending > self._threads and self._threads < self.size
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        self._jobs.put((fn, args, loop, fut))
        return fut

    def _work(self) -> None:
        while True:
            fn, args, loop, fut = self._jobs.get()
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 -- the awaiting coroutine raises it
                result, error = None, e
            with self._lock:
                self._pending -= 1
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:
                pass  # the event loop is closed: nobody waits any more


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():  # (cancelled: its request ended meanwhile)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


TOKENIZER_THREADS = DaemonPool(min(32, (os.cpu_count() or 1) + 4), "slotserve-gateway-tokenize")
"""The threads the tokenizer's work on requests runs on (:meth:`DaemonPool.run`): the default
executor's number, ``min(32, cores + 4)``."""
