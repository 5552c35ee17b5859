"""Running the caller's code: ``on_token`` streaming and completion callbacks.

Both run on the thread that calls ``step()``/``run()``, outside the engine
lock, so they may call ``submit_request`` and ``cancel``. An exception in one
is caught here and reported back; it never reaches the engine loop or
another request (DESIGN.md: "a callback that raises does not stop the engine
or touch other requests").
"""

from __future__ import annotations

import logging
import threading

from worker.request import Completion, Request

log = logging.getLogger(__name__)


def stream_tokens(streaming: list[Request]) -> list[tuple[Request, Exception]]:
    """Call ``on_token`` with each request's newest token; return the calls that raised."""
    failed = []
    for req in streaming:
        try:
            req.on_token(req.seq[-1])
        except Exception as exc:
            log.warning("on_token of request %r raised", req.request_id, exc_info=exc)
            failed.append((req, exc))
    return failed


def complete(finished: list[Request], completion: Completion, now: float) -> None:
    """Record each finished request's ending (``now``: the engine's clock), then
    call its callback once with its final sequence (a copy).

    A raising callback is recorded as the request's ``error`` (its
    ``finish_reason`` stays). Afterwards the handle is ``done`` and any
    thread blocked in its ``result`` wakes.
    """
    completion.delivering_thread = threading.get_ident()
    try:
        for req in finished:
            req._end(req.reason, req.stop_match, req._error, now)
            cb = req.callback
            if cb is not None:
                completion.delivering = req  # (the previous one is done: its result() returns)
                try:
                    cb(list(req.seq))
                except Exception as exc:
                    log.warning("callback of request %r raised", req.request_id, exc_info=exc)
                    if req._error is None:
                        req._error = exc
                req.callback = None
            req._done = True
            if completion.waiters:  # read without the lock: see Completion
                completion.notify()
    finally:
        completion.delivering = None
