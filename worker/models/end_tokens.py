"""A GGUF model's end-of-generation tokens: the stop tokens of every request to it, as llama.cpp's.

A GGUF file declares one EOS (``tokenizer.ggml.eos_token_id``), while a model may end its text
with other tokens too: Qwen2.5 writes ``<|im_end|>`` (151645, the file's EOS) at the end of a turn
and ``<|endoftext|>`` (151643) at the end of a document, and its Hugging Face
``generation_config.json`` lists both; a GGUF file has no generation config. llama.cpp ends a
generation at every end-of-generation token of the vocabulary (``llama_vocab::impl::load`` in
``src/llama-vocab.cpp``: "maintain a list of tokens that cause end-of-generation"), read in its
source:

- the file's EOS, EOT and EOM ids (``tokenizer.ggml.eos_token_id``, ``eot_token_id``,
  ``eom_token_id``);
- its FIM pad, repository and file-separator tokens: the metadata's ids
  (``tokenizer.ggml.fim_pad_token_id``, ``fim_rep_token_id``, ``fim_sep_token_id``), else the
  tokens of :data:`FIM_PAD_TEXTS`, :data:`FIM_REP_TEXTS`, :data:`FIM_SEP_TEXTS` (llama.cpp takes
  the first it meets, in no set order; all of them here);
- every token whose text is one of :data:`END_TEXTS`;
- less ``<|end|>`` beside ``<|call|>`` or ``<|calls|>`` and ``<|return|>`` or ``<|flush|>``
  (harmony's and Solar Open's vocabularies, where it ends a message, not the generation), and
  ``</s>`` beside ``<|tool_response>`` or ``<|plamo:eos|>`` (Gemma 4's and PLaMo's, where it is
  text), as llama.cpp takes them out again, a declared id included.

:func:`gguf_end_ids` gives that set; the worker's default stop tokens for a GGUF file are those
(with the tokenizer's EOS), so a request ends where llama-server ends it, whichever loader read
the file (:func:`worker.models.checkpoint.read_gguf`, or transformers' for another architecture).
A model folder keeps its own ``generation_config.json``'s EOS ids, transformers' reference.

One departure: the texts name *special* tokens only. llama.cpp also takes an ordinary vocabulary
entry spelled so, and makes it a control token ("control-looking token ... was not control-type;
this is probably a bug in the model"): Qwen2.5's ``</s>`` (128247) is plain text, the close of
HTML's ``<s>``, which a code model writes; it stays text here (as :mod:`worker.models.fim` counts
markers only as special tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["END_TEXTS", "FIM_PAD_TEXTS", "FIM_REP_TEXTS", "FIM_SEP_TEXTS", "gguf_end_ids"]

END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
"""Texts of tokens that end a generation wherever they are in a vocabulary (llama.cpp's list)."""

FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
"""The texts llama.cpp finds a vocabulary's FIM pad, repository and file-separator tokens by, when the
metadata names none: each ends a generation (a code model writes one where its file ends)."""

_FIM = (("tokenizer.ggml.fim_pad_token_id", FIM_PAD_TEXTS), ("tokenizer.ggml.fim_rep_token_id", FIM_REP_TEXTS),
        ("tokenizer.ggml.fim_sep_token_id", FIM_SEP_TEXTS))
_DECLARED = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_end_ids(metadata: Mapping, special: Mapping[str, int]) -> tuple[int, ...]:
    """The end-of-generation token ids of a GGUF file (see the module's docstring), the declared EOS,
    EOT and EOM first, then the others by id. ``metadata``: the file's
    (:attr:`~worker.models.gguf_header.GGUFTable.metadata`, where ``tokenizer.ggml.tokens`` is the
    vocabulary's length); ``special``: its tokenizer's special tokens, text -> id (``{}`` for a file
    without one: the metadata's ids alone). An id that is no integer in ``[0, vocabulary size)``
    is left out (the worker refuses such a stop token)."""
    size = metadata.get("tokenizer.ggml.tokens")

    def valid(i) -> bool:
        return type(i) is int and 0 <= i and (type(size) is not int or i < size)

    found = [special[t] for t in END_TEXTS if t in special]
    for key, texts in _FIM:  # (the metadata's id, else the tokens of the texts: llama.cpp takes one it meets)
        found += [metadata[key]] if key in metadata else [special[t] for t in texts if t in special]
    ids = dict.fromkeys(i for i in (metadata.get(key) for key in _DECLARED) if valid(i))
    ids.update(dict.fromkeys(sorted({i for i in found if valid(i)})))
    if "<|end|>" in special and _has(special, "<|call|>", "<|calls|>") and _has(special, "<|return|>", "<|flush|>"):
        ids.pop(special["<|end|>"], None)
    if "</s>" in special and _has(special, "<|tool_response>", "<|plamo:eos|>"):
        ids.pop(special["</s>"], None)
    return tuple(ids)


def _has(special: Mapping[str, int], *texts: str) -> bool:
    return any(t in special for t in texts)
