"""Linear layers on GGUF block-quantised weights as the file stores them.

Every GGUF block format the families' usual files use (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) dequantises, per group of ``group`` input
columns (16 for Q6_K, 32 for the rest), as

    ``W[n, k] = fl(scale[n, g] * code[n, k]) + offset[n, g]``   (``g = k // group``)

with a small integer ``code`` (the file's ``q`` minus the format's fixed zero:
8 for Q4_0, 16 for Q5_0, 32 for Q6_K), ``scale`` the block's fp16 ``d``
(times the sub-block's 6- or 8-bit scale for the K formats, a product fp32
holds exactly) and ``offset`` Q4_1/Q5_1's ``m`` or the K formats'
``-dmin * m`` (None where the format has none). In that order of fp32
operations it is, bit for bit, what ``gguf.dequantize`` (and transformers)
give: the file's weight. :class:`QuantizedWeight` keeps exactly these codes
and scales: codes that fit in 4 bits two to a byte, others one int8 each,
scales and offsets fp32 -- never the dequantised matrix.

Products: ``x [M, K] @ W.T`` by the compiled kernel of
:mod:`worker.models.llama.qkernel` where it is built for this CPU (it reads
the codes and scales as stored; the activations are rounded to bf16, the
products and sums are fp32), else, and above ``kernel_rows`` rows (a
prefill), on the dequantised weight in fp32 (``F.linear``), one layer at a
time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class QuantizedWeight:
    """A ``[N, K]`` weight held as integer codes with a scale (and an offset) per group of columns.

    ``codes`` int8 ``[N, K]`` (kept as 4-bit pairs when ``max - min < 16``),
    ``scales`` fp32 ``[N, K // group]``, ``offsets`` fp32 ``[N, K // group]``
    or None; ``fmt``: the GGUF type name (``"Q4_K"``, ...), for logs.

    Raises ValueError for mismatched shapes or ``K % group != 0``.
    """

    __slots__ = ("fmt", "group", "out_features", "in_features", "scales", "offsets", "packed", "low", "nibbles",
                 "high", "bias", "kernel", "blocked")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
                 fmt: str, bias: torch.Tensor | None = None) -> None:
        n, k = codes.shape
        if k % group or scales.shape != (n, k // group) or (offsets is not None and offsets.shape != scales.shape):
            raise ValueError(f"{fmt}: codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and groups of "
                             f"{group} do not fit")
        self.fmt, self.group, self.out_features, self.in_features = fmt, group, n, k
        self.scales = scales.to(torch.float32).contiguous()
        self.offsets = None if offsets is None else offsets.to(torch.float32).contiguous()
        codes = codes.to(torch.int8)
        self.low, self.high = _code_range(codes)
        self.nibbles = k % 2 == 0 and self.high - self.low < 16
        # two codes a byte where they fit: (code - low) of column 2j low, of column 2j + 1 high
        self.packed = _pack_nibbles(codes, self.low) if self.nibbles else codes.contiguous()
        self.bias = None if bias is None else bias.to(torch.float32)
        self.kernel = None  # set by prepare() when a compiled kernel runs this weight
        self.blocked = False  # True: packed/scales/offsets in the kernel's layout (qkernel.blocked)

    def prepare(self) -> QuantizedWeight:
        """Hand this weight to the compiled kernel where one runs here
        (:func:`worker.models.llama.qkernel.load`): its codes, scales and offsets move into the
        kernel's blocked layout, in place (held once). Returns self."""
        from worker.models.llama import qkernel

        module = qkernel.load()
        if module is None or self.blocked or self.group % 2:
            return self
        self.packed = qkernel.blocked(self.packed, self.nibbles)
        self.scales = qkernel.blocked_groups(self.scales)
        self.offsets = None if self.offsets is None else qkernel.blocked_groups(self.offsets)
        self.blocked, self.kernel = True, qkernel.Kernel(module, self)
        return self

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """One weight of ``parts`` stacked along the output rows (q, k, v -> qkv; gate, up ->
        gate_up), biases alike (zeros for a part without), not prepared (:meth:`prepare` it after);
        the codes, scales and offsets as they are, repacked only where the parts' packings differ.

        Raises ValueError unless every part has the same format, group and ``in_features``
        (a fused linear of mixed formats runs its parts one by one instead:
        :class:`~worker.models.llama.linear.ConcatLinear`).
        """
        first = parts[0]
        if any((p.fmt, p.group, p.in_features, p.offsets is None) != (first.fmt, first.group, first.in_features,
                                                                       first.offsets is None) for p in parts):
            raise ValueError("QuantizedWeight.cat needs parts of one format, group and width; got "
                             + ", ".join(f"{p.fmt} {p.out_features}x{p.in_features}" for p in parts))
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([torch.zeros(p.out_features) if p.bias is None else p.bias for p in parts])
        rows = [p._rows(None) for p in parts]  # row-major, also of a prepared part
        scales = torch.cat([r[1] for r in rows])
        offsets = None if first.offsets is None else torch.cat([r[2] for r in rows])
        if all((p.nibbles, p.low) == (first.nibbles, first.low) for p in parts):
            out = cls._of(first, torch.cat([r[0] for r in rows]), scales, offsets, bias)
            out.out_features = sum(p.out_features for p in parts)
            out.high = max(p.high for p in parts)
            return out
        return cls(torch.cat([p.codes() for p in parts]), scales, offsets, first.group, first.fmt, bias)

    def with_bias(self, bias: torch.Tensor | None) -> QuantizedWeight:
        """This weight (its tensors shared, not copied; prepared if it is) with ``bias`` (fp32) added
        to its products."""
        out = self._of(self, self.packed, self.scales, self.offsets, None if bias is None else bias.to(torch.float32))
        out.blocked = self.blocked
        if self.kernel is not None:
            out.kernel = type(self.kernel)(self.kernel.module, out, self.kernel.rows)
        return out

    @classmethod
    def _of(cls, like: QuantizedWeight, packed, scales, offsets, bias) -> QuantizedWeight:
        """A row-major weight packed as ``like`` (format, group, sizes, packing) from these tensors, no checks."""
        out = cls.__new__(cls)
        out.fmt, out.group, out.out_features, out.in_features = like.fmt, like.group, like.out_features, like.in_features
        out.low, out.high, out.nibbles = like.low, like.high, like.nibbles
        out.packed, out.scales, out.offsets, out.bias = packed, scales, offsets, bias
        out.kernel, out.blocked = None, False
        return out

    def _rows(self, rows: torch.Tensor | None):
        """``(packed, scales, offsets)`` row-major, of all rows or ``rows``."""
        if not self.blocked:
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])
            return pick(self.packed), pick(self.scales), None if self.offsets is None else pick(self.offsets)
        from worker.models.llama import qkernel

        n = self.out_features
        return (qkernel.row_major(self.packed, n, self.nibbles, rows), qkernel.row_groups(self.scales, n, rows),
                None if self.offsets is None else qkernel.row_groups(self.offsets, n, rows))

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes as int8 ``[R, K]`` (all rows, or ``rows``)."""
        return self._codes(self._rows(rows)[0])

    def _codes(self, p: torch.Tensor) -> torch.Tensor:
        if not self.nibbles:
            return p
        pair = torch.stack(((p & 15), (p >> 4)), dim=-1).reshape(p.shape[0], self.in_features)
        return (pair.to(torch.int16) + self.low).to(torch.int8)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The file's weights as fp32 ``[R, K]`` (all rows, or ``rows``: a 1-D index tensor)."""
        packed, scales, offsets = self._rows(rows)
        w = self._codes(packed).float().view(-1, self.in_features // self.group, self.group) * scales[..., None]
        if offsets is not None:
            w += offsets[..., None]
        return w.view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() + self.scales.numel() * 4  # padding rows of the blocked layout included
                + (0 if self.offsets is None else self.offsets.numel() * 4))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)`` in ``x``'s dtype."""
        if not x.shape[0]:  # a step with no logits to compute: the compiled kernel crashes on no rows
            y = torch.zeros(0, self.out_features)
        elif self.kernel is not None:
            y = self.kernel(x)
        else:
            y = F.linear(x.float(), self.dequantize())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        return residual + self(x)


