"""The models the broker knows, and what its ``welcome`` tells peers about them.

A model is *served* once a worker registered it (it stays known after its
workers leave: its requests wait for the next one) and *loading* while a
worker announced it and has not registered yet. Requests for a model that
is neither end ``unknown_model`` -- except within the start-up grace
(``register_grace_s``), when workers may still be on their way.

Served names: a worker may announce *aliases* beside its model's name (its
``--served-model-name`` list; the model's name is the first, the primary).
The broker keeps one queue per model, under the primary name: a request for
an alias is queued as one for its model (:meth:`ServedModels.resolve`). A
name means one model only: an alias that is already another model's name or
alias is ignored (with a warning), and a model's own name outranks an alias
claimed for it earlier. Aliases stay known as long as their model does.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from broker.config import BrokerConfig
from broker.jobs import JobTable
from broker.outbox import Outbox, Side
from broker.registry import WorkerRegistry
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import ModelInfo, Register, Welcome
from protocol.validation import echo, start_hint

log = logging.getLogger(__name__)


class ServedModels:
    """Served and loading models, their aliases, the start-up grace, and the welcomes.

    ``served``: model -> the info its last registering worker gave.
    ``aliases``: alias -> the (primary) name of its model.
    ``clients``: the identities of the clients to tell when the models
    served or loading change (the core's client table: its keys).
    """

    def __init__(self, config: BrokerConfig, broker_id: str, now: float, registry: WorkerRegistry,
                 jobs: JobTable, clients: Collection[bytes]) -> None:
        self.config = config
        self.broker_id = broker_id
        self.started_s = now
        self.served: dict[str, ModelInfo] = {}
        self.aliases: dict[str, str] = {}
        self.grace_over = config.register_grace_s == 0
        self.load_failures: dict[str, str] = {}
        """Model (on demand) -> why its last load failed, as its worker said (:meth:`fail_load`); forgotten
        when a worker loads or registers it again (:meth:`claim`)."""
        self._registry = registry
        self._jobs = jobs
        self._clients = clients
        self._view = self.view()  # what clients were last told (welcome)

    def resolve(self, name: str) -> str:
        """The model a request for ``name`` is for: its primary name when ``name`` is an alias."""
        return self.aliases.get(name, name)

    def known(self, model: str) -> bool:
        """Requests for ``model`` (a name or an alias) wait for a worker: one registered
        it once, one is loading it, or a supervisor loads it on demand (``on_demand_models``)."""
        model = self.aliases.get(model, model)
        return model in self.served or model in self.config.on_demand_models or \
            any(lw.model == model for lw in self._registry.loading.values())

    def view(self) -> tuple[dict[str, ModelInfo], tuple[str, ...], dict[str, str]]:
        """The models served (a copy), those only being loaded (sorted), and the
        aliases of both (:meth:`known_aliases`)."""
        loading = tuple(sorted(set(self._registry.loading_models()) - set(self.served)))
        return dict(self.served), loading, self.known_aliases()

    def known_aliases(self) -> dict[str, str]:
        """The aliases of the models served or loading (a copy): alias -> model."""
        loading = self._registry.loading_models()
        return {a: m for a, m in self.aliases.items() if m in self.served or m in loading}

    def unknown(self, model: str) -> str:
        """The ``unknown_model`` message for ``model``: what is there, what to do."""
        served, loading, aliases = self.view()
        names = sorted(served) + sorted(a for a, m in aliases.items() if m in served)
        there = f"served: {', '.join(names) or 'none'}; loading: {', '.join(loading) or 'none'}"
        if not model:
            return f"the request names no model (an empty name); name one ({there})"
        return f"no worker serves or loads model {echo(model)} ({there}); {start_hint(model)} or check the name"

    def welcome(self, now: float, registering: Register | None = None) -> Welcome:
        """The welcome to send now; with ``registering``, the one its worker gets
        once its registration is accepted (its model served, with its info and aliases)."""
        models, loading, aliases = self.view()
        if registering is not None:
            models[registering.model] = registering.info
            loading = tuple(m for m in loading if m != registering.model)
            aliases.update(self._claimable(registering.model, registering.aliases, warn=False))
        grace_left = 0.0 if self.grace_over else max(0.0, self.config.register_grace_s - (now - self.started_s))
        return Welcome(self.broker_id, self.config.heartbeat_interval_s, models, self.config.max_message_bytes,
                       loading, grace_left, aliases, self.config.on_demand_models)

    def claim(self, model: str, aliases: tuple[str, ...], worker: str, out: Outbox) -> None:
        """A worker loads or registers ``model`` under ``aliases`` too: each
        alias that names no other model becomes one of ``model``'s, and
        requests queued under it meanwhile (within the start-up grace) join
        ``model``'s queue; ``model``'s own name stops being another's alias. A failed load of
        ``model`` noted before is forgotten (this one is another)."""
        self.load_failures.pop(model, None)
        if self.aliases.get(model) is not None:
            log.warning("worker %s serves model %r, until now an alias of model %r: the name means its own "
                        "model from now on", worker, model, self.aliases[model])
            del self.aliases[model]
        for alias, target in self._claimable(model, aliases, worker=worker).items():
            self.aliases[alias] = target
            self._jobs.merge(alias, target, out)

    def _claimable(self, model: str, aliases: tuple[str, ...], *, warn: bool = True,
                   worker: str = "") -> dict[str, str]:
        """The aliases of ``aliases`` that ``model`` may have: not another model's
        name (served or loading), nor another model's alias (nor empty, nor ``model``)."""
        models = set(self.served) | {lw.model for lw in self._registry.loading.values()}
        taken = {}
        for alias in aliases:
            if not alias or alias == model:
                continue
            other = alias if alias in models else self.aliases.get(alias, model)
            if other != model:
                if warn:
                    log.warning("worker %s serves model %r as %r too, but that name is %s: ignored", worker, model,
                                alias, f"model {alias!r}" if other == alias else f"an alias of model {other!r}")
                continue
            taken[alias] = model
        return taken

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

    def restart_grace(self, now: float, since_s: float = float("-inf")) -> None:
        """A start-up grace not over yet starts again at ``now`` (monotonic): the workers it waits for
        get a whole ``register_grace_s`` after the broker's own stall -- once (unless it started after
        ``since_s``, the previous stall's end: a slow broker's grace still ends)."""
        if not self.grace_over and self.started_s > since_s:
            self.started_s = now

    def end_grace(self, now: float, out: Outbox) -> None:
        """Once the start-up grace is over, requests for models nobody serves or loads end."""
        if not self.grace_over and now - self.started_s >= self.config.register_grace_s:
            self.grace_over = True
            self.fail_unknown(out, "the broker's start-up grace is over")

    def fail_load(self, model: str, why: str, out: Outbox) -> None:
        """A worker of ``model`` (on demand) said goodbye while loading it, or can never register
        it -- its load failed: its supervisor stops a loading worker only when everything stops
        (one that dies says nothing: :meth:`load_died`). Unless another worker serves or loads it,
        the requests waiting for it end ``worker_failed`` with ``why`` (rather than waiting, their
        demand loading it again and again), and ``why`` is noted (:attr:`load_failures`: the words of
        its failed state in ``status``'s ``on_demand``)."""
        if self._serving_or_loading(model):
            return
        self.load_failures[model] = why
        for name in [model] + [a for a, m in self.aliases.items() if m == model]:
            q = self._jobs.queues.pop(name, None)
            while q is not None and (job := q.pop()) is not None:
                self._jobs.finish(job, FinishReason.ERROR, ErrorCode.WORKER_FAILED,
                                  f"{why}; see the server's log, fix the model or remove it", out)

    def load_died(self, model: str, worker: str, out: Outbox) -> None:
        """``worker``, loading ``model`` (on demand), fell silent past its liveness window: it died
        without a goodbye (SIGKILL, the OOM killer) or froze, and the broker dropped it. Unless
        another worker serves or loads ``model``, each request waiting for it counts a failed
        attempt, as one lost with a worker does (``Job.attempts``): one at ``max_attempts`` ends
        ``worker_failed`` saying so, the others wait for the next load. So a model whose every load
        dies fails its requests after ``max_attempts`` loads (its supervisor's back-off between
        them) rather than keeping them, and reloading itself for them, forever; while a load that
        froze once (its supervisor kills it and loads the model again) still serves them."""
        if self._serving_or_loading(model):
            return
        limit = self.config.max_attempts
        queues = self._jobs.queues
        ending = []
        for name in [model] + [a for a, m in self.aliases.items() if m == model]:
            q = queues.get(name)
            for job in list(q) if q else ():
                job.attempts += 1
                if job.attempts >= limit:
                    q.remove(job)
                    ending.append(job)
        for job in sorted(ending, key=lambda j: j.key):  # (arrival order)
            self._jobs.finish(job, FinishReason.ERROR, ErrorCode.WORKER_FAILED, (
                f"the worker loading model {model!r} ({worker}) fell silent while loading it: it died or was "
                f"killed (out of memory?) or froze; {job.attempts} loads failed so while this request waited; "
                "see the server's log (and the kernel's, for the OOM killer), free memory or fix the model"), out)

    def _serving_or_loading(self, model: str) -> bool:
        """A worker serves ``model`` (registered) or is loading it."""
        return bool(self._registry.for_model(model)) or model in self._registry.loading_models()

    def fail_unknown(self, out: Outbox, why: str) -> None:
        """End requests still waiting for a model that no worker registered or
        loads (``unknown_model``; ``why``: what changed, for the message)."""
        queues = self._jobs.queues
        for model in [m for m in queues if not self.known(m)]:
            q = queues.pop(model)
            text = f"{why}: {self.unknown(model)}"
            while (job := q.pop()) is not None:
                self._jobs.finish(job, FinishReason.ERROR, ErrorCode.UNKNOWN_MODEL, text, out)
