"""The Llama runner's prefix cache (worker/models/llama/prefix_cache.py) on the tiny random Llama:
hits, misses, eviction, a hit on a running request, cancellation, resumed requests, exact tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.slot_models import TINY_LLAMA_VOCAB, generate_alone, step_tokens  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import ModelOptions, load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.llama.prefix_cache import BLOCK_TOKENS, PrefixCache, skips_cache  # noqa: E402

pytestmark = pytest.mark.hf


ENGINES: dict[int, BatchInferenceEngine] = {}


@pytest.fixture(autouse=True)
def _forget_engines():
    yield
    ENGINES.clear()


def shared_prompts(count: int, prefix_len: int = 50, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: one shared ``prefix_len``-token prefix, then 3..20 tokens of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, TINY_LLAMA_VOCAB) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, TINY_LLAMA_VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(count)]


def run(model, prompts, n=8, batch_size=3):
    """Greedy tokens of ``prompts`` through an engine over ``model`` (one engine per model, kept
    across calls: a new engine binds the slots afresh, and with them a new, empty prefix cache)."""
    engine = ENGINES.get(id(model))
    if engine is None or engine.model is not model:  # (an id outlives its model: a later model may reuse it)
        engine = ENGINES[id(model)] = BatchInferenceEngine(model, batch_size=batch_size)
    handles = [engine.submit_request(p, n) for p in prompts]
    engine.run()
    return [h.tokens for h in handles]


@pytest.mark.parametrize("max_prefill_tokens", [16, 512])
def test_hits_give_the_tokens_of_a_cold_run_and_of_generate(model_dir, reference, max_prefill_tokens):
    prompts = shared_prompts(6)
    cold = load_model(model_dir, max_prefill_tokens=max_prefill_tokens)
    cold.prefix_cache_mb = 0
    want = run(cold, prompts)
    assert cold.prefix_cache is None
    warm = load_model(model_dir, max_prefill_tokens=max_prefill_tokens)
    warm.prefix_cache_mb = 16
    run(warm, prompts[:1])  # the first request alone fills the cache
    stats = warm.prefix_cache.stats
    assert stats.hits == 0 and stats.stored > 0
    got = run(warm, prompts)  # every prompt then hits the shared prefix (the first one all its blocks)
    assert got == want == [generate_alone(reference, p, 8) for p in prompts]
    assert stats.hits >= 6 * (50 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert stats.queries == sum(map(len, prompts)) + len(prompts[0])


def test_a_miss_prefills_everything_and_unrelated_prompts_do_not_hit(model_dir):
    model = load_model(model_dir)
    model.prefix_cache_mb = 16
    a, b = shared_prompts(1, seed=1)[0], shared_prompts(1, seed=2)[0]
    run(model, [a])
    run(model, [b])
    assert model.prefix_cache.stats.hits == 0
    run(model, [a[:BLOCK_TOKENS]])  # exactly one block long: the last token is computed, so no hit
    assert model.prefix_cache.stats.hits == 0
    run(model, [a[:BLOCK_TOKENS + 1]])
    assert model.prefix_cache.stats.hits == BLOCK_TOKENS


def test_a_tiny_budget_evicts_least_recently_used_and_stays_exact(model_dir, reference):
    model = load_model(model_dir)
    model.bind_slots(1)
    block = model.prefix_cache.block_bytes
    model.prefix_cache_mb = 3 * block / 2**20  # three blocks
    prompts = shared_prompts(4, prefix_len=60, seed=3) + shared_prompts(3, prefix_len=60, seed=4)
    got = run(model, prompts, batch_size=2)
    cache = model.prefix_cache
    assert cache.num_blocks == 3 and cache.used_blocks <= 3 and cache.stats.evicted > 0
    assert got == [generate_alone(reference, p, 8) for p in prompts]
    # the most recent prompt's head is kept (a chain's tail is evicted first)
    assert cache.load(0, prompts[-1]) >= BLOCK_TOKENS
    with pytest.raises(ValueError, match="no block"):
        PrefixCache(model.kv_cache, block / 2**21, "fp32")


def test_a_request_hits_the_prompt_of_a_request_still_running(model_dir, reference):
    model = load_model(model_dir)
    model.prefix_cache_mb = 16
    model.bind_slots(2)
    a, b = shared_prompts(2, prefix_len=40, seed=5)
    seq_a = list(a)
    with torch.inference_mode():
        seq_a.append(step_tokens(model, [SlotInput(0, seq_a)])[0])  # a's prefill: its blocks are stored
        assert model.prefix_cache.stats.hits == 0
        seq_b = list(b)
        for _ in range(6):  # a decodes while b is admitted (a hit) and decodes beside it
            ta, tb = step_tokens(model, [SlotInput(0, seq_a), SlotInput(1, seq_b)])
            seq_a.append(ta)
            seq_b.append(tb)
    assert model.prefix_cache.stats.hits == (40 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert seq_a[len(a):] == generate_alone(reference, a, 7)
    assert seq_b[len(b):] == generate_alone(reference, b, 6)


def test_a_cancelled_request_leaves_its_blocks_and_a_resumed_one_hits(model_dir, reference):
    model = load_model(model_dir)
    model.prefix_cache_mb = 16
    (p,) = shared_prompts(1, prefix_len=45, seed=6)
    engine = BatchInferenceEngine(model, batch_size=2)
    seen = []
    h = engine.submit_request(p, 30, request_id="x", on_token=lambda t: seen.append(t) or (
        len(seen) == 20 and engine.cancel("x")))
    engine.run()
    assert h.finish_reason == FinishReason.CANCELLED
    stored = model.prefix_cache.stats.stored
    assert stored >= (len(p) + 19) // BLOCK_TOKENS  # prompt and output blocks of the cancelled request
    # the same request resumed with its tokens so far (as after a migration) reuses them all
    want = generate_alone(reference, p, 30)
    h2 = engine.submit_request(p, 30, resume_tokens=h.tokens)
    engine.run()
    assert h2.tokens == want
    assert model.prefix_cache.stats.hits == ((len(p) + len(h.tokens) - 1) // BLOCK_TOKENS) * BLOCK_TOKENS


def test_prompt_logprobs_requests_bypass_a_hit_and_precisions_have_their_own_root(model_dir):
    assert skips_cache(SimpleNamespace(prompt_logprobs=0)) and not skips_cache(SlotInput(0, [1]))
    model = load_model(model_dir)
    model.prefix_cache_mb = 16
    model.bind_slots(1)
    (p,) = shared_prompts(1, seed=7)
    with torch.inference_mode():
        model.forward_batch([SlotInput(0, list(p))])
        model.release_slot(0)
        stats = model.prefix_cache.stats
        assert stats.stored >= 3 and stats.hits == 0
        # a slot input asking prompt_logprobs (the engine sets it on its SlotInput) prefills it all
        asking = SimpleNamespace(slot=0, tokens=list(p), sampling=SlotInput(0, [1]).sampling, prompt_len=len(p),
                                 prompt_logprobs=0, logprobs=None)
        model.forward_batch([asking])
        assert stats.hits == 0 and model.kv_cache.lengths[0] == len(p)
        model.release_slot(0)
        model.forward_batch([SlotInput(0, list(p))])  # the same prompt without: a hit
        assert stats.hits == (len(p) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0
    bf16 = load_model(model_dir, precision="bf16")
    bf16.prefix_cache_mb = 16
    bf16.bind_slots(1)
    assert model.prefix_cache.root != bf16.prefix_cache.root  # ("root", "fp32") vs ("root", "bf16")


def test_the_budget_option(model_dir):
    assert ModelOptions(prefix_cache_mb=0).prefix_cache_mb == 0
    for bad in (-1, True, float("nan"), "8"):
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            ModelOptions(prefix_cache_mb=bad)
    model = load_model(model_dir, prefix_cache_mb=0)
    model.bind_slots(1)
    assert model.prefix_cache is None
    model = load_model(model_dir)  # default: sized from the machine
    model.bind_slots(1)
    assert model.prefix_cache is not None and model.prefix_cache.nbytes > 0


def test_prompts_admitted_together_hit_what_the_first_one_stored_meanwhile(model_dir, reference):
    """The lookup happens at a prompt's first chunk, not at admission: four prompts sharing a
    60-token prefix arrive at once into a cold cache with 32-token chunks; the first is prefilled
    alone (the budget), and each later one reuses the blocks stored by then."""
    model = load_model(model_dir, max_prefill_tokens=32)
    model.prefix_cache_mb = 16
    prompts = shared_prompts(4, prefix_len=60, seed=8)
    got = run(model, prompts, batch_size=4)
    assert got == [generate_alone(reference, p, 8) for p in prompts]
    assert model.prefix_cache.stats.hits >= 3 * 32


@pytest.mark.parametrize("precision, speculative", [("fp32", 3), ("bf16", 0), ("int8", 0), ("gguf", 0), ("gguf", 3)])
def test_hits_with_speculative_decoding_and_other_precisions_give_the_cold_runs_tokens(model_dir, precision,
                                                                                         speculative, request):
    """A hit's keys are the ones a cold prefill computes in that precision: the same tokens as the
    same runner with the cache off, drafts verified as usual (gguf: the tiny Llama GGUF of every
    block format, ``quantized_gguf``, with an fp32 KV cache: with gguf's default fp16 one, hits and
    cold runs of this batch differ by up to ~0.005 in a logprob, enough to flip this tiny model's
    near-ties; with fp32 and bf16 caches they agree bit for bit here. The cause: a hit prefills the
    rest in other chunks, and a row of torch's CPU SDPA depends on the call's rows and keys:
    docs/architecture.md, "Prefix cache and routing")."""
    prompts = shared_prompts(4, seed=9)
    path = request.getfixturevalue("quantized_gguf") if precision == "gguf" else model_dir
    kv = {"kv_cache_dtype": "fp32"} if precision == "gguf" else {}
    tokens = []
    for mb in (0, 16):
        model = load_model(path, precision=precision, speculative_tokens=speculative, max_prefill_tokens=32, **kv)
        model.prefix_cache_mb = mb
        run(model, prompts[:1], n=12)
        tokens.append(run(model, prompts, n=12))
        if mb:
            assert model.prefix_cache.stats.hits >= 4 * 48
    assert tokens[0] == tokens[1]
