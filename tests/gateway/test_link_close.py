"""The gateway's broker link closing while a status query is in flight (CI at c4fb195..a671cf3,
test_drain: "Task exception was never retrieved ... RuntimeError: this client is closed" logged at
ERROR when `slotserve up` stopped between two status polls)."""

import asyncio
import gc
import threading

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.link import BrokerConnections


class BlockedControl:
    """A control client whose status query blocks until it is closed, then fails as Client's does."""

    def __init__(self):
        self.closed = threading.Event()
        self.asked = threading.Event()

    def status(self, timeout_s=None):
        self.asked.set()
        self.closed.wait(10)
        raise RuntimeError("this client is closed")

    def close(self):
        self.closed.set()


def test_a_status_query_the_close_interrupts_is_a_503_and_no_unretrieved_task_error():
    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        link = BrokerConnections(GatewayConfig(broker="tcp://127.0.0.1:1", connect_timeout_s=5.0))
        control = link._control = BlockedControl()
        caller = asyncio.ensure_future(link.refresh())  # an HTTP handler asking for the status
        await asyncio.get_running_loop().run_in_executor(None, control.asked.wait, 10)
        await link.close()
        with pytest.raises(APIError) as err:
            await caller
        return err.value

    err = asyncio.run(main())
    assert err.status == 503 and "stopping" in str(err.message)
    gc.collect()  # (an unretrieved task exception is reported when the task is collected)
    assert unretrieved == []


def test_a_connect_whose_waiter_is_gone_ends_without_an_unretrieved_error():
    """The same kind for the per-model connect: its caller cancelled (a client went away, the gateway
    stopping), the connect then failing."""
    from types import SimpleNamespace

    from client import BrokerUnavailable

    unretrieved, release = [], threading.Event()

    def connect(model, name):
        release.wait(10)
        raise BrokerUnavailable("no broker")

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        link = BrokerConnections(GatewayConfig(broker="tcp://127.0.0.1:1", connect_timeout_s=5.0))
        link._new_client = connect
        link.broker_ok = True
        link.status = SimpleNamespace(models={"m": SimpleNamespace(workers=1)}, aliases={})  # (a status' fields read)
        caller = asyncio.ensure_future(link.client_for("m"))
        await asyncio.sleep(0)  # (lets the caller start the connect)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        fut = link._connecting["m"]
        release.set()
        await asyncio.wait({fut})  # (does not read its exception)
        assert isinstance(fut._exception, BrokerUnavailable)  # the connect ended with its error ...
        del fut
        link._connecting.clear()  # as when the stopped gateway's link is dropped: the future is collected
        gc.collect()

    asyncio.run(main())
    gc.collect()
    assert unretrieved == []  # ... and nothing was reported as never retrieved
