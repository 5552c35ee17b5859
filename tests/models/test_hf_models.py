"""The Hugging Face backend against transformers' own ``generate``.

Tiny randomly initialised Llama and GPT-2 models are built here, saved with
``save_pretrained`` and loaded through :func:`worker.models.hf.load_hf_model`
(the real loading code); ``initializer_range`` is large so logits are well
separated and greedy argmax is not decided by rounding noise.
"""

from __future__ import annotations

import functools
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from protocol.request import SamplingParams  # noqa: E402
from tests.support import slot_models  # noqa: E402
from tests.support.slot_models import generate_alone, save_tiny_llama, scattered_rows_and_reuse, tiny_llama  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.hf import load_hf_model  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 300
random_prompts = functools.partial(slot_models.random_prompts, max_len=40, vocab=VOCAB)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory):
    """The tiny Llama (a vocabulary of 300 here) or a GPT-2 like it; overrides the
    folder's ``model_dir`` (so its ``reference`` fixture loads these)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_tiny_llama(path, vocab_size=VOCAB)
    else:
        torch.manual_seed(0)
        model = _gpt2()
        model.generation_config.eos_token_id = None
        model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_engine_greedy_equals_generate(model_dir, reference, batch_size):
    model = load_model(model_dir)
    engine = BatchInferenceEngine(model, batch_size=batch_size)
    prompts = random_prompts(10, seed=batch_size)  # more prompts than slots: slots are reused
    rng = random.Random(batch_size + 100)
    max_tokens = [rng.randint(1, 20) for _ in prompts]  # requests finish at different iterations
    handles = [engine.submit_request(p, n) for p, n in zip(prompts, max_tokens)]
    engine.run()
    for p, n, h in zip(prompts, max_tokens, handles):
        assert h.finish_reason == FinishReason.LENGTH
        assert h.result(timeout=0)[len(p):] == generate_alone(reference, p, n)


def test_slot_model_reuse_and_scattered_rows(model_dir, reference):
    """Free a middle slot so decode rows are not consecutive (gather path), then refill it."""
    results = scattered_rows_and_reuse(load_hf_model(model_dir), random_prompts(5, seed=7))
    for prompt, got in results.items():
        assert got == generate_alone(reference, list(prompt), len(got))


def test_cache_grows_past_its_first_capacity(model_dir, reference):
    model = load_hf_model(model_dir, kv_capacity_step=16)
    engine = BatchInferenceEngine(model, batch_size=2)
    prompts = [random_prompts(1, seed=3, max_len=30)[0], [5, 6, 7]]
    handles = [engine.submit_request(p, 40) for p in prompts]
    engine.run()
    assert model.kv_cache.capacity > 16
    for p, h in zip(prompts, handles):
        assert h.result(timeout=0)[len(p):] == generate_alone(reference, p, 40)


def test_context_limit_from_config_and_max_cache_len(model_dir):
    assert load_hf_model(model_dir).max_seq_len == 256
    model = load_hf_model(model_dir, max_cache_len=32)
    assert model.max_seq_len == 32
    engine = BatchInferenceEngine(model, batch_size=2)
    engine.submit_request([3] * 30, 2)
    with pytest.raises(ValueError):
        engine.submit_request([3] * 30, 3)
    with pytest.raises(ValueError):
        engine.submit_request([VOCAB], 1)  # out of vocabulary


def test_bad_options_raise_value_error(model_dir, tmp_path):
    with pytest.raises(ValueError):
        load_hf_model(model_dir, dtype="float64")
    with pytest.raises(ValueError):
        load_hf_model(model_dir, max_cache_len=1)
    with pytest.raises(ValueError):
        load_hf_model(str(tmp_path / "missing"))


def test_eos_stops_like_generate(model_dir, reference):
    """The model's EOS (config + extra generation-config ids) is the default stop token."""
    prompts = random_prompts(6, seed=11)
    free_run = [generate_alone(reference, p, 12) for p in prompts]
    eos = [free_run[0][4], free_run[1][2]]  # tokens that do come up
    model = load_hf_model(model_dir)
    model.model.generation_config.eos_token_id = eos
    model.eos_token_ids = tuple(eos)
    engine = BatchInferenceEngine(model, batch_size=3, stop_token="model")
    handles = [engine.submit_request(p, 12) for p in prompts]
    engine.run()
    stopped = 0
    for p, h in zip(prompts, handles):
        want = generate_alone(reference, p, 12, eos=eos)
        got = h.result(timeout=0)[len(p):]
        assert got == want
        if got[-1] in eos:
            stopped += 1
            assert h.finish_reason == FinishReason.STOP
    assert stopped >= 2


def test_eos_ids_read_from_generation_config(tmp_path):
    model = tiny_llama(vocab_size=VOCAB)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = [2, 7, 9]
    model.save_pretrained(tmp_path)
    assert load_hf_model(str(tmp_path)).eos_token_ids == (2, 7, 9)


def _sample_run(model_dir, prompts, batch_size, params, resume=None):
    engine = BatchInferenceEngine(load_hf_model(model_dir), batch_size=batch_size)
    handles = [
        engine.submit_request(p, 10, resume_tokens=(resume or {}).get(i, ()), **params[i])
        for i, p in enumerate(prompts)
    ]
    engine.run()
    return [h.result(timeout=0)[len(p):] for p, h in zip(prompts, handles)]


def test_seeded_sampling_is_batch_invariant_and_resumable(model_dir):
    prompts = random_prompts(5, seed=21)
    params = [dict(temperature=1.5, top_p=0.95, top_k=50, seed=100 + i) for i in range(5)]
    batched = _sample_run(model_dir, prompts, 5, params)
    alone = [_sample_run(model_dir, [p], 1, [params[i]])[0] for i, p in enumerate(prompts)]
    assert batched == alone
    # a migrated request continues the same random stream
    resumed = _sample_run(model_dir, prompts[:2], 2, params[:2], resume={0: batched[0][:4], 1: batched[1][:7]})
    assert resumed == batched[:2]
    # the seed matters
    other = _sample_run(model_dir, prompts, 5, [dict(p, seed=p["seed"] + 1000) for p in params])
    assert other != batched


def test_sampling_filters(model_dir, reference):
    prompt = random_prompts(1, seed=5)[0]
    greedy = generate_alone(reference, prompt, 10)
    hot = dict(temperature=2.0, seed=3)
    assert _sample_run(model_dir, [prompt], 1, [dict(hot, top_k=1)])[0] == greedy
    assert _sample_run(model_dir, [prompt], 1, [dict(hot, top_p=1e-6)])[0] == greedy
    assert _sample_run(model_dir, [prompt], 1, [hot])[0] != greedy


def test_sampler_positions_give_distinct_streams():
    from worker.models.sampling import Sampler, mix_seed

    assert len({mix_seed(s, p) for s in range(20) for p in range(50)}) == 1000
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(temperature=1.0, seed=9)] * 2
    a = Sampler().pick(logits, params, [5, 6])
    b = Sampler().pick(logits, params, [5, 6])
    assert a == b and a[0] != a[1]
