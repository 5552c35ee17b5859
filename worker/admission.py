"""The worker's admission thread: the slow part of taking an assigned request, off the I/O thread.

Tokenising a text or chat prompt and compiling a structured constraint take time that grows with
what a client sent: at the limits a request may carry (a 200,000-character GBNF grammar, a text of
``max_seq_len x max_token_bytes`` bytes), seconds (a 109,588-character grammar of 3,000 chained
rules: 8-9.7 s in llguidance's GBNF conversion; a 178,924-character schema of 6,000 optional
properties: 3.9 s; 4 MB of text: 3.7 s with Qwen2.5's tokenizer, on the loaded 2-core machine). On
the I/O thread (:mod:`worker.link`) that time sent no heartbeat, and past the broker's worker
liveness (5 s) the worker was declared lost and its requests requeued, as a941b61's tokenizer
build did. Here it runs on admission threads; the I/O thread only queues.

Two lanes, a thread each, each in the order its requests came: ``text`` (tokenising a prompt) and
``structured`` (a request with a constraint to compile, then its prompt). With one thread for both,
one client's 9 s grammar held every text and chat request assigned to that worker behind it (a
break-it pass: token-id requests still passed); now a slow grammar holds only the structured
requests behind it, and a long prompt only the prompts behind it.

Each job is a callable run on its lane's thread; it returns True when the I/O thread must be woken
(an outcome waits in the worker's outbox), which that thread does with one
:data:`~worker.link.WAKE` on its own inproc PUSH socket (a socket has one owning thread), all of
them connected to the I/O thread's one PULL.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import zmq

log = logging.getLogger(__name__)

WAKE = b"w"
"""The one-byte wake-up this thread sends (:data:`worker.link.WAKE`: the same byte)."""


LANES = ("text", "structured")
"""The admission lanes (see the module docstring), each its own thread; a job names its lane."""


class Admission:
    """Runs queued jobs on one thread per lane (:data:`LANES`), each lane in order (:meth:`put`, any
    thread); wakes the I/O thread over a PUSH socket per lane, connected to ``address`` (the I/O
    thread's PULL, bound first) when a job returns True. :meth:`close` ends the lanes after their
    jobs under way (the queued ones are dropped: the worker is stopping and its goodbye hands them
    back to the broker). Threads are named ``name`` (the text lane) and ``name-structured``."""

    def __init__(self, ctx: zmq.Context, address: str, name: str = "slotserve-worker-admission") -> None:
        self._jobs: dict[str, collections.deque[Callable[[], bool]]] = {lane: collections.deque() for lane in LANES}
        self._cond = threading.Condition()
        self._closing = False
        self._ctx, self._address = ctx, address
        self._threads = [threading.Thread(target=self._run, args=(lane,), daemon=True,
                                          name=name if lane == LANES[0] else f"{name}-{lane}") for lane in LANES]
        for t in self._threads:
            t.start()

    def put(self, job: Callable[[], bool], lane: str = "text") -> None:
        """Queue ``job`` on ``lane`` (any thread). Raises ValueError for a lane not in :data:`LANES`."""
        if lane not in self._jobs:
            raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
        with self._cond:
            self._jobs[lane].append(job)
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the jobs under way; wait for the threads up to ``timeout_s`` seconds in all."""
        with self._cond:
            self._closing = True
            for jobs in self._jobs.values():
                jobs.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, lane: str) -> None:
        jobs = self._jobs[lane]
        pipe = self._ctx.socket(zmq.PUSH)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.connect(self._address)
        try:
            while True:
                with self._cond:
                    while not jobs and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                    job = jobs.popleft()
                try:
                    wake = job()
                except Exception:  # noqa: BLE001 -- one request must not stop admission (jobs end their own)
                    log.exception("admission job failed")
                    continue
                if wake:
                    try:
                        pipe.send(WAKE, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the I/O thread has wake-ups queued already
        finally:
            pipe.close(0)
