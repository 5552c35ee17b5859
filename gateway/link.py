"""The gateway's connections to the broker, shared by every HTTP request.

A :class:`client.Client` is bound to one model name (its ``submit``
messages carry it), so the gateway holds one control connection (status
queries) and one client per model it has served, created on the first
request for that model: never one per HTTP request. Requests for a model
are multiplexed over its client; the broker batches them like any others.

A background task connects (retrying until a broker answers) and polls the
broker's status every ``status_interval_s``: the served models answer
``/v1/models`` and the 404/503 checks without a round trip per request.

A model served under several names (its workers' ``--served-model-name``)
answers to each: a request for an alias is one for its model (one shared
client, bound to the primary name); a response names the model as its
request did (as vLLM's do).
"""

from __future__ import annotations

import asyncio
import logging
import time

from client import BrokerUnavailable, Client, UnknownModelError
from gateway.config import GatewayConfig
from gateway.errors import APIError, bad_request, unavailable
from gateway.threads import on_a_daemon_thread
from protocol.messages import DemandState, ModelInfo, Status
from protocol.validation import clip

log = logging.getLogger(__name__)

CONTROL_MODEL = "simulated"
"""The model name of the control connection (a ``Client`` needs one); it also
serves requests for that model, so a simulated cluster needs one connection."""


def listing_order(names, aliases: dict[str, str]) -> list[str]:
    """``names`` in ``GET /v1/models``'s order (and the 404's): by model (its primary name), each
    model's primary name first and then its aliases in the order given (``aliases``: alias ->
    primary, the broker's status's and the models on demand's, :meth:`BrokerConnections.aliases`).
    A client that takes the first entry (vLLM's examples do) gets a primary name: a GGUF file's stem,
    not its path (``/models/m.gguf`` sorted before ``m``), and the first ``--served-model-name``, as
    vLLM lists them."""
    given = {a: i for i, a in enumerate(aliases)}
    return sorted(names, key=lambda n: (aliases.get(n, n), n in aliases, given.get(n, 0), n))


def not_found(model: str, names: dict[str, str], aliases: dict[str, str] | None = None) -> str:
    """The 404 message for ``model``, a name no worker serves nor any model on demand: the names a
    request may give (``names``: name -> ``"loaded"``, ``"loading"`` or ``"unloaded"``, as
    :meth:`BrokerConnections.model_not_found` gathers them), in :func:`listing_order` (``aliases``:
    alias -> primary), and, where one differs from ``model`` only in case, that one (model names are
    case-sensitive, as OpenAI's)."""
    listed = ", ".join(n if names[n] == "loaded" else f"{n} ({names[n]})"
                       for n in listing_order(names, aliases or {}))
    if not model:
        return f"The request names no model (an empty name): name one (models: {listed or 'none'})"
    same = [n for n in names if n.lower() == model.lower()]
    hint = f"; did you mean `{same[0]}`?" if same else ""
    return f"The model `{clip(model)}` does not exist: no slotserve worker serves it (models: {listed or 'none'}){hint}"


