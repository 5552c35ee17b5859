"""A bare ROUTER/ROUTER pass-through broker: the floor that ``python -m bench.broker --compare-bare`` measures
slotserve's broker against.

It speaks just enough of the wire protocol (``protocol.messages``) for the same client and workers
to run through it, and nothing more: requests go to the workers' credits round-robin in arrival
order, their parameters passed through as msgpack arrays (never decoded into ``RequestParams`` nor
validated), and the workers' tokens, prompt lengths and endings back to their clients with each
broker key swapped for the client's request id. No queue bounds, priorities, deadlines, prefix trees,
checks of what a worker sends, liveness, migration, slow-consumer buffers or frame limits: every
cost slotserve's broker adds over moving the same messages between two ROUTER sockets in Python.
Control messages (``welcome``, ``status``, ``heartbeat``) are built with :mod:`protocol.codec`
(rare; ``status`` says only what ``LocalCluster.wait_ready`` and the bench read).

Not for serving: a bench fixture (a peer's malformed frame or a cancel is ignored; a worker that
dies loses its requests).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque

import msgpack
import zmq

from broker.server import tune_gc
from protocol.codec import encode
from protocol.defaults import HEARTBEAT_INTERVAL_S
from protocol.messages import PROTOCOL_VERSION, Heartbeat, ModelInfo, ModelStatus, Status, Welcome
from slotserve.launcher import LocalCluster, _child_setup, _ctx

_V = PROTOCOL_VERSION


class PassThroughBroker:
    """Two bound ROUTER sockets and the least state that routes requests and results.

    ``frontend`` / ``backend``: endpoints to bind (``tcp://127.0.0.1:*`` picks a port; the bound
    ones are in :attr:`frontend` / :attr:`backend` after construction)."""

    def __init__(self, frontend: str, backend: str, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.broker_id = uuid.uuid4().hex
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ctx = zmq.Context()
        self.front = self._socket(frontend)
        self.back = self._socket(backend)
        self.frontend = self.front.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.backend = self.back.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.clients: set[bytes] = set()
        self.workers: dict[bytes, list] = {}  # identity -> [model, info, credits, iterations, num_slots]
        self.ready: deque[bytes] = deque()  # workers with a credit, round-robin
        self.queue: deque[tuple[int, object]] = deque()  # (broker key, params as msgpack array)
        self.route: dict[int, tuple[bytes, object]] = {}  # broker key -> (client, request id)
        self.keys = itertools.count(1)
        self.completed = 0

    def _socket(self, endpoint: str) -> zmq.Socket:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, 10_000)  # BrokerConfig's send_hwm
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.bind(endpoint)
        return s

    def close(self) -> None:
        self.front.close(0)
        self.back.close(0)
        self._ctx.term()

    def serve(self, stop) -> None:
        """Run until ``stop.is_set()`` (checked at least every 20 ms)."""
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        next_beat = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.heartbeat_interval_s
                hb = encode(Heartbeat(broker_id=self.broker_id))
                for w in list(self.workers):
                    self._control(self.back, w, hb)
                for c in list(self.clients):
                    self._control(self.front, c, hb)
            events = dict(poller.poll(20))
            if self.back in events:
                self._drain(self.back, self._on_worker)
            if self.front in events:
                self._drain(self.front, self._on_client)

    def _control(self, sock: zmq.Socket, identity: bytes, data: bytes) -> None:
        """Send a control frame; a peer gone (``EHOSTUNREACH``) is forgotten (a worker's requests with it)."""
        try:
            sock.send_multipart((identity, data))
        except zmq.ZMQError:
            self.clients.discard(identity)
            if self.workers.pop(identity, None) is not None and identity in self.ready:
                self.ready.remove(identity)

    @staticmethod
    def _drain(sock: zmq.Socket, handle) -> None:
        for _ in range(512):
            try:
                identity, data = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(identity, msgpack.unpackb(data, raw=False, use_list=False))

    # ---------------------------------------------------------------- clients

    def _on_client(self, identity: bytes, d: dict) -> None:
        op = d["op"]
        self.clients.add(identity)
        if op == "submit":
            keys, route, queue = self.keys, self.route, self.queue
            for env in d["requests"]:
                key = next(keys)
                route[key] = (identity, env[0])
                queue.append((key, env[1]))
            self._dispatch()
        elif op == "hello":
            self._control(self.front, identity, encode(self._welcome()))
        elif op == "status_query":
            self._control(self.front, identity, encode(self._status(d.get("query", 0))))

    def _dispatch(self) -> None:
        queue, ready, workers = self.queue, self.ready, self.workers
        assigns: dict[bytes, list] = {}
        while queue and ready:
            w = ready[0]
            state = workers[w]
            state[2] -= 1
            if state[2] == 0:
                ready.popleft()
            else:
                ready.rotate(-1)
            assigns.setdefault(w, []).append(queue.popleft())
        for w, entries in assigns.items():
            self.back.send_multipart((w, msgpack.packb({"v": _V, "op": "assign", "requests": entries})))

    # ---------------------------------------------------------------- workers

    def _on_worker(self, identity: bytes, d: dict) -> None:
        op = d["op"]
        if op == "iteration":
            self._iteration(identity, d)
        elif op == "register":
            info = ModelInfo(*d.get("info", ()))
            self.workers[identity] = [d["model"], info, d["max_inflight"], 0, d["num_slots"]]
            self.ready.append(identity)
            self._control(self.back, identity, encode(self._welcome()))
            self._dispatch()
        elif op == "loading":
            self._control(self.back, identity, encode(self._welcome()))

    def _iteration(self, identity: bytes, d: dict) -> None:
        route = self.route
        out: dict[bytes, dict] = {}
        for key, tok in zip(d.get("ids", ()), d.get("tokens", ())):
            client, rid = route[key]
            r = out.get(client)
            if r is None:
                r = out[client] = {"v": _V, "op": "results", "ids": [], "tokens": [], "started": [],
                                   "finished": []}
            r["ids"].append(rid)
            r["tokens"].append(tok)
        for rec in d.get("started", ()):
            client, rid = route[rec[0]]
            r = out.get(client)
            if r is None:
                r = out[client] = {"v": _V, "op": "results", "ids": [], "tokens": [], "started": [],
                                   "finished": []}
            r["started"].append((rid,) + rec[1:])
        finished = d.get("finished", ())
        for rec in finished:
            client, rid = route.pop(rec[0])
            r = out.get(client)
            if r is None:
                r = out[client] = {"v": _V, "op": "results", "ids": [], "tokens": [], "started": [],
                                   "finished": []}
            r["finished"].append((rid,) + rec[1:])
        state = self.workers[identity]
        state[3] += 1
        for client, r in out.items():
            self.front.send_multipart((client, msgpack.packb(r)))
        if finished:
            self.completed += len(finished)
            if state[2] == 0:
                self.ready.append(identity)
            state[2] += len(finished)
            self._dispatch()

    # ---------------------------------------------------------------- control

    def _welcome(self) -> Welcome:
        return Welcome(self.broker_id, self.heartbeat_interval_s, {s[0]: s[1] for s in self.workers.values()})

    def _status(self, query: int = 0) -> Status:
        models: dict[str, ModelStatus] = {}
        for model, _, _, _, slots in self.workers.values():
            m = models.get(model, ModelStatus(len(self.queue), 0, 0, 0, 0))
            models[model] = m._replace(workers=m.workers + 1, slots_total=m.slots_total + slots)
        return Status(self.broker_id, 0.0, models, (), len(self.clients), {"completed": self.completed},
                      query=query)


def passthrough_main(frontend: str, backend: str, ready) -> None:
    """Child process body: run a :class:`PassThroughBroker`; put ``(frontend, backend)`` on ``ready``."""
    stop = _child_setup(f"slotserve pass-through broker {frontend} {backend}", "WARNING", 5.0)
    tune_gc()  # as slotserve's broker process does (the floor is measured under the same settings)
    b = PassThroughBroker(frontend, backend)
    try:
        ready.put((b.frontend, b.backend))
        b.serve(stop)
    finally:
        b.close()


class PassThroughCluster(LocalCluster):
    """A :class:`~slotserve.launcher.LocalCluster` whose broker is a :class:`PassThroughBroker`
    (its ``BrokerConfig`` gives the endpoints only); the workers are the config's."""

    def _start_broker(self) -> None:
        ready = _ctx.Queue()
        p = _ctx.Process(target=passthrough_main, args=(self._broker_cfg.frontend, self._broker_cfg.backend, ready),
                         name="slotserve-passthrough-broker", daemon=True)
        p.start()
        self._broker = p
        self.frontend, self.backend = self._await_ready(p, ready, "the pass-through broker")
