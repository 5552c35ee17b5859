"""One iteration's inputs: host lists built from the batch, and the step plan the forward runs.

The runner (:mod:`worker.models.llama.runner`) decides which cache rows
decode and which prompt chunks prefill (:class:`Chunk`), and which decode
rows carry draft tokens (:class:`Draft`); this module turns that into one
list per field, one entry per new token (:func:`decode_inputs`, then
:func:`add_prefill`), and those lists into the index tensors of a
:class:`StepPlan` (:func:`step_plan`), which
:func:`worker.models.llama.model.forward` runs. The CUDA decode step
(:mod:`worker.models.llama.cuda_graphs`) builds its inputs with the same
:func:`decode_inputs`, so both users import it from here (neither imports
the other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from worker.models.llama.cache import SlotCache
from worker.models.transfer import to_device


class Draft(NamedTuple):
    """A greedy decode row's draft tokens this iteration (speculative decoding)."""

    row: int  # cache row
    pos: int  # the position of the row's token; the drafts go to ``pos + 1 ..``
    tokens: list[int]


class Chunk(NamedTuple):
    """A prompt chunk of this iteration: tokens ``start .. start + count - 1`` of batch entry ``index``."""

    index: int  # in the batch
    row: int  # cache row
    start: int
    count: int


class PrefillSpan(NamedTuple):
    """One prefill sequence of a :class:`StepPlan`: entries ``offset .. offset + count - 1`` are its
    tokens at positions ``start ..`` of cache row ``row``."""

    offset: int
    count: int
    row: int
    start: int


class DecodeInputs(NamedTuple):
    """Host lists of one iteration's entries (see :func:`decode_inputs`; :func:`add_prefill` appends to them).

    - ``ids``, ``positions``, ``write_rows``, ``write_pos``: per entry its
      token, its position, and where its key/value goes (cache row, position).
    - ``lengths``: per query place of the decode attention, how many keys it sees.
    - ``out_rows``, ``out_index``: entry ``out_rows[j]`` gives batch entry
      ``out_index[j]`` a token.
    - ``slots``: speculative decoding only (else None): the place of each
      decode entry among the attention's ``rows * queries`` query places.
    - ``score_rows``, ``score_spans``: ``prompt_logprobs`` (:func:`add_prefill`): entries
      whose logits score the next prompt token (after ``out_rows`` in ``logits_at``), and
      per prefill chunk that has some ``(batch index, first target position, count)``:
      they predict ``tokens[first .. first + count - 1]``, in that order.
    """

    ids: list[int]
    positions: list[int]
    write_rows: list[int]
    write_pos: list[int]
    lengths: list[int]
    out_rows: list[int]
    out_index: list[int]
    slots: list[int] | None
    score_rows: list[int]
    score_spans: list[tuple[int, int, int]]


