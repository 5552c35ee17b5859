"""The gateway's memory of ``/v1/responses`` answers, for ``previous_response_id`` and ``GET``.

OpenAI keeps a stored response (``store: true``, the default) for 30 days; a gateway keeps it in
memory, so the store is bounded both ways: by count (``max_responses``; the oldest goes first) and
by age (``max_age_s`` since it was stored; an expired one is gone as if deleted). The bounds are
:class:`~gateway.config.GatewayConfig`'s ``responses_store_max`` and ``responses_store_max_age_s``.
Nothing survives the gateway's restart, and each gateway replica has its own store: behind a load
balancer, a client that continues a conversation by id needs sticky sessions (or sends the whole
conversation, ``store: false``).

A response being generated is *running* here from its start (:meth:`ResponseStore.begin`) until it
is stored (:meth:`ResponseStore.put`) or fails (:meth:`ResponseStore.abandon`): ``GET`` answers it
as OpenAI does, ``status: "in_progress"``; ``DELETE`` deletes it (it is not stored when it ends);
``previous_response_id`` refuses it as still in progress (its output is not known yet). Running
responses are bounded as stored ones are, so one whose end is never told (its client went away
mid-answer) is forgotten in time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.origins import Origin

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored answer: ``response`` (the Response object as it was answered) and ``messages``
    (the conversation up to and including its output, as chat messages, without ``instructions``,
    which OpenAI does not carry over to the next response) and ``origins`` (the Responses items each
    of ``messages`` was made of, for the errors of a request that replays them; none where unknown)."""

    response: dict
    messages: tuple[dict, ...]
    origins: tuple[Origin, ...] = ()


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them, each for at most ``max_age_s`` seconds
    (``clock``: seconds, :func:`time.monotonic` by default). Event loop only (no lock)."""

    def __init__(self, max_responses: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if type(max_responses) is not int or max_responses < 1:
            raise ValueError(f"max_responses must be an int >= 1, got {max_responses!r}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {max_age_s!r}")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # oldest first
        self._running: OrderedDict[str, tuple[float, dict | None]] = OrderedDict()  # (None: deleted meanwhile)

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def begin(self, response_id: str, in_progress: dict) -> None:
        """``response_id`` is being generated (``in_progress``: the Response object ``GET`` answers
        meanwhile) and is to be stored when it ends."""
        self._running.pop(response_id, None)
        self._running[response_id] = (self._clock(), in_progress)
        while len(self._running) > self.max_responses:
            self._running.popitem(last=False)
        self._expire()

    def running(self, response_id: str) -> dict | None:
        """The in-progress Response object of ``response_id`` while it is generated (not deleted), or None."""
        self._expire()
        entry = self._running.get(response_id)
        return None if entry is None else entry[1]

    def abandon(self, response_id: str) -> None:
        """``response_id`` ended without an answer to store (it failed): no longer running. A no-op
        for one stored or unknown."""
        self._running.pop(response_id, None)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store ``stored`` under ``response_id`` (the newest), dropping the oldest past the bounds;
        nothing when ``response_id`` was deleted while it ran."""
        entry = self._running.pop(response_id, None)
        if entry is not None and entry[1] is None:
            return
        self._items.pop(response_id, None)
        self._items[response_id] = (self._clock(), stored)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None: never stored, evicted, expired or deleted."""
        self._expire()
        entry = self._items.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``, stored or running (then it is not stored when it ends); whether it
        was there."""
        self._expire()
        if self._items.pop(response_id, None) is not None:
            return True
        entry = self._running.get(response_id)
        if entry is None or entry[1] is None:
            return False
        self._running[response_id] = (entry[0], None)
        return True

    def _expire(self) -> None:
        horizon = self._clock() - self.max_age_s
        while self._running and next(iter(self._running.values()))[0] <= horizon:
            self._running.popitem(last=False)
        while self._items:
            stored_at, _ = next(iter(self._items.values()))
            if stored_at > horizon:
                break
            self._items.popitem(last=False)
