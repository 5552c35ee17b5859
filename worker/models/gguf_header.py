"""A GGUF file's header (metadata and tensor table), read without converting anything.

What both :func:`worker.models.checkpoint.read_gguf` (the config and the
tensors) and :func:`worker.models.gguf_tokenizer.gguf_tokenizer` (the
tokenizer, kept under :attr:`GGUFTable.digest`) start from.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFTable:
    """A GGUF file's header: ``metadata`` (string arrays as their lengths), ``entries``
    ``[(name, shape in torch order, ggml type, byte offset in the file)]``, ``blob`` (the file,
    memory-mapped as uint8) and ``digest``: 16 hex digits of a hash of the header bytes (metadata
    and tensor table: all a config or tokenizer is read from) and the transformers version."""

    metadata: dict
    entries: list
    blob: object
    digest: str

    @property
    def names(self) -> tuple:
        return tuple(name for name, *_ in self.entries)


def read_table(path: str) -> GGUFTable:
    """The file's :class:`GGUFTable`, from transformers' own GGUF header reader
    (``integrations.gguf.reader``; the vocabulary's strings skipped, not decoded: ~1 s for Gemma
    3's 262k tokens where ``gguf.GGUFReader`` takes ~15 s building a view per element). Raises
    ValueError or OSError for a file that is not GGUF."""
    import transformers
    from transformers.integrations.gguf import reader

    blob = reader._mapped(path)
    metadata, count, pos = reader._read_metadata(blob, path)
    entries, end = reader._read_tensor_table(blob, count, pos)
    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default
    start = (end + alignment - 1) // alignment * alignment
    digest = hashlib.blake2b(transformers.__version__.encode(), digest_size=8)
    digest.update(memoryview(blob[:end]))
    return GGUFTable(metadata, [(n, shape, t, start + off) for n, shape, t, off in entries], blob, digest.hexdigest())
