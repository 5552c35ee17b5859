"""The gateway's memory of ``/v1/responses`` answers, for ``previous_response_id`` and ``GET``.

OpenAI keeps a stored response (``store: true``, the default) for 30 days; a gateway keeps it in
memory, so the store is bounded both ways: by count (``max_responses``; the oldest goes first) and
by age (``max_age_s`` since it was stored; an expired one is gone as if deleted). The bounds are
:class:`~gateway.config.GatewayConfig`'s ``responses_store_max`` and ``responses_store_max_age_s``.
Nothing survives the gateway's restart, and each gateway replica has its own store: behind a load
balancer, a client that continues a conversation by id needs sticky sessions (or sends the whole
conversation, ``store: false``).

A response being generated is *running* here from its start (:meth:`ResponseStore.begin`, which
gives its :class:`Running` handle) until its end is told through that handle
(:meth:`ResponseStore.end`: stored, or not for one that failed): ``GET`` answers it as OpenAI does,
``status: "in_progress"``; ``DELETE`` deletes it (it is not stored when it ends);
``previous_response_id`` refuses it as still in progress (its output is not known yet). Running
responses are bounded as stored ones are, so one whose end is never told (its client went away
mid-answer) is forgotten in time. A deletion is kept on the handle, not in the store, so it holds
however long the response runs and whatever the bounds drop meanwhile, and goes with the handle; a
running response that the bounds dropped and that was not deleted is stored when it ends (between
the two, ``GET`` and ``DELETE`` do not know it: 404, as for one dropped from the store).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.origins import Origin

__all__ = ["ResponseStore", "Running", "StoredResponse"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored answer: ``response`` (the Response object as it was answered) and ``messages``
    (the conversation up to and including its output, as chat messages, without ``instructions``,
    which OpenAI does not carry over to the next response) and ``origins`` (the Responses items each
    of ``messages`` was made of, for the errors of a request that replays them; none where unknown)."""

    response: dict
    messages: tuple[dict, ...]
    origins: tuple[Origin, ...] = ()


class Running:
    """The handle of one running response, from :meth:`ResponseStore.begin` to :meth:`ResponseStore.end`:
    ``response_id``, ``in_progress`` (the Response object ``GET`` answers meanwhile) and ``deleted``
    (a ``DELETE`` came while it ran: it is not to be stored)."""

    __slots__ = ("response_id", "in_progress", "deleted")

    def __init__(self, response_id: str, in_progress: dict) -> None:
        self.response_id = response_id
        self.in_progress = in_progress
        self.deleted = False


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them, each for at most ``max_age_s`` seconds
    (``clock``: seconds, :func:`time.monotonic` by default), and as many running ones on the same
    bounds. Event loop only (no lock). ValueError for a ``max_responses`` that is not an int >= 1 or
    a ``max_age_s`` that is not > 0."""

    def __init__(self, max_responses: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if type(max_responses) is not int or max_responses < 1:
            raise ValueError(f"max_responses must be an int >= 1, got {max_responses!r}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {max_age_s!r}")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # oldest first
        self._running: OrderedDict[str, tuple[float, Running]] = OrderedDict()  # oldest first, none deleted

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def begin(self, response_id: str, in_progress: dict) -> Running:
        """``response_id`` is being generated (``in_progress``: the Response object ``GET`` answers
        meanwhile) and is to be stored when it ends: its handle, for :meth:`end`."""
        run = Running(response_id, in_progress)
        self._push(self._running, response_id, run)
        return run

    def running(self, response_id: str) -> dict | None:
        """The in-progress Response object of ``response_id`` while it is generated (not deleted nor
        dropped by the bounds), or None."""
        self._expire()
        entry = self._running.get(response_id)
        return None if entry is None else entry[1].in_progress

    def end(self, run: Running, stored: StoredResponse | None) -> None:
        """``run`` ended: no longer running; ``stored`` (its answer; None for one that failed or whose
        client went away) is stored under its id unless it was deleted while it ran -- also where the
        bounds had dropped it meanwhile. Ending a run whose id began again since leaves the new one be."""
        entry = self._running.get(run.response_id)
        if entry is not None and entry[1] is run:
            del self._running[run.response_id]
        if stored is not None and not run.deleted:
            self.put(run.response_id, stored)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store ``stored`` under ``response_id`` (the newest), dropping the oldest past the bounds.
        A running response is stored through :meth:`end`, which keeps a deleted one out."""
        self._push(self._items, response_id, stored)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None: never stored, evicted, expired or deleted."""
        self._expire()
        entry = self._items.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``, stored or running (then it is not stored when it ends); whether it
        was there (False for a running one the bounds dropped: it is stored when it ends)."""
        self._expire()
        found = self._items.pop(response_id, None) is not None
        entry = self._running.pop(response_id, None)
        if entry is not None:
            entry[1].deleted = True
        return found or entry is not None

    def _push(self, entries: OrderedDict, key: str, value: object) -> None:
        """``value`` under ``key`` as the newest of ``entries`` (stamped now), dropping the oldest past
        ``max_responses``, then every expired one."""
        entries.pop(key, None)
        entries[key] = (self._clock(), value)
        while len(entries) > self.max_responses:
            entries.popitem(last=False)
        self._expire()

    def _expire(self) -> None:
        horizon = self._clock() - self.max_age_s
        for entries in (self._running, self._items):
            while entries and next(iter(entries.values()))[0] <= horizon:
                entries.popitem(last=False)
