"""Hugging Face causal LMs as slot-aware models (a :class:`worker.models.base.SlotModel`).

``load_hf_model(name, **options)`` loads a transformers causal LM (Llama and
GPT-2 families tested; any model whose attention layers call
``cache.update(k, v, layer_idx)`` and accept ``position_ids`` and a 4-D mask
works) and wraps it in :class:`HFSlotModel`, which keeps a per-slot KV cache
(:mod:`worker.models.kv_cache`) and per iteration runs

1. one packed prefill forward for the slots that were just assigned (all of
   their prompts concatenated, no padding; split at ``max_prefill_tokens``),
2. one batched decode forward for every other occupied slot, each row at its
   own position.

Why the model's own forward with a custom cache (not a re-implementation):
transformers 5 accepts explicit ``position_ids`` and a prepared 4-D mask and
calls ``cache.update`` in every attention layer, so the HF code runs
unchanged, stays the numerical reference (greedy outputs equal
``model.generate`` -- tested), and every architecture with that shape works.

torch and transformers are imported only here (``import worker`` stays
light); they come with the ``hf`` extra.
"""

from __future__ import annotations

import inspect

import torch

from worker.models.base import BatchPlan, StepOutput
from worker.models.checkpoint import load_pretrained
from worker.models.heap import trim_heap
from worker.models.hf_text import HFTextCodec
from worker.models.kv_cache import SlotKVCache
from worker.models.options import DEFAULT_MAX_MODEL_LEN
from worker.models.grammar import grammars_for
from worker.models.rows import SlotRows
from worker.models.sampling import Sampler, score

_HEAD_CHUNK = 4096  # vocabulary rows per lm_head product, see HFSlotModel._logits

def set_num_threads(num_threads: int | None) -> None:
    """``torch.set_num_threads`` for this process (None: leave torch's default).

    Raises ``ValueError`` unless None or an int >= 1.
    """
    if num_threads is not None:
        if type(num_threads) is not int or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
        torch.set_num_threads(num_threads)


