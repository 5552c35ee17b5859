"""The Llama forward pass over a step plan: weights, one layer loop, two attention shapes.

Weights (:class:`LlamaWeights`) are copied out of a
:class:`~worker.models.llama.source.LlamaSource` (a transformers
``LlamaForCausalLM``, or a GGUF file read without one) into slotserve's own
tensors: q/k/v fused into one ``[(H + 2 Hkv) D, hidden]`` matrix and gate/up
into one ``[2 F, hidden]``, each
a linear of the chosen precision (:mod:`worker.models.llama.linear`), plus
the RoPE cos/sin tables for every position, computed with transformers' own
formula (``position * inv_freq``, concatenated twice, times the attention
scaling), so any RoPE type with a fixed ``inv_freq`` (default, linear,
llama3, yarn) is reproduced exactly.

:func:`forward` runs all new tokens of an iteration in ONE pass: the
decode rows (one token each) and the prefill tokens (whole prompts, or
chunks of long ones) are packed into one ``[N, hidden]`` matrix, so every
weight is read once per iteration. Only attention tells them apart:

- decode: the first ``n_decode`` entries are cache rows ``0..n_decode-1``
  (one query each) and attend over the window ``[0, window)`` of their own
  cache rows, a view (no copy), with an additive mask hiding positions at
  or past each row's length. Rows in that range that are not decoding
  (free, or still prefilling) are padding: token 0, writing its key/value to
  the cache's scratch position (see :mod:`worker.models.llama.cache`).
- prefill: each sequence attends causally over its own keys: the new ones
  (a fresh prompt) or its cache row (a later chunk of a long prompt).

Per-iteration Python work is one loop over the layers plus one small loop
over prefill sequences; positions, masks and cos/sin are built once per
iteration, never per layer or per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.llama.attention import chunk_mask, decode_attention, decode_views, prefill_attention
from worker.models.llama.linear import DenseLinear, cpu_linear_kind, make_linear
from worker.models.llama.screen import screened_head
from worker.models.llama.source import LlamaSource


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """Sizes of a Llama model (names as in transformers' ``LlamaConfig``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    context: int


class LayerWeights:
    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down")

    def __init__(self, ln1, qkv, o, ln2, gate_up, down) -> None:
        self.ln1, self.qkv, self.o, self.ln2, self.gate_up, self.down = ln1, qkv, o, ln2, gate_up, down


class Embedding:
    """Token embedding rows, returned in the activation dtype.

    Stored as int8 with one fp32 scale per 32 columns (``max|x| / 127`` of
    the block) for the int precisions, and at fp32 on CPU when that gives
    every value back bit for bit (a table that already was 8-bit with
    32-column blocks: llama.cpp's Q8_0, as in the SmolLM2 GGUF; checked over
    the whole table at load): a quarter of the bytes (SmolLM2: 113 MB -> 31
    MB). Otherwise fp32 (bf16 at bf16).
    """

    CHUNK_ROWS = 4096  # rows quantised at a time: the load's temporaries stay small

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, device: str, act_dtype: torch.dtype,
                 *, exact_int8: bool = True) -> None:
        """``exact_int8=False`` keeps an fp32 table fp32 (when it is shared with a tied LM head)."""
        self.act_dtype = act_dtype
        self.scales = None
        self.exact = False  # True: rows come back as the fp32 table's, bit for bit
        rows, cols = table.shape
        exact_only = exact_int8 and dtype == torch.float32 and torch.device(device).type == "cpu"
        if (dtype == torch.int8 or exact_only) and cols % 32 == 0:
            codes = torch.empty(rows, cols // 32, 32, dtype=torch.int8)
            scales = torch.empty(rows, cols // 32, 1)
            for start in range(0, rows, self.CHUNK_ROWS):
                blocks = table[start:start + self.CHUNK_ROWS].float().reshape(-1, cols // 32, 32)
                scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(min=1e-30)
                code = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
                if exact_only and not torch.equal((code.float() * scale).view(torch.int32), blocks.view(torch.int32)):
                    # compared as bits: -0.0 must not come back as +0.0
                    break
                codes[start:start + len(blocks)], scales[start:start + len(blocks)] = code, scale
            else:
                self.scales, self.table = scales.to(device), codes.reshape(rows, cols).to(device)
                self.exact = exact_only
                return
        # own memory (copy=True): the HF tensor may map the whole weights file
        self.table = table.to(device=device, dtype=torch.float32 if dtype == torch.int8 else dtype, copy=True)
        self.exact = self.table.dtype == torch.float32 == table.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.table)
        if self.scales is not None:
            rows = (rows.float().view(len(ids), -1, 32) * self.scales[ids]).view(len(ids), -1)
        return rows.to(self.act_dtype)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size() + (0 if self.scales is None else self.scales.numel() * 4)


@dataclass(frozen=True, slots=True)
class _Consts:
    """The step's scalars: fp32 0-dim tensors on CPU, Python floats elsewhere (see LlamaWeights)."""

    inv_hidden: torch.Tensor | float
    eps: torch.Tensor | float
    scaling: torch.Tensor | float
    eps_value: float  # for F.rms_norm on CUDA


class LlamaWeights:
    """The model's tensors in slotserve's layout (see module docstring)."""

    def __init__(self, source: LlamaSource, precision: str, device: str, max_len: int,
                 cpu_linear: str = "auto", screen_head: bool | None = None) -> None:
        """Copy ``source``'s tensors (:class:`~worker.models.llama.source.LlamaSource`) into this layout;
        fp32/bf16 linears on CPU of kind ``cpu_linear`` (``auto``: measured, see
        :func:`~worker.models.llama.linear.cpu_linear_kind`). ``screen_head`` (fp32 on CPU, tied
        head): greedy rows pick through :class:`~worker.models.llama.screen.ScreenedHead`; None:
        when its bf16 product measures faster than the fp32 head (:func:`screened_head`).
        Raises ValueError for a kind this torch cannot run, or ``screen_head=True`` where
        oneDNN has no bf16 product."""
        cfg = source.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.shape = LlamaShape(
            hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            ffn=cfg.intermediate_size, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps), context=max_len,
        )
        self.precision, self.device = precision, device
        self.act_dtype = torch.bfloat16 if precision == "bf16" and device != "cpu" else torch.float32
        act = self.act_dtype

        def norm(weight: torch.Tensor) -> torch.Tensor:  # a copy: the source may map the whole weights file
            return weight.to(device=device, dtype=act, copy=True)

        # fp32/bf16 on CPU: the GEMM library measured fastest for this layer's shapes on this CPU
        dims = self.shape
        shapes = (((dims.heads + 2 * dims.kv_heads) * head_dim, dims.hidden), (dims.hidden, dims.heads * head_dim),
                  (2 * dims.ffn, dims.hidden), (dims.hidden, dims.ffn))
        on_cpu = torch.device(device).type == "cpu"

        def kind_for(p: str) -> str | None:
            named = None if cpu_linear == "auto" else cpu_linear
            return cpu_linear_kind(torch.bfloat16 if p == "bf16" else torch.float32, shapes, named) if on_cpu else None

        layer_kind = kind_for(precision) if precision in ("fp32", "bf16") else None
        # the layers' linear kind: dense, mkl or onednn (fp32/bf16), int8/int4 (logged by the worker)
        self.linear_kind = layer_kind or (precision if on_cpu else "dense")

        def fused(layer: dict, keys: tuple[str, ...]) -> object:
            weight = torch.cat([layer[k] for k in keys])
            bias = None if keys[0] + ".bias" not in layer else torch.cat([layer[k + ".bias"] for k in keys])
            return make_linear(weight, bias, precision, device, layer_kind)

        self.layers = [LayerWeights(norm(layer["ln1"]), fused(layer, ("q", "k", "v")), fused(layer, ("o",)),
                                    norm(layer["ln2"]), fused(layer, ("gate", "up")), fused(layer, ("down",)))
                       for layer in source.layers]
        self.norm = norm(source.norm)
        # The LM head stays fp32 at int8/int4 and the embedding is int8 in 32-column blocks:
        # quantising the head per row (and the embedding) cost most of the greedy agreement with
        # fp32 on HumanEval prompts (measured: 1 of 8 identical against 6 of 8 with int4 layers).
        outer = "bf16" if precision == "bf16" else "fp32"
        embed_dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.int8}.get(precision, act)
        qkv = self.layers[0].qkv
        share = source.head is None and isinstance(qkv, DenseLinear)  # the head can use the embedding's table
        self.embed = Embedding(source.embed, embed_dtype, device, act, exact_int8=not share)
        if share and self.embed.table.dtype == qkv.weight.dtype:
            self.head = DenseLinear(self.embed.table)  # one tensor for both, as in the HF model
        else:
            self.head = make_linear(source.embed if source.head is None else source.head, None, outer, device,
                                    kind_for(outer))
        # fp32 on CPU, head tied to an embedding stored exactly: greedy rows may screen in bf16
        # (worker.models.llama.screen), when that product measures faster here
        self.greedy_head = None
        if on_cpu and precision == "fp32" and source.head is None and self.embed.exact:
            self.greedy_head = screened_head(source.embed.float(), self.head, self.embed, screen_head)
        elif screen_head:
            raise ValueError("screen_head needs fp32 on CPU and an LM head tied to an exactly stored embedding")
        self.scaling = head_dim ** -0.5
        # On CPU the step's scalars are fp32 0-dim tensors: an op with a Python float converts it to
        # a tensor on every call (2-3 us each, 5 per layer; measured), same value and result (the
        # activations are fp32 there). On CUDA they stay floats: a bf16 op would round a 0-dim
        # bf16 tensor (the scaling of head_dim 128 by ~1e-4), and graph replay hides the cost.
        values = (1.0 / cfg.hidden_size, float(cfg.rms_norm_eps), self.scaling)
        self.consts = _Consts(*(torch.tensor(v, dtype=torch.float32) if on_cpu else v for v in values),
                              eps_value=float(cfg.rms_norm_eps))
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * source.inv_freq.float().cpu()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * source.attention_scaling).to(device=device, dtype=act)
        # sin with the second half negated: rotate_half(x) * sin, crosswise (see _rope_), exactly
        sin = emb.sin() * source.attention_scaling
        sin[:, head_dim // 2:].neg_()
        self.sin_signed = sin.to(device=device, dtype=act)

    @property
    def nbytes(self) -> int:
        """Bytes of weights (tables included)."""
        linears = [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        head = 0 if getattr(self.head, "weight", None) is self.embed.table else self.head.nbytes
        screen = 0 if self.greedy_head is None else self.greedy_head.screen.nbytes
        return sum(x.nbytes for x in linears) + self.embed.nbytes + head + screen


@dataclass(slots=True)
class StepPlan:
    """The new tokens of one iteration, as index tensors (built once per iteration).

    - ``ids``, ``positions``, ``write_rows``, ``write_pos``: ``[N]`` long; entry
      ``i`` is token ``ids[i]`` at sequence position ``positions[i]``, whose
      key/value is stored at cache row ``write_rows[i]``, position ``write_pos[i]``.
    - ``n_decode``: entries ``0..n_decode-1`` are decode queries of cache rows
      ``0..n_decode / queries - 1``, ``queries`` per row (row ``r``'s are entries
      ``r * queries ..``: its token, then draft tokens when speculating);
      ``lengths`` ``[n_decode]`` the keys each sees (its own included);
      ``window`` >= ``max(lengths)`` the keys looked at. With ``queries > 1``
      (speculative decoding) the entries are only the real queries, and
      ``decode_slots`` ``[n_decode]`` places each among the ``rows * queries``
      of the attention (``lengths`` has one per place; the others are padding).
    - ``prefill``: ``(offset, count, row, start)`` per prefill sequence: entries
      ``offset..offset+count-1`` are its tokens at positions ``start..``.
    - ``logits_at``: ``[n_out]`` entries whose next-token logits are wanted.
    - ``greedy``: per ``logits_at`` entry, True when only its argmax is wanted
      (then, with a screened head, its logits are exact at the candidates and
      ``-inf`` elsewhere: :class:`~worker.models.llama.screen.ScreenedHead`);
      None: whole logits for all.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    write_pos: torch.Tensor
    n_decode: int
    lengths: torch.Tensor | None
    window: int
    prefill: list[tuple[int, int, int, int]]
    logits_at: torch.Tensor
    queries: int = 1
    decode_slots: torch.Tensor | None = None
    greedy: list[bool] | None = None


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

    Per layer, the new keys and values go into the cache with one indexed
    write (they sit side by side in the qkv product, RoPE applied in place),
    and the decode attention reads views made once per iteration, so the ops
    per layer do not grow with rows.
    """
    s = w.shape
    n = plan.ids.shape[0]
    q_end, k_end, d = s.heads * s.head_dim, (s.heads + s.kv_heads) * s.head_dim, s.head_dim
    cos = w.cos[plan.positions][:, None]  # [N, 1, D]
    sin = w.sin_signed[plan.positions][:, None]
    c = w.consts
    layer_kv = kv.unbind(0)  # per layer [2, rows, kv_heads, capacity, D]
    decode = decode_views(kv, len(plan.lengths) // plan.queries, plan.window, plan.lengths, plan.queries,
                          s.heads // s.kv_heads, plan.decode_slots) if plan.n_decode else None
    masks = [chunk_mask(count, start, plan.ids.device) if start else None for _, count, _, start in plan.prefill]
    x = w.embed(plan.ids)
    for layer, lw in enumerate(w.layers):
        h = _rms_norm(x, lw.ln1, c)
        qkv = lw.qkv(h)
        new_kv = qkv[:, q_end:]
        new_kv.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite key/value never reaches the cache
        _rope_(qkv[:, :k_end].view(n, s.heads + s.kv_heads, d), cos, sin)
        cache = layer_kv[layer]
        cache[:, plan.write_rows, :, plan.write_pos] = new_kv.view(n, 2, s.kv_heads, d)
        q = qkv[:, :q_end].view(n, s.heads, d)
        parts = []
        if decode is not None:
            parts.append(decode_attention(q[: plan.n_decode], decode, layer, c.scaling))
        if plan.prefill:
            k = qkv[:, q_end:k_end].view(n, s.kv_heads, d)
            v = qkv[:, k_end:].view(n, s.kv_heads, d)
        for (offset, count, row, start), mask in zip(plan.prefill, masks):
            parts.append(prefill_attention(q, k, v, cache[0], cache[1], offset, count, row, start, mask,
                                            w.scaling))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = lw.o.add(x, attn.reshape(n, q_end))
        h = _rms_norm(x, lw.ln2, c)
        gu = lw.gate_up(h)
        x = lw.down.add(x, F.silu(gu[:, : s.ffn]).mul_(gu[:, s.ffn:]))
    failed = ~torch.isfinite(x).all(dim=-1)
    x = _rms_norm(x[plan.logits_at], w.norm, c)
    return _logits(w, x, plan.greedy), failed


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, c: _Consts) -> torch.Tensor:
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
