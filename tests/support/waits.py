"""Deadline waits: poll a condition until it holds, fail with a clear message
after a timeout (STYLE 14: tests wait on conditions, never on ``sleep``)."""

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