def load_hf_model(
    name: str,
    *,
    dtype: str = "float32",
    num_threads: int | None = None,
    max_cache_len: int | None = None,
    max_prefill_tokens: int = 2048,
    kv_capacity_step: int = 256,
    attn_implementation: str = "sdpa",
) -> HFSlotModel:
    """Load a causal LM and wrap it for the engine (the HF runner: any architecture).

    - ``name``: alias (``smollm2-135m``), local directory, ``.gguf`` file or hub id.
    - ``dtype``: weights and KV cache dtype, ``"float32"`` (default; GGUF
      files are dequantised to it), ``"bfloat16"`` or ``"float16"``.
    - ``num_threads``: ``torch.set_num_threads`` for this process (None: torch's default).
    - ``max_cache_len``: KV cache limit per slot in tokens (``ModelOptions.max_model_len``;
      default: the model's context length from its config, at most
      :data:`~worker.models.options.DEFAULT_MAX_MODEL_LEN`; ValueError past the context);
      also the engine's ``max_seq_len``.
    - ``max_prefill_tokens``: most prompt tokens packed into one prefill forward.
    - ``kv_capacity_step``: KV cache growth step in tokens (see :mod:`worker.models.kv_cache`).
    - ``attn_implementation``: transformers attention backend (``"sdpa"`` or ``"eager"``).

    Raises ``ValueError`` for an unknown dtype, bad sizes, or a model that
    cannot be found or loaded (the message names the cause).
    """
    set_num_threads(num_threads)
    for key, value in (("max_prefill_tokens", max_prefill_tokens), ("kv_capacity_step", kv_capacity_step)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    model, codec = load_pretrained(name, dtype=dtype, attn_implementation=attn_implementation)
    return HFSlotModel(
        model, codec, max_cache_len=max_cache_len, max_prefill_tokens=max_prefill_tokens,
        kv_capacity_step=kv_capacity_step,
    )


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS token ids of the generation config, the model config and the tokenizer, in that order."""
    return merge_eos_ids([getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id],
                         tokenizer)


def merge_eos_ids(sources: list, tokenizer) -> tuple[int, ...]:
    """The ids in ``sources`` (each an int, a list or None), then the tokenizer's EOS, without repeats."""
    ids: list[int] = []
    sources = list(sources)
    if tokenizer is not None:
        sources.append(tokenizer._tok.eos_token_id)
    for src in sources:
        for i in [src] if isinstance(src, int) else (src or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _static_rope_length(config, context: int) -> int:
    """The default cache length: ``context``, or less where the RoPE changes past a length
    (longrope: transformers switches every position of a forward to its long factors once one
    passes ``original_max_position_embeddings``, so a batch of slots would not be each
    sequence's own forward); :class:`HFSlotModel` refuses a larger ``max_cache_len``."""
    from worker.models.llama.family import rope_position_limit

    limit = rope_position_limit(config)
    return context if limit is None else min(context, limit)


class _LayerMasks:
    """The attention masks transformers' layers get from this runner, as their own forward makes them.

    - Sliding windows: a query at position ``p`` sees keys ``> p - window``
      (``masking_utils.sliding_window_overlay``). Models with ``layer_types``
      (Qwen2/3, Gemma 2/3) take a mask per layer type (a dict, which their
      forward accepts as is); Mistral and Phi-3 slide in every layer (one mask).
    - The eager attention (Gemma 2, or ``attn_implementation="eager"``) adds its
      mask: it gets 0 / dtype-min, as ``masking_utils.eager_mask`` makes it, not bools.
    """

    def __init__(self, window: int | None, per_type: bool, additive: torch.dtype | None) -> None:
        self.window, self.per_type, self.additive = window, per_type, additive

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> _LayerMasks:
        """Raises ValueError for layer types other than full and sliding attention."""
        window = getattr(config, "sliding_window", None)
        types = set(getattr(config, "layer_types", None) or ())
        if types - {"full_attention", "sliding_attention"}:
            raise ValueError(f"the HF runner builds full and sliding-window masks only; this model has "
                             f"layer types {sorted(types)}")
        per_type = bool(types) and config.model_type not in ("mistral", "phi3")
        if per_type and "sliding_attention" not in types:
            window = None
        additive = dtype if getattr(config, "_attn_implementation", "sdpa") == "eager" else None
        return cls(window, per_type, additive)

    def __call__(self, mask: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """``mask`` (bool, True = visible) for the model's layers; ``query_pos`` and ``key_pos``
        broadcast against it (the queries' and keys' sequence positions)."""
        if self.window is None:
            return self._typed(mask)
        windowed = mask & (key_pos > query_pos - self.window)
        if not self.per_type:
            return self._typed(windowed)
        return {"full_attention": self._typed(mask), "sliding_attention": self._typed(windowed)}

    def _typed(self, mask: torch.Tensor) -> torch.Tensor:
        if self.additive is None:
            return mask
        return torch.zeros(mask.shape, dtype=self.additive).masked_fill_(~mask, torch.finfo(self.additive).min)


class HFSlotModel:
    """A transformers causal LM with a slotserve-managed per-slot KV cache.

    Attributes read by the engine: ``vocab_size``, ``max_seq_len`` (``max_cache_len``, by
    default the context length, at most :data:`~worker.models.options.DEFAULT_MAX_MODEL_LEN`), ``eos_token_ids`` (EOS of the
    config, generation config and tokenizer), ``tokenizer`` (an
    :class:`HFTextCodec` or None).

    Engine slots are mapped to cache rows lowest-free-first, so the rows of
    a full batch are consecutive and the decode pass attends over a view of
    the cache instead of a gathered copy.

    Logprobs (``gives_logprobs``): a row asking ``logprobs`` gets its
    token's entry from the sampler (:meth:`~worker.models.sampling.Sampler.pick_scored`,
    the raw logits, same host sync); a row asking ``prompt_logprobs`` has
    the LM head run over its prompt positions too, in its prefill (whole
    prompts here), scored by :func:`~worker.models.sampling.score`.
    """

    gives_logprobs = True

    def __init__(
        self, model, tokenizer: HFTextCodec | None, *, max_cache_len=None, max_prefill_tokens=2048,
        kv_capacity_step=256,
    ):
        from worker.models.llama.family import context_length

        self.model = model.eval()
        cfg = model.config
        context = context_length(cfg)
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 2):
            raise ValueError(f"max_cache_len must be an int >= 2, got {max_cache_len!r}")
        if max_cache_len is not None and max_cache_len > context:
            raise ValueError(f"max_model_len {max_cache_len} is past the model's context of {context} tokens "
                             f"(max_position_embeddings); give at most {context}")
        static = _static_rope_length(cfg, context)
        if max_cache_len is not None and max_cache_len > static:
            raise ValueError(f"max_cache_len {max_cache_len} is past the {static} positions over which this "
                             f"model's longrope RoPE is static (original_max_position_embeddings); the runners "
                             f"run it exactly with max_cache_len <= {static}")
        self.max_seq_len = max_cache_len or min(static, DEFAULT_MAX_MODEL_LEN)
        self._masks = _LayerMasks.of(cfg, next(model.parameters()).dtype)
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.vocab_size = int(cfg.vocab_size)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_capacity_step = kv_capacity_step
        self._base = model.base_model
        self._lm_head = model.get_output_embeddings()
        params = inspect.signature(self._base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._sampler = Sampler()
        # structured outputs (worker.models.grammar); None without a tokenizer. Read by the engine at submit.
        self.grammars = self._sampler.grammars = grammars_for(tokenizer, self.vocab_size, self.eos_token_ids)
        self._cache: SlotKVCache | None = None
        self._rows = SlotRows()

    @property
    def kv_cache(self) -> SlotKVCache | None:
        """The KV cache (None until :meth:`bind_slots`)."""
        return self._cache

    # -- SlotModel ---------------------------------------------------------

    def bind_slots(self, num_slots: int) -> None:
        """Allocate the KV cache for ``num_slots`` slots (drops any earlier one)."""
        self._sampler.bind(num_slots)
        cfg = self.model.config
        heads = cfg.num_attention_heads
        self._cache = SlotKVCache(
            num_layers=cfg.num_hidden_layers,
            num_slots=num_slots,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            max_len=self.max_seq_len,
            dtype=next(self.model.parameters()).dtype,
            capacity_step=self.kv_capacity_step,
        )
        self._rows = SlotRows(num_slots)

    def release_slot(self, slot: int) -> None:
        """Free the slot's cache row (its contents are overwritten by the next user); when it
        was the last one in use, return freed heap to the OS (see :mod:`worker.models.heap`)."""
        self._sampler.release(slot)
        row = self._rows.release(slot)
        if row is not None:
            self._cache.reset_row(row)
            if self._rows.idle:
                trim_heap()

    def step(self, plan: BatchPlan) -> StepOutput:
        """A token for every entry of ``plan.batch`` (prefill new slots whole -- this model does
        not chunk: it has no ``prefill_budget`` --, decode the rest; see :mod:`worker.models.base`).

        Raises ``ValueError`` if a sequence outgrows ``max_seq_len``.
        """
        if self._cache is None:
            raise RuntimeError("bind_slots() must be called before step()")
        batch = plan.batch
        prefill, decode = [], []
        for i, item in enumerate(batch):
            row = self._rows.row(item.slot)
            cached = self._cache.lengths[row]
            if cached > 0 and len(item.tokens) == cached + 1:
                decode.append(i)
            else:  # a new occupant, or tokens the cache does not match: start over
                self._cache.reset_row(row)
                prefill.append(i)
        logits: list[torch.Tensor | None] = [None] * len(batch)
        out = StepOutput([None] * len(batch), logprobs={}, prompt_logprobs={}, errors={})
        with torch.inference_mode():
            for group in self._prefill_groups(batch, prefill):
                for i, row_logits in zip(group, self._prefill(batch, group, out.prompt_logprobs)):
                    logits[i] = row_logits
            if decode:
                for i, row_logits in zip(decode, self._decode(batch, decode)):
                    logits[i] = row_logits
            stacked = torch.stack(logits)
            params, positions = [item.sampling for item in batch], [len(item.tokens) for item in batch]
            if not any(item.logprobs is not None for item in batch):
                picks, scored = self._sampler.pick(stacked, params, positions, inputs=batch), None
            else:
                picks, scored = self._sampler.pick_scored(stacked, params, positions, inputs=batch,
                                                          logprobs=[item.logprobs for item in batch])
        for i, tok in enumerate(picks):
            if type(tok) is not int:
                out.errors[i] = tok
                continue
            out.tokens[i] = tok
            if scored is not None and scored[i] is not None:
                out.logprobs[i] = [scored[i]]
        return out

    # -- internals ---------------------------------------------------------

    def _prefill_groups(self, batch, indices):
        group, total = [], 0
        for i in indices:
            n = len(batch[i].tokens)
            if group and total + n > self.max_prefill_tokens:
                yield group
                group, total = [], 0
            group.append(i)
            total += n
        if group:
            yield group

    def _forward(self, input_ids, positions, mask):
        out = self._base(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=False,
            **{self._cache_kw: self._cache},
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits.

        A bias-free linear head runs in vocabulary chunks of
        ``_HEAD_CHUNK`` rows: each logit is the same dot product as in one big
        product (bitwise equal), but the chunks' weights stay in cache while
        all rows use them, which is faster at decode batch sizes on CPU.
        """
        head = self._lm_head
        if isinstance(head, torch.nn.Linear) and head.bias is None:
            parts = [torch.nn.functional.linear(hidden, w) for w in head.weight.split(_HEAD_CHUNK)]
            logits = torch.cat(parts, dim=-1)
        else:
            logits = head(hidden)
        if self._final_softcap is not None:  # Gemma 2, as its ForCausalLM.forward does
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits.float()

    def _prefill(self, batch, group, prompts: dict[int, list]):
        """Prefill ``group`` (batch indices) in one packed forward; return their last positions'
        logits. A prompt that asks ``prompt_logprobs`` gets its entries in ``prompts``."""
        rows = [self._rows.of[batch[i].slot] for i in group]
        lengths = [len(batch[i].tokens) for i in group]
        positions, mask = self._cache.begin_packed(rows, lengths)
        ids = torch.tensor([[t for i in group for t in batch[i].tokens]], dtype=torch.long)
        mask = self._masks(mask, positions[0][:, None], positions[0][None, :])
        try:
            hidden = self._forward(ids, positions, mask)
        finally:
            self._cache.end()
        last = torch.tensor(lengths).cumsum(0) - 1
        offset = 0
        for i, length in zip(group, lengths):  # prompt_logprobs: the LM head over those prompts' positions
            item = batch[i]
            if item.prompt_logprobs is not None:  # positions 0 .. prompt_len - 2 predict tokens 1 ..
                n = item.prompt_len - 1
                entries = score(self._logits(hidden[0, offset:offset + n]), item.tokens[1:1 + n],
                                [item.prompt_logprobs] * n) if n > 0 else []
                prompts[i] = [None] + entries
            offset += length
        return self._logits(hidden[0, last])

    def _decode(self, batch, indices):
        order = sorted(indices, key=lambda i: self._rows.of[batch[i].slot])
        rows = [self._rows.of[batch[i].slot] for i in order]
        starts = [self._cache.lengths[r] for r in rows]
        positions, mask = self._cache.begin_rows(rows, starts, [1] * len(rows))
        ids = torch.tensor([[batch[i].tokens[-1]] for i in order], dtype=torch.long)
        try:
            keys = torch.arange(mask.shape[-1])[None, None, None, :]
            hidden = self._forward(ids, positions, self._masks(mask, positions[:, None, :, None], keys))
        finally:
            self._cache.end()
        logits = self._logits(hidden[:, -1])
        by_index = dict(zip(order, logits))
        return [by_index[i] for i in indices]
