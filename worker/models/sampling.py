"""Next-token selection from logits, shared by every model runner: the one place a token is chosen.

For a whole batch at once, in vLLM's ``SamplingParams`` order
(vllm/sampling_params.py, vllm/model_executor/layers/sampler.py): raw logits
(the logprobs of the rows that ask are read here) -> the ``min_tokens`` mask (stop tokens -inf) -> ``logit_bias`` -> repetition,
presence and frequency penalties (the logits processors,
:mod:`worker.models.processors`) -> temperature -> top-k
-> top-p -> min-p -> the draw (greedy or seeded). One pass of tensor ops over
the rows that use a stage, and one host synchronisation (the final
``tolist``), so it costs the same on CPU and CUDA and never loops over the
vocabulary in Python. A row that is plain greedy
(:attr:`~protocol.request.SamplingParams.is_plain_greedy`) is the argmax of
its raw logits and pays for nothing else; every other row is copied out of
the batch first, so the raw logits stay as the model made them (for
logprobs, read from the same ``logits``).

Filters follow the usual definitions (as in transformers' ``TopKLogitsWarper``
and ``TopPLogitsWarper`` and vLLM): temperature divides the logits; top-k
keeps the tokens whose score is at least the ``k``-th largest (ties kept);
top-p keeps the smallest set of most likely tokens whose probability mass
reaches ``p`` (the most likely token is always kept), applied after top-k;
min-p drops the tokens whose probability is below ``min_p`` times the
largest (vLLM's ``_apply_min_p``; a ratio of probabilities, so the same
before or after the other two, which never drop the most likely token).
A greedy row with a processor is the argmax of its processed logits
(temperature, top-k, top-p and min-p never move the argmax). The draw is
inverse-CDF sampling: token ``i`` is the first whose cumulative
probability exceeds ``u * total`` for one uniform ``u`` in [0, 1) per row,
so a token of probability 0 is never drawn.

Logprobs (a row whose ``logprobs`` is set, :meth:`Sampler.pick_scored`): the
``log_softmax`` of the row's *raw* logits (before the processors, the
temperature and the filters; vLLM's default ``raw_logprobs``), the chosen
token's value and the ``N`` most likely ``(id, logprob)`` pairs, computed in
the same pass over only the rows that ask, and fetched with the tokens in the
same one host synchronisation; rows that do not ask pay nothing. The top-``N``
is exact with ties by lower id (:func:`top_ids`: ``topk`` over an int64 key,
the value's bits then the id). :func:`score` does the same for given target
tokens (a prompt's, for ``prompt_logprobs``). The runners give such rows the
full LM head (a screened head's logits are -inf outside its candidates).

Batch invariance and migration: a seeded request draws the token at
sequence position ``p`` (0-based index of the token being generated in
prompt + output) with ``u`` derived from ``mix_seed(seed, p)``. The draw
depends only on the request's own logits row, its seed and ``p`` -- never on
the batch, the slot, the worker or how many tokens were drawn before -- so a
request resumed elsewhere with ``resume_tokens`` continues the same stream
(and its penalties count the resumed tokens as output, as uninterrupted).
Unseeded requests draw ``u`` from one per-sampler generator seeded from the
OS.

Numeric containment: a failure in one row never touches another.

- A temperature below :data:`protocol.request.GREEDY_BELOW` is greedy (dividing logits by
  1e-40 overflows to inf and the softmax to NaN).
- A temperature past fp32's range (3.4e38) is taken as its largest value, and top-p keeps the
  most likely token whatever ``top_p`` rounds to in fp32 (below 1.4e-45: 0), so every valid
  request's row keeps its masks and filters (:meth:`Sampler._sample`).
- Scores are shifted by the row maximum before the division, so any
  temperature > 0 gives finite scores for finite logits.
- A row whose logits contain NaN or +inf, or no finite value at all (before
  or after its processors), gets a :class:`~worker.errors.ModelError`
  instead of a token; the engine ends that request with
  ``finish_reason="error"`` and the rest of the batch goes on.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import torch

from protocol.logprobs import TokenLogprob
from protocol.request import GREEDY, SamplingParams
from worker.errors import ModelError
from worker.models.base import SlotInput
from worker.models.processors import LogitsProcessors
from worker.models.transfer import to_device

__all__ = ["NonFiniteLogits", "Sampler", "argmax_rows", "log_softmax_", "mix_seed", "row_logsumexp", "score", "top_ids",
           "uniform"]

_MASK64 = (1 << 64) - 1
_NO_TOP_P = 2.0  # a top_p that never drops a token, even when the cumulative sum rounds past 1
_FP32_MAX = torch.finfo(torch.float32).max


def mix_seed(seed: int, position: int) -> int:
    """Map (seed, position) to a 63-bit integer, uniformly spread.

    SplitMix64's finaliser (Steele, Lea, Flood: "Fast splittable
    pseudorandom number generators", OOPSLA 2014), applied to a golden-ratio
    combination of the two inputs; deterministic across processes, unlike
    Python's ``hash`` of strings.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def uniform(seed: int, position: int) -> float:
    """A uniform float in [0, 1) from (seed, position): the top 53 bits of :func:`mix_seed`."""
    return (mix_seed(seed, position) >> 10) / float(1 << 53)


