"""Deadline waits: poll a condition until it holds, fail with a clear message
after a timeout (STYLE 14: tests wait on conditions, never on ``sleep``).

:func:`wait_until` is the plain wait. A loop that does more than wait (reads a
socket with a poll timeout, asserts something on every pass) uses its
building block, :class:`Deadline`."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class Deadline:
    """A moment ``timeout_s`` seconds from now on the monotonic clock."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def left_s(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() > self.at


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "condition",
               show: Callable[[], object] | None = None, *, pause_s: float = 0.002) -> T:
    """Poll ``condition`` every ``pause_s`` seconds until it returns something
    true, and return that; AssertionError after ``timeout_s`` seconds (naming
    ``what``, plus ``show()`` when given). For states that have no event to
    wait on -- never a bare sleep."""
    deadline = Deadline(timeout_s)
    pause = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if deadline.passed():
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + ("" if show is None else f": {show()}"))
        pause.wait(pause_s)
