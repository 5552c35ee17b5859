"""The client's ledger: every request submitted and not yet ended, by request id.

A plain object (no sockets, threads or locks), driven by
:class:`~client.core.ClientCore`. A request is *open* from :meth:`Ledger.open`
until :meth:`Ledger.end` records its ending (it leaves the ledger then:
whatever arrives for it later finds nothing), and *settled* once its
completion callback has returned (:meth:`Ledger.settle`; ``handle.done()``
is true from then on). ``in_flight`` counts requests opened and not settled.

Invariants (kept here, pinned by ``tests/client/test_ledger.py``):

- a request id is in the ledger at most once: a caller's id already in
  flight is refused; an id picked for the caller skips the ones in flight;
- every opened request ends exactly once: :meth:`~Ledger.end` answers
  False for every later ending, whoever reports it;
- a cancel is pending from :meth:`~Ledger.cancel` until its request ends
  (after a broker restart, the pending ones are sent again);
- an open request with a ``timeout_s`` has its deadline (submission +
  ``timeout_s``, on the client's clock) in a heap until :meth:`~Ledger.overdue`
  hands it out once (ended requests' entries are dropped there, or when the
  heap outgrows the open requests);
- a request ended here while the broker may still hold it (its deadline passed
  while the broker was silent, or a message about it could not be handled: a
  cancel is sent) keeps its id ``retiring`` until the broker's own ending or
  refusal of it arrives (:meth:`~Ledger.retired`), or a new broker is heard from:
  until then :meth:`~Ledger.open` refuses the id, which the broker would take
  for the old request (a resubmission, run once) and answer with its news.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

from client.handle import ClientHandle
from protocol.enums import FinishReason
from protocol.request import RequestId, RequestParams


class Ledger:
    """The open requests of one client.

    - ``handles``: request id -> :class:`~client.handle.ClientHandle`, open ones only.
    - ``in_flight``: requests opened and not yet settled.
    - ``closed``: the client was closed: :meth:`open` refuses.
    - ``broken``: the exception that ended the connection, or None: :meth:`open` refuses.
    - ``retiring``: ids of requests ended here that the broker may still hold (see the module
      docstring): :meth:`open` refuses them. The I/O thread takes ids out without the client's
      lock (:meth:`retired`; one ``set.discard``, atomic): a request the broker has ended can be
      sent again at once.

    ``owner`` is given to every handle (it serves ``handle.result()`` and
    ``handle.text``; None for a ledger driven without a client, as in tests).
    """

    __slots__ = ("handles", "in_flight", "closed", "broken", "retiring", "_ids", "_cancelling", "_owner",
                 "_deadlines", "_order")

    def __init__(self, owner=None) -> None:
        self.handles: dict[RequestId, ClientHandle] = {}
        self.in_flight = 0
        self.closed = False
        self.broken: BaseException | None = None
        self.retiring: set[RequestId] = set()
        self._ids = itertools.count()
        self._cancelling: set[RequestId] = set()  # open requests with a cancel sent
        self._owner = owner
        self._deadlines: list[tuple[float, int, RequestId]] = []  # heap: (deadline_s, order, id) of timed requests
        self._order = itertools.count()  # (ties in the heap never compare ids, which may mix ints and strs)

    def open(self, params: RequestParams, callback: Callable | None, on_token: Callable | None,
             on_text: Callable | None, request_id: RequestId | None, now: float) -> ClientHandle:
        """Record a new request (``request_id`` checked already, or None: pick one)
        submitted at ``now``; return its handle.

        Raises ValueError when ``request_id`` is open already or retiring (ended here, the
        broker's ending of it not heard yet), RuntimeError when the client is closed or its
        connection failed.
        """
        if self.closed:
            raise RuntimeError("this client is closed")
        if self.broken is not None:
            raise RuntimeError(f"this client's connection failed ({self.broken}); make a new Client")
        handles = self.handles
        rid = request_id
        if rid is None:
            rid = next(self._ids)
            while rid in handles or rid in self.retiring:
                rid = next(self._ids)
        elif rid in handles:
            raise ValueError(f"request_id {rid!r} is already in flight on this client; "
                             "use a new id, or cancel the old request first")
        elif rid in self.retiring:
            raise ValueError(f"request_id {rid!r} ended here (its deadline passed while the broker was silent, or "
                             "a message about it failed) and the broker has not yet said it ended there: it would "
                             "take this request for that one; use a new id, or wait for the broker")
        h = ClientHandle(rid, params, callback, on_token, now, self._owner, on_text)
        handles[rid] = h
        self.in_flight += 1
        if params.timeout_s is not None:
            deadlines = self._deadlines
            if len(deadlines) > 2 * len(handles) + 64:  # mostly ended requests' entries: keep the open ones
                deadlines[:] = [e for e in deadlines if e[2] in handles]
                heapq.heapify(deadlines)
            heapq.heappush(deadlines, (now + params.timeout_s, next(self._order), rid))
        return h

    def overdue(self, now: float) -> list[ClientHandle]:
        """The open requests whose deadline (``timeout_s`` after submission) is at or before
        ``now``, each handed out once, earliest deadline first."""
        deadlines, handles, out = self._deadlines, self.handles, {}
        while deadlines and deadlines[0][0] <= now:
            _, _, rid = heapq.heappop(deadlines)
            h = handles.get(rid)  # (an id ended and used again: that request's own deadline counts)
            if h is not None and h.params.timeout_s is not None and h.submitted_s + h.params.timeout_s <= now:
                out[rid] = h
        return list(out.values())

    def cancel(self, request_id) -> bool:
        """Note a cancel for ``request_id``: True when it is open (send the
        cancel), False when it is unknown, ended or already being cancelled
        (send nothing; as the engine's ``cancel``, which says False for a
        request already ending)."""
        if request_id not in self.handles or request_id in self._cancelling:
            return False
        self._cancelling.add(request_id)
        return True

    def retire(self, request_ids: Iterable[RequestId]) -> None:
        """``request_ids`` ended here and were cancelled at the broker, which may still hold them:
        their ids stay refused until :meth:`retired` (or :meth:`forget_retiring`)."""
        self.retiring.update(request_ids)

    def retired(self, request_id: RequestId) -> None:
        """The broker ended or refused ``request_id`` (its news found no open request): if it
        was retiring, its id is free again."""
        self.retiring.discard(request_id)

    def forget_retiring(self) -> None:
        """A new broker (a restart): it holds none of the retiring requests."""
        self.retiring.clear()

    def cancelling(self, request_ids: Iterable[RequestId]) -> list[RequestId]:
        """Those of ``request_ids`` with a cancel pending, in order."""
        pending = self._cancelling
        return [rid for rid in request_ids if rid in pending]

    def end(self, h: ClientHandle, reason: FinishReason, error: BaseException | None, now: float,
            stop_reason=None) -> bool:
        """Record ``h``'s ending at ``now`` and take it out of the ledger; False
        (nothing changes) when it ended already.

        An error a streaming callback raised, or a failure handling a
        message about ``h`` (``h._stream_error``), overrides the ending given:
        the request ends ``error`` with it (tokens may be missing).
        """
        rid = h.request_id
        if self.handles.get(rid) is not h:
            return False
        del self.handles[rid]
        self._cancelling.discard(rid)
        if h._stream_error is not None:
            reason, error = FinishReason.ERROR, h._stream_error
        h._end(reason, stop_reason, error, now)
        return True

    def settle(self, h: ClientHandle, callback_error: BaseException | None = None) -> None:
        """``h`` ended and its completion callback returned (raising
        ``callback_error``, recorded on the handle unless it has an error
        already): it is done, and no longer counts in ``in_flight``."""
        if callback_error is not None and h._error is None:
            h._error = callback_error
        h.callback = None
        h._done = True
        self.in_flight -= 1
