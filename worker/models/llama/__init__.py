"""slotserve's own runner for decoder-only LMs: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, Phi-3
(in the style of gpt-fast and nano-vllm).

- :mod:`~worker.models.llama.family`: what each family does differently from
  Llama, as data read from the config at load (:class:`~worker.models.llama.family.Family`).
- :mod:`~worker.models.llama.linear`: linear layers per precision (fp32,
  bf16, weight-only int8/int4) on torch's own kernels.
- :mod:`~worker.models.llama.weights`: weights in slotserve's fused layout,
  built from a source by one small function per part.
- :mod:`~worker.models.llama.plan`: one iteration's inputs (host lists from
  the batch) and the step plan of index tensors built from them.
- :mod:`~worker.models.llama.model`: the forward pass over a step plan.
- :mod:`~worker.models.llama.attention`: decode attention on views of the
  KV cache made once per iteration, and prefill attention.
- :mod:`~worker.models.llama.cache`: the static per-slot KV cache.
- :mod:`~worker.models.llama.runner`: :class:`LlamaRunner`, the
  :class:`~worker.models.base.SlotModel` the engine drives (chunked prefill,
  decode over per-row lengths, sampling).
- :mod:`~worker.models.llama.cuda_graphs`: the CUDA decode step, replayed
  from graphs captured at fixed batch sizes.
- :mod:`~worker.models.llama.source`: where the weights come from (a
  transformers module, or a GGUF file read without one).
- :mod:`~worker.models.llama.screen`: exact fp32 greedy picks through a
  bf16-screened LM head.
- :mod:`~worker.models.llama.lookup`: prompt-lookup draft tokens for
  speculative decoding.

Weights come from a transformers ``LlamaForCausalLM`` (whatever
:func:`worker.models.checkpoint.load_pretrained` loads: a GGUF file or a
``save_pretrained`` directory; :func:`from_hf`) or straight from a plain Llama GGUF file
(:func:`worker.models.checkpoint.read_gguf`, without transformers'
modelling stack; :func:`from_source`). Either is copied into the runner's
tensors, after which the caller drops the source (its memory is returned).
"""

from __future__ import annotations

from worker.models.llama.runner import LlamaRunner

__all__ = ["LlamaRunner", "cache_len", "from_hf", "from_source", "kv_dtype", "supports"]

CUDA_DEFAULT_MAX_MODEL_LEN = 4096
"""Tokens per slot by default on CUDA, where the cache is allocated whole (CPU:
:data:`~worker.models.options.DEFAULT_MAX_MODEL_LEN`)."""


def supports(config, max_len: int | None = None) -> str | None:
    """None when this runner reproduces the model exactly with a cache of ``max_len`` tokens per
    slot (default: the model's context); else why not (a short reason, from
    :func:`~worker.models.llama.family.describe`)."""
    from worker.models.llama.family import Unsupported, context_length, describe

    try:
        describe(config, max_len or context_length(config))
    except Unsupported as exc:
        return str(exc)
    return None


def cache_len(config, device: str, max_cache_len: int | None) -> int:
    """Tokens per slot the runner will hold (``ModelOptions.max_model_len``): ``max_cache_len``, or by
    default the model's context (or the length its RoPE stays static over,
    :func:`~worker.models.llama.family.rope_position_limit`), at most
    :data:`~worker.models.options.DEFAULT_MAX_MODEL_LEN` on CPU and 4096 on CUDA (the cache is
    allocated whole there). Raises ValueError for a ``max_cache_len`` under 2 or past the context."""
    from worker.models.llama.family import context_length, rope_position_limit
    from worker.models.options import DEFAULT_MAX_MODEL_LEN

    context = context_length(config)
    if max_cache_len is None:
        static = min(context, rope_position_limit(config) or context)
        return min(static, DEFAULT_MAX_MODEL_LEN if device == "cpu" else CUDA_DEFAULT_MAX_MODEL_LEN)
    if type(max_cache_len) is not int or not 2 <= max_cache_len:
        raise ValueError(f"max_model_len must be an int >= 2, got {max_cache_len!r}")
    if max_cache_len > context:
        raise ValueError(f"max_model_len {max_cache_len} is past the model's context of {context} tokens "
                         f"(max_position_embeddings); give at most {context}")
    return max_cache_len


