"""Silence judged on the judge's own clock (:mod:`protocol.liveness`): every liveness judge whose own
loop was stalled past its peers' window (the whole cluster SIGSTOPped and resumed, a suspended laptop
or VM) gives its peers a fresh window instead of declaring them dead, and one that ran normally still
declares a silent peer dead a window after its last word. A break-it pass froze a whole ``slotserve
up`` for 20-172 s and resumed it: the launcher killed a worker as 'alive but has not answered the
broker for 172 s (frozen?)', two requests ended 'no heartbeat from this client for 10 s', and the
broker could take workers for lost and move their requests.

One test per judge, each on an injected clock, no sleeps: the broker's core and its socket loop (of
its workers, loaders and clients, their progress, the start-up grace), a worker's link (of its
broker), the client's I/O thread (of its broker: the deadline of a request the broker does not end),
the launcher (of its worker processes)."""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import pytest
import zmq

from broker import BrokerConfig
from broker.server import BrokerServer
from client.connection import DEADLINE_GRACE_HEARTBEATS, Connection
from protocol.codec import decode, encode
from protocol.liveness import STALL_FRACTION, StallWatch
from protocol.messages import (
    BROKER_TO_CLIENT, BROKER_TO_WORKER, Heartbeat, Hello, Loading, Register, Submit, Welcome,
)
from tests.support import cores
from tests.support.cluster import ANY_PORT
from tests.support.cores import C1, INFO, W1, W2, assigned
from tests.support.messages import envelope
from tests.support.waits import Deadline, wait_until
from worker import SimulatedLLM
from worker.config import WorkerConfig
from worker.link import BrokerLink
from worker.process import WorkerProcess

T0 = 1000.0
"""Where the injected clocks start (seconds; steps of 0.25 stay exact)."""


