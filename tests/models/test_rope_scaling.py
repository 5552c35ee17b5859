"""RoPE scaling read without the transformers module (worker/models/llama/rope.py), against transformers.

- :func:`~worker.models.llama.rope.rope_inv_freq` gives transformers'
  ``LlamaRotaryEmbedding`` values bit for bit, for default, linear, llama3
  and yarn parameters.
- A tiny random Llama with Llama 3's scaling (``original_max_position_embeddings``
  = 32, so the factors change the forward at test lengths) read by
  :func:`~worker.models.llama.source.from_state_dict`: the runner's logits are
  transformers' ``LlamaForCausalLM``'s, greedy tokens identical.
- The same scaling as llama.cpp keeps it in a GGUF file (the ``rope_freqs``
  tensor, computed as ``convert_hf_to_gguf.py`` does): loaded by
  ``load_model``, the same tokens as transformers' llama3 model with the
  file's weights (transformers' own GGUF reader drops ``rope_freqs`` and runs
  the default RoPE: tested to differ).
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from tests.models.test_gguf_families import HEADS, HIDDEN, write_gguf  # noqa: E402
from tests.support.reference import greedy_generate  # noqa: E402
from tests.support.slot_models import random_prompts, tiny_llama  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.checkpoint import read_gguf  # noqa: E402
from worker.models.llama import LlamaRunner, from_source  # noqa: E402
from worker.models.llama.family import Unsupported  # noqa: E402
from worker.models.llama.rope import default_inv_freq, rope_inv_freq  # noqa: E402
from worker.models.llama.source import from_state_dict  # noqa: E402

pytestmark = pytest.mark.hf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
THETA = 10_000.0


@pytest.mark.parametrize("params,theta,head_dim", [
    ({"rope_type": "default"}, THETA, 16),
    ({"rope_type": "linear", "factor": 4.0}, THETA, 16),
    (LLAMA3, THETA, 16),
    ({**LLAMA3, "original_max_position_embeddings": 8192}, 500_000.0, 128),  # Llama 3.1 8B
    ({**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}, 500_000.0, 64),  # Llama 3.2 1B
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, THETA, 16),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
      "mscale": 1.0, "mscale_all_dim": 0.5}, 1_000_000.0, 128),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5,
      "truncate": False}, THETA, 64),
])
def test_inv_freq_is_transformers_own(params, theta, head_dim):
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=256 * 1024,
                                      rope_parameters={**params, "rope_theta": theta})
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    inv_freq, scaling = rope_inv_freq(config.rope_parameters, config, head_dim)
    assert torch.equal(inv_freq, rope.inv_freq)
    assert scaling == rope.attention_scaling


def test_dynamic_rope_types_are_refused_with_the_reason():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    with pytest.raises(Unsupported, match="RoPE type 'dynamic'"):
        rope_inv_freq({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, config, 16)
    with pytest.raises(ValueError, match="4 RoPE frequency factors for a head of 16"):
        rope_inv_freq({"rope_type": "llama3", "rope_theta": THETA, "freq_factors": [1.0] * 4}, config, 16)


def _runner_matches(runner, ref, prompts, max_tokens: int = 10) -> None:
    """The runner's greedy tokens are transformers' ``generate``'s, for every prompt, batched."""
    engine = BatchInferenceEngine(runner, batch_size=len(prompts))
    handles = [engine.submit_request(p, max_tokens) for p in prompts]
    engine.run()
    for p, h in zip(prompts, handles):
        assert h.tokens == greedy_generate(ref, p, max_tokens, eos_token_id=None, pad_token_id=0), p