class QuantizedEmbedding:
    """Token embedding rows read from a :class:`QuantizedWeight`'s stored rows (precision ``gguf``):
    ``dequantize(rows=ids)`` -- the file's values, bit for bit -- in the activation dtype
    ``act_dtype``. ``weight`` is the stored table itself, so a tied LM head multiplies by the
    same object: one copy for both."""

    __slots__ = ("weight", "act_dtype")
    exact = True  # rows come back as the file's, bit for bit

    def __init__(self, weight: QuantizedWeight, act_dtype: torch.dtype) -> None:
        self.weight, self.act_dtype = weight, act_dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(ids).to(self.act_dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


PACK_CODES = 1 << 20
"""Codes packed at a time: a tensor's packing temporaries stay a few MiB, not a multiple of it."""


def _code_range(codes: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of int8 codes, by numpy: torch's int8 reductions contend for the cores with a
    loaded machine's other work (2 threads at load 5: 9 ms against numpy's 0.01 ms for 0.9M codes)."""
    if not codes.numel():
        return 0, 0
    a = codes.contiguous().numpy()
    return int(a.min()), int(a.max())


def _pack_nibbles(codes: torch.Tensor, low: int) -> torch.Tensor:
    """``[N, K / 2]`` uint8: ``code - low`` of column ``2j`` in the low nibble, of ``2j + 1`` in the high
    one. By numpy (one thread; see :func:`_code_range`), :data:`PACK_CODES` at a time: two adjacent
    codes read as one little-endian uint16 ``a | b << 8`` give ``a | b << 4`` in its low byte."""
    import sys

    import numpy as np

    n, k = codes.shape
    packed = np.empty((n, k // 2), dtype=np.uint8)
    src = codes.contiguous().numpy()
    step = max(1, PACK_CODES // max(k, 1))
    for start in range(0, n, step):
        u = (src[start:start + step] - np.int8(low)).view(np.uint8)  # wraps as int8, exact as uint8
        if sys.byteorder == "little":
            pair = u.view(np.uint16)
            packed[start:start + step] = pair | (pair >> np.uint16(4))
        else:
            packed[start:start + step] = u[:, 0::2] | (u[:, 1::2] << np.uint8(4))
    return torch.from_numpy(packed)
