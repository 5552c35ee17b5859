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
        self.low = int(codes.min()) if codes.numel() else 0
        self.high = int(codes.max()) if codes.numel() else 0
        self.nibbles = k % 2 == 0 and self.high - self.low < 16
        if self.nibbles:  # two codes a byte: (code - low) of column 2j low, of column 2j + 1 high
            u = (codes.to(torch.int16) - self.low).to(torch.uint8)
            self.packed = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
        else:
            self.packed = codes.contiguous()
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
        if self.kernel is not None:
            y = self.kernel(x)
        else:
            y = F.linear(x.float(), self.dequantize())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        return residual + self(x)
