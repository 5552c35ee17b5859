"""Warm-up: a model's first calls, made before it is served ("ready means warm").

A model's first steps at a shape are slower than the rest: on CUDA each
decode batch size is captured into a CUDA graph the first time a step needs
it (:mod:`worker.models.llama.cuda_graphs`); on every device the first call
at a shape sets up kernels, oneDNN primitives and allocator pools, and a
tokenizer compiles its chat template on first use. Served cold, the first
requests pay for all of it (issue 22: 5.1 s for a 32-token chat that takes
1.0 s warm). :func:`warm_up` makes those calls before the worker registers,
through the engine's public interface only (``submit_request`` and
``step``), with synthetic greedy requests that have no stop token:

1. one request alone: a prefill (chunked as the model is configured) and
   decode steps at batch size 1, :data:`DECODE_TOKENS` tokens in all. With
   a tokenizer its prompt is the chat :data:`CHAT` (the template) and its
   text is streamed (the detokenizer), as every request of a worker with a
   tokenizer is; without, :data:`PROMPT_TOKENS` token ids;
2. ``min(num_slots, MAX_BATCH)`` requests of :data:`BATCH_PROMPT_TOKENS`
   token ids at once (another prompt than 1.'s, so none is a prefix-cache
   hit): their prefills (together, beside the decoding of the first ones, as
   under load), then decode steps at the batch sizes of :func:`batch_sizes`,
   from the largest down: the requests end in groups, one group per step.
   Their prompts are short: nothing a first call sets up depends on a
   prefill's length (the shapes of later prompts are theirs), and
   ``num_slots`` prefills of :data:`PROMPT_TOKENS` each made most of the
   warm-up's time on a larger model (Qwen2.5-Coder-1.5B at gguf on 2 cores:
   2.1 s of its 4.6 s).
3. a model with structured outputs (``model.grammars``,
   :mod:`worker.models.grammar`) builds its llguidance tokenizer
   (:meth:`~worker.models.grammar.Grammars.prepare`): built by the first
   constrained request instead, on the worker's I/O thread and holding the
   GIL (Qwen2.5's 151,665 tokens: 5-8.5 s on a loaded 2-core machine), it
   silenced the worker's heartbeats, the broker declared the worker lost
   and moved every request it held. A tokenizer llguidance cannot read is
   logged, and the model is served anyway (its constrained requests fail
   as before).

Its cost is bounded whatever ``num_slots``: at most :data:`MAX_BATCH`
requests and ``len(batch_sizes(...))`` decode levels. It once decoded at
every batch size from ``num_slots`` down to 1, one slot freed per step: a
quadratic cost (256 slots of SmolLM2-135M took 236 s on a loaded 2-core
machine, 16 slots 7 s) under which ``--slots 100000`` never became ready.
Past :data:`MAX_BATCH` a step's first-call set-up is small beside the step
itself; on CUDA the graph of a batch wider than that is captured by the
first step that needs it.

It leaves no trace: every request ends and frees its slot (the model's
``release_slot``, as for any request), nothing stays queued or in the
engine's book, and the ids are its own (``warmup-N``: the engine's id
counter does not move). A model's prefix cache keeps the blocks the warm-up
stored (the chat template's prefix serves the first chats) but its counters
are zeroed, so the hit rate a worker reports (``slotserve status``,
heartbeats) is that of the requests it served. Greedy picks never draw from the sampler's
generator, and a seeded request's draws depend on its seed and position
alone, so sampling after the warm-up is as after load. Stateless models
(``next_tokens``, such as :class:`~worker.SimulatedLLM`) keep no state
between calls: :func:`needs_warmup` says False for them.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass

from protocol.enums import FinishReason
from worker.engine import BatchInferenceEngine
from worker.models.base import SlotModel

log = logging.getLogger(__name__)

PROMPT_TOKENS = 96
"""Prompt length of the warm-up requests (tokens): a typical chat prompt's, long
enough for a real prefill, within the smallest decode window of the CUDA graphs."""

BATCH_PROMPT_TOKENS = 4
"""Prompt length of the ``num_slots`` requests of phase 2 (tokens). Short: their prefill sets up
what a batch's first prefill sets up at any length (Qwen2.5-Coder-1.5B at gguf, 8 slots, 2-core AMD
EPYC: the first 8 x 16-token prefill after a warm-up at 4 tokens took 1,116 ms, the next ones 1,120
and 1,165 ms), and 8 x 16 tokens made 1.1 s of that warm-up's 2.4 s of steps (8 x 4: 0.41 s)."""

