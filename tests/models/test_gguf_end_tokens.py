"""A GGUF model ends a request at each of its end-of-generation tokens, as llama.cpp does
(worker/models/end_tokens.py), not at the one EOS the file declares.

Before, a GGUF file's default stop tokens were its ``tokenizer.ggml.eos_token_id`` alone:
Qwen2.5-Coder's ``<|im_end|>`` (151645), not its ``<|endoftext|>`` (151643, the second EOS of its
``generation_config.json``, and an end for llama.cpp), so a completion whose model wrote
``<|endoftext|>`` went on to ``max_tokens`` (``/v1/completions`` of a finished ChatML turn:
``'**Created Question**: ...'``, ``finish_reason: length``, where llama-server and transformers stop
with no text). Same for the FIM pad, repository and file-separator tokens, ends for llama.cpp of
every request, and so through transformers' GGUF loader (an architecture the direct reader leaves
to it) and the direct one alike."""

from __future__ import annotations

import pytest

from tests.support.vocab import QWEN, SMOLLM2, kept_tokenizer
from worker.models.end_tokens import gguf_end_ids

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|fim_prefix|>": 151659,
                 "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663,
                 "<|file_sep|>": 151664}


def test_qwen_ends_at_endoftext_and_its_fim_ends_besides_its_declared_eos():
    metadata = {"tokenizer.ggml.eos_token_id": 151645, "tokenizer.ggml.tokens": 151665}
    assert gguf_end_ids(metadata, QWEN_SPECIALS) == (151645, 151643, 151662, 151663, 151664)


@pytest.mark.parametrize("pattern, eos, ends, text", [(QWEN, 151645, (151643, 151662, 151663, 151664), 128247),
                                                      (SMOLLM2, 2, (0, 4), None)], ids=["qwen", "smollm2"])
def test_the_real_vocabularies(pattern, eos, ends, text):
    """The kept tokenizers of the real GGUFs, as the loaders pass them (their special tokens): Qwen's
    <|endoftext|> and FIM pad, repo and file separator; SmolLM2's <|endoftext|> (id 0) and <reponame> (4). Qwen's ``</s>``
    (128247) is an ordinary token, which llama.cpp would make an end: it stays text (HTML's strike-through
    close, which a code model writes)."""
    from worker.models.checkpoint import _special_tokens

    tokenizer = kept_tokenizer(pattern)
    if tokenizer is None:
        pytest.skip("the model's tokenizer is not on disk")
    metadata = {"tokenizer.ggml.eos_token_id": eos, "tokenizer.ggml.tokens": len(tokenizer.get_vocab())}
    got = gguf_end_ids(metadata, _special_tokens(tokenizer))
    assert got == (eos, *sorted(ends)), got
    if text is not None:
        assert tokenizer.get_vocab()["</s>"] == text and text not in got


def test_the_metadata_ids_come_first_and_name_the_fim_tokens():
    """EOT and EOM ids count; a FIM id in the metadata stands for its kind (the texts are not searched)."""
    vocab = {"<|endoftext|>": 0, "<fim_pad>": 5, "<|fim_pad|>": 6, "<reponame>": 9, "x": 10}
    metadata = {"tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 11, "tokenizer.ggml.eom_token_id": 12,
                "tokenizer.ggml.fim_pad_token_id": 7}
    assert gguf_end_ids(metadata, vocab) == (3, 11, 12, 0, 7, 9)
    assert gguf_end_ids({"tokenizer.ggml.eos_token_id": 3}, vocab) == (3, 0, 5, 6, 9)  # every alternative


def test_ids_outside_the_vocabulary_and_no_tokenizer():
    metadata = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 99, "tokenizer.ggml.eom_token_id": -1,
                "tokenizer.ggml.fim_sep_token_id": True, "tokenizer.ggml.tokens": 50}
    assert gguf_end_ids(metadata, {"<|endoftext|>": 70, "<|im_end|>": 4}) == (2, 4)
    assert gguf_end_ids(metadata, {}) == (2,)
    assert gguf_end_ids({}, {}) == ()


@pytest.mark.parametrize("vocab, kept", [
    ({"<|end|>": 1, "<|return|>": 2, "<|call|>": 3}, (2, 3)),  # harmony: <|end|> ends a message
    ({"<|end|>": 1, "<|calls|>": 2, "<|flush|>": 3}, (2, 3)),  # Solar Open
    ({"<|end|>": 1, "<|return|>": 2}, (1, 2)),  # Phi-3's <|end|>: its EOS
    ({"</s>": 1, "<|tool_response>": 2}, (2,)),  # Gemma 4: </s> is text
    ({"</s>": 1}, (1,)),
])
def test_llama_cpp_takes_end_and_s_out_again_beside_their_vocabularies(vocab, kept):
    assert gguf_end_ids({"tokenizer.ggml.eos_token_id": 1}, vocab) == kept


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="module")
def ending_gguf(tmp_path_factory):
    """The tiny Llama GGUF with Qwen's special tokens before its EOS (``<|end|>``) and BOS; its path."""
    from tests.support.tiny_gguf import write_quantized_gguf

    path = str(tmp_path_factory.mktemp("ends") / "tiny-ends.gguf")
    write_quantized_gguf(path, "llama", specials=SPECIALS)
    return path


def _ids(tokenizer) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {t: vocab[t] for t in (*SPECIALS, "<|end|>")}


def test_a_gguf_model_stops_at_each_end_token(ending_gguf):
    """load_model's direct reader: the runner's stop tokens, and a request whose model writes
    <|endoftext|> (a bias makes it) ends there, 'stop' (before: 'length', three of them)."""
    from worker import BatchInferenceEngine
    from worker.models import load_model

    model = load_model(ending_gguf, precision="fp32")
    ids = _ids(model.tokenizer._tok)
    ends = [ids[t] for t in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
    assert model.eos_token_ids == (ids["<|end|>"], *sorted(ends))
    engine = BatchInferenceEngine(model, batch_size=2, stop_token="model")  # (a worker's default)
    handles = {t: engine.submit_request([5, 6, 7], 3, logit_bias={ids[t]: 100.0}, temperature=0.0)
               for t in ("<|endoftext|>", "<|im_start|>")}
    engine.run()
    ended, on = handles["<|endoftext|>"], handles["<|im_start|>"]
    assert (ended.finish_reason.value, ended.tokens) == ("stop", [ids["<|endoftext|>"]])
    assert (on.finish_reason.value, on.tokens) == ("length", [ids["<|im_start|>"]] * 3)


def test_transformers_gguf_loader_ends_at_them_too(ending_gguf):
    """The loader of an architecture the direct reader leaves to transformers: its generation
    config's EOS ids are the same (HF generate, and the runner built from the module, stop there)."""
    from worker.models.checkpoint import load_pretrained

    model, codec = load_pretrained(ending_gguf)
    ids = _ids(codec._tok)
    ends = [ids[t] for t in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
    assert model.generation_config.eos_token_id == [ids["<|end|>"], *sorted(ends)]
