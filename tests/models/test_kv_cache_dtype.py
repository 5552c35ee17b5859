"""--kv-cache-dtype (ModelOptions.kv_cache_dtype) on the tiny random Llama: the KV and prefix caches'
dtype and bytes, the decode attention over a bf16 cache, tokens, and the options it is refused with.
SmolLM2's tokens at bf16 KV: test_kv_cache_dtype_smollm2.py."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.slot_models import TINY_LLAMA_VOCAB, generate_alone, tiny_llama  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import ModelOptions, llama, load_model  # noqa: E402
from worker.models.llama.attention import decode_attention, decode_views  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def bound(runner, slots=2):
    runner.prefix_cache_mb = 1
    runner.bind_slots(slots)
    return runner


@pytest.mark.parametrize("kv, dtype", [("auto", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                                       ("fp16", torch.float16)])
def test_the_option_sets_the_cache_and_prefix_pool_dtype(tiny, kv, dtype):
    runner = bound(llama.from_hf(tiny, max_cache_len=64, kv_cache_dtype=kv))
    assert runner.kv_dtype == runner.kv_cache.kv.dtype == runner.prefix_cache.pool.dtype == dtype
    assert runner.weights.act_dtype == torch.float32  # activations stay fp32 on CPU


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_a_16_bit_cache_halves_the_bytes_of_the_cache_and_of_each_prefix_block(tiny, kv):
    fp32 = bound(llama.from_hf(tiny, max_cache_len=64, kv_cache_dtype="fp32"))
    bf16 = bound(llama.from_hf(tiny, max_cache_len=64, kv_cache_dtype=kv))
    assert bf16.kv_cache.nbytes * 2 == fp32.kv_cache.nbytes > 0
    assert bf16.kv_bytes_per_slot * 2 == fp32.kv_bytes_per_slot == 2 * 2 * 2 * 16 * 64 * 4  # K+V, layers, heads, D
    assert bf16.prefix_cache.block_bytes * 2 == fp32.prefix_cache.block_bytes
    assert bf16.prefix_cache.root != fp32.prefix_cache.root  # a block of one dtype is never another's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_over_a_16_bit_cache_is_fp32_attention_over_its_rounded_values(dtype):
    torch.manual_seed(0)
    kv = torch.randn(2, 2, 3, 2, 16, 8)  # layers, K/V, rows, kv heads, capacity, D
    rounded = kv.to(dtype)
    lengths = torch.tensor([5, 16 - 1, 1])
    q = torch.randn(3, 4, 8)
    for window in (None, 4):
        want = decode_attention(q, decode_views(rounded.float(), 3, 15, lengths, group=2, windows={window}), 1,
                                0.3, window)
        got = decode_attention(q, decode_views(rounded, 3, 15, lengths, group=2, windows={window},
                                               dtype=torch.float32), 1, 0.3, window)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_at_bf16_a_prompt_gives_the_same_tokens_whole_in_chunks_and_after_a_prefix_hit(tiny):
    """Attention reads keys and values as the cache stores them, a fresh prompt's too: a prefix hit
    copies the bf16 blocks a cold prefill stored, and a later chunk reads its prefix from the cache,
    so both give the whole prompt's tokens. (Not the fp32 ones: the tiny random model's tokens
    change at bf16 KV within 12 tokens; SmolLM2's: test_kv_cache_dtype_smollm2.py.)"""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, TINY_LLAMA_VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(4)]

    def tokens(runner, repeat=1):
        engine = BatchInferenceEngine(runner, batch_size=2)
        for _ in range(repeat):
            handles = [engine.submit_request(p, 12) for p in prompts]
            engine.run()
        return [h.tokens for h in handles], [h.cached_tokens for h in handles]

    runner = llama.from_hf(tiny, max_cache_len=128, kv_cache_dtype="bf16")
    runner.prefix_cache_mb = 0
    whole, _ = tokens(runner)
    runner = llama.from_hf(tiny, max_cache_len=128, kv_cache_dtype="bf16", max_prefill_tokens=16)
    runner.prefix_cache_mb = 0
    assert tokens(runner)[0] == whole  # chunks of 16
    runner = llama.from_hf(tiny, max_cache_len=128, kv_cache_dtype="bf16")
    runner.prefix_cache_mb = 4
    warm, cached = tokens(runner, repeat=2)
    assert warm == whole and min(cached) >= 16


def test_speculative_decoding_over_a_bf16_cache_gives_its_draft_free_tokens(tiny):
    prompt = [7, 8, 9, 10, 11] * 6
    got = {}
    for drafts in (0, 4):
        runner = llama.from_hf(tiny, max_cache_len=128, kv_cache_dtype="bf16")
        runner.speculative_tokens = drafts
        runner.draft_costs = None  # every draft the lookup finds
        engine = BatchInferenceEngine(runner, batch_size=2)
        h = engine.submit_request(prompt, 16)
        engine.run()
        got[drafts] = h.tokens
    assert got[4] == got[0] and len(got[0]) == 16


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, fp32, bf16, fp16"),
    ({"kv_cache_dtype": "bf16", "runner": "hf"}, "needs the slotserve runner"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype must be one of"),
])
def test_options_are_checked_once(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelOptions(**kwargs)


def test_the_simulated_model_refuses_it():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_model("simulated", kv_cache_dtype="bf16")


def test_off_the_cpu_only_the_activations_dtype_is_accepted(tiny):
    weights = llama.from_hf(tiny, max_cache_len=32).weights
    assert llama.kv_dtype("auto", weights) == torch.float32
    weights.device = "cuda"  # (the check reads the device only: no GPU needed)
    assert llama.kv_dtype("fp32", weights) == torch.float32
    with pytest.raises(ValueError, match="runs on CPU only"):
        llama.kv_dtype("bf16", weights)


def test_a_model_on_the_hf_runner_refuses_it(tmp_path):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="whose KV cache has the weights' dtype"):
        load_model(str(tmp_path), kv_cache_dtype="bf16")


@pytest.mark.parametrize("precision, device, want", [
    ("gguf", "cpu", torch.float16),  # a GGUF as stored: llama.cpp's default cache type
    ("fp32", "cpu", torch.float32),  # the exact reference keeps its fp32 cache
    ("bf16", "cpu", torch.float32),  # (fp32 activations on CPU)
    ("gguf", "cuda", torch.bfloat16),  # off the CPU: the activations'
])
def test_auto_is_fp16_for_a_gguf_on_cpu_else_the_activations_dtype(precision, device, want):
    from types import SimpleNamespace

    act = torch.bfloat16 if device == "cuda" else torch.float32
    weights = SimpleNamespace(precision=precision, device=device, act_dtype=act)
    assert llama.kv_dtype("auto", weights) == want
