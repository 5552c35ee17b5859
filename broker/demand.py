"""The models on demand as the broker shows them (``status``'s ``on_demand``), and the orders for them.

Which model loads is the supervisor's decision (``slotserve up``'s, :mod:`slotserve.on_demand`);
the broker is where everyone looks (the gateway's ``GET /v1/models`` and ``/metrics``,
``slotserve status``). Between two of the supervisor's passes (0.2 s apart, and a worker's
process takes seconds to announce its load) the broker knows things the supervisor has not said
yet, so a model's state here is, in order:

1. the supervisor's last word (its ``demand`` message: each model's
   :class:`~protocol.messages.DemandState`), ``unloaded`` before it spoke;
2. with the orders it has not taken yet (``model_order``: ``POST /models/load|unload``) applied,
   the last one per model: a load makes an ``unloaded`` or ``loading`` model ``loading``, an unload
   a ``loaded`` or ``loading`` one ``unloading``; a load of a model ``unloading`` leaves it so (the
   supervisor says next whether it stays or loads again), and an order that changes nothing
   (a load of a loaded model, an unload of an unloaded one) changes nothing;
3. with what the broker saw since: a model ``loading`` that a worker registered is ``loaded``; a
   model ``loaded`` whose workers all left is ``loading`` if requests wait for it (the supervisor
   loads it again), else ``unloaded``; a model ``unloaded`` with requests waiting is ``loading``
   (a request for a model not loaded loads it: its load is accepted with the request), unless it
   failed for want of memory (``failed`` with no exit code: it waits for room, as its requests do).

So a load or an unload shows in every ``status`` from the moment it is accepted, and a load that
fails ends ``unloaded`` with ``failed`` (and the worker's exit code, and why: the words of the worker
that said goodbye while loading, as the broker heard them, else the supervisor's) once the supervisor
saw it end --
never ``loading`` for good. No clock or socket here: :class:`~broker.core.BrokerCore` feeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from protocol.enums import ModelAction, ModelState
from protocol.messages import Demand, DemandState, ModelOrder, ModelStatus, PendingOrder
from protocol.validation import echo

log = logging.getLogger(__name__)

__all__ = ["DemandBoard"]

_UNLOADED = DemandState(ModelState.UNLOADED)


class DemandBoard:
    """The orders not taken yet and the supervisor's last word, for the models of ``on_demand``
    (the broker's ``on_demand_models``: every served name of each). ``broker_id``: this broker's
    (a ``demand`` read from another broker's status says nothing of this one's orders).
    ``resolve(name)``: the model a served name is for, as the broker knows it (its registered
    aliases); ``load_failures``: model -> why its last load failed, as the broker heard it (a
    worker's goodbye while loading), read for the words of a failed state."""

    def __init__(self, on_demand: tuple[str, ...], broker_id: str, resolve=lambda name: name,
                 load_failures: Mapping[str, str] | None = None) -> None:
        self._on_demand = frozenset(on_demand)
        self._broker_id = broker_id
        self._resolve_registered = resolve
        self._load_failures = {} if load_failures is None else load_failures
        self._seq = 0
        self._pending: dict[str, PendingOrder] = {}  # model (as resolved when ordered) -> its last order
        self._said: dict[str, DemandState] = {}  # the supervisor's last word: model -> its state
        self._aliases: dict[str, str] = {}  # the supervisor's: alias -> model

    def resolve(self, name: str) -> str:
        """The primary name of the model on demand ``name`` is a served name of."""
        return self._aliases.get(name) or self._resolve_registered(name)

    def aliases(self) -> dict[str, str]:
        """The supervisor's ``{alias: model}`` of the models on demand (empty before it first spoke)."""
        return dict(self._aliases)

    def primaries(self) -> tuple[str, ...]:
        """The names on demand that are a model's own (not an alias of another), sorted: before the
        supervisor's first word, every name not registered as an alias."""
        return tuple(n for n in sorted(self._on_demand) if self.resolve(n) == n)

    def order(self, msg: ModelOrder) -> PendingOrder | None:
        """Keep ``msg`` for the supervisor (replacing the model's order not taken yet: the last order
        wins); None, logged, for a model that is not on demand here."""
        if msg.model not in self._on_demand and msg.model not in self._aliases:
            log.warning("an order to %s model %s ignored: it is not a model on demand here (%s)", msg.action,
                        echo(msg.model), ", ".join(sorted(self._on_demand)) or "none")
            return None
        self._seq += 1
        model = self.resolve(msg.model)
        self._pending.pop(model, None)  # (re-inserted: the dict stays in order of seq)
        order = self._pending[model] = PendingOrder(self._seq, msg.action, msg.model)
        return order

    def said(self, msg: Demand) -> None:
        """The supervisor's ``demand``: its states replace the last ones; the orders it took (this
        broker's, up to ``orders_taken``) are no longer pending. Anyone may send one (the supervisor is a
        client as another): one that says it took an order this broker never gave (``orders_taken`` past
        the last ``seq``: no supervisor's, which takes the orders of a ``status``) is ignored, and the
        states and aliases of names that are no model on demand here are left out (both logged)."""
        if msg.broker_id == self._broker_id and msg.orders_taken > self._seq:
            log.warning("a demand ignored: it says it took orders up to %d, and the last order here is %d",
                        msg.orders_taken, self._seq)
            return
        strangers = sorted({*msg.models, *msg.aliases, *msg.aliases.values()} - self._on_demand)
        if strangers:
            log.warning("a demand names %s, no model on demand here (%s): left out", ", ".join(map(echo, strangers)),
                        ", ".join(sorted(self._on_demand)) or "none")
        self._said = {m: st for m, st in msg.models.items() if m in self._on_demand}
        self._aliases = {a: m for a, m in msg.aliases.items() if a in self._on_demand and m in self._on_demand}
        if msg.broker_id == self._broker_id:
            self._pending = {m: o for m, o in self._pending.items() if o.seq > msg.orders_taken}

    def pending(self) -> tuple[PendingOrder, ...]:
        """The orders the supervisor has not taken yet, oldest first."""
        return tuple(self._pending.values())

    def states(self, lines: Mapping[str, ModelStatus]) -> dict[str, DemandState]:
        """Each model on demand (primary name) -> its state now (see the module docstring), given
        the broker's ``lines`` (``status``'s models: a model's requests for an alias queue under
        the alias until a worker claims it, so a model's line sums its names')."""
        models = set(self._said) or {n for n in self._on_demand if self.resolve(n) == n}
        folded: dict[str, list[int]] = {m: [0, 0, 0, 0] for m in models}
        for name, line in lines.items():
            sums = folded.get(self.resolve(name))
            if sums is not None:
                for i, v in enumerate((line.queued, line.running, line.workers, line.loading)):
                    sums[i] += v
        orders: dict[str, list[PendingOrder]] = {}
        for o in self._pending.values():
            orders.setdefault(self.resolve(o.model), []).append(o)
        return {m: self._state(m, *folded[m], orders.get(m, ())) for m in sorted(models)}

    def _state(self, model: str, queued: int, running: int, workers: int, loading: int,
               orders: list[PendingOrder]) -> DemandState:
        said = self._said.get(model, _UNLOADED)
        state = said.state
        for o in orders:
            if o.action is ModelAction.LOAD and state is ModelState.UNLOADED:
                state = ModelState.LOADING
            elif o.action is ModelAction.UNLOAD and state in (ModelState.LOADED, ModelState.LOADING):
                state = ModelState.UNLOADING
        busy = queued > 0 or running > 0
        if state is ModelState.LOADING and workers:
            state = ModelState.LOADED
        elif state is ModelState.LOADED and not orders and not workers and not loading:  # its workers left
            state = ModelState.LOADING if busy else ModelState.UNLOADED
        elif state is ModelState.UNLOADED:
            refused = said.failed and said.exit_code is None  # (it does not fit now: it waits for room)
            state = ModelState.LOADED if workers else ModelState.LOADING if loading or (busy and not refused) \
                else state
        if state is not ModelState.UNLOADED:
            return DemandState(state)
        if said.state is ModelState.UNLOADED and said.failed:
            words = self._load_failures.get(model) if said.exit_code is not None else None  # (its worker's own)
            return said._replace(reason=words) if words else said
        return _UNLOADED
