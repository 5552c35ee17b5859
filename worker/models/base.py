"""The model interface the engine drives.

Two kinds of model plug into :class:`worker.BatchInferenceEngine`:

**Stateless** -- any object with::

    next_tokens(sequences: list[list[int]]) -> list[int]

one next token per sequence, same order. ``sequences`` are the engine's own
token lists (prompt followed by the tokens generated so far); they are passed
by reference, never copied, and the model must not mutate them.
:class:`worker.SimulatedLLM` is one.

**Slot-aware** -- a :class:`SlotModel`, for models that keep per-slot state
such as a KV cache. The engine calls ``bind_slots(num_slots)`` once, then per
iteration ``step(batch)`` with one :class:`SlotInput` per occupied slot, and
``release_slot(slot)`` when a slot is freed (finished, cancelled, deadline),
always before the slot is given to another request. A slot that was just
assigned shows up in ``step`` with tokens the model has not seen (the model
prefills them); afterwards each call carries exactly one new token per slot
(the one the model returned last time), which the model decodes.

``step`` returns one entry per slot, same order. Besides a token id, an
entry may be:

- ``None``: no token this iteration -- the slot's prompt is not fully
  prefilled yet (chunked prefill: a long prompt is processed over several
  iterations so the other slots keep decoding). The engine appends nothing,
  checks no termination and streams nothing for that slot, and calls ``step``
  again with the same tokens. Only valid before the slot's first token;
  afterwards the engine ends that request with a ModelError.
- an exception instance: this slot's computation failed (e.g. its logits
  are NaN). The engine ends that request alone with ``finish_reason="error"``
  (the exception, wrapped in a ModelError, is its error); the other slots
  go on. Raising from ``step`` instead fails every slot of the batch.
- a non-empty list of token ids: several tokens at once (speculative
  decoding: accepted draft tokens and one more). The engine appends them in
  order, one iteration each, with every check of a one-token iteration
  (stop tokens and sequences, ``max_tokens``, streaming, cancellation), so
  results are those of one token per step; tokens after the request ends
  are dropped. Next time the slot carries all appended tokens, of which the
  model has not seen the last.

The engine tells these apart with one scan of the entries' types, so a
step that returns only ints costs nothing extra.

Optional attributes on either kind, read once by the engine:

- ``vocab_size: int`` -- token ids must lie in ``[0, vocab_size)``.
- ``max_seq_len: int`` -- prompt + ``max_tokens`` must not exceed it.
- ``eos_token_ids: tuple[int, ...]`` -- the default stop tokens when the
  engine is built with ``stop_token="model"`` (real models).
- ``tokenizer: TextCodec`` -- present when the model can take text prompts.
- ``gives_logprobs: bool`` -- True for a slot-aware model that fills
  ``SlotInput.scored`` / ``prompt_scored`` (a model with logits); the
  engine refuses ``logprobs`` / ``prompt_logprobs`` requests for any other
  model (SimulatedLLM, stateless ``next_tokens`` models) at submission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from protocol.request import GREEDY, SamplingParams  # how a slot's next token is picked; defined with the request

__all__ = ["GREEDY", "IncrementalDecoder", "SamplingParams", "SlotInput", "SlotModel", "StatelessModel", "TextCodec"]


@dataclass(slots=True)
class SlotInput:
    """One occupied slot in one iteration, as the engine hands it to a SlotModel.

    - ``slot``: slot index in ``[0, num_slots)``.
    - ``tokens``: the request's full sequence so far (prompt + generated),
      the engine's own list -- read it, never mutate or keep it.
    - ``sampling``: how to pick the next token.
    - ``prompt_len``: ``tokens[:prompt_len]`` is the prompt, the rest the
      output (resumed tokens of a migrated request included): what the
      penalties count (:mod:`worker.models.processors`).
    - ``logprobs``: None, or ``N``: the request wants each token's
      :class:`~protocol.logprobs.TokenLogprob` with ``N`` alternatives; the
      model (one with ``gives_logprobs``) then sets ``scored`` in every
      ``step`` that returns tokens for the slot: one entry per token
      returned, in order (a list, fresh each step).
    - ``prompt_logprobs``: None, or ``N``: score the prompt
      (``tokens[:prompt_len]``) while prefilling it; the model sets
      ``prompt_scored`` in the ``step`` that returns the slot's first token:
      one entry per prompt token, the first None. The engine reads both and
      sets ``prompt_logprobs`` back to None (a resumed request never asks).
    - ``cached_tokens``: set by a model with a prefix cache when it starts the
      slot's prefill: prompt tokens (of ``tokens[:prompt_len]``) whose KV it
      took from the cache, 0 for a miss. The engine reads it with the slot's
      first token (``RequestHandle.cached_tokens``); None (not set) counts as 0.
    """

    slot: int
    tokens: list[int]
    sampling: SamplingParams = GREEDY
    prompt_len: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    scored: list | None = None
    prompt_scored: list | None = None
    cached_tokens: int | None = None


@runtime_checkable
class StatelessModel(Protocol):
    def next_tokens(self, sequences: list[list[int]]) -> list[int]: ...


@runtime_checkable
class SlotModel(Protocol):
    """A model with per-slot state; see the module docstring for the call order."""

    def bind_slots(self, num_slots: int) -> None: ...

    def step(self, batch: Sequence[SlotInput]) -> list[int | None | BaseException]:
        """Return the next token for every entry of ``batch``, same order (or None / an
        exception for an entry, see the module docstring)."""
        ...

    def release_slot(self, slot: int) -> None: ...


class IncrementalDecoder(Protocol):
    """Streams text from token ids without splitting multi-byte characters."""

    def step(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (maybe '')."""
        ...


class TextCodec(Protocol):
    """Text in and out for models with a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat prompt's ids: ``messages`` as :meth:`protocol.request.ChatMessage.template_dict`
        gives them; ``tools`` (OpenAI's definitions) is passed only when the request has tools."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (EOS, ...) left out by default, as in vLLM."""
        ...

    def decoder(self, prompt_ids: Sequence[int]) -> IncrementalDecoder: ...
