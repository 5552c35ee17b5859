"""A GGUF file's tokenizer, converted by transformers from the metadata once and kept next to the file.

transformers converts a GGUF's vocabulary, merges, special tokens and chat
template into a fast tokenizer (``TokenizersBackend.from_pretrained(gguf_file=...)``,
no tensor read): ~10-18 s for Gemma 3's 262k tokens on 2 cores. The result is
kept as ``<file>.tokenizer-<digest>/`` (``tokenizer.json``, the constructor's
arguments and the chat template), keyed by a hash of the file's header and the
transformers version (:attr:`worker.models.gguf_header.GGUFTable.digest`), and
later loads build the same tokenizer from it in ~1-4 s (tested equal). Best
effort: a folder that cannot be written keeps nothing, an unreadable kept
tokenizer is converted again and rewritten.
"""

from __future__ import annotations

import os
import struct

from worker.models.gguf_header import read_table


def gguf_tokenizer(path: str, digest: str | None = None):
    """The file's tokenizer as transformers converts it from the metadata (``TokenizersBackend``;
    for SmolLM2 the class ``AutoTokenizer`` returns, same settings; tested), or None when the
    file has none.

    The conversion (vocabulary, merges, special tokens, chat template; no tensor) takes ~10 s
    for Gemma 3's 262k tokens, so its result is kept next to the file
    (``<file>.tokenizer-<digest>/``: ``tokenizer.json``, the constructor's arguments and the chat
    template), keyed by the header's :attr:`~worker.models.gguf_header.GGUFTable.digest` (``digest``, read when not
    given); a later load builds the same tokenizer from it (tested). Where the folder cannot be
    written, nothing is kept.
    """
    from transformers import TokenizersBackend

    folder, name = os.path.split(path)
    try:
        cache = f"{path}.tokenizer-{digest or read_table(path).digest}"
    except (OSError, ValueError, KeyError, struct.error):
        cache = None
    if cache is not None and os.path.isfile(os.path.join(cache, _SAVED)):
        cached = _cached_tokenizer(cache)
        if cached is not None:
            return cached
        import shutil

        shutil.rmtree(cache, ignore_errors=True)  # unreadable: converted again and rewritten below
    try:
        tokenizer = TokenizersBackend.from_pretrained(folder or ".", gguf_file=name)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if cache is not None:
        _keep_tokenizer(tokenizer, cache)
    return tokenizer


_SAVED = "slotserve_tokenizer.json"
_NOT_PASSED = ("is_local", "local_files_only", "vocab_file", "added_tokens_decoder", "gguf_file")
"""Constructor arguments that say how the tokenizer was read (or that ``tokenizer.json`` holds): kept in
``init_kwargs`` as they were, not passed again."""


def _keep_tokenizer(tokenizer, cache: str) -> None:
    """Write ``tokenizer`` to ``cache`` (atomically: a temporary folder renamed); nothing on OSError
    or arguments JSON cannot hold."""
    import json
    import shutil
    import tempfile

    init = {k: str(v) if hasattr(v, "content") else v  # an AddedToken as its text, as the GGUF gives it
            for k, v in tokenizer.init_kwargs.items()}
    if init.get("added_tokens_decoder"):
        return  # tokens added past tokenizer.json: not kept (none for GGUF conversions seen)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=os.path.dirname(cache) or ".")
        tokenizer.backend_tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, _SAVED), "w") as f:
            json.dump({"init_kwargs": init, "chat_template": tokenizer.chat_template}, f)
        os.replace(tmp, cache)
    except (OSError, TypeError):  # TypeError: an argument JSON cannot hold; the next load converts again
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _cached_tokenizer(cache: str):
    """The tokenizer :func:`_keep_tokenizer` wrote, or None when it cannot be read. From the file
    (``tokenizer_file``): a ``tokenizer_object`` would be deep-copied, ~5 s for Gemma 3's."""
    import json

    from transformers import TokenizersBackend

    try:
        with open(os.path.join(cache, _SAVED)) as f:
            saved = json.load(f)
        init = saved["init_kwargs"]
        tokenizer = TokenizersBackend(tokenizer_file=os.path.join(cache, "tokenizer.json"),
                                      **{k: v for k, v in init.items() if k not in _NOT_PASSED})
    except Exception:  # noqa: BLE001 -- tokenizers raises a bare Exception for a file it cannot parse
        return None
    tokenizer.chat_template = saved["chat_template"]
    if "local_files_only" in init:  # how this read went, as transformers records it: offline mode forces it
        from huggingface_hub import is_offline_mode

        init["local_files_only"] = is_offline_mode()
    tokenizer.init_kwargs = init  # the record of the converted tokenizer's arguments, as they were
    return tokenizer
