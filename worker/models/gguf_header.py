"""A GGUF file's header (metadata and tensor table), read without converting anything.

What both :func:`worker.models.checkpoint.read_gguf` (the config and the
tensors) and :func:`worker.models.gguf_tokenizer.gguf_tokenizer` (the
tokenizer, kept under :attr:`GGUFTable.digest`) start from.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from worker.errors import ModelFileError


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
    OSError for a file it cannot open, and :class:`~worker.errors.ModelFileError` for one that is
    no GGUF file it reads (empty, another format or GGUF version, no ``general.architecture``, a
    metadata type it does not know: transformers' reader's words) or that is cut short or corrupt
    (naming the place: :func:`_header_error`, :func:`_check_tensor_data`)."""
    import transformers
    from transformers.integrations.gguf import reader

    try:
        blob = reader._mapped(path)
    except ValueError as exc:  # (numpy's for an empty file)
        raise ModelFileError(f"the file cannot be mapped: {exc}") from None
    try:
        metadata, count, pos = reader._read_metadata(blob, path)
        entries, end = reader._read_tensor_table(blob, count, pos)
    except (struct.error, IndexError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        raise _header_error(len(blob), exc) from None
    except ValueError as exc:  # the reader's own checks (magic, version, architecture, value types)
        raise ModelFileError(str(exc)) from None
    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelFileError(f"the file is corrupt: its general.alignment is {alignment!r}, not a positive integer")
    start = (end + alignment - 1) // alignment * alignment
    _check_tensor_data(len(blob), [(n, shape, t, start + off) for n, shape, t, off in entries])
    digest = hashlib.blake2b(transformers.__version__.encode(), digest_size=8)
    digest.update(memoryview(blob[:end]))
    return GGUFTable(metadata, [(n, shape, t, start + off) for n, shape, t, off in entries], blob, digest.hexdigest())


def _header_error(size: int, exc: BaseException) -> ModelFileError:
    """What a header read that failed says: cut short where it reads past the file's end (the
    header's own structure -- counts, string lengths, dimensions -- runs past ``size`` bytes:
    ``struct.error``, or a count too large to hold), else corrupt (a string that is not UTF-8)."""
    if isinstance(exc, UnicodeDecodeError):
        return ModelFileError(f"the file is corrupt: a string in its header is not UTF-8 (at byte {exc.start} of it)")
    return ModelFileError(f"the file is cut short or corrupt: its header (metadata and tensor table) runs past the "
                          f"file's end ({size:,} bytes); a download or copy that did not finish leaves this")


def _check_tensor_data(size: int, entries: list) -> None:
    """ModelFileError for the first tensor whose data runs past the file's ``size`` bytes (a file cut short
    in its tensor data: the header whole, the weights not), or whose type or shape no GGUF has. Its
    bytes: ``gguf.GGML_QUANT_SIZES`` (columns and bytes per block) times the blocks of its shape.
    Without the ``gguf`` package nothing is checked here (each weight's read checks what it reads)."""
    try:
        import gguf
    except ImportError:
        return
    for name, shape, ggml_type, start in entries:
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ModelFileError(f"the file is corrupt: tensor {name!r} has ggml type {ggml_type}, which no GGUF "
                                 "reader here knows") from None
        count = math.prod(shape)
        if count % block:
            raise ModelFileError(f"the file is corrupt: tensor {name!r} of shape {list(shape)} is not whole blocks of "
                                 f"{block} values")
        end = start + count // block * block_bytes
        if end > size:
            raise ModelFileError(f"the file is cut short: tensor {name!r} ends at byte {end:,}, past the file's "
                                 f"{size:,} bytes; a download or copy that did not finish leaves this")
