"""RoPE's inverse frequencies for a config read without its transformers module (a GGUF file).

:func:`rope_inv_freq` gives ``(inv_freq [head_dim / 2], attention_scaling)``
for one RoPE parameter dict, as transformers' ``ROPE_INIT_FUNCTIONS``
compute them (``transformers/modeling_rope_utils.py``, the same ops in the
same order, so the same fp32 values; equality tested) for the RoPE types
whose frequencies do not depend on the sequence length:

- ``default``: ``1 / theta ** (2i / d)``;
- ``linear``: the default divided by ``factor`` (position interpolation);
- ``llama3``: Llama 3.1's per-band scaling (``_compute_llama3_parameters``);
- ``yarn``: YaRN's ramp between interpolation and extrapolation, and its
  attention factor (``_compute_yarn_parameters``).

llama.cpp's form of ``llama3``: a GGUF file keeps no llama3 parameters, only
the tensor ``rope_freqs`` (``convert_hf_to_gguf.py``, ``LlamaModel.
generate_extra_tensors``: per frequency 1 below the high band, ``factor``
above the low band, ``1 / ((1 - s) / factor + s)`` between), and llama.cpp
divides each default frequency by it (``ggml_rope_ext``'s ``freq_factors``).
A parameter dict with ``freq_factors`` (:func:`worker.models.checkpoint.gguf_config`
puts the tensor there) gets ``default / freq_factors``: transformers' values
exactly in both outer bands, within one fp32 ulp between (measured: at most
1.1e-7 relative, for Llama 3.1's 8/1/4/8192 at head_dim 128).

Dynamic types (``dynamic``, ``longrope``: their frequencies change with the
sequence length) raise :class:`~worker.models.llama.family.Unsupported`.
"""

from __future__ import annotations

import math

import torch

from worker.models.llama.family import Unsupported

STATIC_TYPES = ("default", "linear", "llama3", "yarn")
"""The RoPE types :func:`rope_inv_freq` computes."""


def rope_inv_freq(params: dict, config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of one RoPE parameter dict (``rope_parameters`` or one layer
    type's entry of it: ``rope_type`` (or the older ``type``), ``rope_theta``, the type's keys);
    ``config`` for what transformers reads outside the dict (``max_position_embeddings``,
    YaRN's ``truncate``). Raises :class:`~worker.models.llama.family.Unsupported` for another
    type or partial rotary dimensions, ``ValueError`` for ``freq_factors`` of the wrong length."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_TYPES:
        raise Unsupported(f"RoPE type {rope_type!r} read from a checkpoint without its module "
                          f"(slotserve computes {', '.join(STATIC_TYPES)}); use runner='hf'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("partial rotary dimensions (partial_rotary_factor != 1)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if "freq_factors" in params:
        factors = torch.tensor(params["freq_factors"], dtype=torch.float32)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"{len(factors)} RoPE frequency factors for a head of {head_dim} (want {head_dim // 2})")
        return default_inv_freq(theta, head_dim) / factors, 1.0
    if rope_type == "default":
        return default_inv_freq(theta, head_dim), 1.0
    if rope_type == "linear":
        return default_inv_freq(theta, head_dim) / params["factor"], 1.0
    # transformers' standardize_rope_params: a config's own original_max_position_embeddings first (Phi-3's)
    original = getattr(config, "original_max_position_embeddings", None) or params.get(
        "original_max_position_embeddings", config.max_position_embeddings)
    if rope_type == "llama3":
        return llama3_inv_freq(theta, head_dim, params["factor"], params["low_freq_factor"],
                               params["high_freq_factor"], original), 1.0
    top = getattr(config, "rope_parameters", None) or params
    return yarn_inv_freq(theta, head_dim, params, original, config.max_position_embeddings,
                         top.get("truncate", True))


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """transformers' default RoPE (``_compute_default_rope_parameters``), same ops; equality tested."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original: int) -> torch.Tensor:
    """Llama 3.1's RoPE (transformers' ``_compute_llama3_parameters``), same ops: frequencies whose
    wavelength is above ``original / low_freq_factor`` divided by ``factor``, those below
    ``original / high_freq_factor`` kept, a smooth blend between."""
    inv_freq = default_inv_freq(theta, head_dim)
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def yarn_inv_freq(theta: float, dim: int, params: dict, original: int, max_positions: int,
                  truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' ``_compute_yarn_parameters``), same ops: ``(inv_freq, attention_factor)``.
    ``params``: ``factor`` (None: ``max_positions / original``), optional ``attention_factor``,
    ``mscale``, ``mscale_all_dim``, ``beta_fast`` (32), ``beta_slow`` (1)."""
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (Eq. 21; transformers' ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
