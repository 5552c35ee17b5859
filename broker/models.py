"""The models the broker knows, and what its ``welcome`` tells peers about them.

A model is *served* once a worker registered it (it stays known after its
workers leave: its requests wait for the next one) and *loading* while a
worker announced it and has not registered yet. Requests for a model that
is neither end ``unknown_model`` -- except within the start-up grace
(``register_grace_s``), when workers may still be on their way.
"""

from __future__ import annotations

from collections.abc import Collection

from broker.config import BrokerConfig
from broker.jobs import JobTable
from broker.outbox import Outbox, Side
from broker.registry import WorkerRegistry
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import ModelInfo, Register, Welcome


class ServedModels:
    """Served and loading models, the start-up grace, and the welcomes.

    ``served``: model -> the info its last registering worker gave.
    ``clients``: the identities of the clients to tell when the models
    served or loading change (the core's client table: its keys).
    """

    def __init__(self, config: BrokerConfig, broker_id: str, now: float, registry: WorkerRegistry,
                 jobs: JobTable, clients: Collection[bytes]) -> None:
        self.config = config
        self.broker_id = broker_id
        self.started_s = now
        self.served: dict[str, ModelInfo] = {}
        self.grace_over = config.register_grace_s == 0
        self._registry = registry
        self._jobs = jobs
        self._clients = clients
        self._view = self.view()  # what clients were last told (welcome)

    def known(self, model: str) -> bool:
        """Requests for ``model`` wait for a worker: one registered it once, or one is loading it."""
        return model in self.served or any(lw.model == model for lw in self._registry.loading.values())

    def view(self) -> tuple[dict[str, ModelInfo], tuple[str, ...]]:
        """The models served (a copy) and those only being loaded (sorted)."""
        loading = tuple(sorted(set(self._registry.loading_models()) - set(self.served)))
        return dict(self.served), loading

    def unknown(self, model: str) -> str:
        """The ``unknown_model`` message for ``model``: what is there, what to do."""
        served, loading = self.view()
        return (f"no worker serves or loads model {model!r} (served: {', '.join(sorted(served)) or 'none'}; "
                f"loading: {', '.join(loading) or 'none'}); start one (slotserve worker --model {model}) "
                "or check the name")

    def welcome(self, now: float, registering: Register | None = None) -> Welcome:
        """The welcome to send now; with ``registering``, the one its worker gets
        once its registration is accepted (its model served, with its info)."""
        models, loading = self.view()
        if registering is not None:
            models[registering.model] = registering.info
            loading = tuple(m for m in loading if m != registering.model)
        grace_left = 0.0 if self.grace_over else max(0.0, self.config.register_grace_s - (now - self.started_s))
        return Welcome(self.broker_id, self.config.heartbeat_interval_s, models, self.config.max_message_bytes,
                       loading, grace_left)

    def tell_clients(self, now: float, out: Outbox) -> None:
        """The models served or loading changed: send every client a fresh
        ``welcome`` (so ``Client.wait_for_model`` waits without asking)."""
        view = self.view()
        if view == self._view:
            return
        self._view = view
        welcome = self.welcome(now)
        for identity in self._clients:
            out.send(Side.FRONTEND, identity, welcome)

    def end_grace(self, now: float, out: Outbox) -> None:
        """Once the start-up grace is over, requests for models nobody serves or loads end."""
        if not self.grace_over and now - self.started_s >= self.config.register_grace_s:
            self.grace_over = True
            self.fail_unknown(out, "the broker's start-up grace is over")

    def fail_unknown(self, out: Outbox, why: str) -> None:
        """End requests still waiting for a model that no worker registered or
        loads (``unknown_model``; ``why``: what changed, for the message)."""
        queues = self._jobs.queues
        for model in [m for m in queues if not self.known(m)]:
            q = queues.pop(model)
            text = f"{why}: {self.unknown(model)}"
            while (job := q.pop()) is not None:
                self._jobs.finish(job, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, text, out)
