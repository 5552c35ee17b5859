"""Models loaded on demand and unloaded when idle (issue 34, item 1): the decisions, as a pure core.

What llama.cpp's router mode (``--models-max``, ``--sleep-idle-seconds``), Ollama
(``OLLAMA_MAX_LOADED_MODELS``, ``keep_alive``) and llama-swap do, over
slotserve's broker: the broker keeps one queue per model, and requests for a
model of ``BrokerConfig.on_demand_models`` wait in it while no worker serves
the model. A supervisor (``slotserve up`` with several models:
:class:`slotserve.launcher.LocalCluster`) polls the broker's ``status`` and
feeds it to :class:`OnDemand`, which says what to do; the supervisor starts or
stops the worker processes. No clock, process or socket here: every decision
is tested on made-up statuses (tests/cli/test_on_demand.py).

The rules, each pass (:meth:`OnDemand.decide`):

- A model is *wanted* when requests for it are queued or running (status),
  or :meth:`OnDemand.want` asked for it (``POST /models/load``) and it has
  not loaded since (then it is as any loaded model: idle until used); *busy*
  while requests for it are queued or running; *idle* otherwise, since the
  last pass it was busy (``last_used_s``).
- A wanted model that is not loaded (no worker registered, none starting) is
  loaded when fewer than ``max_loaded`` models are loaded or loading and its
  memory estimate fits in what the machine has available; else the least
  recently used *idle* loaded model is unloaded first (its memory then
  counts as available). A busy model is never unloaded (the issue's rule,
  and Ollama's): the wanted model waits, its requests queued, until one
  becomes idle -- so steady traffic for one model can keep another waiting
  as long as it lasts (up to the requests' deadlines). ``turn_s`` (None by
  default: off) changes that: once requests for a model have waited
  ``turn_s`` seconds, the busy model loaded longest, if loaded ``turn_s``
  itself, is unloaded (its requests go back to the broker's queue with the
  tokens they have, as on any worker's goodbye, and wait their turn behind).
- A model whose estimate exceeds what even unloading every idle model
  would free is *refused* (:class:`Refuse`, once until its demand ends or it
  fits): the supervisor says why in its log and ``slotserve status``; its
  requests wait for their deadline rather than an OOM kill of the machine.
  From the pass in which it fits (a model that was loading became idle, and
  is unloaded for it) it is waiting for room, as any wanted model: not refused.
- A loaded model idle for ``idle_unload_s`` seconds is unloaded (0: never,
  as Ollama's ``keep_alive: -1``).
- A model whose worker exited before it registered (its load failed, or it was killed) is
  not loaded again for a while (:meth:`OnDemand.failed`: 1 s, doubling with each failure in a
  row, at most ``MAX_RETRY_S``), and a ``POST /models/load`` order for it is dropped: a model
  that cannot load is not reloaded in a loop. (The broker ends the requests waiting for it
  when its worker said why it stopped; a worker that died silently while loading, which the
  broker drops once it is silent past its liveness window, costs each waiting request a failed
  attempt, so they end ``worker_failed`` at ``max_attempts`` such loads: ``ServedModels.load_died``;
  one that died before it announced its load is announced by the supervisor for it.)
- Wanted models are served oldest demand first (the order in which they
  became wanted), so alternating requests for two models with room for one
  take turns instead of starving one.
- What everyone is told (:meth:`OnDemand.published`, which the supervisor sends the broker after
  each pass): ``loading`` from the moment a load is wanted until its worker registers (waiting for
  room or a back-off included), ``unloading`` from the moment an unload is asked for until its
  worker is gone, and a failed load ``unloaded`` with ``failed`` -- never ``loading`` for good.
- A stall of the supervisor's own loop (:meth:`OnDemand.stalled`: the whole
  ``slotserve up`` SIGSTOPped, a suspended laptop or VM) counts as neither idle
  time nor time waited for a turn: nobody used a model or was served while it
  lasted, and its first pass may not see yet the requests that queued up (so
  an idle model is not unloaded, nor a busy one for a turn, on waking). The
  back-off of a failed load counts it (waking, a model may load at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.enums import ModelState
from protocol.messages import DemandState, Status
from protocol.validation import as_seconds

__all__ = ["Load", "OnDemand", "Refuse", "Unload", "estimate_bytes"]

DEFAULT_IDLE_UNLOAD_S = 300.0
"""Ollama's default ``keep_alive`` (5 minutes)."""

DEFAULT_TURN_S = None
"""No turns by default: a busy model is never unloaded. A value for ``turn_s`` should be long against
a load (~2-6 s for SmolLM2-135M and Qwen2.5-Coder-0.5B, bench/on_demand.py), e.g. 30 s, so that
alternating traffic is not all loading."""


