"""The shell of the models on demand (issue 34 item 1): the worker processes of
:class:`slotserve.on_demand.OnDemand`'s decisions.

:class:`DemandSupervisor` is what :class:`slotserve.launcher.LocalCluster` runs
for its ``ClusterConfig.on_demand`` models: every pass (:meth:`DemandSupervisor.run_pass`,
each ``DEMAND_POLL_S`` from the cluster's supervise loop, and while the gateway drains)
it asks the broker for its ``status``, reaps the workers that exited, takes the
``/models/load|unload`` orders the broker kept for it (``status``'s ``orders``: the
gateway hands them to the broker, which shows their state at once), feeds all of it
to the pure core, performs its actions -- start a model's worker, terminate one (it
says goodbye), log a refusal -- and tells the broker each model's state and the
orders it took (``demand``), which every ``status`` then shows
(:mod:`broker.demand`). The decisions are the core's; this module owns the
processes, the broker connection and the clock.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time
from dataclasses import replace
from typing import Callable

from client import Client
from protocol.liveness import StallWatch
from slotserve.on_demand import Load, OnDemand, Refuse, Unload, estimate_bytes
from worker import host_memory
from worker.config import WorkerConfig
from worker.link import announce_dead_load

log = logging.getLogger(__name__)

__all__ = ["DEMAND_POLL_S", "STOP_KILL_S", "DemandSupervisor"]

DEMAND_POLL_S = 0.2
"""Seconds between two passes of the models on demand (a broker status query each)."""

STOP_KILL_S = 30.0
"""Seconds a model's worker told to stop (SIGTERM: it says goodbye, then exits) may take before it
is killed: a frozen one (SIGSTOP, a deadlock) never exits, and held its model's memory and its place
among ``--max-loaded-models``. A stall of the supervisor does not count (its workers were frozen
too, with no time to exit): see :class:`DemandSupervisor`."""


class DemandSupervisor:
    """The models on demand of one cluster, their worker processes and the pass that runs them.

    ``configs``: one worker config per model (its first served name is the model's);
    ``max_loaded``, ``idle_unload_s``: :class:`OnDemand`'s; ``spawn(model, config)``: start a
    worker process for ``model`` (the cluster's: its index, its broker endpoint); ``connect()``:
    a broker client for the status queries and the ``demand`` messages; ``timeout_s``: how long a
    status query may take; ``announce(model, config,
    worker_name)``: tell the broker that a worker of ``model`` started loading it and fall silent,
    for one whose process ended before the broker ever listed it (:func:`worker.link.announce_dead_load`
    by default). ValueError for a model larger than the machine's whole memory (its
    :func:`estimate_bytes`).

    Which of its timers count a stall of its own loop (a pass that comes late:
    :class:`~protocol.liveness.StallWatch`, against its shortest timer -- :data:`STOP_KILL_S`,
    ``idle_unload_s``, the core's ``turn_s`` -- and twice a pass's longest wait, ``DEMAND_POLL_S``
    plus ``timeout_s``; the whole ``slotserve up`` SIGSTOPped, a paused VM; a laptop's suspend stops the
    monotonic clock too), decided
    per timer by what happened meanwhile:

    - :data:`STOP_KILL_S` (a worker told to stop is killed): not counted. Its worker was frozen too
      and had no time to exit; killed on waking it would die without its goodbye (its requests
      count a failed attempt). It gets the rest of its time after the stall.
    - ``idle_unload_s`` and ``turn_s`` (:meth:`OnDemand.stalled`): not counted. Nobody used a
      model or was served meanwhile, and the first pass after the stall may not see yet the
      requests that queued up.
    - The back-off of a failed load: counted (waking, the model may load at once).
    - A request's deadline (the broker's, the worker's and the client's): counted, and not the
      supervisor's. It is the client's wall-clock promise: past it the answer is of no use to the
      client, who waited through the stall whether or not anything was frozen.

    Each timer gets one stall excused until it starts again (as a liveness judge's peers,
    :meth:`StallWatch.excuses`), so a supervisor slow at every pass still kills and unloads, or
    until the supervisor has run on time for its window (its shortest timer) since that stall: the
    next one is a freeze again (``slotserve up`` stopped each night), not a slow supervisor, and nothing
    restarts an idle model's timer as a live peer's word restarts its silence timer (excused once,
    it counted the second freeze as idle time). A timer excused again so has counted at least a
    window since its previous excuse, so it still fires however often the supervisor stalls.
    """

    def __init__(self, configs: tuple[WorkerConfig, ...], max_loaded: int, idle_unload_s: float, *,
                 spawn: Callable[[str, WorkerConfig], mp.Process], connect: Callable[[], Client],
                 timeout_s: float = 5.0,
                 announce: Callable[[str, WorkerConfig, str], None] | None = None) -> None:
        self.configs: dict[str, WorkerConfig] = {w.served_names[0]: w for w in configs}
        needs = {n: estimate_bytes(w.model) for n, w in self.configs.items()}
        total = host_memory.total_bytes()
        for name, need in needs.items():
            if total is not None and need > total:
                raise ValueError(f"model {name!r} needs about {need / 2**20:,.0f} MiB (its files x 1.25 + "
                                 f"400 MiB) and this machine has {total / 2**20:,.0f} MiB of memory in all")
        self.core = OnDemand(needs, max_loaded, idle_unload_s)
        self._spawn, self._connect, self._timeout_s = spawn, connect, timeout_s
        self._orders_taken = 0  # the seq of the last order taken from this broker (status's orders)
        self.running: dict[str, mp.Process] = {}  # model -> its worker (started, maybe not registered yet)
        self.stopping: dict[str, mp.Process] = {}  # model -> its worker being stopped
        self._stop_since: dict[str, float] = {}  # model -> when its worker was told to stop
        self._heard: set[str] = set()  # models whose running worker the broker has listed (loading or served)
        self._registered: set[str] = set()  # models whose running worker a broker has listed served (any broker)
        self._broker_id: str | None = None  # that broker's (a new one, restarted, has heard of no worker)
        self._announce = announce or (lambda model, config, name: announce_dead_load(config, name, timeout_s))
        self._client: Client | None = None
        windows = [STOP_KILL_S] + [s for s in (idle_unload_s, self.core.turn_s) if s]
        self._stalls_window_s = min(windows)
        self._stalls: StallWatch | None = None  # from the first pass (the supervisor's clock then)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every served name of every model on demand (the broker's and the gateway's ``on_demand_models``)."""
        return tuple(n for w in self.configs.values() for n in w.served_names)

    @property
    def aliases(self) -> tuple[tuple[str, str], ...]:
        """``(alias, primary)`` for every alias of every model on demand (the gateway's
        ``on_demand_aliases``: its lists put each model's primary name first while it is unloaded)."""
        return tuple((alias, w.served_names[0]) for w in self.configs.values() for alias in w.served_names[1:])

    def run_pass(self, now: float | None = None) -> list:
        """One pass: the broker's status -> :meth:`OnDemand.decide` -> start or stop worker processes;
        returns the actions taken ([] when the broker does not answer now). ``now``: the pass's
        clock (seconds, ``time.monotonic()``'s by default). A model's status is summed over its served
        names (requests for an alias wait under the alias until its worker registers it). A worker that
        died is forgotten: the model loads again when it is wanted, after a back-off when it died before
        registering (its load failed). One that died before the broker ever listed it (killed or
        crashed while its process started, before it announced its load; or after, to a broker that
        has restarted since: a new ``broker_id``, which heard of none of it) is announced to the broker
        for it (``announce``), so that the broker counts it as it counts a loader that died: a failed
        attempt of each request waiting for the model, which ends ``worker_failed`` at
        ``max_attempts`` such loads rather than waiting forever while the model reloads."""
        from client.errors import BrokerUnavailable

        now = time.monotonic() if now is None else now
        self._watch_stalls(now)
        try:
            if self._client is None:
                self._client = self._connect()
            st = self._client.status(timeout_s=self._timeout_s)
        except (BrokerUnavailable, RuntimeError, TimeoutError) as exc:  # broker restarting: next pass
            log.info("models on demand: no broker status now (%s)", exc)
            self.close()
            return []
        if st.broker_id != self._broker_id:  # a broker restarted: what the old one heard is lost with it
            self._heard.clear()
            self._broker_id = st.broker_id
            self._orders_taken = 0  # (it numbers its orders from 1 again)
        for name, p in list(self.stopping.items()):
            if not p.is_alive():
                p.join()
                del self.stopping[name]
                self._stop_since.pop(name, None)
            elif now - self._stop_since.setdefault(name, now) > STOP_KILL_S:  # frozen: SIGTERM waits for SIGCONT
                log.warning("the worker of model %r (on demand) has not stopped %.0f s after it was told to: "
                            "killing it", name, now - self._stop_since[name])
                p.kill()
        folded = _fold_aliases(st, {n: w.served_names for n, w in self.configs.items()})
        for name, p in list(self.running.items()):
            if folded.models[name].workers or folded.models[name].loading:
                self._heard.add(name)
            if folded.models[name].workers:
                self._registered.add(name)
            if not p.is_alive():
                log.warning("the worker of model %r (on demand) exited with code %s; it loads again when wanted",
                            name, p.exitcode)
                p.join()
                del self.running[name]
                # It never registered: its load failed (back off), unless it exited with code 0, as a worker
                # told to stop while loading does (a signal from outside: its goodbye says so, Bye.load_failed;
                # a failed load exits 1). One that did register (listed served at an earlier pass) loaded its
                # model, whatever ended it after: its goodbye (SIGTERM) drops it from the broker at once. Those
                # leave the model unloaded, not failed: it loads again when wanted.
                if folded.models[name].workers == 0 and name not in self._registered and p.exitcode != 0:
                    self.core.failed(name, now, p.exitcode)
                    if name not in self._heard:  # nor announced its load: the broker would never count it
                        self._announce_dead(name, p)
                self._heard.discard(name)
                self._registered.discard(name)
        self._take_orders(st.orders, now)
        starting = frozenset(n for n in self.running if folded.models[n].workers == 0)
        actions = self.core.decide(folded, now, self._available_bytes(starting), starting,
                                   frozenset(self.stopping))
        for a in actions:
            if isinstance(a, Load):
                log.info("models on demand: loading %r", a.model)
                self._heard.discard(a.model)
                self._registered.discard(a.model)
                self.running[a.model] = self._spawn(a.model, self.configs[a.model])
            elif isinstance(a, Unload):
                p = self.running.pop(a.model, None)
                log.info("models on demand: unloading %r: %s", a.model, a.why)
                if p is not None:
                    p.terminate()  # the worker says goodbye; the broker migrates what it ran (only with turn_s)
                    self.stopping[a.model] = p
                    self._stop_since[a.model] = now
            elif isinstance(a, Refuse):
                log.warning("models on demand: cannot load %r now: %s; its requests wait (their deadlines apply)",
                            a.model, a.why)
        self._tell(st.broker_id)
        return actions

    def _available_bytes(self, starting: frozenset[str]) -> int | None:
        """The memory the machine has for a model to load now (bytes; None: unknown): what it has available
        (:func:`worker.host_memory.available_bytes`) less what the models whose workers are starting (not
        registered yet) will still take -- each one's estimate less what its process holds already. A
        worker takes its model's memory over seconds (its process's start-up, then its load): the
        machine's reading alone, taken a pass after a load started, would let a second model load into
        memory the first is about to take (two models wanted at once with room for one: both loaded)."""
        available = host_memory.available_bytes()
        if available is None:
            return None
        for name in starting:
            need = self.core.models[name]
            held = _resident_bytes(self.running.get(name))
            available -= max(0, need - held) if held is not None else need
        return available

    def _tell(self, broker_id: str) -> None:
        """Tell the broker (``demand``) each model's state after this pass and the orders taken, so
        that every ``status`` shows them (a lost one: the next pass's says it again)."""
        from protocol.messages import Demand

        aliases = {alias: primary for alias, primary in self.aliases}
        try:
            self._client.tell_demand(Demand(broker_id, self.core.published(), aliases, self._orders_taken))
        except Exception:  # noqa: BLE001 -- the connection closing: the next pass's status says so
            log.info("models on demand: could not tell the broker the models' states now", exc_info=True)

    def _announce_dead(self, name: str, p: mp.Process) -> None:
        """Announce the load of ``name``'s worker ``p``, dead before it could, to the broker (which
        drops it once silent past its window, as any dead loader)."""
        config = self.configs[name]
        worker_name = f"{config.name_of(p.pid)}, exited with code {p.exitcode} before it announced its load"
        try:
            self._announce(name, config, worker_name)
        except Exception:  # noqa: BLE001 -- a broker unreachable now: its next load is counted instead
            log.exception("models on demand: could not tell the broker of the dead load of %r", name)

    def _watch_stalls(self, now: float) -> None:
        """A pass that came late (the supervisor was stalled): its stop-kill timers and its core's
        idle and turn timers move as much later (see the class docstring)."""
        if self._stalls is None:
            self._stalls = StallWatch(self._stalls_window_s, now, period_s=DEMAND_POLL_S + self._timeout_s)
            return
        self._stalls.window_s = min([self._stalls_window_s] + ([self.core.turn_s] if self.core.turn_s else []))
        if (gap_s := self._stalls.stalled(now)) is None:
            return
        log.warning("models on demand: the supervisor was stalled for %.1f s (suspended or starved): it counts "
                    "for no idle unload nor stop timeout", gap_s)
        since_s = self._stalls.previous_s
        if now - gap_s - since_s >= self._stalls.window_s:  # on time for a window since the previous stall
            since_s = -math.inf  # (a freeze again, not a slow supervisor: see the class docstring)
        self.core.stalled(gap_s, since_s)
        self._stop_since = {n: s + gap_s if s > since_s else s for n, s in self._stop_since.items()}

    def kill_frozen(self, model: str) -> None:
        """Kill the worker of ``model``, found frozen (alive, silent: the broker dropped it), and
        forget it, not as a failed load: the model loads again as soon as it is wanted (its requests,
        requeued by the broker, want it)."""
        p = self.running.pop(model, None)
        self._heard.discard(model)
        self._registered.discard(model)
        if p is not None:
            p.kill()
            p.join(self._timeout_s)

    def _take_orders(self, orders, now: float) -> None:
        """The ``POST /models/load`` and ``/models/unload`` orders the broker kept (``status``'s
        ``orders``, :class:`~protocol.messages.PendingOrder`) that this supervisor has not taken yet, in
        order (served names: an alias counts as its model); the next ``demand`` says they are taken."""
        from protocol.enums import ModelAction

        primary = {n: name for name, w in self.configs.items() for n in w.served_names}
        for order in sorted(orders, key=lambda o: o.seq):
            if order.seq <= self._orders_taken:
                continue
            self._orders_taken = order.seq
            name = primary.get(order.model)
            if name is None:
                continue
            if order.action is ModelAction.LOAD:
                self.core.want(name, now)
            elif order.action is ModelAction.UNLOAD:
                self.core.release(name)

    def take_processes(self) -> list[mp.Process]:
        """Every worker process, running or stopping, handed over to be stopped (forgotten here)."""
        procs = list(self.running.values()) + list(self.stopping.values())
        self.running.clear()
        self.stopping.clear()
        self._stop_since.clear()
        return procs

    def close(self) -> None:
        """Close the broker connection (the next pass opens another)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def _resident_bytes(process) -> int | None:
    """The memory ``process`` (a worker's :class:`multiprocessing.Process`) holds now (bytes): its resident
    set less its shared pages (the libraries it maps, torch's ~hundreds of MiB, stay in the page cache
    and leave the machine's available memory as it was), None when it cannot be read (no psutil, the
    process gone, not a real process)."""
    pid = getattr(process, "pid", None)
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        return None
    try:
        mem = psutil.Process(pid).memory_info()
    except (psutil.Error, OSError, ValueError):
        return None
    return max(0, mem.rss - getattr(mem, "shared", 0))


def _fold_aliases(status, names: dict[str, tuple[str, ...]]):
    """``status`` whose models on demand (``names``: model -> its served names, the first its own) each
    sum their served names' lines (requests for an alias queue under the alias until its worker
    registers and claims it)."""
    from protocol.messages import ModelStatus

    models = dict(status.models)
    for name, served in names.items():
        lines = [models[n] for n in served if n in models]
        models[name] = ModelStatus(*(sum(col) for col in zip(*lines))) if lines else ModelStatus(0, 0, 0, 0, 0, 0)
    return replace(status, models=models)
