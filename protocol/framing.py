"""Frames within a peer's size limit, and the requests a message names.

Every peer refuses frames over its ``max_message_bytes`` (announced in
``welcome`` and ``register``), and many requests share a frame (``submit``,
``assign``, ``iteration``, ``results``). So that one request never decides
the fate of the others in its frame, a sender passes each message through
:func:`fit`: the common case encodes it once and checks its length; a
message over the limit is split per request (halves, recursively) until
every part fits, and a part that still does not fit with one request in it
-- or that cannot be encoded at all -- is handed back to the sender, which
ends just that request with an error (``too_large``, or the encoder's
failure as ``bad_request``).

:func:`request_ids` names the requests a message is about, for the same
purpose on the other paths: a message whose handling failed, a frame
discarded unsent.
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.codec import encode
from protocol.enums import ErrorCode
from protocol.messages import Assign, Cancel, Error, Iteration, Logprobs, Message, Results, Submit
from protocol.request import RequestId

__all__ = ["Framed", "Refused", "fit", "request_ids", "split"]


class Refused(NamedTuple):
    """A part of a message that could not be sent: ``message`` (naming one
    request, or none), the ``code`` to end its request with (``too_large``,
    ``bad_request``) and a ``reason`` for the user."""

    message: Message
    code: ErrorCode
    reason: str


class Framed(NamedTuple):
    """:func:`fit`'s answer: ``frames``, ``(bytes, part)`` pairs to send in
    order (each part a message of the sent one's type, naming a subset of
    its requests), and the ``refused`` parts."""

    frames: list[tuple[bytes, Message]]
    refused: list[Refused]


def fit(msg: Message, max_bytes: int) -> Framed:
    """Encode ``msg`` into frames of at most ``max_bytes`` bytes each.

    A message over the limit (or that fails to encode) is split
    (:func:`split`) and each part fitted again: per request first (the
    requests of a part keep their relative order), then one request's output
    into consecutive parts (its ending in the last). Parts that cannot be
    split further (one request's envelope, one ending) are returned as
    :class:`Refused`. Raises nothing.
    """
    try:
        data = encode(msg)
    except Exception as e:  # noqa: BLE001 -- a value the encoder refuses: find the request carrying it
        error: Exception | None = e
    else:
        if len(data) <= max_bytes:
            return Framed([(data, msg)], [])
        error = None
    framed = Framed([], [])
    _fit_parts(msg, max_bytes, framed, error, None if error is not None else len(data))
    return framed


def _fit_parts(msg: Message, max_bytes: int, framed: Framed, error: Exception | None, size: int | None) -> None:
    halves = split(msg)
    if halves is None:
        if error is not None:
            framed.refused.append(Refused(msg, ErrorCode.BAD_REQUEST,
                                          f"it cannot be encoded for the wire ({type(error).__name__}: {error})"))
        else:
            framed.refused.append(Refused(msg, ErrorCode.TOO_LARGE,
                                          f"its message of {size} bytes exceeds the receiver's limit of {max_bytes} "
                                          "bytes (max_message_bytes); send less per request"))
        return
    for part in halves:
        try:
            data = encode(part)
        except Exception as e:  # noqa: BLE001 -- as in fit()
            _fit_parts(part, max_bytes, framed, e, None)
            continue
        if len(data) <= max_bytes:
            framed.frames.append((data, part))
        else:
            _fit_parts(part, max_bytes, framed, None, len(data))


def split(msg: Message) -> tuple[Message, Message] | None:
    """Two messages that, sent in order, say what ``msg`` says: each about part
    of its requests (``submit``, ``assign``, ``cancel``, ``error``,
    ``iteration``, ``results``), or, for one request's ``iteration`` /
    ``results``, each with part of its output. None when ``msg`` cannot be
    split (one request's envelope or ending; another kind of message)."""
    t = type(msg)
    if t is Submit or t is Assign:
        reqs = msg.requests
        if len(reqs) < 2:
            return None
        h = len(reqs) // 2
        if t is Submit:
            return Submit(msg.model, reqs[:h]), Submit(msg.model, reqs[h:])
        return Assign(reqs[:h]), Assign(reqs[h:])
    if t is Cancel or t is Error:
        ids = msg.request_ids
        if len(ids) < 2:
            return None
        h = len(ids) // 2
        if t is Cancel:
            return Cancel(ids[:h]), Cancel(ids[h:])
        return Error(msg.code, msg.message, ids[:h]), Error(msg.code, msg.message, ids[h:])
    if t is Iteration or t is Results:
        ids = request_ids(msg)
        if len(ids) < 2:
            return _split_one(msg) if ids else None
        first = set(ids[:len(ids) // 2])
        parts = []
        for keep in (first.__contains__, lambda r: r not in first):
            pairs = [(r, tok) for r, tok in zip(msg.ids, msg.tokens) if keep(r)]
            parts.append(t(tuple(r for r, _ in pairs), tuple(tok for _, tok in pairs),
                           tuple(x for x in msg.texts if keep(x.request_id)),
                           tuple(f for f in msg.finished if keep(f.request_id)),
                           tuple(x for x in msg.started if keep(x.request_id)),
                           tuple(x for x in msg.logprobs if keep(x.request_id)),
                           tuple(x for x in msg.embeddings if keep(x.request_id))))
        return parts[0], parts[1]
    return None


def _split_one(msg: Iteration | Results) -> tuple[Message, Message] | None:
    """Split one request's output in two consecutive parts, sent in order: the
    first tokens and text pieces, then the rest with its ending (a client or
    broker appends tokens and text as they come, so two parts say what one
    did). A single text piece is split in two pieces of its characters. The
    prompt length (``started``) goes with the first part, before any token,
    and so do the prompt's logprobs (never split: one request's ``prompt``
    entries over the limit are refused with it); the tokens' logprob entries
    go with their tokens."""
    t = type(msg)
    ids, tokens, texts, finished, started = msg.ids, msg.tokens, msg.texts, msg.finished, msg.started
    if len(ids) > 1 or len(texts) > 1:
        h, k = len(ids) // 2, len(texts) // 2
        first, rest = _split_logprobs(msg.logprobs, h)
        return (t(ids[:h], tokens[:h], texts[:k], (), started, first),
                t(ids[h:], tokens[h:], texts[k:], finished, (), rest, msg.embeddings))
    if texts and len(texts[0].text) > 1:
        (piece,) = texts
        h = len(piece.text) // 2
        return (t(ids, tokens, (piece._replace(text=piece.text[:h]),), (), started, msg.logprobs),
                t(texts=(piece._replace(text=piece.text[h:]),), finished=finished, embeddings=msg.embeddings))
    return None


def _split_logprobs(records: tuple[Logprobs, ...], h: int) -> tuple[tuple[Logprobs, ...], tuple[Logprobs, ...]]:
    """One request's logprob records as two: the entries of its first ``h``
    tokens with its ``prompt`` entries (and ``prompt_ids``), then the entries of the rest."""
    if not records:
        return (), ()
    rid = records[0].request_id
    entries = tuple(e for r in records for e in r.entries)
    with_prompt = next((r for r in records if r.prompt is not None), None)
    prompt, ids = (None, None) if with_prompt is None else (with_prompt.prompt, with_prompt.prompt_ids)
    if not entries:  # (it asked for prompt_logprobs alone)
        return (Logprobs(rid, (), prompt, ids),), ()
    first = (Logprobs(rid, entries[:h], prompt, ids),) if h or prompt is not None else ()
    return first, ((Logprobs(rid, entries[h:]),) if entries[h:] else ())


def request_ids(msg: Message) -> list[RequestId]:
    """The requests ``msg`` is about, each once, in order of first mention
    (empty for messages about no request: ``hello``, ``status``, ...)."""
    t = type(msg)
    if t is Submit or t is Assign:
        return list(dict.fromkeys(e.request_id for e in msg.requests))
    if t is Cancel or t is Error:
        return list(dict.fromkeys(msg.request_ids))
    if t is Iteration or t is Results:
        ids = dict.fromkeys(msg.ids)
        ids.update(dict.fromkeys(x.request_id for x in msg.texts))
        ids.update(dict.fromkeys(f.request_id for f in msg.finished))
        ids.update(dict.fromkeys(x.request_id for x in msg.started))
        ids.update(dict.fromkeys(x.request_id for x in msg.logprobs))
        ids.update(dict.fromkeys(x.request_id for x in msg.embeddings))
        return list(ids)
    return []
