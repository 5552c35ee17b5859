"""The worker's admission thread: the slow part of taking an assigned request, off the I/O thread.

Tokenising a text or chat prompt and compiling a structured constraint take time that grows with
what a client sent: at the limits a request may carry (a 200,000-character GBNF grammar, a text of
``max_seq_len x max_token_bytes`` bytes), seconds (a 109,588-character grammar of 3,000 chained
rules: 8-9.7 s in llguidance's GBNF conversion; a 178,924-character schema of 6,000 optional
properties: 3.9 s; 4 MB of text: 3.7 s with Qwen2.5's tokenizer, on the loaded 2-core machine). On
the I/O thread (:mod:`worker.link`) that time sent no heartbeat, and past the broker's worker
liveness (5 s) the worker was declared lost and its requests requeued, as a941b61's tokenizer
build did. Here one thread does it, in the order the requests came; the I/O thread only queues.

Each job is a callable run on this thread; it returns True when the I/O thread must be woken (an
outcome waits in the worker's outbox), which this thread does with one :data:`~worker.link.WAKE`
on its own inproc PAIR (a socket has one owning thread: the main thread's PAIR is not this one's).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

import zmq

log = logging.getLogger(__name__)

WAKE = b"w"
"""The one-byte wake-up this thread sends (:data:`worker.link.WAKE`: the same byte)."""


class AdmissionThread:
    """Runs queued jobs on one thread, in order (:meth:`put`, any thread); wakes the I/O thread
    over a PAIR it connects to ``address`` (bound by the I/O thread's side first) when a job returns
    True. :meth:`close` ends it after the job under way (the queued ones are dropped: the worker is
    stopping and its goodbye hands them back to the broker)."""

    def __init__(self, ctx: zmq.Context, address: str, name: str = "slotserve-worker-admission") -> None:
        self._jobs: collections.deque[Callable[[], bool]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._ctx, self._address = ctx, address
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], bool]) -> None:
        """Queue ``job`` (any thread)."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the job under way; wait for the thread up to ``timeout_s`` seconds."""
        with self._cond:
            self._closing = True
            self._jobs.clear()
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        pipe = self._ctx.socket(zmq.PAIR)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.connect(self._address)
        try:
            while True:
                with self._cond:
                    while not self._jobs and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                    job = self._jobs.popleft()
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