@dataclass(slots=True)
class StepPlan:
    """The new tokens of one iteration, as index tensors (built once per iteration).

    - ``ids``, ``positions``, ``write_rows``, ``write_pos``: ``[N]`` long; entry
      ``i`` is token ``ids[i]`` at sequence position ``positions[i]``, whose
      key/value is stored at cache row ``write_rows[i]``, position ``write_pos[i]``.
    - ``n_decode``: entries ``0..n_decode-1`` are decode queries of cache rows
      ``0..n_decode / queries - 1``, ``queries`` per row (row ``r``'s are entries
      ``r * queries ..``: its token, then draft tokens when speculating);
      ``lengths`` ``[n_decode]`` the keys each sees (its own included);
      ``window`` >= ``max(lengths)`` the keys looked at. With ``queries > 1``
      (speculative decoding) the entries are only the real queries, and
      ``decode_slots`` ``[n_decode]`` places each among the ``rows * queries``
      of the attention (``lengths`` has one per place; the others are padding).
    - ``prefill``: a :class:`PrefillSpan` per prefill sequence.
    - ``logits_at``: ``[n_out]`` entries whose next-token logits are wanted (the entries that give
      a token, then those that score a prompt token: ``DecodeInputs.score_rows``).
    - ``greedy``: per ``logits_at`` entry, True when only its argmax is wanted
      (then, with a screened head, its logits are exact at the candidates and
      ``-inf`` elsewhere: :class:`~worker.models.llama.screen.ScreenedHead`);
      None: whole logits for all.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    write_pos: torch.Tensor
    n_decode: int
    lengths: torch.Tensor | None
    window: int
    prefill: list[PrefillSpan]
    logits_at: torch.Tensor
    queries: int = 1
    decode_slots: torch.Tensor | None = None
    greedy: list[bool] | None = None


def decode_inputs(batch, decode: dict[int, int], cache: SlotCache, drafts: dict[int, Draft] | None = None,
                  queries: int = 1) -> DecodeInputs:
    """Host lists for the decode rows ``0..max(decode)`` (``decode``: cache row -> batch index);
    advances ``cache.lengths``.

    One query per row (``queries == 1``): every row is an entry, and rows not
    in ``decode`` (free or prefilling) are padding (token 0, the scratch
    position, one key); ``slots`` is None.

    Speculative decoding (``queries > 1``): a decoding row's entries are its
    token and its draft tokens (``drafts``: batch index -> :class:`Draft`);
    only those are computed, and ``slots[e]`` places entry ``e`` among the
    attention's ``rows * queries`` queries (the others are padding: one key).
    Every entry gives a token, and the row's length counts all of them until
    :meth:`~worker.models.llama.runner.LlamaRunner.step` keeps the accepted ones.
    """
    ids, positions, rows, write_pos, out_rows, out_index = [], [], [], [], [], []
    n_rows = max(decode) + 1 if decode else 0
    lengths = [1] * (n_rows * queries)
    slots = [] if queries > 1 else None
    scratch = cache.scratch
    for row in range(n_rows):
        i = decode.get(row)
        if i is None:
            if slots is None:
                ids.append(0), positions.append(0), rows.append(row), write_pos.append(scratch)
            continue
        pos = cache.lengths[row]
        tokens = [batch[i].tokens[pos]]
        if i in (drafts or ()):
            tokens += drafts[i].tokens
        for t, tok in enumerate(tokens):
            out_rows.append(len(ids)), out_index.append(i)
            if slots is not None:
                slots.append(row * queries + t)
            ids.append(tok), positions.append(pos + t), rows.append(row), write_pos.append(pos + t)
            lengths[row * queries + t] = pos + t + 1
        cache.lengths[row] = pos + len(tokens)
    return DecodeInputs(ids, positions, rows, write_pos, lengths, out_rows, out_index, slots, [], [])


def add_prefill(inputs: DecodeInputs, batch, chunks: Sequence[Chunk], cache: SlotCache) -> list[PrefillSpan]:
    """Append the entries of ``chunks`` to ``inputs``' lists (after the decode entries); advances
    ``cache.lengths``. A chunk that ends its prompt gives the request's first token (its last entry).

    A chunk of an entry asking ``prompt_logprobs`` also scores: its entry at position ``p`` predicts
    the prompt token ``p + 1`` (known, also across chunks: a chunk's last entry predicts the next
    chunk's first token), for every ``p + 1 < prompt_len`` (``score_rows`` / ``score_spans``)."""
    ids, positions, rows, write_pos = inputs.ids, inputs.positions, inputs.write_rows, inputs.write_pos
    spans = []
    for i, row, start, count in chunks:
        offset = len(ids)
        ids.extend(batch[i].tokens[start:start + count])
        span = range(start, start + count)
        positions.extend(span), write_pos.extend(span)
        rows.extend([row] * count)
        spans.append(PrefillSpan(offset, count, row, start))
        cache.lengths[row] = start + count
        if start + count == len(batch[i].tokens):  # prompt done: its last token gives the first output
            inputs.out_rows.append(offset + count - 1), inputs.out_index.append(i)
        if batch[i].prompt_logprobs is not None:
            scored = min(start + count, batch[i].prompt_len - 1) - start
            if scored > 0:
                inputs.score_rows.extend(range(offset, offset + scored))
                inputs.score_spans.append((i, start + 1, scored))
    return spans


def step_plan(inputs: DecodeInputs, n_decode: int, prefill: list[PrefillSpan], queries: int,
              greedy: list[bool] | None, device: str) -> StepPlan:
    """The :class:`StepPlan` of ``inputs`` on ``device`` (the first ``n_decode`` entries decode)."""
    return StepPlan(
        ids=to_device(inputs.ids, torch.long, device),
        positions=to_device(inputs.positions, torch.long, device),
        write_rows=to_device(inputs.write_rows, torch.long, device),
        write_pos=to_device(inputs.write_pos, torch.long, device), n_decode=n_decode,
        lengths=to_device(inputs.lengths, torch.long, device) if n_decode else None,
        window=max(inputs.lengths, default=0), prefill=prefill,
        logits_at=to_device(inputs.out_rows + inputs.score_rows if inputs.score_rows else inputs.out_rows,
                            torch.long, device), queries=queries,
        decode_slots=None if inputs.slots is None else to_device(inputs.slots, torch.long, device),
        greedy=greedy,
    )
