"""The broker's worker registry: who serves which model, with how many credits,
holding which requests, last heard from when.

Credits: a worker registers ``max_inflight`` (its slots plus a small
prefetch). The broker keeps the set of request keys assigned to it and never
lets that set grow past ``max_inflight``; every ``finished`` entry the worker
reports removes its key and so returns one credit. Counting on the broker's
side (instead of trusting a "free slots" number from the worker) cannot
over-assign when a freed-slot report crosses an assignment on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.defaults import MAX_MESSAGE_BYTES
from protocol.messages import ModelInfo, PrefixCacheUsage


@dataclass(slots=True)
class WorkerState:
    """One registered worker.

    - ``identity``: ``bytes`` its ZeroMQ routing id on the backend socket.
    - ``model``: ``str``; ``num_slots``, ``max_inflight``: ``int`` (see module doc).
    - ``inflight``: ``set[int]`` broker keys assigned and not yet finished.
    - ``last_seen_s``: ``float`` monotonic time of its last message.
    - ``progress``: ``int`` iterations it reported completed (heartbeats), or
      None before its first heartbeat (the baseline).
    - ``progress_s``: ``float`` monotonic time it was last seen making
      progress: an iteration arrived, its heartbeat's ``progress`` grew, or
      it went from holding nothing to holding requests. A worker holding
      requests with no progress for ``worker_hung_s`` is hung.
    - ``suspect``: ``bool`` it was hung and registered again without having
      made progress since: it gets no requests until its ``progress`` moves
      (a stuck model must not eat every request, one hang after another).
    - ``iterations``: ``int`` iteration messages with tokens received from it
      (one per engine iteration that generated tokens).
    - ``max_message_bytes``: ``int`` the largest frame it decodes (from its
      ``register``); every ``assign`` to it is kept within it.
    - ``prefix_cache``: its latest :class:`~protocol.messages.PrefixCacheUsage`
      (heartbeats), None for a worker without a prefix cache.
    - ``faults``: kinds of things it reported that cannot be true (token counts,
      prefix-cache numbers, token ids, error codes, tokens past ``max_tokens``),
      each logged once (see :meth:`broker.workers.WorkerHandler._faulty`).
    """

    identity: bytes
    model: str
    num_slots: int
    max_inflight: int
    info: ModelInfo
    name: str
    last_seen_s: float
    inflight: set[int] = field(default_factory=set)
    progress: int | None = None
    progress_s: float = 0.0
    suspect: bool = False
    iterations: int = 0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    prefix_cache: PrefixCacheUsage | None = None
    faults: set[str] = field(default_factory=set)

    @property
    def credits(self) -> int:
        """Requests the broker may still assign (``max_inflight - len(inflight)``)."""
        return self.max_inflight - len(self.inflight)

    @property
    def free_slots(self) -> int:
        """Slots not yet holding an assigned request (negative: prefetch in use)."""
        return self.num_slots - len(self.inflight)


@dataclass(slots=True)
class LoadingWorker:
    """A worker that announced ``model`` (``loading``) and has not registered yet:
    ``identity``, ``name`` as in :class:`WorkerState`; ``last_seen_s``: monotonic
    time of its last message (it heartbeats while loading)."""

    identity: bytes
    model: str
    name: str
    last_seen_s: float


class WorkerRegistry:
    """Registered workers by identity, and per model, in registration order;
    workers still loading their model (:attr:`loading`, by identity)."""

    def __init__(self) -> None:
        self._workers: dict[bytes, WorkerState] = {}
        self._by_model: dict[str, list[WorkerState]] = {}
        self.loading: dict[bytes, LoadingWorker] = {}

    def loading_models(self) -> dict[str, int]:
        """Models being loaded -> number of workers loading each."""
        counts: dict[str, int] = {}
        for lw in self.loading.values():
            counts[lw.model] = counts.get(lw.model, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self):
        return iter(list(self._workers.values()))

    def get(self, identity: bytes) -> WorkerState | None:
        return self._workers.get(identity)

    def add(self, worker: WorkerState) -> None:
        """Add a worker; its identity must not be registered (remove the old one first)."""
        assert worker.identity not in self._workers
        self._workers[worker.identity] = worker
        self._by_model.setdefault(worker.model, []).append(worker)

    def remove(self, identity: bytes) -> WorkerState | None:
        """Forget a worker; returns it (with its ``inflight`` keys) or None."""
        w = self._workers.pop(identity, None)
        if w is not None:
            peers = self._by_model[w.model]
            peers.remove(w)
            if not peers:
                del self._by_model[w.model]
        return w

    def for_model(self, model: str) -> list[WorkerState]:
        """Workers serving ``model`` (the registry's own list: do not mutate)."""
        return self._by_model.get(model, [])

    def pick(self, model: str) -> WorkerState | None:
        """The worker to assign the next ``model`` request to, or None if none has a credit.

        Most free slots first, so load spreads over idle workers before any
        worker's prefetch is used; ties go to the earliest registered.
        """
        best, most = None, 0
        for w in self._by_model.get(model, ()):  # (credits and free_slots, inline: once per request)
            held = len(w.inflight)
            if held < w.max_inflight and not w.suspect and (best is None or w.num_slots - held > most):
                best, most = w, w.num_slots - held
        return best

    def hung_since(self, cutoff_s: float) -> list[WorkerState]:
        """Workers holding requests whose last progress is older than ``cutoff_s``."""
        return [w for w in self._workers.values() if w.inflight and w.progress_s < cutoff_s]

    def heard_all(self, now: float, since_s: float = float("-inf")) -> None:
        """Count every worker and loader as heard from at ``now`` (monotonic), its progress too: their
        silence and progress timers restart (a fresh window after the broker's own stall,
        :meth:`broker.core.BrokerCore.restart_silence_timers`), each one that started after
        ``since_s`` (the previous stall's end: one the previous stall restarted, and nothing since,
        is not restarted twice)."""
        for w in self._workers.values():
            if w.last_seen_s > since_s:
                w.last_seen_s = now
            if w.progress_s > since_s:
                w.progress_s = now
        for lw in self.loading.values():
            if lw.last_seen_s > since_s:
                lw.last_seen_s = now

    def silent_since(self, cutoff_s: float) -> list[WorkerState]:
        """Workers whose last message is older than ``cutoff_s`` (monotonic)."""
        return [w for w in self._workers.values() if w.last_seen_s < cutoff_s]
