"""Pooled embeddings of a decoder (``load_model(..., pooling=...)``, :mod:`worker.models.embedder`): the
tiny random Llama's last hidden states (transformers' ``model.model``, final norm included), pooled
(last token, or the mean) and normalised, one prompt at a time, equal what the embedder gives for
prompts of different lengths padded into one batch (within 1e-5); and the decoder runner's options refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from protocol.embedding import unpack  # noqa: E402
from worker.models import load_model  # noqa: E402

PROMPTS = [[5, 9, 2, 7, 11, 3], [4], [8, 8, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _alone(reference, prompt: list[int], mode: str) -> np.ndarray:
    with torch.inference_mode():
        hidden = reference.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    v = hidden[-1] if mode == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0).numpy()


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_a_decoder_pools_its_last_hidden_states(model_dir, reference, mode):
    model = load_model(model_dir, pooling=mode, device="cpu")
    assert model.embedding_size == reference.config.hidden_size and model.pooling.normalize
    got = np.array([unpack(v) for v in model.embed(PROMPTS)])
    want = np.array([_alone(reference, p, mode) for p in PROMPTS])
    assert np.abs(got - want).max() <= 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_the_decoder_runners_options_are_refused(model_dir):
    with pytest.raises(ValueError, match="does not take"):
        load_model(model_dir, pooling="last", speculative_tokens=2)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        load_model(model_dir, pooling="last", precision="int8")
