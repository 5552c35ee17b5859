"""Running the caller's code: ``on_token`` streaming and completion callbacks.

Both run on the thread that calls ``step()``/``run()``, outside the engine
lock, so they may call ``submit_request`` and ``cancel``. An exception in one
is caught here and reported back; it never reaches the engine loop or
another request (docs/architecture.md, "The in-process engine": "a callback
that raises does not stop the engine or touch other requests"). A completion
callback's ``KeyboardInterrupt`` or ``SystemExit`` is recorded alike, then
raised again from ``run()`` once the iteration's endings are all delivered
(:func:`complete`).
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


def stream_text(streaming: list[Request]) -> list[tuple[Request, Exception]]:
    """Call ``on_text`` with each request's newly released text, if any; return the calls that raised."""
    failed = []
    for req in streaming:
        piece = req.detok.take()
        if piece:
            try:
                req.on_text(piece)
            except Exception as exc:
                failed.append((req, exc))
    return failed


def complete(finished: list[Request], completion: Completion, now: float) -> None:
    """Record each finished request's ending (``now``: the engine's clock),
    release the rest of its text (the last ``on_text``), then call its
    callback once with its final sequence (a copy).

    A raising callback (or last ``on_text``, or a failing final decode) is
    recorded as the request's ``error`` (its ``finish_reason`` stays).
    Afterwards the handle is ``done`` and any thread blocked in its
    ``result`` wakes. A ``KeyboardInterrupt`` or ``SystemExit`` from a
    callback (Ctrl-C while one runs, ``sys.exit()`` in one) is recorded alike
    and raised again once every request of ``finished`` has ended and had its
    callback: the engine stays whole (its slots freed, every request ended
    once), and the caller's ``run()`` stops as asked.
    """
    completion.delivering_thread = threading.get_ident()
    pending: BaseException | None = None
    try:
        for req in finished:
            req._end(req.reason, req.stop_match, req._error, now)
            if req.detok is not None:
                raised = _finish_text(req)
                pending = pending or raised
            cb = req.callback
            if cb is not None:
                completion.delivering = req  # (the previous one is done: its result() returns)
                try:
                    cb(list(req.seq))
                except BaseException as exc:
                    log.warning("callback of request %r raised", req.request_id, exc_info=exc)
                    if req._error is None:
                        req._error = exc
                    if not isinstance(exc, Exception):
                        pending = pending or exc
                req.callback = None
            req._done = True
            if completion.waiters:  # read without the lock: see Completion
                completion.notify()
    finally:
        completion.delivering = None
    if pending is not None:
        raise pending


def _finish_text(req: Request) -> BaseException | None:
    """Release all of a finished request's text; hand the last piece to ``on_text``. Returns what
    ``on_text`` raised that is no ``Exception`` (KeyboardInterrupt, SystemExit: recorded, for
    :func:`complete` to raise again), else None."""
    try:
        req.detok.finish(req.seq[req._prompt_tokens:])
        if req.on_text is not None:
            piece = req.detok.take()
            if piece:
                req.on_text(piece)
    except BaseException as exc:
        log.warning("text of request %r failed at its end", req.request_id, exc_info=exc)
        if req._error is None:
            req._error = exc
        return None if isinstance(exc, Exception) else exc
    return None
