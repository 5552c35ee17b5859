"""The decoder forward pass over a step plan: one layer loop, two attention shapes.

One loop for every family (:mod:`worker.models.llama.family`): what a family
changes is data fixed at load (the weights' ``family``): a sliding window or
soft-cap per layer goes to the attention, q/k norms and sandwich norms are
weights a layer has or not (None), the activation and the embedding's factor
are the weights' own.

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
  On CPU, where it runs, one compiled call per layer
  (:mod:`worker.models.llama.attnkernel`) stores every entry's new key and
  value and attends each decode entry over its own length only (no mask,
  no padded positions); elsewhere an indexed write and batched products.
- prefill: each sequence attends causally over its own keys. Where the
  compiled call runs, in that same call: a prompt token at position ``p`` is
  one more entry over its row's keys ``0 .. p`` (its length ``p + 1``), so it
  attends exactly as its decode would, and where the products are
  row-invariant (``gguf``, bf16) a prompt gives the same bits whole, in chunks
  of any size or after a prefix hit (with SDPA per chunk a row's
  sums followed the call's size, and int8 activations amplified that into
  greedy tokens that followed the serving timing); elsewhere
  ``F.scaled_dot_product_attention`` over the new keys (a fresh prompt) or
  its cache row (a later chunk of a long prompt).

Per-iteration Python work is one loop over the layers (:func:`_attention`
and :func:`_mlp` per layer) plus one small loop over prefill sequences;
positions, masks and cos/sin are built once per iteration
(:class:`_Iteration`), never per layer or per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.llama import attnkernel, qkernel
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
    if w.embed_scale is not None:  # Gemma
        x = x * w.embed_scale
    glue = it.fused  # the compiled module's small operations (RMSNorm, RoPE) where it runs, else None
    with qkernel.leading_exact_rows(plan.n_decode):
        x = _layers(w, x, it, glue)
    failed = ~torch.isfinite(x).all(dim=-1)
    x = _rms_norm(x[plan.logits_at], w.norm, c, glue=glue)
    logits = _logits(w, x, plan.greedy)
    cap = w.family.final_softcap
    return (logits if cap is None else _softcap_logits(logits, cap)), failed


def _layers(w: LlamaWeights, x: torch.Tensor, it: _Iteration, glue) -> torch.Tensor:
    """The decoder layers over the iteration's hidden states ``x`` ``[N, hidden]``; ``glue``: the
    compiled module's small operations, or None."""
    c = w.consts
    for layer, lw in enumerate(w.layers):
        if lw.post_attn is None:  # pre-norm only (Llama): the residual add fused into the product
            x = lw.o.add(x, _attention(w, layer, _rms_norm(x, lw.ln1, c, glue=glue), it))  # x + o(attention)
            x = lw.down.add(x, _mlp(w, lw, _rms_norm(x, lw.ln2, c, glue=glue), glue))
        else:  # Gemma's sandwich: the outputs normed before the residual add
            x = x + _rms_norm(lw.o(_attention(w, layer, _rms_norm(x, lw.ln1, c, glue=glue), it)), lw.post_attn, c,
                              glue=glue)
            x = x + _rms_norm(lw.down(_mlp(w, lw, _rms_norm(x, lw.ln2, c, glue=glue), glue)), lw.post_mlp, c,
                              glue=glue)
    return x


