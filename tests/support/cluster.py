"""The cluster harness the tests share: free ports, a broker and workers on
threads of the test process (so a test can inject a failure with
monkeypatch, or hang a model), and a fake broker (a raw ROUTER socket the
test drives) for the client's side. Clusters of child processes are
:class:`slotserve.launcher.LocalCluster` itself, on :data:`ANY_PORT`;
:mod:`tests.support.gateway` adds the HTTP gateway on top of it (the fault injection
on top of it is ``bench/chaos.py``'s, shared with ``tests/cluster/test_chaos.py``)."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager

import zmq

from broker import BrokerConfig
from broker.server import BrokerServer
from protocol.codec import decode, encode
from protocol.messages import CLIENT_TO_BROKER, Message, Welcome
from tests.support.waits import Deadline
from worker import SimulatedLLM
from worker.config import WorkerConfig
from worker.process import WorkerProcess

ANY_PORT = "tcp://127.0.0.1:*"  # any free port, on loopback


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a command that takes a port, not ``*``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def registered(client, name: str) -> bool:
    """True when the broker ``client`` talks to lists a worker named ``name``."""
    return any(w.name == name for w in client.status().workers)


def on_worker(client, name: str) -> int:
    """How many requests the broker ``client`` talks to has assigned to the worker ``name`` (0 when
    it lists no such worker)."""
    return sum(w.inflight for w in client.status().workers if w.name == name)


class ThreadWorker:
    """A real worker (engine, I/O thread, sockets) on a thread of this process,
    started at once: ``llm`` (a model object, default a SimulatedLLM) served
    under ``config``'s model name, or with ``load`` the worker loads
    ``config.model`` itself in ``run``. ``config``: WorkerConfig fields
    (``num_slots`` 4 unless given).

    With ``keep_error`` an exception that ends the worker is kept in
    :attr:`error` for the test to look at; without, it escapes the thread
    (and pytest fails the test). Closing (or leaving the ``with`` block) sets
    the model's ``release`` event first, where it has one, so a model hung on
    purpose lets its step end."""

    def __init__(self, backend: str, llm=None, *, process_cls=WorkerProcess, load: bool = False,
                 keep_error: bool = False, **config) -> None:
        config.setdefault("num_slots", 4)
        self.config = WorkerConfig(broker=backend, **config)
        self.name = self.config.name
        self.model = None if load else SimulatedLLM() if llm is None else llm
        self.stop = threading.Event()
        self.wp = process_cls(self.config, self.model)
        self.keep_error = keep_error
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-worker-{self.config.model}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.wp.run(self.stop)
        except BaseException as e:
            if not self.keep_error:
                raise
            self.error = e  # the test looks at it

    def close(self) -> None:
        release = getattr(self.model, "release", None)
        if isinstance(release, threading.Event):
            release.set()
        self.stop.set()
        self.thread.join(15)
        assert not self.thread.is_alive(), "worker thread did not stop"

    def __enter__(self) -> "ThreadWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ThreadCluster:
    """A broker on a thread (``broker_options``: BrokerConfig fields) plus
    workers added with :meth:`add_worker`. Use as a context manager."""

    def __init__(self, **broker_options) -> None:
        self.config = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, **broker_options)
        self.server = BrokerServer(self.config)
        self.frontend, self.backend = self.server.frontend, self.server.backend
        self.core = self.server.core
        self.stop = threading.Event()
        self.workers: list[ThreadWorker] = []
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,), name="test-broker", daemon=True)
        self.thread.start()

    def add_worker(self, llm=None, **config) -> ThreadWorker:
        w = ThreadWorker(self.backend, llm, keep_error=True, **config)
        self.workers.append(w)
        return w

    def __enter__(self) -> "ThreadCluster":
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.close()
        self.stop.set()
        self.thread.join(15)
        self.server.close()


class FakeBroker:
    """A ROUTER socket the test drives as if it were the broker's frontend."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.client: bytes | None = None
        self._welcome: Welcome | None = None
        self._serving = threading.Event()
        self._thread: threading.Thread | None = None

    def serve_welcome(self, welcome: Welcome) -> None:
        """Answer hellos with ``welcome`` on a thread until :meth:`take` is used."""
        self._welcome = welcome
        self._serving.set()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while self._serving.is_set():
            if poller.poll(20):
                identity, data = self.sock.recv_multipart()
                self.client = identity
                if decode(data, CLIENT_TO_BROKER).op.value == "hello":
                    self.sock.send_multipart((identity, encode(self._welcome)))
                    self._serving.clear()  # one welcome: the test takes over

    def take(self, kind: type, timeout_s: float = 10.0) -> Message:
        """The next message of type ``kind`` from the client (others skipped)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = Deadline(timeout_s)
        while True:
            left = deadline.left_s()
            assert left > 0, f"no {kind.__name__} from the client"
            if self.sock.poll(int(left * 1000)):
                identity, data = self.sock.recv_multipart()
                self.client = identity
                msg = decode(data, CLIENT_TO_BROKER)
                if isinstance(msg, kind):
                    return msg

    def send(self, data: bytes | Message) -> None:
        self.sock.send_multipart((self.client, data if isinstance(data, bytes) else encode(data)))

    def close(self) -> None:
        self._serving.clear()
        if self._thread is not None:
            self._thread.join(5)
        self.sock.close(0)


@contextmanager
def fake_broker(welcome: Welcome):
    fb = FakeBroker()
    fb.serve_welcome(welcome)
    try:
        yield fb
    finally:
        fb.close()


def iterations(wp: WorkerProcess) -> list:
    """Step a socket-less :class:`WorkerProcess`'s engine until it has no work; the ``Iteration``
    message it would send after each step (``_collect``), in order."""
    its = []
    while wp.engine.wait_for_work(0):
        wp.engine.step()
        out = wp._collect()
        if out is not None:
            its.append(out[1])
    return its
