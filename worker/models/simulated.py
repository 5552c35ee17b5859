"""SimulatedLLM: a deterministic stand-in for a language model, with an optional cost model.

Next token: a hash of (seed, sequence length, last four tokens). It is a pure
function of the sequence's content, so a request gets the same tokens
whichever slot it runs in and whoever shares its batch (batch invariance
holds exactly), and it costs O(1) per sequence however long the sequence
is. With probability ``stop_rate`` the token is 0 (the spec's stop token);
otherwise it is spread over ``[1, vocab_size)``.

Cost model (optional): one call costs ``iteration_cost_s +
sequence_cost_s * len(sequences)`` seconds, like a memory-bound decode step
whose weights are read once per iteration plus a small per-sequence part.
With ``sleep=True`` the call really sleeps that long; with ``sleep=False``
it adds it to :attr:`SimulatedLLM.clock_s` instead (a virtual clock), so a
benchmark can simulate hours of model time in seconds and add the engine's
measured wall time on top.
"""

from __future__ import annotations

import time

_MASK32 = (1 << 32) - 1


class SimulatedLLM:
    """A deterministic stateless model: ``next_tokens(sequences) -> tokens``.

    - ``vocab_size``: token ids are in ``[0, vocab_size)`` (default 1000; the
      spec's examples use ids below 100).
    - ``stop_rate``: probability in [0, 1] that a next token is 0.
    - ``seed``: selects a different (still deterministic) model.
    - ``max_seq_len``: optional context length the engine enforces; None = unbounded.
    - ``iteration_cost_s``, ``sequence_cost_s``: the cost model, seconds.
    - ``sleep``: True sleeps for the cost; False advances :attr:`clock_s`.

    Attributes read by the engine: ``vocab_size``, ``max_seq_len``,
    ``eos_token_ids`` (``(0,)``). Counters: ``calls`` (model calls made),
    ``sequences`` (sequences processed, i.e. tokens generated), ``clock_s``
    (simulated seconds, ``sleep=False`` only). Raises ValueError for bad arguments.
    """

    eos_token_ids = (0,)

    def __init__(self, vocab_size: int = 1000, *, stop_rate: float = 0.1, seed: int = 0,
                 max_seq_len: int | None = None, iteration_cost_s: float = 0.0,
                 sequence_cost_s: float = 0.0, sleep: bool = True) -> None:
        if type(vocab_size) is not int or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not 0.0 <= stop_rate <= 1.0:
            raise ValueError(f"stop_rate must be in [0, 1], got {stop_rate!r}")
        if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be None or an int >= 2, got {max_seq_len!r}")
        if iteration_cost_s < 0 or sequence_cost_s < 0:
            raise ValueError("iteration_cost_s and sequence_cost_s must be >= 0 seconds")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.stop_rate = stop_rate
        self.seed = int(seed)
        self.iteration_cost_s = float(iteration_cost_s)
        self.sequence_cost_s = float(sequence_cost_s)
        self.sleep = bool(sleep)
        self._stop_below = int(stop_rate * (1 << 32))  # compare 32 hash bits, no floats
        self.calls = 0
        self.sequences = 0
        self.clock_s = 0.0

    def next_token(self, sequence: list[int]) -> int:
        """The next token of one sequence (what :meth:`next_tokens` returns for it)."""
        h = hash((self.seed, len(sequence), *sequence[-4:]))
        if (h & _MASK32) < self._stop_below:
            return 0
        return 1 + (h >> 32) % (self.vocab_size - 1)

    def next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """One next token per sequence, same order; applies the cost model."""
        self.calls += 1
        self.sequences += len(sequences)
        cost = self.iteration_cost_s + self.sequence_cost_s * len(sequences)
        if cost:
            if self.sleep:
                time.sleep(cost)
            else:
                self.clock_s += cost
        return list(map(self.next_token, sequences))
