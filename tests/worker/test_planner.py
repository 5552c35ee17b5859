"""The engine's plan of a slot-aware model's iteration (worker/planner.py): which prompt chunks
run within the model's prefill_budget, in which order, and how a prefill advances."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.planner import NO_CHUNKS, Prefill, plan_chunks


@dataclass(eq=False)
class Running:
    """A stand-in for a running request: its batch index and sequence (hashed by identity)."""

    pos: int
    seq: list[int] = field(default_factory=list)


def running(pos: int, length: int) -> Running:
    return Running(pos, [1] * length)


def test_started_prompts_first_then_batch_order_and_the_budget_is_shared():
    a, b, c, d = running(0, 40), running(1, 30), running(2, 20), running(3, 50)
    prefilling = {a: Prefill(), b: Prefill(done=16), c: Prefill(), d: Prefill(done=8)}
    chunks = plan_chunks(prefilling, 48)
    assert list(chunks.items()) == [(1, 14), (3, 34), (0, 0), (2, 0)]  # b, d started; then a, c wait
    assert sum(chunks.values()) <= 48


def test_the_one_that_does_not_fit_gets_what_is_left():
    a, b = running(0, 10), running(1, 100)
    assert plan_chunks({a: Prefill(), b: Prefill()}, 32) == {0: 10, 1: 22}


def test_no_budget_plans_whole_prompts():
    a, b = running(0, 700), running(1, 900)
    assert plan_chunks({a: Prefill(), b: Prefill(done=100)}, None) == {1: 800, 0: 700}


def test_a_prompt_with_one_token_left_decodes():
    one, last, done = running(0, 1), running(1, 17), running(2, 5)
    chunks = plan_chunks({one: Prefill(), last: Prefill(done=16), done: Prefill(done=5)}, 16)
    assert chunks is NO_CHUNKS and chunks == {}


def test_a_prefill_advances_by_its_chunk_after_the_prefix_the_model_took_from_its_cache():
    p = Prefill().advanced(16, 32, 100)  # first chunk: 32 cached, then 16 computed
    assert (p.done, p.cached) == (48, 32)
    p = p.advanced(16, None, 100)
    assert (p.done, p.cached) == (64, 32)
    assert p.advanced(64, None, 100).done == 100  # never past the sequence
    assert Prefill().advanced(0, None, 10) == Prefill()  # waited (chunk 0): nothing changes
