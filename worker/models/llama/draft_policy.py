"""Which draft tokens pay for themselves this step: speculative decoding that does not slow a busy batch.

A draft token costs a row of every linear whether or not it is accepted,
and gives a token only when it is. Alone, a CPU decode step streams the
weights for a few rows almost as fast as for one, so drafts are nearly free;
with 8 rows the products are compute-bound and each row costs its share.
Measured on a 2-core AMD EPYC (Zen 3, AVX2; SmolLM2-135M Q8_0/Q4_1, HE32 at 8
slots, up to 3 prompt-lookup drafts a row): a decode step of 8 rows took 19 ms,
each draft token added ~1.3 ms, and a draft after a 3-token match was
accepted 74 % of the time, after a 2-token match 46 %: the 3-token matches paid
for themselves, the 2-token ones cost more than they gave, and drafting all
of them broke even against decoding without drafts.

So, as vLLM turns its n-gram drafts off past a batch size
(``disable_by_batch_size``) and llama.cpp keeps a draft token only above a
probability (``--draft-p-min``), the runner keeps a draft token only while it
is expected to raise the step's tokens per second, from two running
estimates:

- the **step's cost** as ``a + b * rows`` seconds (rows: the decode rows and
  their draft tokens), fitted by weighted least squares over the mean time of
  decode-only steps at each row count seen (each mean an exponential moving
  average, so the fit follows a cache that grows; the worker's warm-up decodes
  at several batch sizes, so a fit exists before the first request). A row
  count not seen in the last :data:`STALE_STEPS` decode-only steps is forgotten:
  its mean is of a cache, a load or a first call that are past. Until two
  row counts are seen, ``a = PRIOR_FIXED_ROWS * b``;
- the **acceptance** of a draft token by the length ``n`` of the match that
  proposed it and its depth ``t`` (1: the first draft token): ``P(n, t)``, the
  share of depth-``t`` tokens after an ``n``-token match whose row accepted all
  of its first ``t`` drafts, counted from this runner's verified drafts with
  :data:`PRIOR_FIRST` and :data:`PRIOR_DEPTH` as a prior worth :data:`PRIOR_WEIGHT` drafts.

A step of ``R`` decode rows with ``D`` draft tokens chosen so far, expected to
give ``R + A`` tokens, gives ``(R + A) / (a + b (R + D))`` tokens a second;
one more draft token, accepted with probability ``p``, raises that exactly when
``p (a + b (R + D)) > b (R + A)``. :meth:`DraftCosts.choose` takes the
candidates in falling ``p`` (a row's depths in order, since ``P(n, t)`` falls
with ``t``) while that holds. Which tokens the step returns does not depend on
it: every kept draft is verified (:mod:`worker.models.llama.runner`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PRIOR_FIRST = {1: 0.2, 2: 0.55, 3: 0.8}
"""Prior share of first draft tokens accepted, by the length of the match that proposed them
(HE32 on SmolLM2 at 8 slots, 2-core AMD EPYC: after a 3-token match 0.82, 0.76 and 0.66 of the
depth-1, 2 and 3 tokens were accepted with all before them; after a 2-token match 0.55, 0.45,
0.38; see :data:`worker.models.llama.lookup.MIN_NGRAM`). Longer matches take the 3-token prior; a match of unknown length (``n = 0``: drafts from
another proposer) the 2-token one."""

PRIOR_DEPTH = 0.85
"""A depth-``t`` token's prior is its first token's times this to the power ``t - 1``."""

PRIOR_WEIGHT = 8.0
"""Drafts' worth of evidence the prior counts as, per match length and depth."""

PRIOR_FIXED_ROWS = 4.0
"""Until the step cost is fitted: the fixed part ``a`` of a step as this many rows' cost ``b``
(SmolLM2 measured ~6.6, Qwen2.5-Coder-1.5B at gguf ~3.8 on the same 2-core CPU: drafts then pay
at a step of 8 rows when accepted more than ~67 % of the time)."""

DECAY = 0.05
"""Weight of a new decode-only step's time in its row count's moving average."""

STALE_STEPS = 200
"""A row count's mean leaves the fit once this many decode-only steps passed without one of its own
(seen again, it starts afresh). Kept for ever, a mean whose row count no longer comes up held the fit
where it was: a worker's warm-up on a loaded 2-core AMD EPYC (SmolLM2, 8 slots, K = 3) took 3.2 and
3.6 s for its first two decode steps at one row and 0.1 s for the third, which left a slope of 0
(every draft free), and 2,000 steps of ``0.09 + 0.01 * rows`` s at 8-32 rows later (as measured
there) the fit was ``(0.19, 0.0054)``: all 24 drafts of 8 rows after 2-token matches kept, where
the steps' own cost keeps 8."""


