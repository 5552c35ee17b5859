"""Prefix-cache reporting end to end on one cluster (issue 23 step 3): broker and a worker running
the tiny random Llama with its prefix cache, on threads of this process. ``cached_tokens`` on
``Client`` handles and ``slotserve run``'s JSONL rows; the worker's queries, hits and cache size
in ``status``, ``slotserve status`` and the broker's Prometheus metrics."""

from __future__ import annotations

import io
import json
import random
import urllib.request

import pytest
from click.testing import CliRunner

from client import Client
from slotserve.cli import main
from slotserve.job import run_job
from tests.support.cluster import ThreadCluster, registered
from tests.support.waits import wait_until

pytest.importorskip("transformers")

PREFIX = [random.Random(23).randrange(2, 250) for _ in range(40)]  # 2 whole blocks of 16, and 8 tokens


def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_cached_tokens_reach_handles_rows_status_and_metrics():
    from tests.support.slot_models import tiny_llama
    from worker.models import llama

    runner = llama.from_hf(tiny_llama(), max_cache_len=64)
    runner.prefix_cache_mb = 1
    with ThreadCluster(heartbeat_interval_s=0.1, metrics_port=0, tick_s=0.01) as cl, \
            Client(cl.frontend, model="tiny") as c:
        cl.add_worker(runner, model="tiny", num_slots=2, warmup=False, name="tiny-w")
        wait_until(lambda: registered(c, "tiny-w"), 30, "the worker to register")
        cold = c.submit_request(PREFIX, 3, stop_token=None)
        cold.result(timeout=60)
        warm = c.submit_request(PREFIX + [5, 6, 7, 8, 9], 3, stop_token=None)
        warm.result(timeout=60)
        assert (cold.cached_tokens, warm.cached_tokens) == (0, 32) and warm.prompt_tokens == 45
        rows = [{"id": "a", "prompt": PREFIX + [9, 9], "max_tokens": 2, "stop_token": None},
                {"id": "b", "prompt": PREFIX[:20], "max_tokens": 2, "stop_token": None}]  # 19 looked up: 16 hit
        out = io.StringIO()
        summary = run_job(c, io.StringIO("\n".join(map(json.dumps, rows))), out, progress=False, timeout_s=60)
        got = {r["id"]: r["usage"] for r in map(json.loads, out.getvalue().splitlines())}
        assert got["a"] == {"prompt_tokens": 42, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
        assert got["b"]["prompt_tokens_details"] == {"cached_tokens": 16} and summary.cached_tokens == 48
        assert "(48 cached)" in summary.format()

        queries, hits = 40 + 45 + 42 + 20, 32 + 32 + 16  # tokens looked up (whole sequences), found
        def reported():
            (w,) = c.status().workers
            return w if w.prefix_cache is not None and w.prefix_cache.queries == queries else None
        w = wait_until(reported, 10, "the worker's heartbeat with its prefix cache", pause_s=0.02)
        cache = runner.prefix_cache
        assert w.prefix_cache.hits == hits and w.prefix_cache.budget_bytes == cache.num_blocks * cache.block_bytes
        assert 0 < w.prefix_cache.used_bytes == cache.used_blocks * cache.block_bytes <= w.prefix_cache.budget_bytes
        text = CliRunner().invoke(main, ["status", "--broker", cl.frontend]).output
        line = next(x for x in text.splitlines() if "tiny-w" in x)
        assert f"prefix cache hit rate {100 * hits / queries:.1f}% ({hits}/{queries} tokens)" in line
        assert json.loads(CliRunner().invoke(main, ["status", "--broker", cl.frontend, "--json"]).output)[
            "workers"][0]["prefix_cache"]["hits"] == hits

        port, labels = cl.server.metrics.port, (("model", "tiny"), ("worker", "tiny-w"))
        m = wait_until(lambda: (lambda m: m if m.get(("slotserve_prefix_cache_hits_total", labels)) == hits
                                else None)(scrape(port)), 10, "the prefix cache in the metrics", pause_s=0.02)
        assert m[("slotserve_prefix_cache_queries_total", labels)] == queries
        assert m[("slotserve_prefix_cache_used_bytes", labels)] == w.prefix_cache.used_bytes
        assert m[("slotserve_prefix_cache_budget_bytes", labels)] == w.prefix_cache.budget_bytes


def test_a_worker_without_a_prefix_cache_reports_0_and_shows_no_cache():
    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend) as c:
        cl.add_worker(name="sim-w")  # a SimulatedLLM: no prefix cache
        wait_until(lambda: registered(c, "sim-w"), 30, "the worker to register")
        h = c.submit_request(PREFIX, 3)
        h.result(timeout=30)
        assert h.cached_tokens == 0
        assert c.status().workers[0].prefix_cache is None
        text = CliRunner().invoke(main, ["status", "--broker", cl.frontend]).output
        assert "sim-w" in text and "prefix cache" not in text
