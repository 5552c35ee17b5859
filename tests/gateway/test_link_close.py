"""The gateway's broker link closing while a status query is in flight (CI at c4fb195..a671cf3,
test_drain: "Task exception was never retrieved ... RuntimeError: this client is closed" logged at
ERROR when `slotserve up` stopped between two status polls)."""

import asyncio
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
    import gc

    gc.collect()  # (an unretrieved task exception is reported when the task is collected)
    assert unretrieved == []
