"""Where the runner's weights come from: a transformers module, or a GGUF file read without one.

:class:`LlamaSource` is what :class:`~worker.models.llama.weights.LlamaWeights`
copies: the config, the tensors of each layer, the final norm, the
embedding and the LM head (None when tied to the embedding), and RoPE's
inverse frequencies.

- :meth:`LlamaSource.from_hf`: from a loaded transformers ``LlamaForCausalLM``.
- :func:`read_gguf`: from a GGUF file, through transformers' own GGUF reader
  (``load_gguf_checkpoint``, one call that converts each tensor once: the
  dequantisation and the q/k un-permutation that ``from_pretrained``
  applies, so the same tensors bit for bit; tested) and its tokenizer through
  ``TokenizersBackend.from_pretrained`` (the class ``AutoTokenizer`` returns
  for these files, with the same settings; tested), which reads the
  metadata alone, without building the transformers model or its config class.
  The process then never imports transformers' modelling stack
  (``modeling_utils`` pulls in torch.distributed, torch._dynamo and sympy;
  ``AutoTokenizer`` the same through ``LlamaConfig``): measured for
  SmolLM2-135M, ~115 MiB less RSS in every worker. Only plain Llama GGUFs
  take this path (their config keys all in :data:`GGUF_KEYS`: default RoPE,
  no biases); :func:`read_gguf` returns None for any other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

GGUF_KEYS = frozenset({
    "model_type", "_model_name_or_path", "num_hidden_layers", "max_position_embeddings", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "rope_theta", "rms_norm_eps",
    "vocab_size", "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id", "unk_token_id",
    "pad_token_id",
})
"""The config keys a GGUF may have to be read by :func:`read_gguf` (what transformers' GGUF
reader gives a plain Llama file); anything else (RoPE scaling, biases) goes through transformers."""

_LAYER_PARTS = {  # LlamaSource layer key -> transformers' module path inside a decoder layer
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "ln1": "input_layernorm", "ln2": "post_attention_layernorm",
}


@dataclass
class LlamaSource:
    """A decoder model's config and tensors (Llama or another family), however they were read.

    - ``config``: attributes as transformers' ``LlamaConfig`` (``hidden_size``,
      ``num_attention_heads``, ``rms_norm_eps``, ...).
    - ``layers``: per decoder layer, ``{"q", "k", "v", "o", "gate", "up",
      "down": weight [out, in], "ln1", "ln2": [hidden]}``, plus ``"q.bias"``
      etc. where the model has attention biases; ``"qkv"`` and ``"gate_up"``
      instead where they are stored fused (Phi-3); ``"q_norm"``, ``"k_norm"``
      ``[head_dim]`` (Qwen3, Gemma 3) and ``"post_attn"``, ``"post_mlp"``
      ``[hidden]`` (Gemma) where the family has them (:mod:`worker.models.llama.family`).
    - ``norm`` ``[hidden]``, ``embed`` ``[vocab, hidden]``, ``head``
      ``[vocab, hidden]`` or None when the LM head is the embedding (tied).
    - ``inv_freq`` ``[head_dim / 2]`` and ``attention_scaling``: RoPE's, as
      transformers computes them.
    - ``eos_token_ids``: of the generation config and the model config.
    - ``local_rope``: ``(inv_freq, attention_scaling)`` of a second RoPE for the sliding-window
      layers (Gemma 3's local base), or None.
    """

    config: object
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor
    embed: torch.Tensor
    head: torch.Tensor | None
    inv_freq: torch.Tensor
    attention_scaling: float
    eos_token_ids: list = field(default_factory=list)
    local_rope: tuple | None = None  # (inv_freq, attention_scaling) of the sliding layers (Gemma 3)

    @classmethod
    def from_hf(cls, model, parts: dict | None = None) -> LlamaSource:
        """The tensors of a transformers decoder LM (shared, not copied); ``parts``: source layer key
        -> module path in a decoder layer (:attr:`~worker.models.llama.family.Family.parts`;
        default Llama's), a part the layer lacks left out (q/k norms, sandwich norms)."""
        cfg, base = model.config, model.base_model
        layers = []
        for layer in base.layers[: cfg.num_hidden_layers]:
            layer_parts = {}
            for key, path in (parts or _LAYER_PARTS).items():
                try:
                    module = layer.get_submodule(path)
                except AttributeError:
                    continue
                layer_parts[key] = module.weight.detach()
                if getattr(module, "bias", None) is not None:
                    layer_parts[key + ".bias"] = module.bias.detach()
            layers.append(layer_parts)
        head = model.get_output_embeddings().weight
        embed = base.embed_tokens.weight
        eos = [getattr(model.generation_config, "eos_token_id", None), cfg.eos_token_id]
        rope = base.rotary_emb
        if hasattr(rope, "inv_freq"):
            inv_freq, scaling, local = rope.inv_freq, rope.attention_scaling, None
        else:  # Gemma 3: one RoPE per layer type
            inv_freq, scaling = rope.full_attention_inv_freq, rope.full_attention_attention_scaling
            local = (rope.sliding_attention_inv_freq.detach().float().cpu(),
                     float(rope.sliding_attention_attention_scaling))
        return cls(cfg, layers, base.norm.weight.detach(), embed.detach(),
                   None if head is embed else head.detach(), inv_freq.detach().float().cpu(),
                   float(scaling), eos, local)


def read_gguf(path: str):
    """``(LlamaSource, tokenizer)`` from a plain Llama GGUF file (see module docstring), or None
    when the file is not one (the caller then loads it through transformers).

    The file's tensors are converted once, and its metadata parsed in full once, by one
    ``load_gguf_checkpoint`` call (which gives the config too); before it, the header alone
    (:func:`_llama_layer_count`) keeps every other architecture from costing a conversion.
    ``tokenizer``: a transformers ``TokenizersBackend`` (:func:`_tokenizer`), or None when the
    file has none. Raises ValueError for a file transformers' GGUF reader cannot read.
    """
    try:
        num_layers = _llama_layer_count(path)
        read = None if num_layers is None else _load_checkpoint(path, num_layers)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read GGUF file {path!r}: {exc}") from exc
    if read is None or not _is_plain_llama(read["config"]):
        return None
    source = _source(read["config"], read["tensors"])
    return None if source is None else (source, _tokenizer(path))


def _llama_layer_count(path: str) -> int | None:
    """The decoder layer count of a Llama-architecture file, from its header alone; None for any
    other architecture.

    transformers' fast metadata reader (``read_gguf_metadata``, the one its GGUF tokenizer uses)
    leaves the vocabulary's arrays unread: ~20 ms for SmolLM2, against ~3 s for the full parse
    that ``load_gguf_checkpoint`` does. This only says no early; :func:`_is_plain_llama` decides
    on the config that ``load_gguf_checkpoint`` returns.
    """
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(path)
    layers = metadata.get("llama.block_count")
    return layers if metadata.get("general.architecture") == "llama" and isinstance(layers, int) else None


def _load_checkpoint(path: str, num_layers: int) -> dict:
    """transformers' GGUF reader over the whole file: ``{"config", "tokenizer", "tokenizer_config",
    "tensors"}``, the tensors under transformers' Llama names, dequantised to fp32 and q/k
    un-permuted as ``from_pretrained`` has them."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    names = {"model.embed_tokens.weight": None, "model.norm.weight": None, "lm_head.weight": None}
    for i in range(num_layers):
        names.update({f"model.layers.{i}.{p}.weight": None for p in _LAYER_PARTS.values()})

    class _Names:  # what load_gguf_checkpoint reads of the model it would load into: names and sizes
        config = SimpleNamespace(model_type="llama", num_hidden_layers=num_layers)

        def state_dict(self):
            return names

        def named_children(self):
            return []

    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=_Names())


def _is_plain_llama(config: dict) -> bool:
    """Whether transformers' config for the file is a Llama with only :data:`GGUF_KEYS`."""
    return config.get("model_type") == "llama" and set(config) <= GGUF_KEYS


def _source(config: dict, tensors: dict) -> LlamaSource | None:
    """The :class:`LlamaSource` of a plain Llama's config and tensors, or None for an untied
    model without its LM head (transformers then decides)."""
    n, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    # LlamaConfig's values for what a plain Llama GGUF does not say
    cfg = SimpleNamespace(hidden_act="silu", pretraining_tp=1, mlp_bias=False, attention_bias=False,
                          tie_word_embeddings=False, num_key_value_heads=heads,
                          rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]})
    cfg.__dict__.update({k: v for k, v in config.items() if not k.startswith("_")})
    cfg.head_dim = head_dim
    # transformers' default RoPE (_compute_default_rope_parameters), same ops; equality tested
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    layers = [{key: tensors[f"model.layers.{i}.{p}.weight"] for key, p in _LAYER_PARTS.items()} for i in range(n)]
    head = None if cfg.tie_word_embeddings else tensors.get("lm_head.weight")
    if head is None and not cfg.tie_word_embeddings:
        return None
    return LlamaSource(cfg, layers, tensors["model.norm.weight"], tensors["model.embed_tokens.weight"], head,
                       inv_freq, 1.0, [config.get("eos_token_id")])


def _tokenizer(path: str):
    """The file's tokenizer as ``AutoTokenizer`` builds it for these files (``TokenizersBackend``,
    same settings; tested), or None when the file has none.

    From the metadata only: transformers' GGUF tokenizer path (``get_gguf_tokenizer`` and
    ``convert_gguf_tokenizer``) reads the vocabulary, merges, special tokens and chat template
    with its fast metadata reader (~0.2 s) and converts no tensor; tested. Building it from
    ``load_gguf_checkpoint``'s own tokenizer entries instead would mean copying that path's
    special-token and ``add_bos_token`` rules, which it applies only when reading a file.
    """
    from transformers import TokenizersBackend

    try:
        return TokenizersBackend.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except (OSError, ValueError, TypeError, KeyError):
        return None
