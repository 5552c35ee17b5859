"""Linear layers at each precision, on torch's own kernels.

Every kind takes activations ``x [M, K]`` in the runner's activation dtype
and returns ``[M, N]`` in the same dtype; what differs is how the weight is
stored and which kernel multiplies it:

- :class:`PackedLinear` -- fp32 weight packed once for MKL's ``sgemm_compute``,
  or fp32/bf16 weight in oneDNN's blocked layout (CPU).
- :class:`DenseLinear` -- fp32 or bf16 weight, ``torch.nn.functional.linear``
  (cuBLAS on CUDA).
- :class:`Int8Linear` -- weight-only int8, one scale per output row
  (symmetric, ``scale = max|w| / 127``), ``torch.ops.aten._weight_int8pack_mm``.
- :class:`Int4Linear` -- weight-only int4 in groups of 32 input columns with a
  scale and a zero per group (asymmetric min/max, as in gpt-fast's
  ``group_quantize_tensor`` and llama.cpp's Q4_1), packed by
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and multiplied by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``.
- :class:`~worker.models.llama.quantized.QuantizedWeight` -- precision
  ``gguf``: a GGUF file's block-quantised weight as stored (its own module);
  :class:`ConcatLinear` runs a fused q/k/v or gate/up whose parts the file
  stores in different formats.

On CPU, fp32 and bf16 use ``onednn`` where torch has it (the kind whose rows do not depend on
the rows beside them), else whichever of ``dense`` and ``mkl`` is measured fastest on the CPU at
hand for the model's layer shapes (:func:`cpu_linear_kind`, once per process): the order flips
between CPUs (measured below and in :class:`PackedLinear`).

The weight-only kernels take bf16 activations (their fp32 CPU paths are not
vectorised: tens of times slower, measured), so ``x`` is rounded to bf16 on
the way in. They are small-batch kernels: their cost grows almost linearly
with the rows, so above ``KERNEL_ROWS`` rows (a prefill; per kind, where the
two cost the same) the quantised kinds dequantise the very same weights to
fp32 and use the dense kernel.

Measured on a 2-core Ice Lake Xeon (avx512_vnni, no avx512_bf16), one thread,
the 30 layers of SmolLM2-135M (ms; 1 / 8 / 32 / 256 rows): fp32 ``F.linear``
40 / 90 / 125 / 417, fp32 oneDNN prepacked 48 / 55 / 89 / 446, bf16
``F.linear`` 35 / 118 / 281 / -, int8 weight-only 23 / 46 / 124 / 993, int4
weight-only 11 / 30 / 110 / 825. (An int8 x int8 product with per-row
activation scales, ``torch._int_mm``, was faster from 8 rows on -- 33 / 47 /
245 ms -- but agreed with fp32 greedy on 1 of 8 HumanEval prompts against 3
for weight-only int8, so it is not used.) Two threads, same layers, later
(ms; 1 / 8 / 32 / 128 / 256 / 512 rows): MKL packed 19.5 / 25.7 / 44.0 /
130 / 216 / 491, oneDNN prepacked 25.9 / 35.1 / 52.9 / 144 / 219 / 511,
``F.linear`` 17.7 / 55.1 / 107 / 138 / 240 / 497. On a 2-core AMD EPYC with
avx512_bf16, 2 threads (ms; 1 / 8 / 32 / 128 / 512 rows): MKL packed 26.8 /
49.8 / 83.8 / 212 / 603, oneDNN prepacked 17.0 / 17.3 / 39.0 / 136 / 503,
``F.linear`` 33.9 / 47.3 / 79.3 / 213 / 608; bf16 ``F.linear`` 16.8 / 20.8 /
32.1 / 86.4 / 282, bf16 oneDNN prepacked 9.3 / 10.1 / 21.5 / 70.6 / 257;
int8 weight-only 7.1 / 22.0 / 61.2 (32 rows).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from worker.models.heap import bound_onednn_caches
from worker.models.llama import qkernel
from worker.models.llama.quantized import QuantizedWeight


PACK_ROWS = 512
"""Row hint for packing fp32 weights (MKL's packed layout for 512 rows was as fast as
the one for 8 or 64 rows at 1-32 rows, and faster from 64 rows on: measured, see PackedLinear)."""

INT4_GROUP = 32
"""Input columns per int4 scale/zero group (llama.cpp's Q4_0/Q4_1 block size)."""


class DenseLinear:
    """``y = x @ W.T (+ b)`` with ``W`` stored in ``weight.dtype`` (fp32 or bf16)."""

    __slots__ = ("weight", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype:
            return F.linear(x, w, self.bias)
        return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (one ``addmm`` when dtypes allow: the residual add is fused)."""
        w = self.weight
        if x.dtype == w.dtype and self.bias is None and x.dim() == 2:
            return torch.addmm(residual, x, w.t())
        return residual + self(x)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class PackedLinear:
    """``y = x @ W.T (+ b)`` on a weight packed once for one of the CPU's GEMM libraries.

    ``kind``:

    - ``"mkl"`` (fp32 only): ``cblas_sgemm_pack`` through
      ``torch.ops.mkl._mkl_reorder_linear_weight`` and ``cblas_sgemm_compute``
      through ``torch.ops.mkl._mkl_linear``, the kernel torch's inductor picks
      for frozen fp32 linears on CPU. Packed once with :data:`PACK_ROWS` as the
      row hint, it serves any number of rows (each call passes its own row
      count, so the packed path always runs; that the packed format does not
      depend on the row count is checked in tests/models/test_llama_runner.py).
    - ``"onednn"`` (fp32 or bf16): oneDNN's blocked layout
      (``torch.ops.mkldnn._reorder_linear_weight``) and
      ``torch.ops.mkldnn._linear_pointwise``. A bf16 weight takes bf16
      activations: ``x`` is rounded on the way in and the product returned in
      ``x``'s dtype.

    Which one a runner uses: oneDNN's where it exists (:func:`cpu_linear_kind`: its rows are
    batch-invariant), or the one named. Measured: on a 2-core Ice Lake Xeon MKL's packed fp32 was
    the faster (a decode step at 8 slots 86 -> 59 ms; oneDNN's fused residual
    add alone cost 15 ms of the 86, so the add is a separate in-place op), on a
    2-core AMD EPYC with avx512_bf16 oneDNN's (30 layers of SmolLM2-135M at 8
    rows: 17 ms against 50, and MKL's packed buffers took ~35 % more memory).
    """

    __slots__ = ("weight", "bias", "out_features", "in_features", "kind", "dtype", "_shape")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "mkl",
                 dtype: torch.dtype = torch.float32) -> None:
        if kind == "mkl" and dtype != torch.float32:
            raise ValueError(f"MKL's packed GEMM is fp32 only, not {dtype}")
        w = weight.to(dtype).contiguous()
        self.out_features, self.in_features = w.shape
        self.kind, self.dtype = kind, dtype
        if kind == "mkl":
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
            # _mkl_linear reads only the sizes and dtype of the plain weight on its packed
            # path: a zero-stride view stands in for it, so the weight is held once.
            self._shape = torch.zeros(1, 1).expand(self.out_features, self.in_features)
        elif kind == "onednn":
            bound_onednn_caches()
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_ROWS)
        else:
            raise ValueError(f"unknown packed kind {kind!r}; choose from {PACKED_KINDS}")
        self.bias = None if bias is None else bias.to(dtype, copy=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mkl":
            return torch.ops.mkl._mkl_linear(x, self.weight, self._shape, self.bias, x.numel() // self.in_features)
        if x.numel() == self.in_features and x.dim() >= 1:  # one row, whatever its leading shape ([K], [1, 1, K])
            # oneDNN multiplies one row on another path (a matrix-vector product) whose sums
            # differ in the last bits from that row's among others (fp32 and bf16, K above 1024,
            # measured on a 2-core Zen 4: every row of 12 in fp32, 1-3 of 12 in bf16), and from
            # two rows on a row's result does not depend on the rows beside it (the same bits
            # at 2 to 600 rows): so one row runs as two, and a request's tokens do not depend
            # on whether it decoded alone (batch invariance)
            return self(x.reshape(1, -1).expand(2, -1))[:1].reshape(*x.shape[:-1], self.out_features)
        if x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, self.bias, "none", [], "")
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (the sum computed in place in the product's buffer)."""
        y = self(x)
        return y.add_(residual) if y.dtype == residual.dtype else residual + y

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * (4 if self.dtype == torch.float32 else 2)


PACKED_KINDS = ("mkl", "onednn")

ONEDNN_ROWS = 8
"""Row hint for oneDNN's packing (1, 8, 64 and 512 were measured on an AMD EPYC: 8 and up
tie at 1-512 rows; 1 was 1.7x slower at 8 rows)."""


def cpu_linear_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The CPU linear kinds this torch build can run for weights of ``dtype`` (fp32 or bf16)."""
    kinds = ["dense"]
    if dtype == torch.float32 and torch._C.has_mkl:
        kinds.append("mkl")
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        kinds.append("onednn")
    return tuple(kinds)


def cpu_linear_kind(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], named: str | None = None,
                    rows: tuple[int, ...] = (1, 8, 64)) -> str:
    """The CPU linear kind for ``dtype`` weights of ``shapes`` ``(N, K)``: ``named``, else
    ``"onednn"`` where this build has it, else the fastest.

    oneDNN's is the one kind whose row does not depend on the rows beside it (with
    :class:`PackedLinear` running one row as two): ``dense`` and MKL's packed GEMM move a row
    by up to ~2e-6 (fp32) with the call's row count, so a request's greedy tokens could follow
    what it was batched with, and a prompt's logits how it was chunked (a prefix-cache hit).
    It is also the fastest measured on a 2-core AMD EPYC (fp32 and bf16); on a 2-core Intel
    Ice Lake MKL's packed fp32 was ~25 % faster at 1-8 rows (``--cpu-linear mkl`` names it).

    Without oneDNN, each candidate (:func:`cpu_linear_candidates`)
    multiplies random weights of ``shapes`` by ``rows``-row activations; the
    lowest sum over ``rows`` of the best of 6 passes wins. The candidates take
    turns pass by pass, so a burst of load from elsewhere slows all of them
    alike (about 0.2 s on 2 cores for one Llama layer's shapes). The answer is
    kept per ``(dtype, shapes, rows)`` for the process.

    Raises ValueError when ``named`` is a kind this build cannot run for ``dtype``.
    """
    bound_onednn_caches()  # before the first oneDNN product: the libraries read it once
    candidates = cpu_linear_candidates(dtype)
    if named is None:
        if "onednn" in candidates:
            return "onednn"
        return _fastest(candidates, dtype, tuple(shapes), tuple(rows))
    if named not in candidates:
        why = "MKL's packed GEMM is fp32 only" if named == "mkl" and torch._C.has_mkl else (
            f"this torch build runs {', '.join(candidates)}")
        raise ValueError(f"cpu_linear={named!r} for {dtype} weights: {why}")
    return named


def best_times(calls: dict, passes: int) -> dict:
    """The fastest of ``passes`` runs of each of ``calls`` (name -> no-argument callable), in
    seconds. The calls take turns pass by pass, so a burst of load from elsewhere slows all of
    them alike; the first pass warms caches and kernels up and counts only if fastest."""
    best = dict.fromkeys(calls, float("inf"))
    with torch.inference_mode():
        for _ in range(passes):
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=None)
def _fastest(candidates, dtype: torch.dtype, shapes, rows, passes: int = 6) -> str:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    linears = {kind: [_cpu_linear(w, None, kind, dtype) for w in weights] for kind in candidates}
    inputs = {m: [torch.randn(m, k, generator=gen) for _, k in shapes] for m in rows}
    best = best_times({(kind, m): functools.partial(_run_all, linears[kind], inputs[m])
                       for kind in candidates for m in rows}, passes)
    return min(candidates, key=lambda kind: sum(best[kind, m] for m in rows))


def _run_all(linears, inputs) -> None:
    for lin, x in zip(linears, inputs):
        lin(x)


def _cpu_linear(weight, bias, kind: str, dtype: torch.dtype):
    if kind == "dense":
        return DenseLinear(weight.to(dtype=dtype, copy=True), None if bias is None else bias.to(dtype, copy=True))
    return PackedLinear(weight, bias, kind, dtype)


class _Quantised:
    """Shared by the int kinds: the kernel up to ``KERNEL_ROWS`` prompt rows, the dequantised weight
    above, but for a step's decode rows (:func:`~worker.models.llama.qkernel.leading_exact_rows`),
    which keep the kernel's bits whatever prompt chunk shares their step."""

    __slots__ = ()
    KERNEL_ROWS: int  # set by each kind, measured

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if qkernel.past(self.KERNEL_ROWS, x.shape[0]):
            y = F.linear(x.float(), self.dequantize())
            y = (y if self.bias is None else y + self.bias).to(x.dtype)
            return qkernel.own_decode_rows(y, x, self.KERNEL_ROWS, self)
        y = self._kernel(x.to(torch.bfloat16))
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)


