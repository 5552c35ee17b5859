"""The client's decisions without sockets: what is resubmitted after a broker
restart (and how), and the handle surface it shares with the engine."""

from __future__ import annotations

import pytest

from client.core import resubmission
from client.handle import ClientHandle
from protocol.enums import FinishReason
from protocol.handle import RequestHandle
from protocol.messages import Envelope
from protocol.request import RequestParams
from worker import BatchInferenceEngine, SimulatedLLM


def handle(rid, params, received=(), submitted_s=0.0):
    h = ClientHandle(rid, params, None, None, submitted_s, owner=None)
    h._tokens.extend(received)
    return h


def test_unfinished_requests_are_resubmitted_with_their_tokens_and_the_time_left():
    mid = RequestParams([1, 2], 10, stop_token=None, timeout_s=5.0, priority=3)
    fresh = RequestParams("a text prompt", 4)
    endings, entries = resubmission([handle("mid", mid, [7, 8, 9], submitted_s=1.0), handle(2, fresh)], now=3.5)
    assert endings == []
    assert entries == [Envelope("mid", mid, (7, 8, 9), pytest.approx(2.5)), Envelope(2, fresh, (), None)]
    assert entries[0].params is mid and entries[1].params is fresh  # the same objects, unchanged


def test_complete_and_expired_requests_end_instead():
    done = handle("done", RequestParams([1], 3), [4, 5, 6])
    late = handle("late", RequestParams([1], 30, timeout_s=1.0), [4], submitted_s=0.0)
    endings, entries = resubmission([done, late], now=1.5)
    assert endings == [(done, FinishReason.LENGTH), (late, FinishReason.DEADLINE)] and entries == []


def test_nothing_pending_nothing_to_do():
    assert resubmission([], now=0.0) == ([], [])


SURFACE = {"request_id", "params", "prompt", "tokens", "text", "finish_reason", "stop_reason", "error", "usage",
           "ttft_s", "latency_s", "submitted_s", "first_token_s", "finished_s", "done", "result", "cached_tokens"}


def test_engine_and_client_handles_share_one_surface():
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), 2, stop_token=None)
    eh = engine.submit_request([1, 2], 3)
    ch = handle(0, RequestParams([1, 2], 3))
    for h in (eh, ch):
        assert isinstance(h, RequestHandle)
        assert SURFACE <= {n for n in dir(h) if not n.startswith("_")}
    engine.run()
    assert eh.usage == (2, 3) and eh.ttft_s is not None and 0 <= eh.ttft_s <= eh.latency_s
    assert eh.cached_tokens == 0 and ch.cached_tokens is None  # (a model without a prefix cache; not prefilled)
    assert eh.text is None and eh.prompt == [1, 2] and eh.result() == [1, 2] + eh.tokens
    assert ch.usage == (2, 0) and ch.text is None and ch.ttft_s is None and ch.finish_reason is None
    assert handle(1, RequestParams("hi", 2)).text == "" and handle(1, RequestParams("hi", 2)).prompt is None
