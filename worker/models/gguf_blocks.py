"""GGUF block formats unpacked into integer codes, scales and offsets, without dequantising.

:func:`unpack` turns a quantised tensor's stored rows into what
:class:`~worker.models.llama.quantized.QuantizedWeight` holds, for the block
formats the families' usual files use (:data:`FORMATS`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Per group of ``group`` columns the file's
weight is ``fl(scale * code) + offset``:

======  =====  =========================  ======================  ===================
format  group  code                       scale                   offset
======  =====  =========================  ======================  ===================
Q4_0    32     ``q - 8``   (-8..7)        ``d``                   --
Q4_1    32     ``q``       (0..15)        ``d``                   ``m``
Q5_0    32     ``q - 16``  (-16..15)      ``d``                   --
Q5_1    32     ``q``       (0..31)        ``d``                   ``m``
Q8_0    32     ``q``       (-128..127)    ``d``                   --
Q4_K    32     ``q``       (0..15)        ``fl(d * sc)``          ``-fl(dmin * m)``
Q5_K    32     ``q``       (0..31)        ``fl(d * sc)``          ``-fl(dmin * m)``
Q6_K    16     ``q - 32``  (-32..31)      ``fl(d * sc)``          --
======  =====  =========================  ======================  ===================

``d``, ``dmin``, ``m`` (Q4_1/Q5_1) are the block's fp16 fields widened to
fp32; ``sc``, ``m`` of the K formats are the sub-block's 6-bit (Q6_K: signed
8-bit) scale and min. The layouts, the bit order and the order of the fp32
operations are the ``gguf`` package's ``quants.py`` (``dequantize_blocks`` of
each class, llama.cpp's ``ggml-quants.c`` reference), so that
``QuantizedWeight(*unpack(raw, t)).dequantize()`` is ``gguf.dequantize(raw, t)``
bit for bit (tested for every format; ``x - y`` and ``x + (-y)`` round alike,
signed zeros included).

Scales and offsets are kept as the file has them, a
:class:`~worker.models.llama.quantized.GroupScales` each: the fp16 ``d`` (and
``m``) per 32-column block of Q4_0 .. Q8_0; the K formats' fp16 ``d`` and
``-dmin`` per 256-column super-block with the sub-block's ``sc`` and ``m`` as
uint8 (Q6_K: ``sc`` int8) per group. ``fl(d * sc)`` and ``fl(dmin * m)`` are
exact in fp32 (at most 11 + 8 significant bits), so forming them per group when
multiplying gives gguf's numbers, and negating ``dmin`` (fp16, exact) turns
``- fl(dmin * m)`` into ``fl(-dmin * m)``.

Rows are unpacked :data:`CHUNK_CODES` codes at a time, so the temporaries stay
small whatever the tensor's size; the codes are written into one int8 array.

Where the compiled kernel runs (:mod:`worker.models.llama.qkernel`), a file's tensors are read by
:func:`stored_weights` instead: the same formats decoded in C++ (``qkernel.cpp``), straight into
the kernel's blocked layout, 16 rows at a time; :func:`unpack` (numpy) stays the reference and the
path without it.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # the K formats' super-block: 256 columns

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The GGUF types :func:`unpack` reads (``gguf.GGMLQuantizationType`` names)."""

CHUNK_CODES = 1 << 20
"""Codes unpacked at a time: the numpy temporaries of one chunk take a few MiB."""

# format -> (columns per block, bytes per block, columns per group): llama.cpp's GGML_QUANT_SIZES
_SIZES = {"Q4_0": (32, 18, 32), "Q4_1": (32, 20, 32), "Q5_0": (32, 22, 32), "Q5_1": (32, 24, 32),
          "Q8_0": (32, 34, 32), "Q4_K": (256, 144, 32), "Q5_K": (256, 176, 32), "Q6_K": (256, 210, 16)}

CODE_RANGE = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q8_0": (-128, 127),
              "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
"""Each format's ``(lowest, highest)`` code."""


# format -> bytes of scales and offsets per block as held (GroupScales): fp16 d (m, dmin), (u)int8 sc (m) per group
_FACTOR_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2, "Q4_K": 4 + 16, "Q5_K": 4 + 16, "Q6_K": 2 + 16}


