"""A :class:`~broker.core.BrokerCore` for the socket-free broker tests, the peers'
identities they use, and what to read from the sends it returns."""

from __future__ import annotations

from broker.config import BrokerConfig
from broker.core import BrokerCore
from broker.outbox import Send, Side
from protocol.messages import Assign, Envelope, ModelInfo

C1, C2 = b"client-1", b"client-2"
W1, W2 = b"worker-1", b"worker-2"
INFO = ModelInfo(1000, None, (0,), False)  # what a test worker registers with


def make_core(*, identity: str = "broker-A", **config) -> BrokerCore:
    """A broker core named ``identity`` at time 0.0; ``config``: BrokerConfig fields.
    A test module with its own defaults binds them with ``functools.partial``."""
    return BrokerCore(BrokerConfig(**config), identity, now=0.0)


def sent(sends: list[Send], side: Side | None = None, identity: bytes | None = None, kind=None):
    """The messages of ``sends`` to ``side`` / ``identity`` / of type ``kind`` (None: any)."""
    return [s.message for s in sends
            if (side is None or s.side is side) and (identity is None or s.identity == identity)
            and (kind is None or isinstance(s.message, kind))]


def assigned(sends, w=W1) -> list[Envelope]:
    """The requests ``sends`` assign to worker ``w``, in order."""
    return [r for m in sent(sends, Side.BACKEND, w, Assign) for r in m.requests]
