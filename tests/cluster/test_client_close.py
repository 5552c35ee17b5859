"""Kind "a call waiting on the broker ends when the client closes" (the CI
failure of stop 36: the gateway's status poll, on an executor thread, waited
out its 5 s timeout after the gateway closed its client, and asyncio's
shutdown waited for that thread). Members: :meth:`Client.status` and
:meth:`Client.wait_for_model`, each closed from another thread while it
waits on a broker that never answers, and each called on a closed client.
"""

from __future__ import annotations

import threading

import pytest

from client import Client
from protocol.messages import ModelInfo, StatusQuery, Welcome
from tests.support.cluster import fake_broker

# "other" is being loaded: wait_for_model("other") waits for a welcome that never comes.
WELCOME = Welcome("fake-broker", 0.5, {"simulated": ModelInfo(1000, None, (0,), False)}, loading=("other",))
LONG_S = 60.0  # the calls' own timeouts: far longer than the test waits for them


class Waiting:
    """``call()`` on a thread; what it raised."""

    def __init__(self, call) -> None:
        self.raised: BaseException | None = None
        self.returned = threading.Event()

        def run():
            try:
                call()
            except BaseException as e:  # noqa: BLE001 -- the test looks at it
                self.raised = e
            self.returned.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def status_waiting(fb, c: Client) -> Waiting:
    w = Waiting(lambda: c.status(timeout_s=LONG_S))
    fb.take(StatusQuery)  # the query left; the fake broker never answers it
    return w


def model_waiting(fb, c: Client) -> Waiting:
    return Waiting(lambda: c.wait_for_model(LONG_S))


@pytest.mark.parametrize("start", [status_waiting, model_waiting], ids=["status", "wait_for_model"])
def test_closing_the_client_ends_a_call_waiting_on_the_broker(start):
    with fake_broker(WELCOME) as fb:
        c = Client(fb.address, model="other")
        w = start(fb, c)
        assert not w.returned.wait(0.3), f"the call returned before the close: {w.raised!r}"
        c.close()
        assert w.returned.wait(10), "the call still waits after close()"
        assert isinstance(w.raised, RuntimeError) and "closed" in str(w.raised), repr(w.raised)


@pytest.mark.parametrize("call", [lambda c: c.status(timeout_s=LONG_S), lambda c: c.wait_for_model(LONG_S)],
                         ids=["status", "wait_for_model"])
def test_a_closed_client_refuses_at_once(call):
    with fake_broker(WELCOME) as fb:
        c = Client(fb.address, model="other")
        c.close()
        w = Waiting(lambda: call(c))
        assert w.returned.wait(10), "the call waited on a closed client"
        assert isinstance(w.raised, RuntimeError) and "closed" in str(w.raised), repr(w.raised)
