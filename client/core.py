"""The client's decisions, without sockets: messages in, what to send and what to deliver out.

:class:`ClientCore` is fed the caller's submits and cancels, the broker's
decoded messages and the connection's failures, each with the client's
monotonic ``now``. It keeps the :class:`~client.ledger.Ledger` and answers
with an :class:`Outcome`: the messages to send the broker and the handles
whose completion callback to run. :mod:`client.client` (and through it
:mod:`client.aio`) owns the threads, the connection and the callbacks and
performs the outcomes; ``tests/client/test_ledger.py`` drives the core alone.

Threads: the core is not thread-safe. Each request has one delivering
thread: the I/O thread for requests without callbacks (``on_token``,
``on_text``, ``callback`` all None: one thread hop less on the way to a
waiting ``result()``/``run()``), the callback thread for the others. Applying
tokens and text (:meth:`ClientCore.apply_plain`, :meth:`ClientCore.stream`)
is done by that thread without the lock (it alone appends to those handles;
reading the ledger's dict while another thread changes it is safe in
CPython); every other method -- whatever changes the ledger: opening,
ending, settling, cancels -- is called under the shell's one lock.

Invariants: every submitted request gets exactly one ending (see
:mod:`client.ledger`), whatever arrives: results, an error naming it, the
connection's end, a broker restart, its deadline passing while the broker
is silent, ``close()``; an error or a failure
names the requests it ends, and ends nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

from client.errors import RemoteError
from client.handle import ClientHandle
from client.ledger import Ledger
from protocol.enums import ErrorCode, FinishReason
from protocol.framing import request_ids
from protocol.messages import Envelope, Error, Finished, Results
from protocol.request import RequestId, RequestParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """What the shell does after an event, in this order: ask the broker for
    its welcome (``hello``), send ``submit`` (envelopes) and ``cancel``
    (request ids); wake the threads waiting on requests when ``settled``
    (how many ended with no completion callback to run: done already);
    then run the completion callback of each handle of ``deliver`` (ended
    already: ``finish_reason`` and ``error`` are set) and
    :meth:`ClientCore.settle` it. (Empty tuples by default: an outcome
    costs no lists when it has nothing to say.)"""

    hello: bool = False
    submit: list[Envelope] | tuple = ()
    cancel: list[RequestId] | tuple = ()
    deliver: list[ClientHandle] | tuple = ()
    settled: int = 0


def internal(error: BaseException) -> RemoteError:
    """The error a request ends with when the client failed handling a message about it."""
    return RemoteError(ErrorCode.INTERNAL, f"the client failed handling a message about this request "
                                           f"({type(error).__name__}: {error}); please report it")


class ClientCore:
    """The request ledger of one client and every decision about its requests.

    - ``ledger``: the open requests (:class:`~client.ledger.Ledger`).
    - ``broker_id``: the broker last heard from (None before its first
      welcome); a new one means it restarted (:meth:`broker_seen`).
    - ``resubmitted``: requests resubmitted after broker restarts (a counter).

    ``owner``: given to every handle (see :class:`~client.ledger.Ledger`).
    """

    def __init__(self, owner=None) -> None:
        self.ledger = Ledger(owner)
        self.broker_id: str | None = None
        self.resubmitted = 0

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet settled."""
        return self.ledger.in_flight

    # ------------------------------------------------------------------ the caller's threads

    def submit(self, params: RequestParams, callback: Callable | None = None, *, on_token: Callable | None = None,
               on_text: Callable | None = None, request_id: RequestId | None = None,
               now: float) -> tuple[ClientHandle, Envelope]:
        """A new request (its parameters and ``request_id`` checked already; None:
        pick one): its handle and the envelope to send. Raises as
        :meth:`Ledger.open <client.ledger.Ledger.open>`; nothing is recorded then."""
        h = self.ledger.open(params, callback, on_token, on_text, request_id, now)
        return h, Envelope(h.request_id, params)

    def cancel(self, request_id) -> bool:
        """The caller cancels ``request_id``: True when it is open (send a cancel
        for it; it stays pending until the request ends), False otherwise
        (send nothing: a request that ended stays as it ended)."""
        return self.ledger.cancel(request_id)

    def close(self) -> bool:
        """The caller closes the client: True the first time (no new requests
        from now on; the shell says goodbye and then :meth:`abandon`\\ s the
        rest), False after that."""
        if self.ledger.closed:
            return False
        self.ledger.closed = True
        return True

    # ------------------------------------------------------------------ the I/O thread

    def apply_plain(self, msg: Results, now: float) -> tuple[Results | None, list[tuple[ClientHandle, Finished]]]:
        """Apply ``msg``'s tokens and text to the requests with no callbacks;
        return what is left for the callback thread (:meth:`stream`; None
        when nothing is) and those requests' endings, for :meth:`end_plain`.
        Entries for requests not open are dropped. The prompt lengths
        (``started``) are set on every request's handle here, before any of
        its tokens is delivered, whichever thread delivers them; so are the
        embeddings (before the endings), and the prompt's logprobs (the first to arrive: a resumed request's later
        ones are ignored). Token logprobs go with their tokens.

        The I/O thread calls it without the lock: it alone delivers to these
        requests (as the callback thread to the others). The hot path of a
        client without callbacks: kept flat."""
        handles, retiring = self.ledger.handles, self.ledger.retiring
        for rid, n, cached in msg.started:  # text and chat prompts, with their first tokens
            h = handles.get(rid)
            if h is not None:
                h._prompt_tokens = n
                if cached is not None:
                    h._cached_tokens = cached
        for rid, vector in msg.embeddings:  # (embedding requests, before their endings below)
            h = handles.get(rid)
            if h is not None:
                h.embedding_bytes = vector
        logprobs = _logprobs(msg.logprobs, handles) if msg.logprobs else ()
        ids, tokens, texts, finished, endings = [], [], [], [], []
        for rid, t in zip(msg.ids, msg.tokens):
            h = handles.get(rid)
            if h is None:
                continue
            if h.callback is None and h.on_token is None and h.on_text is None:  # no callbacks
                if h.first_token_s is None:
                    h.first_token_s = now
                h._tokens.append(t)
            else:
                ids.append(rid)
                tokens.append(t)
        for entry in msg.texts:
            h = handles.get(entry.request_id)
            if h is None:
                continue
            if h.callback is None and h.on_token is None and h.on_text is None:
                h._text.append(entry.text)
            else:
                texts.append(entry)
        for f in msg.finished:
            h = handles.get(f.request_id)
            if h is None:
                if retiring:  # (the broker's ending of a request ended here: its id is free again)
                    self.ledger.retired(f.request_id)
                continue
            if h.callback is None and h.on_token is None and h.on_text is None:
                endings.append((h, f))
            else:
                finished.append(f)
        rest = (Results(tuple(ids), tuple(tokens), tuple(texts), tuple(finished), (), logprobs)
                if ids or texts or finished else None)
        return rest, endings

    def end_plain(self, endings: list[tuple[ClientHandle, Finished]], now: float) -> int:
        """End the requests of :meth:`apply_plain`'s ``endings`` as the broker
        said (they have no callback: each is settled at once, unless it ended
        before); return how many settled."""
        ledger = self.ledger
        before = ledger.in_flight
        for h, f in endings:
            self.finish(h, f, now)
        return before - ledger.in_flight

    def mark_failed(self, ids, error: BaseException) -> None:
        """Requests ``ids`` end with ``error`` whatever arrives for them next
        (their message failed, or the broker refused them: the callback thread
        ends them; a later frame applied on the I/O thread first must not end
        them normally, as the tokens of the failed one are lost)."""
        handles = self.ledger.handles
        for rid in ids:
            h = handles.get(rid)
            if h is not None and h._stream_error is None:
                h._stream_error = error

    def io_refused(self, msg: Error) -> None:
        """The broker (or the connection) refused the requests ``msg`` names:
        they will end with its code (:meth:`mark_failed`, then :meth:`error`); those that
        ended here already are no longer the broker's (:meth:`Ledger.retired`)."""
        self.mark_failed(msg.request_ids, RemoteError(msg.code, msg.message))
        if self.ledger.retiring:
            for rid in msg.request_ids:
                if rid not in self.ledger.handles:
                    self.ledger.retired(rid)

    def io_failed(self, msg, error: BaseException) -> None:
        """Handling ``msg`` on the I/O thread raised ``error``: the requests it
        names will end ``internal`` (:meth:`mark_failed`, then :meth:`failed`)."""
        self.mark_failed(request_ids(msg), internal(error))

    # ------------------------------------------------------------------ the callback thread

    def stream(self, msg: Results, now: float) -> Iterator[tuple[ClientHandle, Callable | None, object]]:
        """Apply ``msg`` in order, one entry at a time, yielding what to deliver:
        ``(handle, fn, value)`` to call ``fn(value)`` (``on_token`` with each
        token, then ``on_text`` with each piece of text), and ``(handle,
        None, finished)`` for each ending, to pass to :meth:`finish`.

        Lazy: each entry is applied just before its call is yielded (a
        callback sees the tokens up to its own, and each token's logprob
        entry, appended before it), and a request whose streaming callback
        raised (:meth:`stream_failed`) gets no more calls.
        """
        handles = self.ledger.handles
        entries = _entries(msg.logprobs) if msg.logprobs else None
        for rid, t in zip(msg.ids, msg.tokens):
            h = handles.get(rid)
            if h is None:
                continue
            if h.first_token_s is None:
                h.first_token_s = now
            if entries is not None:
                e = entries.get(rid)
                if e is not None and h.logprobs is not None:
                    h.logprobs.append(next(e))
            h._tokens.append(t)
            if h.on_token is not None and h._stream_error is None:
                yield h, h.on_token, t
        for rid, text in msg.texts:
            h = handles.get(rid)
            if h is None:
                continue
            h._text.append(text)
            if h.on_text is not None and h._stream_error is None:
                yield h, h.on_text, text
        for f in msg.finished:
            h = handles.get(f.request_id)
            if h is not None:
                yield h, None, f

    def finish(self, h: ClientHandle, f: Finished, now: float) -> bool:
        """The broker's ending ``f`` for ``h`` (from :meth:`stream`): True when
        ``h``'s completion callback is to run now (then :meth:`settle` it);
        False when there is nothing to run (``h`` had no callback and is
        settled already, or it had ended before)."""
        if f.prompt_tokens is not None:
            h._prompt_tokens = f.prompt_tokens
        if f.cached_tokens is not None:  # (the last worker's count; None: it never prefilled the prompt)
            h._cached_tokens = f.cached_tokens
        error = None if f.code is None else RemoteError(f.code, f.message or f.code.value)
        if not self.ledger.end(h, f.finish_reason, error, now, f.stop_reason):
            return False
        if h.callback is None:
            self.ledger.settle(h)
            return False
        return True

    def stream_failed(self, h: ClientHandle, error: BaseException) -> Outcome:
        """``h``'s ``on_token`` or ``on_text`` raised ``error``: it ends with that
        error (no more streaming calls) and is cancelled at the broker."""
        h._stream_error = error
        return Outcome(cancel=[h.request_id])

    def error(self, msg: Error, now: float) -> Outcome:
        """The broker (or the connection, for what it could not send) refused
        the requests ``msg`` names: each ends ``error`` with its code. One
        naming no request (not a refusal of this client's hello) is logged."""
        if not msg.request_ids:
            log.warning("the broker reported an error: %s: %s", msg.code.value, msg.message)
            return Outcome()
        return self._end_all(msg.request_ids, FinishReason.ERROR, RemoteError(msg.code, msg.message), now)

    def failed(self, msg, error: BaseException, now: float) -> Outcome:
        """Handling ``msg`` raised ``error``: the requests it names end
        ``internal`` and are cancelled at the broker; nothing else is touched."""
        try:
            ids = request_ids(msg)
        except Exception:  # noqa: BLE001 -- not a message at all: it names nothing
            return Outcome()
        ended = [rid for rid in ids if rid in self.ledger.handles]
        out = self._end_all(ended, FinishReason.ERROR, internal(error), now)
        out.cancel = ended
        # the broker still holds them (their ids wait for its word), but for those this message ended there
        over = {f.request_id for f in msg.finished} if isinstance(msg, Results) else ()
        self.ledger.retire(rid for rid in ended if rid not in over)
        return out

    def broken(self, error: BaseException, now: float) -> Outcome:
        """The connection failed: every request ends with an error
        (``broker_unavailable``), and new ones are refused."""
        self.ledger.broken = error
        err = RemoteError(ErrorCode.BROKER_UNAVAILABLE, f"the client's connection failed ({type(error).__name__}: "
                                                        f"{error}); make a new Client")
        return self._end_all(list(self.ledger.handles), FinishReason.ERROR, err, now)

    def abandon(self, now: float) -> Outcome:
        """The client closed: what is still open ends ``cancelled`` (the broker
        cancels it when the client says goodbye)."""
        return self._end_all(list(self.ledger.handles), FinishReason.CANCELLED, None, now)

    def broker_seen(self, broker_id: str, now: float) -> Outcome:
        """A welcome or heartbeat from broker ``broker_id``. A new id means the
        broker restarted and lost what was in flight: ask for its welcome
        (its models), and send every open request again (:func:`resubmission`:
        with the tokens received and the time left), then the cancels still
        pending for them (the old broker took those with it)."""
        old, self.broker_id = self.broker_id, broker_id
        if old is None or old == broker_id:
            return Outcome()
        self.ledger.forget_retiring()  # (the new broker holds none of them)
        pending = list(self.ledger.handles.values())
        log.warning("broker restarted (%s -> %s): resubmitting %d requests", old[:8], broker_id[:8], len(pending))
        endings, entries = resubmission(pending, now)
        out = self._end_each(endings, None, now)
        out.hello, out.submit = True, entries
        out.cancel = self.ledger.cancelling(e.request_id for e in entries)
        self.resubmitted += len(entries)
        return out

    def overdue(self, now: float, heard_s: float, grace_s: float) -> list[ClientHandle]:
        """The open requests whose deadline passed (``timeout_s`` seconds after submission) while
        the broker is silent: nothing heard from it since ``heard_s`` and at least ``grace_s``
        seconds before ``now`` (the client's monotonic clock). A broker that answers ends each
        request at its deadline itself (queued or running, with the tokens so far); one that is
        gone (killed, stopped, cut off) never would, and a request with a deadline must not wait
        past it for a broker that may never come back. Each is handed out once, for
        :meth:`expire`; [] while the broker is heard from."""
        if now - heard_s < grace_s:
            return []
        return self.ledger.overdue(now)

    def expire(self, handles: list[ClientHandle], now: float) -> Outcome:
        """End each of ``handles`` (from :meth:`overdue`) still open ``deadline`` with the tokens
        received, as the broker would have, and cancel it there (a broker that comes back then
        frees its slot; its later news about it finds nothing)."""
        open_ = [h for h in handles if self.ledger.handles.get(h.request_id) is h]
        out = self._end_each(((h, FinishReason.DEADLINE) for h in open_), None, now)
        out.cancel = [h.request_id for h in open_]
        self.ledger.retire(out.cancel)  # (the broker may still hold them: their ids wait for its word)
        return out

    def settle(self, h: ClientHandle, callback_error: BaseException | None = None) -> None:
        """``h``'s completion callback (an :class:`Outcome`'s ``deliver``) returned,
        or raised ``callback_error``: see :meth:`Ledger.settle <client.ledger.Ledger.settle>`."""
        self.ledger.settle(h, callback_error)

    # ------------------------------------------------------------------ helpers

    def _end_all(self, ids, reason: FinishReason, error: BaseException | None, now: float) -> Outcome:
        """End each open request of ``ids`` with ``reason`` and ``error``."""
        handles = self.ledger.handles
        return self._end_each(((handles[rid], reason) for rid in ids if rid in handles), error, now)

    def _end_each(self, endings, error: BaseException | None, now: float) -> Outcome:
        """End each ``(handle, reason)`` of ``endings`` with ``error``: an
        outcome delivering those with a completion callback; the others are
        settled at once."""
        ledger = self.ledger
        deliver, settled = [], 0
        for h, reason in endings:
            if not ledger.end(h, reason, error, now):
                continue
            if h.callback is None:
                ledger.settle(h)
                settled += 1
            else:
                deliver.append(h)
        return Outcome(deliver=deliver, settled=settled)


