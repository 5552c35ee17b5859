"""A status query or a model order is answered by the status that answers it, never by a late answer to an
earlier one (protocol 16: ``query`` in ``status_query``, ``model_order`` and ``status``).

A break-it pass: the broker stalled (SIGSTOP, or a busy host) past a client's ``status(timeout_s=0.5)``,
which raised BrokerUnavailable; the broker's answer came after, and the next call took it for its own.
``order("load", "tiny-c")`` then raised ValueError "the broker did not take the order to load model
'tiny-c': it is not a model on demand there" (the gateway's ``POST /models/load``: a 400 saying so)
while the broker had taken it and the model was loading. Here the broker is a ROUTER socket in the
test, which answers when and what the test says."""

from __future__ import annotations

import threading

import pytest
import zmq

from client import Client
from client.errors import BrokerUnavailable
from protocol.codec import decode, encode
from protocol.enums import ModelAction, ModelState
from protocol.messages import CLIENT_TO_BROKER, DemandState, Hello, ModelOrder, PendingOrder, Status, StatusQuery, \
    Welcome


class _Broker:
    """A broker's frontend the test drives: :meth:`next` receives a client message (heartbeats skipped),
    :meth:`send` answers."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer = b""

    def next(self, kind: type):
        while True:
            assert self.sock.poll(10_000), f"no {kind.__name__} from the client"
            self.peer, frame = self.sock.recv_multipart()
            msg = decode(frame, CLIENT_TO_BROKER)
            if isinstance(msg, kind):
                return msg

    def send(self, msg) -> None:
        self.sock.send_multipart([self.peer, encode(msg)])

    def status(self, query: int, orders=()) -> Status:
        state = DemandState(ModelState.LOADING if orders else ModelState.UNLOADED)
        return Status("b1", 1.0, {}, (), 1, {}, on_demand={"m": state}, orders=tuple(orders), query=query)


@pytest.fixture
def broker():
    b = _Broker()
    yield b
    b.sock.close()


def _connected(broker: _Broker) -> Client:
    """A client of model ``m`` (on demand) welcomed by ``broker`` (its constructor waits for the welcome)."""
    made = {}
    t = threading.Thread(target=lambda: made.setdefault("c", Client(broker.address, model="m", connect_timeout_s=10)))
    t.start()
    broker.next(Hello)
    broker.send(Welcome("b1", 5.0, on_demand=("m",)))
    t.join(15)
    return made["c"]


def test_a_late_answer_to_a_query_that_timed_out_is_not_the_answer_to_the_next(broker):
    with _connected(broker) as c:
        with pytest.raises(BrokerUnavailable):
            c.status(timeout_s=0.2)
        first = broker.next(StatusQuery)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("st", c.order("load", "m", timeout_s=10)))
        t.start()
        order = broker.next(ModelOrder)
        assert order.query != first.query
        broker.send(broker.status(first.query))  # the late answer to the first query: no order in it
        broker.send(broker.status(order.query, [PendingOrder(1, ModelAction.LOAD, "m")]))
        t.join(15)
        assert got["st"].orders == (PendingOrder(1, ModelAction.LOAD, "m"),)  # (was ValueError: not taken)
        assert got["st"].on_demand["m"].state is ModelState.LOADING
        # and a status query likewise: the answer to an order that timed out is not its answer
        with pytest.raises(BrokerUnavailable):
            c.order("unload", "m", timeout_s=0.2)
        late = broker.next(ModelOrder)
        t = threading.Thread(target=lambda: got.__setitem__("st", c.status(timeout_s=10)))
        t.start()
        query = broker.next(StatusQuery)
        broker.send(broker.status(late.query, [PendingOrder(2, ModelAction.UNLOAD, "m")]))
        broker.send(broker.status(query.query))
        t.join(15)
        assert got["st"].query == query.query and got["st"].orders == ()