class FakeClock:
    """A monotonic clock the test moves (:meth:`advance`); read from any thread."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now


# ---------------------------------------------------------------------- the shared helper


def test_a_turn_later_than_half_the_window_is_a_stall_and_one_within_it_is_not():
    watch = StallWatch(2.0, T0)
    assert watch.threshold_s == STALL_FRACTION * 2.0 == 1.0
    assert watch.stalled(T0 + 1.0) is None  # exactly the threshold: no stall
    assert watch.stalled(T0 + 2.5) == 1.5  # the gap since the previous turn
    assert watch.stalled(T0 + 2.5) is None and watch.stalled(T0 + 3.0) is None
    # never less than twice the loop's own wait between turns: a loop that turns as meant is no stall
    slow = StallWatch(1.5, T0, period_s=1.0)
    assert slow.threshold_s == 2.0 and slow.stalled(T0 + 2.0) is None and slow.stalled(T0 + 4.5) == 2.5
    watch.window_s = 6.0  # a peer announced a longer interval
    assert watch.stalled(T0 + 5.9) is None and watch.stalled(T0 + 9.1) == pytest.approx(3.2)
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="window_s"):
            StallWatch(bad, T0)
    with pytest.raises(ValueError, match="period_s"):
        StallWatch(1.0, T0, period_s=-0.1)


# ---------------------------------------------------------------------- the broker


make_core = functools.partial(cores.make_core, heartbeat_interval_s=0.25, worker_liveness_s=1.0,
                              client_liveness_s=2.0, worker_hung_s=3.0, register_grace_s=2.0)


def _busy_core():
    """A core with a worker holding a request (W1), a worker loading (W2), a client (C1) with a
    request for a model nobody serves yet (waiting out the start-up grace), all last heard at 0.5."""
    core = make_core()
    core.on_backend(W1, Register("simulated", 1, 1, INFO, "w1"), 0.0)
    core.on_backend(W2, Loading("lazy", "w2"), 0.0)
    (spec,) = assigned(core.on_frontend(C1, Submit("simulated", [envelope("a", [1], 5)]), 0.0), W1)
    core.on_frontend(C1, Submit("later", [envelope("b", [1], 5)]), 0.0)
    core.on_backend(W1, Heartbeat(progress=0), 0.5)
    core.on_backend(W2, Heartbeat(), 0.5)
    core.on_frontend(C1, Heartbeat(), 0.5)
    return core, spec


def _judged(core) -> dict:
    return {k: core.counters[k] for k in ("workers_lost", "workers_hung", "clients_lost", "requeued", "errors")}


NOTHING = {"workers_lost": 0, "workers_hung": 0, "clients_lost": 0, "requeued": 0, "errors": 0}


def test_the_broker_core_gives_everyone_a_fresh_window_after_its_own_stall():
    """Stalled for 3 x its longest window: every worker, loader and client, every progress timer and
    the start-up grace start over; silent for a window after that, each is judged as before."""
    core, spec = _busy_core()
    stall_end = 0.5 + 3 * 3.0  # 3 x worker_hung_s, the longest window
    core.restart_silence_timers(stall_end)
    core.tick(stall_end)
    assert _judged(core) == NOTHING
    assert core.workers.get(W1).inflight == {spec.request_id} and "w2" in core.status(stall_end).loading_workers
    assert core.queues["later"] and C1 in core.clients  # still within the (restarted) grace
    # then running normally, everyone silent: the worker and the loader are dead one window later
    core.tick(stall_end + 0.75)
    assert _judged(core) == NOTHING
    core.tick(stall_end + 1.25)
    assert core.counters["workers_lost"] == 1 and core.counters["requeued"] == 1 and core.workers.get(W1) is None
    assert core.status(stall_end + 1.25).loading_workers == {}
    core.tick(stall_end + 2.25)  # the client too, and the grace is over
    assert core.counters["clients_lost"] == 1 and C1 not in core.clients and "later" not in core.queues


def test_the_broker_core_that_ran_normally_judges_silence_as_before():
    """(The same peers, no stall of the judge: the worker is lost one window after its last word.)"""
    core, spec = _busy_core()
    t = 0.5
    while t <= 1.5:  # silent for a whole window, not past it
        core.tick(t)
        t += 0.25
    assert _judged(core) == NOTHING
    core.tick(1.75)
    assert core.counters["workers_lost"] == 1 and core.counters["requeued"] == 1 and core.workers.get(W1) is None


def _recv(sock: zmq.Socket, kinds, timeout_s: float = 10.0):
    """The next message on ``sock`` (a DEALER to the broker), decoded as ``kinds``; AssertionError
    after ``timeout_s``."""
    deadline = Deadline(timeout_s)
    while not deadline.passed():
        if sock.poll(max(1, int(deadline.left_s() * 1000))):
            return decode(sock.recv(), kinds)
    raise AssertionError(f"nothing from the broker within {timeout_s} s")


@contextlib.contextmanager
def _broker_loop(clock: FakeClock):
    """A broker's socket loop on ``clock`` (heartbeats every 0.25 s, worker and client windows 1 s) on
    its own thread, with a worker and a client that registered and said hello: yields ``(config,
    core, worker, client)``, the two DEALER sockets; stops and closes everything after."""
    cfg = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.25, worker_liveness_s=1.0,
                       client_liveness_s=1.0)
    server = BrokerServer(cfg, clock=clock)
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    ctx = zmq.Context()
    worker, client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        loop.start()
        for s, to in ((worker, server.backend), (client, server.frontend)):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"silent-" + to.encode())
            s.connect(to)
        worker.send(encode(Register("simulated", 1, 1, INFO, "w")))
        assert type(_recv(worker, BROKER_TO_WORKER)) is Welcome
        client.send(encode(Hello("c")))
        assert type(_recv(client, BROKER_TO_CLIENT)) is Welcome
        yield cfg, server.core, worker, client
    finally:
        stop.set()
        loop.join(10)
        worker.close(0)
        client.close(0)
        ctx.term()
        server.close()


def test_the_broker_loop_times_its_own_stalls():
    """The socket loop on an injected clock, with a worker and a client that register and fall
    silent: a jump of 3 windows (the broker's stall) leaves both registered (they get the next
    heartbeat); steps of a quarter window (the broker running, no word from them) lose both."""
    clock = FakeClock()
    with _broker_loop(clock) as (cfg, core, worker, client):
        clock.advance(3 * cfg.worker_liveness_s)  # the broker stalled (its peers too)
        assert type(_recv(worker, BROKER_TO_WORKER)) is Heartbeat  # (the tick after the stall kept it)
        assert type(_recv(client, BROKER_TO_CLIENT)) is Heartbeat
        assert core.counters["workers_lost"] == 0 and len(core.workers) == 1 and len(core.clients) == 1
        for _ in range(4):  # running, a quarter window a turn: silent for a whole window, not past it
            clock.advance(0.25)
            assert type(_recv(worker, BROKER_TO_WORKER)) is Heartbeat
            assert type(_recv(client, BROKER_TO_CLIENT)) is Heartbeat
        clock.advance(0.25)
        wait_until(lambda: core.counters["workers_lost"] == 1 and not core.clients, 10,
                   "the silent worker and client to be judged gone", lambda: (core.counters, len(core.clients)))


# ---------------------------------------------------------------------- a worker's link to its broker


def _linked(clock: FakeClock) -> tuple[BrokerLink, list]:
    """A registered worker link on ``clock`` (broker window 1 s, heartbeats every 0.25 s), its
    sends recorded."""
    wp = WorkerProcess(WorkerConfig(broker="tcp://127.0.0.1:1", heartbeat_interval_s=0.25, broker_liveness_s=1.0),
                       SimulatedLLM())
    ctx = zmq.Context.instance()
    pipe = ctx.socket(zmq.PAIR)
    link = BrokerLink(wp, ctx, pipe, clock=clock)
    pipe.close(0)
    sent: list = []
    link.send = sent.append
    link.ready = link.welcomed = link.registered = True
    return link, sent


def test_a_worker_gives_its_broker_a_fresh_window_after_its_own_stall():
    """Stalled for 3 x the broker's window: no re-registration (which drops every request it holds:
    the broker moves them); then running and the broker silent: it registers again after a window."""
    clock = FakeClock()
    link, sent = _linked(clock)
    try:
        clock.advance(3 * link.broker_liveness_s)
        link._keep_alive()
        assert link.registered and not [m for m in sent if type(m) is Register]
        assert sent == [Heartbeat(progress=0)]  # what a stall ends with: its heartbeat, due long ago
        for _ in range(4):
            clock.advance(0.25)
            link._keep_alive()
        assert link.registered and not [m for m in sent if type(m) is Register]
        clock.advance(0.25)
        link._keep_alive()
        assert not link.registered and type(sent[-1]) is Register
    finally:
        link.sock.close(0)


def test_a_worker_that_ran_normally_registers_again_after_the_brokers_window():
    clock = FakeClock()
    link, sent = _linked(clock)
    try:
        for _ in range(5):
            clock.advance(0.25)
            link._keep_alive()
        assert not link.registered and type(sent[-1]) is Register
    finally:
        link.sock.close(0)


def test_a_worker_waiting_for_its_brokers_answer_polls_instead_of_spinning():
    """Before the broker's welcome no heartbeat is sent, so the loop waits until the broker's window
    ends (at most a heartbeat interval) rather than for a heartbeat due long ago (0 ms: ~65,000 turns a
    second while the broker was down); once welcomed, until the next heartbeat is due."""
    clock = FakeClock()
    link, sent = _linked(clock)
    try:
        link.welcomed = link.registered = False
        link.last_sent = T0  # its register left
        clock.advance(0.5)  # a heartbeat interval passed long ago: 0 ms before
        assert link._wait_ms() == 250.0
        clock.advance(0.375)
        assert link._wait_ms() == 125.0  # the broker's window ends first
        link.welcomed = True
        link.last_sent = clock() - 0.125
        assert link._wait_ms() == 125.0
    finally:
        link.sock.close(0)


# ---------------------------------------------------------------------- the client's view of its broker


def test_the_client_gives_its_broker_a_fresh_window_after_its_own_stall():
    """The client's I/O loop on an injected clock (heartbeats every 0.25 s, the broker's window 3 of
    them): after a jump of 3 windows, the broker counts as heard at the jump (the deadline judge,
    :meth:`ClientCore.overdue`, waits a window more); running on with no word from it, the broker's
    silence grows from there as before."""
    clock = FakeClock()
    ticks: list = []
    conn = Connection("tcp://127.0.0.1:1", "m", lambda msg: None, heartbeat_interval_s=0.25,
                      on_tick=lambda now, heard_s, interval_s: ticks.append((now, heard_s)), clock=clock)
    window = DEADLINE_GRACE_HEARTBEATS * 0.25

    def turn_at(now: float) -> tuple:
        conn.send(Heartbeat())  # wakes the loop: a turn at ``now``
        return wait_until(lambda: next((t for t in reversed(ticks) if t[0] == now), None), 10, f"a turn at {now}")

    try:
        turn_at(T0)
        now, heard = turn_at(clock.advance(3 * window))
        assert heard == now  # (without the stall watch: T0, 3 windows of silence)
        for _ in range(2):
            now, heard = turn_at(clock.advance(0.25))
            assert now - heard < window
        now, heard = turn_at(clock.advance(0.25))
        assert heard == T0 + 3 * window and now - heard >= window  # a broker silent a window: judged
    finally:
        conn.close()


# ---------------------------------------------------------------------- the launcher of its workers


class _Process:
    """A worker process as the launcher's watch sees it: alive until killed."""

    pid = 4242
    exitcode = None

    def __init__(self) -> None:
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def _watched_worker() -> tuple:
    """A launcher (started nothing) watching one alive worker process that its broker (a fake
    status) stops listing after the first look: (cluster, the process, the broker's list)."""
    from slotserve.launcher import ClusterConfig, LocalCluster

    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.25,
                                     worker_liveness_s=1.0), (WorkerConfig(name="w0"),))
    cluster = LocalCluster(cfg)
    proc, listed = _Process(), {"w0"}
    cluster.frontend = "tcp://127.0.0.1:1"
    cluster._workers = [proc]
    cluster._watch = types.SimpleNamespace(
        status=lambda timeout_s: types.SimpleNamespace(workers=[types.SimpleNamespace(name=n) for n in listed],
                                                       loading_workers={}))
    assert cluster._kill_lost_workers(T0) == [] and cluster._listed[0] == (proc.pid, T0)
    listed.clear()  # the broker dropped it
    return cluster, proc