def _logprobs(records, handles: dict) -> tuple:
    """(I/O thread) Apply the logprob records of requests without callbacks (their
    entries, and every request's first ``prompt``); return those of the others
    (their entries, for :meth:`ClientCore.stream`)."""
    rest = []
    for rec in records:
        h = handles.get(rec.request_id)
        if h is None:
            continue
        if rec.prompt is not None and h.prompt_logprobs is None and h.params.prompt_logprobs is not None:
            if rec.prompt_ids is not None and not h.params.is_token_prompt and len(rec.prompt_ids) == len(rec.prompt):
                h._prompt_ids = list(rec.prompt_ids)  # (a text prompt's ids: known now)
            h.prompt_logprobs = list(rec.prompt)
        if not rec.entries or h.logprobs is None:  # (entries for a request that did not ask: dropped)
            continue
        if h.callback is None and h.on_token is None and h.on_text is None:
            h.logprobs.extend(rec.entries)
        else:
            rest.append(rec._replace(prompt=None))
    return tuple(rest)


def _entries(records) -> dict:
    """Request id -> an iterator over its entries, in order (a message may hold several records of one request)."""
    by_id: dict = {}
    for rec in records:
        by_id.setdefault(rec.request_id, []).extend(rec.entries)
    return {rid: iter(e) for rid, e in by_id.items()}


def resubmission(pending: list[ClientHandle], now: float) -> tuple[list[tuple[ClientHandle, FinishReason]],
                                                                  list[Envelope]]:
    """What to do with unfinished requests when the broker restarted (``now``: the
    client's monotonic clock): ``(endings, envelopes)``.

    A request that already has all its tokens ends ``length``; one whose
    ``timeout_s`` passed ends ``deadline``; every other one is sent again
    with the tokens received so far (``resume_tokens``) and the time left of
    its deadline, so it continues where it stopped. Pure: no sockets, no locks.
    """
    endings, entries = [], []
    for h in pending:
        params = h.params
        if len(h._tokens) >= params.max_tokens:
            endings.append((h, FinishReason.LENGTH))
            continue
        time_left_s = None
        if params.timeout_s is not None:
            time_left_s = params.timeout_s - (now - h.submitted_s)
            if time_left_s <= 0:
                endings.append((h, FinishReason.DEADLINE))
                continue
        entries.append(Envelope(h.request_id, params, tuple(h._tokens), time_left_s))
    return endings, entries
