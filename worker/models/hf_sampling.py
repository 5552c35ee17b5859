"""Next-token selection from logits: greedy, temperature, top-k, top-p, seeds.

Batch invariance and migration: a seeded request draws the token at sequence
position ``p`` (0-based index of the token being generated in prompt +
output) from a ``torch.Generator`` seeded with ``mix_seed(seed, p)``. The
draw depends only on the request's own logits row, its seed and ``p`` --
never on the batch, the slot, the worker or how many tokens were drawn
before -- so a request resumed elsewhere with ``resume_tokens`` continues the
same stream. Unseeded requests use one per-model generator seeded from the
OS.

Filters follow the usual definitions (as in transformers' ``TopKLogitsWarper``
and ``TopPLogitsWarper`` and vLLM): temperature divides the logits; top-k
keeps the ``k`` largest; top-p keeps the smallest set of most likely tokens
whose probability mass reaches ``p`` (the most likely token is always kept).
"""

from __future__ import annotations

import os

import torch

from worker.models.base import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """Map (seed, position) to a 63-bit generator seed.

    SplitMix64's finaliser (Steele, Lea, Flood: "Fast splittable
    pseudorandom number generators", OOPSLA 2014), applied to a golden-ratio
    combination of the two inputs; deterministic across processes, unlike
    Python's ``hash`` of strings.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Picks one token per logits row according to each row's SamplingParams."""

    def __init__(self) -> None:
        self._generator = torch.Generator()
        self._generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def pick(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """Return one token id per row.

        - ``logits``: float tensor ``[B, vocab]``.
        - ``params[b]``: how to pick for row ``b``.
        - ``positions[b]``: sequence position of the token being generated.
        """
        tokens = logits.argmax(dim=-1).tolist()
        for b, p in enumerate(params):
            if not p.greedy:
                tokens[b] = self._sample(logits[b], p, positions[b])
        return tokens

    def _sample(self, row: torch.Tensor, p: SamplingParams, position: int) -> int:
        scores = row.float() / p.temperature
        if 0 < p.top_k < scores.shape[0]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            # drop a token when the mass before it already reaches top_p
            drop = (cum - torch.softmax(sorted_scores, dim=-1)) >= p.top_p
            scores = scores.index_fill(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.seed is None:
            generator = self._generator
        else:
            generator = torch.Generator()
            generator.manual_seed(mix_seed(p.seed, position))
        return int(torch.multinomial(probs, 1, generator=generator))