def from_hf(model, tokenizer=None, *, device: str = "cpu", precision: str = "fp32", max_cache_len: int | None = None,
            max_prefill_tokens: int = 512, eos_token_ids: tuple[int, ...] = (),
            cpu_linear: str = "auto", screen_head: bool | None = None, kv_cache_dtype: str = "auto") -> LlamaRunner:
    """A :class:`LlamaRunner` holding a copy of ``model``'s weights (a transformers causal LM of a
    family in :data:`~worker.models.llama.family.FAMILIES`: ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ``Gemma2ForCausalLM``, ...).

    - ``tokenizer``: an :class:`~worker.models.hf_text.HFTextCodec` or None (token ids only).
    - ``device``: ``"cpu"`` or ``"cuda"``; ``precision``: ``"fp32"``, ``"bf16"``,
      ``"int8"``, ``"int4"`` (the last two on CPU).
    - ``max_cache_len``: tokens per slot (``ModelOptions.max_model_len``; default and
      errors: :func:`cache_len`).
    - ``cpu_linear``: ``ModelOptions.cpu_linear`` (fp32/bf16 on CPU).
    - ``screen_head``: fp32 greedy picks through a bf16 screen (see
      :class:`~worker.models.llama.weights.LlamaWeights`; None: when measured faster).
    - ``kv_cache_dtype``: ``ModelOptions.kv_cache_dtype``: ``"auto"`` (fp16 at precision gguf
      on CPU, else the activations'), ``"fp32"``, ``"bf16"`` or ``"fp16"``; on CUDA only auto or
      the activations' own (ValueError).

    Raises ValueError when :func:`supports` says no, or for bad options.
    """
    from worker.models.llama.family import Unsupported, describe
    from worker.models.llama.source import LlamaSource

    try:
        parts = describe(model.config, cache_len(model.config, device, max_cache_len)).parts
    except Unsupported as exc:
        raise ValueError(f"the slotserve runner cannot run this model: {exc}; use runner='hf'") from exc
    return from_source(LlamaSource.from_hf(model, parts), tokenizer, device=device, precision=precision,
                       max_cache_len=max_cache_len, max_prefill_tokens=max_prefill_tokens,
                       eos_token_ids=eos_token_ids, cpu_linear=cpu_linear, screen_head=screen_head,
                       kv_cache_dtype=kv_cache_dtype)


def from_source(source, tokenizer=None, *, device: str = "cpu", precision: str = "fp32",
                max_cache_len: int | None = None, max_prefill_tokens: int = 512,
                eos_token_ids: tuple[int, ...] = (), cpu_linear: str = "auto",
                screen_head: bool | None = None, kv_cache_dtype: str = "auto") -> LlamaRunner:
    """:func:`from_hf` for a :class:`~worker.models.llama.source.LlamaSource` (e.g. from
    :func:`worker.models.checkpoint.read_gguf`); same options and errors."""
    from worker.models.llama.family import Unsupported, describe
    from worker.models.llama.weights import LlamaWeights

    max_len = cache_len(source.config, device, max_cache_len)
    try:
        family = describe(source.config, max_len)
    except Unsupported as exc:
        raise ValueError(f"the slotserve runner cannot run this model: {exc}; use runner='hf'") from exc
    weights = LlamaWeights(source, precision, device, max_len, cpu_linear, screen_head, family)
    return LlamaRunner(weights, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                       max_prefill_tokens=max_prefill_tokens, kv_dtype=kv_dtype(kv_cache_dtype, weights))


def _kv_dtypes() -> dict:
    """``ModelOptions.kv_cache_dtype`` names (all but ``"auto"``) -> torch dtypes."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def kv_dtype_name(dtype) -> str:
    """The ``kv_cache_dtype`` name of a KV cache's torch dtype (``str(dtype)`` for another)."""
    return next((name for name, d in _kv_dtypes().items() if d == dtype), str(dtype))


def kv_dtype(kv_cache_dtype: str, weights):
    """The KV cache's torch dtype for ``ModelOptions.kv_cache_dtype`` (``"auto"``: fp16 for precision
    ``gguf`` on CPU, as llama.cpp's server and Ollama keep a GGUF's cache by default, half fp32's
    bytes per slot and per step; else the activations', ``weights.act_dtype``). Raises ValueError
    for another name, or off the CPU for a dtype other than the activations' (the CUDA decode graphs
    are captured and tested at that one)."""
    import torch

    auto = (torch.float16 if weights.precision == "gguf" and torch.device(weights.device).type == "cpu"
            else weights.act_dtype)
    dtypes = {"auto": auto, **_kv_dtypes()}
    if kv_cache_dtype not in dtypes:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(dtypes)}; got {kv_cache_dtype!r}")
    dtype = dtypes[kv_cache_dtype]
    if dtype != weights.act_dtype and torch.device(weights.device).type != "cpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with {weights.act_dtype} activations runs on CPU only; "
                         f"on {weights.device} use kv_cache_dtype='auto'")
    return dtype
