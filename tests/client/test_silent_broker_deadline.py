"""A request with a ``timeout_s`` ends ``deadline`` at its deadline when its broker is silent (gone,
frozen, cut off), with the tokens received, through the SDK's client (sync and async: the shell
the gateway and ``slotserve run --broker`` use too), and is cancelled at the broker. A break-it
pass: with the broker SIGKILLed and not restarted, an HTTP request with ``timeout_s: 8`` waited
until its HTTP client gave up (60 s), while new requests got 503 at once. A request without a
deadline still waits for a broker that comes back (it resubmits then)."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, Client
from protocol.enums import FinishReason
from protocol.messages import Cancel, Finished, ModelInfo, Results, Submit, Welcome
from tests.support.cluster import fake_broker
from tests.support.waits import wait_until

WELCOME = Welcome("silent-broker", 0.05, {"simulated": ModelInfo(1000, None, (0,), False)})
"""The fake broker welcomes the client (heartbeats every 0.05 s) and says nothing after it."""


def test_requests_past_their_deadline_end_when_the_broker_is_silent():
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        streamed = []
        plain = c.submit_request([1], 5, request_id="plain", timeout_s=0.3)
        hooked = c.submit_request([2], 5, request_id="hooked", timeout_s=0.3, on_token=streamed.append)
        waits = c.submit_request([3], 5, request_id="waits")
        submitted: set = set()
        while submitted != {"plain", "hooked", "waits"}:
            submitted |= {e.request_id for e in fb.take(Submit).requests}
        fb.send(Results(ids=["plain", "hooked"], tokens=[7, 8]))
        wait_until(lambda: plain.done() and hooked.done(), 10, "the overdue requests to end")
        assert plain.finish_reason is FinishReason.DEADLINE and plain.tokens == [7] and plain.error is None
        assert hooked.finish_reason is FinishReason.DEADLINE and hooked.tokens == [8] and streamed == [8]
        assert plain.latency_s >= 0.3 and hooked.latency_s >= 0.3  # never before the deadline
        cancelled: set = set()
        while cancelled != {"plain", "hooked"}:
            cancelled |= set(fb.take(Cancel).request_ids)
        assert not waits.done() and c.num_in_flight == 1


def test_the_async_client_gets_its_deadline_from_a_silent_broker():
    async def main():
        with fake_broker(WELCOME) as fb:
            async with await AsyncClient.connect(fb.address) as c:
                h = await asyncio.wait_for(c.generate([1], 5, timeout_s=0.2), 10)
                return h.finish_reason, h.tokens
    assert asyncio.run(main()) == (FinishReason.DEADLINE, [])


def test_an_id_ended_at_its_deadline_is_not_sent_again_before_the_broker_ends_it():
    # The broker (SIGSTOPped, in the reproduction) still held "x" when the client ended it: the same id
    # sent again was that request to the broker, and the new handle got the old one's tokens and ending.
    with fake_broker(WELCOME) as fb, Client(fb.address) as c:
        old = c.submit_request([1], 50, request_id="x", timeout_s=0.2)
        assert [e.request_id for e in fb.take(Submit).requests] == ["x"]
        wait_until(old.done, 10, "the overdue request to end")
        assert fb.take(Cancel).request_ids == ("x",)
        with pytest.raises(ValueError, match="has not yet said it ended there"):
            c.submit_request([7], 5, request_id="x")
        fb.send(Results(ids=["x"], tokens=[4], finished=[Finished("x", FinishReason.CANCELLED)]))
        new = wait_until(lambda: _submitted(c, [7], "x"), 10, "the id to be free again")
        assert fb.take(Submit).requests[0].params.prompt == (7,)
        fb.send(Results(ids=["x"], tokens=[8], finished=[Finished("x", FinishReason.LENGTH)]))
        new.result(10)
        assert new.tokens == [8] and old.tokens == [] and old.finish_reason is FinishReason.DEADLINE


def _submitted(client: Client, prompt: list, rid):
    """The handle of ``prompt`` submitted as ``rid``, or None while the client refuses the id."""
    try:
        return client.submit_request(prompt, 5, request_id=rid)
    except ValueError:
        return None
