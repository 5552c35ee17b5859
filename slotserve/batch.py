"""``slotserve run`` end to end: a :class:`~slotserve.job.BatchJob` against a
running broker or an embedded cluster, supervised from one loop until the job
ends, a stop signal comes, ``timeout_s`` passes or the cluster fails; then
the job is stopped cleanly (:meth:`BatchJob.stop`), the cluster stopped, and the
outcome mapped to an exit status.

Exit status (:class:`ExitStatus`; 2 is click's usage error):

- 0: every row ran and none ended with ``finish_reason`` ``"error"``;
- 1: the job could not run: no broker, a cluster that failed to start or
  kept crashing, an input that could not be read, an output that could not
  be written (the job stops at the first row that fails);
- 3: the job ran, but some rows ended ``"error"`` (bad rows included);
- 124: ``timeout_s`` passed (as coreutils ``timeout``);
- 128+N: stopped by signal N (130 Ctrl-C, 129 SIGHUP, 143 SIGTERM), the
  shell's convention for a command ended by a signal.

A resumed job (``previous``) is judged over its whole output: the rows kept from
before count as rows of this run (3 when one of them ended ``"error"``), so a job
resumed to its end exits as one run of the whole input would have.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, TextIO

from client import BrokerUnavailable, Client
from slotserve.job import BatchJob, JobSummary
from slotserve.launcher import ClusterConfig, LocalCluster
from slotserve.resume import Previous
from slotserve.signals import StopSignals


class ExitStatus(IntEnum):
    """Exit statuses of ``slotserve run`` (a signal N gives ``SIGNALLED + N``)."""

    OK = 0
    FAILED = 1
    ROW_ERRORS = 3
    TIMEOUT = 124
    SIGNALLED = 128


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """How a batch ended: its ``summary`` (None when no job started),
    ``exit_status`` and, unless it is 0, a one-line ``message`` saying why."""

    summary: JobSummary | None
    exit_status: int
    message: str | None = None


def run_batch(inp: Iterable[str], out: TextIO, *, signals: StopSignals, model: str | None, broker: str | None = None,
              cluster: ClusterConfig | None = None, curve=None, max_in_flight: int = 10_000,
              total: int | None = None, progress: bool = True, timeout_s: float | None = None,
              wait_for_model_s: float = 60.0, poll_s: float = 0.25, close_input: bool = False,
              previous: Previous | None = None) -> BatchOutcome:
    """Run the job ``inp`` -> ``out`` against ``broker`` (a client endpoint) or
    an embedded ``cluster`` (exactly one), stopping early on ``signals``
    (installed by the caller, on the main thread) or after ``timeout_s``
    seconds. ``curve``, ``model``: as for :class:`~client.Client` (``model``
    None: the broker's only model);
    ``max_in_flight``, ``total``, ``progress``, ``close_input``, ``previous``: as for :class:`BatchJob`;
    ``wait_for_model_s``: seconds a worker for ``model`` may take to appear;
    ``poll_s``: how often the loop checks the deadline (signals and the
    job's end wake it at once). Raises ValueError unless exactly one of
    ``broker`` and ``cluster`` is given; everything else is in the outcome.
    """
    if (broker is None) == (cluster is None):
        raise ValueError("give exactly one of broker (an endpoint) and cluster (a ClusterConfig)")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def stop_reason() -> str | None:
        if signals.flag.signum is not None:
            return signal.Signals(signals.flag.signum).name
        if deadline is not None and time.monotonic() >= deadline:
            return f"timeout after {timeout_s:g} s"
        return None

    local = job = failure = None
    try:
        if stop_reason() is not None:  # asked to stop before anything started: start nothing
            raise RuntimeError(f"stopped before starting ({stop_reason()})")
        if cluster is not None:
            local = LocalCluster(cluster)
            local.start(should_stop=lambda: stop_reason() is not None)
            broker = local.frontend
        with Client(broker, model=model, name="slotserve-run", curve=curve) as client:
            _wait_for_model(client, wait_for_model_s, lambda: stop_reason() is not None)
            job = BatchJob(client, inp, out, max_in_flight=max_in_flight, total=total, progress=progress,
                           on_finish=signals.wake, close_input=close_input, previous=previous).start()
            try:
                def should_stop() -> bool:
                    return job.finished or job.output_error is not None or stop_reason() is not None

                if local is not None:  # restarts a child that dies; RuntimeError on a crash loop
                    local.supervise(should_stop, wakeup_fd=signals.fileno(), poll_s=poll_s)
                while not should_stop():
                    signals.wait(poll_s)
            except RuntimeError as e:
                job.stop(f"the cluster failed ({e})")
                raise
            finally:
                job.stop(stop_reason() or "stopped")  # a no-op when the job finished
                job.close()
    except (BrokerUnavailable, RuntimeError, TimeoutError, ValueError) as e:
        failure = str(e)
    finally:
        if local is not None:
            local.stop()
        if job is None and close_input:
            inp.close()
    return _outcome(job, failure, signals.flag.signum)


def _outcome(job: BatchJob | None, failure: str | None, signum: int | None) -> BatchOutcome:
    summary = None if job is None else job.summary()
    if signum is not None and (summary is None or summary.stopped is not None):
        return BatchOutcome(summary, ExitStatus.SIGNALLED + signum, f"stopped by {signal.Signals(signum).name}")
    if failure is not None:
        return BatchOutcome(summary, ExitStatus.FAILED, failure)
    if job.output_error is not None:
        return BatchOutcome(summary, ExitStatus.FAILED, f"cannot write the results: {job.output_error}")
    if job.failure is not None:
        return BatchOutcome(summary, ExitStatus.FAILED, f"cannot read the input: {job.failure}")
    if summary.stopped is not None:
        return BatchOutcome(summary, ExitStatus.TIMEOUT, f"stopped: {summary.stopped}")
    errors = summary.errors + summary.already_errors
    if errors:
        before = f", {summary.already_errors} of them before this run" if summary.already_errors else ""
        return BatchOutcome(summary, ExitStatus.ROW_ERRORS,
                            f"{errors} row(s) ended with finish_reason 'error'{before} (see their \"error\")")
    return BatchOutcome(summary, ExitStatus.OK)


def _wait_for_model(client: Client, timeout_s: float, should_stop) -> None:
    """``client.wait_for_model`` that gives up when ``should_stop()`` turns true
    (RuntimeError). It waits in short steps so a signal ends it promptly;
    each step waits on the broker's welcomes (no polling of the broker). A
    model nobody serves or loads, nor would on demand, raises
    :class:`~client.UnknownModelError` (a ValueError) at once, listing the
    models served; one loaded on demand returns at once (the job's first rows
    load it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.wait_for_model(min(0.5, max(0.01, deadline - time.monotonic())))
            return
        except TimeoutError:
            if should_stop():
                raise RuntimeError("stopped while waiting for a worker") from None
            if time.monotonic() >= deadline:
                state = "is still loading" if client.model in client.loading else "has no worker"
                raise TimeoutError(f"model {client.model or '(any)'!r} {state} after {timeout_s:g} s") from None