def test_the_launcher_gives_its_workers_a_fresh_window_after_its_own_stall():
    """Stalled for 3 x its window (LOST_GRACE x worker_liveness_s: 3 s): the unlisted worker is not
    killed on waking; watched on every half liveness window after, it is killed once unlisted for
    the window (was: killed at once, 'has not answered the broker for 9 s (frozen?)')."""
    from slotserve.launcher import LOST_GRACE

    cluster, proc = _watched_worker()
    window = LOST_GRACE * 1.0
    now = T0 + 3 * window
    assert cluster._kill_lost_workers(now) == [] and not proc.killed
    woke = now
    while now - woke <= window:
        now += 0.5
        killed = cluster._kill_lost_workers(now)
        assert killed == ([0] if now - woke > window else []) and proc.killed is bool(killed)


def test_the_launcher_that_ran_normally_kills_a_worker_unlisted_for_its_window():
    from slotserve.launcher import LOST_GRACE

    cluster, proc = _watched_worker()
    now = T0
    while not proc.killed:
        now += 0.5
        cluster._kill_lost_workers(now)
    assert now == T0 + LOST_GRACE * 1.0 + 0.5


def test_the_launchers_supervise_loop_with_a_short_liveness_still_kills_a_frozen_worker(monkeypatch):
    """worker_liveness_s 0.6 (heartbeats 0.1 s, as the frozen-worker tests run) under ``slotserve
    up``'s supervise loop, which looks once a second (its ``poll_s``): a second between two looks is
    the loop's own wait, no stall, so the worker the broker stopped listing is killed once unlisted
    for LOST_GRACE x 0.6 s (failed before: the stall threshold, half of 1.8 s, was under the loop's
    wait, every look was a stall that gave the worker a fresh window, and it was never killed)."""
    from slotserve import launcher
    from slotserve.launcher import LOST_GRACE, ClusterConfig, LocalCluster

    clock = [T0]

    def waited(handles, timeout):  # (the supervise loop's wait: the time passes, nothing happens)
        clock[0] += timeout
        return []

    monkeypatch.setattr(launcher, "wait_for_sentinels", waited)
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1,
                                     worker_liveness_s=0.6), (WorkerConfig(name="w0"),))
    cluster = LocalCluster(cfg)
    proc, listed, looks = _Process(), {"w0"}, []
    proc.sentinel = -1
    cluster.frontend = "tcp://127.0.0.1:1"
    cluster._workers = [proc]

    def status(timeout_s):
        looks.append(clock[0])
        shown = set(listed)
        listed.clear()  # (listed at the first look only: then frozen, the broker dropped it)
        return types.SimpleNamespace(workers=[types.SimpleNamespace(name=n) for n in shown], loading_workers={})

    cluster._watch = types.SimpleNamespace(status=status)
    cluster.supervise(lambda: proc.killed or clock[0] > T0 + 30)
    assert proc.killed and clock[0] - looks[0] <= LOST_GRACE * 0.6 + 2.0


