"""A GGUF file's metadata keys, required or optional, as llama.cpp's loader decides per key.

transformers' GGUF config mapping leaves a key the file lacks to the family's config class, whose
defaults are some other model's: a Qwen2 file without ``qwen2.attention.head_count`` loaded as a
32-head model (``Qwen2Config``'s), and a Llama file without ``llama.rope.freq_base`` was refused
where llama.cpp takes 10000. Now (:mod:`worker.models.gguf_hparams`) a key llama.cpp requires is a
:class:`~worker.errors.ModelFileError` naming it and the file, and an optional one takes
llama.cpp's default, for every family :func:`~worker.models.checkpoint.read_gguf` reads. Each file
is the tiny one of ``tests/models/test_gguf_families.py`` with keys left out.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.models.test_gguf_families import ARCHS, HEADS, HIDDEN, LAYERS, write_gguf  # noqa: E402
from worker.errors import ModelFileError  # noqa: E402
from worker.models.checkpoint import read_gguf  # noqa: E402
from worker.models.gguf_hparams import REQUIRED  # noqa: E402
from worker.models.llama.family import Unsupported  # noqa: E402

pytestmark = pytest.mark.hf


def _written(tmp_path, arch: str, *drop: str, **kw) -> str:
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch, drop=tuple(f"{arch}.{key}" for key in drop), **kw)
    return path


@pytest.mark.parametrize("key", list(REQUIRED))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_required_key_missing_is_a_file_fault_naming_it(tmp_path, arch, key):
    # (before: block_count missing sent the file to transformers' loader; head_count, feed_forward_length,
    # context_length and the RMSNorm epsilon took the config class's defaults, Llama's raised for some)
    path = _written(tmp_path, arch, key)
    with pytest.raises(ModelFileError) as raised:
        read_gguf(path)
    assert f"{arch}.{key}" in str(raised.value) and path in str(raised.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_required_key_that_is_no_positive_number_is_a_file_fault(tmp_path, arch, monkeypatch):
    import dataclasses

    from worker.models import checkpoint

    path = _written(tmp_path, arch)
    real = checkpoint.read_table
    monkeypatch.setattr(checkpoint, "read_table", lambda p: dataclasses.replace(
        real(p), metadata={**real(p).metadata, f"{arch}.attention.head_count": 0}))
    with pytest.raises(ModelFileError, match=f"{arch}.attention.head_count.* is 0"):
        read_gguf(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_without_head_count_kv_the_heads_are_all_kv_heads(tmp_path, arch):
    # llama.cpp: n_head_kv defaults to n_head (Qwen2Config's and Qwen3Config's default is 32, Gemma's 4)
    path = _written(tmp_path, arch, "attention.head_count_kv", kv_heads=HEADS)
    assert read_gguf(path)[0].config.num_key_value_heads == HEADS


def _rope_bases(config) -> set:
    params = config.rope_parameters
    nested = isinstance(params.get("full_attention"), dict)
    return {p["rope_theta"] for p in ([params["full_attention"], params["sliding_attention"]] if nested
                                      else [params])}


@pytest.mark.parametrize("arch", ARCHS)
def test_without_rope_freq_base_the_base_is_10000(tmp_path, arch):
    # llama.cpp: rope_freq_base_train = 10000 (Llama's was refused, Gemma 3's global layers ran 1,000,000)
    path = _written(tmp_path, arch, "rope.freq_base")
    assert _rope_bases(read_gguf(path)[0].config) == {10000.0}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_without_key_length_the_head_size_is_the_width_over_the_heads(tmp_path, arch):
    # llama.cpp: n_embd_head_k = n_embd / n_head (Gemma's config classes say 256: refused before)
    path = _written(tmp_path, arch, "attention.key_length", "attention.value_length")
    assert read_gguf(path)[0].config.head_dim == HIDDEN // HEADS


def test_a_qwen3_file_whose_heads_are_wider_than_that_without_key_length_is_refused(tmp_path):
    # llama.cpp reads 64 / 4 = 16-wide heads and refuses the 128-wide tensors; before, Qwen3Config's
    # head_dim (128) happened to fit them and the file loaded
    path = _written(tmp_path, "qwen3", "attention.key_length")
    with pytest.raises(Unsupported, match="heads are 128 wide, but its metadata gives head size 16"):
        read_gguf(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_without_vocab_size_it_is_the_tokenizers(tmp_path, arch):
    # llama.cpp: the tokenizer.ggml.tokens count (the file's 268 tokens; the embedding has as many rows)
    path = _written(tmp_path, arch, "vocab_size")
    source, _ = read_gguf(path)
    assert source.config.vocab_size == source.embed.shape[0] == 268


def test_without_gemma2s_window_it_is_4096(tmp_path):
    path = _written(tmp_path, "gemma2", "attention.sliding_window")
    assert read_gguf(path)[0].config.sliding_window == 4096


def test_without_gemma3s_window_every_layer_is_global(tmp_path):
    # llama.cpp: no sliding_window, no SWA (before: Gemma3TextConfig's 4096 and its 5:1 pattern)
    from worker.models.llama.family import describe

    path = _written(tmp_path, "gemma3", "attention.sliding_window")
    config = read_gguf(path)[0].config
    family = describe(config, 8192)
    assert family.windows == (None,) * LAYERS and family.local_rope == (False,) * LAYERS


def test_a_llama_file_without_its_rope_base_serves(tmp_path):
    """The reported member end to end: loaded and run (refused before: a KeyError made a ModelFileError)."""
    from worker.models import load_model
    from worker.models.base import SlotInput

    model = load_model(_written(tmp_path, "llama", "rope.freq_base"), precision="fp32")
    model.bind_slots(1)
    logits, _ = model.forward_batch([SlotInput(0, [1, 2, 3])])
    assert logits.shape[0] == 1 and bool(logits.isfinite().all())
