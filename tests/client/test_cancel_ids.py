"""``cancel`` with what can be no request's id (a list, a float, a dict, a bool, an empty or too long
str) raises ValueError naming ``request_id`` and what to send, as ``submit_request``'s
``request_id`` does (:func:`protocol.request.check_request_id`), everywhere a request is cancelled:
the in-process engines (generation and embedding), the Python SDK sync and async. Before: a list or
dict was ``TypeError: unhashable type``, a float or bool an unknown id (False). A valid id of no
request is still False, and the engine and client keep working."""

from __future__ import annotations

import re

import pytest

from protocol.request import check_request_id
from tests.support.cluster import ThreadCluster
from worker import BatchInferenceEngine, SimulatedLLM

NOT_IDS = [([1], "got an array [1]"), (1.5, "got a number 1.5"), ({}, "got an object {}"), (True, "got true"),
           (None, "got null"), ("", "1..256 characters, got 0"), ("x" * 257, "got 257")]


@pytest.mark.parametrize("value, says", NOT_IDS)
def test_check_request_id_says_what_an_id_is(value, says):
    with pytest.raises(ValueError, match=r"^request_id must be .*" + re.escape(says)):
        check_request_id(value)
    assert check_request_id("x") == "x" and check_request_id(7) == 7


@pytest.mark.parametrize("value, says", NOT_IDS)
def test_the_engine_refuses_a_cancel_of_no_id(value, says):
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size=2, stop_token=None)
    h = engine.submit_request([1, 2], 3, request_id="a")
    with pytest.raises(ValueError, match="^request_id must be"):
        engine.cancel(value)
    assert engine.cancel("nope") is False and engine.cancel(12) is False
    engine.run()
    assert h.finish_reason == "length" and len(h.tokens) == 3


def test_the_embedding_engine_refuses_a_cancel_of_no_id():
    from worker.embeddings import EmbeddingEngine

    class Model:
        embedding_size, vocab_size, max_seq_len = 2, 8, 8

        def embed(self, prompts):
            return [b"\0" * 8 for _ in prompts]

    engine = EmbeddingEngine(Model(), 2)
    for value, _ in NOT_IDS:
        with pytest.raises(ValueError, match="^request_id must be"):
            engine.cancel(value)
    assert engine.cancel("nope") is False


@pytest.fixture(scope="module")
def frontend():
    with ThreadCluster() as cluster:
        cluster.add_worker()
        yield cluster.frontend


def test_the_sdk_refuses_a_cancel_of_no_id_sync_and_async(frontend):
    import asyncio

    from client import AsyncClient, Client

    with Client(frontend, model="simulated") as c:
        c.wait_for_model(30)
        for value, _ in NOT_IDS:
            with pytest.raises(ValueError, match="^request_id must be"):
                c.cancel(value)
            with pytest.raises(ValueError, match="^request_id must be"):
                AsyncClient(c).cancel(value)
        assert c.cancel("nope") is False
        h = c.submit_request([1, 2], 3, stop_token=None)
        assert h.result(timeout=30) and len(h.tokens) == 3
        assert asyncio.run(AsyncClient(c).generate([1, 2], 2, stop_token=None)) is not None
