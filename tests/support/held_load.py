"""A worker whose model load the test holds open, in a real process, without sleeps.

The model loader is wrapped: each load first runs a child process that reads a FIFO to its end, as
a first start's kernel build runs the compiler as a child the load waits for. The test makes the
FIFO (``os.mkfifo``) and holds a writer on it (``os.open(path, os.O_RDWR)``), so the child blocks in
its read until the test closes it; the child's command line holds the FIFO's path, so the test sees
the load under way in the process table (:func:`load_child`).

- ``python -m tests.support.held_load FIFO ARGS...``: the ``slotserve`` CLI with ARGS
  (``worker --broker ...``), the loader held.
- :func:`held_worker_main`: :func:`slotserve.launcher.worker_main` (what ``slotserve up`` / ``serve``
  start), the loader held, as a ``spawn`` process's target.
"""

from __future__ import annotations

import subprocess
import sys

READER = "import sys; open(sys.argv[1], 'rb').read()"


def hold_loads(fifo: str) -> None:
    """Wrap :func:`worker.models.load_model` (which the worker imports when it loads) in this process."""
    import worker.models

    real = worker.models.load_model

    def held(name: str, **options):
        subprocess.run([sys.executable, "-c", READER, fifo], check=True)  # until the test lets go
        return real(name, **options)

    worker.models.load_model = held


def load_child(proc, fifo: str):
    """The held load's child process of ``proc`` (a psutil.Process), or None while there is none."""
    import psutil

    for kid in proc.children():
        try:
            if fifo in kid.cmdline():
                return kid
        except psutil.Error:
            pass
    return None


def held_worker_main(fifo: str, config, log_level: str = "WARNING") -> None:
    """:func:`slotserve.launcher.worker_main` with ``config``, its loads held on ``fifo``."""
    from slotserve.launcher import worker_main

    hold_loads(fifo)
    worker_main(config, log_level)


if __name__ == "__main__":
    hold_loads(sys.argv[1])
    from slotserve.cli import main

    main(sys.argv[2:], prog_name="slotserve")
