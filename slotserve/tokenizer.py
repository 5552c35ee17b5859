"""The gateway's tokenizer loader (:mod:`gateway.tokenizer`): the served model's own tokenizer,
found as the worker finds it (``worker.models``), so token strings are the worker's tokens.

:func:`load_tokenizer` is what ``slotserve serve`` and ``slotserve up --http-port`` give the
gateway (a module-level function: the launcher's gateway process gets it by name). It runs on a
gateway thread in the background (transformers' import and a GGUF vocabulary: ~2-5 s), so the
HTTP server starts as fast as before.
"""

from __future__ import annotations

import os


def is_local_model(name: str) -> bool:
    """Whether ``name`` is a model this machine has: an alias (``smollm2-135m``), a model folder, a
    GGUF file, or a hub id in the local Hugging Face cache, as the worker finds it
    (:func:`worker.models.names.locate_model`; nothing is downloaded)."""
    from worker.models.names import ALIASES, locate_model

    try:
        return name in ALIASES or locate_model(name) is not None
    except ValueError:
        return False


def load_tokenizer(name: str, *, explicit: bool = False):
    """``name``'s tokenizer as a :class:`gateway.tokenizer.Tokenizer`, or None when ``name`` is no
    local model (``simulated``, a hub id) or has no fast tokenizer (token ids only).

    ``explicit`` (``--tokenizer NAME``): a hub id is tried too, and a model without a usable
    tokenizer raises ValueError saying so. Loaded as :func:`worker.models.load_model` does: a
    GGUF's tokenizer from its metadata (no tensor converted), else ``AutoTokenizer``."""
    if name == "simulated" or not (explicit or is_local_model(name)):
        return None
    from gateway.tokenizer import Tokenizer
    from worker.models.checkpoint import resolve_model_path
    from worker.models.hf_text import HFTextCodec

    try:
        path, gguf_file = resolve_model_path(name)
    except ValueError as e:  # (explicit: a name that is no model here, said as the worker says it)
        raise ValueError(f"cannot load a tokenizer from {name!r}: {e}") from None
    tok = None
    if gguf_file is not None:
        from worker.models.gguf_tokenizer import gguf_tokenizer

        tok = gguf_tokenizer(os.path.join(path, gguf_file))
    if tok is None:
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            tok = AutoTokenizer.from_pretrained(path, **kwargs)
        except (OSError, ValueError, TypeError) as e:
            if explicit:
                raise ValueError(f"cannot load a tokenizer from {name!r}: {e}") from e
            return None
    if not tok.is_fast:
        if explicit:
            raise ValueError(f"{name!r} has no fast tokenizer (slotserve's text needs one)")
        return None
    return Tokenizer(HFTextCodec(tok), tok)


def explicit_loader(name: str):
    """The loader for ``--tokenizer NAME`` (:func:`load_tokenizer` with ``explicit=True``)."""
    return load_tokenizer(name, explicit=True)


def loader_for(config):
    """The loader a gateway with ``config`` (:class:`gateway.GatewayConfig`) gets: ``--tokenizer``'s
    (explicit), else each served model's own name's."""
    return explicit_loader if config.tokenizer is not None else load_tokenizer
