"""Embedding vectors as they travel and as callers shape them (stdlib only).

On the wire an embedding is little-endian float32 bytes (:class:`~protocol.messages.EmbeddingVector`):
4 bytes a value, what OpenAI's ``encoding_format: "base64"`` encodes (its Python SDK decodes
base64 with ``numpy.frombuffer(..., dtype="float32")``, little-endian on every platform it runs on).
These helpers are shared by the client SDK, the HTTP gateway and the worker:

- :func:`pack` / :func:`unpack`: floats <-> those bytes;
- :func:`truncate`: OpenAI's ``dimensions`` for a Matryoshka model: the first ``n`` values,
  renormalised to unit length (as OpenAI's text-embedding-3 and vLLM do);
- :func:`cosine`: the cosine similarity of two vectors (a bi-encoder's relevance score).
"""

from __future__ import annotations

import math
import sys
from array import array
from typing import Iterable, Sequence

from protocol.validation import echo

_SWAP = sys.byteorder == "big"  # array("f") packs in the machine's order; the wire's is little-endian


def pack(values: Iterable[float]) -> bytes:
    """``values`` as little-endian float32 bytes (4 bytes each; rounded to float32)."""
    a = array("f", values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes) -> list[float]:
    """Little-endian float32 bytes as Python floats. ValueError when ``len(data)`` is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"an embedding is float32 values, 4 bytes each; got {len(data)} bytes")
    a = array("f")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def truncate(values: Sequence[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` values, scaled to unit L2 norm (Matryoshka representation learning,
    Kusupati et al. 2022: a prefix of the embedding is an embedding; OpenAI's ``dimensions``).
    A zero prefix stays zero. ValueError unless 1 <= ``dimensions`` <= ``len(values)``."""
    if not 1 <= dimensions <= len(values):
        raise ValueError(f"dimensions must be in [1, {len(values)}], got {echo(dimensions)}")
    head = [float(v) for v in values[:dimensions]]
    norm = math.sqrt(math.fsum(v * v for v in head))
    return head if norm == 0.0 else [v / norm for v in head]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of ``a`` and ``b`` in [-1, 1] (0.0 when either is zero). ValueError for lengths that differ."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values cannot be compared")
    dot = math.fsum(x * y for x, y in zip(a, b))
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    return 0.0 if na == 0.0 or nb == 0.0 else dot / (na * nb)
