"""``cached_tokens`` where a careless caller might break it (breaker, issue 23 step 3): a request
asking ``prompt_logprobs`` bypasses the prefix cache and reports 0 even when its whole prompt is
cached (and stores its blocks for the next request), ``n`` copies of one prompt admitted together
each count whole reused blocks, never more than the prompt, with the tokens of a cache-less run,
and a request cancelled before its prefill reports None while one cancelled after keeps its count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from protocol.enums import FinishReason  # noqa: E402
from tests.models.test_cached_tokens import cached_model, tokens  # noqa: E402, F401  (the same tiny cached model)
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.llama.prefix_cache import BLOCK_TOKENS  # noqa: E402

pytestmark = pytest.mark.hf


def test_prompt_logprobs_bypass_the_cache_and_report_0(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=2)
    prompt = tokens(70, seed=11)
    warm = engine.submit_request(prompt, 2)
    engine.run()
    scored = engine.submit_request(prompt, 2, prompt_logprobs=1)
    engine.run()
    assert warm.cached_tokens == 0 and scored.cached_tokens == 0 and len(scored.prompt_logprobs) == 70
    fresh = tokens(40, seed=12)
    first_scored = engine.submit_request(fresh, 2, prompt_logprobs=0)  # a miss that stores its blocks
    engine.run()
    after = engine.submit_request(fresh, 2)
    engine.run()
    assert first_scored.cached_tokens == 0 and after.cached_tokens == (39 // BLOCK_TOKENS) * BLOCK_TOKENS


def test_copies_of_one_prompt_admitted_together_count_whole_blocks_of_their_prompt(cached_model, model_dir):
    prompt = tokens(75, seed=13)
    engine = BatchInferenceEngine(cached_model, batch_size=4)
    handles = [engine.submit_request(prompt, 6) for _ in range(4)]
    engine.run()
    off = load_model(model_dir, max_prefill_tokens=32)
    off.prefix_cache_mb = 0
    plain = BatchInferenceEngine(off, batch_size=4)
    reference = [plain.submit_request(prompt, 6) for _ in range(4)]
    plain.run()
    for h, ref in zip(handles, reference):
        assert h.tokens == ref.tokens and h.prompt_tokens == 75
        assert 0 <= h.cached_tokens <= 74 and h.cached_tokens % BLOCK_TOKENS == 0
    assert handles[0].cached_tokens == 0 and max(h.cached_tokens for h in handles) > 0


def test_a_cancelled_request_reports_none_before_its_prefill_and_its_count_after(cached_model):
    engine = BatchInferenceEngine(cached_model, batch_size=1)
    prompt = tokens(50, seed=14)
    warm = engine.submit_request(prompt, 2)
    engine.run()
    started = engine.submit_request(prompt, 50)
    queued = engine.submit_request(prompt, 5)  # waits behind it (one slot)
    while started.first_token_s is None:
        engine.step()
    engine.cancel(started.request_id)
    engine.cancel(queued.request_id)
    engine.run()
    assert warm.cached_tokens == 0 and started.finish_reason is FinishReason.CANCELLED
    assert started.cached_tokens == 48 and queued.cached_tokens is None
