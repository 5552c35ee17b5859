"""Blocking calls the gateway's event loop waits for, each on a daemon thread of its own.

The loop's default executor (``run_in_executor(None, ...)``, ``asyncio.to_thread``) is no place for a
call that may block for long: the loop's close joins that executor's threads, and so does the
interpreter's exit, so a gateway stopping -- its parent gone included -- waited for it, past the grace
its parent gives it (then its parent watch ended it with ``os._exit(1)``). A daemon thread is abandoned
at exit instead, its result unread.
"""

from __future__ import annotations

import asyncio
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
