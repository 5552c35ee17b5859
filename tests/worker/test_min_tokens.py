"""min_tokens, end to end (vLLM's semantics): the stop token and stop
sequences are ignored until min_tokens tokens were generated; min_tokens <=
max_tokens. Engine, client, JSONL rows, and the wire (by the generic codec)."""

from __future__ import annotations

import io
import json

import pytest

from broker import BrokerConfig
from client import Client
from protocol.codec import decode, encode
from protocol.messages import Envelope, Submit
from protocol.request import RequestParams
from slotserve.job import run_job
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.engine import ScriptedModel
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig


def test_stop_token_and_sequences_wait_for_min_tokens():
    model = ScriptedModel({1: [0, 5, 0, 6, 7, 0, 8, 9]})
    engine = BatchInferenceEngine(model, batch_size=4, stop_token=0)
    plain = engine.submit_request([1], 8)
    held = engine.submit_request([1], 8, min_tokens=3)              # the stop token at 1 and 3 counts from 3 on
    exact = engine.submit_request([1], 8, min_tokens=2)
    seq = engine.submit_request([1], 8, stop_token=None, stop_sequences=[[0, 5], [7, 0]], min_tokens=3)
    engine.run()
    assert plain.tokens == [0] and plain.stop_reason is None  # (the engine's default stop token: its EOS)
    assert held.tokens == [0, 5, 0] and held.finish_reason == "stop"
    assert exact.tokens == [0, 5, 0]
    assert seq.tokens == [0, 5, 0, 6, 7, 0] and seq.stop_reason == (7, 0)  # [0, 5] matched too early


def test_resumed_tokens_count_toward_min_tokens():
    engine = BatchInferenceEngine(ScriptedModel({1: [0, 5, 0, 6]}), batch_size=1, stop_token=0)
    h = engine.submit_request([1], 8, min_tokens=3, resume_tokens=[9, 9])
    engine.run()
    assert h.tokens == [9, 9, 0] and h.finish_reason == "stop"


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        RequestParams([1], 3, min_tokens=4)
    for bad in (-1, 1.5, True, 2**64):
        with pytest.raises(ValueError, match="min_tokens"):
            RequestParams([1], 3, min_tokens=bad)
    engine = BatchInferenceEngine(SimulatedLLM(), 1)
    with pytest.raises(ValueError, match="min_tokens"):
        engine.submit_request([1], 3, min_tokens=4)
    assert engine.num_queued == 0
    assert RequestParams([1], 3, min_tokens=3).min_tokens == 3


def test_min_tokens_travels_on_the_wire():
    msg = Submit("m", [Envelope(1, RequestParams([1], 9, min_tokens=4))])
    assert decode(encode(msg)).requests[0].params.min_tokens == 4


def test_min_tokens_through_a_cluster_from_the_client_and_jsonl_rows():
    engine = BatchInferenceEngine(SimulatedLLM(), 1, stop_token=0)  # as the worker serves "simulated"
    ref = engine.submit_request([3, 4], 30, min_tokens=12)
    engine.run()
    assert 0 in ref.tokens[:11] and len(ref.tokens) >= 12  # the stop token did come early, and was ignored
    any_port = "tcp://127.0.0.1:*"
    cfg = ClusterConfig(BrokerConfig(frontend=any_port, backend=any_port),
                        (WorkerConfig(num_slots=2, model="simulated"),), start_timeout_s=60.0)
    with LocalCluster(cfg) as cluster, Client(cluster.frontend) as c:
        c.wait_for_model(30)
        h = c.submit_request([3, 4], 30, min_tokens=12)
        c.run(timeout=30)
        out = io.StringIO()
        run_job(c, io.StringIO(json.dumps({"id": "r", "prompt": [3, 4], "max_tokens": 30, "min_tokens": 12}) + "\n"),
                out, progress=False, timeout_s=30)
    assert (h.tokens, h.finish_reason, h.stop_reason) == (ref.tokens, ref.finish_reason, ref.stop_reason)
    assert json.loads(out.getvalue())["tokens"] == ref.tokens
