"""The broker process's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from protocol import defaults
from protocol.endpoints import check_endpoint
from protocol.validation import as_seconds

MIN_HEARTBEATS_PER_WINDOW = 3
"""A liveness window spans at least this many heartbeat intervals (a peer is
declared dead or gone only after missing several heartbeats in a row)."""

DEFAULT_FRONTEND = defaults.CLIENT_ENDPOINT
DEFAULT_BACKEND = defaults.WORKER_ENDPOINT


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Everything :func:`broker.run_broker` needs.

    - ``frontend`` / ``backend``: ZeroMQ endpoints to bind for clients / workers
      (``tcp://HOST:*`` picks a free port; the chosen ones are reported to
      ``run_broker``'s ``on_ready``).
    - ``max_queue``: queued requests per model before ``queue_full`` (requests).
    - ``heartbeat_interval_s``: seconds between the broker's heartbeats; also
      the period every worker and client heartbeats at (the broker announces
      it in its ``welcome``, and peers follow it), so the liveness windows
      below are counted in the peers' own heartbeat periods.
    - ``worker_liveness_s``: a worker silent this long (seconds) is dead and
      its requests migrate. At least :data:`MIN_HEARTBEATS_PER_WINDOW`
      heartbeat intervals (ValueError otherwise): one late heartbeat must not
      look like a death.
    - ``client_liveness_s``: a client silent this long (seconds) is gone and
      its requests end with ``client_silent``; at least
      :data:`MIN_HEARTBEATS_PER_WINDOW` heartbeat intervals too.
    - ``worker_hung_s``: a worker that holds requests but completes no
      iteration for this long (seconds) is hung: its requests migrate as if
      it had died, although it still heartbeats. It must exceed the longest
      legitimate model step (a slow step is never "hung" before this bound;
      heartbeats come from the worker's I/O thread, so a long step never
      looks dead). None disables the check.
    - ``register_grace_s``: for this long after the broker starts (seconds),
      requests for a model no worker has registered yet wait in its queue
      instead of failing with ``unknown_model``: after a broker restart,
      clients resubmit at once but workers re-register only on their next
      heartbeat. Past it, such requests end with ``unknown_model``.
    - ``aging_window``: submissions per priority level of aging (see :mod:`protocol.queue`).
    - ``max_attempts``: workers a request may be lost on before it ends with
      ``worker_failed`` instead of migrating again.
    - ``max_message_bytes``: larger incoming frames get ``too_large`` (bytes),
      naming the requests in them; announced in ``welcome``, so clients
      refuse a larger request at submit and split their batches to fit, and
      workers split their iterations.
    - ``send_hwm``: ZeroMQ send high-water mark per peer (messages).
    - ``max_pending_per_peer``: messages buffered per peer beyond the
      high-water mark before that peer is failed (a client: each of its
      requests not yet ended -- those whose endings were in the discarded
      messages included -- ends with ``slow_consumer``; a worker: treated as
      dead). A peer thus holds at most ``send_hwm + max_pending_per_peer``
      messages of the broker's memory.
    - ``tick_s``: seconds between housekeeping passes (queued deadlines, liveness).
    - ``curve_secret_file``: the broker's CURVE secret key file (from
      ``slotserve keygen``); when set, both sockets require CURVE
      encryption and authentication. ``curve_clients_dir`` /
      ``curve_workers_dir``: directories of allowed public keys for the
      frontend (clients) and the backend (workers), kept apart so a client
      key can never register as a worker.
    - ``metrics_port``: serve Prometheus metrics on this TCP port (0 picks a
      free one), or None for no metrics; ``metrics_host`` is the address to bind.
    - ``prefix_routing``: among workers with a free credit, send a request to
      the one most likely to hold its prompt's prefix in its KV cache
      (:mod:`broker.prefix`); False: credit-only dispatch (most free slots).
    - ``on_demand_models``: models a supervisor loads when they are asked for
      (``slotserve up`` with several models: :mod:`slotserve.on_demand`):
      requests for them wait in their queue while no worker serves them
      (never ``unknown_model``; their deadlines still apply), and ``status``
      lists each of them (``workers`` 0 while none is loaded): the demand the
      supervisor reads. Every served name of each model is given here; once the
      supervisor said which are aliases (its ``demand``), ``status`` lists a model
      by its own name, the others among its ``aliases``.
    """

    frontend: str = DEFAULT_FRONTEND
    backend: str = DEFAULT_BACKEND
    max_queue: int = 100_000
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    worker_liveness_s: float = 5.0
    client_liveness_s: float = 10.0
    worker_hung_s: float | None = 300.0
    register_grace_s: float = 10.0
    aging_window: int = defaults.AGING_WINDOW
    max_attempts: int = 3
    max_message_bytes: int = defaults.MAX_MESSAGE_BYTES
    send_hwm: int = 10_000
    max_pending_per_peer: int = 100_000
    tick_s: float = 0.02
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    curve_secret_file: str | None = None
    curve_clients_dir: str | None = None
    curve_workers_dir: str | None = None
    prefix_routing: bool = True
    on_demand_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = self.on_demand_models
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"on_demand_models must be a tuple of non-empty model names, got {names!r}")
        object.__setattr__(self, "on_demand_models", tuple(dict.fromkeys(names)))
        if type(self.prefix_routing) is not bool:
            raise ValueError(f"prefix_routing must be True or False, got {self.prefix_routing!r}")
        for name in ("frontend", "backend"):
            check_endpoint(getattr(self, name), bind=True, name=name)
        for name in ("max_queue", "aging_window", "max_attempts", "max_message_bytes", "send_hwm", "max_pending_per_peer"):
            v = getattr(self, name)
            least = defaults.MIN_MESSAGE_BYTES if name == "max_message_bytes" else 1
            if type(v) is not int or v < least:
                raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
        as_seconds(self.register_grace_s, "register_grace_s", allow_zero=True)
        for name in ("heartbeat_interval_s", "worker_liveness_s", "client_liveness_s", "tick_s"):
            as_seconds(getattr(self, name), name)
        if self.heartbeat_interval_s < defaults.MIN_HEARTBEAT_INTERVAL_S:  # it is announced in every welcome
            raise ValueError(f"heartbeat_interval_s must be >= {defaults.MIN_HEARTBEAT_INTERVAL_S} s, "
                             f"got {self.heartbeat_interval_s!r}")
        if self.worker_hung_s is not None:  # None: never declared hung
            as_seconds(self.worker_hung_s, "worker_hung_s")
        curve = (self.curve_secret_file, self.curve_clients_dir, self.curve_workers_dir)
        if any(v is not None for v in curve) and not all(isinstance(v, str) and v for v in curve):
            raise ValueError("CURVE needs all of curve_secret_file, curve_clients_dir and curve_workers_dir "
                             "(paths; `slotserve keygen DIR` makes them), or none")
        if self.metrics_port is not None and (type(self.metrics_port) is not int or not 0 <= self.metrics_port < 65536):
            raise ValueError(f"metrics_port must be None or a TCP port 0..65535, got {self.metrics_port!r}")
        least = MIN_HEARTBEATS_PER_WINDOW * self.heartbeat_interval_s
        for name in ("worker_liveness_s", "client_liveness_s"):
            v = getattr(self, name)
            if v < least * (1 - 1e-9):  # (3 x 0.1 is 0.30000000000000004)
                raise ValueError(
                    f"{name} ({v:g} s) must be at least {MIN_HEARTBEATS_PER_WINDOW} heartbeat intervals "
                    f"({MIN_HEARTBEATS_PER_WINDOW} x {self.heartbeat_interval_s:g} s = {least:g} s): peers heartbeat "
                    "at the broker's interval, and a peer is declared dead only after missing several in a row; "
                    "raise it or lower heartbeat_interval_s")
