"""Embedding models: transformers' base model (no LM head) and a pooling step (:class:`EmbeddingModel`).

Two kinds of checkpoint, one code path (:func:`load_embedder`):

- a **sentence-transformers folder** (``modules.json``; e.g. the alias ``all-minilm-l6-v2``): its
  transformers model (``AutoModel``: BERT and the other encoders, or a decoder) and its pooling,
  normalisation and ``max_seq_length`` from its own config files (:func:`worker.models.pooling.read_pooling`);
- a **decoder of the generation families** (any checkpoint ``load_model`` reads through transformers,
  ``.gguf`` files included) with ``pooling`` set (``--pooling last|mean``): the last hidden states of
  ``AutoModel`` (the decoder stack and its final norm, as vLLM's poolers read them), pooled so and
  normalised (vLLM's default for embedding models).

Why transformers' forward and not slotserve's decoder runner for the decoder families: an embedding is
one prefill of the prompt with no decode and no KV cache to keep, which is all the runner adds; the
transformers forward is the numerical reference and takes any architecture, encoders included, in
one path.

Batching (:meth:`EmbeddingModel.embed`): the prompts of one engine step are sorted by length and cut
into forwards of at most :data:`MAX_ROWS` prompts and :data:`BATCH_TOKENS` padded tokens, each
right-padded to its longest prompt (as sentence-transformers' ``encode`` sorts its inputs by length and
runs batches of 32); padding is masked, so a prompt's embedding does not depend on its batch beyond
float rounding. The more requests a step holds (the worker's ``--slots``), the closer the lengths in
each forward and the less padding: bench/embeddings.py measures 64 and 256.
"""

from __future__ import annotations

import logging
from typing import Sequence

from worker.models.pooling import Pooling, is_sentence_transformers, pool, read_pooling

log = logging.getLogger(__name__)

BATCH_TOKENS = 16384
"""Most padded tokens (rows x longest prompt) per forward: bounds the activations' memory (about
``BATCH_TOKENS x hidden size x 4`` bytes a layer's output: 24 MiB for MiniLM's 384) while keeping
forwards wide enough that the CPU's matrix products run at full speed."""

MAX_ROWS = 32
"""Most prompts per forward: sentence-transformers' default batch size. Measured on all-MiniLM-L6-v2
(bench/embeddings.py's sentences, 2 cores): a step's 64 prompts in one forward padded to the longest
took 2.4x the time of two forwards of 32, each padded to its own longest."""

DECODER_NORMALIZE = True
"""A decoder served with ``--pooling`` gives unit-length embeddings (vLLM's default for embedding
models: cosine similarity is then a dot product)."""


