"""Errors the client SDK raises or records on handles."""

from __future__ import annotations

from protocol.enums import ErrorCode


class RemoteError(Exception):
    """A request ended with an error reported by the broker or a worker.

    Recorded as ``handle.error`` (``finish_reason == "error"``). ``code`` is the
    wire :class:`~protocol.enums.ErrorCode` (``queue_full``, ``bad_request``,
    ``model_error``, ...); ``message`` says what happened and what to do.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class BrokerUnavailable(ConnectionError):
    """No broker answered at the address within the timeout (per-process failure).

    Check that ``slotserve broker`` (or ``slotserve up``) runs there.
    """