def held_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes a ``[rows, cols]`` tensor of ``fmt`` takes as a
    :class:`~worker.models.llama.quantized.QuantizedWeight`: its codes (two a byte where the
    format's codes span 16 values or fewer: Q4_0, Q4_1, Q4_K; one a byte otherwise -- an upper
    bound, a tensor whose codes happen to span fewer is packed tighter) and its scales and offsets
    as the file holds them (fp16 per block or super-block, a byte per sub-block scale or min).
    For memory estimates (``slotserve.sizing``)."""
    block = _SIZES[fmt][0]
    lo, hi = CODE_RANGE[fmt]
    codes = rows * cols // 2 if hi - lo < 16 else rows * cols
    return codes + rows * (cols // block) * _FACTOR_BYTES[fmt]


def unpack(raw: np.ndarray, qtype) -> tuple:
    """``(codes, scales, offsets, group)`` of a quantised tensor's stored rows.

    ``raw``: uint8 ``[rows, row_bytes]`` (a view of the memory-mapped file is
    read, not copied); ``qtype``: a ``gguf.GGMLQuantizationType`` or its name.
    Returns ``codes`` (a torch int8 ``[rows, K]``), ``scales`` and ``offsets``
    (:class:`~worker.models.llama.quantized.GroupScales` of ``K // group``
    groups a row; offsets None for a format without) and ``group`` (columns per
    scale), as :class:`~worker.models.llama.quantized.QuantizedWeight` takes
    them (see the module docstring for each format's meaning).

    Raises ValueError for a format not in :data:`FORMATS` or a row length
    that is not whole blocks.
    """
    import torch

    from worker.models.llama.quantized import GroupScales

    fmt, (block, size, group) = _checked(raw, qtype)
    rows, k = raw.shape[0], raw.shape[1] // size * block
    per_row = k // block  # blocks a row
    codes = np.empty((rows, k), dtype=np.int8)
    factors = None  # [scale d, scale q, offset d, offset q]: [rows, per_row * (per block)] each, or None
    step = max(1, CHUNK_CODES // max(k, 1))
    for start in range(0, rows, step):
        end = min(rows, start + step)
        blocks = np.ascontiguousarray(raw[start:end]).reshape(-1, size)
        q, *parts = _UNPACK[fmt](blocks)
        codes[start:end] = q.reshape(end - start, k)
        if factors is None:
            factors = [None if p is None else np.empty((rows, per_row * p.shape[1]), dtype=p.dtype) for p in parts]
        for out, p in zip(factors, parts):
            if p is not None:
                out[start:end] = p.reshape(end - start, -1)
    if factors is None:  # no rows
        return torch.from_numpy(codes), GroupScales(torch.zeros(0, k // group, dtype=torch.float16)), None, group
    t = [None if f is None else torch.from_numpy(f) for f in factors]
    sub = block // group if t[1] is not None else 1  # groups per d: a super-block's, or one
    scales = GroupScales(t[0], t[1], sub)
    offsets = None if t[2] is None else GroupScales(t[2], t[3], block // group if t[3] is not None else 1)
    return torch.from_numpy(codes), scales, offsets, group


def stored_weight(raw: np.ndarray, qtype):
    """A quantised tensor's stored rows (as :func:`unpack` takes them) as a
    :class:`~worker.models.llama.quantized.QuantizedWeight`: :func:`stored_weights` of one."""
    return stored_weights([raw], qtype)[0]


def stored_weights(raws: list[np.ndarray], qtype) -> list:
    """Quantised tensors' stored rows (each as :func:`unpack` takes them) of one format as
    :class:`~worker.models.llama.quantized.QuantizedWeight` each.

    Where the compiled kernel runs here (:func:`worker.models.llama.qkernel.load`), read straight
    into its blocked layout, prepared (``qkernel.cpp``'s ``unpack_blocked``: one pass over the
    bytes, 16 rows at a time; no row-major codes, no numpy temporaries): the same tensors, bit for
    bit, as ``QuantizedWeight(*unpack(raw)).prepare()`` (tested per format). Tensors of one width
    (q/k/v, gate/up: what the runner fuses), every one but the last of whole 16-row blocks, are
    read as one: each weight's tensors are slices of shared ones, so fusing them
    (``QuantizedWeight.cat``) takes a view, not a copy of the layer. The codes' kind and ``low``
    are those of the format's whole range first (:data:`CODE_RANGE`); a tensor whose codes span
    less (a Q4_K tensor without a 0, a Q8_0 one within [-64, 63]), in a way that changes their
    layout, is read again alone. Elsewhere ``QuantizedWeight(*unpack(raw))``, row-major (numpy).
    Raises ValueError as :func:`unpack`.

    Measured on Qwen2.5-Coder-1.5B Q4_K_M's 198 tensors (1.11 GB; 2-core Xeon with AMX, load ~1):
    0.23 s on 2 threads, 0.40 s on 1, where numpy's unpack then ``prepare()`` took ~3.8 s.
    """
    from worker.models.llama import qkernel
    from worker.models.llama.quantized import QuantizedWeight

    fmt, (block, size, group) = _checked(raws[0], qtype)
    for raw in raws[1:]:
        _checked(raw, fmt)
    module = qkernel.load()
    if module is None or not all(len(raw) for raw in raws):
        return [QuantizedWeight(*unpack(raw, fmt), fmt) for raw in raws]
    if len({raw.shape[1] for raw in raws}) > 1 or any(len(raw) % qkernel.BLOCK for raw in raws[:-1]):
        return [w for raw in raws for w in stored_weights([raw], fmt)]  # not one tensor: each alone
    k = raws[0].shape[1] // size * block
    six, quad = qkernel.six_bits(), qkernel.quad_layout()  # (MAGIC holds u = code - low in the quad layout)

    def read(parts: list[np.ndarray], low: int, high: int) -> tuple[list, list]:
        """``(weights, fits)``: ``parts`` read for the codes' kind of ``low .. high``; ``fits[i]``:
        part ``i``'s own codes give that kind (and ``low`` where the layout holds ``code - low``)."""
        kind = qkernel.code_kind(k % 2 == 0 and high - low < 16, low, high, k, group, six)
        *tensors, ranges = module.unpack_blocked(parts, FORMATS.index(fmt), kind, low)
        weights, fits, start = [], [], 0
        for part, (lo, hi) in zip(parts, ranges):
            end = start + -(-len(part) // qkernel.BLOCK)
            weights.append(_blocked_weight([t[start:end] if t.numel() else t for t in tensors], fmt, block, group,
                                           (len(part), k), lo, hi, six))
            holds_codes = kind == qkernel.WIDE or (kind == qkernel.MAGIC and not quad)  # (the others: code - low)
            fits.append(qkernel.code_kind(k % 2 == 0 and hi - lo < 16, lo, hi, k, group, six) == kind
                        and (holds_codes or lo == low))
            start = end
        return weights, fits

    weights, fits = read(raws, *CODE_RANGE[fmt])
    return [w if fit else read([raw], w.low, w.high)[0][0] for raw, w, fit in zip(raws, weights, fits)]


def _blocked_weight(tensors: list, fmt: str, block: int, group: int, shape: tuple, low: int, high: int, six: bool):
    """A prepared QuantizedWeight of ``unpack_blocked``'s ``(packed, sd, sq, od, oq)`` (empty: absent),
    its codes laid out for ``code_kind(..., six)``."""
    from worker.models.llama.quantized import GroupScales, QuantizedWeight

    packed, sd, sq, od, oq = tensors
    sub = block // group  # groups per d where a sub-block factor q goes with it (K formats), else 1
    scales = GroupScales(sd, sq if sq.numel() else None, sub if sq.numel() else 1)
    offsets = None if not od.numel() else GroupScales(od, oq if oq.numel() else None, sub if oq.numel() else 1)
    return QuantizedWeight.from_blocked(packed, scales, offsets, shape, group, fmt, low, high, six)


def _checked(raw: np.ndarray, qtype) -> tuple[str, tuple[int, int, int]]:
    """``(format name, (columns per block, bytes per block, columns per group))`` of ``qtype`` (a
    ``gguf.GGMLQuantizationType`` or its name); ValueError for a format not in :data:`FORMATS` or
    ``raw`` not uint8 rows of whole blocks."""
    fmt = getattr(qtype, "name", qtype)
    if fmt not in _SIZES:
        raise ValueError(f"GGUF type {fmt} is not one slotserve reads quantised; it reads {', '.join(FORMATS)}")
    size = _SIZES[fmt][1]
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % size:
        raise ValueError(f"{fmt}: rows of whole {size}-byte blocks expected, got {raw.dtype} {raw.shape}")
    return fmt, _SIZES[fmt]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (``[n, 2]``) as the fp16 value, ``[n, 1]``."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """``[n, c * 2 * width]``: per run of ``width`` bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the 32-bit field ``qh`` (``[n, 4]`` bytes, little-endian) as bit ``i`` per column ``i``."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


# Each returns (codes [n, block], scale d, scale q, offset d, offset q), per block [n, *] (None: absent)

def _q4_0(b):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - np.int8(8), _f16(b[:, :2]), None, None, None


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).astype(np.int8), _f16(b[:, :2]), None, _f16(b[:, 2:4]), None


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6]) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None, None, None


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _f16(b[:, :2]), None, _f16(b[:, 2:4]), None


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, None, None


def _k_factors(b):
    """Q4_K/Q5_K: ``(d, sc, -dmin, m)``: the super-block's fp16 ``d`` and ``-dmin`` ``[n, 1]``, the
    sub-blocks' 6-bit ``sc`` and ``m`` as uint8 ``[n, 8]``."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]), sc, -_f16(b[:, 2:4]), m


def _q4_k(b):
    return (_nibbles(b[:, 16:], 32).astype(np.int8), *_k_factors(b))


def _q5_k(b):
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    q = _nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(n, -1) << np.uint8(4))
    return (q.astype(np.int8), *_k_factors(b))


def _q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64)  # per half of 128 columns: 64 low nibbles, then 64 high ones
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ql | ((qh & np.uint8(3)).reshape(n, -1) << np.uint8(4))
    return q.astype(np.int8) - np.int8(32), _f16(b[:, 208:210]), b[:, 192:208].view(np.int8), None, None


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
           "Q5_K": _q5_k, "Q6_K": _q6_k}
