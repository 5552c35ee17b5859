"""The engine's plan of each iteration of a slot-aware model: which prompt chunks run.

Every occupied slot is in every iteration (Orca's iteration-level batching):
a slot decodes, or, while its prompt is not prefilled, gets a chunk of it.
:func:`plan_chunks` picks the chunks within the model's ``prefill_budget``
(prompt tokens per iteration; :mod:`worker.models.base`): prompts already
started first, then in batch order; the one that does not fit gets what is
left and the rest wait (chunk 0), so the decoding slots never wait for more
than one chunk (vLLM's and SGLang's chunked prefill). A prompt with one
token left (a one-token prompt, or the last token after full chunks) is
decoded, not chunked.

The engine keeps one :class:`Prefill` per request that has had no token yet
(:attr:`worker.slots.SlotTable.prefilling`) and advances it from the model's
:class:`~worker.models.base.StepOutput` (:meth:`Prefill.advanced`). A
``Prefill`` is a tuple, so every new request shares :data:`NOT_STARTED` and
admitting one allocates nothing (the stateless models' requests never need
another).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from worker.request import Request

NO_CHUNKS: dict[int, int] = {}  # the plan of an iteration where no prompt is prefilled (shared: never mutated)


class Prefill(NamedTuple):
    """A running request's prefill so far.

    - ``done``: tokens of its sequence the model holds (computed, or taken
      from its prefix cache), in ``[0, len(seq)]``.
    - ``cached``: of those, the prompt tokens the model took from its prefix
      cache (``StepOutput.cached_tokens``); given to the request with its
      first token.
    """

    done: int = 0
    cached: int = 0

    def advanced(self, chunk: int, cached: int | None, length: int) -> Prefill:
        """After a step that gave the request no token: ``chunk`` planned tokens were computed,
        after the ``cached`` ones (None: no report) the model took from its prefix cache;
        ``length``: the request's sequence length."""
        return Prefill(min(length, self.done + (cached or 0) + chunk), cached or self.cached)


NOT_STARTED = Prefill()


def plan_chunks(prefilling: dict[Request, Prefill], budget: int | None) -> dict[int, int]:
    """This iteration's prompt chunks: batch index (``req.pos``) -> prompt tokens to compute.

    ``prefilling``: the running requests with no token yet; ``budget``: the
    most prompt tokens per iteration (int >= 1), None for no limit (whole
    prompts). Requests with one token left or none are left out (they
    decode). Order (the dict's): prompts already started, then new ones,
    each in batch order.
    """
    todo = sorted((p.done == 0, req.pos, len(req.seq) - p.done) for req, p in prefilling.items()
                  if len(req.seq) - p.done > 1)
    if not todo:
        return NO_CHUNKS
    left = sys.maxsize if budget is None else budget
    chunks = {}
    for _, pos, count in todo:
        count = min(count, left)
        chunks[pos] = count
        left -= count
    return chunks
