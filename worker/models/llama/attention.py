"""Attention for the Llama runner's iterations (see :mod:`worker.models.llama.model`).

- decode: each decode row's one query over its own cache row, as batched
  matrix products on views of the KV cache made once per iteration
  (:func:`decode_views`, :func:`decode_attention`);
- prefill: one sequence's new tokens, causal over its own keys, through
  ``F.scaled_dot_product_attention`` (:func:`prefill_attention`, with
  :func:`chunk_mask` for a later chunk of a long prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeViews:
    """The decode attention's operands for every layer, as views made once per iteration."""

    keys_t: tuple  # per layer [n_decode * kv_heads, D, window]
    values: tuple  # per layer [n_decode * kv_heads, window, D]
    bias: torch.Tensor  # [n_decode * kv_heads, 1, window]: 0, or -inf past a row's length
    kv_heads: int


def decode_views(kv: torch.Tensor, b: int, w: int, lengths: torch.Tensor) -> DecodeViews:
    """The operands for decode rows ``0..b-1`` of ``kv`` (``[layers, 2, rows, kv_heads, capacity, D]``)
    over the window ``[0, w)``; ``lengths`` ``[b]``: the keys each row sees."""
    layers, _, _, heads, _, d = kv.shape
    # rows and heads merge without a copy (view() would raise otherwise): the views see the keys
    # and values the layer loop writes after they are made
    keys = kv[:, 0, :b, :, :w].view(layers, b * heads, w, d)
    values = kv[:, 1, :b, :, :w].view(layers, b * heads, w, d)
    visible = torch.arange(w, device=kv.device)[None, :] < lengths[:, None]
    bias = torch.zeros(visible.shape, dtype=kv.dtype, device=kv.device).masked_fill_(~visible, float("-inf"))
    bias = bias[:, None, None].expand(b, heads, 1, w).reshape(b * heads, 1, w)
    return DecodeViews(keys.transpose(2, 3).unbind(0), values.unbind(0), bias, heads)


def decode_attention(q, views: DecodeViews, layer: int, scaling) -> torch.Tensor:
    """``[n_decode, heads, D]``: each query over its own cache row's window.

    Plain batched matrix products, a query group per ``(row, kv head)``
    (grouped-query heads as a ``[n_decode * kv_heads, group]`` view, no key/value
    copies), the length mask added inside the first product (``baddbmm``):
    one fixed kernel sequence for every shape, so nothing is re-planned per
    batch size or window, and it captures in a CUDA graph.
    """
    b, heads, d = q.shape
    qg = (q * scaling).view(b * views.kv_heads, heads // views.kv_heads, d)
    scores = torch.baddbmm(views.bias, qg, views.keys_t[layer])  # [b * kv_heads, group, window]
    probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else torch.softmax(
        scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, views.values[layer]).view(b, heads, d)


def prefill_attention(q, k, v, k_cache, v_cache, offset, count, row, start, mask, scaling) -> torch.Tensor:
    """``[count, heads, D]``: one prefill sequence, causal over its own keys."""
    qs = q[offset:offset + count].transpose(0, 1)[None]
    if start == 0:  # a fresh prompt: its keys are the new ones
        ks = k[offset:offset + count].transpose(0, 1)[None]
        vs = v[offset:offset + count].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
    else:  # a later chunk: the whole prefix is in the cache row
        end = start + count
        ks, vs = k_cache[row:row + 1, :, :end], v_cache[row:row + 1, :, :end]
        out = F.scaled_dot_product_attention(qs, ks.to(qs.dtype), vs.to(qs.dtype), attn_mask=mask,
                                             scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)


def chunk_mask(count: int, start: int, device) -> torch.Tensor:
    """``[count, start + count]`` bool: query ``i`` (position ``start + i``) sees keys ``0..start + i``."""
    keys = torch.arange(start + count, device=device)
    return keys[None, :] <= (start + torch.arange(count, device=device))[:, None]