def _logits_match(runner, ref, seq: list[int], steps: int = 6) -> None:
    """Each decode step's fp32 logits against transformers' forward over the whole sequence."""
    runner.bind_slots(1)
    for _ in range(steps):
        logits, _ = runner.forward_batch([SlotInput(0, list(seq))])
        with torch.inference_mode():
            want = ref(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
        seq = seq + [int(want.argmax())]


def test_a_llama3_config_read_without_its_module_runs_as_transformers():
    ref = tiny_llama(rope_scaling=dict(LLAMA3), rope_theta=THETA)
    assert ref.config.rope_parameters["rope_type"] == "llama3"
    source = from_state_dict(ref.config, ref.state_dict())
    assert torch.equal(source.inv_freq, ref.model.rotary_emb.inv_freq)
    assert not torch.equal(source.inv_freq, default_inv_freq(THETA, 16))  # the factors apply at this size
    runner = from_source(source, max_cache_len=128)
    prompts = random_prompts(3, seed=5, max_len=60)
    _logits_match(runner, ref, prompts[0] + prompts[1])  # past original_max_position_embeddings
    _runner_matches(from_source(source, max_cache_len=128), ref, prompts)


def llama_cpp_rope_freqs(theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                         original: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for llama3 parameters (``convert_hf_to_gguf.py``,
    ``LlamaModel.generate_extra_tensors``), same ops."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def test_a_llama3_gguf_with_rope_freqs_runs_as_transformers_llama3(tmp_path):
    path = str(tmp_path / "llama3.gguf")
    head_dim = HIDDEN // HEADS
    write_gguf(path, "llama", rope_freqs=llama_cpp_rope_freqs(THETA, head_dim, 8.0, 1.0, 4.0, 32))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()  # drops rope_freqs
    config = transformers.LlamaConfig.from_dict({**plain.config.to_dict(),
                                                 "rope_parameters": {**LLAMA3, "rope_theta": THETA}})
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.load_state_dict(plain.state_dict())
    ref.generation_config.eos_token_id = None

    source, _ = read_gguf(path)
    assert source.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(source.inv_freq, ref.model.rotary_emb.inv_freq, rtol=2e-7, atol=0)  # 1 ulp
    model = load_model(path, precision="fp32")  # auto would serve the file's Q8_0 tensors as stored (gguf)
    assert isinstance(model, LlamaRunner)
    seq = [int(t) for t in torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))]
    _logits_match(model, ref, seq)
    with torch.inference_mode():  # transformers' own reading of the file runs another model past position 8
        assert not torch.allclose(plain(torch.tensor([seq])).logits, ref(torch.tensor([seq])).logits, atol=1e-3)
    prompts = [[int(t) for t in torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (20, 45, 60)]
    _runner_matches(load_model(path, precision="fp32"), ref, prompts)


def test_linear_scaling_in_a_llama_gguf_is_read(tmp_path, monkeypatch):
    from worker.models import checkpoint

    path = str(tmp_path / "linear.gguf")
    write_gguf(path, "llama")
    real = checkpoint.read_table
    monkeypatch.setattr(checkpoint, "read_table", lambda p: type(real(p))(
        {**real(p).metadata, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        real(p).entries, real(p).blob, real(p).digest))
    source, _ = read_gguf(path)
    assert source.config.rope_parameters == {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}
    assert torch.equal(source.inv_freq, default_inv_freq(THETA, HIDDEN // HEADS) / 4.0)


def test_rope_freqs_elsewhere_or_with_other_scaling_are_refused(tmp_path, monkeypatch):
    from worker.models import checkpoint

    freqs = llama_cpp_rope_freqs(THETA, HIDDEN // HEADS, 8.0, 1.0, 4.0, 32)
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(path, "qwen2", rope_freqs=freqs)
    with pytest.raises(Unsupported, match="rope_freqs.*'qwen2'"):
        read_gguf(path)
    path = str(tmp_path / "llama.gguf")
    write_gguf(path, "llama", rope_freqs=freqs)
    real = checkpoint.read_table
    monkeypatch.setattr(checkpoint, "read_table", lambda p: type(real(p))(
        {**real(p).metadata, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
        real(p).entries, real(p).blob, real(p).digest))
    with pytest.raises(Unsupported, match="rope_freqs.*and RoPE scaling 'linear'"):
        read_gguf(path)
