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

The quantised kernels take bf16 activations (their fp32 CPU paths are not
vectorised: tens of times slower, measured), so ``x`` is rounded to bf16 on
the way in. They are decode kernels: for many rows (prefill) they are slower
than dequantising the weight and calling the dense kernel, so above
:data:`DEQUANT_ROWS` rows the weight is dequantised on the fly (measured on
this project's 2-core Xeon; see the notes in bench/model.py's results).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEQUANT_ROWS = 64
"""Rows above which a quantised linear dequantises its weight and runs the dense kernel."""

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


class Int8Linear:
    """Weight-only int8: ``W ~= q * scale[:, None]``, ``q`` int8 ``[N, K]``."""

    __slots__ = ("qweight", "scales", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.float()
        # the kernel takes bf16 scales: round up to bf16 first, then quantise against that scale
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0 * (1 + 2 ** -7)).to(torch.bfloat16)
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale
        self.bias = bias
        self.out_features = weight.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as fp32 ``[N, K]``."""
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > DEQUANT_ROWS:
            y = F.linear(x.float(), self.dequantize())
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

    __slots__ = ("packed", "scales_zeros", "group_size", "bias", "out_features", "in_features")

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

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as fp32 ``[N, K]`` (an identity product)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales_zeros)[:, : self.out_features].float().t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, device: str):
    """The linear kind for ``precision`` holding ``weight`` ``[N, K]`` (any float dtype) on ``device``."""
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
