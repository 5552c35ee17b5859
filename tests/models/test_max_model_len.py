"""--max-model-len (ModelOptions.max_model_len): tokens per slot on both runners, its default, the
context as its limit, and the engine's refusal of a longer request (the wire and HTTP paths:
tests/gateway/test_max_model_len.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from protocol.errors import ContextLengthError  # noqa: E402
from tests.support.slot_models import save_tiny_llama, tiny_llama  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import ModelOptions, llama, load_model  # noqa: E402
from worker.models.hf import HFSlotModel  # noqa: E402
from worker.models.options import DEFAULT_MAX_MODEL_LEN  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-256")
    save_tiny_llama(path)  # max_position_embeddings 256
    return str(path)


@pytest.mark.parametrize("bad", [1, 0, -5, "64", 64.0, True])
def test_a_bad_value_is_refused_once(bad):
    with pytest.raises(ValueError, match="max_model_len must be None or an int >= 2"):
        ModelOptions(max_model_len=bad)


def test_the_default_is_the_context_up_to_8192_on_both_runners():
    assert DEFAULT_MAX_MODEL_LEN == 8192
    assert llama.from_hf(tiny_llama()).max_seq_len == 256
    long = tiny_llama(max_position_embeddings=32768)
    assert llama.from_hf(long).max_seq_len == 8192  # not 32k reserved per slot
    assert HFSlotModel(long, None).max_seq_len == 8192
    assert llama.cache_len(long.config, "cuda", None) == 4096  # (CUDA allocates the cache whole)
    assert llama.from_hf(long, max_cache_len=32768).max_seq_len == 32768  # asked for: the whole context


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_each_slot_reserves_max_model_len_tokens(path, runner):
    model = load_model(path, runner=runner, max_model_len=48)
    assert model.max_seq_len == 48
    model.bind_slots(3)
    assert model.kv_cache.max_len == 48
    if runner == "slotserve":
        assert model.kv_cache.nbytes == 3 * model.kv_bytes_per_slot == 3 * 2 * 2 * 2 * 16 * 48 * 4
        assert model.weights.cos.shape[0] == 48


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_past_the_models_context_is_a_value_error(path, runner):
    with pytest.raises(ValueError, match="max_model_len 257 is past the model's context of 256 tokens"):
        load_model(path, runner=runner, max_model_len=257)
    assert load_model(path, runner=runner, max_model_len=256).max_seq_len == 256


def test_the_older_keyword_names_the_same_limit(path):
    assert load_model(path, max_cache_len=40).max_seq_len == 40
    assert load_model(path, max_cache_len=40, max_model_len=40).max_seq_len == 40
    with pytest.raises(ValueError, match="give max_model_len only"):
        load_model(path, max_cache_len=40, max_model_len=48)


def test_the_simulated_model_refuses_it():
    with pytest.raises(ValueError, match="max_model_len"):
        load_model("simulated", max_model_len=64)


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_the_engine_refuses_a_request_over_it_as_over_the_context(path, runner):
    engine = BatchInferenceEngine(load_model(path, runner=runner, max_model_len=32), batch_size=2)
    with pytest.raises(ContextLengthError, match=r"prompt \(20 tokens\) \+ max_tokens \(13\) = 33 exceeds the "
                                                 r"served context of 32 tokens \(--max-model-len\); shorten the prompt or lower max_tokens"):
        engine.submit_request(list(range(2, 22)), 13)
    assert ContextLengthError.code.value == "context_length_exceeded"
    fits = engine.submit_request(list(range(2, 22)), 12)  # exactly 32
    engine.run()
    assert fits.finish_reason == FinishReason.LENGTH and len(fits.tokens) == 12
