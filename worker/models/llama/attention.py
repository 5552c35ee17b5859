"""Attention for the Llama runner's iterations (see :mod:`worker.models.llama.model`).

- decode: each decode row's one query over its own cache row, as batched
  matrix products on views of the KV cache made once per iteration
  (:func:`decode_views`, :func:`decode_attention`): the CUDA path (it
  captures in a graph), and the CPU path where the compiled decode attention
  (:mod:`worker.models.llama.attnkernel`: one call per layer, the KV write
  included, over each row's real length) does not run;
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

    keys_t: tuple  # per layer [rows * kv_heads, D, window]
    values: tuple  # per layer [rows * kv_heads, window, D]
    bias: dict  # sliding window (None: full) -> [rows * kv_heads, queries * group or 1, window]: 0 where a
    # query sees the key, -inf at or past its length (and, with a window, at or before length - window)
    kv_heads: int
    queries: int  # per row: 1, or 1 + draft tokens (speculative decoding)
    slots: torch.Tensor | None  # queries > 1: each query's place among rows * queries


def decode_views(kv: torch.Tensor, b: int, w: int, lengths: torch.Tensor, queries: int = 1,
                 group: int = 1, slots: torch.Tensor | None = None, windows=frozenset({None}),
                 dtype: torch.dtype | None = None) -> DecodeViews:
    """The operands for decode rows ``0..b-1`` of ``kv`` (``[layers, 2, rows, kv_heads, capacity, D]``)
    over the window ``[0, w)``.

    ``lengths`` ``[b * queries]``: the keys each query place sees, row-major
    (row ``r``'s are ``r * queries ..``). ``queries > 1`` (speculative
    decoding: the row's token and its draft tokens) needs ``group``, the
    query heads per key/value head, and ``slots``, the place of each query
    :func:`decode_attention` gets (the other places are padding). ``windows``:
    the layers' sliding windows (None: full attention), a mask for each; a
    query of length ``n`` (position ``n - 1``) sees keys ``n - window .. n - 1``. ``dtype``: the
    queries' (the masks'), None: the cache's; :func:`decode_attention` upcasts a narrower cache's
    keys and values to it.
    """
    layers, _, _, heads, _, d = kv.shape
    # rows and heads merge without a copy (view() would raise otherwise): the views see the keys
    # and values the layer loop writes after they are made
    keys = kv[:, 0, :b, :, :w].view(layers, b * heads, w, d)
    values = kv[:, 1, :b, :, :w].view(layers, b * heads, w, d)
    keys_at = torch.arange(w, device=kv.device)[None, :]
    biases = {}
    for window in windows:
        visible = keys_at < lengths[:, None]
        if window is not None:
            visible &= keys_at >= lengths[:, None] - window
        bias = torch.zeros(visible.shape, dtype=dtype or kv.dtype, device=kv.device)
        bias.masked_fill_(~visible, float("-inf"))
        if queries == 1:
            bias = bias[:, None, None].expand(b, heads, 1, w).reshape(b * heads, 1, w)
        else:  # [rows * kv_heads, queries * group, window]: each query's mask over its group of heads
            bias = bias.view(b, 1, queries, 1, w).expand(b, heads, queries, group, w).reshape(b * heads, -1, w)
        biases[window] = bias
    return DecodeViews(keys.transpose(2, 3).unbind(0), values.unbind(0), biases, heads, queries, slots)


def decode_attention(q, views: DecodeViews, layer: int, scaling, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """``[n_decode, heads, D]``: each query over its own cache row's window; ``window``: the layer's
    sliding window (None: full); ``softcap``: scores become ``softcap * tanh(scores / softcap)``
    before the mask (Gemma 2, transformers' ``eager_attention_forward``), or None.

    Plain batched matrix products, a query group per ``(row, kv head)``
    (grouped-query heads as a ``[n_decode * kv_heads, group]`` view, no key/value
    copies), the length mask added inside the first product (``baddbmm``):
    one fixed kernel sequence for every shape, so nothing is re-planned per
    batch size or window, and it captures in a CUDA graph. With several
    queries per row (speculative decoding) they are one ``[queries * group]``
    block per ``(row, kv head)``, each with its own length.
    """
    n, heads, d = q.shape
    kv, t, bias = views.kv_heads, views.queries, views.bias[window]
    if t == 1:
        qg = (q * scaling).view(n * kv, heads // kv, d)
    else:  # placed: [rows, queries, kv, group, D] -> [rows * kv, queries * group, D]
        places = bias.shape[0] // kv * t
        placed = q.new_zeros(places, heads, d).index_copy_(0, views.slots, q * scaling)
        qg = placed.view(-1, t, kv, heads // kv, d).transpose(1, 2).reshape(places // t * kv, -1, d)
    keys_t, values = views.keys_t[layer], views.values[layer]
    if keys_t.dtype != qg.dtype:  # a 16-bit cache, fp32 activations: the products stay fp32
        keys_t, values = keys_t.transpose(1, 2).to(qg.dtype).transpose(1, 2), values.to(qg.dtype)
    if softcap is None:
        scores = torch.baddbmm(bias, qg, keys_t)  # [rows * kv_heads, t * group, window]
    else:
        scores = torch.tanh(torch.bmm(qg, keys_t) / softcap).mul_(softcap).add_(bias)
    probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else torch.softmax(
        scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, values)
    if t == 1:
        return out.view(n, heads, d)
    out = out.view(-1, kv, t, heads // kv, d).transpose(1, 2).reshape(-1, heads, d)
    return out.index_select(0, views.slots)


def prefill_attention(q, k, v, cache, span, mask, scaling, softcap: float | None = None) -> torch.Tensor:
    """``[count, heads, D]``: one prefill sequence, causal over its own keys.

    ``q``, ``k``, ``v``: the iteration's ``[N, heads or kv_heads, D]``; ``cache``
    the layer's ``[2, rows, kv_heads, capacity, D]`` (keys, values); ``span`` a
    :class:`~worker.models.llama.plan.PrefillSpan` (which entries, cache row and
    start); ``mask`` its :func:`chunk_mask` (a later chunk, or a sliding window) or
    None (a fresh prompt, plain causal). Keys and values are read as the cache stores them (a
    fresh prompt's rounded to a narrower cache's dtype too), so a prompt gives the same keys
    whole, in chunks, or after a prefix-cache hit. ``softcap``: see :func:`decode_attention`
    (SDPA has none, so those scores are computed here).
    """
    offset, count, row, start = span
    qs = q[offset:offset + count].transpose(0, 1)[None]
    if start == 0:  # a fresh prompt: its keys are the new ones
        ks = k[offset:offset + count].transpose(0, 1)[None]
        vs = v[offset:offset + count].transpose(0, 1)[None]
        if cache.dtype != ks.dtype:  # as stored (a 16-bit cache): what a later chunk or a prefix hit reads
            ks, vs = ks.to(cache.dtype).to(ks.dtype), vs.to(cache.dtype).to(vs.dtype)
    else:  # a later chunk: the whole prefix is in the cache row
        end = start + count
        ks, vs = cache[0, row:row + 1, :, :end].to(qs.dtype), cache[1, row:row + 1, :, :end].to(qs.dtype)
    if softcap is not None:
        out = _softcapped_attention(qs, ks, vs, mask if mask is not None else chunk_mask(count, 0, qs.device),
                                    scaling, softcap)
    elif mask is None:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)


def _softcapped_attention(qs, ks, vs, mask, scaling, softcap: float) -> torch.Tensor:
    """``[1, heads, count, D]``: attention with soft-capped scores, as transformers'
    ``eager_attention_forward`` (scores ``q k^T * scaling``, capped, masked, softmax in fp32)."""
    group = qs.shape[1] // ks.shape[1]
    ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(qs, ks.transpose(2, 3)).mul_(scaling / softcap)).mul_(softcap)
    scores = scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype), vs)


def chunk_mask(count: int, start: int, device, window: int | None = None) -> torch.Tensor:
    """``[count, start + count]`` bool: query ``i`` (position ``start + i``) sees keys ``0..start + i``;
    with a sliding ``window``, only the last ``window`` of them (keys ``> start + i - window``)."""
    keys = torch.arange(start + count, device=device)[None, :]
    positions = (start + torch.arange(count, device=device))[:, None]
    visible = keys <= positions
    return visible if window is None else visible & (keys > positions - window)