class DraftCosts:
    """The running estimates above and the choice they make (one per runner).

    ``record_step(rows, seconds)`` after each decode-only step (no prompt tokens): ``rows`` its
    query rows (decode rows plus their draft tokens); ``record_drafts(n, drafted, accepted)``
    after each drafted row's verification; ``choose(candidates, decode_rows)`` before a step.
    ``cost`` (read-only property): the fitted ``(a, b)`` in seconds, or None before two row
    counts were seen.
    """

    __slots__ = ("_times", "_tried", "_kept", "_cost", "_steps")

    def __init__(self) -> None:
        self._times: dict[int, list[float]] = {}  # rows -> [moving mean seconds, steps seen, last step]
        self._steps = 0  # decode-only steps recorded
        self._tried: dict[tuple[int, int], float] = {}  # (n, depth) -> draft tokens of that depth made
        self._kept: dict[tuple[int, int], float] = {}  # (n, depth) -> of them, accepted with all before
        self._cost: tuple[float, float] | None = None

    # -- the step's cost

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` query rows took ``seconds``. Raises ValueError for
        ``rows < 1`` or a time that is not a finite non-negative number."""
        if rows < 1 or not 0.0 <= seconds < float("inf"):
            raise ValueError(f"a step needs rows >= 1 and a finite time >= 0, got {rows} rows, {seconds} s")
        self._steps += 1
        seen = self._times.get(rows)
        if seen is None:
            self._times[rows] = [seconds, 1, self._steps]
        else:
            seen[0] += DECAY * (seconds - seen[0]) if seen[1] >= 1 / DECAY else (seconds - seen[0]) / (seen[1] + 1)
            seen[1] += 1
            seen[2] = self._steps
        stale = [r for r, (_, _, last) in self._times.items() if self._steps - last >= STALE_STEPS]
        for r in stale:
            del self._times[r]
        self._cost = self._fit()

    def set_cost(self, fixed: float, per_row: float) -> None:
        """Take ``(a, b)`` as given (seconds; tests, or a cost measured elsewhere) until the next
        :meth:`record_step`. Raises ValueError for a negative or non-finite value."""
        if not (0.0 <= fixed < float("inf") and 0.0 <= per_row < float("inf")):
            raise ValueError(f"a step's cost needs finite a, b >= 0, got a={fixed}, b={per_row}")
        self._cost = (fixed, per_row)

    @property
    def cost(self) -> tuple[float, float] | None:
        return self._cost

    def _fit(self) -> tuple[float, float] | None:
        """Weighted least squares of the mean step time against rows (weight: steps seen, at most
        1 / DECAY), clamped to a >= 0; None before two row counts. A slope that does not come out
        positive (noise, or first calls' times: more rows measured no dearer than fewer) says nothing
        of a row's cost, so the prior stands (None) rather than every draft looking free."""
        if len(self._times) < 2:
            return self._cost
        sw = sx = sy = sxx = sxy = 0.0
        for rows, (mean, count, _) in self._times.items():
            w = min(count, 1 / DECAY)
            sw += w
            sx += w * rows
            sy += w * mean
            sxx += w * rows * rows
            sxy += w * rows * mean
        var = sxx * sw - sx * sx
        if var <= 0:
            return self._cost
        b = (sxy * sw - sx * sy) / var
        if b <= 0:
            return None
        return (max((sy - b * sx) / sw, 0.0), b)

    # -- acceptance

    def record_drafts(self, n: int, drafted: int, accepted: int) -> None:
        """A row drafted ``drafted`` tokens after an ``n``-token match and its first ``accepted`` of
        them were kept (0 <= accepted <= drafted). Raises ValueError otherwise."""
        if n < 0 or not 0 <= accepted <= drafted:
            raise ValueError(f"need n >= 0 and 0 <= accepted <= drafted, got n={n}, {accepted} of {drafted}")
        for t in range(1, drafted + 1):
            key = (n, t)
            self._tried[key] = self._tried.get(key, 0.0) + 1
            if t <= accepted:
                self._kept[key] = self._kept.get(key, 0.0) + 1

    def accept_rate(self, n: int, depth: int) -> float:
        """``P(n, depth)``: the estimated share of depth-``depth`` draft tokens after an ``n``-token
        match that are accepted (with every draft before them)."""
        prior = PRIOR_FIRST.get(min(n, max(PRIOR_FIRST)), PRIOR_FIRST[2]) * PRIOR_DEPTH ** (depth - 1)
        key = (n, depth)
        return ((self._kept.get(key, 0.0) + PRIOR_WEIGHT * prior)
                / (self._tried.get(key, 0.0) + PRIOR_WEIGHT))

    def _reach(self, n: int, depth: int) -> list[float]:
        """:meth:`accept_rate` at depths ``1 .. depth``, each at most the one before it: a token is
        accepted only with every draft before it, so the share cannot rise with depth, and each
        depth's own counts can say it does (few drafts that deep; the prior's weight). Falling, the
        offers of a row come in its depths' order, so the choice always takes a prefix."""
        out, low = [], 1.0
        for t in range(1, depth + 1):
            low = min(low, self.accept_rate(n, t))
            out.append(low)
        return out

    # -- the choice

    def choose(self, candidates: Mapping[int, tuple[int, Sequence[int]]], decode_rows: int) -> dict[int, int]:
        """How many of each candidate's draft tokens to keep: ``candidates`` maps a batch index to
        ``(n, tokens)`` (the match length and the proposed drafts), ``decode_rows`` is the step's
        decode rows (drafted or not). Returns batch index -> tokens kept (at least 1; a candidate
        that keeps none is left out)."""
        if not candidates:
            return {}
        a, b = self._cost if self._cost is not None else (PRIOR_FIXED_ROWS, 1.0)
        offers = sorted((-p, t, i) for i, (n, tokens) in candidates.items()
                        for t, p in enumerate(self._reach(n, len(tokens)), 1))
        kept: dict[int, int] = {}
        gain, drafts = 0.0, 0  # A and D
        for neg_p, t, i in offers:
            p = -neg_p
            if p * (a + b * (decode_rows + drafts)) <= b * (decode_rows + gain):
                break
            kept[i] = t
            gain += p
            drafts += 1
        return kept
