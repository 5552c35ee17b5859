"""Model backends, chosen by name (:func:`load_model`).

Heavy imports (torch, transformers) happen only inside the backend that
needs them, so ``import worker`` stays light.
"""

from __future__ import annotations

from protocol.request import SamplingParams
from worker.models.base import BatchPlan, SlotInput, SlotModel, StatelessModel, StepOutput
from worker.models.heap import bound_onednn_caches, return_freed_memory, reuse_freed_memory
from worker.models.options import ModelOptions

__all__ = ["BatchPlan", "ModelOptions", "SamplingParams", "SlotInput", "SlotModel", "StatelessModel", "StepOutput",
           "load_model"]

_RUNNER_OPTIONS = ("device", "precision", "runner", "max_prefill_tokens", "speculative_tokens", "cpu_linear",
                   "num_threads", "prefix_cache_mb", "kv_cache_dtype", "gguf_activations", "max_model_len", "chat_template",
                   "pooling")
_DECODER_OPTIONS = ("runner", "max_prefill_tokens", "speculative_tokens", "cpu_linear", "prefix_cache_mb",
                    "kv_cache_dtype", "gguf_activations", "chat_template")
"""The options of the decoder runners, which an embedding model does not take."""


def load_model(name: str, **options):
    """Build a model backend from its name.

    - ``"simulated"``: :class:`worker.SimulatedLLM` with ``options`` passed on.
    - a sentence-transformers folder (the alias ``all-minilm-l6-v2``), or any model with
      ``pooling`` given: an embedding model (:func:`worker.models.embedder.load_embedder`; options
      ``device``, ``precision``, ``num_threads``, ``max_model_len``, ``pooling``).
    - anything else: a Hugging Face causal LM (alias ``smollm2-135m``, a local
      directory, a ``.gguf`` file, or a hub id in the local Hugging Face cache: nothing is
      downloaded, :mod:`worker.models.names`); needs the ``hf`` extra. Options: those of :class:`ModelOptions`
      (``device``, ``precision``, ``runner``, ``max_prefill_tokens``,
      ``speculative_tokens``, ``num_threads``, ``kv_cache_dtype``, ``max_model_len``) and
      ``max_cache_len`` (the older name of ``max_model_len``, for the runners' own API). A model of
      a family slotserve's own runner serves (:mod:`worker.models.llama`: Llama, Mistral, Qwen2/2.5,
      Qwen3, Gemma 2/3, Phi-3) runs there unless ``runner="hf"`` or its config asks for a feature
      the runner refuses at load (:func:`worker.models.llama.supports`); others on the transformers forward
      (:mod:`worker.models.hf`, fp32 or bf16 on CPU), which with
      ``runner="hf"`` also takes :func:`~worker.models.hf.load_hf_model`'s options.

    Raises ``ValueError`` for a name that cannot be resolved (checked before anything heavy is
    imported: :func:`~worker.models.names.locate_model`, one line saying what to do) or options that
    do not apply (e.g. ``precision="int8"`` for a model only the HF runner runs), or a
    ``max_model_len`` past the model's context.
    """
    if name == "simulated":
        return _simulated(options)
    template = options.get("chat_template")
    if template is not None:
        from worker.models.options import chat_template_text

        template = chat_template_text(template)  # (a bad one fails before minutes of loading)
    model = _load_real(name, options)
    reuse_freed_memory()  # from here, the iterations' temporaries reuse the heap's pages
    if template is not None:
        codec = getattr(model, "tokenizer", None)
        if not callable(getattr(codec, "with_chat_template", None)):
            raise ValueError(f"chat_template: this model ({name}) has no tokenizer to render chats with")
        model.tokenizer = codec.with_chat_template(template)
    return model


