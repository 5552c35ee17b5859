"""What a GGUF file's metadata must state, and what llama.cpp assumes where it is silent.

transformers' GGUF config mapping (:func:`worker.models.checkpoint.gguf_config_dict`) copies the
keys a file has and leaves the others to the family's config class, whose defaults are some other
model's (``Qwen2Config``: 32 heads, 32 KV heads, 151,936 tokens; ``Gemma3TextConfig``: RoPE base
1,000,000, head size 256): a file missing ``qwen2.attention.head_count`` loaded as a 32-head
model. llama.cpp, whose files these are, decides per key (``llama_model::load_hparams`` in
``src/llama-model.cpp``; ``ml.get_key(key, x)`` requires it, ``ml.get_key(key, x, false)`` keeps
the value set before it): :func:`check_required` and :func:`with_llama_cpp_defaults` do the same
for the families :func:`~worker.models.checkpoint.read_gguf` reads (llama, qwen2, qwen3, gemma2,
gemma3, phi3).

Required (missing: :class:`~worker.errors.ModelFileError` naming the key and the file):
``context_length``, ``embedding_length``, ``block_count``, ``attention.layer_norm_rms_epsilon``
(each ``get_key(..., required)``), ``feed_forward_length`` and ``attention.head_count`` (read
with ``false``, but their default is 0, with which no layer's tensors have the shapes llama.cpp
checks: it refuses the file when it creates them).

Optional, llama.cpp's default (:data:`OPTIONAL`): ``attention.head_count_kv`` -> the head count;
``rope.freq_base`` -> 10000; ``attention.key_length`` (the head size; for Llama
``rope.dimension_count`` too) -> ``embedding_length / head_count``; ``vocab_size`` -> the
``tokenizer.ggml.tokens`` count (else the embedding's rows: what its shape check asks);
``attention.sliding_window`` -> Gemma 2: 4096, Gemma 3: none (every layer global, one RoPE
base), Phi-3: none (the reader keeps a stated one: :func:`~worker.models.checkpoint.gguf_config`).
``rope.scaling.*`` are read with their defaults where they are read
(:func:`~worker.models.checkpoint.gguf_rope_parameters`).
"""

from __future__ import annotations

from worker.errors import ModelFileError

REQUIRED = {
    "context_length": ("the context length it was trained for", int),
    "embedding_length": ("hidden size", int),
    "block_count": ("layer count", int),
    "feed_forward_length": ("feed-forward width", int),
    "attention.head_count": ("attention head count", int),
    "attention.layer_norm_rms_epsilon": ("RMSNorm epsilon", float),
}
"""``{key after the architecture's prefix: (what it is, its type)}``: what every family read here needs
stated (llama.cpp refuses a file without it)."""

OPTIONAL = {
    "attention.head_count_kv": "the head count (no grouped-query attention)",
    "rope.freq_base": "10000",
    "attention.key_length": "embedding_length / head_count",
    "rope.dimension_count": "the head size",
    "vocab_size": "the number of tokenizer.ggml.tokens (else the embedding's rows)",
    "attention.sliding_window": "gemma2: 4096; gemma3: none (every layer global); phi3: none",
}
"""Keys a file may leave out, and llama.cpp's value for them (what :func:`with_llama_cpp_defaults` sets)."""

ROPE_BASE = 10000.0
"""llama.cpp's ``rope_freq_base_train`` where ``rope.freq_base`` is missing (and Gemma 3's local base)."""

GEMMA2_WINDOW = 4096
"""llama.cpp's Gemma 2 sliding window where ``gemma2.attention.sliding_window`` is missing."""


def check_required(metadata: dict, arch: str, path: str) -> None:
    """Raise :class:`~worker.errors.ModelFileError` for the first key of :data:`REQUIRED` that the
    file at ``path`` (an ``arch`` GGUF; ``metadata``: its header's) lacks or states as no positive
    number of its type, naming the key and the file; the words clients read are "its files could
    not be read"."""
    for key, (what, kind) in REQUIRED.items():
        name = f"{arch}.{key}"
        value = metadata.get(name)
        if value is None:
            raise ModelFileError(f"cannot read GGUF file {path!r}: its metadata has no {name} (the model's {what}), "
                                 f"which llama.cpp and slotserve require; the file is not a whole model "
                                 f"(convert it again)")
        number = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not number or not value > 0:
            raise ModelFileError(f"cannot read GGUF file {path!r}: its {name} (the model's {what}) is {value!r}, "
                                 f"not a positive {'number' if kind is float else 'integer'}; the file is corrupt")


def with_llama_cpp_defaults(config: dict, metadata: dict, shapes: dict, arch: str) -> dict:
    """transformers' GGUF config dict ``config`` with llama.cpp's value (:data:`OPTIONAL`) for each
    optional key the file does not state, where the family's config class would otherwise take its
    own default; a new dict. ``metadata``: the file's header (:func:`check_required` passed);
    ``shapes``: tensor name -> shape (torch order), for a vocabulary nothing else states."""
    config = dict(config)
    heads = metadata[f"{arch}.attention.head_count"]
    config.setdefault("num_key_value_heads", heads)
    config.setdefault("rope_theta", ROPE_BASE)
    key_length = metadata.get(f"{arch}.attention.key_length")
    config["head_dim"] = key_length if isinstance(key_length, int) else metadata[f"{arch}.embedding_length"] // heads
    if "vocab_size" not in config and "token_embd.weight" in shapes:
        config["vocab_size"] = shapes["token_embd.weight"][0]
    if f"{arch}.attention.sliding_window" not in metadata:
        if arch == "gemma2":
            config["sliding_window"] = GEMMA2_WINDOW
        elif arch == "gemma3":  # no window: every layer global, on the (one) file's RoPE base
            config["sliding_window"] = None
            config["layer_types"] = ["full_attention"] * metadata[f"{arch}.block_count"]
    return config