def argmax_rows(logits: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[B, V]`` logits, long ``[B]``: the same index, found faster.

    With ``V`` a multiple of ``block``: the row's maximum block (``amax`` over
    blocks, a vectorised reduction; the first block holding the maximum, as
    ``argmax`` over the block maxima returns the first), then the argmax
    within it. So ties go to the first index and a NaN wins as in
    ``argmax``. Measured at 24 x 49,152 fp32 on 2 threads: ~0.05 ms against
    ~0.49 ms (``argmax`` over a row is not vectorised on CPU).
    """
    rows, width = logits.shape
    if width % block:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, width // block, block)
    best = blocks.amax(dim=2).argmax(dim=1)
    within = blocks[torch.arange(rows, device=logits.device), best].argmax(dim=1)
    return best * block + within


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of fp32 ``x [R, V]`` over the last dim, in place (``x - logsumexp(x)``,
    :func:`row_logsumexp`; they agree with ``torch.log_softmax`` within ~1 ulp, measured 9.5e-7 on
    8 x 49,152 normal logits); returns ``x``. Every value is <= 0 (``logsumexp >= max``).
    In place: a prompt's rows (``score``) need no second ``[R, V]`` tensor."""
    return x.sub_(row_logsumexp(x))


LSE_CHUNK = 1024
"""Columns each first-stage sum of :func:`row_logsumexp` adds up."""


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: each row's ``log(sum(exp(x)))`` of ``x [R, V]``, max-shifted (as ``torch.logsumexp``:
    ``-inf`` for a row of ``-inf``, ``inf`` with an ``inf``, NaN with a NaN), its sum taken in an order
    that depends on ``V`` alone: per :data:`LSE_CHUNK` columns, then over the chunks. So a row's
    logprobs do not depend on the rows beside it nor on the thread count. ``torch.logsumexp`` splits
    its reduction by the call's rows and threads: a 49,152-wide row moved by an ulp (3.8e-6 in every
    logprob) between decoding alone and beside others in 7 of 140 trials at 2 threads, and between 1
    and 2 threads, which the runner's thread tuner changes between steps. (A reduction over the last
    dim with several outputs is split over the outputs, each summed by one thread in one order.)
    Costs 0.13 ms against 0.10 at 1 x 151,936, 0.77 against 0.62 at 8 rows (2-core Zen 4)."""
    rows, width = x.shape
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # (-inf, inf, NaN rows: as torch.logsumexp)
    e = (x - m).exp_()
    if width % LSE_CHUNK:
        e = torch.nn.functional.pad(e, (0, -width % LSE_CHUNK))  # zeros: exact in any sum
    return m + e.view(rows, -1, LSE_CHUNK).sum(-1).sum(-1, keepdim=True).log_()


_MAGNITUDE = 0x7FFFFFFF  # an fp32's bits without the sign


def top_ids(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """long ``[R, k]``: per row of fp32 ``logprobs [R, V]`` (values <= 0, as a log_softmax's) the ids
    of its ``k`` largest values, most likely first, ties by lower id (exact; ``topk`` on the values
    leaves the order of ties unspecified).

    On CPU: ``topk(k + 1)`` of the values, the ``k`` reordered by (value, id); a row whose ``k``-th
    and ``k + 1``-th values tie (a tie across the cut, where ``topk`` may have kept a higher id) is
    redone by :func:`_top_ids_exact`. Measured at 125 x 49,152 (a prompt's rows), k = 5, 2 threads:
    15 ms against 158 ms for the exact keys alone. Elsewhere (CUDA) the exact keys always, which
    need no host synchronisation.
    """
    vocab = logprobs.shape[-1]
    if k >= vocab or logprobs.device.type != "cpu":
        return _top_ids_exact(logprobs, k)
    values, ids = logprobs.topk(k + 1, dim=-1)  # descending
    cut = values[:, k - 1] == values[:, k]
    values, ids = values[:, :k], ids[:, :k]
    by_id = ids.argsort(dim=-1)  # ties inside the k: lower id first (a stable sort by value keeps it)
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    ids = ids.gather(1, values.sort(dim=-1, descending=True, stable=True).indices)
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]
        ids[rows] = _top_ids_exact(logprobs.index_select(0, rows), k)
    return ids


def _top_ids_exact(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_ids` by one ``topk`` over distinct int64 keys ``magnitude << 32 | id``: a value
    <= 0 is the larger the smaller its bits' magnitude (``-0.0`` and ``0.0`` alike), so the ``k``
    smallest keys are the answer, in order."""
    vocab = logprobs.shape[-1]
    magnitude = (logprobs.view(torch.int32) & _MAGNITUDE).long()
    ids = torch.arange(vocab, device=logprobs.device)
    return ((magnitude << 32) | ids).topk(min(k, vocab), dim=-1, largest=False).indices


def _pack(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
    """float64 pieces to fetch for ``logprobs [R, V]``: the targets' values ``[R]``, then with
    ``k > 0`` the top-``k`` values and ids ``[R * k]`` each (ids < 2**53 are exact in float64)."""
    parts = [logprobs.gather(1, targets[:, None])[:, 0].double()]
    if k:
        ids = top_ids(logprobs, k)
        parts += [logprobs.gather(1, ids).double().flatten(), ids.double().flatten()]
    return parts


def _unpack(host: list[float], tops: Sequence[int], k: int) -> list[TokenLogprob]:
    """:class:`TokenLogprob` per row from :func:`_pack`'s values (fetched), row ``r`` keeping ``tops[r]``."""
    n = len(tops)
    values, ids = host[n:n + n * k], host[n + n * k:]
    return [TokenLogprob(host[r], tuple((int(ids[r * k + j]), values[r * k + j]) for j in range(tops[r])))
            for r in range(n)]


def score(logits: torch.Tensor, targets: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """Row ``r`` of fp32 ``logits [R, V]`` (modified: made its log_softmax in place) scored at
    ``targets[r]``, with its ``tops[r]`` most likely alternatives; one host synchronisation.
    What ``prompt_logprobs`` gives for the prompt tokens (each row predicts the next one)."""
    if not len(targets):
        return []
    k = max(tops)
    lp = log_softmax_(logits)
    parts = _pack(lp, to_device(list(targets), torch.long, lp.device), k)
    return _unpack(torch.cat(parts).tolist(), tops, k)


class NonFiniteLogits(ModelError):
    """The model produced NaN or infinite logits for this request (and only this one)."""


class Sampler:
    """Picks one token per logits row according to each row's :class:`SamplingParams`.

    Stateful only for the penalties' token counts, per slot: a runner calls
    :meth:`bind` with its slot count and :meth:`release` when a slot is freed.
    """

    def __init__(self) -> None:
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.processors = LogitsProcessors()
        self.grammars = None  # the model's worker.models.grammar.Grammars (structured outputs), set by its runner

    def bind(self, num_slots: int) -> None:
        """``num_slots`` slots from now on, none holding counted tokens."""
        self.processors.bind(num_slots)

    def release(self, slot: int) -> None:
        """The slot's request is gone (its token counts are cleared, its grammar's matcher dropped)."""
        self.processors.release(slot)
        if self.grammars is not None:
            self.grammars.release(slot)

    def pick(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
             failed: torch.Tensor | None = None, inputs: Sequence[SlotInput] | None = None
             ) -> list[int | ModelError]:
        """Return one entry per row: a token id, or a :class:`NonFiniteLogits` for a failed row.

        - ``logits``: float tensor ``[B, vocab]`` on any device; never modified.
        - ``params[b]``: how to pick for row ``b``.
        - ``positions[b]``: sequence position of the token being generated.
        - ``failed``: optional bool ``[B]``, rows the model already knows went
          non-finite (e.g. an earlier token of the sequence).
        - ``inputs[b]``: row ``b``'s slot and sequence, read only for the rows
          with a penalty (ValueError if they have none) or a ``min_tokens`` mask
          (its output count); one row per slot.
        """
        return self._pick(logits, params, positions, failed, inputs, None)[0]

    def pick_scored(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                    failed: torch.Tensor | None = None, inputs: Sequence[SlotInput] | None = None,
                    logprobs: Sequence[int | None] = ()) -> tuple[list[int | ModelError], list[TokenLogprob | None]]:
        """:meth:`pick`, and per row its chosen token's :class:`TokenLogprob` where ``logprobs[r]``
        is not None (``logprobs[r]`` alternatives; from the raw ``logits``, see the module
        docstring), else None (and None for a failed row). Same one host synchronisation."""
        out, scored = self._pick(logits, params, positions, failed, inputs, logprobs)
        return out, [None] * len(out) if scored is None else scored

    def _pick(self, logits, params, positions, failed, inputs, logprobs):
        tokens = argmax_rows(logits)
        bad = ~torch.isfinite(logits.amax(dim=-1))  # amax propagates NaN
        if failed is not None:
            bad |= failed
        rows = [b for b, p in enumerate(params) if p is not GREEDY and not p.is_plain_greedy]
        mismatched = None
        if rows:
            index = to_device(rows, torch.long, logits.device)
            some = [params[b] for b in rows]
            scores = logits.index_select(0, index).float()  # a copy: the raw logits stay
            if any(p.structured is not None for p in some):  # grammars' masks first (worker.models.grammar)
                mismatched = self._constrain(scores, some, None if inputs is None else [inputs[b] for b in rows])
                bad = bad.index_copy(0, index, bad.index_select(0, index) | ~torch.isfinite(scores.amax(dim=-1)))
            if any(p.processed for p in some):
                self.processors.apply(scores, some, None if inputs is None else [inputs[b] for b in rows])
                bad = bad.index_copy(0, index, bad.index_select(0, index) | ~torch.isfinite(scores.amax(dim=-1)))
            tokens = tokens.index_copy(0, index, self._draw(scores, some, [positions[b] for b in rows]))
        out = torch.where(bad, -1, tokens)
        scored = None
        if logprobs:
            asking = [b for b, n in enumerate(logprobs) if n is not None]
            if asking:
                index = to_device(asking, torch.long, logits.device)
                tops = [logprobs[b] for b in asking]
                k = max(tops)
                lp = log_softmax_(logits.index_select(0, index).float())  # a copy of the raw rows
                host = torch.cat([out.double()] + _pack(lp, tokens.index_select(0, index), k)).tolist()
                out = [int(t) for t in host[:len(params)]]  # the one host sync
                scored = [None] * len(params)
                for b, entry in zip(asking, _unpack(host[len(params):], tops, k)):
                    if out[b] != -1:
                        scored[b] = entry
        if scored is None:
            out = out.tolist()  # the one host sync
        if -1 in out:
            for b, t in enumerate(out):
                if t == -1:
                    out[b] = NonFiniteLogits(
                        "the model produced non-finite values (NaN or inf) for this request; "
                        "the other requests in the batch are not affected")
        if mismatched:
            for r, exc in mismatched.items():
                out[rows[r]] = exc
        return out, scored

    def _constrain(self, scores: torch.Tensor, params: list[SamplingParams], inputs) -> dict[int, ModelError]:
        """The constrained rows' grammar masks on ``scores`` (in place); ``{row: error}`` for the rows
        that cannot be masked (their scores become -inf, so they count as failed)."""
        if self.grammars is None:
            failed = {r: ModelError("this model cannot constrain its output (no grammar support)")
                      for r, p in enumerate(params) if p.structured is not None}
        else:
            failed = self.grammars.mask(scores, params, inputs)
        for r in failed:
            scores[r] = float("-inf")
        return failed

    def _draw(self, scores: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """The token of each processed row: the argmax for greedy rows, else :meth:`_sample`."""
        greedy = [r for r, p in enumerate(params) if p.greedy]
        if not greedy:
            return self._sample(scores, params, positions)
        if len(greedy) == len(params):
            return argmax_rows(scores)
        device = scores.device
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        at = to_device(sampled, torch.long, device)
        drawn = self._sample(scores.index_select(0, at), [params[r] for r in sampled],
                             [positions[r] for r in sampled])
        g = to_device(greedy, torch.long, device)
        out = torch.empty(len(params), dtype=torch.long, device=device)
        return out.index_copy_(0, g, argmax_rows(scores.index_select(0, g))).index_copy_(0, at, drawn)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """The drawn token of each row (long ``[R]``) of fp32 ``logits [R, V]``.

        Every finite temperature >= :data:`~protocol.request.GREEDY_BELOW` and top_p in (0, 1] is a
        valid request, but fp32 holds neither a temperature past 3.4e38 (inf: a masked token's
        ``-inf / inf`` is NaN, and the NaN row drew its last id whatever its mask) nor a top_p below
        1.4e-45 (0: every token dropped, the most likely one too). So the temperature is taken within
        fp32's finite range (past it the distribution is uniform over the allowed tokens, as the
        limit is), and top-p keeps the most likely token whatever ``p`` rounds to."""
        device, vocab = logits.device, logits.shape[-1]
        temperature = to_device([p.temperature for p in params], torch.float32, device)[:, None].clamp_(max=_FP32_MAX)
        scores = logits.float()
        scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature  # <= 0: never overflows
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else _NO_TOP_P for p in params]
        if any(top_k) or any(p != _NO_TOP_P for p in top_p):
            ordered, order = torch.sort(scores, dim=-1, descending=True)
            k = to_device([k or vocab for k in top_k], torch.long, device)[:, None]
            kth = ordered.gather(1, k - 1)
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            probs = torch.softmax(ordered, dim=-1)
            # drop a token when the mass before it already reaches top_p
            drop = (probs.cumsum(dim=-1) - probs) >= to_device(top_p, torch.float32, device)[:, None]
            drop[:, 0] = False  # the most likely token stays (a top_p that rounds to 0 in fp32 dropped it)
            drop |= ordered == float("-inf")
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        min_p = [p.min_p for p in params]
        if any(min_p):  # vLLM's _apply_min_p: drop probs < min_p * max prob
            probs = torch.softmax(scores, dim=-1)
            floor = to_device(min_p, torch.float32, device)[:, None] * probs.amax(dim=-1, keepdim=True)
            scores = scores.masked_fill(probs < floor, float("-inf"))
        cdf = torch.softmax(scores, dim=-1).double().cumsum(dim=-1)
        u = [self._rng.random() if p.seed is None else uniform(p.seed, pos)
             for p, pos in zip(params, positions)]
        target = to_device(u, torch.float64, device)[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)[:, 0]
