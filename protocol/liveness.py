"""Silence judged on the judge's own clock: a judge that was stalled itself gives its peers a fresh window.

Every liveness judge in slotserve (the broker of its workers and clients, a worker's link of its
broker, the client's I/O thread of its broker, the launcher of its worker processes) declares a peer
dead after a window of silence measured on its own monotonic clock. When the judge's own process
stops -- the whole cluster SIGSTOPped (Ctrl-Z then ``fg`` of ``slotserve up``), a VM paused, a host
that starves it (a laptop's suspend is not seen: CLOCK_MONOTONIC stops with it) -- it wakes to find
every peer silent past its window, and cannot
tell their silence from its own: it heard nothing because it listened to nothing (a break-it pass
froze a cluster for 20-170 s: the launcher killed a worker as frozen, the broker ended two requests
``client_silent``, and could take workers for lost and move their requests).

So each judge times its own loop with a :class:`StallWatch`: a turn that comes more than
:meth:`StallWatch.threshold_s` after the previous one ends a stall of the judge, and the judge
restarts its peers' silence timers at that turn (a fresh window) instead of judging them. A peer
that stays silent after that is declared dead one window later, as before. The threshold is
:data:`STALL_FRACTION` of the shortest window the judge applies: a stall shorter than that cannot
make a live peer look dead, since a peer heartbeats at least 3 times a window
(``MIN_HEARTBEATS_PER_WINDOW``), so its last word before the stall was at most a third of a window
earlier. It is never less than twice the longest wait the loop makes on purpose between turns (its
poll timeout), so a loop that turns as meant is never taken for stalled.

A stall excuses a peer's silence once (:meth:`StallWatch.excuses`): a timer that started before the
previous stall ended -- its peer said nothing since that stall gave it a fresh window -- is not
restarted again. A frozen judge stalls once, and its live peers speak within a heartbeat interval of
waking, so they are excused at its next freeze too; but a judge that is slow, not frozen (every turn,
or every other, later than the threshold: a starved or overloaded process), would otherwise restart
a dead peer's timer at every slow turn and never declare it dead. So a peer that stays silent is
declared dead at most two windows after its last word (one excused, then one judged), however
often its judge stalls, as long as the judge turns at all.

Other timers, decided one by one by what the user expects after a freeze: those of the models on
demand that kill a worker told to stop and unload an idle model (or a busy one for another's turn)
do not count a stall of their supervisor either (:class:`slotserve.demand_supervisor.DemandSupervisor`,
on a StallWatch of its own). A request's deadline (``timeout_s``: the broker's queue, the worker's
engine, the client) does count it: it is the client's wall-clock limit, past which the answer is no
use to it, frozen or not.
"""

from __future__ import annotations

import math

__all__ = ["STALL_FRACTION", "StallWatch"]

STALL_FRACTION = 0.5
"""A judge's turn that comes more than this fraction of its silence window after the previous one
ends a stall of the judge (see the module's docstring for why a half)."""


class StallWatch:
    """A liveness judge's watch on its own loop (one per judge; not thread-safe: the judge's thread only).

    - ``window_s``: the shortest silence window the judge applies (seconds, > 0); may be changed
      later (a peer announcing its heartbeat interval changes the window).
    - ``now``: the judge's monotonic clock at its start (seconds), the first turn.
    - ``period_s``: the longest the judge's loop waits on purpose between two turns (seconds, >= 0:
      its poll timeout); 0 when it is small against the window.

    Raises ValueError for a window that is not a positive finite number of seconds or a negative
    or non-finite period.
    """

    __slots__ = ("window_s", "period_s", "_last_s", "_ended_s", "_previous_s")

    def __init__(self, window_s: float, now: float, period_s: float = 0.0) -> None:
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number of seconds > 0, got {window_s!r}")
        if not (isinstance(period_s, (int, float)) and math.isfinite(period_s) and period_s >= 0):
            raise ValueError(f"period_s must be a finite number of seconds >= 0, got {period_s!r}")
        self.window_s = window_s
        self.period_s = period_s
        self._last_s = now
        self._ended_s = self._previous_s = -math.inf  # when the latest stall ended, and the one before

    @property
    def threshold_s(self) -> float:
        """The longest gap between two turns that is no stall (seconds):
        ``max(STALL_FRACTION * window_s, 2 * period_s)``."""
        return max(STALL_FRACTION * self.window_s, 2.0 * self.period_s)

    def stalled(self, now: float) -> float | None:
        """Record a turn of the judge's loop at ``now`` (its monotonic clock, seconds). Returns the
        gap since the previous turn (seconds) when it exceeds :attr:`threshold_s` -- the judge was
        stalled, and restarts at ``now`` each silence timer the stall :meth:`excuses` before it judges
        its peers -- else None."""
        gap = now - self._last_s
        self._last_s = max(self._last_s, now)
        if gap <= self.threshold_s:
            return None
        self._previous_s, self._ended_s = self._ended_s, now
        return gap

    @property
    def previous_s(self) -> float:
        """When the stall before the latest one ended (the judge's clock, seconds; ``-inf``: none):
        a timer started at or before it is not excused by the latest (:meth:`excuses`)."""
        return self._previous_s

    def excuses(self, started_s: float) -> bool:
        """Whether the latest stall (reported by :meth:`stalled`) gives a timer that started at
        ``started_s`` (a peer's last word, its last progress, a grace's start: the judge's clock,
        seconds) a fresh window: only if it started after the previous stall ended. A timer that the
        previous stall restarted, and that its peer has not restarted since, is not excused twice, so
        a judge that stalls again and again (slow, not frozen) still declares a silent peer dead (see
        the module's docstring)."""
        return started_s > self._previous_s