@dataclass(slots=True)
class _Iteration:
    """What every layer of one :func:`forward` reads, made once per iteration."""

    plan: StepPlan
    rope: tuple  # (cos, sin_signed), each [N, 1, D] at the entries' positions
    local_rope: tuple | None  # the same from the sliding layers' own RoPE (Gemma 3), or None
    layer_kv: tuple  # per layer [2, rows, kv_heads, capacity, D], views of the cache
    decode: DecodeViews | None  # the batched decode attention's operands (None: no decode entries, or fused)
    masks: dict  # sliding window (None: full) -> per prefill sequence its mask (None: causal, fresh prompt)
    fused: object | None  # the compiled decode attention (worker.models.llama.attnkernel), or None: batched
    decode_rows: torch.Tensor | None  # fused: [n_decode] each decode entry's cache row ...
    decode_lengths: torch.Tensor | None  # ... and the keys it sees (its own included)

    @classmethod
    def of(cls, w: LlamaWeights, kv: torch.Tensor, plan: StepPlan) -> _Iteration:
        s, windows = w.shape, w.family.windowed
        fused = w.attention_kernel if w.attention_kernel is not None and attnkernel.runs(kv, w.act_dtype) else None
        rows = lengths = decode = None
        if fused is not None:  # one call per layer: the KV write and the attention of every entry
            rows = plan.write_rows[:plan.n_decode]
            if not plan.n_decode:
                lengths = rows  # (empty)
            else:
                lengths = plan.lengths if plan.decode_slots is None else plan.lengths[plan.decode_slots]
            if plan.prefill:  # a prompt token at position p sees keys 0 .. p of its row, as its decode would
                n = plan.n_decode
                rows, lengths = torch.cat((rows, plan.write_rows[n:])), torch.cat((lengths, plan.write_pos[n:] + 1))
        elif plan.n_decode:
            decode = decode_views(kv, len(plan.lengths) // plan.queries, plan.window, plan.lengths, plan.queries,
                                  s.heads // s.kv_heads, plan.decode_slots, windows, w.act_dtype)
        device = plan.ids.device
        masks = {} if fused is not None else {win: [chunk_mask(p.count, p.start, device, win) if p.start or win else None
                                                    for p in plan.prefill] for win in windows}
        local = None if w.local_rope is None else tuple(t[plan.positions][:, None] for t in w.local_rope)
        return cls(plan, (w.cos[plan.positions][:, None], w.sin_signed[plan.positions][:, None]), local,
                   kv.unbind(0), decode, masks, fused, rows, lengths)


def _attention(w: LlamaWeights, layer: int, h: torch.Tensor, it: _Iteration) -> torch.Tensor:
    """``[N, heads * D]``: layer ``layer``'s attention for ``h`` (its normed input), whose new keys
    and values it stores in the cache.

    They sit side by side in the qkv product: made finite, RoPE applied in
    place (to q and k at once), then one indexed write stores them; the
    decode attention reads views made once per iteration, so the ops per
    layer do not grow with rows.
    """
    s, plan, lw, fam = w.shape, it.plan, w.layers[layer], w.family
    n, d = h.shape[0], s.head_dim
    q_end, k_end = s.heads * d, (s.heads + s.kv_heads) * d
    qkv = lw.qkv(h)
    new_kv = qkv[:, q_end:]
    cos, sin_signed = it.local_rope if fam.local_rope[layer] else it.rope
    if it.fused is not None and lw.q_norm is None and d % 32 == 0:  # both in one compiled call
        it.fused.rope_finite_(qkv, cos, sin_signed, s.heads + s.kv_heads, d, q_end)
    else:
        new_kv.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite key/value never reaches the cache
        if lw.q_norm is not None:  # Qwen3, Gemma 3: RMSNorm per head of q and k, before RoPE
            for part, weight in ((qkv[:, :q_end].view(n, s.heads, d), lw.q_norm),
                                 (qkv[:, q_end:k_end].view(n, s.kv_heads, d), lw.k_norm)):
                part.copy_(_rms_norm(part, weight, w.consts, per_head=True))
        _rope_(qkv[:, :k_end].view(n, s.heads + s.kv_heads, d), cos, sin_signed)
    cache = it.layer_kv[layer]
    q = qkv[:, :q_end].view(n, s.heads, d)
    window, cap = fam.windows[layer], fam.attn_softcap
    if it.fused is not None:  # the KV write and every entry's attention (decode and prefill) in one call
        return it.fused.decode_attention(q[: len(it.decode_rows)], cache, new_kv.view(n, 2, s.kv_heads, d),
                                         plan.write_rows, plan.write_pos, it.decode_rows, it.decode_lengths, w.scaling,
                                         window or 0, cap or 0.0).reshape(n, q_end)
    else:
        # (a bf16 cache of fp32 activations: rounded as stored, read upcast by the attention)
        cache[:, plan.write_rows, :, plan.write_pos] = new_kv.view(n, 2, s.kv_heads, d).to(cache.dtype)
        parts = [] if it.decode is None else [
            decode_attention(q[: plan.n_decode], it.decode, layer, w.consts.scaling, window, cap)]
    if plan.prefill:
        k, v = qkv[:, q_end:k_end].view(n, s.kv_heads, d), qkv[:, k_end:].view(n, s.kv_heads, d)
        parts += [prefill_attention(q, k, v, cache, span, mask, w.scaling, cap)
                  for span, mask in zip(plan.prefill, it.masks[window])]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(n, q_end)


def _mlp(w: LlamaWeights, lw: LayerWeights, h: torch.Tensor, glue=None) -> torch.Tensor:
    """The gated MLP's hidden activations ``act(gate) * up``, ``[N, ffn]`` (the down projection comes
    after): SwiGLU (``silu``) or Gemma's GeGLU (tanh ``gelu``), as ``w.act``; SwiGLU in one call of
    ``glue`` (the compiled module's ``silu_mul``, the same bits) where it runs at ATen's width
    (:func:`attnkernel.swiglu_exact`)."""
    gu, ffn = lw.gate_up(h), w.shape.ffn
    if glue is not None and w.act is F.silu and attnkernel.swiglu_exact():
        return glue.silu_mul(gu, ffn)
    return w.act(gu[:, :ffn]).mul_(gu[:, ffn:])


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


def _softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's final soft-capping, ``cap * tanh(logits / cap)``, where finite (a screened head's
    ``-inf`` outside its candidates stays ``-inf``: the cap is monotonic, so the argmax stays)."""
    capped = torch.tanh(logits / cap).mul_(cap)
    return torch.where(torch.isfinite(logits), capped, logits)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, c: StepConsts, per_head: bool = False,
              glue=None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Llama's RMSNorm, Zhang & Sennrich 2019);
    ``per_head``: over ``head_dim`` (q/k norms), else over ``hidden``. ``glue``: the compiled
    module (:mod:`worker.models.llama.attnkernel`) where it runs: one call, the same formula.

    On CPU as a sum of squares times ``1 / hidden`` (seven small ops): ``F.rms_norm``
    (whose ``mean`` alone cost 16 us of its 36 us at 8 rows) made this 6 % of a
    decode step. The result differs from it by at most ~2 ulp (94 % of values equal;
    measured on 4,096 random rows of 576).
    """
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, c.eps_value)
    if glue is not None and not per_head and x.dtype == weight.dtype == torch.float32 and x.dim() == 2:
        return glue.rms_norm(x, weight, c.inv_hidden_value, c.eps_value)
    ss = (x * x).sum(-1, keepdim=True)
    return (x * torch.rsqrt(ss.mul_(c.inv_head_dim if per_head else c.inv_hidden).add_(c.eps))).mul_(weight)


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
