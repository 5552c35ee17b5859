"""The slotserve broker: per-model queues, a worker registry with credits,
dispatch, result routing and request migration (see docs/architecture.md,
"The distributed system").

``run_broker(BrokerConfig(...))`` runs one; :class:`BrokerCore` holds every
decision and is usable without sockets.
"""

from broker.config import DEFAULT_BACKEND, DEFAULT_FRONTEND, BrokerConfig
from broker.core import BrokerCore
from broker.outbox import Send, Side
from broker.server import BrokerServer, run_broker

__all__ = ["BrokerConfig", "BrokerCore", "BrokerServer", "DEFAULT_BACKEND", "DEFAULT_FRONTEND",
           "Send", "Side", "run_broker"]