MAX_BATCH = 256
"""Most requests of phase 2: the largest decode batch the warm-up runs (the largest of the CUDA
graphs' own sizes, :data:`worker.models.llama.cuda_graphs.BATCH_SIZES`)."""

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""The decode batch sizes phase 2 steps through below its width: the CUDA graphs' (one graph
each, a step padded to the next), which also spread the CPU's shapes. A copy of
:data:`worker.models.llama.cuda_graphs.BATCH_SIZES`, which imports torch (this module may not);
``tests/worker/test_warmup.py`` keeps the two equal."""

DECODE_TOKENS = 4
"""Tokens the request alone generates (the first from its prefill), and the
fewest a request of the ``num_slots`` together does."""

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
"""The warm-up's chat prompt (models with a tokenizer): short, since its prefill is the template's
own tokens (a system prompt, for Qwen2.5) and this text, and warms nothing a longer text would."""


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What :func:`warm_up` did: ``seconds`` (monotonic) over ``iterations``
    engine steps, ``max_batch`` the largest decode batch (rows), ``failed`` the
    warm-up requests that ended in error (the worker serves anyway: the log
    says why) and ``stopped``: cut short by the stop event."""

    seconds: float
    iterations: int
    max_batch: int
    failed: int = 0
    stopped: bool = False


def batch_sizes(num_slots: int) -> list[int]:
    """The decode batch sizes of phase 2 for ``num_slots`` slots, ascending: those of
    :data:`BATCH_SIZES` below its width ``min(num_slots, MAX_BATCH)``, then the width."""
    width = min(num_slots, MAX_BATCH)
    return [b for b in BATCH_SIZES if b < width] + [width]


def _budgets(num_slots: int, budget: int) -> list[int]:
    """Tokens each request of phase 2 generates (at most ``budget``): request ``i`` lives through
    the decode levels whose batch size is above ``i``, so the batch steps down :func:`batch_sizes`
    from the widest (the first request lives longest)."""
    sizes = batch_sizes(num_slots)
    return [min(DECODE_TOKENS + len(sizes) - 1 - bisect.bisect_right(sizes, i), budget) for i in range(sizes[-1])]


def needs_warmup(model) -> bool:
    """Whether ``model`` keeps state a warm-up sets up: slot-aware models do
    (a KV cache, CUDA graphs, kernels by shape), and so do embedding models
    (kernels and allocator pools by shape); stateless ones do not."""
    return isinstance(model, SlotModel) or getattr(model, "embedding_size", None) is not None


def warm_up(engine: BatchInferenceEngine, stop: threading.Event | None = None) -> WarmupReport:
    """Run the warm-up (see the module docstring) on ``engine``, which must be
    idle and not stepped by anyone else meanwhile; return when every warm-up
    request has ended and freed its slot. ``stop`` set: the requests left are
    cancelled and end in the next step. Logs its duration at INFO.

    An :class:`~worker.embeddings.EmbeddingEngine` (an embedding model) is warmed with one step
    of ``min(batch_size, MAX_BATCH)`` requests instead: its forwards at that width, at two lengths (short and
    :data:`PROMPT_TOKENS`), as a step of requests of mixed lengths makes them."""
    t0 = time.monotonic()
    if getattr(engine.model, "embedding_size", None) is not None:
        return _warm_up_embeddings(engine, stop, t0)
    tokenizer = getattr(engine.model, "tokenizer", None)
    on_text = (lambda piece: None) if tokenizer is not None else None  # (text is streamed, as the worker does)
    prompt, budget = _prompt(engine)
    short = _prompt(engine, BATCH_PROMPT_TOKENS, shift=1)[0]
    phases = (("alone", [(CHAT if tokenizer is not None else prompt, min(DECODE_TOKENS, budget))]),
              ("all", [(short, n) for n in _budgets(engine.batch_size, budget)]))
    steps = failed = 0
    stopped = False
    for name, requests in phases:
        handles = [_submit(engine, p, n, f"warmup-{name}-{i}", on_text, fallback=prompt)
                   for i, (p, n) in enumerate(requests)]
        s, stopped = _drain(engine, handles, stop)
        steps += s
        failed += _report_failures(handles)
        if stopped:
            break
    if not stopped:
        _prepare_grammars(engine.model)
    cache = getattr(engine.model, "prefix_cache", None)  # (worker.models.llama.prefix_cache)
    if cache is not None:
        cache.reset_stats()
    sizes = batch_sizes(engine.batch_size)
    report = WarmupReport(time.monotonic() - t0, steps, sizes[-1], failed, stopped)
    log.info("warm-up %s in %.2f s: %d iterations (a prefill alone, then %d of %d tokens at once), decode at "
             "batch sizes %s%s", "stopped" if stopped else "done", report.seconds, steps, sizes[-1],
             len(short), ", ".join(map(str, sizes)), f"; {failed} warm-up requests failed" if failed else "")
    return report