# ---------------------------------------------------------------------- a judge slow, not frozen


SLOW = 0.6
"""A turn of a slow judge every 0.6 of its window: each one later than the stall threshold (half)."""


def test_a_stall_gives_a_timer_one_fresh_window_until_its_peer_speaks_again():
    """A judge stalled again and again (slow, not frozen) excuses a peer's silence once: a timer that
    started before the previous stall ended (its peer said nothing since) is not excused again."""
    watch = StallWatch(1.0, T0)
    assert watch.stalled(T0 + 0.6) == pytest.approx(0.6) and watch.excuses(T0)  # the first stall: a fresh window
    assert watch.stalled(T0 + 1.2) == pytest.approx(0.6)
    assert not watch.excuses(T0 + 0.6)  # restarted at the previous stall, silent since
    assert watch.excuses(T0 + 0.7)  # spoke after it
    assert watch.stalled(T0 + 1.3) is None and watch.excuses(T0 + 0.7)  # (a turn within the threshold changes nothing)


def test_a_slow_broker_loop_still_declares_a_silent_worker_dead():
    """The socket loop on an injected clock, each turn SLOW x the worker's window after the last (a
    broker starved or busy, never frozen: it keeps reading its sockets), a client that heartbeats and
    a worker that registered and fell silent: the worker is lost within two windows of its last word
    (before: every turn was a stall that gave it a fresh window, and it was never lost)."""
    clock = FakeClock()
    with _broker_loop(clock) as (cfg, core, worker, client):
        lost_at = None
        for _ in range(6):
            clock.advance(SLOW * cfg.worker_liveness_s)
            assert type(_recv(client, BROKER_TO_CLIENT)) is Heartbeat  # (the turn at this time is done)
            client.send(encode(Heartbeat()))
            if lost_at is None and core.counters["workers_lost"]:
                lost_at = clock()
        assert lost_at is not None and lost_at - T0 <= 2 * cfg.worker_liveness_s, core.counters
        assert len(core.clients) == 1  # the client, which spoke, kept its place