def _load_real(name: str, options: dict):
    """:func:`load_model` of a real model (its options not yet popped)."""
    bound_onednn_caches()  # before torch's first oneDNN product in this process
    opts = ModelOptions(**{k: options.pop(k) for k in _RUNNER_OPTIONS if k in options})
    device, precision = opts.resolve()
    if opts.speculative_tokens and device != "cpu":
        raise ValueError(f"speculative decoding (speculative_tokens > 0) runs on CPU only, not {device}")
    from worker.models.names import locate_model

    locate_model(name)  # a name that means no model here fails now, before torch's import, and never on a hub
    from worker.models import hf

    hf.set_num_threads(opts.num_threads)
    max_cache_len = _model_len(opts, options.pop("max_cache_len", None))
    from worker.models import embedder

    if embedder.embeds(name, opts.pooling):
        given = [k for k in _DECODER_OPTIONS if getattr(opts, k) != getattr(ModelOptions(), k)] + sorted(options)
        if given:
            raise ValueError(f"{name!r} is served as an embedding model, which does not take {given} "
                             "(options of the decoder runners)")
        return embedder.load_embedder(name, opts.pooling, device, precision, max_cache_len)
    if opts.runner == "hf":
        if device != "cpu" or precision not in ("fp32", "bf16"):
            raise ValueError(f"runner hf runs fp32 or bf16 on CPU; got {precision} on {device}")
        return hf.load_hf_model(name, dtype="float32" if precision == "fp32" else "bfloat16",
                                max_prefill_tokens=opts.max_prefill_tokens, max_cache_len=max_cache_len, **options)
    if options:
        raise ValueError(f"unknown model options {sorted(options)} (runner-specific ones need runner='hf')")
    # auto: gguf if the file is quantised and the compiled kernel runs here (without it the stored
    # weights multiply in pure torch, many times slower than fp32: a CPU with neither AVX-512 BF16 nor
    # AVX2, or no compiler)
    stored = precision == "gguf" or (opts.precision == "auto" and device == "cpu" and _is_gguf(name)
                                      and _kernel_runs())
    runner = _load_gguf_directly(name, device, precision, max_cache_len, opts.max_prefill_tokens, opts.cpu_linear,
                                 opts.kv_cache_dtype, stored)
    if runner is not None and runner.weights.precision == "gguf":
        runner.weights.set_gguf_activations(opts.gguf_activations)
    elif opts.gguf_activations != "auto":
        raise ValueError(f"gguf_activations={opts.gguf_activations!r} applies to precision gguf (a GGUF file's "
                         f"block-quantised weights as stored); {name!r} does not run at gguf here")
    if runner is None:
        if precision == "gguf":
            raise ValueError(f"precision gguf serves a GGUF file's own block-quantised weights; {name!r} is not a "
                             f"GGUF file slotserve's runner reads (llama, qwen2, qwen3, gemma2, gemma3, phi3): "
                             f"use fp32, bf16, int8 or int4")
        return _load_through_transformers(name, opts, device, precision, max_cache_len)
    runner.speculative_tokens = opts.speculative_tokens
    runner.prefix_cache_mb = opts.prefix_cache_mb
    runner.thread_tuner = _thread_tuner(runner, opts)
    return runner


def _thread_tuner(runner, opts: ModelOptions):
    """A :class:`~worker.models.threads.ThreadTuner` for ``runner``'s steps, up to torch's thread
    count, when the count was not given (``num_threads`` None) and cannot change the results: on
    CPU at precision gguf with the compiled GGUF products and decode attention, which compute each
    output element on one thread whatever the count. None otherwise (torch's own products may split
    a sum by threads: bf16 logits measured different at 1 and 2 threads, so their count stays fixed)."""
    import torch

    if opts.num_threads is not None or runner.device != "cpu" or runner.precision != "gguf" \
            or torch.get_num_threads() < 2 or runner.weights.attention_kernel is None or not _kernel_runs():
        return None
    from worker.models.threads import ThreadTuner, others_busy

    return ThreadTuner(torch.get_num_threads(), busy=others_busy)


def _model_len(opts: ModelOptions, max_cache_len):
    """Tokens per slot asked for: ``opts.max_model_len`` or the older keyword ``max_cache_len`` (None:
    the runner's default, :data:`~worker.models.options.DEFAULT_MAX_MODEL_LEN`); ValueError when both
    are given and differ."""
    if opts.max_model_len is not None and max_cache_len is not None and max_cache_len != opts.max_model_len:
        raise ValueError(f"max_cache_len={max_cache_len} and max_model_len={opts.max_model_len} name the same "
                         "limit; give max_model_len only")
    return opts.max_model_len if opts.max_model_len is not None else max_cache_len


def _simulated(options: dict):
    """:class:`worker.SimulatedLLM` with ``options``; ValueError for a real model's option that
    is not its default."""
    given = {k: options.pop(k) for k in _RUNNER_OPTIONS if k in options}
    if not ModelOptions(**given).is_default:
        changed = sorted(k for k, v in given.items() if v != getattr(ModelOptions(), k))
        raise ValueError(f"options {changed} apply to real models, not 'simulated'")
    from worker.models.simulated import SimulatedLLM

    return SimulatedLLM(**options)


