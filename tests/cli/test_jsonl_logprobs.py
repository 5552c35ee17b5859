"""`slotserve run` rows with token logprobs (issue 20 item 3): a row asking
``"logprobs": N`` gets one ``{"token", "logprob", "top_logprobs"}`` entry per
generated token, one asking ``"prompt_logprobs": N`` one per prompt token (the
first null); a row asking nothing gets neither key; ``-inf`` (probability 0),
which JSON cannot hold, is written as vLLM writes it, -9999.0."""

from __future__ import annotations

import io
import json

import pytest

from client import Client
from protocol.logprobs import TokenLogprob
from slotserve.job import JSON_MIN_LOGPROB, _scored, run_job
from tests.support.cluster import ThreadCluster, registered
from tests.support.waits import wait_until

pytest.importorskip("transformers")


def strict(line: str) -> dict:
    """json.loads refusing NaN and infinities (which are not JSON)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def test_minus_infinity_is_written_as_vllm_writes_it():
    entry = _scored(7, TokenLogprob(float("-inf"), ((3, -0.5), (7, float("-inf")))))
    assert entry == {"token": 7, "logprob": -9999.0, "top_logprobs": [[3, -0.5], [7, -9999.0]]}
    assert JSON_MIN_LOGPROB == -9999.0 and strict(json.dumps(entry)) == entry


def test_rows_that_ask_get_logprobs_and_prompt_logprobs_entries():
    from tests.support.slot_models import tiny_llama
    from worker.models import llama

    rows = [{"id": "both", "prompt": [1, 9, 40, 7], "max_tokens": 5, "stop_token": None, "logprobs": 2,
             "prompt_logprobs": 1},
            {"id": "gen", "prompt": [3, 4], "max_tokens": 3, "stop_token": None, "logprobs": 0},
            {"id": "none", "prompt": [3, 4], "max_tokens": 3, "stop_token": None}]
    out = io.StringIO()
    runner = llama.from_hf(tiny_llama(), max_cache_len=64)
    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="tiny") as c:
        cl.add_worker(runner, model="tiny", num_slots=2, warmup=False, name="tiny")
        wait_until(lambda: registered(c, "tiny"), 30, "the worker to register")
        summary = run_job(c, io.StringIO("\n".join(map(json.dumps, rows))), out, progress=False, timeout_s=60)
    assert summary.errors == 0
    got = {r["id"]: r for r in map(strict, out.getvalue().splitlines())}
    both, gen, none = got["both"], got["gen"], got["none"]
    assert "logprobs" not in none and "prompt_logprobs" not in none
    assert "prompt_logprobs" not in gen and [e["token"] for e in gen["logprobs"]] == gen["tokens"]
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in gen["logprobs"])
    assert [e["token"] for e in both["logprobs"]] == both["tokens"] and len(both["tokens"]) == 5
    for e in both["logprobs"]:
        assert len(e["top_logprobs"]) == 2 and all(type(i) is int and x <= 0 for i, x in e["top_logprobs"])
        assert e["top_logprobs"][0][1] >= e["logprob"]  # the most likely first
    prompt = both["prompt_logprobs"]
    assert prompt[0] is None and [e["token"] for e in prompt[1:]] == [9, 40, 7]
    assert all(len(e["top_logprobs"]) == 1 for e in prompt[1:])
