"""The client's callback thread starts only once its connection exists: a welcome the connection's
I/O thread hears before ``Connection()`` returns waits in the inbox. (Under load in CI the welcome's
handler ran first and read a ``_conn`` not yet assigned: the client's model never resolved, and
every submit was refused as malformed.)"""

from __future__ import annotations

import threading

import client.client as client_module
from client import Client
from protocol.messages import FinishReason, Hello, Welcome
from tests.support.cluster import ThreadCluster


def test_a_welcome_heard_before_the_connection_returns_resolves_the_model(monkeypatch):
    class WelcomedFirst(client_module.Connection):
        """A connection whose constructor returns only after the broker's welcome reached the
        client's inbox: the worst order the threads can take, every time."""

        def __init__(self, address, model, on_message, **kw):
            heard = threading.Event()

            def deliver(msg):
                on_message(msg)
                if isinstance(msg, Welcome):
                    heard.set()

            super().__init__(address, model, deliver, **kw)
            self.send(Hello("early"))
            assert heard.wait(10)

    with ThreadCluster() as cluster:
        cluster.add_worker()
        with Client(cluster.frontend, model="simulated") as probe:
            probe.wait_for_model(10)  # (the worker registered: the welcome will name its model)
        monkeypatch.setattr(client_module, "Connection", WelcomedFirst)
        with Client(cluster.frontend) as c:  # no model given: the broker's only one, from its welcome
            assert c.model == "simulated"
            h = c.submit_request([1, 2], 3, stop_token=None)
            assert h.result(timeout=30) and h.finish_reason is FinishReason.LENGTH
