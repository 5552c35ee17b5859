"""What handling one event makes the broker send: :class:`Send` actions.

The broker's core never touches a socket: each event (a message, a tick, a
failure the socket loop reports) fills one :class:`Outbox`, whose
:meth:`Outbox.done` gives the list of sends for :mod:`broker.server` to
perform. A client's tokens, texts and endings from one event travel in one
``results`` message (docs/architecture.md, "The distributed system": the
message rate follows iterations, not tokens).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.codec import encode
from protocol.messages import Cancel, EmbeddingVector, Finished, Logprobs, Message, Results, Started, Text
from protocol.request import RequestId


class Side(enum.Enum):
    """Which broker socket a message goes out on."""

    FRONTEND = "frontend"  # clients
    BACKEND = "backend"    # workers


@dataclass(frozen=True, slots=True)
class Send:
    """An action: send ``message`` to the peer ``identity`` on socket ``side``."""

    side: Side
    identity: bytes
    message: Message


class ResultsDraft:
    """The parts of one client's ``results`` message while an event is handled."""

    __slots__ = ("ids", "tokens", "texts", "finished", "started", "logprobs", "embeddings")

    def __init__(self) -> None:
        self.ids: list[RequestId] = []
        self.tokens: list[int] = []
        self.texts: list[Text] = []
        self.finished: list[Finished] = []
        self.started: list[Started] = []
        self.logprobs: list[Logprobs] = []
        self.embeddings: list[EmbeddingVector] = []


class Outbox:
    """Collects one event's sends; results are grouped into one message per
    client, sent after everything else (:meth:`done`)."""

    __slots__ = ("sends", "results")

    def __init__(self) -> None:
        self.sends: list[Send] = []
        self.results: dict[bytes, ResultsDraft] = {}

    def result(self, client: bytes) -> ResultsDraft:
        """The draft of ``client``'s ``results`` message (started if need be)."""
        r = self.results.get(client)
        if r is None:
            r = self.results[client] = ResultsDraft()
        return r

    def send(self, side: Side, identity: bytes, message: Message) -> None:
        """Send ``message`` to ``identity`` on ``side`` (in order, before every ``results``)."""
        self.sends.append(Send(side, identity, message))

    def cancels(self, to_workers: dict[bytes, list[int]]) -> None:
        """Send each worker one ``cancel`` naming the broker keys gathered for it."""
        for w, keys in to_workers.items():
            self.sends.append(Send(Side.BACKEND, w, Cancel(tuple(keys))))

    def done(self) -> list[Send]:
        """Every send of the event, each client's ``results`` last."""
        for client, r in self.results.items():
            self.sends.append(Send(Side.FRONTEND, client, Results(
                tuple(r.ids), tuple(r.tokens), tuple(r.texts), tuple(r.finished), tuple(r.started),
                tuple(r.logprobs), tuple(r.embeddings))))
        return self.sends


def encoded_size(msg: Message) -> int:
    """``msg``'s length on the wire (bytes); 0 when it cannot be encoded (the
    socket loop finds and reports that itself)."""
    try:
        return len(encode(msg))
    except Exception:  # noqa: BLE001 -- see above
        return 0
