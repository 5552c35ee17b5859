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
iteration ``step(plan)`` and ``release_slot(slot)`` when a slot is freed
(finished, cancelled, deadline), always before the slot is given to another
request. As in Orca and nano-vllm, the engine decides and the model computes:

- The engine **plans** each iteration (:class:`BatchPlan`, made by
  :mod:`worker.planner`): ``plan.batch`` holds one :class:`SlotInput` per
  occupied slot; ``plan.chunks`` maps the batch index of each slot whose
  prompt is not prefilled yet to the prompt tokens to compute now (chunked
  prefill: at most the model's ``prefill_budget`` tokens in all per
  iteration, prompts already started first, so the decoding slots never wait
  for more than one chunk, as vLLM's and SGLang's chunked prefill). Every
  other slot decodes: it carries exactly one token the model has not seen
  (the one it returned last time) -- or, after a step that gave the slot
  several tokens, all of them appended, of which the model has not seen the
  last.
- The model **returns** a :class:`StepOutput` (one record per step, an
  entry per batch entry) and never writes into the plan or its inputs. A
  slot's tokens (``tokens[i]``, then ``more[i]``) are what the model
  produced for it:

  - none (``tokens[i]`` None): a prompt chunk that does not finish the
    prompt (or a slot the plan gave 0 tokens). The engine appends nothing,
    checks no termination and streams nothing for that slot. Only valid for
    a slot in ``plan.chunks``; a decoding slot without a token (and without
    an error) ends its request with a ModelError.
  - one token: the usual case (a decode, or the chunk that ends the prompt).
  - several tokens (speculative decoding: accepted draft tokens and one
    more). The engine appends them in order, one iteration each, with every
    check of a one-token iteration (stop tokens and sequences,
    ``max_tokens``, streaming, cancellation), so results are those of one
    token per step; tokens after the request ends are dropped.

  ``errors[i]`` (no token then): this slot's computation failed (e.g. its
  logits are NaN). The engine ends that request alone with
  ``finish_reason="error"`` (the exception, wrapped in a ModelError, is its
  error); the other slots go on. Raising from ``step`` instead fails every
  slot of the batch. ``logprobs`` / ``prompt_logprobs`` / ``cached_tokens``:
  see :class:`StepOutput`.

  An entry that breaks this contract -- further tokens that are not a list
  of token ids, or without a first token; an error next to a token, or one
  that is no exception; ``logprobs`` / ``prompt_logprobs`` that are not a
  list of one entry per token for a slot that asks -- ends that request
  alone with a ModelError saying what was wrong (its tokens are dropped);
  a ``more`` / ``errors`` key that is no batch index, a ``tokens`` of the
  wrong length, or first tokens the termination checks cannot read (e.g.
  lists) fail the batch, as raising does.

The engine reads the usual step (a token for every slot, no ``more``, no
``errors``) with one C-level scan of ``tokens`` (``None in tokens``) and
appends it as it is, so a slot-aware model's tokens cost about what a
stateless model's do (one small record per step more).

Optional attributes on either kind, read once by the engine (``prefill_budget``
at every iteration that prefills):

- ``vocab_size: int`` -- token ids must lie in ``[0, vocab_size)``.
- ``max_seq_len: int`` -- prompt + ``max_tokens`` must not exceed it.
- ``eos_token_ids: tuple[int, ...]`` -- the default stop tokens when the
  engine is built with ``stop_token="model"`` (real models).
- ``tokenizer: TextCodec`` -- present when the model can take text prompts.
- ``gives_logprobs: bool`` -- True for a slot-aware model that fills
  ``StepOutput.logprobs`` / ``prompt_logprobs`` (a model with logits); the
  engine refuses ``logprobs`` / ``prompt_logprobs`` requests for any other
  model (SimulatedLLM, stateless ``next_tokens`` models) at submission.
- ``prefill_budget: int`` (slot-aware) -- the model can prefill a prompt in
  chunks over several iterations: the engine plans at most this many prompt
  tokens per iteration. Absent or None: every prompt is planned whole in its
  first iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from protocol.request import GREEDY, SamplingParams  # how a slot's next token is picked; defined with the request

__all__ = ["BatchPlan", "IncrementalDecoder", "SlotInput", "SlotModel", "StatelessModel", "StepOutput", "TextCodec"]


