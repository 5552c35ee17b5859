"""Whether a checkpoint's weights fit its config: checked as transformers loads them, and as
slotserve's own GGUF reader reads a file (:func:`gguf_unfitted`).

transformers' ``from_pretrained`` builds the module its config describes (a folder's
``config.json``, a GGUF file's metadata) and then copies the weights files' tensors into it:

- a tensor whose shape is not the module's (``hidden_size``, ``vocab_size``,
  ``num_key_value_heads`` or ``intermediate_size`` edited, or another size's config.json beside
  the weights) made it raise a bare ``RuntimeError`` ("You set `ignore_mismatched_sizes` to
  `False`, thus raising an error. For details look at the above report!"), the tensors named only
  in a table it logs, so clients read "an unexpected error";
- a tensor the module needs and the files lack (``num_hidden_layers`` raised) was left at its
  random initial values, with a logged warning, and the model served noise.

Both are faults of the model's files (:class:`~worker.errors.ModelFileError`), as vLLM's loader
("Following weights were not initialized from checkpoint") and llama.cpp's ("tensor ... has wrong
shape", "missing tensor") refuse them; the error names the first tensor (by name) and its shapes.

Tensors the files hold and the module has no place for (transformers' ``unexpected`` keys, after
its own per-model exceptions) are left to its log: they change nothing the forward computes, and
valid checkpoints hold them (a causal LM's ``lm_head`` under an embedding model's base module,
extra prediction heads). A lowered ``num_hidden_layers`` is one of them, and is not seen here.

slotserve's GGUF reader (:func:`worker.models.checkpoint.read_gguf`, the runner's own path) builds
no module: a tensor whose shape is not what the file's metadata makes it (``feed_forward_length`` or
``attention.head_count_kv`` edited) loaded, and every request then failed with the forward's
``RuntimeError`` ("shape '[5, 2, 1, 64]' is invalid for input of size 1280"). :func:`gguf_unfitted`
computes each tensor's shape from the config (:func:`expected_shapes`) and says the same words.
"""

from __future__ import annotations

__all__ = ["expected_shapes", "fitted", "gguf_unfitted", "unfitted"]


def fitted(auto_class, path: str, **kwargs):
    """``auto_class.from_pretrained(path, **kwargs)`` (a transformers auto class:
    ``AutoModelForCausalLM``, ``AutoModel``) with its load report checked: ``(module, cause)``, where
    ``cause`` is None when the weights fit the config, else what clients may read of the fault
    (:func:`unfitted`; no path), for the caller to raise as a :class:`~worker.errors.ModelFileError`
    beside its own words (the path, for the log). Raises what ``from_pretrained`` raises for files it
    cannot read or a config it refuses."""
    module, info = auto_class.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True,
                                              **kwargs)
    return module, unfitted(info, gguf=bool(kwargs.get("gguf_file")))


def unfitted(info: dict, gguf: bool = False) -> str | None:
    """What does not fit in transformers' load report ``info`` (``from_pretrained``'s
    ``output_loading_info``: ``mismatched_keys``, a set of ``(name, shape in the files, shape in the
    module)``; ``missing_keys``, a set of names), in one line that names the first tensor (mismatched
    shapes first, then by name) and its shapes, and says what to do; None when every tensor fits.
    ``gguf``: the config is a GGUF file's metadata, not a folder's config.json."""
    config = "its metadata" if gguf else "config.json"
    mismatched = sorted((name, list(stored), list(built))
                        for name, stored, built in info.get("mismatched_keys") or ())
    missing = sorted(info.get("missing_keys") or ())
    if mismatched:
        name, stored, built = mismatched[0]
        first = f"{name} is {stored} in the weights, {built} by {config}"
    elif missing:
        first = f"{config} asks for {missing[0]}, which the weights do not hold"
    else:
        return None
    others = len(mismatched) + len(missing) - 1
    first += f", and {others} other tensor{'s' if others > 1 else ''}" if others else ""
    todo = "download the model again" if gguf else "fix config.json or download the model again"
    return f"its weights do not match {'its metadata' if gguf else 'its config.json'} ({first}); {todo}"


def expected_shapes(config, parts: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as ``config`` (attributes as transformers' ``LlamaConfig``: ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
    ``vocab_size``) makes it, under transformers' names: ``model.embed_tokens.weight`` and
    ``lm_head.weight`` ``(vocab, hidden)``, ``model.norm.weight`` ``(hidden,)``, and for each of
    ``num_layers`` layers each part in ``parts`` (source layer key -> module path:
    :func:`~worker.models.llama.source.family_parts`) as :class:`~worker.models.llama.source.LlamaSource`
    documents it (a weight ``(out, in)``, its bias ``(out,)``, a norm ``(hidden,)`` or ``(head_dim,)``)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q = heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    ffn = config.intermediate_size
    weights = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q), "qkv": (q + 2 * kv, hidden),
               "gate": (ffn, hidden), "up": (ffn, hidden), "gate_up": (2 * ffn, hidden), "down": (hidden, ffn),
               "ln1": (hidden,), "ln2": (hidden,), "post_attn": (hidden,), "post_mlp": (hidden,),
               "q_norm": (head_dim,), "k_norm": (head_dim,)}
    vocab = (config.vocab_size, hidden)
    shapes = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab, "model.norm.weight": (hidden,)}
    for i in range(num_layers):
        for key, path in parts.items():
            shapes[f"model.layers.{i}.{path}.weight"] = weights[key]
            shapes[f"model.layers.{i}.{path}.bias"] = weights[key][:1]
    return shapes


def gguf_unfitted(config, tensors: dict, parts: dict, num_layers: int) -> str | None:
    """:func:`unfitted`'s words for a GGUF file's ``tensors`` (transformers name -> an fp32 tensor or a
    :class:`~worker.models.llama.quantized.QuantizedWeight`, as :func:`worker.models.checkpoint.read_gguf`
    reads them) whose shapes are not what its metadata (``config``) makes them (:func:`expected_shapes`);
    None when each fits. A tensor the config has no shape for is not judged."""
    shapes = expected_shapes(config, parts, num_layers)
    mismatched = set()
    for name, tensor in tensors.items():
        stored = tuple(tensor.shape) if hasattr(tensor, "shape") else (tensor.out_features, tensor.in_features)
        if name in shapes and stored != shapes[name]:
            mismatched.add((name, stored, shapes[name]))
    return unfitted({"mismatched_keys": mismatched}, gguf=True)
