"""How many CPU threads each model step uses, chosen by timing the steps (issue 32, item 4).

On a machine that other processes share, a step run on every core collapses: torch's OpenMP
regions split each operation evenly among their threads and wait at the end of each for the
last one, so one thread that the OS preempts for a time slice stalls all the others, thousands of
times per step. Measured on a 2-core Xeon (SmolLM2-135M, GGUF weights, 8 slots, 160 cached
tokens), with two busy processes beside it: a decode step took 359 ms at 2 threads and 128 ms at
1 (41 ms at 2 threads on the quiet machine). Which count is fastest depends on the load of the
moment, which no setting made at start can know.

:class:`ThreadTuner` is the pure core: the model runner asks it before each step how many threads
to use (:meth:`~ThreadTuner.next_threads`) and tells it afterwards what the step was and how long
it took (:meth:`~ThreadTuner.record`). It runs the current count, and now and then *probes*: a few
rounds in which each count next to the current one in :attr:`~ThreadTuner.candidates` runs one
step beside a step at the current count. A round counts when its steps had the same shape (the
``key``: e.g. decode rows and prompt tokens), so a probe compares like with like; each neighbour's
cost is its steps' time over the current count's steps' time, summed over the rounds (a mean, so
the long tails of a collapsing count weigh as they cost). A neighbour at least ``margin`` cheaper
becomes the current count; one step of a neighbour :data:`COLLAPSE` times the current's ends the
probe at once. Probes start ``first_interval`` steps after the
last one; the interval doubles, up to ``max_interval``, while probes keep the count, and starts
over after a change, so a quiet machine pays a probe's extra cost rarely (5 steps at another
count in every ~260 at the cap) and a change of load is answered within about ``max_interval`` steps.

Two rules keep a quiet machine's probes cheap (measured: Qwen2.5-Coder-0.5B's GGUF, HE32 in
process, 8 slots, 2 threads on a 2-core EPYC: the tuner of before this rule took 5 % longer than a
fixed 2 threads, 38 of its 316 steps at 1 thread, 4 of them prefills that could never be compared):

- When the runner says what the coming step is (``next_threads(key)``), a probe runs its counts only
  on steps of one shape: a round begins on a step of the last step's shape (a steady state, not a
  prompt's prefill) and takes only steps of its first step's shape; the others run at the current
  count and are not the probe's.
- While ``busy`` says the other processes are quiet, a round in which every neighbour took at least
  :data:`QUIET_SLOWER` times the current count's step ends the probe, keeping the count. The long
  tails that a mean over rounds is there to weigh come from other processes' preemption; on a
  quiet machine one such round already rules the neighbour out (the margin asks for 15 % faster).

This is a feedback controller in the spirit of the hill-climbing thread controller of .NET's
thread pool (Hellerstein et al., "Optimizing Concurrency Levels in the .NET ThreadPool", FeBID
2008): measure throughput at neighbouring concurrency levels, move towards the better one.

Only where the count does not change the results may a runner use this: there every output
element is computed by one thread whatever the count (slotserve's GGUF products and decode
attention split their work by output rows and heads, tested bitwise-equal at 1 and 2 threads).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable


COLLAPSE = 3.0
"""A probe ends at once when, in a comparable round, a neighbour's step takes this many times the
current count's (the count is kept) or the current count's takes this many times a neighbour's
(the neighbour is taken): a count that collapses under the load of the moment costs as much as
many steps, and more rounds of it would cost more than a decision could gain (measured: HE32
beside two busy processes, in process, ran at 56-66 tokens/s with probes that waited for all their
rounds, 27 steps at 2 threads taking 11.8 of its 31 s; 85 tokens/s at a fixed thread)."""

QUIET_SLOWER = 1.5
"""On a quiet machine (``busy`` says no at a probe's start), a round in which each neighbour's step
took this many times the current count's ends the probe and keeps the count (module docstring).
One thread against two on a quiet 2-core machine measures 1.7-2x per step."""


def others_busy(threads: int) -> bool:
    """Whether other processes keep at least a core busy: the 1-minute load average
    (``os.getloadavg``) less the ``threads`` this process's steps run on is 1 or more, or, now, at
    least one other task is runnable (:func:`runnable_others`; the load average takes a minute to
    follow a process that starts spinning). False where neither can be read. A probe of more
    threads then waits: beside busy processes a step on more threads collapses now and then
    (0.5-1.2 s against 50-100 ms), and those tails are what the probes cost (measured:
    ``bench/threads.py``, the default's busy rounds at 60-102 tokens/s against 122 at 1 thread; with
    the load average alone, the first busy round after a quiet one stayed at 101 tokens/s against
    fixed-1's 174: its first ~30 s read as quiet). The runnable count is read three times and the
    least taken: a process that spins is runnable in every reading, a task that wakes for a moment
    (or one of this process's threads going to sleep between the two files' reads) seldom in all
    three (right after a 2-thread matmul, 13 of 300 single readings saw one, 5 of 300 triples);
    such a reading would hold a probe of more threads back one interval and give a quiet machine's
    probe all its rounds."""
    try:
        if os.getloadavg()[0] - threads >= 1.0:
            return True
    except OSError:
        pass
    return min(runnable_others() for _ in range(3)) >= 1  # a spinning process is in every reading


def runnable_others() -> int:
    """Tasks runnable now (running or waiting for a CPU) that are not this process's threads: the
    system's count (``/proc/loadavg``'s fourth field, ``runnable/total``) less this process's
    threads in state ``R`` (``/proc/self/task/*/stat``). 0 where ``/proc`` cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    own += f.read().rpartition(")")[2].split()[0] == "R"
            except OSError:  # a thread that ended meanwhile
                continue
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, runnable - own)


def thread_counts(max_threads: int) -> tuple[int, ...]:
    """The counts a tuner of up to ``max_threads`` chooses among: ``max_threads`` halved down to
    1, ascending (8 -> ``(1, 2, 4, 8)``, 6 -> ``(1, 3, 6)``). ValueError below 1."""
    if type(max_threads) is not int or max_threads < 1:
        raise ValueError(f"max_threads must be an int >= 1, got {max_threads!r}")
    counts = []
    n = max_threads
    while n >= 1:
        counts.append(n)
        n //= 2
    return tuple(sorted(set(counts)))


class ThreadTuner:
    """Chooses each step's thread count among :attr:`candidates` by timing steps (module docstring).

    - ``max_threads``: the most threads a step may use (the starting count).
    - ``first_interval`` / ``max_interval``: steps at the current count between probes, first and
      at most (the interval doubles each time a probe keeps the count).
    - ``rounds``: rounds of comparable steps a probe needs to decide; a probe gives up (keeping the
      count) after ``4 * rounds`` rounds without enough comparable ones.
    - ``margin``: how much cheaper (a fraction of the current count's step time) a neighbour must
      be to be chosen, so noise does not flip the count back and forth.
    - ``busy``: called with the current count at a probe's start; while it says True only fewer
      threads are probed, while it says False a neighbour :data:`QUIET_SLOWER` times slower ends
      the probe (:func:`others_busy` for a worker; None: neither, as in the tests' cost models).

    ValueError for counts or intervals below 1 or a margin outside ``[0, 1)``.
    """

    def __init__(self, max_threads: int, *, first_interval: int = 2, max_interval: int = 256, rounds: int = 5,
                 margin: float = 0.15, busy: Callable[[int], bool] | None = None) -> None:
        self.candidates = thread_counts(max_threads)
        if min(first_interval, max_interval, rounds) < 1 or first_interval > max_interval:
            raise ValueError(f"need 1 <= first_interval <= max_interval and rounds >= 1, got {first_interval}, "
                             f"{max_interval}, {rounds}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        self.current = max_threads
        self.first_interval, self.max_interval, self.rounds, self.margin = first_interval, max_interval, rounds, margin
        self.busy = busy
        self.interval = first_interval
        self.changes = 0  # how many times the count changed (for logs and tests)
        self._until_probe = first_interval
        self._plan: list[int] = []  # the counts of the probe round under way, in order; [] outside a probe
        self._round: list[tuple[int, Hashable, float]] = []  # (count, key, seconds) of its steps so far
        self._pairs: dict[int, list[tuple[float, float]]] = {}  # neighbour -> (its step's s, the current's), per round
        self._rounds_tried = 0
        self._pending: int | None = None  # the count given for the step being run
        self._up_held = False  # this probe leaves out more threads (busy said so at its start)
        self._quiet = False  # busy said no at this probe's start
        self._last_key: Hashable | None = None  # the shape next_threads was told for the last step
        self._round_key: Hashable | None = None  # the shape of the probe round under way's first step
        self._outside = False  # the step being run is not the probe's (another shape): record skips it

    def _neighbours(self) -> list[int]:
        i = self.candidates.index(self.current)
        out = [c for c in self.candidates[max(0, i - 1):i + 2] if c != self.current]
        if self.busy is not None and self._rounds_tried == 0:  # decided at a probe's first round, kept
            busy = self.busy(self.current)
            self._up_held = busy and any(c > self.current for c in out)
            self._quiet = not busy
        return [c for c in out if c < self.current] if self._up_held else out

    def next_threads(self, key: Hashable | None = None) -> int:
        """The thread count for the next step (then :meth:`record` it). ``key``: the step's shape where
        the caller knows it beforehand (what it will give :meth:`record`); None: any step may be a
        probe's."""
        wanted = self._last_key if self._round_key is None else self._round_key  # round under way, else last step
        self._last_key = key
        if key is not None and key != wanted and (self._plan or self._until_probe <= 0) and len(self.candidates) > 1:
            self._outside = True  # a probe waits for a step of that shape
            return self._give(self.current)
        if not self._plan and self._until_probe <= 0 and len(self.candidates) > 1:
            neighbours = self._neighbours()
            if not neighbours:  # only more threads to try, and other processes busy: wait a whole interval,
                self._up_held = False  # and the next one twice that, as a probe that keeps the count
                self._until_probe = self.interval
                self.interval = min(2 * self.interval, self.max_interval)
                return self._give(self.current)
            self._rounds_tried += 1
            self._plan = [self.current, *neighbours]
            if self._rounds_tried % 2 == 0:  # alternate which goes first (a step can warm caches for the next)
                self._plan.reverse()
        if self._plan and not self._round:
            self._round_key = key
        return self._give(self._plan[len(self._round)] if self._plan else self.current)

    def _give(self, count: int) -> int:
        self._pending = count
        return count

    def record(self, key: Hashable, seconds: float) -> None:
        """The step just run had shape ``key`` (steps of equal keys do equal work) and took ``seconds``."""
        count, self._pending = self._pending, None
        if count is None:
            raise RuntimeError("record() without next_threads() first")
        if self._outside:
            self._outside = False
            return
        if not self._plan:
            self._until_probe -= 1
            return
        self._round.append((count, key, seconds))
        if len(self._round) < len(self._plan):
            return
        steps, self._round, self._round_key = self._round, [], None
        clear = None  # a neighbour that collapses (keep the count) or the current count does (take it)
        if len({k for _, k, _ in steps}) == 1:  # comparable: one shape
            times = {c: s for c, _, s in steps}
            base = times[self.current]
            for c, s in times.items():
                if c != self.current:
                    self._pairs.setdefault(c, []).append((s, base))
                    if s >= COLLAPSE * base:
                        clear = self.current
                    elif s * COLLAPSE <= base:
                        clear = c
            if clear is None and self._quiet and all(s >= QUIET_SLOWER * base for c, s in times.items()
                                                     if c != self.current):
                clear = self.current
        done = min((len(r) for r in self._pairs.values()), default=0) >= self.rounds
        if clear is not None:
            self._decide(False, clear)
        elif done or self._rounds_tried >= 4 * self.rounds:
            self._decide(done)
        else:
            self._plan = []  # the next round starts at the next step
            self._until_probe = 0

    def _decide(self, enough: bool, best: int | None = None) -> None:
        best, cost = self.current if best is None else best, 1.0 - self.margin
        if enough:
            for c, pairs in self._pairs.items():
                r = sum(s for s, _ in pairs) / max(sum(b for _, b in pairs), 1e-9)
                if r < cost:
                    best, cost = c, r
        if best != self.current:
            self.current, self.interval = best, self.first_interval
            self.changes += 1
        else:
            self.interval = min(2 * self.interval, self.max_interval)
        self._plan, self._pairs, self._rounds_tried, self._up_held, self._quiet = [], {}, 0, False, False
        self._until_probe = self.interval
