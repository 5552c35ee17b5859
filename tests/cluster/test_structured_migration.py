"""A worker killed mid-JSON (issue 21, "a migration mid-JSON" and "``length`` endings"): a broker
and two worker processes serving the tiny text model; two greedy requests under the same JSON
schema stream from the first worker (slowed by ``step_delay_ms``), which is SIGKILLed once both
have streamed some tokens. The broker moves them, with their tokens so far, to the second worker,
whose matchers are rebuilt from those tokens: the one with room ends ``stop`` with JSON that
validates against the schema, the one cut by ``max_tokens`` ends ``length`` (never ``stop``) with
an unfinished prefix of the same JSON; each token streams exactly once, in order, and the tokens
are those of an uninterrupted run of the same pair."""

from __future__ import annotations

import json
import os
import signal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from broker import BrokerConfig  # noqa: E402
from client import Client  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from slotserve.launcher import ClusterConfig, LocalCluster  # noqa: E402
from tests.support.cluster import ANY_PORT  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "yy"]}}}
PROMPT = "hello world"
CUT = 10  # max_tokens of the request cut by length (the whole JSON takes more)
STREAMED_BEFORE_KILL = 4  # tokens of each request streamed before its worker is killed


@pytest.fixture(scope="module")
def cluster(tiny_text_dir):
    """The victim first (4 slots, 200 ms per iteration: the broker gives it both requests, most
    free slots first, and the kill lands mid-stream), then the survivor (2 slots, no delay)."""
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1, worker_liveness_s=1.0)
    workers = (WorkerConfig(model=tiny_text_dir, num_slots=4, step_delay_ms=200.0, heartbeat_interval_s=0.1,
                            warmup=False),
               WorkerConfig(model=tiny_text_dir, num_slots=2, heartbeat_interval_s=0.1, warmup=False))
    with LocalCluster(ClusterConfig(broker, workers, start_timeout_s=120.0)) as c:
        yield c


def submit_pair(client: Client, streamed: dict[str, list[int]]):
    """The request with room (``whole``) and the one cut at :data:`CUT` tokens, streaming into ``streamed``."""
    return {name: client.submit_request(PROMPT, n, structured={"json_schema": SCHEMA},
                                        on_token=streamed[name].append)
            for name, n in (("whole", 64), ("cut", CUT))}


def test_a_worker_killed_mid_json_hands_both_requests_on_whole(cluster, tiny_text_dir):
    victim = cluster.worker_processes[0]
    streamed = {"whole": [], "cut": []}
    with Client(cluster.frontend, model=tiny_text_dir, heartbeat_interval_s=0.1) as c:
        name = os.path.basename(tiny_text_dir)  # (a model folder's primary name; its path an alias)
        wait_until(lambda: c.status().models[name].workers == 2, 60, "both workers to register")
        h = submit_pair(c, streamed)

        def victim_streams_both():
            held = [w.inflight for w in c.status().workers if w.name.endswith(f":{victim.pid}")]
            return held == [2] and min(map(len, streamed.values())) >= STREAMED_BEFORE_KILL

        wait_until(victim_streams_both, 30, "the victim to stream both requests",
                   show=lambda: (c.status().workers, streamed))
        os.kill(victim.pid, signal.SIGKILL)
        before = {name: list(tokens) for name, tokens in streamed.items()}  # (its last tokens may be lost)
        for handle in h.values():
            handle.result(timeout=60)
        counters = c.status().counters
        ref_streamed = {"whole": [], "cut": []}
        ref = submit_pair(c, ref_streamed)  # the same pair, uninterrupted, on the survivor
        for handle in ref.values():
            handle.result(timeout=60)
    whole, cut = h["whole"], h["cut"]
    assert counters["workers_lost"] >= 1 and counters["requeued"] >= 2
    assert whole.finish_reason is FinishReason.STOP and whole.error is None
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    assert cut.finish_reason is FinishReason.LENGTH and len(cut.tokens) == CUT
    with pytest.raises(json.JSONDecodeError):  # unfinished: cut, not stopped
        json.loads(cut.text)
    assert cut.tokens == whole.tokens[:CUT] and whole.text.startswith(cut.text)
    for name, handle in h.items():
        moved_at = len(before[name])
        assert STREAMED_BEFORE_KILL <= moved_at < len(handle.tokens)  # moved mid-JSON
        assert streamed[name] == handle.tokens  # each token once, in order: no gap, no duplicate
        assert handle.tokens[:moved_at] == before[name]
        assert handle.tokens == ref[name].tokens and handle.finish_reason is ref[name].finish_reason
