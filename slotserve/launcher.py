"""The local launcher: a broker, workers and optionally the HTTP gateway as supervised child processes.

Children are started with multiprocessing's ``spawn`` (a clean interpreter:
no inherited sockets, threads or locks) and stopped with terminate ->
join(timeout) -> kill, in order: the gateway (which first drains its
requests, :mod:`gateway.drain`), the workers, the broker. In each child
SIGTERM only sets its stop flag, SIGINT and SIGHUP are ignored (the parent,
which gets them too from a terminal, decides), a thread watches the parent
and stops the child when the parent is gone however it ended (SIGKILL
included; :func:`slotserve.signals.watch_parent`),
and the process title says what the child is (``slotserve broker ...``,
``slotserve worker 0 model=... slots=...`` in ``ps``).
:meth:`LocalCluster.supervise` restarts children that die, from a loop, until
told to stop.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Callable, Sequence

from broker import BrokerConfig, run_broker
from broker.server import tune_gc
from client import BrokerUnavailable, Client
from gateway.config import GatewayConfig
from gateway.drain import END_GRACE_S, PARENT_GONE as PARENT_GONE_MESSAGE
from gateway.listen import bind
from protocol.endpoints import BindError
from protocol.liveness import StallWatch
from protocol.validation import as_seconds
from slotserve.demand_supervisor import DEMAND_POLL_S, DemandSupervisor
from slotserve.logs import configure_logging
from slotserve.on_demand import DEFAULT_IDLE_UNLOAD_S
from slotserve.signals import PARENT_GONE, SignalStopFlag, child_signals, watch_parent
from worker.errors import ModelLoadError
from worker.config import WorkerConfig
from worker.link import announce_dead_load
from worker.process import run_worker

log = logging.getLogger(__name__)

LOST_GRACE = 3.0
"""A worker process the broker has not listed for this many of its ``worker_liveness_s`` (after
listing it) is killed and restarted (:meth:`LocalCluster._kill_lost_workers`); 15 s by default, on
top of the liveness window in which the broker declared it dead."""

_ctx = mp.get_context("spawn")


@dataclass(frozen=True)
class StartFailed:
    """What a child puts on its ready queue in place of its address when it cannot listen
    (a :class:`~protocol.endpoints.BindError`): ``reason``, its one line, which the parent raises
    as its RuntimeError (no traceback in the child's log)."""

    reason: str


# ---------------------------------------------------------------------- child entry points


def _child_setup(title: str, log_level: str, stop_timeout_s: float) -> SignalStopFlag:
    from setproctitle import setproctitle

    setproctitle(title)
    configure_logging(log_level, "%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    stop = SignalStopFlag()  # the loops check it every tick
    child_signals(stop)
    watch_parent(stop, grace_s=stop_timeout_s)
    # At exit the interpreter collects garbage again and again as it clears the modules, each pass
    # over every object: ~1.1 s CPU of a worker's exit with torch and transformers loaded, ~0.2 s
    # with every object frozen first (measured, niced on a busy 2-core host). Atexit handlers run
    # before that; refcounting and the modules' teardown still free what they free.
    atexit.register(gc.freeze)
    return stop


def broker_main(config: BrokerConfig, ready, log_level: str = "WARNING", stop_timeout_s: float = 5.0) -> None:
    """Child process body: run a broker; put ``(frontend, backend)`` on ``ready`` once bound.
    ``stop_timeout_s``: seconds it may take to stop once its parent is gone."""
    stop = _child_setup(f"slotserve broker frontend={config.frontend} backend={config.backend}", log_level,
                        stop_timeout_s)

    def on_ready(frontend: str, backend: str) -> None:
        from setproctitle import setproctitle

        setproctitle(f"slotserve broker frontend={frontend} backend={backend}")  # '*' ports resolved
        ready.put((frontend, backend))

    tune_gc()  # (this process runs only the broker)
    try:
        run_broker(config, stop=stop, on_ready=on_ready)
    except BindError as e:  # one line, said by the parent
        ready.put(StartFailed(str(e)))
        raise SystemExit(1) from None


def worker_main(config: WorkerConfig, log_level: str = "WARNING", index: int = 0, stop_timeout_s: float = 5.0) -> None:
    """Child process body: run a worker (``index``: its place in the cluster, for
    its process title; ``stop_timeout_s`` as for :func:`broker_main`)."""
    stop = _child_setup(f"slotserve worker {index} model={config.model} slots={config.num_slots} "
                        f"broker={config.broker}", log_level, stop_timeout_s)
    try:
        run_worker(config, stop=stop)
    except ModelLoadError as e:  # one clear line, not a page of loader traceback; the parent reports the exit
        logging.getLogger("slotserve.worker").error("%s", e)
        raise SystemExit(1) from None


def gateway_halt(stop: SignalStopFlag, halt=None) -> bool | str:
    """Whether the gateway child ends its drain at once, and why (:func:`gateway.run`'s ``halt``):
    its parent is gone (the message its requests get: nothing could finish, the broker and workers
    stop too), a second SIGTERM or the parent's ``halt`` event (a second stop signal: True), else False."""
    if stop.reason == PARENT_GONE:
        return PARENT_GONE_MESSAGE
    return stop.repeated() or (halt is not None and halt.is_set())


def gateway_main(config: GatewayConfig, ready, log_level: str = "WARNING", stop_timeout_s: float = 5.0,
                 halt=None) -> None:
    """Child process body: run the HTTP gateway; put its ``http://host:port`` on
    ``ready`` once bound (``stop_timeout_s`` as for :func:`broker_main`).

    SIGTERM drains it; it ends what is in flight at once when ``halt`` (a
    multiprocessing Event) is set, on a second SIGTERM, or when the parent is
    gone (the workers and the broker stop then too: nothing could finish)."""
    stop = _child_setup(f"slotserve gateway host={config.host} port={config.port} broker={config.broker}",
                        log_level, stop_timeout_s)
    from gateway import run

    def on_ready(url: str) -> None:
        from setproctitle import setproctitle

        setproctitle(f"slotserve gateway {url} broker={config.broker}")  # port 0 resolved
        ready.put(url)

    def should_halt() -> bool | str:
        return gateway_halt(stop, halt)

    from slotserve.tokenizer import loader_for

    try:
        run(config, stop=stop, halt=should_halt, on_ready=on_ready, load_tokenizer=loader_for(config))
    except BindError as e:  # one line, said by the parent
        ready.put(StartFailed(str(e)))
        raise SystemExit(1) from None


# ---------------------------------------------------------------------- the cluster


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A broker and its workers, as one process tree.

    - ``broker``: the broker's config (``tcp://127.0.0.1:*`` endpoints pick free ports).
    - ``workers``: one config per worker; their ``broker`` field is replaced
      by the broker's actual backend endpoint.
    - ``start_timeout_s``: seconds for the broker to bind and every worker to register.
    - ``stop_timeout_s``: seconds each child gets to exit after SIGTERM before
      SIGKILL (the gateway: on top of its drain, ``shutdown_timeout_s``).
    - ``log_level``: children's logging level (``WARNING``, ``INFO``, ...).
    - ``client_curve``: CURVE keys for the launcher's own client (readiness
      checks) when the broker requires CURVE: as ``Client(curve=...)``.
    - ``gateway``: an HTTP gateway to start once the workers registered (its
      ``broker`` field is replaced by the broker's client endpoint), or None.
    - ``on_demand``: one worker config per model loaded on demand (issue 34):
      none runs at start; :meth:`LocalCluster.supervise` starts a model's worker
      when requests for it wait in the broker and stops it when idle, as
      :class:`slotserve.on_demand.OnDemand` decides, at most
      ``max_loaded_models`` at once, each unloaded after ``idle_unload_s``
      seconds without requests (0: never). Their served names become the
      broker's ``on_demand_models`` (and the gateway's).
    """

    broker: BrokerConfig
    workers: tuple[WorkerConfig, ...]
    start_timeout_s: float = 600.0  # real models load in 10-60 s on 2 cores; a dead worker fails fast anyway
    stop_timeout_s: float = 5.0
    log_level: str = "WARNING"
    client_curve: object = None
    gateway: GatewayConfig | None = None
    on_demand: tuple[WorkerConfig, ...] = ()
    max_loaded_models: int = 3  # Ollama's default on a CPU
    idle_unload_s: float = DEFAULT_IDLE_UNLOAD_S

    def __post_init__(self) -> None:
        if not self.workers and not self.on_demand:
            raise ValueError("a cluster needs at least one worker, or models on demand")
        names = [w.served_names[0] for w in self.on_demand]
        if len(set(names)) != len(names):
            raise ValueError(f"each model on demand once: got {names}")
        if type(self.max_loaded_models) is not int or self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be an int >= 1, got {self.max_loaded_models!r}")
        as_seconds(self.idle_unload_s, "idle_unload_s", allow_zero=True)
        for n in ("start_timeout_s", "stop_timeout_s"):
            as_seconds(getattr(self, n), n)


class LocalCluster:
    """Start, supervise and stop a :class:`ClusterConfig`; a context manager.

    After :meth:`start`, :attr:`frontend` is the clients' endpoint and
    :attr:`http_url` the gateway's (None without one). Raises RuntimeError
    when the broker, a worker or the gateway fails to come up in time.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.frontend: str | None = None
        self.backend: str | None = None
        self._broker_cfg = config.broker
        self._broker: mp.Process | None = None
        self._workers: list[mp.Process | None] = [None] * len(config.workers)
        self._restarts: list[float] = []
        self.http_url: str | None = None
        self._gateway_cfg = config.gateway
        self._gateway: mp.Process | None = None
        self._gateway_halt = _ctx.Event() if config.gateway is not None else None  # set: end the drain at once
        self._should_stop: Callable[[], bool] = _never
        self._watch: Client | None = None  # the broker's worker list, for _kill_lost_workers
        # worker index (a model's name, on demand) -> (its pid, when the broker last listed it)
        self._listed: dict[int | str, tuple[int, float]] = {}
        self._next_watch = 0.0
        # the watch's own stalls (the launcher suspended): the broker's lists meanwhile do not count. From
        # the first watch on (start() may load models for minutes before it).
        self._stalls: StallWatch | None = None
        self._demand: DemandSupervisor | None = None  # the models on demand
        if config.on_demand:
            self._demand = DemandSupervisor(
                config.on_demand, config.max_loaded_models, config.idle_unload_s, spawn=self._spawn_on_demand,
                connect=lambda: Client(self.frontend, connect_timeout_s=config.stop_timeout_s,
                                       name="launcher-on-demand", curve=config.client_curve),
                timeout_s=config.stop_timeout_s, announce=self._announce_on_demand)
            names = self._demand.served_names
            self._broker_cfg = replace(config.broker, on_demand_models=names)
            if self._gateway_cfg is not None:  # (each model's names grouped: its primary first while unloaded)
                self._gateway_cfg = replace(self._gateway_cfg, on_demand_models=names,
                                            on_demand_aliases=self._demand.aliases)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def worker_processes(self) -> list[mp.Process]:
        """The worker processes running: the fixed ones, then those of models on demand."""
        return [p for p in self._workers if p is not None] + \
            (list(self._demand.running.values()) if self._demand is not None else [])

    @property
    def loaded_on_demand(self) -> dict[str, mp.Process]:
        """Models on demand whose worker runs (started, maybe not registered yet): model -> its process."""
        return {} if self._demand is None else dict(self._demand.running)

    @property
    def broker_process(self) -> mp.Process | None:
        return self._broker

    @property
    def gateway_process(self) -> mp.Process | None:
        return self._gateway

    def start(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Start the broker, then the workers; return once all workers registered.

        ``should_stop``: checked while waiting (e.g. a signal flag); when it
        turns true the children are stopped and RuntimeError is raised.
        """
        self._should_stop = should_stop or (lambda: False)
        try:
            self._check_http_port()
            self._start_broker()
            for i in range(len(self._workers)):
                self._start_worker(i)
            self.wait_ready(self.config.start_timeout_s)
            if self._gateway_cfg is not None:
                self._start_gateway()
        except BaseException:
            self.stop()
            raise
        finally:
            self._should_stop = _never

    def _check_http_port(self) -> None:
        """RuntimeError (the :class:`~protocol.endpoints.BindError`'s one line) when the gateway's port
        cannot be bound now: another server listens there, or its host is not this machine's. Checked
        before the broker starts and the workers load their models (for a large model, minutes): the
        gateway binds it once they are ready, and a second ``slotserve up`` on a taken ``--http-port``
        said so only then. Port 0 (a free one) is not checked; a port taken between this check and the
        gateway's start is still said then."""
        cfg = self._gateway_cfg
        if cfg is None or cfg.port == 0:
            return
        try:
            bind(cfg.host, cfg.port).close()
        except BindError as e:
            raise RuntimeError(str(e)) from None

    def _check_stop(self) -> None:
        if self._should_stop():
            raise RuntimeError("stopped while starting")

    def _start_broker(self) -> None:
        ready = _ctx.Queue()
        p = _ctx.Process(target=broker_main,
                         args=(self._broker_cfg, ready, self.config.log_level, self.config.stop_timeout_s),
                         name="slotserve-broker", daemon=True)
        p.start()
        self._broker = p
        self.frontend, self.backend = self._await_ready(p, ready, "the broker")
        # A restarted broker must come back on the same endpoints.
        self._broker_cfg = replace(self._broker_cfg, frontend=self.frontend, backend=self.backend)

    def _await_ready(self, p, ready, what: str):
        """What child ``p`` puts on ``ready`` once it has bound its sockets.
        RuntimeError if it cannot bind them (the :class:`StartFailed` reason it sent), exits
        first or takes longer than ``start_timeout_s``; a stop request (signal) interrupts the wait."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            alive = p.is_alive()  # before the read: what a child put, its exit flushes before it ends
            try:
                value = ready.get(timeout=0.2)
                break
            except queue.Empty:  # check the child is still alive, then wait on
                self._check_stop()
                if not alive:
                    raise RuntimeError(f"{what} exited with code {p.exitcode} while starting "
                                       "(see its log above)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not bind within the start timeout") from None
        ready.close()
        if isinstance(value, StartFailed):
            raise RuntimeError(value.reason)
        return value

    def _start_gateway(self) -> None:
        self._gateway_halt.clear()
        ready = _ctx.Queue()
        cfg = replace(self._gateway_cfg, broker=self.frontend)
        p = _ctx.Process(target=gateway_main,
                         args=(cfg, ready, self.config.log_level, self.config.stop_timeout_s, self._gateway_halt),
                         name="slotserve-gateway", daemon=True)
        p.start()
        self._gateway = p
        self.http_url = self._await_ready(p, ready, "the HTTP gateway")
        # A restarted gateway must come back on the same port.
        self._gateway_cfg = replace(cfg, port=int(self.http_url.rsplit(":", 1)[1]))

    def _start_worker(self, i: int) -> None:
        cfg = replace(self.config.workers[i], broker=self.backend)
        p = _ctx.Process(target=worker_main, args=(cfg, self.config.log_level, i, self.config.stop_timeout_s),
                         name=f"slotserve-worker-{i}", daemon=True)
        p.start()
        self._workers[i] = p

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker is registered with the broker (loaded and warmed up; RuntimeError
        after ``timeout_s``). A status query the broker leaves unanswered (starved or frozen a while:
        a busy machine, a stopped process group) is asked again until then."""
        deadline = time.monotonic() + timeout_s
        expected: dict[str, int] = {}
        for w in self.config.workers:
            name = w.served_names[0]  # the name the broker lists the model by
            expected[name] = expected.get(name, 0) + 1
        with Client(self.frontend, connect_timeout_s=timeout_s, name="launcher",
                    curve=self.config.client_curve) as c:
            while True:
                self._check_stop()
                try:
                    st = c.status()
                except BrokerUnavailable:
                    st = None
                if st is not None and all(m in st.models and st.models[m].workers >= n
                                          for m, n in expected.items()):
                    return
                for i, p in enumerate(self._workers):
                    if p is not None and not p.is_alive():
                        raise RuntimeError(f"worker {i} exited with code {p.exitcode} while starting "
                                           "(see its log above)")
                if self._broker is not None and not self._broker.is_alive():
                    raise RuntimeError(f"the broker exited with code {self._broker.exitcode} while the workers "
                                       "started (see its log above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not register within {timeout_s} s"
                                       + ("" if st is not None else " (the broker did not answer its status query)"))
                wait_for_sentinels([p.sentinel for p in self.worker_processes], timeout=0.05)

    def supervise(self, should_stop: Callable[[], bool], *, max_restarts_per_min: int = 10,
                  wakeup_fd: int | None = None, poll_s: float = 1.0) -> None:
        """Restart children that exit until ``should_stop()`` is true.

        Waits on the children's sentinels (and ``wakeup_fd``, e.g. a signal
        wakeup pipe, non-blocking; drained when it wakes the loop) rather
        than sleeping; ``should_stop`` is also checked every ``poll_s``
        seconds. Raises RuntimeError when children die more than
        ``max_restarts_per_min`` times in a minute (a crash loop).
        """
        if self._demand is not None:
            poll_s = min(poll_s, DEMAND_POLL_S)
        while not should_stop():
            if self._demand is not None:
                self.on_demand_pass()
            handles = [p.sentinel for p in self.worker_processes]
            if self._broker is not None:
                handles.append(self._broker.sentinel)
            if self._gateway is not None:
                handles.append(self._gateway.sentinel)
            if wakeup_fd is not None:
                handles.append(wakeup_fd)
            if wakeup_fd in wait_for_sentinels(handles, timeout=poll_s):
                _drain(wakeup_fd)
            if should_stop():
                return
            if self._broker is not None and not self._broker.is_alive():
                self._note_restart(max_restarts_per_min, f"broker (exit code {self._broker.exitcode})")
                self._broker.join()
                self._start_broker()
                self._listed.clear()  # the workers register again: none is lost before the new broker lists it
            for i, p in enumerate(self._workers):
                if p is not None and not p.is_alive():
                    self._note_restart(max_restarts_per_min, f"worker {i} (exit code {p.exitcode})")
                    p.join()
                    self._start_worker(i)
            if self._gateway is not None and not self._gateway.is_alive():
                self._note_restart(max_restarts_per_min, f"HTTP gateway (exit code {self._gateway.exitcode})")
                self._gateway.join()
                self._start_gateway()
            self._kill_lost_workers(period_s=poll_s)  # (a frozen one: killed here, restarted above on the next pass)

    def _kill_lost_workers(self, now: float | None = None, period_s: float = 0.0) -> list[int]:
        """Kill each worker process that is alive but that the broker stopped listing, more than
        :data:`LOST_GRACE` x its ``worker_liveness_s`` ago, after it had listed it: a frozen process
        (SIGSTOP, a deadlock) that the broker declared dead, whose requests it requeued. Only a
        process that exits is restarted (:meth:`supervise`), so those requests waited for a worker
        that never came back (a break-it pass froze one: its request waited forever). Looks at most
        every half ``worker_liveness_s``; nothing while the broker does not answer (it restarts).
        A model's worker on demand is watched alike (keyed by the model's name): killed, it is
        forgotten, and the model loads again for the requests the broker requeued (a break-it pass
        froze one: its requests, and with ``--max-loaded-models 1`` every other model's, waited
        forever). A worker loading its model counts as listed while the broker lists it loading
        (``Status.loading_workers``): one frozen in its load, which the broker then drops as silent, is
        killed alike (a break-it pass froze one during its load on demand: it was never killed, and its
        model's requests, and with ``--max-loaded-models 1`` every other model's, waited forever).
        A call that comes late (the launcher itself was stalled: suspended, SIGSTOPped with the whole
        cluster, starved; :class:`~protocol.liveness.StallWatch`, against ``LOST_GRACE`` x
        ``worker_liveness_s``) counts every worker as listed now instead (a fresh window; not twice in a
        row for one the broker has not listed since: a slow launcher still kills): the launcher
        did not watch meanwhile (a break-it pass froze a whole cluster 172 s: it killed a worker as
        frozen). ``now``: the monotonic clock (seconds; :func:`time.monotonic`'s by default).
        ``period_s``: the longest the caller waits on purpose between two calls (seconds: the supervise
        loop's ``poll_s``), never taken for a stall (with ``worker_liveness_s`` 0.6 the stall threshold
        was 0.9 s, under the loop's 1 s: every call was a stall, and a frozen worker was never killed).
        Returns the indices (names, on demand) killed."""
        now = time.monotonic() if now is None else now
        if self._stalls is None:
            self._stalls = StallWatch(LOST_GRACE * self._broker_cfg.worker_liveness_s, now)
        self._stalls.period_s = period_s
        if (stalled_s := self._stalls.stalled(now)) is not None:
            log.warning("the launcher did not watch its workers for %.1f s (suspended, starved or busy): each "
                        "gets a fresh window before it counts as frozen", stalled_s)
            self._listed = {i: (pid, now if self._stalls.excuses(seen) else seen)
                            for i, (pid, seen) in self._listed.items()}
        alive = [(i, p, self.config.workers[i]) for i, p in enumerate(self._workers) if p is not None and p.is_alive()]
        if self._demand is not None:  # a model's on demand, keyed by its name (killed, it loads again when wanted)
            alive += [(m, p, self._demand.configs[m]) for m, p in self._demand.running.items() if p.is_alive()]
        if now < self._next_watch or not alive or self.frontend is None:
            return []
        liveness = self._broker_cfg.worker_liveness_s
        self._next_watch = now + liveness / 2
        try:
            if self._watch is None:
                self._watch = Client(self.frontend, connect_timeout_s=self.config.stop_timeout_s, name="launcher-watch",
                                     curve=self.config.client_curve)
            st = self._watch.status(timeout_s=self.config.stop_timeout_s)
            listed = {w.name for w in st.workers} | set(st.loading_workers)  # (registered or loading)
        except (ConnectionError, TimeoutError, RuntimeError):
            return []
        killed = []
        for i, p, cfg in alive:
            name = cfg.name_of(p.pid)
            seen = self._listed.get(i)
            if name in listed:
                self._listed[i] = (p.pid, now)
            elif seen is not None and seen[0] == p.pid and now - seen[1] > LOST_GRACE * liveness:
                what = f"worker {i}" if isinstance(i, int) else f"the worker of model {i!r} (on demand)"
                log.warning("%s (pid %d) is alive but has not answered the broker for %.0f s (frozen?): "
                            "killing it, to start it again", what, p.pid, now - seen[1])
                if isinstance(i, int):
                    p.kill()
                else:
                    self._demand.kill_frozen(i)
                del self._listed[i]
                killed.append(i)
        return killed

    def _note_restart(self, limit: int, what: str) -> None:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        if len(self._restarts) > limit:
            raise RuntimeError(f"{what} died; more than {limit} restarts in a minute: giving up")
        log.warning("%s died: restarting it", what)

    def on_demand_pass(self, now: float | None = None) -> list:
        """One pass of the models on demand (:meth:`supervise` runs it every ``DEMAND_POLL_S``):
        :meth:`DemandSupervisor.run_pass`'s actions ([] without models on demand)."""
        return [] if self._demand is None else self._demand.run_pass(now)

    def _spawn_on_demand(self, model: str, config: WorkerConfig) -> mp.Process:
        index = len(self._workers) + list(self._demand.configs).index(model)
        p = _ctx.Process(target=worker_main, args=(replace(config, broker=self.backend), self.config.log_level,
                                                   index, self.config.stop_timeout_s),
                         name=f"slotserve-worker-{index}", daemon=True)
        p.start()
        return p

    def _announce_on_demand(self, model: str, config: WorkerConfig, worker_name: str) -> None:
        """Announce to the broker the load of ``model``'s worker that died before it could (as
        :meth:`_spawn_on_demand` started it: on the cluster's backend)."""
        announce_dead_load(replace(config, broker=self.backend), worker_name, self.config.stop_timeout_s)

    def restart_broker(self) -> None:
        """Start the broker again on the same endpoints (after a test killed it)."""
        if self._broker is not None:
            self._broker.join(self.config.stop_timeout_s)
        self._start_broker()
        self._listed.clear()

    def restart_worker(self, i: int) -> None:
        """Start worker ``i`` again (after a test killed it)."""
        p = self._workers[i]
        if p is not None:
            p.join(self.config.stop_timeout_s)
        self._start_worker(i)

    def stop(self, halt: Callable[[], bool] | None = None, wakeup_fd: int | None = None) -> None:
        """Stop the gateway, the workers, then the broker: SIGTERM -> join(timeout) -> SIGKILL. Idempotent.

        The gateway drains first (up to its ``shutdown_timeout_s``) while the
        workers and the broker still serve (and models on demand still load for
        the requests in flight); when ``halt()`` turns true (a
        second signal; looked at when ``wakeup_fd``, e.g. the signal wakeup
        pipe, wakes the wait, and every 0.1 s) it ends its requests at once.
        """
        if self._gateway is not None:
            self._stop_gateway(halt or _never, wakeup_fd)
            self._gateway = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        procs: list[mp.Process] = [p for p in self._workers if p is not None]
        if self._demand is not None:
            self._demand.close()
            procs += self._demand.take_processes()
        _terminate(procs, self.config.stop_timeout_s)
        if self._broker is not None:
            _terminate([self._broker], self.config.stop_timeout_s)
        self._workers = [None] * len(self._workers)
        self._broker = None

    def _stop_gateway(self, halt: Callable[[], bool], wakeup_fd: int | None) -> None:
        p = self._gateway
        if p.is_alive():
            p.terminate()  # it drains: new requests 503, those in flight get shutdown_timeout_s
        stop_s = self.config.stop_timeout_s
        deadline = time.monotonic() + self._gateway_cfg.shutdown_timeout_s + END_GRACE_S + stop_s
        handles = [p.sentinel] + ([wakeup_fd] if wakeup_fd is not None else [])
        while p.is_alive() and time.monotonic() < deadline:
            if not self._gateway_halt.is_set() and halt():
                self._gateway_halt.set()  # a second signal: end what is in flight now
                deadline = min(deadline, time.monotonic() + END_GRACE_S + stop_s)
            if self._demand is not None:  # requests in flight may wait for a model's load: keep loading
                self.on_demand_pass()
            wait_s = DEMAND_POLL_S if self._demand is not None else 0.1
            if wakeup_fd in wait_for_sentinels(handles, timeout=max(0.0, min(wait_s, deadline - time.monotonic()))):
                _drain(wakeup_fd)
        if p.is_alive():
            log.warning("%s did not stop within its drain and %.1f s: killing it", p.name, stop_s)
            p.kill()
        p.join()


def make_curve_keys(curve_dir: str, *, clients: int = 1, workers: int = 1) -> list[str]:
    """Write a CURVE key layout (:mod:`protocol.curve`) into ``curve_dir``:
    the broker's pair, ``client``/``worker`` pairs (more as ``client2``...
    when ``clients``/``workers`` > 1), and their public keys in the
    ``clients/`` and ``workers/`` allow-lists. Existing key files are kept.
    Returns the files written. Raises ValueError for counts < 0."""
    import os
    import shutil

    from zmq.auth import create_certificates

    from protocol.curve import BROKER_NAME, CLIENTS_DIR, WORKERS_DIR

    if clients < 0 or workers < 0:
        raise ValueError("key counts must be >= 0")
    os.makedirs(curve_dir, exist_ok=True)
    written = []

    def pair(name: str) -> str:
        public = os.path.join(curve_dir, f"{name}.key")
        if not os.path.exists(public):
            pub, sec = create_certificates(curve_dir, name)
            os.chmod(sec, 0o600)
            written.extend([pub, sec])
        return public

    pair(BROKER_NAME)
    for role, sub, n in (("client", CLIENTS_DIR, clients), ("worker", WORKERS_DIR, workers)):
        allow = os.path.join(curve_dir, sub)
        os.makedirs(allow, exist_ok=True)
        for i in range(n):
            public = pair(role if i == 0 else f"{role}{i + 1}")
            dest = os.path.join(allow, os.path.basename(public))
            if not os.path.exists(dest):
                shutil.copyfile(public, dest)
                written.append(dest)
    return written


def _never() -> bool:
    return False


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _terminate(procs: Sequence[mp.Process], timeout_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("%s did not stop within %.1f s: killing it", p.name, timeout_s)
            p.kill()
            p.join()