class BrokerConnections:
    """Connections, the last broker status, and per-model clients (event loop only)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.status: Status | None = None
        """The last status the broker answered, or None."""
        self.broker_ok = False
        """True while the last status query was answered."""
        self.started_s = int(time.time())
        self._control: Client | None = None
        self._clients: dict[str, Client] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._refreshing: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._first_try = asyncio.Event()
        """Set once the first try to reach the broker ended (its connect and status query, answered or
        not), or on close."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start connecting and polling in the background (returns at once)."""
        self._task = asyncio.create_task(self._maintain(), name="slotserve-gateway-link")

    async def close(self) -> None:
        """Stop polling and close every connection; the broker cancels what they still run."""
        self._closed = True
        self._first_try.set()  # (nothing waits for it any more)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        clients = list(self._clients.values()) + ([self._control] if self._control is not None else [])
        self._clients.clear()
        self._control = None
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, c.close) for c in clients))

    async def _maintain(self) -> None:
        while not self._closed:
            if self._control is None:
                try:
                    self._control = await _on_a_thread(self._new_client, CONTROL_MODEL, "gateway")
                    log.info("gateway connected to the broker at %s", self.config.broker)
                except BrokerUnavailable as e:
                    log.warning("%s (retrying)", e)
                    self._first_try.set()
                    continue  # the connect timeout paces the retries
                except Exception:  # noqa: BLE001 -- e.g. unreadable CURVE keys: say so, keep trying
                    log.exception("gateway cannot connect to the broker at %s (retrying)", self.config.broker)
                    self._first_try.set()
                    await asyncio.sleep(self.config.status_interval_s)
                    continue
            try:
                await self._refresh_now()
            except APIError:
                pass  # broker_ok is False; requests get 503 until it answers again
            except Exception:  # noqa: BLE001 -- the poller must survive anything
                log.exception("gateway status poll failed")
            self._first_try.set()
            await asyncio.sleep(self.config.status_interval_s)  # the poll interval (a period, not a wait on a condition)

    def _new_client(self, model: str, name: str) -> Client:
        c = Client(self.config.broker, model=model, connect_timeout_s=self.config.connect_timeout_s,
                   name=name, curve=self.config.curve)
        if self._closed:  # the gateway stopped while this connected: nobody will close it
            c.close()
            raise BrokerUnavailable("the gateway is stopping")
        return c

    # ------------------------------------------------------------------ status

    async def first_contact(self) -> None:
        """While the gateway's first try to reach the broker runs (it just started: the control
        connection still connecting, or its first status query in flight), wait for that try to
        end, up to ``connect_timeout_s`` and a status query's; at once after. So a request sent as
        soon as the HTTP port listens is served, not refused 503 "no broker" for the time the
        connection takes; with no broker there, requests get that 503 once the first try failed
        (and at once from then on)."""
        if self.status is not None or self._closed or self._first_try.is_set():
            return
        try:
            await asyncio.wait_for(self._first_try.wait(), 2 * self.config.connect_timeout_s)
        except TimeoutError:
            pass

    async def refresh(self) -> Status:
        """Ask the broker for its status now (concurrent callers share one query); before the first
        answer, wait for it (:meth:`first_contact`). Raises :class:`APIError` 503 when no broker answers."""
        if self._control is None:  # (still connecting: the answer comes from the connecting side's poll)
            await self.first_contact()
        return await self._refresh_now()

    async def _refresh_now(self) -> Status:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = _shared(asyncio.ensure_future(self._query_status()))
        return await asyncio.shield(self._refreshing)

    async def _query_status(self) -> Status:
        if self._control is None:
            raise self.no_broker()
        try:
            st = await _on_a_thread(self._control.status, self.config.connect_timeout_s)
        except BrokerUnavailable:
            self.broker_ok = False
            raise self.no_broker() from None
        except RuntimeError:
            if not self._closed:
                raise
            raise unavailable("the gateway is stopping") from None  # close() closed the client mid-query
        self.status, self.broker_ok = st, True
        return st

    def no_broker(self) -> APIError:
        """The 503 for "no broker answers"."""
        return unavailable(f"no slotserve broker answers at {self.config.broker}; start one (`slotserve up`) "
                           "or check the gateway's --broker")

    def served(self, status: Status | None = None) -> dict[str, int]:
        """The names of the models with at least one worker -> their worker count
        (from the last status), each alias as its model."""
        st = status or self.status
        if st is None:
            return {}
        served = {n: m.workers for n, m in st.models.items() if m.workers > 0}
        served.update({a: served[m] for a, m in st.aliases.items() if m in served})
        return served

    def model_states(self, status: Status | None = None) -> dict[str, str]:
        """Every model a request may name -> ``"loaded"`` (a worker serves it), ``"loading"`` (its
        first worker is starting: a model on demand, or one a worker was started for, as ``slotserve
        up`` starts) or ``"unloaded"`` (a model on demand that no worker runs now), from the last
        status; each alias as its model. A model on demand says the state the broker gives it
        (``status``'s ``on_demand``, :class:`~protocol.enums.ModelState`: ``"loading"`` from the moment
        its load is accepted, ``"unloading"`` from the moment its unload is, until either is done;
        :mod:`broker.demand`), not what its workers alone say."""
        st = status or self.status
        if st is None:
            return {}
        served = self.served(st)
        aliases = self.aliases(st)
        names = {**{n: n for n in st.models}, **st.aliases}  # every name -> its model's
        names.update({n: aliases.get(n, n) for n in self.config.on_demand_models})
        states = {}
        for name, primary in names.items():
            m = st.models.get(primary)
            if name in served:
                states[name] = "loaded"
            elif m is not None and m.loading:
                states[name] = "loading"
            elif name in self.config.on_demand_models:
                states[name] = "unloaded"
            else:
                continue
            demand = st.on_demand.get(primary)
            if demand is not None:
                states[name] = demand.state.value
        return states

    def demand_state(self, model: str, status: Status | None = None) -> DemandState | None:
        """The broker's :class:`~protocol.messages.DemandState` of ``model`` (any served name of a model
        on demand: its failed load's exit code and words too), None for a model not on demand."""
        st = status or self.status
        if st is None:
            return None
        return st.on_demand.get(self.aliases(st).get(model, model))

    async def order(self, action: str, model: str) -> Status:
        """Hand ``POST /models/load`` or ``/models/unload`` (``action`` ``"load"`` or ``"unload"``) of
        ``model`` (a served name of a model on demand) to the broker, which keeps it for the supervisor;
        its answer, a status showing the order's state (``loading``, ``unloading``), becomes the last
        status, so that every route (``/v1/models``, ``/metrics``, the 404's list) says it from now on.
        Raises :class:`APIError`: 503 when no broker answers, 400 when it does not take the order
        (``model`` is not on demand there)."""
        await self.first_contact()
        if self._control is None:
            raise self.no_broker()
        primary = self.aliases().get(model, model)
        try:
            st = await _on_a_thread(self._control.order, action, primary, self.config.connect_timeout_s)
        except BrokerUnavailable:
            self.broker_ok = False
            raise self.no_broker() from None
        except ValueError as e:
            raise bad_request(str(e), "model") from None
        except RuntimeError:
            if not self._closed:
                raise
            raise unavailable("the gateway is stopping") from None
        self.status, self.broker_ok = st, True
        return st

    def aliases(self, status: Status | None = None) -> dict[str, str]:
        """Every alias -> its model's primary name: the status's (the models whose workers registered
        them), and the models on demand's (``config.on_demand_aliases``: known before a worker of the
        model registers; the status's win where both name one)."""
        st = status or self.status
        return {**dict(self.config.on_demand_aliases), **({} if st is None else st.aliases)}

    def knows(self, model: str, status: Status) -> bool:
        """True when ``status`` lists ``model`` (or the model it is an alias of): served, loading, on
        demand, or served before. A request for a name it does not know is a 404
        (:meth:`model_not_found`); one for a known model without a worker now is not."""
        return status.aliases.get(model, model) in status.models

    def model_not_found(self, model: str, status: Status) -> APIError:
        """The 404 ``model_not_found`` for ``model``, a name ``status`` does not know (:meth:`knows`),
        the one every route answers: :func:`not_found`'s message over the names a request may give,
        :meth:`model_states`'s, in ``GET /v1/models``'s order (:func:`listing_order`)."""
        return APIError(404, not_found(model, self.model_states(status), self.aliases(status)), param="model",
                        code="model_not_found")

    def no_worker(self, model: str, status: Status | None = None) -> APIError:
        """The 503 for ``model``, a name ``status`` (default: the last) knows, that no worker serves
        right now, the one every route answers, saying why by its :meth:`model_states` state: its
        first worker is loading (on demand, or as ``slotserve up`` starts), a model on demand not
        loaded now (a generation request waits for it instead: only the tokenizer routes say so),
        or none (its workers left)."""
        state = self.model_states(status).get(model)
        on_demand = model in self.config.on_demand_models
        if state == "loading":
            how = "is loaded on demand and is loading now" if on_demand else \
                "is loading now (its first worker is starting)"
            return unavailable(f"model `{model}` {how}; retry when GET /v1/models says it is loaded")
        if state == "unloaded":
            return unavailable(f"model `{model}` is loaded on demand and is not loaded now: a generation request "
                               "or POST /models/load loads it (GET /v1/models says when); retry then")
        return unavailable(f"no worker serves model `{model}` right now; retry when one has registered")

    def only_model(self, status: Status | None = None) -> str | None:
        """The primary name of the one model a request may name (:meth:`models`), or None when none
        or several are: what a request that names no model is for, loaded or not (one loading is
        answered as a request naming it is). (Counting :meth:`served`'s names, a model served under
        a file's stem or folder's name and its path as given counted as two, and a request without
        a model was told to name one; counting the models with a worker alone, one loaded among
        several on demand took every such request, each time another.)"""
        models = self.models(status)
        return next(iter(models)) if len(models) == 1 else None

    def models(self, status: Status | None = None) -> set[str]:
        """The primary names of the models a request may name, as ``GET /v1/models`` lists them
        (:meth:`model_states`: served, loading, or on demand and not loaded), from the last status."""
        aliases = self.aliases(status)
        return {aliases.get(n, n) for n in self.model_states(status)}

    def served_name(self, model: str) -> str:
        """The primary name of the model a request for ``model`` is for (``model``
        itself unless it is an alias, as the last status says)."""
        st = self.status
        return model if st is None else st.aliases.get(model, model)

    def names_of(self, model: str) -> tuple[str, ...]:
        """The names ``model`` (a primary name) is served under, as the last status says: itself
        first, then its aliases (sorted)."""
        st = self.status
        return (model,) + tuple(sorted(a for a, m in ({} if st is None else st.aliases).items() if m == model))

    def model_info(self, model: str) -> ModelInfo | None:
        """What the model's workers registered (vocabulary, context, EOS tokens), if known:
        from the model's own client, else from the control connection, whose broker
        welcomes list every served model (so it is known before the model's first request)."""
        model = self.served_name(model)
        for c in (self._clients.get(model), self._control):
            info = None if c is None else c.models.get(model)
            if info is not None:
                return info
        return None

    # ------------------------------------------------------------------ per-model clients

    async def client_for(self, model: str) -> Client:
        """The shared client for ``model`` (for an alias, its model's). Raises
        :class:`APIError`: 503 when no broker answers or no worker serves
        ``model`` right now, 404 when the broker has never had a worker for it."""
        await self.first_contact()
        if not self.broker_ok:
            raise self.no_broker()
        model = self.served_name(model)
        c = self._clients.get(model)
        st = self.status
        known = st is not None and model in st.models
        if not known or st.models[model].workers == 0:
            st = await self.refresh()  # the last poll may predate the model's first worker
            model = st.aliases.get(model, model)
            c = self._clients.get(model)
            if model not in st.models:
                raise self.model_not_found(model, st)
            if st.models[model].workers == 0 and model not in self.config.on_demand_models:
                raise self.no_worker(model, st)
        if c is not None:
            return c
        if model == CONTROL_MODEL and self._control is not None:
            # registered after the control connected: fetch its info -- unless it is a model on demand,
            # whose requests wait in its queue while it loads, as any other model on demand's
            if model not in self._control.models and model not in self.config.on_demand_models:
                try:
                    await _on_a_thread(self._control.wait_for_model, self.config.connect_timeout_s)
                except (TimeoutError, UnknownModelError):  # (its workers left since the status)
                    raise self.no_worker(model) from None
            return self._control
        fut = self._connecting.get(model)
        if fut is None:
            fut = self._connecting[model] = _shared(_on_a_thread(self._new_client, model, "gateway"))
        try:
            c = await asyncio.shield(fut)
        except BrokerUnavailable:
            raise self.no_broker() from None
        finally:
            if fut.done():
                self._connecting.pop(model, None)
        self._clients.setdefault(model, c)
        return self._clients[model]


