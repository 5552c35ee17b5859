"""Run a command under a child subreaper that reports how each process of its tree ended, orphans included.

``python -m tests.support.subreaper CMD ARGS...`` makes this process a child subreaper
(Linux's ``prctl(PR_SET_CHILD_SUBREAPER)``), starts CMD, and reaps every process that ends under it:
CMD, and the descendants that CMD leaves orphaned when it dies (the kernel hands them to the nearest
subreaper, here, instead of init). For each it prints one line, flushed, ``PID CODE MONOTONIC_S``:
its exit code as :func:`os.waitstatus_to_exitcode` gives it (``-N`` for a signal N) and
``time.monotonic()`` when it was reaped (one clock for every process of the machine). It exits, 0,
once nothing is left under it. The first line it prints is ``started PID``, CMD's pid.

A test that kills CMD learns so how each orphan of CMD ended and when, which no other process can
(an orphan's exit status goes to whoever reaps it).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    pid = os.posix_spawnp(argv[0], argv, os.environ)
    print(f"started {pid}", flush=True)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # nothing left under this process
            return
        print(f"{pid} {os.waitstatus_to_exitcode(status)} {time.monotonic()}", flush=True)


def reaped(stdout: str) -> dict[int, tuple[int, float]]:
    """The subreaper's report (its whole stdout): pid -> (exit code, when reaped, monotonic seconds)."""
    ends = {}
    for line in stdout.splitlines():
        if not line.startswith("started "):
            pid, code, when = line.split()
            ends[int(pid)] = (int(code), float(when))
    return ends


if __name__ == "__main__":
    main(sys.argv[1:])
