"""The gateway's control connection also serves the model named ``simulated`` (gateway.link.CONTROL_MODEL):
a request for it waited for that model's worker with ``wait_for_model``, which raises
UnknownModelError at once when no worker serves or loads it. With ``simulated`` among the models on
demand (``slotserve up --model simulated --model smollm2-135m``) every request for it before its load
was a 500 (uvicorn cut the connection: "Exception in ASGI application") instead of waiting in its
queue while it loads; and a model whose worker left between the status and the wait got the same.
The gateway's own link over a status the test gives (no broker, no socket)."""

from __future__ import annotations

import asyncio

import pytest

from client import UnknownModelError
from gateway.errors import APIError
from tests.support.gateway import GivenStatusLink
from tests.support.gateway import model_status as model


class _Control:
    """The control connection as ``client_for`` uses it: ``models`` (none registered yet) and
    ``wait_for_model``, which raises as a Client's does when no worker serves or loads the model."""

    def __init__(self) -> None:
        self.models: dict = {}
        self.waits = 0

    def wait_for_model(self, timeout_s: float):
        self.waits += 1
        raise UnknownModelError("simulated", "tcp://broker", (), ())


def test_a_request_for_simulated_on_demand_and_not_loaded_goes_to_its_queue_without_waiting():
    link = GivenStatusLink(on_demand=("simulated", "smollm2-135m"))
    link._control = control = _Control()
    link.show({"simulated": model(), "smollm2-135m": model()})
    assert asyncio.run(link.client_for("simulated")) is control  # (its request waits in the queue)
    assert control.waits == 0


def test_a_served_simulated_whose_worker_left_before_the_wait_is_a_503_not_a_500():
    link = GivenStatusLink()
    link._control = control = _Control()
    link.show({"simulated": model(workers=1)})  # the last status: served; by the wait, gone
    with pytest.raises(APIError) as e:
        asyncio.run(link.client_for("simulated"))
    assert e.value.status == 503 and "no worker serves model `simulated`" in e.value.message
    assert control.waits == 1