def _prepare_grammars(model) -> None:
    """Phase 3 (see the module docstring): ``model.grammars.prepare()``, where the model has one."""
    grammars = getattr(model, "grammars", None)
    if grammars is None:
        return
    try:
        seconds = grammars.prepare()
    except Exception as e:  # noqa: BLE001 -- the model is served anyway; its constrained requests say why
        log.warning("warm-up: the structured outputs' tokenizer could not be built (%s: %s); the model is "
                    "served anyway", type(e).__name__, e)
        return
    log.info("warm-up: the structured outputs' tokenizer built in %.2f s", seconds)


def _warm_up_embeddings(engine, stop: threading.Event | None, t0: float) -> WarmupReport:
    """:func:`warm_up` of an :class:`~worker.embeddings.EmbeddingEngine` (see there)."""
    limit = getattr(engine.model, "max_seq_len", None) or PROMPT_TOKENS
    short, _ = _prompt(engine, min(BATCH_PROMPT_TOKENS, limit))
    long, _ = _prompt(engine, min(PROMPT_TOKENS, limit), shift=1)
    handles = [engine.submit_request(long if i % 2 else short, request_id=f"warmup-embed-{i}")
               for i in range(min(engine.batch_size, MAX_BATCH))]
    steps, stopped = _drain(engine, handles, stop)
    report = WarmupReport(time.monotonic() - t0, steps, len(handles), _report_failures(handles), stopped)
    log.info("warm-up %s in %.2f s: %d embedding requests in %d step(s)", "stopped" if stopped else "done",
             report.seconds, len(handles), steps)
    return report


def _prompt(engine: BatchInferenceEngine, length: int = PROMPT_TOKENS, shift: int = 0) -> tuple[list[int], int]:
    """A token-id prompt of up to ``length`` tokens (``shift``: another sequence of ids) and the
    most tokens a warm-up request may generate, within the model's vocabulary and context."""
    vocab = getattr(engine.model, "vocab_size", None) or 256
    limit = getattr(engine.model, "max_seq_len", None)
    longest = DECODE_TOKENS + len(batch_sizes(engine.batch_size))  # more than phase 2's longest generates
    if limit is not None:
        length = max(1, min(length, limit - longest))
        longest = min(longest, limit - length)
    low = min(100, vocab // 4)  # past the special tokens most vocabularies start with
    return [low + (37 * i + 11 * shift) % (vocab - low) for i in range(length)], max(1, longest)


def _submit(engine: BatchInferenceEngine, prompt, max_tokens: int, request_id: str, on_text, *, fallback):
    """One warm-up request (no stop token, greedy); a chat the model's context
    cannot take is sent as the token-id ``fallback`` instead."""
    try:
        return engine.submit_request(prompt, max_tokens, on_text=on_text, request_id=request_id, stop_token=None)
    except ValueError:
        if prompt is fallback:
            raise
        return engine.submit_request(fallback, max_tokens, on_text=on_text, request_id=request_id, stop_token=None)


def _drain(engine: BatchInferenceEngine, handles: list, stop: threading.Event | None) -> tuple[int, bool]:
    """Step until every one of ``handles`` ended; return the steps taken and
    whether ``stop`` cut it short (its requests cancelled)."""
    steps, stopped = 0, False
    while not all(h.done() for h in handles):
        if stop is not None and stop.is_set() and not stopped:
            stopped = True
            for h in handles:
                engine.cancel(h.request_id)
        engine.step()
        steps += 1
    return steps, stopped


def _report_failures(handles: list) -> int:
    """Log the warm-up requests that ended in error; return how many."""
    failed = [h for h in handles if h.finish_reason is FinishReason.ERROR]
    if failed:
        log.warning("warm-up: %d of %d requests failed (%s); the model is served anyway", len(failed), len(handles),
                    failed[0].error)
    return len(failed)
