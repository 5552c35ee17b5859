"""bench/model.py's --model and bench/gpu.py's shapes (issue 24): what the HE32 and random-weight
runs are built from, checked without running them (the runs themselves are benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("psutil")

pytestmark = pytest.mark.hf

from bench import gpu  # noqa: E402
from bench import model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_results_file_per_model():
    assert model.results_stem("smollm2-135m") == "model"  # the SmolLM2 results keep their name
    assert model.results_stem("gemma3-270m") == "model_gemma3-270m"
    assert model.results_stem("/x/y/gemma-3-270m-q4_k_m.gguf") == "model_gemma-3-270m-q4_k_m"
    assert model.results_stem("/tmp/my model/") == "model_my_model"


class _Tok:
    unk_token_id = 3
    vocab = {"<eos>": 1, "<end_of_turn>": 106}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)


class _Codec:
    _tok = _Tok()


def test_gemma_stops_at_end_of_turn_besides_eos(monkeypatch):
    assert model.stop_ids("gemma3_text", (1,), _Codec()) == {1, 106}
    assert model.stop_ids("gemma2", [1], _Codec()) == {1, 106}
    assert model.stop_ids("llama", (2, 0), _Codec()) == {0, 2}  # no extra stops
    monkeypatch.setitem(model.EXTRA_STOPS, "gemma3_text", ("<end_of_turn>", "<nope>"))
    with pytest.raises(ValueError, match="<nope>"):
        model.stop_ids("gemma3_text", (1,), _Codec())


def test_shapes_are_their_families_configs():
    qwen = gpu.shape_config("qwen2.5-0.5b", tiny=False)
    assert type(qwen).__name__ == "Qwen2Config"
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.intermediate_size, qwen.vocab_size, qwen.tie_word_embeddings) == (896, 24, 14, 2, 4864, 151936, True)
    gemma = gpu.shape_config("gemma-2-2b", tiny=False)
    assert type(gemma).__name__ == "Gemma2Config"
    assert (gemma.hidden_size, gemma.num_hidden_layers, gemma.head_dim, gemma.num_key_value_heads,
            gemma.vocab_size, gemma.final_logit_softcapping, gemma.attn_logit_softcapping,
            gemma.query_pre_attn_scalar) == (2304, 26, 256, 4, 256000, 30.0, 50.0, 256)
    tiny = gpu.shape_config("gemma-2-2b", tiny=True)
    assert (tiny.hidden_size, tiny.head_dim, tiny.vocab_size) == (64, 16, 1024)
    assert type(gpu.shape_config("smollm2-135m", tiny=False)).__name__ == "LlamaConfig"


def test_cases_per_device_and_shape():
    new = {"qwen2.5-0.5b", "gemma-2-2b"}
    cpu = gpu.cases_for("cpu", sorted(new))
    cuda = gpu.cases_for("cuda", sorted(new))
    assert {c.workload for c in cpu} == {"he8"} and {c.shape for c in cpu} == new  # a 2B on 2 cores: 8 prompts
    assert {c.workload for c in cuda} == {"mix256"} and {c.shape for c in cuda} == new
    assert {c.slots for c in cuda} == {64}
    assert set(gpu.cases_for("cpu", tiny=True)) == set(gpu.CASES)  # --tiny checks the plumbing of every case
    assert {c.shape for c in gpu.cases_for("cuda")} == set(gpu.SHAPES)
    with pytest.raises(ValueError, match="gemma-9"):
        gpu.cases_for("cpu", ["gemma-9"])


def test_shapes_and_tiny_need_random_weights():
    done = subprocess.run([sys.executable, "-m", "bench.model", "--shapes", "gemma-2-2b"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                              "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert "--random-weights only" in done.stderr
