"""The Llama forward pass over a step plan: one layer loop, two attention shapes.

:func:`forward` runs all new tokens of an iteration in ONE pass (a
:class:`~worker.models.llama.plan.StepPlan` over the weights of
:mod:`worker.models.llama.weights`): the decode rows (one token each) and the
prefill tokens (whole prompts, or chunks of long ones) are packed into one
``[N, hidden]`` matrix, so every weight is read once per iteration. Only
attention tells them apart:

- decode: the first ``n_decode`` entries are cache rows ``0..n_decode-1``
  (one query each) and attend over the window ``[0, window)`` of their own
  cache rows, a view (no copy), with an additive mask hiding positions at
  or past each row's length. Rows in that range that are not decoding
  (free, or still prefilling) are padding: token 0, writing its key/value to
  the cache's scratch position (see :mod:`worker.models.llama.cache`).
- prefill: each sequence attends causally over its own keys: the new ones
  (a fresh prompt) or its cache row (a later chunk of a long prompt).

Per-iteration Python work is one loop over the layers (:func:`_attention`
and :func:`_mlp` per layer) plus one small loop over prefill sequences;
positions, masks and cos/sin are built once per iteration
(:class:`_Iteration`), never per layer or per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.llama.attention import (DecodeViews, chunk_mask, decode_attention, decode_views,
                                           prefill_attention)
from worker.models.llama.plan import StepPlan
from worker.models.llama.weights import LayerWeights, LlamaWeights, StepConsts


def forward(w: LlamaWeights, kv: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one iteration; return ``(logits, failed)``.

    - ``logits``: fp32 ``[n_out, vocab]`` for ``plan.logits_at``;
    - ``failed``: bool ``[N]``, True where a token's final hidden state is not
      finite (its key/value went into the cache as 0, so only its own
      sequence is affected; the runner fails that request).

    ``kv``: the cache, ``[layers, 2, rows, kv_heads, capacity, head_dim]`` (keys,
    then values; :class:`~worker.models.llama.cache.SlotCache`), updated in
    place. Runs under CUDA graph capture as is (decode plans on static
    tensors): no host synchronisation, no data-dependent shapes.
    """
    it, c = _Iteration.of(w, kv, plan), w.consts
    x = w.embed(plan.ids)
    for layer, lw in enumerate(w.layers):
        x = lw.o.add(x, _attention(w, layer, _rms_norm(x, lw.ln1, c), it))  # x + o(attention)
        x = lw.down.add(x, _mlp(lw, _rms_norm(x, lw.ln2, c), w.shape.ffn))
    failed = ~torch.isfinite(x).all(dim=-1)
    x = _rms_norm(x[plan.logits_at], w.norm, c)
    return _logits(w, x, plan.greedy), failed


