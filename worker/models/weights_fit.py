"""Whether a checkpoint's weights fit its config, checked as transformers loads them.

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
"""

from __future__ import annotations

__all__ = ["fitted", "unfitted"]


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
