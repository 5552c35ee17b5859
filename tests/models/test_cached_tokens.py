"""``cached_tokens`` on the engine's handles (issue 23 step 3): the prompt tokens the Llama runner's
prefix cache gave a request, on a hit, a miss, a model without a cache, and a resumed request."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.slot_models import TINY_LLAMA_VOCAB  # noqa: E402
from worker import BatchInferenceEngine, SimulatedLLM  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.llama.prefix_cache import BLOCK_TOKENS  # noqa: E402
from worker.process import WorkerProcess  # noqa: E402

pytestmark = pytest.mark.hf


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, TINY_LLAMA_VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def cached_model(model_dir):
    model = load_model(model_dir, max_prefill_tokens=32)
    model.prefix_cache_mb = 16
    return model


def test_a_miss_counts_0_and_a_hit_counts_the_whole_blocks_reused(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=2)
    prefix = tokens(50, seed=1)
    first = engine.submit_request(prefix + tokens(5, seed=2), 4)
    assert first.cached_tokens is None  # not prefilled yet
    engine.run()
    assert first.cached_tokens == 0 and first.usage.prompt_tokens == 55
    second = engine.submit_request(prefix + tokens(9, seed=3), 4)
    engine.run()
    assert second.cached_tokens == (50 // BLOCK_TOKENS) * BLOCK_TOKENS == 48
    again = engine.submit_request(prefix + tokens(9, seed=3), 4)  # the same 59 tokens: all but the last block
    unrelated = engine.submit_request(tokens(40, seed=4), 4)
    engine.run()
    assert again.cached_tokens == (58 // BLOCK_TOKENS) * BLOCK_TOKENS and unrelated.cached_tokens == 0
    stats = cached_model.prefix_cache.stats
    assert stats.hits >= 48 + 48


def test_the_count_is_set_with_the_first_token_of_a_chunked_prompt(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=2)
    prompt = tokens(100, seed=5)
    for want in (0, 96):  # cold (in 4 chunks of max_prefill_tokens=32), then all whole blocks but the last token's
        seen, steps = [], 0
        h = engine.submit_request(prompt + [7], 3, on_token=lambda t: seen.append(h.cached_tokens))
        while h.first_token_s is None:
            assert h.cached_tokens is None
            engine.step()
            steps += 1
        engine.run()
        assert seen[0] == h.cached_tokens == want and steps == (4 if want == 0 else 1)


def test_a_resumed_request_counts_prompt_tokens_only(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=1)
    prompt = tokens(33, seed=6)
    done = engine.submit_request(prompt, 20)
    engine.run()  # prompt + 19 of its tokens are cached (52 tokens: 3 blocks)
    resumed = engine.submit_request(prompt, 25, resume_tokens=done.tokens[:19])
    engine.run()
    assert resumed.cached_tokens == len(prompt) == resumed.prompt_tokens  # (48 tokens reused, 33 of the prompt)


def test_models_without_a_prefix_cache_report_0(model_dir):
    off = load_model(model_dir)
    off.prefix_cache_mb = 0
    for model in (off, SimulatedLLM()):
        engine = BatchInferenceEngine(model, batch_size=2)
        prompt = tokens(40, seed=7)
        handles = [engine.submit_request(prompt, 3) for _ in range(2)]
        engine.run()
        assert [h.cached_tokens for h in handles] == [0, 0]
    wp = WorkerProcess.__new__(WorkerProcess)
    wp.model = off
    assert wp.prefix_cache_usage() is None


def test_the_worker_reports_its_prefix_cache_usage(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=2)  # (a new engine: an empty cache)
    prompt = tokens(40, seed=8)
    for _ in range(2):
        engine.submit_request(prompt, 3)
        engine.run()
    wp = WorkerProcess.__new__(WorkerProcess)  # (only its model is read)
    wp.model = cached_model
    cache = cached_model.prefix_cache
    usage = wp.prefix_cache_usage()
    assert usage.queries == cache.stats.queries == 80 and usage.hits == cache.stats.hits == 32
    assert usage.used_bytes == cache.used_blocks * cache.block_bytes > 0
    assert usage.budget_bytes == cache.num_blocks * cache.block_bytes <= 16 * 2**20