@dataclass(slots=True)
class _Iteration:
    """What every layer of one :func:`forward` reads, made once per iteration."""

    plan: StepPlan
    cos: torch.Tensor  # [N, 1, D], at the entries' positions
    sin_signed: torch.Tensor  # [N, 1, D]
    layer_kv: tuple  # per layer [2, rows, kv_heads, capacity, D], views of the cache
    decode: DecodeViews | None  # the decode attention's operands (None: no decode entries)
    masks: list  # per prefill sequence: its chunk_mask, None for a fresh prompt (causal)

    @classmethod
    def of(cls, w: LlamaWeights, kv: torch.Tensor, plan: StepPlan) -> _Iteration:
        s = w.shape
        decode = decode_views(kv, len(plan.lengths) // plan.queries, plan.window, plan.lengths, plan.queries,
                              s.heads // s.kv_heads, plan.decode_slots) if plan.n_decode else None
        masks = [chunk_mask(p.count, p.start, plan.ids.device) if p.start else None for p in plan.prefill]
        return cls(plan, w.cos[plan.positions][:, None], w.sin_signed[plan.positions][:, None], kv.unbind(0),
                   decode, masks)


def _attention(w: LlamaWeights, layer: int, h: torch.Tensor, it: _Iteration) -> torch.Tensor:
    """``[N, heads * D]``: layer ``layer``'s attention for ``h`` (its normed input), whose new keys
    and values it stores in the cache.

    They sit side by side in the qkv product: made finite, RoPE applied in
    place (to q and k at once), then one indexed write stores them; the
    decode attention reads views made once per iteration, so the ops per
    layer do not grow with rows.
    """
    s, plan = w.shape, it.plan
    n, d = h.shape[0], s.head_dim
    q_end, k_end = s.heads * d, (s.heads + s.kv_heads) * d
    qkv = w.layers[layer].qkv(h)
    new_kv = qkv[:, q_end:]
    new_kv.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite key/value never reaches the cache
    _rope_(qkv[:, :k_end].view(n, s.heads + s.kv_heads, d), it.cos, it.sin_signed)
    cache = it.layer_kv[layer]
    cache[:, plan.write_rows, :, plan.write_pos] = new_kv.view(n, 2, s.kv_heads, d)
    q = qkv[:, :q_end].view(n, s.heads, d)
    parts = [] if it.decode is None else [decode_attention(q[: plan.n_decode], it.decode, layer, w.consts.scaling)]
    if plan.prefill:
        k, v = qkv[:, q_end:k_end].view(n, s.kv_heads, d), qkv[:, k_end:].view(n, s.kv_heads, d)
        parts += [prefill_attention(q, k, v, cache, span, mask, w.scaling)
                  for span, mask in zip(plan.prefill, it.masks)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(n, q_end)


def _mlp(lw: LayerWeights, h: torch.Tensor, ffn: int) -> torch.Tensor:
    """SwiGLU's hidden activations ``silu(gate) * up``, ``[N, ffn]`` (the down projection comes after)."""
    gu = lw.gate_up(h)
    return F.silu(gu[:, :ffn]).mul_(gu[:, ffn:])


def _logits(w: LlamaWeights, x: torch.Tensor, greedy: list[bool] | None) -> torch.Tensor:
    """fp32 ``[n_out, vocab]``: through the screened head for the greedy rows when there is one."""
    if w.greedy_head is None or not greedy or not any(greedy):
        return w.head(x).float()
    if all(greedy):
        return w.greedy_head.greedy_logits(x)
    picked = torch.tensor(greedy)
    out = torch.empty(x.shape[0], w.shape.vocab)
    out[picked] = w.greedy_head.greedy_logits(x[picked])
    out[~picked] = w.head(x[~picked]).float()
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, c: StepConsts) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Llama's RMSNorm, Zhang & Sennrich 2019).

    On CPU as a sum of squares times ``1 / hidden`` (seven small ops): ``F.rms_norm``
    (whose ``mean`` alone cost 16 us of its 36 us at 8 rows) made this 6 % of a
    decode step. The result differs from it by at most ~2 ulp (94 % of values equal;
    measured on 4,096 random rows of 576).
    """
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, c.eps_value)
    ss = (x * x).sum(-1, keepdim=True)
    return (x * torch.rsqrt(ss.mul_(c.inv_hidden).add_(c.eps))).mul_(weight)


def _rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """transformers' ``apply_rotary_pos_emb`` for q and k at once, in place in ``x`` ``[N, heads, D]``.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
    is, per half, ``x1 * cos + x2 * -sin`` and ``x2 * cos + x1 * sin``: the
    products ``t = x * sin_signed`` (``sin`` with its second half negated)
    added crosswise to ``x * cos``. The same products and sums, bit for bit,
    in four ops and one temporary (``torch.roll`` took five more).
    """
    half = x.shape[-1] // 2
    t = x * sin_signed
    x.mul_(cos)
    x[..., :half].add_(t[..., half:])
    x[..., half:].add_(t[..., :half])