@dataclass(slots=True)
class SlotInput:
    """One occupied slot, as the engine hands it to a SlotModel (inside a :class:`BatchPlan`).

    Owned by the engine and reused from one iteration to the next: the model
    reads it, never writes it.

    - ``slot``: slot index in ``[0, num_slots)``.
    - ``tokens``: the request's full sequence so far (prompt + generated),
      the engine's own list -- read it, never mutate or keep it.
    - ``sampling``: how to pick the next token.
    - ``prompt_len``: ``tokens[:prompt_len]`` is the prompt, the rest the
      output (resumed tokens of a migrated request included): what the
      penalties count (:mod:`worker.models.processors`).
    - ``logprobs``: None, or ``N``: the request wants each token's
      :class:`~protocol.logprobs.TokenLogprob` with ``N`` alternatives; the
      model (one with ``gives_logprobs``) then gives ``StepOutput.logprobs``
      for every token it returns for the slot.
    - ``prompt_logprobs``: None, or ``N``: score the prompt
      (``tokens[:prompt_len]``) while prefilling it; the model gives
      ``StepOutput.prompt_logprobs`` with the slot's first token. The engine
      sets it back to None then (a resumed request never asks).
    """

    slot: int
    tokens: list[int]
    sampling: SamplingParams = GREEDY
    prompt_len: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class BatchPlan:
    """One iteration of a slot-aware model, as the engine planned it (:mod:`worker.planner`).

    - ``batch``: one :class:`SlotInput` per occupied slot, in batch order
      (the engine's own list, reused: read it, never keep it).
    - ``chunks``: batch index -> prompt tokens (int >= 0) to compute in this
      iteration, for each slot whose prompt is not prefilled yet, in the
      order to run them (prompts already started first). A chunk continues
      from where the model's state of the slot ends: for a new occupant,
      after the prefix the model takes from its own prefix cache, if any
      (reported in ``StepOutput.cached_tokens``), so a chunk never runs past
      the slot's last token. 0: the slot waits (the budget is spent).
      Every slot not in ``chunks`` decodes. The model must not mutate it.
      None (only when driving a model by hand: tests, benchmarks): every
      slot's unseen tokens are computed whole.
    """

    batch: list[SlotInput]
    chunks: dict[int, int] | None = None


@dataclass(slots=True)
class StepOutput:
    """What a slot-aware model's ``step`` computed: one record per step, indexed by batch entry
    (as vLLM's ``ModelRunnerOutput``), so the usual step -- one token per slot -- costs one
    list and no record per slot. The dicts are None (the default) when empty; a model may pass
    its own, filled or not.

    - ``tokens``: one entry per entry of ``plan.batch``, same order: the first
      (usually the only) token the slot produced, None for none (a prompt
      chunk that did not finish its prompt, or a failure: see ``errors``).
    - ``more``: batch index -> the slot's further tokens after ``tokens[i]``,
      in order (speculative decoding: accepted drafts and one more); only
      for slots that produced several.
    - ``logprobs``: batch index -> one :class:`~protocol.logprobs.TokenLogprob`
      per token produced (``tokens[i]``, then ``more[i]``), for each slot
      that produced tokens and whose ``SlotInput.logprobs`` is set.
    - ``prompt_logprobs``: batch index -> one entry per prompt token, the
      first None, with the slot's first token, for a slot whose
      ``SlotInput.prompt_logprobs`` is set.
    - ``cached_tokens``: batch index -> the prompt tokens (of
      ``tokens[:prompt_len]``) whose KV a model with a prefix cache took from
      it, 0 for a miss, in the step that starts the slot's prefill (its first
      chunk); absent counts as 0. The engine gives it to the request with its
      first token (``RequestHandle.cached_tokens``).
    - ``errors``: batch index -> why this slot's computation failed
      (``tokens[i]`` is then None); the request alone ends with
      ``finish_reason="error"``.
    """

    tokens: list[int | None]
    more: dict[int, list[int]] | None = None
    logprobs: dict[int, list] | None = None
    prompt_logprobs: dict[int, list] | None = None
    cached_tokens: dict[int, int] | None = None
    errors: dict[int, BaseException] | None = None


@runtime_checkable
class StatelessModel(Protocol):
    def next_tokens(self, sequences: list[list[int]]) -> list[int]: ...


@runtime_checkable
class SlotModel(Protocol):
    """A model with per-slot state; see the module docstring for the call order."""

    def bind_slots(self, num_slots: int) -> None: ...

    def step(self, plan: BatchPlan) -> StepOutput:
        """Run ``plan``; return what it computed for each entry of ``plan.batch`` (see the module docstring)."""
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

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """The chat prompt's ids: ``messages`` as :meth:`protocol.request.ChatMessage.template_dict`
        gives them; ``tools`` (OpenAI's definitions) is passed only when the request has tools,
        ``template_kwargs`` (extra template variables: the request's ``chat_template_kwargs``) only
        when it has them; ``add_generation_prompt=False`` (no generation prompt) and
        ``continue_final_message=True`` (the final message left open, to be continued: transformers'
        argument) only when the request asks for them."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (EOS, ...) left out by default, as in vLLM."""
        ...

    def decoder(self, prompt_ids: Sequence[int]) -> IncrementalDecoder: ...