def test_a_slow_worker_link_still_registers_again_when_its_broker_is_silent():
    """Each turn of the link SLOW x the broker's window after the last: it registers again within two
    windows of the broker's last word (before: never)."""
    clock = FakeClock()
    link, sent = _linked(clock)
    try:
        for _ in range(6):
            clock.advance(SLOW * link.broker_liveness_s)
            link._keep_alive()
            if not link.registered:
                break
        assert not link.registered and type(sent[-1]) is Register
        assert clock() - T0 <= 2 * link.broker_liveness_s
    finally:
        link.sock.close(0)


def test_a_slow_client_loop_still_judges_a_silent_broker():
    """Each turn of the client's I/O loop 0.6 s after the last (its stall threshold is 0.5 s: twice
    its heartbeat interval, more than half its window of 0.75 s): the broker's silence reaches the
    window within two windows (before: heard at every turn, never judged)."""
    clock = FakeClock()
    ticks: list = []
    conn = Connection("tcp://127.0.0.1:1", "m", lambda msg: None, heartbeat_interval_s=0.25,
                      on_tick=lambda now, heard_s, interval_s: ticks.append((now, heard_s)), clock=clock)
    window = DEADLINE_GRACE_HEARTBEATS * 0.25
    try:
        silent = []
        for _ in range(6):
            now = clock.advance(0.6)
            conn.send(Heartbeat())  # wakes the loop: a turn at ``now``
            _, heard = wait_until(lambda: next((t for t in reversed(ticks) if t[0] == now), None), 10,
                                  f"a turn at {now}")
            silent.append(now - heard >= window)
        assert any(silent) and silent.index(True) <= 2, silent
    finally:
        conn.close()


