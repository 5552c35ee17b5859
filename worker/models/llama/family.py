"""The decoder families the runner serves, as data: what each does differently from Llama.

The runner's forward (:mod:`worker.models.llama.model`) is one decoder loop;
the ways Qwen2/2.5, Qwen3, Mistral, Gemma 2/3 and Phi-3 differ from Llama are
the fields of :class:`Family`, read from the transformers config once at load
(:func:`describe`), as llama.cpp's per-architecture hparams and nano-vllm's
model files do:

========================  =========================================================
family (``model_type``)   differences from Llama (transformers' modelling code)
========================  =========================================================
``llama``                 none (q/k/v biases where ``attention_bias``)
``mistral``               sliding-window attention in every layer (``sliding_window``)
``qwen2``                 q/k/v biases; sliding window in the layers ``layer_types`` says
``qwen3``                 q/k RMSNorm per head before RoPE; ``layer_types`` windows
``gemma2``                embedding times sqrt(hidden); RMSNorm as ``(1 + w)``; tanh
                          GeGLU; norms after attention and MLP too; attention and
                          final logit soft-capping; ``query_pre_attn_scalar``;
                          alternating sliding/global layers
``gemma3_text``           Gemma 2's, minus soft-capping by default, plus q/k norms and a
                          local RoPE base for the sliding layers
``phi3``                  q/k/v and gate/up stored fused (``qkv_proj``, ``gate_up_proj``);
                          longrope while every position is below
                          ``original_max_position_embeddings``; sliding window
========================  =========================================================

A config asking for something outside these fields (a RoPE whose
frequencies change with the sequence length, partial rotary dimensions,
bidirectional attention, MLP biases, another activation) is refused by
:func:`describe` with the reason (:class:`Unsupported`), so a model is never
run silently wrong; ``--runner auto`` then takes the transformers runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA_PARTS = {  # source layer key -> transformers' module path inside a decoder layer
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "ln1": "input_layernorm", "ln2": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",  # where the family has them
}
FUSED = (("q", "k", "v"), ("gate", "up"))
"""Source layer keys the runner fuses into one linear each (qkv, gate_up; :func:`~worker.models.llama.weights.layer_weights`),
in their order there; a GGUF file's quantised parts of one are read as one
(:func:`worker.models.gguf_blocks.stored_weights`)."""
GEMMA_PARTS = {**LLAMA_PARTS, "ln2": "pre_feedforward_layernorm", "post_attn": "post_attention_layernorm",
               "post_mlp": "post_feedforward_layernorm"}
PHI3_PARTS = {k: v for k, v in LLAMA_PARTS.items() if k not in ("q", "k", "v", "gate", "up")} | {
    "qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
"""The ``model_type`` values the runner serves."""

_GEMMA = ("gemma2", "gemma3_text")
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed, independent of sequence length
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class Unsupported(ValueError):
    """A config feature the runner does not implement; the message is the reason."""


@dataclass(frozen=True, slots=True)
class Family:
    """One model's departures from Llama, fixed at load (see module docstring).

    - ``model_type``; ``parts``: source layer key -> module path in a transformers decoder layer.
    - ``norm_offset``: RMSNorm weights are applied as ``offset + w`` (1.0 for Gemma, else 0.0).
    - ``sandwich``: norms after attention and after the MLP too (``post_attn``, ``post_mlp``).
    - ``activation``: of the gated MLP, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
    - ``embed_scale``: the embedding rows are multiplied by it (Gemma: sqrt(hidden)), or None.
    - ``attn_softcap``, ``final_softcap``: ``cap * tanh(x / cap)`` on attention scores / logits, or None.
    - ``scaling``: attention scores' factor (``head_dim ** -0.5``, Gemma ``query_pre_attn_scalar ** -0.5``).
    - ``windows``: per layer, its sliding window in tokens (a query at position ``p`` sees keys
      ``p - window + 1 .. p``, transformers' ``sliding_window_overlay``), or None (full causal;
      also where the window covers every position the cache holds).
    - ``local_rope``: per layer, True where it uses the local RoPE table (Gemma 3's sliding layers).
    """

    model_type: str
    parts: dict
    norm_offset: float
    sandwich: bool
    activation: str
    embed_scale: float | None
    attn_softcap: float | None
    final_softcap: float | None
    scaling: float
    windows: tuple
    local_rope: tuple

    @property
    def windowed(self) -> frozenset:
        """The distinct sliding windows of the layers (None: full attention)."""
        return frozenset(self.windows)


def describe(config, max_len: int) -> Family:
    """The :class:`Family` of a transformers config (``LlamaConfig``, ``Qwen2Config``, ...) for a
    cache of ``max_len`` tokens per slot.

    Raises :class:`Unsupported` (a ValueError) naming the feature the runner does not implement.
    """
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise Unsupported(f"architecture {kind!r} is not one of {', '.join(FAMILIES)}")
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    if get("pretraining_tp", 1) != 1:
        raise Unsupported("pretraining_tp != 1")
    if get("mlp_bias", False):
        raise Unsupported("MLP biases")
    if get("use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention")
    act_name = get("hidden_activation") if kind in _GEMMA else get("hidden_act")
    activation = _ACTIVATIONS.get(act_name)
    if activation is None or (kind not in _GEMMA and activation != "silu"):
        raise Unsupported(f"activation {act_name!r}")
    heads = config.num_attention_heads
    head_dim = get("head_dim") or config.hidden_size // heads
    local = _check_rope(config, max_len)
    n = config.num_hidden_layers
    layer_types = list(get("layer_types") or [])
    window = get("sliding_window")
    if kind in ("mistral", "phi3") or not layer_types:
        layer_types = ["sliding_attention" if window else "full_attention"] * n
    if len(layer_types) < n or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise Unsupported(f"layer types {sorted(set(layer_types))}")
    windowed = window is not None and window < max_len  # a window that covers the cache is full attention
    windows = tuple(window if t == "sliding_attention" and windowed else None for t in layer_types[:n])
    gemma = kind in _GEMMA
    scaling = get("query_pre_attn_scalar") ** -0.5 if gemma else head_dim ** -0.5
    return Family(
        model_type=kind, parts=GEMMA_PARTS if gemma else PHI3_PARTS if kind == "phi3" else LLAMA_PARTS,
        norm_offset=1.0 if gemma else 0.0, sandwich=gemma, activation=activation,
        embed_scale=math.sqrt(config.hidden_size) if gemma else None,
        attn_softcap=get("attn_logit_softcapping") if gemma else None,
        final_softcap=get("final_logit_softcapping") if gemma else None,
        scaling=scaling, windows=windows,
        local_rope=tuple(local and t == "sliding_attention" for t in layer_types[:n]))


def context_length(config) -> int:
    """The model's context length in tokens, from its transformers config (any architecture, not
    only the runner's families: the HF runner reads it too). Raises ValueError when absent."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot find the context length in the {type(config).__name__}")


def rope_position_limit(config) -> int | None:
    """The most positions over which ``config``'s RoPE is static when its type changes frequencies
    past a length (longrope: ``original_max_position_embeddings``), else None. Both runners hold a
    cache of at most that many tokens per slot by default and refuse a longer one."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for p in ([params.get("full_attention"), params.get("sliding_attention")]
              if isinstance(params.get("full_attention"), dict) else [params]):
        p = p or {}
        if p.get("rope_type", p.get("type")) == "longrope":
            return p.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    return None


def _check_rope(config, max_len: int) -> bool:
    """Raise :class:`Unsupported` for a RoPE the runner cannot reproduce within ``max_len`` positions;
    return whether the config has a separate local (sliding-layer) RoPE (Gemma 3).

    Static types (default, linear, llama3, yarn) have fixed frequencies. longrope (Phi-3)
    switches to its long factors once a forward's positions pass
    ``original_max_position_embeddings`` (transformers' ``longrope_frequency_update``, per
    forward, so per batch): it is static only while ``max_len`` stays within that length.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = isinstance(params.get("full_attention"), dict)
    if nested and getattr(config, "model_type", None) != "gemma3_text":
        raise Unsupported("RoPE parameters per layer type")
    for p in ([params.get("full_attention"), params.get("sliding_attention")] if nested else [params]):
        p = p or {}
        rope_type = p.get("rope_type", p.get("type", "default"))
        if p.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
            raise Unsupported("partial rotary dimensions (partial_rotary_factor != 1)")
        if rope_type == "longrope":
            original = rope_position_limit(config)
            if original is None or max_len > original:
                raise Unsupported(
                    f"longrope RoPE past original_max_position_embeddings={original} (its frequencies "
                    f"change once a sequence passes it; transformers switches per forward); "
                    f"a cache of at most {original} tokens per slot (max_cache_len) runs exactly")
        elif rope_type not in _STATIC_ROPE:
            raise Unsupported(f"RoPE type {rope_type!r} (its frequencies change with the sequence length)")
    return nested
