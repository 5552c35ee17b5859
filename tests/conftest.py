"""Helpers shared by the tests (pytest imports this first)."""

from __future__ import annotations

import threading
import time
from typing import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "condition",
               show: Callable[[], object] | None = None) -> None:
    """Poll ``condition`` until it is true; AssertionError after ``timeout_s``
    seconds (naming ``what``, plus ``show()`` when given). For states that
    have no event to wait on -- never a bare sleep."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + ("" if show is None else f": {show()}"))
        pause.wait(0.002)


def envelope(request_id, prompt, max_tokens, *, resume_tokens=(), time_left_s=None, **options):
    """An :class:`~protocol.messages.Envelope` for ``submit``/``assign`` in tests:
    ``RequestParams(prompt, max_tokens, **options)`` and its routing data."""
    from protocol.messages import Envelope
    from protocol.request import RequestParams

    return Envelope(request_id, RequestParams(prompt, max_tokens, **options), tuple(resume_tokens), time_left_s)
