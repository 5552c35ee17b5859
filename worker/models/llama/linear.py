"""Linear layers at each precision, on torch's own kernels.

Every kind takes activations ``x [M, K]`` in the runner's activation dtype
and returns ``[M, N]`` in the same dtype; what differs is how the weight is
stored and which kernel multiplies it:

- :class:`DenseLinear` -- fp32 or bf16 weight, ``torch.nn.functional.linear``
  (MKL / oneDNN on CPU, cuBLAS on CUDA).
- :class:`Int8Linear` -- weight-only int8, one scale per output row
  (symmetric, ``scale = max|w| / 127``), ``torch.ops.aten._weight_int8pack_mm``.
- :class:`Int4Linear` -- weight-only int4 in groups of ``group_size`` input
  columns with a scale and a zero per group (asymmetric min/max, as in
  gpt-fast's ``group_quantize_tensor`` and llama.cpp's Q4_1), packed by
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and multiplied by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

The weight-only kernels take bf16 activations (their fp32 CPU paths are not
vectorised: tens of times slower, measured), so ``x`` is rounded to bf16 on
the way in. They are small-batch kernels: their cost grows almost linearly
with the rows, so above :data:`INT8_ROWS` / :data:`INT4_ROWS` rows the
quantised kinds switch to an int8 x int8 product with per-row activation
scales (see :class:`Int8Linear`), which is faster there.

Measured on a 2-core Ice Lake Xeon (avx512_vnni, no avx512_bf16), one thread,
the 30 layers of SmolLM2-135M (ms; 1 / 8 / 32 / 256 rows): fp32 ``F.linear``
40 / 90 / 125 / 417, fp32 oneDNN prepacked 48 / 55 / 89 / 446, bf16
``F.linear`` 35 / 118 / 281 / -, int8 weight-only 23 / 46 / 124 / 993, int4
weight-only 11 / 30 / 110 / 825, int8 x int8 per-row (this module's glue
included) 25 / 33 / 47 / 245.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_ROWS = 4
"""Rows up to which :class:`Int8Linear` uses the weight-only kernel (above: int8 x int8)."""

INT4_ROWS = 12
"""Rows up to which :class:`Int4Linear` uses the int4 kernel (above: its int8 twin, int8 x int8)."""

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
    """fp32 ``y = x @ W.T (+ b)`` on oneDNN with the weight reordered once into its blocked layout.

    Measured on a 2-core Xeon (Ice Lake), one thread, SmolLM2-135M shapes:
    at 8 rows the 30 layers' products take 55 ms against 90 ms for MKL's
    ``F.linear`` (which repacks the weight on every call), the 49152-row LM
    head 16 ms against 39 ms; at 256 rows (prefill) 446 ms against 417 ms.
    The packed weight serves any number of rows. ``add`` fuses the
    residual add (oneDNN's binary post-op).
    """

    __slots__ = ("weight", "bias", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 8) -> None:
        w = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = w.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.bias = None if bias is None else bias.to(torch.float32, copy=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, residual, self.weight, self.bias, "add")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4


class Int8Linear:
    """int8 weights: ``W ~= q * scale[:, None]``, ``q`` int8 ``[N, K]``, one scale per output row.

    Up to :data:`INT8_ROWS` rows: weight-only, bf16 activations,
    ``torch.ops.aten._weight_int8pack_mm``. More rows: activations
    are quantised to int8 per row (symmetric, ``max|x_row| / 127``, so a row's
    result never depends on the other rows) and multiplied exactly in int32 by
    ``torch._int_mm`` (oneDNN, VNNI where the CPU has it): measured 2-3x
    faster than dequantising the weight for fp32 ``F.linear`` at 256-512 rows,
    and than the weight-only kernel from about 4 rows on.
    """

    __slots__ = ("qweight", "scales", "scales_f32", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.float()
        # the kernel takes bf16 scales: round up to bf16 first, then quantise against that scale
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0 * (1 + 2 ** -7)).to(torch.bfloat16)
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale
        self.scales_f32 = scale.float()
        self.bias = bias
        self.out_features = weight.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The weight the kernels multiply by, as fp32 ``[N, K]``."""
        return self.qweight.float() * self.scales_f32[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT8_ROWS:
            x = x.float()
            x_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            x_q = (x / x_scale).round_().to(torch.int8)
            y = torch._int_mm(x_q, self.qweight.t()) * (x_scale * self.scales_f32)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2


class Int4Linear:
    """Weight-only int4 in groups of :data:`INT4_GROUP` input columns (scale and zero per group).

    Dequantised weight: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``
    with ``g = k // group_size`` and ``q`` in 0..15 (the formula of torch's
    ``_weight_int4pack_mm`` kernels). Needs ``K % group_size == 0``.
    """

    __slots__ = ("packed", "scales_zeros", "group_size", "bias", "out_features", "in_features", "prefill")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = INT4_GROUP) -> None:
        n, k = weight.shape
        if k % group_size:
            raise ValueError(f"int4 needs in_features % {group_size} == 0, got {k}")
        rows = -(-n // 16) * 16  # the packing kernel wants N % 16 == 0: zero rows, sliced off after
        padded = torch.zeros(rows, k) if rows != n else None
        if padded is not None:
            padded[:n] = weight
        groups = (weight.float() if padded is None else padded).reshape(rows, k // group_size, group_size)
        lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        # the kernel takes bf16 scales and zeros: round them first, then quantise against them
        scale = ((hi - lo).clamp(min=1e-6) / 15.0 * (1 + 2 ** -7)).to(torch.bfloat16).float()
        zero = (lo + 8.0 * scale).to(torch.bfloat16).float()
        q = torch.round((groups - zero) / scale + 8.0).clamp_(0, 15).to(torch.int32).reshape(rows, k)
        # [K / group, N, 2]: (scale, zero) per group and output row, the kernel's layout
        self.scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.group_size = group_size
        self.bias = bias
        self.out_features, self.in_features = n, k
        # Many rows: the int4 kernel is slower than fp32 there (measured: 825 ms against 417 ms for
        # 256 rows of SmolLM2's layers), so an int8 copy of the weight serves them with
        # Int8Linear's int8 x int8 product.
        self.prefill = Int8Linear(weight, bias)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as fp32 ``[N, K]`` (an identity product)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales_zeros)[:, : self.out_features].float().t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_ROWS:
            return self.prefill(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2 + self.prefill.nbytes


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, device: str):
    """The linear kind for ``precision`` holding ``weight`` ``[N, K]`` (any float dtype) on ``device``."""
    if precision == "fp32" and device == "cpu" and torch.backends.mkldnn.is_available():
        return PackedLinear(weight, bias)
    if precision in ("fp32", "bf16"):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        return DenseLinear(weight.to(device=device, dtype=dtype, copy=True),
                           None if bias is None else bias.to(device=device, dtype=dtype, copy=True))
    if bias is not None:
        bias = bias.to(device=device, dtype=torch.float32, copy=True)  # added to the fp32 output
    if device != "cpu":
        raise ValueError(f"precision {precision} runs on CPU only; on CUDA use bf16")
    if precision == "int8":
        return Int8Linear(weight, bias)
    if precision == "int4":
        return Int4Linear(weight, bias)
    raise ValueError(f"unknown precision {precision!r}")
