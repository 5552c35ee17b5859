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
- :func:`held_launched_worker_main`: the same in ``worker_main``'s place (a LocalCluster's workers,
  on demand too), the FIFO named by ``$SLOTSERVE_TEST_HELD_FIFO``.
- :func:`held_gateway_main`: :func:`slotserve.launcher.gateway_main`, its tokenizer loads held (in
  process, on the gateway's loading thread).
- ``python -m tests.support.held_load --parent worker|gateway FIFO ENDPOINT GRACE_S``: a parent as
  ``slotserve up`` is to its children: it starts one of the two above as a ``spawn`` child and waits
  for it, until killed (:func:`parent`).
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


def held_worker_main(fifo: str, config, log_level: str = "WARNING", stop_timeout_s: float = 5.0) -> None:
    """:func:`slotserve.launcher.worker_main` with ``config``, its loads held on ``fifo``."""
    from slotserve.launcher import worker_main

    hold_loads(fifo)
    worker_main(config, log_level, stop_timeout_s=stop_timeout_s)


HELD_FIFO_ENV = "SLOTSERVE_TEST_HELD_FIFO"
"""The variable naming the FIFO that :func:`held_launched_worker_main` holds its loads on."""


def held_launched_worker_main(config, log_level: str = "WARNING", index: int = 0, stop_timeout_s: float = 5.0) -> None:
    """:func:`slotserve.launcher.worker_main` with its very signature (a test puts it in
    ``slotserve.launcher.worker_main``'s place, so that a LocalCluster starts it, models on demand
    included), its loads held on the FIFO that ``$SLOTSERVE_TEST_HELD_FIFO`` names (a ``spawn``
    child inherits the variable)."""
    import os

    from slotserve.launcher import worker_main

    hold_loads(os.environ[HELD_FIFO_ENV])
    worker_main(config, log_level, index, stop_timeout_s)


def held_gateway_main(fifo: str, config, log_level: str = "WARNING", stop_timeout_s: float = 5.0) -> None:
    """:func:`slotserve.launcher.gateway_main` with ``config``, its tokenizer loads held: each reads
    ``fifo`` to its end on the gateway's loading thread, in process as a tokenizer loads (no child to
    kill), after making the file ``fifo + ".loading"`` (what the test waits for)."""
    import multiprocessing

    import slotserve.tokenizer
    from slotserve.launcher import gateway_main

    def held(name: str):
        open(fifo + ".loading", "w").close()
        with open(fifo, "rb") as f:
            f.read()
        return None

    slotserve.tokenizer.loader_for = lambda config: held
    gateway_main(config, multiprocessing.get_context("spawn").Queue(), log_level, stop_timeout_s)


def parent(role: str, fifo: str, endpoint: str, grace_s: str) -> None:
    """Start :func:`held_worker_main` (``role`` "worker": served as ``held-orphan``, its broker's backend
    at ``endpoint``) or :func:`held_gateway_main` ("gateway": its broker's frontend at ``endpoint``,
    ``--tokenizer held``) as ``slotserve up`` starts its children (``spawn``, logging at INFO,
    ``grace_s`` their ``stop_timeout_s``), and wait for it."""
    import multiprocessing

    if role == "worker":
        from worker.config import WorkerConfig

        target = held_worker_main
        config = WorkerConfig(broker=endpoint, model="simulated", num_slots=2, served_model_names=("held-orphan",))
    else:
        from gateway.config import GatewayConfig

        target = held_gateway_main
        config = GatewayConfig(broker=endpoint, host="127.0.0.1", port=0, tokenizer="held")
    p = multiprocessing.get_context("spawn").Process(target=target, args=(fifo, config, "INFO", float(grace_s)),
                                                     name=f"slotserve-{role}", daemon=True)
    p.start()
    p.join()


if __name__ == "__main__" and sys.argv[1] == "--parent":
    parent(*sys.argv[2:])
elif __name__ == "__main__":
    hold_loads(sys.argv[1])
    from slotserve.cli import main

    main(sys.argv[2:], prog_name="slotserve")