def _load_through_transformers(name: str, opts: ModelOptions, device: str, precision: str, max_cache_len):
    """The model loaded by transformers: on slotserve's runner when it supports the architecture
    (the transformers module then freed), else on the HF runner (:func:`_check_hf_fallback`)."""
    from worker.models import checkpoint, hf, llama

    model, codec = checkpoint.load_pretrained(name)
    reason = llama.supports(model.config, llama.cache_len(model.config, device, max_cache_len))
    if reason is not None:
        _check_hf_fallback(name, reason, opts, device, precision)
        if precision == "bf16":
            model = model.to(dtype=__import__("torch").bfloat16)
        return hf.HFSlotModel(model, codec, max_cache_len=max_cache_len, max_prefill_tokens=opts.max_prefill_tokens)
    runner = llama.from_hf(model, codec, device=device, precision=precision, max_cache_len=max_cache_len,
                           max_prefill_tokens=opts.max_prefill_tokens, eos_token_ids=hf.eos_ids(model, codec),
                           cpu_linear=opts.cpu_linear, kv_cache_dtype=opts.kv_cache_dtype)
    del model  # the runner holds its own copy; the HF module's memory goes back now
    return_freed_memory()
    runner.speculative_tokens = opts.speculative_tokens
    runner.prefix_cache_mb = opts.prefix_cache_mb
    return runner


def _check_hf_fallback(name: str, reason: str, opts: ModelOptions, device: str, precision: str) -> None:
    """ValueError unless ``opts`` suit the HF runner, which takes a model slotserve's runner cannot
    run (``reason``): no runner asked for, no speculative decoding, no cpu_linear or kv_cache_dtype
    choice, fp32 or bf16 on CPU."""
    if opts.runner == "slotserve":
        raise ValueError(f"the slotserve runner cannot run {name!r}: {reason}; use runner='hf'")
    if opts.speculative_tokens:
        raise ValueError(f"{name!r} runs on the HF runner ({reason}), which has no speculative decoding")
    if opts.cpu_linear != "auto":
        raise ValueError(f"{name!r} runs on the HF runner ({reason}), which has no cpu_linear choice")
    if opts.kv_cache_dtype != "auto":
        raise ValueError(f"{name!r} runs on the HF runner ({reason}), whose KV cache has the weights' dtype; "
                         "use kv_cache_dtype='auto'")
    if device != "cpu" or precision not in ("fp32", "bf16"):
        raise ValueError(f"{name!r} runs on the HF runner ({reason}), which runs fp32 or bf16 on CPU; "
                         f"got {precision} on {device}")


def _is_gguf(name: str) -> bool:
    """Whether ``name`` resolves to a ``.gguf`` file (False where it does not resolve: the loader says why)."""
    from worker.models.checkpoint import resolve_model_path

    try:
        return resolve_model_path(name)[1] is not None
    except (OSError, ValueError):
        return False


def _kernel_runs() -> bool:
    """Whether the GGUF kernel (:mod:`worker.models.llama.qkernel`) runs in this process (built on first use)."""
    from worker.models.llama import qkernel

    return qkernel.load() is not None


def _load_gguf_directly(name: str, device: str, precision: str, max_cache_len, max_prefill_tokens: int,
                        cpu_linear: str, kv_cache_dtype: str = "auto", stored: bool = False):
    """The slotserve runner for a GGUF file of a family it serves (llama, qwen2, qwen3, gemma2, gemma3,
    phi3), read without building the transformers model (:func:`worker.models.checkpoint.read_gguf`);
    None for anything else. ValueError (:class:`~worker.models.llama.family.Unsupported`) for a file
    stating what neither that reader nor transformers' applies (RoPE scaling).

    ``stored``: read block-quantised weights as stored (``read_gguf(quantized=True)``) and run them
    at precision ``gguf`` -- asked for, or ``auto`` on CPU (``precision`` then says fp32: it stays
    fp32 for a file with no block-quantised weight; there is nothing to keep)."""
    import os

    from worker.models import hf, llama
    from worker.models.checkpoint import read_gguf, resolve_model_path
    from worker.models.hf_text import HFTextCodec

    path, gguf_file = resolve_model_path(name)
    if gguf_file is None or not os.path.isfile(os.path.join(path, gguf_file)):
        return None
    read = read_gguf(os.path.join(path, gguf_file), quantized=stored)
    if read is None:
        return None
    source, tokenizer = read
    if stored:
        precision = "gguf" if _has_stored(source) else precision
    codec = HFTextCodec(tokenizer) if tokenizer is not None and tokenizer.is_fast else None
    runner = llama.from_source(source, codec, device=device, precision=precision, max_cache_len=max_cache_len,
                               max_prefill_tokens=max_prefill_tokens, cpu_linear=cpu_linear,
                               eos_token_ids=hf.merge_eos_ids(source.eos_token_ids, codec),
                               kv_cache_dtype=kv_cache_dtype)
    del source, read
    return_freed_memory()
    return runner


def _has_stored(source) -> bool:
    """Whether a :class:`~worker.models.llama.source.LlamaSource` holds a block-quantised weight as stored."""
    from worker.models.llama.quantized import QuantizedWeight

    return any(isinstance(t, QuantizedWeight) for t in
               [source.embed, source.head, *(t for layer in source.layers for t in layer.values())])
