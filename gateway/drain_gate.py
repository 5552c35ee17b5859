"""The drain for every route: :class:`DrainGate`, an ASGI middleware in front of the routes.

The generation and embedding routes take part in the drain themselves (:mod:`gateway.drain`: a
request is in the registry from its start to its end, and its stream ends with its own last words).
Every other route -- ``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``, ``/models/load``
and ``/models/unload``, ``GET`` / ``DELETE /v1/responses/{id}``, ``/v1/models``, ``/props``, and a
path no route serves -- is taken into the drain here, those added later included, as
:class:`gateway.auth.APIKeys` guards them all:

- while the gateway drains, a new request gets the 503 a generation request gets
  (:data:`~gateway.drain.REFUSED`, ``Retry-After: 1``, ``Connection: close``; under
  ``/v1/messages`` in Anthropic's shape, ``overloaded_error``). Before, ``POST /models/load``
  answered ``{"success": true}`` and ``slotserve up`` started loading the model in a cluster that was
  stopping;
- a request in flight is in the registry until its answer is sent, so the drain waits for it (up to
  ``--shutdown-timeout-s``); when the drain ends it, it is cancelled and answers 503 with the drain's
  message. Before, the drain did not know it: a ``/tokenize`` of a large text (seconds of tokenizer
  work) was cut by uvicorn's shutdown two seconds later with a plain-text ``500 Internal Server
  Error`` and an ERROR logged.

``/health`` (it answers ``{"status": "draining"}`` itself) and ``/metrics`` (scrapers see the last
numbers) stay open.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.drain import REFUSED, Drain, unless_ended
from gateway.errors import APIError, shutting_down
from gateway.responses import error_response, json_response

__all__ = ["DrainGate", "OPEN_PATHS"]

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Paths served whatever the drain (answered by their own handlers)."""

_ANTHROPIC = "/v1/messages"


def _refusal(path: str, e: APIError):
    """``e`` as the route at ``path`` words an error: Anthropic's shape under ``/v1/messages``, else OpenAI's."""
    if path == _ANTHROPIC or path.startswith(_ANTHROPIC + "/"):
        return json_response(e.anthropic_body(), e.status, e.headers)
    return error_response(e)


class _Held:
    """One request in flight through the gate (:class:`gateway.drain.AbortableCall`): :meth:`end`
    keeps the drain's message and sets ``event``, which ends the route's work."""

    __slots__ = ("ended", "event")

    def __init__(self) -> None:
        self.ended: str | None = None
        self.event = asyncio.Event()

    def end(self, message: str) -> None:
        if self.ended is None:
            self.ended = message
            self.event.set()


class DrainGate:
    """The ASGI middleware: refuses a new request while ``drain`` drains, and keeps one in flight in
    its registry until answered; ``own``: the paths whose routes take part in the drain themselves
    (passed through as they are), besides :data:`OPEN_PATHS`."""

    def __init__(self, app: ASGIApp, *, drain: Drain, own: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.drain = drain
        self.passed = OPEN_PATHS | own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.passed:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _refusal(path, shutting_down(REFUSED))(scope, receive, send)
            return
        started = complete = False

        async def tracked(message: Message) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        held = _Held()
        self.drain.add(held)  # (ends it at once when the drain has ended everything already)
        try:
            done, _ = await unless_ended(self.app(scope, receive, tracked), held.event)
            if done:
                return
            if not started:
                await _refusal(path, shutting_down(held.ended))(scope, receive, send)
            elif not complete:  # (an answer cut in its body: end it, short)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.drain.discard(held)
