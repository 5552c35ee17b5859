"""The compiled product for GGUF-quantised weights (``qkernel.cpp``), built once per machine.

:func:`load` compiles ``qkernel.cpp`` with torch's C++ extension builder the
first time a process needs it (about a minute on 2 cores; cached under
``~/.cache/slotserve/kernels`` keyed by the source, its local headers, torch's version and the
compiler flags, so later processes load it in milliseconds). On a CPU with AVX2, FMA and F16C but
without AVX-512 BF16 it builds ``qkernel_avx2.cpp`` instead (:func:`isa`): int8 activations only
(``qmm8``; no ``qmm``, ``qmm_tiles`` or ``dequant_t``, so ``gguf_activations`` ``bf16`` is refused
there). It returns None where neither runs (``/proc/cpuinfo``), with no C++ compiler, or with
``SLOTSERVE_NO_KERNELS`` set. The
weights then multiply in pure torch (:class:`~worker.models.llama.quantized.QuantizedWeight`).

:func:`prepare` moves a :class:`~worker.models.llama.quantized.QuantizedWeight`'s
codes and scales into the kernel's blocked layout (16 output rows a block;
see ``qkernel.cpp``), in place: the weight is held once, in that layout. The scales and offsets
stay as the file holds them (fp16 ``d`` per block or super-block, (u)int8 sub-block factors;
:class:`~worker.models.llama.quantized.GroupScales`), multiplied out per group in the kernel.
A GGUF file's tensors are read into that layout directly (``unpack_blocked``, through
:func:`worker.models.gguf_blocks.stored_weight`): the same tensors as ``prepare`` makes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import torch

from worker.models.llama import extension

SOURCE = Path(__file__).with_name("qkernel.cpp")
FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
         "-mamx-tile", "-mamx-bf16", "-fopenmp"]
SOURCE_AVX2 = Path(__file__).with_name("qkernel_avx2.cpp")
"""The product where the CPU has AVX2 but no AVX-512 BF16 (AMD Zen 2/3, Intel Haswell to Alder Lake): int8
activations only (``qmm8``, the same bits as qkernel.cpp's), so ``gguf_activations`` ``bf16`` does not run there."""
FLAGS_AVX2 = ["-O3", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
BLOCK = 16
"""Output rows per block: one zmm of fp32 lanes."""

KERNEL_ROWS = 512
"""Prompt rows up to which the bf16-activation kernel runs where it has no AMX tiles (AVX-512: every
prefill chunk of the default ``max_prefill_tokens``, 512, with the step's decode rows beside it); more
multiply the layer dequantised for the call (:meth:`Kernel.wide`), the step's decode rows
(:func:`leading_exact_rows`) still on the kernel. int8 activations run ``qmm8`` at every row count
(its 512 rows of a Qwen2.5-1.5B layer: 86-97 ms, against the wide product's 165; and every row's
result whatever shares its step). Measured on a 2-core AMD EPYC (Zen 4), a layer of Qwen2.5-1.5B's shapes, 2
threads (bench/qkernel.py): Q4_K kernel against dequantised bf16 ``torch.mm`` at 64 rows 20.2 / 44.1 ms,
128 rows 36.1 / 57.4, 256 69.3 / 86.9, 512 142.2 / 165.3; Q6_K's kernel 24.6, 45.8, 91.3, 190.4
(the last above the bf16 product). At 64 rows (before), HE32 on Qwen2.5-Coder-1.5B served
36.3 tokens/s, at 512 39.4, and prefill on the file's weights, not their bf16 rounding."""


_EXACT_ROWS = contextvars.ContextVar("exact_rows", default=0)


def past(limit: int, m: int) -> bool:
    """Whether a product of ``m`` rows goes past ``limit`` to its other product: more prompt rows than
    ``limit``, or more decode rows (the :func:`leading_exact_rows` block's ``n``)."""
    n = _EXACT_ROWS.get()
    return m - n > limit or n > limit


def own_decode_rows(y: torch.Tensor, x: torch.Tensor, limit: int, own) -> torch.Tensor:
    """``y`` (the other product of ``x``) with the step's decode rows (up to ``limit`` of them) replaced
    by ``own(x[:n])``, the product they take alone (:func:`leading_exact_rows`)."""
    n = _EXACT_ROWS.get()
    if 0 < n <= limit:
        y[:n] = own(x[:n])
    return y


@contextlib.contextmanager
def leading_exact_rows(n: int):
    """While the block runs, the first ``n`` rows of a product are a step's decode rows (its decode
    entries come before its prompt chunks; :func:`~worker.models.llama.model.forward` says them at
    every step, a step of decode rows only included), and they get the product their count alone
    would pick, whatever prompt rows share the step: where the prompt rows take another product --
    AMX bf16 tiles above :data:`TILE_ROWS` rows (the weights rounded to bf16), the wide product
    above :data:`KERNEL_ROWS` prompt rows (bf16 activations), the dequantised weight above a torch
    int kind's ``KERNEL_ROWS`` (:mod:`worker.models.llama.linear`) -- the decode rows are multiplied
    again on the mode's decode product (``auto``: int8 where it runs; ``bf16``: the file's weights
    exactly) and replace theirs; more decode rows than that take the other product, prompt or
    not. ``n`` 0 (the default): no such rows."""
    token = _EXACT_ROWS.set(n)
    try:
        yield
    finally:
        _EXACT_ROWS.reset(token)


def cpu_has_avx512_bf16() -> bool:
    """Whether ``/proc/cpuinfo`` lists ``avx512_bf16`` (False where it cannot be read)."""
    return extension.cpu_has("avx512_bf16")


def isa() -> str:
    """Which product :func:`load` builds here: ``"avx512"`` (``qkernel.cpp``: a CPU with AVX-512 BF16),
    ``"avx2"`` (``qkernel_avx2.cpp``: AVX2, FMA and F16C without it), or ``""`` (neither)."""
    if cpu_has_avx512_bf16():
        return "avx512"
    return "avx2" if extension.cpu_has_avx2() else ""


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (``qmm8``; ``qmm`` and the rest on AVX-512), or None where it cannot be built
    or run here (module docstring; :func:`isa`)."""
    if isa() == "avx2":
        return extension.build("qkernel_avx2", SOURCE_AVX2, FLAGS_AVX2, "avx2", "quantised products run in pure torch")
    return extension.build("qkernel", SOURCE, FLAGS, "avx512_bf16", "quantised products run in pure torch")


class Kernel:
    """``x [M, K] -> x @ W.T`` fp32 ``[M, N]`` on a weight in the blocked layout.

    Where the process may use AMX tiles (``amx_bf16``; Linux grants the state on request), every
    row count runs on them (``qmm(..., amx=True)``; rows padded to a multiple of 16 above 16).
    Otherwise the AVX-512 BF16 product (``amx=False``) up to ``rows`` rows, and above that :meth:`wide`.
    """

    __slots__ = ("module", "weight", "rows", "amx", "int8", "tiles", "args")

    def __init__(self, module, weight, rows: int = KERNEL_ROWS, activations: str = "auto") -> None:
        self.module, self.weight, self.rows = module, weight, rows
        # the kernels' arguments after x, formed once (a Python tuple per call cost ~5 us of a
        # SmolLM2 decode step's ~150 products)
        self.args = (weight.packed, kernel_kind(weight), weight.low, *factor_args(weight), weight.group,
                     weight.out_features)
        self.amx = bool(module.has_amx())
        self.int8 = self.tiles = False
        self.set_activations(activations)

    def set_activations(self, activations: str) -> None:
        """``"int8"``: the activations rounded to int8 per row and group (``qmm8``: VNNI, AMX-INT8
        tiles above :data:`VNNI_ROWS` rows where the process may use them), as llama.cpp's Q8
        activations, and above :data:`TILE_ROWS` rows (AMX) bf16 tiles of the weights
        (``qmm_tiles``); runs where the CPU has AVX-512 VNNI and VBMI, or AVX2 (``qkernel_avx2.cpp``:
        the same bits), every GGUF block format.
        ``"bf16"``: rounded to bf16 (``qmm``), the file's weights exactly at every row count; needs
        AVX-512 BF16 (ValueError on the AVX2 build).
        ``"auto"`` (the default): ``"int8"`` where it runs, else ``"bf16"`` -- llama.cpp's choice,
        faster at every decode size measured and, since its base and offset terms multiply the
        rounded x (``qrows``) and its sums hold the codes' base exactly, above llama.cpp's greedy
        agreement with fp32 on HE32 (2-core Zen 4, int8 everywhere: SmolLM2 16, Qwen2.5-Coder-0.5B
        27, -1.5B 29 of 32, the same every run, against llama.cpp's 14-15, 23-26 and 17-20; bf16
        activations 27, 30, 32). Decode steps at 8 slots, in turns in one process (2 threads, 160
        cached tokens a slot), bf16 -> int8, before the decode prefetch: SmolLM2 14.7 -> 13.3 ms, the
        0.5B 41.1 -> 38.2, the 1.5B 105.0 -> 90.6. (A model's LM head under its ``"auto"``:
        :data:`worker.models.llama.weights.HEAD_ACTIVATIONS`.) ValueError for ``"int8"`` where it does
        not run, or another value."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(ACTIVATIONS)}; got {activations!r}")
        w = self.weight
        runs = bool(self.module.has_q8()) and w.group % 16 == 0
        if activations == "int8" and not runs:
            raise ValueError("gguf_activations='int8' needs a CPU with AVX-512 VNNI and VBMI, or AVX2 (and groups "
                             f"of a multiple of 16 columns; this weight: {w.fmt}); use 'bf16'")
        if activations == "bf16" and not runs_bf16(self.module):
            raise ValueError("gguf_activations='bf16' needs a CPU with AVX-512 BF16; this one runs the stored "
                             "weights on AVX2 with int8 activations: use 'int8' or 'auto'")
        self.int8 = activations == "int8" or (activations == "auto" and runs)
        self.tiles = activations != "bf16" and self.amx

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, m = self.weight, x.shape[0]
        if self.tiles and m > TILE_ROWS:  # a prefill chunk: bf16 tiles over all of K
            y = self.module.qmm_tiles(_tile_rows(x.to(torch.bfloat16).contiguous()), *self.args)
            return own_decode_rows(y if y.shape[0] == m else y[:m], x, TILE_ROWS, self)  # decode rows: theirs
        if self.int8:  # every row count: past 512 rows still faster than the wide product, and row-invariant
            if x.dtype != torch.float32 or not x.is_contiguous():  # (a decode step's x is both: no call)
                x = x.to(torch.float32).contiguous()
            y = self.module.qmm8(_tile_rows(x) if self.amx and m > VNNI_ROWS else x, *self.args, self.amx,
                                 VNNI_ROWS)
            return y if y.shape[0] == m else y[:m]
        if self.amx and w.group in (16, 32):  # fp32 x: the kernel rounds it to bf16 itself (one op less)
            y = self._qmm(_tile_rows(x.to(torch.float32).contiguous()), True)
            return y if y.shape[0] == m else y[:m]
        if past(self.rows, m):  # the wide product, but a step's decode rows as they would be alone
            return own_decode_rows(self.wide(x), x, self.rows, self)
        # fp32 x as it is: the kernel rounds it to bf16 in the call (nearest even, as torch's cast,
        # but a denormal x becomes 0), where a cast here cost ~4 dispatched operations a product
        return self._qmm((x if x.dtype == torch.bfloat16 else x.to(torch.float32)).contiguous(), False)

    def _qmm(self, xb: torch.Tensor, amx: bool) -> torch.Tensor:
        return self.module.qmm(xb, *self.args, amx)

    def wide(self, x: torch.Tensor, bf16: bool = True) -> torch.Tensor:
        """``x @ W.T`` for many rows: the layer's weight dequantised for this call (``W.T``, bf16 by
        default: the GEMM library's AMX/AVX-512 BF16 product; fp32: the file's weights exactly)."""
        wt = self.transposed(bf16)
        return torch.mm(x.to(wt.dtype), wt).float()

    def transposed(self, bf16: bool) -> torch.Tensor:
        """``W.T`` ``[K, N]``: fp32 (exactly :meth:`QuantizedWeight.dequantize`'s values) or bf16."""
        w = self.weight
        return self.module.dequant_t(w.packed, kind(w), w.low, *factor_args(w), w.group, w.out_features,
                                     w.in_features, bf16)


_EMPTY = torch.empty(0)


def _tile_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as AMX tiles take rows: up to 16, or a multiple of 16 (zero rows appended; slice the
    product's first ``len(x)`` rows)."""
    m = x.shape[0]
    return x if m <= 16 or m % 16 == 0 else torch.cat([x, x.new_zeros(-m % 16, x.shape[1])])

ACTIVATIONS = ("auto", "int8", "bf16")
"""``ModelOptions.gguf_activations``: how the activations meet the codes (:meth:`Kernel.set_activations`)."""

TILE_ROWS = 64
"""On AMX, with activations ``auto`` or ``int8``: above this many rows (a prefill chunk) the product
runs on the weights decoded per 16-row block to bf16 tiles (``qmm_tiles``: the file's weights
rounded to bf16, bf16 activations, fp32 sums over all of K), up to it on the mode's decode product.
Decode batches of up to 64 rows are then row-invariant, also beside a prompt chunk in one step
(:func:`leading_exact_rows`); a prompt's rows follow their chunk's size (``bf16``: every row count
on the exact product). Without AMX, ``int8`` (and ``auto``, where int8 runs) multiplies prompt chunks
of up to :data:`KERNEL_ROWS` rows on ``qmm8`` too (``vpdpbusd`` does 64 products an instruction where
``vdpbf16ps`` does 32, each one a cycle on Zen 4)."""

VNNI_ROWS = 0
"""Rows up to which int8 products run on VNNI where AMX-INT8 tiles are there too: none. Measured on
all of Qwen2.5-Coder-1.5B's products, head included, 2 threads, best of 5, both in one run: with the
tiles' ring and two groups a tile product up to 8 rows (qkernel.cpp, amx8_stack), VNNI 58.6 ms at
1 row against the tiles' 56.8, 61.8 against 57.4 at 2 rows, 73.4 against 74.3 at 8 (the same
kernel above 2 rows). With the ring alone VNNI led at 1 row (56.5 against 60.1); before the ring, up
to 5 rows. VNNI decodes each block first; it runs where the process may not use the tiles."""

NIBBLES, MAGIC, WIDE, SIX = 0, 1, 2, 3
"""How the kernel holds and decodes a weight's codes (``qkernel.cpp``): 4-bit pairs through a table;
int8 codes in [-64, 63] as the bf16 numbers ``192 + code`` (one add); other int8 codes through fp32;
codes spanning at most 64 values (Q5_0, Q5_1, Q5_K, Q6_K) as 6 bits ``u = code - low``, a nibble
and two bits apart (as ggml's Q6_K), decoded as the bf16 numbers ``128 + u`` (one or)."""


def six_bits() -> bool:
    """Whether 6-bit codes (Q5_0, Q5_1, Q5_K, Q6_K) are held in 6 bits (:data:`SIX`) here: where
    the process may use AMX tiles, which multiply while the vector ports decode, so the bytes
    streamed count. Without them (the AVX-512 product) a byte a code (:data:`MAGIC`, 33 % more
    bytes for those tensors): there the decode runs on the ports of the dot product itself (on
    Zen 4 a 512-bit decode operation delays a ``vdpbf16ps`` stream by about as much as another
    ``vdpbf16ps``, measured), and a byte decodes in 2 operations a column pair where 6 bits take
    4.5. Measured on a 2-core AMD EPYC (Zen 4), a Qwen2.5-1.5B layer of Q6_K codes, 2 threads,
    both in one process, 6 bits -> a byte: 1 row 1.77 -> 1.55 ms, 4 rows 2.35 -> 2.02, 8 rows 3.32
    -> 2.85, 16 rows 5.41 -> 4.93, 64 and 512 rows even (int8 activations: even). A weight keeps
    the choice it was laid out with (``QuantizedWeight.six``)."""
    module = load()
    return bool(module is not None and module.has_amx())


def runs_bf16(module) -> bool:
    """Whether ``module`` (:func:`load`'s) has the bf16-activation product (``qmm``: the AVX-512 build;
    the AVX2 build multiplies int8 activations alone)."""
    return hasattr(module, "qmm")


def takes(module, group: int) -> bool:
    """Whether ``module`` (:func:`load`'s) multiplies a weight of ``group`` columns a group: an even
    group on AVX-512 (``qmm``), 16 or 32 on AVX2 (``qmm8`` alone, whose 4-bit codes' int16 sums hold
    at most 32 columns; every GGUF format's group), so that no weight it is handed is refused at its
    first product."""
    return group % 2 == 0 and (runs_bf16(module) or group in (16, 32))


def kind(w) -> int:
    """:data:`NIBBLES`, :data:`SIX`, :data:`MAGIC` or :data:`WIDE` for a QuantizedWeight ``w``."""
    return code_kind(w.nibbles, w.low, w.high, w.in_features, w.group, w.six)


def kernel_kind(w) -> int:
    """:func:`kind` of a QuantizedWeight ``w`` as :func:`load`'s products take it: in the quad layout
    (:func:`quad_layout`) :data:`MAGIC` carries ``1 + high - low``, one more than the largest
    ``u = code - low``, in bits 8 and up, so that ``qmm8`` multiplies its blocks where they lie
    without a pass over each to find its own (``qkernel_avx2.cpp``)."""
    k = kind(w)
    return k | (w.high - w.low + 1) << 8 if k == MAGIC and quad_layout() else k


def code_kind(nibbles: bool, low: int, high: int, in_features: int, group: int, six: bool | None = None) -> int:
    """:func:`kind` of a weight whose codes span ``low .. high`` (``nibbles``: held two a byte;
    ``six``: whether a span of at most 64 values takes 6 bits, None: :func:`six_bits`)."""
    if nibbles:
        return NIBBLES
    if high - low < 64 and in_features % 4 == 0 and group % 4 == 0 and (six_bits() if six is None else six):
        return SIX
    return MAGIC if -64 <= low and high <= 63 else WIDE


def factor_args(w) -> tuple:
    """``(sd, sq, sshift, od, oq, oshift)``: a prepared QuantizedWeight's scales and offsets
    (:class:`~worker.models.llama.quantized.GroupScales` in the blocked layout) as ``qmm`` and
    ``dequant_t`` take them, an empty tensor for what is absent."""
    out = []
    for f in (w.scales, w.offsets):
        out += [_EMPTY, _EMPTY, 0] if f is None else [f.d, _EMPTY if f.q is None else f.q, f.shift]
    return tuple(out)


def quad_layout() -> bool:
    """Whether this machine's module (:func:`load`) takes :data:`NIBBLES`, :data:`MAGIC` and
    :data:`WIDE` codes in the quad layout (the AVX2 build, ``qkernel_pack.h``: rows as dwords, so a
    block's 4-column quads load as they lie) rather than by column pairs (the AVX-512 build)."""
    module = load()
    return bool(module is not None and hasattr(module, "quad_layout") and module.quad_layout())


def blocked(rows: torch.Tensor, code_kind: int, low: int = 0) -> torch.Tensor:
    """Row-major codes (``[N, K / 2]`` nibble pairs for :data:`NIBBLES`, else ``[N, K]`` int8) -> the
    kernel's layout for ``code_kind``, rows padded with zeros to a multiple of :data:`BLOCK`:
    ``[N / 16, K / 2, 16]`` bytes (nibbles), ``[N / 16, K / 2, 16, 2]`` int8 (each row's even and odd
    column; MAGIC, WIDE), or ``[N / 16, K / 4, 48]`` bytes (:data:`SIX`: per 4 columns the two pairs'
    low nibbles, 16 bytes each, then 16 bytes of high bit pairs; ``u = code - low``). In the quad
    layout (:func:`quad_layout`) ``[N / 16, K / 8, 16, 4]`` bytes (nibbles: per 8 columns each row's 4
    pair bytes) or ``[N / 16, K / 4, 16, 4]`` int8 (each row's 4 columns: MAGIC ``u = code - low``, WIDE
    the codes); there a row's bytes come in whole 4-byte units (K a multiple of 8 for nibbles, of 4
    for int8; ValueError otherwise)."""
    if code_kind == SIX:  # the compiled module packs them (a Q6_K head: 233M codes)
        return load().pack_six(rows.contiguous(), low)
    n, width = rows.shape
    if quad_layout():
        if width % 4:
            raise ValueError(f"the quad layout takes whole 4-byte units a row; got rows of {width} bytes")
        if code_kind == MAGIC:  # (rows past N: u = 0, as unpack_blocked pads)
            rows = (rows.to(torch.int16) - low).to(torch.int8)
        return _pad_rows(rows).view(-1, BLOCK, width // 4, 4).transpose(1, 2).contiguous()
    padded = _pad_rows(rows)
    if code_kind == NIBBLES:
        return padded.view(-1, BLOCK, width).transpose(1, 2).contiguous()
    return padded.view(-1, BLOCK, width // 2, 2).transpose(1, 2).contiguous()


def row_major(blocks: torch.Tensor, n: int, code_kind: int, rows: torch.Tensor | None = None,
              low: int = 0) -> torch.Tensor:
    """The inverse of :func:`blocked`: ``[N, width]`` (or the ``rows`` selected); int8 codes for :data:`SIX`."""
    if code_kind == SIX:
        if rows is None:  # block by block: [NB, K / 4, 16] each
            lo0, lo1, hi = blocks[:, :, :16], blocks[:, :, 16:32], blocks[:, :, 32:]
        else:  # the rows' bytes where they lie: [R, K / 4] each
            b, j = rows // BLOCK, rows % BLOCK
            lo0, lo1, hi = blocks[b, :, j], blocks[b, :, j + 16], blocks[b, :, j + 32]
        u = torch.stack((lo0 & 15 | (hi & 3) << 4, lo0 >> 4 | (hi >> 2 & 3) << 4,
                         lo1 & 15 | (hi >> 4 & 3) << 4, lo1 >> 4 | (hi >> 6) << 4), dim=-1)
        if rows is None:  # [NB, K / 4, 16, 4] -> [NB, 16, K / 4, 4]
            u = u.permute(0, 2, 1, 3).reshape(-1, blocks.shape[1] * 4)[:n]
        return (u.reshape(u.shape[0], -1).to(torch.int16) + low).to(torch.int8)
    if rows is not None:  # gather the rows' bytes where they lie: no copy of the whole table
        out = blocks[rows // BLOCK, :, rows % BLOCK].reshape(len(rows), -1)  # of [R, K / 2], [R, K / 2, 2], [R, U, 4]
    else:
        out = blocks.transpose(1, 2).reshape(blocks.shape[0] * BLOCK, -1)[:n]
    if code_kind == MAGIC and quad_layout():  # held as u = code - low
        out = (out.to(torch.int16) + low).to(torch.int8)
    return out


def blocked_groups(values: torch.Tensor) -> torch.Tensor:
    """A per-group (or per-super-block) factor's tensor ``[N, G]`` (fp16 ``d`` or (u)int8 ``q`` of a
    GroupScales) -> ``[N / 16, G, 16]`` (rows padded with zeros)."""
    return _pad_rows(values).view(-1, BLOCK, values.shape[1]).transpose(1, 2).contiguous()


def row_groups(values: torch.Tensor, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`blocked_groups`."""
    if rows is not None:
        return values[rows // BLOCK, :, rows % BLOCK]
    return values.transpose(1, 2).reshape(-1, values.shape[1])[:n]


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % BLOCK
    return t if not extra else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