def _shared(fut: asyncio.Future) -> asyncio.Future:
    """``fut``, awaited through ``asyncio.shield`` by whoever needs it: its exception is marked read
    when it ends, since every waiter may be gone by then (cancelled, or the gateway stopping: a
    status query or a connect that close() ended), and asyncio would otherwise log "exception was
    never retrieved" at ERROR. The waiters still get the exception."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def _on_a_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread (:func:`gateway.threads.on_a_daemon_thread`): the calls that
    wait on the broker (connect, status, wait_for_model: up to ``connect_timeout_s`` each), which on
    the loop's default executor held a stopping gateway for that long (the broker down, a status query
    out). Closing the clients ends status and wait_for_model at once; a connect in flight ends at its
    timeout, after the gateway is gone."""
    return on_a_daemon_thread(fn, *args, name="slotserve-gateway-broker-call")


async def resolve_model(link, model: str | None) -> str:
    """``model`` as a request named it, else the one model ``link`` (a :class:`BrokerConnections`)
    serves (:meth:`~BrokerConnections.only_model`), as llama.cpp (which ignores the field) and vLLM
    (which defaults it to the served model) do. Raises :class:`APIError` 400
    ``missing_required_parameter`` naming each model a request may name when several are (models on
    demand too, loaded or not: :meth:`~BrokerConnections.models`), 503 when none is, or when no broker
    answers (:meth:`~BrokerConnections.no_broker`: a request naming a model is told the same)."""
    if model is not None:
        return model
    await link.first_contact()  # (a gateway that just started: what is served is not known yet)
    only = link.only_model()
    if only is not None:
        return only
    models = link.models()
    if not models:
        if not link.broker_ok:  # (no status: "no worker serves a model" blamed the workers)
            raise link.no_broker()
        raise unavailable("no worker serves a model right now; retry, or name the model")
    raise bad_request(f"model is required: this gateway serves several ({', '.join(sorted(models))})", "model",
                      "missing_required_parameter")