MAX_RETRY_S = 60.0
"""The longest wait before a model whose loads keep failing is tried again (seconds)."""


@dataclass(frozen=True)
class Load:
    """Start a worker for ``model``."""

    model: str


@dataclass(frozen=True)
class Unload:
    """Stop ``model``'s workers (``why``: idle for long, or room for another model)."""

    model: str
    why: str


@dataclass(frozen=True)
class Refuse:
    """``model`` cannot be loaded on this machine now (``why`` says what it needs and what there is)."""

    model: str
    why: str


@dataclass
class _Model:
    need_bytes: int
    state: str = "unloaded"  # unloaded | loading | loaded
    last_used_s: float = float("-inf")
    wanted_since: float | None = None
    loaded_since: float | None = None  # when its worker registered (the start of its turn)
    waiting: bool = False  # requests for it are queued or running
    asked: bool = False  # want() was called and no request came yet
    drop: bool = False  # release() was called: unload it once idle
    refused: bool = False
    refused_why: str = ""  # why it was refused (its Refuse's)
    failures: int = 0  # loads in a row whose worker exited before registering
    exit_code: int | None = None  # the last such worker's exit code
    retry_s: float = float("-inf")  # not loaded again before this time (after a failure)


@dataclass
class OnDemand:
    """The decisions of models on demand (see the module docstring).

    ``models``: model name -> its memory estimate in bytes (:func:`estimate_bytes`);
    ``max_loaded``: models loaded (or loading) at once, >= 1; ``idle_unload_s``: seconds
    idle before a model is unloaded (0: never); ``turn_s``: None (a busy model is never unloaded),
    or seconds a model with requests waits before a busy model loaded at least as long is unloaded
    for it (> 0). ValueError for bad values.
    """

    models: dict[str, int]
    max_loaded: int = 1
    idle_unload_s: float = DEFAULT_IDLE_UNLOAD_S
    turn_s: float | None = DEFAULT_TURN_S
    _state: dict[str, _Model] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.models or not all(isinstance(n, str) and n for n in self.models):
            raise ValueError("models on demand need at least one model name")
        for name, need in self.models.items():
            if type(need) is not int or need < 0:
                raise ValueError(f"the memory estimate of {name!r} must be an int >= 0 (bytes), got {need!r}")
        if type(self.max_loaded) is not int or self.max_loaded < 1:
            raise ValueError(f"max_loaded must be an int >= 1, got {self.max_loaded!r}")
        as_seconds(self.idle_unload_s, "idle_unload_s", allow_zero=True)
        if self.turn_s is not None:
            as_seconds(self.turn_s, "turn_s")
        self._state = {name: _Model(need) for name, need in self.models.items()}

    # ------------------------------------------------------------------ what the supervisor tells it

    def want(self, model: str, now: float) -> None:
        """Load ``model`` even without requests (``POST /models/load``). KeyError for an unknown model."""
        m = self._state[model]
        m.drop = False  # (the last order wins: a release before it is void)
        m.last_used_s = max(m.last_used_s, now)
        if m.state == "loaded":  # done already: it counts as a use
            return
        m.asked = True
        if m.wanted_since is None:
            m.wanted_since = now

    def release(self, model: str) -> None:
        """Unload ``model`` as soon as it is idle (``POST /models/unload``; a model with requests queued or
        running is never unloaded: it goes once they end, unless more come; one whose requests wait for room
        loads for them, then goes). KeyError for an unknown model."""
        m = self._state[model]
        m.asked, m.drop = False, True

    def failed(self, model: str, now: float, exit_code: int | None = None) -> None:
        """``model``'s worker exited before it registered (the supervisor saw its process end, with
        ``exit_code``: negative, the signal that killed it): not loaded again before a back-off (1 s,
        doubling per failure in a row, at most :data:`MAX_RETRY_S`); an order to load it (:meth:`want`)
        is dropped. KeyError for an unknown model."""
        m = self._state[model]
        m.asked = False
        m.exit_code = exit_code
        m.failures += 1
        m.retry_s = now + min(MAX_RETRY_S, 2.0 ** (m.failures - 1))

    def stalled(self, gap_s: float, since_s: float = float("-inf")) -> None:
        """The supervisor's loop was stalled for ``gap_s`` seconds (its
        :class:`~protocol.liveness.StallWatch`): each model's idle, wanted and loaded times move
        ``gap_s`` later, each that started after ``since_s`` (the previous stall's end: one the
        previous stall moved, and nothing since, is not moved twice, so a supervisor slow at every
        pass still unloads), so the stall counts as neither idle time nor time waited for a turn."""
        for m in self._state.values():
            if m.last_used_s > since_s:
                m.last_used_s += gap_s
            if m.wanted_since is not None and m.wanted_since > since_s:
                m.wanted_since += gap_s
            if m.loaded_since is not None and m.loaded_since > since_s:
                m.loaded_since += gap_s

    def state(self, model: str) -> str:
        """``"loaded"``, ``"loading"`` or ``"unloaded"`` (as of the last pass). KeyError for an unknown model."""
        return self._state[model].state

    def states(self) -> dict[str, str]:
        return {name: m.state for name, m in self._state.items()}

    def published(self) -> dict[str, DemandState]:
        """Each model's state as everyone is told it (``status``'s ``on_demand``, ``GET /v1/models``;
        :class:`~protocol.enums.ModelState`), as of the last pass (:meth:`decide`, :meth:`want`,
        :meth:`release`, :meth:`failed` since included):

        - ``loaded``: its worker registered, and no unload is pending;
        - ``unloading``: its worker is told to stop, or an unload is pending (:meth:`release`, for a
          model loading, busy or waiting for room for its requests: it goes once loaded and idle);
        - ``loading``: its worker started and has not registered, or it is wanted (requests, or
          :meth:`want`) and waits for room, for the back-off of a failed load, or for a model
          unloading -- a load accepted and not ended;
        - ``unloaded`` otherwise; ``failed`` when it is wanted and refused (it does not fit now: the
          refusal's words, no exit code) or when its last load failed and nothing wants it now
          (:meth:`failed`'s exit code; the broker adds the worker's words, if it said any)."""
        out = {}
        for name, m in self._state.items():
            if m.state == "unloading" or (m.drop and (m.state in ("loaded", "loading")
                                                      or (m.wanted_since is not None and not m.refused))):
                out[name] = DemandState(ModelState.UNLOADING)
            elif m.state in ("loaded", "loading"):
                out[name] = DemandState(ModelState(m.state))
            elif m.wanted_since is not None and not m.refused:
                out[name] = DemandState(ModelState.LOADING)
            elif m.refused:
                out[name] = DemandState(ModelState.UNLOADED, True, None, m.refused_why)
            elif m.failures:
                why = f"its worker exited with code {m.exit_code} before it registered" \
                    if m.exit_code is not None else "its worker exited before it registered"
                out[name] = DemandState(ModelState.UNLOADED, True, m.exit_code, why)
            else:
                out[name] = DemandState(ModelState.UNLOADED)
        return out

    # ------------------------------------------------------------------ the pass

    def decide(self, status: Status, now: float, available_bytes: int | None, starting: frozenset[str] = frozenset(),
               stopping: frozenset[str] = frozenset()) -> list[Load | Unload | Refuse]:
        """The actions for this pass, given the broker's ``status``, the time ``now`` (seconds, any
        monotonic clock), the memory the machine has available (bytes,
        :func:`worker.host_memory.available_bytes`; None: unknown, the limit on loaded models alone
        decides), the models whose workers the supervisor has started and that have not registered yet (``starting``) and those whose workers it is stopping
        (``stopping``: they hold their memory and their place until they are gone). A model is
        loaded only in a pass that unloads nothing to make room for it: the memory of what is
        unloaded counts once its processes have exited (a later pass)."""
        for name, m in self._state.items():
            st = status.models.get(name)
            queued, running = (st.queued, st.running) if st is not None else (0, 0)
            workers, loading = (st.workers, st.loading) if st is not None else (0, 0)
            m.state = ("unloading" if name in stopping else "loaded" if workers > 0 else
                       "loading" if name in starting or loading else "unloaded")
            if m.state != "loaded":
                m.loaded_since = None
            elif m.loaded_since is None:  # registered: a load order is done; idle from now unless used
                m.loaded_since, m.failures, m.exit_code, m.asked = now, 0, None, False
                m.last_used_s = max(m.last_used_s, now)
            busy = m.waiting = queued > 0 or running > 0
            if busy:
                m.last_used_s = now
                m.asked = False
            wanted = busy or m.asked
            if wanted and m.wanted_since is None:
                m.wanted_since = now
            elif not wanted:
                m.wanted_since, m.refused, m.refused_why = None, False, ""
        actions: list[Load | Unload | Refuse] = self._idle_unloads(now)
        free = available_bytes if available_bytes is not None else math.inf
        for name in sorted((n for n, m in self._state.items()
                            if m.wanted_since is not None and m.state == "unloaded" and now >= m.retry_s),
                           key=lambda n: (self._state[n].wanted_since, n)):
            free = self._make_room(name, free, now, actions)
        return actions

    def _idle_unloads(self, now: float) -> list[Unload]:
        out = []
        for name, m in self._state.items():
            if m.state not in ("loaded", "loading") or m.wanted_since is not None:
                if m.state == "unloaded" and m.wanted_since is None:  # (one waiting for room keeps its unload)
                    m.drop = False
                continue
            if m.drop and m.state == "loaded":
                m.state, m.drop = "unloading", False
                out.append(Unload(name, "asked to (POST /models/unload)"))
            elif self.idle_unload_s and m.state == "loaded" and now - m.last_used_s >= self.idle_unload_s:
                m.state = "unloading"
                out.append(Unload(name, f"idle for {now - m.last_used_s:.0f} s (idle_unload_s {self.idle_unload_s:g})"))
        return out

    def _make_room(self, name: str, free: float, now: float, actions: list) -> float:
        """Load ``name`` if it fits now, else unload the least recently used idle models it needs
        gone (it loads in a later pass, once they are); refuse it (once) when even unloading every
        idle model would not make it fit. Returns the memory still available in this pass."""
        m = self._state[name]
        idle = sorted((n for n, o in self._state.items() if o.state == "loaded" and o.wanted_since is None),
                      key=lambda n: (self._state[n].last_used_s, n))
        going = sum(o.need_bytes for o in self._state.values() if o.state == "unloading")
        if m.need_bytes > free + going + sum(self._state[n].need_bytes for n in idle):
            if not m.refused:
                m.refused = True
                m.refused_why = (f"it needs about {m.need_bytes / 2**20:,.0f} MiB and the machine has "
                                 f"{(free + going) / 2**20:,.0f} MiB available, "
                                 f"{sum(self._state[n].need_bytes for n in idle) / 2**20:,.0f} MiB more "
                                 "with every idle model unloaded")
                actions.append(Refuse(name, m.refused_why))
            return free
        m.refused, m.refused_why = False, ""  # (it fits now, maybe once others are gone: its load is under way)
        active = sum(1 for o in self._state.values() if o.state != "unloaded")
        if active < self.max_loaded and m.need_bytes <= free:
            m.state = "loading"
            actions.append(Load(name))
            return free - m.need_bytes
        room, slots = free + going, self.max_loaded - active + sum(
            1 for o in self._state.values() if o.state == "unloading")
        while (slots < 1 or m.need_bytes > room) and idle:
            victim = idle.pop(0)
            self._state[victim].state = "unloading"
            actions.append(Unload(victim, f"room for {name!r} (max_loaded {self.max_loaded}, least recently used)"))
            room += self._state[victim].need_bytes
            slots += 1
        if self.turn_s is not None and (slots < 1 or m.need_bytes > room) and m.waiting \
                and now - m.wanted_since >= self.turn_s:
            self._take_turn(name, now, slots, room, actions)
        return free  # loads once what is unloading is gone; if every loaded model is busy, its requests wait

    def _take_turn(self, name: str, now: float, slots: int, room: float, actions: list) -> None:
        """``name``'s requests waited ``turn_s`` for busy models: unload those loaded longest (each
        loaded ``turn_s`` at least) until it fits; each goes to the back of the line (its requests,
        migrated by the broker, wait from now)."""
        need = self._state[name].need_bytes
        busy = sorted((n for n, o in self._state.items() if o.state == "loaded" and o.loaded_since is not None
                       and now - o.loaded_since >= self.turn_s),
                      key=lambda n: (self._state[n].loaded_since, n))
        while (slots < 1 or need > room) and busy:
            victim = busy.pop(0)
            v = self._state[victim]
            v.state, v.wanted_since = "unloading", now
            actions.append(Unload(victim, f"requests for {name!r} waited {self.turn_s:g} s (turn_s) for it"))
            room += v.need_bytes
            slots += 1


def estimate_bytes(path: str, overhead_bytes: int = 400 * 2**20) -> int:
    """A model's resident memory once served, estimated from its files (bytes): their size (a
    ``.gguf`` file's, or every file's in a model folder) x 1.25 -- KV cache, activations,
    dequantized embeddings -- plus ``overhead_bytes`` (the interpreter, torch and the
    tokenizer: ~400 MiB measured for a worker process before its model loads). A name that is
    no file or folder (a packaged model's alias, ``simulated``) is resolved as the worker
    resolves it when that is possible, else counts the overhead alone."""
    import os

    target = path
    if not os.path.exists(target):
        try:
            from worker.models.checkpoint import resolve_model_path

            folder, gguf = resolve_model_path(path)
            target = os.path.join(folder, gguf) if gguf else folder
        except Exception:  # noqa: BLE001 -- simulated, or a name only the worker's loader knows
            return overhead_bytes
    if not os.path.exists(target):
        return overhead_bytes
    if os.path.isdir(target):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(target) for f in files)
    else:
        size = os.path.getsize(target)
    return int(size * 1.25) + overhead_bytes