class Int8Linear(_Quantised):
    """Weight-only int8: ``W ~= q * scale[:, None]``, ``q`` int8 ``[N, K]``, one scale per output row."""

    __slots__ = ("qweight", "scales", "bias", "out_features")
    KERNEL_ROWS = 64
    """Measured (2 threads, SmolLM2's 30 layers; kernel vs dequantise + fp32, ms): 185 vs 200 at
    64 rows, 283 vs 231 at 96."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.float()
        # the kernel takes bf16 scales: round up to bf16 first, then quantise against that scale
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0 * (1 + 2 ** -7)).to(torch.bfloat16)
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale
        self.bias = bias
        self.out_features = weight.shape[0]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as fp32 ``[N, K]``."""
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2


class Int4Linear(_Quantised):
    """Weight-only int4 in groups of :data:`INT4_GROUP` input columns (scale and zero per group).

    Dequantised weight: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``
    with ``g = k // 32`` and ``q`` in 0..15 (the formula of torch's
    ``_weight_int4pack_mm`` kernels). Needs ``K % 32 == 0``. The scale is
    ``(max - min) / 15`` of the group, so weights that came from a 4-bit
    format with 32-column blocks (llama.cpp's Q4_1, as in the SmolLM2 GGUF)
    get their own codes back. The codes are also kept in a plain layout (two
    per byte), to dequantise exactly these weights for many-row products.
    """

    __slots__ = ("packed", "scales_zeros", "codes", "scale", "offset", "bias", "out_features", "in_features")
    KERNEL_ROWS = 192
    """Measured (2 threads, SmolLM2's 30 layers; kernel vs dequantise + fp32, ms): 123 vs 278 at
    64 rows, 327 vs 422 at 128, 465 vs 499 at 192, 603 vs 568 at 256. A prefill iteration of
    HE32 (one prompt beside 7 decoding rows) has 50-180 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = weight.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs in_features % {INT4_GROUP} == 0, got {k}")
        rows = -(-n // 16) * 16  # the packing kernel wants N % 16 == 0: zero rows, sliced off after
        w = torch.zeros(rows, k)
        w[:n] = weight
        groups = w.reshape(rows, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        # the kernel takes bf16 scales and zeros: round them first, then quantise against them
        scale = ((hi - lo).clamp(min=1e-6) / 15.0).to(torch.bfloat16).float()
        zero = (lo + 8.0 * scale).to(torch.bfloat16).float()
        q = torch.round((groups - zero) / scale + 8.0).clamp_(0, 15)
        # [K / group, N, 2]: (scale, zero) per group and output row, the kernel's layout
        self.scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(rows, k).contiguous(), 1)
        codes = q[:n].to(torch.uint8).reshape(n, k)
        self.codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # two codes per byte, [N, K / 2]
        self.scale, self.offset = scale[:n], (zero - 8.0 * scale)[:n]
        self.bias = bias
        self.out_features, self.in_features = n, k

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)

    def unpacked_codes(self) -> torch.Tensor:
        """The 4-bit codes, one per byte, ``[N, K // 32, 32]``."""
        c = self.codes
        return torch.stack((c & 15, c >> 4), dim=-1).reshape(self.out_features, -1, INT4_GROUP)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as fp32 ``[N, K]``."""
        return torch.addcmul(self.offset, self.unpacked_codes().float(), self.scale).reshape(
            self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2
                + self.codes.numel() + 8 * self.scale.numel())


class ConcatLinear:
    """``x @ W.T`` for ``W`` the rows of ``parts`` stacked (q, k, v), each part run by its own linear
    and the outputs put side by side: a fused linear whose parts a GGUF file stores in different
    formats (a Q4_K_M file's Q4_K q and k beside a Q6_K v), which one
    :class:`~worker.models.llama.quantized.QuantizedWeight` cannot hold."""

    __slots__ = ("parts", "out_features")

    def __init__(self, parts: list) -> None:
        self.parts = list(parts)
        self.out_features = sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def make_linear(weight, bias: torch.Tensor | None, precision: str, device: str, kind: str | None = None):
    """The linear kind for ``precision`` holding ``weight`` ``[N, K]`` (any float dtype, or a
    :class:`~worker.models.llama.quantized.QuantizedWeight`) on ``device``.

    fp32 and bf16 on CPU: ``kind`` (``"dense"`` or one of :data:`PACKED_KINDS`; default:
    :func:`cpu_linear_kind` measured for this weight's shape). ``gguf``: a QuantizedWeight as it
    is (its tensors shared, ``bias`` added in fp32), a tensor (a weight the file stores F32/F16)
    as fp32; at any other precision a QuantizedWeight is dequantised first.

    Raises ValueError for int8/int4/gguf off the CPU or an unknown precision or kind.
    """
    if precision == "gguf":
        if device != "cpu":
            raise ValueError("precision gguf runs on CPU only; on CUDA use bf16")
        if isinstance(weight, QuantizedWeight):
            return weight if bias is None else weight.with_bias(bias)
        precision = "fp32"
        if kind is None and "onednn" in cpu_linear_candidates(torch.float32):
            # oneDNN's: a row's bits whatever the rows beside it (dense and MKL's packed GEMM moved by
            # up to 5e-3 between a prompt whole and in chunks), as gguf's compiled products
            kind = "onednn"
    elif isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    if precision in ("fp32", "bf16"):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        if device == "cpu":
            return _cpu_linear(weight, bias, kind or cpu_linear_kind(dtype, (tuple(weight.shape),)), dtype)
        return DenseLinear(weight.to(device=device, dtype=dtype, copy=True),
                           None if bias is None else bias.to(device=device, dtype=dtype, copy=True))
    if device != "cpu":
        raise ValueError(f"precision {precision} runs on CPU only; on CUDA use bf16")
    if bias is not None:
        bias = bias.to(device=device, dtype=torch.float32, copy=True)  # added to the fp32 output
    if precision == "int8":
        return Int8Linear(weight, bias)
    if precision == "int4":
        return Int4Linear(weight, bias)
    raise ValueError(f"unknown precision {precision!r}")
