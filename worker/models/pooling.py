"""Pooling: how an embedding model turns its last hidden states into one vector per prompt.

:class:`Pooling` says how (mode, normalisation, the longest prompt); :func:`read_pooling` reads it
from a sentence-transformers folder, in that library's own formats:

- ``modules.json``: the module pipeline. slotserve runs ``Transformer`` (the transformers model),
  ``Pooling`` and ``Normalize``; a folder with another module (``Dense``, ``LayerNorm``, ...)
  is refused, as its output would not be the library's.
- ``1_Pooling/config.json`` (the ``Pooling`` module's ``path``): one mode, mean, cls or last
  token, as ``pooling_mode`` (``"mean"``, ``"cls"``, ``"lasttoken"``: sentence-transformers 5.2+)
  or the older booleans (``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``,
  ``pooling_mode_lasttoken``); the other modes (max, mean_sqrt_len, weightedmean) and several at
  once are refused.
- ``sentence_bert_config.json``: ``max_seq_length`` (the longest prompt, in tokens) and
  ``do_lower_case`` (the text is lower-cased before tokenising, as the library does).

:func:`pool` computes it, the same arithmetic as sentence-transformers' ``Pooling`` and
``Normalize`` modules (so results agree to float32 rounding): the mean is the masked sum divided
by the token count clamped at 1e-9; the last token is the last one the mask keeps (right
padding); normalisation is ``torch.nn.functional.normalize(p=2, dim=1)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from worker.errors import ModelFileError

MODES = ("mean", "cls", "last")
"""Pooling modes: the mean of the prompt's hidden states, the first token's (BERT's ``[CLS]``), or
the last token's (a decoder's: the only one that has seen the whole prompt)."""

_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
"""sentence-transformers' pooling modes that slotserve runs -> :data:`MODES`."""
_ST_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
"""The older config's booleans -> the library's mode names (its ``_LEGACY_POOLING_MODE_KWARGS``)."""


@dataclass(frozen=True, slots=True)
class Pooling:
    """How one model pools: ``mode`` (one of :data:`MODES`), ``normalize`` (scale each vector to
    unit L2 norm), ``max_seq_length`` (the longest prompt in tokens, special tokens included;
    None: the model's position limit), ``lower_case`` (lower-case text before tokenising).
    ValueError for a mode outside :data:`MODES` or a length < 1."""

    mode: str
    normalize: bool
    max_seq_length: int | None = None
    lower_case: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_seq_length is not None and (type(self.max_seq_length) is not int or self.max_seq_length < 1):
            raise ValueError(f"max_seq_length must be None or an int >= 1, got {self.max_seq_length!r}")


def is_sentence_transformers(folder: str | Path) -> bool:
    """Whether ``folder`` is a sentence-transformers model folder (it has ``modules.json``)."""
    return (Path(folder) / "modules.json").is_file()


def read_pooling(folder: str | Path) -> Pooling:
    """The :class:`Pooling` of the sentence-transformers folder ``folder`` (see the module docstring).
    ValueError for a folder whose pipeline or pooling mode slotserve does not run;
    :class:`~worker.errors.ModelFileError` for a ``modules.json`` or pooling config that cannot be
    read, does not parse or is not the shape sentence-transformers writes."""
    folder = Path(folder)
    try:
        modules = json.loads((folder / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]  # (the class name, whatever its module path)
        paths = {kind: m.get("path", "") for kind, m in zip(kinds, modules)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelFileError(f"cannot read {folder / 'modules.json'}: {e}") from None
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise ValueError(f"{folder}: sentence-transformers modules {kinds}; slotserve runs Transformer, Pooling "
                         "and optionally Normalize, in that order")
    config = _json(folder / paths["Pooling"] / "config.json")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY.items() if config.get(key)] or ["mean"]  # (the library's default)
    elif isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1 or modes[0] not in _ST_MODES or config.get("include_prompt", True) is not True:
        raise ValueError(f"{folder}: pooling config {config}; slotserve pools with exactly one of "
                         f"{', '.join(_ST_MODES)} (include_prompt true)")
    bert = _json(folder / "sentence_bert_config.json") if (folder / "sentence_bert_config.json").is_file() else {}
    return Pooling(_ST_MODES[modes[0]], "Normalize" in kinds, bert.get("max_seq_length"),
                   bool(bert.get("do_lower_case")))


def _json(path: Path) -> dict:
    """The JSON object in the file ``path``; ModelFileError for a file that cannot be read, does not
    parse or holds something else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path} must hold a JSON object")
    return value


def pool(hidden, mask, pooling: Pooling):
    """One vector per row: ``hidden`` ``[batch, tokens, size]`` (float), ``mask`` ``[batch, tokens]``
    (1 for a prompt token, 0 for right padding; every row with at least one token) ->
    ``[batch, size]``, pooled by ``pooling.mode`` and normalised when ``pooling.normalize``."""
    import torch

    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "last":
        last = mask.sum(dim=1) - 1
        out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:  # mean: sentence-transformers' Pooling, operation for operation
        expanded = mask.unsqueeze(-1).expand(hidden.size()).to(hidden.dtype)
        out = torch.sum(hidden * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)
    if pooling.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out
