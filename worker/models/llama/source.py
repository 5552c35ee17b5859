"""Where the runner's weights come from: a transformers module, or a GGUF file read without one.

:class:`LlamaSource` is what :class:`~worker.models.llama.weights.LlamaWeights`
copies: the config, the tensors of each layer, the final norm, the
embedding and the LM head (None when tied to the embedding), and RoPE's
inverse frequencies.

- :meth:`LlamaSource.from_hf`: from a loaded transformers causal LM of a family.
- :func:`from_state_dict`: from a config object and tensors under transformers'
  names, without the module: what :func:`worker.models.checkpoint.read_gguf`
  gives for a GGUF file of any family in
  :data:`~worker.models.checkpoint.GGUF_FAMILIES`. The process then never
  imports transformers' modelling stack (``modeling_utils`` pulls in
  torch.distributed, torch._dynamo and sympy): measured for SmolLM2-135M,
  ~115 MiB less RSS in every worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    def from_hf(cls, model, parts: dict) -> LlamaSource:
        """The tensors of a transformers decoder LM (shared, not copied); ``parts``: source layer key
        -> module path in a decoder layer (:attr:`~worker.models.llama.family.Family.parts`), a part
        the layer lacks left out (q/k norms, sandwich norms)."""
        cfg, base = model.config, model.base_model
        layers = []
        for layer in base.layers[: cfg.num_hidden_layers]:
            layer_parts = {}
            for key, path in parts.items():
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
        else:  # Gemma 3: one RoPE per layer type, a buffer only for the types the layers have
            full, sliding = (_rope_of(rope, t) for t in ("full_attention", "sliding_attention"))
            (inv_freq, scaling), local = full or sliding, sliding or full  # the absent one serves no layer
            local = (local[0].detach().float().cpu(), float(local[1]))
        return cls(cfg, layers, base.norm.weight.detach(), embed.detach(),
                   None if head is embed else head.detach(), inv_freq.detach().float().cpu(),
                   float(scaling), eos, local)


def _rope_of(rope, layer_type: str) -> tuple | None:
    """``(inv_freq, attention_scaling)`` of a per-layer-type RoPE module (Gemma 3's) for ``layer_type``,
    or None where no layer has that type (transformers then makes no buffer for it)."""
    inv_freq = getattr(rope, f"{layer_type}_inv_freq", None)
    return None if inv_freq is None else (inv_freq, getattr(rope, f"{layer_type}_attention_scaling"))


def from_state_dict(config, tensors: dict, parts: dict | None = None) -> LlamaSource | None:
    """The :class:`LlamaSource` of a config object (``Qwen2Config``, ...) and tensors under
    transformers' names (``model.layers.{i}.{path}.weight`` and ``.bias``, ``model.norm.weight``,
    ``model.embed_tokens.weight``, ``lm_head.weight``), as a GGUF read gives them
    (:func:`worker.models.checkpoint.read_gguf`); ``parts``: default the family's
    (:func:`family_parts`), a part the tensors lack left out.

    None for an untied model without its LM head (transformers then decides). RoPE: ``inv_freq``
    and the attention scaling of the config's ``rope_parameters`` (or older ``rope_scaling`` and
    ``rope_theta``), as transformers computes them for the static types (default, linear,
    llama3, yarn; :func:`~worker.models.llama.rope.rope_inv_freq`, equality tested), per layer
    type where the config has two (Gemma 3). Raises
    :class:`~worker.models.llama.family.Unsupported` for another RoPE type.
    """
    from worker.models.llama.rope import rope_inv_freq

    n, heads, hidden = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layers = []
    for i in range(n):
        layer = {}
        for key, path in (parts or family_parts(config.model_type)).items():
            for suffix, name in (("", "weight"), (".bias", "bias")):
                tensor = tensors.get(f"model.layers.{i}.{path}.{name}")
                if tensor is not None:
                    layer[key + suffix] = tensor
        layers.append(layer)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = None if tied else tensors.get("lm_head.weight")
    if head is None and not tied:
        return None
    params = getattr(config, "rope_parameters", None) or {**(getattr(config, "rope_scaling", None) or {}),
                                                          "rope_theta": config.rope_theta}
    nested = isinstance(params.get("full_attention"), dict)
    ropes = [rope_inv_freq(p, config, head_dim) for p in
             ([params["full_attention"], params["sliding_attention"]] if nested else [params])]
    return LlamaSource(config, layers, tensors["model.norm.weight"], tensors["model.embed_tokens.weight"], head,
                       *ropes[0], [getattr(config, "eos_token_id", None)], ropes[1] if nested else None)


def family_parts(model_type: str) -> dict:
    """Source layer key -> module path in a transformers decoder layer, for ``model_type``'s family
    (what :func:`~worker.models.llama.family.describe` puts in ``Family.parts``)."""
    from worker.models.llama.family import GEMMA_PARTS, LLAMA_PARTS, PHI3_PARTS

    return GEMMA_PARTS if model_type in ("gemma2", "gemma3_text") else PHI3_PARTS if model_type == "phi3" else LLAMA_PARTS
