"""A caller's wait on the Python SDK's client, cut short by a signal's exception (Ctrl-C's
KeyboardInterrupt in a script or a notebook cell, a test runner's timeout) while another thread holds the
lock it waits to take back, leaves that thread its lock (tests/support/interrupted_wait.py says how and
why). Before, ``run()``'s and a handle's ``result()``'s condition variable was on the client's plain
lock, and ``status()`` waited on a ``threading.Event``: the interrupted waiter released the lock of the
thread that had woken it -- the client's callback or I/O thread, which takes it for every message --
whose next wait or notify then raised "cannot wait/notify on un-acquired lock" and whose ``with`` exit
"release unlocked lock". Now they are on an RLock, which a waiter takes back whole."""

from __future__ import annotations

import signal

import pytest

from client import Client
from protocol.enums import FinishReason
from protocol.messages import Finished, ModelInfo, Results, Submit, Welcome
from tests.support.cluster import fake_broker
from tests.support.interrupted_wait import interrupt_a_wait

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="signals to one thread: POSIX")

WELCOME = Welcome("quiet-broker", 1.0, {"simulated": ModelInfo(1000, None, (0,), False)})


def test_interrupted_waits_of_the_client_leave_the_lock_of_the_thread_that_woke_them():
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        h = c.submit_request([1], 2, request_id="r")
        assert [e.request_id for e in fb.take(Submit).requests] == ["r"]
        interrupt_a_wait(c._idle, c.run)
        interrupt_a_wait(c._idle, h.result)
        interrupt_a_wait(c._status_event._cond, lambda: c.status(30))
        fb.send(Results(("r",), (7,), finished=(Finished("r", FinishReason.STOP),)))  # (the client still works)
        c.run(10)
        assert h.result(10) == [1, 7] and h.finish_reason is FinishReason.STOP