def test_a_slow_launcher_still_kills_a_worker_unlisted_for_its_window():
    """Each look SLOW x its window (LOST_GRACE x worker_liveness_s) after the last: the worker the
    broker stopped listing is killed within two windows (before: never)."""
    from slotserve.launcher import LOST_GRACE

    cluster, proc = _watched_worker()
    window = LOST_GRACE * 1.0
    now = T0
    for _ in range(6):
        now += SLOW * window
        if cluster._kill_lost_workers(now):
            break
    assert proc.killed and now - T0 <= 2 * window


class _StatusClient:
    """The launcher's readiness client: ``answers`` in turn, each a status or an exception to raise."""

    def __init__(self, answers: list) -> None:
        self.answers, self.asked = answers, 0

    def __call__(self, *args, **kwargs) -> "_StatusClient":
        return self

    def __enter__(self) -> "_StatusClient":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def status(self, timeout_s: float = 5.0):
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def _starting_cluster(monkeypatch, answers: list, broker_alive: bool = True) -> tuple:
    """A launcher (started nothing) waiting for one worker of model 'm', its broker's status queries
    answered by ``answers``: (cluster, the readiness client)."""
    from slotserve import launcher
    from slotserve.launcher import ClusterConfig, LocalCluster

    cluster = LocalCluster(ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                                         (WorkerConfig(name="w0", served_model_names=("m",)),)))
    worker = _Process()  # it runs
    worker.sentinel = None
    cluster.frontend, cluster._workers = "tcp://127.0.0.1:1", [worker]
    cluster._broker = types.SimpleNamespace(is_alive=lambda: broker_alive, exitcode=None if broker_alive else 1)
    monkeypatch.setattr(launcher, "wait_for_sentinels", lambda handles, timeout: [])  # (no exit to wait on)
    client = _StatusClient(answers)
    monkeypatch.setattr(launcher, "Client", client)
    return cluster, client


def test_the_launcher_asks_again_when_its_broker_left_a_status_query_unanswered(monkeypatch):
    """A broker starved or frozen past a status query's 5 s while the workers load (a busy machine, a
    SIGSTOP) is asked again: the start goes on (was: BrokerUnavailable's traceback out of `slotserve up`,
    exit status 1, found with the broker alone SIGSTOPped for 8 s during a load)."""
    from client import BrokerUnavailable

    ready = types.SimpleNamespace(models={"m": types.SimpleNamespace(workers=1)})
    cluster, client = _starting_cluster(monkeypatch, [BrokerUnavailable("no answer within 5.0 s"), ready])
    cluster.wait_ready(60.0)
    assert client.asked == 2


def test_the_launcher_waiting_on_a_silent_broker_says_so_at_its_deadline(monkeypatch):
    from client import BrokerUnavailable

    cluster, _ = _starting_cluster(monkeypatch, [BrokerUnavailable("no answer within 5.0 s")])
    with pytest.raises(RuntimeError, match=r"did not register within 0.0 s \(the broker did not answer"):
        cluster.wait_ready(0.0)


def test_the_launcher_whose_broker_exited_while_the_workers_started_says_so(monkeypatch):
    from client import BrokerUnavailable

    cluster, client = _starting_cluster(monkeypatch, [BrokerUnavailable("no answer within 5.0 s")],
                                        broker_alive=False)
    with pytest.raises(RuntimeError, match="the broker exited with code 1 while the workers started"):
        cluster.wait_ready(60.0)
    assert client.asked == 1
