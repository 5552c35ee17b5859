"""A worker process's configuration: one frozen dataclass, validated once
(:class:`WorkerConfig`, what :func:`worker.process.run_worker` takes)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from pathlib import PurePath

from protocol import defaults
from protocol.endpoints import check_endpoint
from protocol.validation import as_seconds
from worker.models.options import ModelOptions


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything :func:`~worker.process.run_worker` needs.

    - ``broker``: the broker's worker endpoint (default
      :data:`protocol.defaults.WORKER_ENDPOINT`, ``tcp://127.0.0.1:5556``).
    - ``model``: model name, passed to :func:`worker.models.load_model`
      (``"simulated"`` = ``SimulatedLLM()`` with its defaults); also the name
      clients ask for, unless ``served_model_names`` gives others (a ``.gguf``
      file: its stem first, :func:`default_served_names`).
    - ``served_model_names``: the names clients ask for the model by (vLLM's
      ``--served-model-name``): the first is the primary (the broker queues
      and lists the model by it), the others are aliases. Empty (default):
      :func:`default_served_names` of ``model``.
    - ``num_slots``: the engine's batch size (slots).
    - ``prefetch``: requests the broker may assign beyond the free slots, so a
      freed slot is refilled on the next iteration without waiting a round
      trip (default: ``max(1, num_slots // 4)``).
    - ``step_delay_ms``: extra cost per iteration in milliseconds (simulates
      a slower model; 0 = none).
    - ``stop_token``: the default stop token for requests that give none:
      ``"model"`` (the model's EOS tokens, if it has them), an int, or None.
    - ``heartbeat_interval_s``: seconds between heartbeats when idle, until
      the broker's welcome announces its interval; then the broker's (or
      this, if shorter): the broker's liveness window counts in its interval.
    - ``broker_liveness_s``: no word from the broker for this long (seconds;
      at least 3 of the broker's heartbeat intervals) -> drop all work and
      register again.
    - ``name``: shown in ``slotserve status`` (default ``host:pid``).
    - ``curve_secret_file`` / ``curve_broker_key_file``: this worker's CURVE
      secret key file and the broker's public key file (``slotserve keygen``
      makes both; see :mod:`protocol.curve`); set both to talk CURVE, or neither.
    - ``max_message_bytes``: larger frames from the broker are refused
      (ZeroMQ drops the connection past 4x this; the decoder refuses above it).
    - ``model_options``: device, precision, runner, prefill chunk and threads
      for a real model (:class:`~worker.models.options.ModelOptions`).
    - ``warmup``: before registering, run a prefill and decode steps at every
      batch size up to ``num_slots`` (:mod:`worker.warmup`), so the first
      requests do not pay for the model's first calls (CUDA graph capture,
      kernel and allocator set-up); the model is served only after it.
      Stateless models (``SimulatedLLM``) have nothing to warm and skip it.
    """

    broker: str = defaults.WORKER_ENDPOINT
    model: str = "simulated"
    num_slots: int = 8
    prefetch: int | None = None
    step_delay_ms: float = 0.0
    stop_token: int | str | None = "model"
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    broker_liveness_s: float = 5.0
    name: str = ""
    curve_secret_file: str | None = None
    curve_broker_key_file: str | None = None
    max_message_bytes: int = defaults.MAX_MESSAGE_BYTES
    model_options: ModelOptions = ModelOptions()
    served_model_names: tuple[str, ...] = ()
    warmup: bool = True

    def __post_init__(self) -> None:
        check_endpoint(self.broker, bind=False, name="broker")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty name, got {self.model!r}")
        if type(self.num_slots) is not int or self.num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {self.num_slots!r}")
        if self.prefetch is not None and (type(self.prefetch) is not int or self.prefetch < 0):
            raise ValueError(f"prefetch must be None or an int >= 0, got {self.prefetch!r}")
        if isinstance(self.step_delay_ms, bool) or not isinstance(self.step_delay_ms, (int, float)) \
                or not 0 <= self.step_delay_ms < math.inf:
            raise ValueError(f"step_delay_ms must be a finite number of milliseconds >= 0, got {self.step_delay_ms!r}")
        if not (self.stop_token is None or self.stop_token == "model"
                or (type(self.stop_token) is int and 0 <= self.stop_token < 2**64)):
            raise ValueError(f"stop_token must be 'model', None or a token id >= 0 (below 2**64, the wire's "
                             f"integer range), got {self.stop_token!r}")
        for n in ("heartbeat_interval_s", "broker_liveness_s"):
            as_seconds(getattr(self, n), n)
        if (self.curve_secret_file is None) != (self.curve_broker_key_file is None):
            raise ValueError("CURVE needs both curve_secret_file and curve_broker_key_file, or neither")
        if type(self.max_message_bytes) is not int or self.max_message_bytes < defaults.MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be an int >= {defaults.MIN_MESSAGE_BYTES}, "
                             f"got {self.max_message_bytes!r}")
        names = self.served_model_names
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n.strip() == n and n for n in names) \
                or len(set(names)) != len(names):
            raise ValueError(f"served_model_names must be a tuple of distinct non-empty names without surrounding "
                             f"spaces, got {names!r}")
        if type(self.warmup) is not bool:
            raise ValueError(f"warmup must be True or False, got {self.warmup!r}")
        if not isinstance(self.model_options, ModelOptions):
            raise ValueError(f"model_options must be a ModelOptions, got {self.model_options!r}")
        if self.broker_liveness_s <= self.heartbeat_interval_s:
            raise ValueError("broker_liveness_s must exceed heartbeat_interval_s")

    def name_of(self, pid: int) -> str:
        """The name the process ``pid`` running this worker registers under (``slotserve status``):
        :attr:`name`, or ``host:pid`` by default."""
        return self.name or f"{socket.gethostname()}:{pid}"

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names the model is served under: the primary first, then the aliases."""
        return self.served_model_names or default_served_names(self.model)

    @property
    def max_inflight(self) -> int:
        """Credits announced to the broker: slots plus prefetch."""
        prefetch = max(1, self.num_slots // 4) if self.prefetch is None else self.prefetch
        return self.num_slots + prefetch


def default_served_names(model: str) -> tuple[str, ...]:
    """The names a model is served under when none are given (``--served-model-name``): for a
    ``.gguf`` file its stem first, then the path as given (still accepted, as before: it is an
    alias); for a model folder that exists here its folder's name first, then the path as given
    (as ``slotserve up`` with several models and ``--models-dir`` name folders); any other name
    (``simulated``, an alias such as ``smollm2-135m``, a hub id) alone.

    The stem (``Qwen2.5-Coder-0.5B-Instruct-Q4_K_M`` for
    ``/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf``) rather than the file's
    ``general.name`` (``Qwen2.5 Coder 0.5B Instruct``): it is the name llama.cpp users
    download, list and pass around (LM Studio and koboldcpp list GGUF models by it), it tells
    two quantisations of one model apart (``general.name`` does not), it has no spaces, and it
    is known without opening the file (the CLI decides names before any worker starts).
    Two files with the same stem in different folders need ``--served-model-name`` to differ.
    """
    path = PurePath(model)
    if path.suffix.lower() == ".gguf" and path.stem and path.stem != model:
        return (path.stem, model)
    if os.path.isdir(model):
        name = os.path.basename(os.path.abspath(model))  # (abspath: "." and ".." have names too)
        return (name, model) if name and name != model else (model,)
    return (model,)
