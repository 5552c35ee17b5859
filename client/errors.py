"""Errors the client SDK raises or records on handles."""

from __future__ import annotations

from protocol.enums import ErrorCode
from protocol.validation import echo, start_hint


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


class UnknownModelError(RemoteError, ValueError):
    """No worker serves or loads ``model`` at the broker (code ``unknown_model``):
    raised by :meth:`Client.wait_for_model <client.Client.wait_for_model>` at
    once, not after a timeout. The message lists the models the broker
    serves, the ones being loaded and those it loads on demand (when there are
    any); ``served``, ``loading`` and ``on_demand`` hold them."""

    def __init__(self, model: str, address: str, served, loading, on_demand=()) -> None:
        self.model = model
        self.served = tuple(sorted(served))
        self.loading = tuple(sorted(loading))
        self.on_demand = tuple(sorted(on_demand))
        there = f"served: {', '.join(self.served) or 'none'}; loading: {', '.join(self.loading) or 'none'}"
        if self.on_demand:
            there += f"; on demand: {', '.join(self.on_demand)}"
        super().__init__(ErrorCode.UNKNOWN_MODEL,
                         f"no model named at {address} (an empty name); name one ({there})" if not model else
                         f"no worker serves or loads model {echo(model)} at {address} ({there}); "
                         f"{start_hint(model)} or pick a served model")