class EmbeddingModel:
    """One embedding model: ``embed(prompts) -> vectors``. What the worker and the broker read of it:

    - ``embedding_size``: the length of its embeddings (the hidden size); ``matryoshka_dims``: the
      lengths ``dimensions`` may cut them to (:class:`protocol.messages.ModelInfo`);
    - ``vocab_size``; ``max_seq_len``: the longest prompt, in tokens (``max_seq_length`` of a
      sentence-transformers folder, else the position limit, at most ``max_model_len`` when given);
    - ``tokenizer``: the text codec (:class:`~worker.models.hf_text.HFTextCodec`), or None (token ids only);
    - ``pooling``: its :class:`~worker.models.pooling.Pooling`; ``runs``: what it runs as, for people.
    """

    def __init__(self, module, codec, pooling: Pooling, *, max_seq_len: int | None, device: str, precision: str,
                 matryoshka_dims: tuple[int, ...] = ()) -> None:
        config = module.config
        self.module = module
        self.tokenizer = codec
        self.pooling = pooling
        self.vocab_size = int(config.vocab_size)
        self.embedding_size = int(config.hidden_size)
        self.max_seq_len = max_seq_len
        self.matryoshka_dims = matryoshka_dims
        self.device = device
        self.runs = f"{precision}: transformers {type(module).__name__}, {pooling.mode} pooling" + \
            (", normalised" if pooling.normalize else "")
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0  # (masked: any id does)

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids, special tokens included (as sentence-transformers tokenises; lower-cased
        first when the folder says ``do_lower_case``). ValueError for empty text; UnsupportedError
        (a ValueError) for a model without a tokenizer."""
        if self.tokenizer is None:
            from protocol.errors import UnsupportedError

            raise UnsupportedError("this embedding model has no tokenizer: send token ids, not text")
        return self.tokenizer.encode(text.lower() if self.pooling.lower_case else text)

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[bytes]:
        """The embedding of each prompt (token ids, non-empty, each within ``max_seq_len`` and the
        vocabulary: checked by the caller), in order, as little-endian float32 bytes
        (``embedding_size`` x 4 each). Raises what the forward raises."""
        import torch

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[bytes] = [b""] * len(prompts)
        start = 0
        with torch.inference_mode():
            while start < len(order):
                end = start + 1
                while end < len(order) and end - start < MAX_ROWS and \
                        (end + 1 - start) * len(prompts[order[end]]) <= BATCH_TOKENS:
                    end += 1
                rows = order[start:end]
                vectors = self._forward([prompts[i] for i in rows])
                for i, v in zip(rows, vectors):
                    out[i] = v
                start = end
        return out

    def _forward(self, prompts: list[Sequence[int]]) -> list[bytes]:
        """One padded forward of ``prompts`` (sorted by length: the last is the longest)."""
        import numpy as np
        import torch

        width = len(prompts[-1])
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
            mask[r, :len(p)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.module(input_ids=ids, attention_mask=mask).last_hidden_state
        vectors = pool(hidden, mask, self.pooling).float().cpu().numpy().astype("<f4", copy=False)
        return [np.ascontiguousarray(v).tobytes() for v in vectors]


def embeds(name: str, pooling: str | None) -> bool:
    """Whether ``load_model(name, pooling=pooling)`` builds an embedding model: ``pooling`` given, or
    ``name`` resolves to a sentence-transformers folder."""
    if pooling is not None:
        return True
    from worker.models.checkpoint import resolve_model_path

    try:
        path, gguf_file = resolve_model_path(name)
    except (OSError, ValueError):
        return False
    return gguf_file is None and is_sentence_transformers(path)


def load_embedder(name: str, pooling: str | None, device: str, precision: str,
                  max_model_len: int | None = None) -> EmbeddingModel:
    """The :class:`EmbeddingModel` of ``name`` (an alias, a folder, a ``.gguf`` file, a hub id) on
    ``device`` (``cpu`` / ``cuda``) in ``precision`` (``fp32`` / ``bf16``). ``pooling`` (one of
    :data:`worker.models.pooling.MODES`): required for a checkpoint that is not a sentence-transformers
    folder (a decoder; normalised, :data:`DECODER_NORMALIZE`), and for such a folder it replaces the
    folder's mode. ``max_model_len``: the longest prompt, at most the model's.

    Raises :class:`~worker.errors.ModelFileError` for a checkpoint whose files cannot be found or
    read (:func:`~worker.models.checkpoint.resolve_model_path`, the sentence-transformers files:
    :func:`~worker.models.pooling.read_pooling`, the weights: :func:`~worker.models.checkpoint.loader_error`)
    or whose weights do not fit its config (:mod:`worker.models.weights_fit`),
    ValueError for one transformers will not build, a folder whose pipeline slotserve does not run,
    another precision, or a decoder without ``pooling``."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"an embedding model runs fp32 or bf16 (transformers' forward), not {precision}")
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModel, AutoTokenizer

    from worker.errors import ModelFileError
    from worker.models.checkpoint import loader_error, resolve_model_path
    from worker.models.hf_text import HFTextCodec
    from worker.models.weights_fit import fitted

    path, gguf_file = resolve_model_path(name)
    folder = gguf_file is None and is_sentence_transformers(path)
    if folder:
        config = read_pooling(path)
        if pooling is not None:
            config = Pooling(pooling, config.normalize, config.max_seq_length, config.lower_case)
    elif pooling is None:
        raise ValueError(f"{name!r} is no sentence-transformers folder (no modules.json): give its pooling "
                         "(--pooling last or mean) to serve it as an embedding model")
    else:
        config = Pooling(pooling, DECODER_NORMALIZE)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        module, unfit = fitted(AutoModel, path, dtype=torch.float32 if precision == "fp32" else torch.bfloat16,
                               **kwargs)
    except (OSError, ValueError, SafetensorError) as exc:
        raise loader_error(f"cannot load embedding model {name!r} from {path!r}: {exc}", exc) from exc
    if unfit is not None:
        raise ModelFileError(f"cannot load embedding model {name!r} from {path!r}: {unfit}", cause=unfit)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    codec = HFTextCodec(tokenizer) if tokenizer is not None and tokenizer.is_fast else None
    limits = [n for n in (config.max_seq_length, getattr(module.config, "max_position_embeddings", None),
                          max_model_len) if isinstance(n, int) and n > 0]
    dims = getattr(module.config, "matryoshka_dimensions", None)
    size = int(module.config.hidden_size)
    if dims:
        dims = tuple(sorted({int(d) for d in dims if 0 < int(d) <= size}))
    elif getattr(module.config, "is_matryoshka", False):
        dims = tuple(range(1, size + 1))
    model = EmbeddingModel(module.to(device).eval(), codec, config, max_seq_len=min(limits) if limits else None,
                           device=device, precision=precision, matryoshka_dims=dims or ())
    log.info("loaded embedding model %r: %s, %d floats, prompts up to %s tokens", name, model.runs,
             model.embedding_size, model.max_seq_len)
    return model
