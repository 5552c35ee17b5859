"""Linear layers on GGUF block-quantised weights as the file stores them.

Every GGUF block format the families' usual files use (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) dequantises, per group of ``group`` input
columns (16 for Q6_K, 32 for the rest), as

    ``W[n, k] = fl(scale[n, g] * code[n, k]) + offset[n, g]``   (``g = k // group``)

with a small integer ``code`` (the file's ``q`` minus the format's fixed zero:
8 for Q4_0, 16 for Q5_0, 32 for Q6_K), ``scale`` the block's fp16 ``d``
(times the sub-block's 6- or 8-bit scale for the K formats) and ``offset``
Q4_1/Q5_1's ``m`` or the K formats' ``-dmin * m`` (None where the format has
none). In that order of fp32 operations it is, bit for bit, what
``gguf.dequantize`` (and transformers) give: the file's weight.

:class:`QuantizedWeight` keeps exactly the file's numbers: codes that fit in 4
bits two to a byte, others one int8 each; scales and offsets as a
:class:`GroupScales` each -- the fp16 ``d`` (per 32 columns for Q4_0 .. Q8_0,
per 256-column super-block for the K formats, with the sub-block's uint8 / int8
scale or min per group beside it), whose fp32 product ``fl(d) * fl(q)`` (11 and
at most 8 significant bits: exact) is the scale gguf forms. Never the
dequantised matrix, nor an fp32 scale per group (Qwen2.5-Coder-1.5B Q4_K_M:
1.55 GB held with fp32 scales per group, the file 0.93 GB).

Products: ``x [M, K] @ W.T`` by the compiled kernel of
:mod:`worker.models.llama.qkernel` where it is built for this CPU (it reads
the codes and scale factors as stored; the activations are rounded to bf16, the
products and sums are fp32), else, and above ``kernel_rows`` rows (a
prefill), on the dequantised weight in fp32 (``F.linear``), one layer at a
time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GroupScales:
    """A per-group factor (the scales, or the offsets) of a ``[N, K]`` weight with ``G = K / group``
    groups a row, as a GGUF file holds it:

        ``value[n, g] = fl32(d[n, g // sub]) * fl32(q[n, g])``   (``q`` None: ``value = d``)

    ``d`` fp16 ``[N, G / sub]`` (a K format's super-block ``d`` or ``-dmin``, ``sub`` = 8 or 16
    groups; Q4_0 .. Q8_0's ``d`` or Q4_1's ``m`` per group, ``sub`` = 1); ``q`` uint8 or int8
    ``[N, G]`` (the sub-block's 6-bit scale or min, Q6_K's signed 8-bit scale) or None. The
    product of an fp16 (11 significant bits) and an integer of at most 8 bits is exact in fp32,
    and negating ``dmin`` rounds nothing, so :meth:`values` is the fp32 factor ``gguf.dequantize``
    forms, bit for bit. ``sub`` is a power of two (the kernel shifts).

    Held row-major, or in the kernel's blocked layout (:meth:`map` with
    :func:`~worker.models.llama.qkernel.blocked_groups`; ``QuantizedWeight.blocked`` says which).

    Raises ValueError for shapes that do not fit, another dtype, or ``sub`` not a power of two.
    """

    __slots__ = ("d", "q", "sub")

    def __init__(self, d: torch.Tensor, q: torch.Tensor | None = None, sub: int = 1) -> None:
        if d.dtype != torch.float16 or (q is not None and q.dtype not in (torch.uint8, torch.int8)):
            raise ValueError(f"GroupScales: d fp16 and q uint8/int8 expected, got {d.dtype} and "
                             f"{None if q is None else q.dtype}")
        if sub < 1 or sub & (sub - 1) or (q is None and sub != 1):
            raise ValueError(f"GroupScales: sub must be a power of two (1 without q), got {sub}")
        self.d, self.q, self.sub = d, q, sub

    @classmethod
    def of(cls, values: torch.Tensor) -> GroupScales:
        """``values`` ``[N, G]`` (one per group) as fp16 ``d``; ValueError unless fp16 holds each exactly."""
        if isinstance(values, GroupScales):
            return values
        d = values.to(torch.float16)
        if not torch.equal(d.to(values.dtype), values):
            raise ValueError("per-group scales or offsets must be exact in fp16 (as GGUF stores them): "
                             "pass a GroupScales for a K format's d x sub-block scale")
        return cls(d.contiguous())

    @property
    def shift(self) -> int:
        """``log2(sub)``: groups per ``d`` as the kernel's shift."""
        return self.sub.bit_length() - 1

    def groups(self) -> int:
        """Groups per row, ``G``, of a row-major factor."""
        return self.d.shape[1] * self.sub if self.q is None else self.q.shape[1]

    def values(self) -> torch.Tensor:
        """fp32 ``[N, G]`` of a row-major factor (exact: see the class docstring)."""
        d = self.d.float()
        if self.q is None:
            return d
        return d.repeat_interleave(self.sub, dim=1) * self.q.float()

    def map(self, fn) -> GroupScales:
        """``fn`` applied to ``d`` and ``q`` (a row pick, the blocked layout, ...), ``sub`` kept."""
        out = GroupScales.__new__(GroupScales)
        out.d, out.q, out.sub = fn(self.d), None if self.q is None else fn(self.q), self.sub
        return out

    @property
    def nbytes(self) -> int:
        return self.d.numel() * 2 + (0 if self.q is None else self.q.numel())

    def like(self, other: GroupScales | None) -> bool:
        """Whether ``other`` has the same dtypes and ``sub`` (so their rows stack)."""
        return other is not None and (self.sub, self.d.dtype, None if self.q is None else self.q.dtype) == (
            other.sub, other.d.dtype, None if other.q is None else other.q.dtype)

    @staticmethod
    def cat(parts: list[GroupScales]) -> GroupScales:
        """Rows of row-major ``parts`` stacked, or 16-row blocks of blocked ones (they must be
        :meth:`like` each other)."""
        first = parts[0]
        out = GroupScales.__new__(GroupScales)
        out.d, out.sub = _stack([p.d for p in parts]), first.sub
        out.q = None if first.q is None else _stack([p.q for p in parts])
        return out


class QuantizedWeight:
    """A ``[N, K]`` weight held as integer codes with a scale (and an offset) per group of columns.

    ``codes`` int8 ``[N, K]`` (kept as 4-bit pairs when ``max - min < 16``); ``scales`` and
    ``offsets`` (or None) :class:`GroupScales` of ``K // group`` groups a row, or tensors
    ``[N, K // group]`` of values exact in fp16 (:meth:`GroupScales.of`); ``fmt``: the GGUF type
    name (``"Q4_K"``, ...), for logs.

    Raises ValueError for mismatched shapes, ``K % group != 0`` or scales that fp16 cannot hold.
    """

    __slots__ = ("fmt", "group", "out_features", "in_features", "scales", "offsets", "packed", "low", "nibbles",
                 "high", "bias", "kernel", "blocked", "six")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
                 fmt: str, bias: torch.Tensor | None = None) -> None:
        n, k = codes.shape
        scales = GroupScales.of(scales)
        offsets = None if offsets is None else GroupScales.of(offsets)
        for f in (scales, offsets):
            if k % group or (f is not None and not _fits(f, n, k // group)):
                raise ValueError(f"{fmt}: codes {tuple(codes.shape)}, scales {tuple(scales.d.shape)} and groups of "
                                 f"{group} do not fit")
        self.fmt, self.group, self.out_features, self.in_features = fmt, group, n, k
        self.scales = scales.map(torch.Tensor.contiguous)
        self.offsets = None if offsets is None else offsets.map(torch.Tensor.contiguous)
        codes = codes.to(torch.int8)
        self.low, self.high = _code_range(codes)
        self.nibbles = k % 2 == 0 and self.high - self.low < 16
        # two codes a byte where they fit: (code - low) of column 2j low, of column 2j + 1 high
        self.packed = _pack_nibbles(codes, self.low) if self.nibbles else codes.contiguous()
        self.bias = None if bias is None else bias.to(torch.float32)
        self.kernel = None  # set by prepare() when a compiled kernel runs this weight
        self.blocked = False  # True: packed/scales/offsets in the kernel's layout (qkernel.blocked)
        self.six = None  # blocked: whether a span of <= 64 codes is held in 6 bits (qkernel.six_bits)

    def prepare(self) -> QuantizedWeight:
        """Hand this weight to the compiled kernel where one runs here
        (:func:`worker.models.llama.qkernel.load`): its codes, scales and offsets move into the
        kernel's blocked layout, in place (held once; int8 codes that span at most 64 values --
        Q5_0, Q5_1, Q5_K, Q6_K -- in 6 bits, :data:`~worker.models.llama.qkernel.SIX`, where
        :func:`~worker.models.llama.qkernel.six_bits` says so, else a byte each). Returns self."""
        from worker.models.llama import qkernel

        module = qkernel.load()
        if module is None or self.blocked or not qkernel.takes(module, self.group):
            return self
        self.six = qkernel.six_bits()
        self.packed = qkernel.blocked(self.packed, qkernel.kind(self), self.low)
        self.scales = self.scales.map(qkernel.blocked_groups)
        self.offsets = None if self.offsets is None else self.offsets.map(qkernel.blocked_groups)
        self.blocked, self.kernel = True, qkernel.Kernel(module, self)
        return self

    @classmethod
    def from_blocked(cls, packed: torch.Tensor, scales: GroupScales, offsets: GroupScales | None, shape: tuple,
                     group: int, fmt: str, low: int, high: int, six: bool) -> QuantizedWeight:
        """A weight whose tensors are already in the compiled kernel's blocked layout, as :meth:`prepare`
        leaves them (``packed`` for :func:`~worker.models.llama.qkernel.code_kind` of ``low`` ..
        ``high`` and ``six``, the factors as :func:`~worker.models.llama.qkernel.blocked_groups` lays them out),
        ``shape`` ``(N, K)``: what :func:`worker.models.gguf_blocks.stored_weight` reads from a file.
        The kernel checks the sizes when it multiplies (RuntimeError)."""
        from worker.models.llama import qkernel

        out = cls.__new__(cls)
        out.fmt, out.group, (out.out_features, out.in_features) = fmt, group, shape
        out.low, out.high = low, high
        out.nibbles = out.in_features % 2 == 0 and high - low < 16
        out.packed, out.scales, out.offsets, out.bias = packed, scales, offsets, None
        out.blocked, out.six = True, six
        out.kernel = qkernel.Kernel(qkernel.load(), out)
        return out

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """One weight of ``parts`` stacked along the output rows (q, k, v -> qkv; gate, up ->
        gate_up), biases alike (zeros for a part without); the codes, scales and offsets as they
        are, repacked only where the parts' packings differ. Prepared where every part is and their
        blocked tensors stack as they are (one code kind and ``low``, every part but the last whole
        16-row blocks: :meth:`_cat_blocked`), else not (:meth:`prepare` it after).

        Formats may differ where their factors do not (:meth:`stacks_with`: Q5_0 beside Q8_0, each
        an fp16 ``d`` per 32 columns; ``fmt`` then names both, ``"Q5_0+Q8_0"``): the codes then take
        the kind their joined range needs (int8 ones for Q8_0's), and each row's int8-activation
        product is the same integers and epilogue as its part's alone, so the same bits.

        Raises ValueError unless every part :meth:`stacks_with` the first (a fused linear of
        formats whose factors differ runs its parts one by one instead:
        :class:`~worker.models.llama.linear.ConcatLinear`).
        """
        first = parts[0]
        if not all(first.stacks_with(p) for p in parts):
            raise ValueError("QuantizedWeight.cat needs parts of one group, width and kind of scales and offsets; got "
                             + ", ".join(f"{p.fmt} {p.out_features}x{p.in_features}" for p in parts))
        fmt = "+".join(dict.fromkeys(p.fmt for p in parts))
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([torch.zeros(p.out_features) if p.bias is None else p.bias for p in parts])
        fused = cls._cat_blocked(parts, bias)
        if fused is not None:
            fused.fmt = fmt
            return fused
        rows = [p._rows(None) for p in parts]  # row-major, also of a prepared part
        scales = GroupScales.cat([r[1] for r in rows])
        offsets = None if first.offsets is None else GroupScales.cat([r[2] for r in rows])
        if all((p.nibbles, p.low) == (first.nibbles, first.low) for p in parts):
            out = cls._of(first, torch.cat([r[0] for r in rows]), scales, offsets, bias)
            out.fmt, out.out_features = fmt, sum(p.out_features for p in parts)
            out.high = max(p.high for p in parts)
            return out
        return cls(torch.cat([p.codes() for p in parts]), scales, offsets, first.group, fmt, bias)

    def stacks_with(self, other: QuantizedWeight) -> bool:
        """Whether one weight can hold this one's rows and ``other``'s (:meth:`cat`): the same group and
        ``in_features``, and scales and offsets (or none) of the same kind (:meth:`GroupScales.like`).
        The format may differ where both hold a byte a code (:data:`~worker.models.llama.qkernel.MAGIC`,
        :data:`~worker.models.llama.qkernel.WIDE`: Q5_0 and Q8_0 without AMX), so that no part's codes
        take more bytes stacked than alone (4-bit or 6-bit codes would widen to bytes)."""
        from worker.models.llama import qkernel

        if not ((self.group, self.in_features, self.offsets is None) == (other.group, other.in_features,
                                                                          other.offsets is None)
                and self.scales.like(other.scales) and (self.offsets is None or self.offsets.like(other.offsets))):
            return False
        return self.fmt == other.fmt or {qkernel.kind(self), qkernel.kind(other)} <= {qkernel.MAGIC, qkernel.WIDE}

    @classmethod
    def _cat_blocked(cls, parts: list[QuantizedWeight], bias: torch.Tensor | None) -> QuantizedWeight | None:
        """:meth:`cat` of prepared ``parts`` as their blocked tensors stacked (each 16-row block is
        its own slab of every tensor, so blocks of whole parts stack as they lie), or None where
        that does not hold: a part not prepared, a part but the last with rows past whole blocks
        (padding inside), or parts whose codes differ in ``low`` or in kind, or whose stack would be
        of another kind than theirs (its ``high`` is the largest)."""
        from worker.models.llama import qkernel

        first = parts[0]
        high = max(p.high for p in parts)
        kinds = {qkernel.kind(p) for p in parts}
        if (not all(p.blocked for p in parts) or any(p.out_features % qkernel.BLOCK for p in parts[:-1])
                or len({(p.nibbles, p.low, p.six) for p in parts}) > 1 or len(kinds) > 1
                or qkernel.code_kind(first.nibbles, first.low, high, first.in_features, first.group, first.six)
                not in kinds):
            return None
        scales = GroupScales.cat([p.scales for p in parts])
        offsets = None if first.offsets is None else GroupScales.cat([p.offsets for p in parts])
        out = cls._of(first, _stack([p.packed for p in parts]), scales, offsets, bias)
        out.out_features, out.high = sum(p.out_features for p in parts), high
        out.blocked, out.kernel = True, qkernel.Kernel(first.kernel.module, out)
        return out

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
        out.low, out.high, out.nibbles, out.six = like.low, like.high, like.nibbles, like.six
        out.packed, out.scales, out.offsets, out.bias = packed, scales, offsets, bias
        out.kernel, out.blocked = None, False
        return out

    def _rows(self, rows: torch.Tensor | None):
        """``(packed, scales, offsets)`` row-major, of all rows or ``rows``."""
        if not self.blocked:
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])
            return pick(self.packed), self.scales.map(pick), None if self.offsets is None else self.offsets.map(pick)
        from worker.models.llama import qkernel

        n = self.out_features

        def groups(t):
            return qkernel.row_groups(t, n, rows)

        return (qkernel.row_major(self.packed, n, qkernel.kind(self), rows, self.low), self.scales.map(groups),
                None if self.offsets is None else self.offsets.map(groups))

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
        w = self._codes(packed).float().view(-1, self.in_features // self.group, self.group) * scales.values()[..., None]
        if offsets is not None:
            w += offsets.values()[..., None]
        return w.view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() + self.scales.nbytes  # padding rows of the blocked layout included
                + (0 if self.offsets is None else self.offsets.nbytes))

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
        return y if y.dtype == x.dtype else y.to(x.dtype)  # (a cast to its own dtype still costs a dispatch)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, in the product's own new tensor where it has the residual's dtype and
        shape (the same sums: fp32 addition commutes; no third tensor)."""
        y = self(x)
        if y.dtype == residual.dtype and y.shape == residual.shape:
            return y.add_(residual)
        return residual + y


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


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` (along dim 0): a view where they lie one after another in one storage,
    contiguous (parts read as one: :func:`worker.models.gguf_blocks.stored_weights`), else a copy."""
    first = tensors[0]
    if (all(t.is_contiguous() and t.shape[1:] == first.shape[1:]
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors)
            and all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(tensors, tensors[1:]))):
        return first.as_strided((sum(len(t) for t in tensors), *first.shape[1:]), first.stride(),
                                first.storage_offset())
    return torch.cat(tensors)


def _fits(f: GroupScales, n: int, groups: int) -> bool:
    """Whether the row-major factor ``f`` is ``[n, groups]``."""
    return (f.d.shape == (n, groups // f.sub) and groups % f.sub == 0
            and (f.q is None or f.q.shape == (n, groups)))


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
