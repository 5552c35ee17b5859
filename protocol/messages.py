"""Typed wire messages: one class per ``op``.

Every message travels as one msgpack map with the protocol version ``v``
(:data:`PROTOCOL_VERSION`) and its ``op``; :mod:`protocol.codec` turns bytes
into these classes and back. ``from_wire`` checks every field's type and
raises :class:`~protocol.errors.ProtocolError` (code ``malformed``) on
anything else, so a peer's bytes never reach the caller unchecked. Optional
fields left at their defaults are omitted on the wire (smaller, faster).

Who sends what (``C`` client, ``B`` broker, ``W`` worker)::

    C->B  hello, submit, cancel, heartbeat, status_query, bye
    B->C  welcome, results, error, heartbeat, status
    W->B  register, iteration, heartbeat, bye
    B->W  welcome, assign, cancel, heartbeat, error

Request ids: a client chooses its own (``int`` or ``str``), scoped to that
client; the broker keys requests by (client, id) and gives each worker its
own ``int`` key instead, so worker-side ids (``assign``, ``iteration``,
``cancel`` on the backend) are broker keys, never client ids.

Batching: ``submit`` and ``assign`` carry many requests; ``iteration`` (one per
worker iteration) carries the new tokens of every slot, and ``results`` the
same grouped for one client, so message rate follows iterations, not tokens.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; a peer with another version gets ``unsupported_version``."""

MAX_REQUEST_ID_CHARS = 256
"""Longest accepted ``str`` request id (characters)."""

RequestId = Union[int, str]
"""A request id: ``int`` or ``str`` (at most :data:`MAX_REQUEST_ID_CHARS` characters)."""


class Op(str, enum.Enum):
    """The ``op`` of a message (its type on the wire)."""

    HELLO = "hello"
    WELCOME = "welcome"
    SUBMIT = "submit"
    CANCEL = "cancel"
    RESULTS = "results"
    ERROR = "error"
    HEARTBEAT = "heartbeat"
    STATUS_QUERY = "status_query"
    STATUS = "status"
    BYE = "bye"
    REGISTER = "register"
    ASSIGN = "assign"
    ITERATION = "iteration"

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------- field checks
# Small, fast helpers: each returns the value when it has the right type and
# raises ProtocolError(malformed) naming the field otherwise.


def _bad(name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: expected {expected}, got {type(value).__name__}")


def _get(d: dict, name: str) -> Any:
    try:
        return d[name]
    except KeyError:
        raise ProtocolError(ErrorCode.MALFORMED, f"missing field {name!r}") from None


def _int(v: Any, name: str) -> int:
    if type(v) is not int:  # bool is not an int here
        raise _bad(name, "int", v)
    return v


def _opt_int(v: Any, name: str) -> int | None:
    return None if v is None else _int(v, name)


def _num(v: Any, name: str) -> float:
    if type(v) is float:
        if math.isnan(v):
            raise _bad(name, "a number (not NaN)", v)
        return v
    if type(v) is int:
        return float(v)
    raise _bad(name, "number", v)


def _opt_num(v: Any, name: str) -> float | None:
    return None if v is None else _num(v, name)


def _str(v: Any, name: str) -> str:
    if type(v) is not str:
        raise _bad(name, "str", v)
    return v


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise _bad(name, "bool", v)
    return v


def _list(v: Any, name: str) -> list:
    if type(v) is not list:
        raise _bad(name, "list", v)
    return v


def _dict(v: Any, name: str) -> dict:
    if type(v) is not dict:
        raise _bad(name, "map", v)
    return v


def _tokens(v: Any, name: str) -> list[int]:
    if type(v) is not list:
        raise _bad(name, "list of int", v)
    for t in v:
        if type(t) is not int:
            raise _bad(name, "list of int", t)
    return v


def _rid(v: Any, name: str) -> RequestId:
    t = type(v)
    if t is int:
        return v
    if t is str:
        if len(v) > MAX_REQUEST_ID_CHARS:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: longer than {MAX_REQUEST_ID_CHARS} chars")
        return v
    raise _bad(name, "int or str request id", v)


def _rids(v: Any, name: str) -> list[RequestId]:
    return [_rid(x, name) for x in _list(v, name)]


def _enum(cls: type[enum.Enum], v: Any, name: str):
    try:
        return cls(v)
    except (ValueError, TypeError):
        raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: unknown value {v!r:.40}") from None


# --------------------------------------------------------------------------- parts


@dataclass(slots=True)
class RequestSpec:
    """One generation request on the wire (inside ``submit`` and ``assign``).

    - ``request_id``: ``int | str``; the client's id in ``submit``, the
      broker's ``int`` key in ``assign``.
    - ``prompt``: ``list[int]`` token ids, or ``str`` text (needs a model
      with a tokenizer), or ``None`` when ``messages`` is given.
    - ``max_tokens``: ``int``, generated tokens to stop at (``>= 1``).
    - ``messages``: ``list[{"role": str, "content": str}]`` chat messages,
      rendered with the model's chat template, or ``None``.
    - ``stop_tokens``: ``list[int]`` stop tokens (``[]`` = none), or ``None``
      = the worker's default (the model's EOS tokens or ``--stop-token``).
    - ``stop_sequences``: ``list[list[int]]`` multi-token stop patterns.
    - ``priority``: ``int``, lower runs first (vLLM's convention).
    - ``timeout_s``: ``float`` seconds from submission to a ``deadline``
      finish, or ``None``. In ``assign`` it is the time left.
    - ``temperature``, ``top_p``, ``top_k``, ``seed``: sampling, as
      :class:`worker.models.base.SamplingParams`.
    - ``resume_tokens``: ``list[int]`` tokens already generated elsewhere
      (migration, resubmission); they count toward ``max_tokens`` and are
      not streamed again.
    """

    request_id: RequestId
    prompt: list[int] | str | None
    max_tokens: int
    messages: list[dict] | None = None
    stop_tokens: list[int] | None = None
    stop_sequences: list[list[int]] = field(default_factory=list)
    priority: int = 0
    timeout_s: float | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    resume_tokens: list[int] = field(default_factory=list)

    def to_wire(self) -> dict:
        d: dict[str, Any] = {"id": self.request_id, "max_tokens": self.max_tokens}
        if self.prompt is not None:
            d["prompt"] = self.prompt
        if self.messages is not None:
            d["messages"] = self.messages
        if self.stop_tokens is not None:
            d["stop_tokens"] = self.stop_tokens
        if self.stop_sequences:
            d["stop_sequences"] = self.stop_sequences
        if self.priority:
            d["priority"] = self.priority
        if self.timeout_s is not None:
            d["timeout_s"] = self.timeout_s
        if self.temperature != 0.0:
            d["temperature"] = self.temperature
        if self.top_p != 1.0:
            d["top_p"] = self.top_p
        if self.top_k:
            d["top_k"] = self.top_k
        if self.seed is not None:
            d["seed"] = self.seed
        if self.resume_tokens:
            d["resume_tokens"] = self.resume_tokens
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "RequestSpec":
        # Hot path (every request crosses it twice): inline checks for the
        # fields every request has; optional ones only when present.
        if type(d) is not dict:
            raise _bad("request", "map", d)
        rid = d.get("id")
        t = type(rid)
        if not (t is int or (t is str and len(rid) <= MAX_REQUEST_ID_CHARS)):
            raise _bad("id", f"int or str (at most {MAX_REQUEST_ID_CHARS} chars)", rid)
        max_tokens = d.get("max_tokens")
        if type(max_tokens) is not int:
            raise _bad("max_tokens", "int", max_tokens)
        prompt = d.get("prompt")
        if type(prompt) is list:
            if not _INT_ONLY.issuperset(map(type, prompt)):
                raise _bad("prompt", "list of int", prompt)
        elif prompt is not None and type(prompt) is not str:
            raise _bad("prompt", "list of int or str", prompt)
        spec = cls(rid, prompt, max_tokens)
        if len(d) > 3 or prompt is None:
            spec._optional(d)
        return spec

    def _optional(self, d: dict) -> None:
        """Check and set the optional fields present in ``d`` (unknown keys are
        ignored, so a newer peer may add fields)."""
        for k, v in d.items():
            if k == "stop_tokens":
                self.stop_tokens = None if v is None else _tokens(v, k)
            elif k == "stop_sequences":
                self.stop_sequences = [_tokens(x, "stop_sequences[]") for x in _list(v, k)]
            elif k == "priority":
                self.priority = _int(v, k)
            elif k == "timeout_s":
                self.timeout_s = _opt_num(v, k)
            elif k == "resume_tokens":
                self.resume_tokens = _tokens(v, k)
            elif k == "temperature":
                self.temperature = _num(v, k)
            elif k == "top_p":
                self.top_p = _num(v, k)
            elif k == "top_k":
                self.top_k = _int(v, k)
            elif k == "seed":
                self.seed = _opt_int(v, k)
            elif k == "messages" and v is not None:
                for m in _list(v, k):
                    m = _dict(m, "messages[]")
                    _str(_get(m, "role"), "role")
                    _str(_get(m, "content"), "content")
                self.messages = v
        if self.prompt is None and self.messages is None:
            raise ProtocolError(ErrorCode.MALFORMED, "a request needs 'prompt' or 'messages'")


@dataclass(slots=True)
class Finished:
    """The terminal notice for one request (inside ``iteration`` and ``results``).

    - ``request_id``: ``int | str`` (broker key from a worker, client id to a client).
    - ``finish_reason``: :class:`FinishReason`.
    - ``code``: :class:`ErrorCode` when ``finish_reason`` is ``error``, else ``None``.
    - ``message``: ``str`` human-readable detail for an error, else ``None``.
    - ``prompt_tokens``: ``int`` prompt length in tokens when the worker knows
      it (text prompts are tokenized there), else ``None``.

    The request's last tokens travel in the same message's ``ids``/``tokens``.
    """

    request_id: RequestId
    finish_reason: FinishReason
    code: ErrorCode | None = None
    message: str | None = None
    prompt_tokens: int | None = None

    def to_wire(self) -> list:
        # Compact positional form: [id, reason, prompt_tokens, code, message],
        # trailing nulls dropped (most entries are [id, reason, prompt_tokens]).
        if self.code is None and self.message is None:
            if self.prompt_tokens is None:
                return [self.request_id, self.finish_reason.value]
            return [self.request_id, self.finish_reason.value, self.prompt_tokens]
        return [self.request_id, self.finish_reason.value, self.prompt_tokens,
                None if self.code is None else self.code.value, self.message]

    @classmethod
    def from_wire(cls, e: Any) -> "Finished":
        if type(e) is not list or not 2 <= len(e) <= 5:
            raise _bad("finished[]", "[id, reason, prompt_tokens?, code?, message?]", e)
        reason = _REASONS.get(e[1]) if type(e[1]) is str else None
        if reason is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"field 'reason': unknown value {e[1]!r:.40}")
        f = cls(_rid(e[0], "id"), reason)
        n = len(e)
        if n > 2:
            f.prompt_tokens = _opt_int(e[2], "prompt_tokens")
        if n > 3 and e[3] is not None:
            f.code = _enum(ErrorCode, e[3], "code")
        if n > 4 and e[4] is not None:
            f.message = _str(e[4], "message")
        return f


_REASONS = {r.value: r for r in FinishReason}
_INT_ONLY = frozenset({int})
_ID_TYPES = frozenset({int, str})


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a worker's model accepts (from ``register``, shown in ``welcome``).

    - ``vocab_size``: ``int`` token ids lie in ``[0, vocab_size)``, or ``None`` (unknown).
    - ``max_seq_len``: ``int`` prompt + ``max_tokens`` limit in tokens, or ``None``.
    - ``eos_token_ids``: ``list[int]`` the worker's default stop tokens.
    - ``has_tokenizer``: ``bool`` whether text prompts / chat messages work.
    """

    vocab_size: int | None = None
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    has_tokenizer: bool = False

    def to_wire(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            "eos_token_ids": list(self.eos_token_ids),
            "has_tokenizer": self.has_tokenizer,
        }

    @classmethod
    def from_wire(cls, d: Any) -> "ModelInfo":
        d = _dict(d, "info")
        return cls(
            vocab_size=_opt_int(d.get("vocab_size"), "vocab_size"),
            max_seq_len=_opt_int(d.get("max_seq_len"), "max_seq_len"),
            eos_token_ids=tuple(_tokens(d.get("eos_token_ids", []), "eos_token_ids")),
            has_tokenizer=_bool(d.get("has_tokenizer", False), "has_tokenizer"),
        )


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model's line in ``status``: ``queued`` requests waiting in the broker,
    ``running`` requests assigned to workers, ``workers`` registered,
    ``slots_busy`` / ``slots_total`` across them (all ``int``)."""

    queued: int
    running: int
    workers: int
    slots_busy: int
    slots_total: int

    def to_wire(self) -> dict:
        return {"queued": self.queued, "running": self.running, "workers": self.workers,
                "slots_busy": self.slots_busy, "slots_total": self.slots_total}

    @classmethod
    def from_wire(cls, d: Any) -> "ModelStatus":
        d = _dict(d, "models{}")
        return cls(**{k: _int(_get(d, k), k) for k in ("queued", "running", "workers", "slots_busy", "slots_total")})


def _id_list(v: Any, name: str) -> list:
    """A list of request ids, checked at C speed for the common all-int case."""
    if type(v) is not list:
        raise _bad(name, "list of request ids", v)
    types = set(map(type, v))
    if not _ID_TYPES.issuperset(types):
        raise _bad(name, "list of int or str request ids", v)
    if str in types and max(len(x) for x in v if type(x) is str) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: an id is longer than {MAX_REQUEST_ID_CHARS} chars")
    return v


def _texts(v: Any, name: str) -> list[list]:
    """``[[request_id, text], ...]``, checked."""
    for e in _list(v, name):
        if type(e) is not list or len(e) != 2 or type(e[1]) is not str:
            raise _bad(name, "[request_id, text] pairs", e)
        _rid(e[0], name)
    return v


# --------------------------------------------------------------------------- messages


@dataclass(slots=True)
class Hello:
    """C->B: a client introduces itself; the broker answers ``welcome``.

    - ``client_name``: ``str`` free text for logs and ``status``.
    """

    op: ClassVar[Op] = Op.HELLO
    client_name: str = ""

    def to_wire(self) -> dict:
        return {"client_name": self.client_name}

    @classmethod
    def from_wire(cls, d: dict) -> "Hello":
        return cls(client_name=_str(d.get("client_name", ""), "client_name"))


@dataclass(slots=True)
class Welcome:
    """B->C answer to ``hello``, B->W answer to ``register``.

    - ``broker_id``: ``str`` a fresh id per broker start (a change means the
      broker restarted and forgot everything in flight).
    - ``heartbeat_interval_s``: ``float`` seconds between heartbeats the
      broker expects; a peer silent for several intervals counts as gone.
    - ``models``: ``{name: ModelInfo}`` models that have workers registered.
    """

    op: ClassVar[Op] = Op.WELCOME
    broker_id: str
    heartbeat_interval_s: float
    models: dict[str, ModelInfo] = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {"broker_id": self.broker_id, "heartbeat_interval_s": self.heartbeat_interval_s,
                "models": {k: m.to_wire() for k, m in self.models.items()}}

    @classmethod
    def from_wire(cls, d: dict) -> "Welcome":
        models = _dict(d.get("models", {}), "models")
        return cls(
            broker_id=_str(_get(d, "broker_id"), "broker_id"),
            heartbeat_interval_s=_num(_get(d, "heartbeat_interval_s"), "heartbeat_interval_s"),
            models={_str(k, "models{}"): ModelInfo.from_wire(m) for k, m in models.items()},
        )


@dataclass(slots=True)
class Submit:
    """C->B: new requests, all for one model.

    - ``model``: ``str`` model name, as workers register it (e.g. ``"simulated"``).
    - ``requests``: ``list[RequestSpec]`` with client-chosen ids.

    Each request ends in exactly one ``finished`` entry of a ``results``
    message (or an ``error`` naming it when the whole message was refused).
    """

    op: ClassVar[Op] = Op.SUBMIT
    model: str
    requests: list[RequestSpec]

    def to_wire(self) -> dict:
        return {"model": self.model, "requests": [r.to_wire() for r in self.requests]}

    @classmethod
    def from_wire(cls, d: dict) -> "Submit":
        return cls(model=_str(_get(d, "model"), "model"),
                   requests=[RequestSpec.from_wire(r) for r in _list(_get(d, "requests"), "requests")])


@dataclass(slots=True)
class Assign:
    """B->W: requests for the worker's slots; never more than its credits.

    - ``requests``: ``list[RequestSpec]`` whose ids are broker keys (``int``)
      and whose ``timeout_s`` is the time left.
    """

    op: ClassVar[Op] = Op.ASSIGN
    requests: list[RequestSpec]

    def to_wire(self) -> dict:
        return {"requests": [r.to_wire() for r in self.requests]}

    @classmethod
    def from_wire(cls, d: dict) -> "Assign":
        return cls(requests=[RequestSpec.from_wire(r) for r in _list(_get(d, "requests"), "requests")])


@dataclass(slots=True)
class Cancel:
    """C->B (client ids) or B->W (broker keys): cancel these requests.

    - ``request_ids``: ``list[int | str]``. Unknown or finished ids are
      ignored (a cancel may cross the request's end).
    """

    op: ClassVar[Op] = Op.CANCEL
    request_ids: list[RequestId]

    def to_wire(self) -> dict:
        return {"ids": self.request_ids}

    @classmethod
    def from_wire(cls, d: dict) -> "Cancel":
        return cls(request_ids=_rids(_get(d, "ids"), "ids"))


@dataclass(slots=True)
class _TokenBatch:
    """Shared shape of ``iteration`` and ``results``.

    - ``ids``, ``tokens``: parallel lists: ``tokens[i]`` (``int``) is the next
      generated token of request ``ids[i]``. A request appears once per
      iteration (more often only if it generated several tokens, in order).
      Flat lists keep decoding at C speed.
    - ``texts``: ``[[request_id, str], ...]`` newly completed text per request
      (text prompts only).
    - ``finished``: ``list[Finished]``; a request's final tokens are in the
      same message's ``ids``/``tokens``.
    """

    ids: list = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    texts: list[list] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)

    def to_wire(self) -> dict:
        d: dict[str, Any] = {"ids": self.ids, "tokens": self.tokens}
        if self.texts:
            d["texts"] = self.texts
        if self.finished:
            d["finished"] = [f.to_wire() for f in self.finished]
        return d

    @classmethod
    def from_wire(cls, d: dict):
        ids = _id_list(d.get("ids", []), "ids")
        tokens = d.get("tokens", [])
        if type(tokens) is not list or len(tokens) != len(ids) or not _INT_ONLY.issuperset(map(type, tokens)):
            raise _bad("tokens", "a list of int as long as 'ids'", tokens)
        texts = d.get("texts")
        finished = d.get("finished")
        return cls(ids, tokens, [] if texts is None else _texts(texts, "texts"),
                   [] if finished is None else [Finished.from_wire(f) for f in _list(finished, "finished")])


@dataclass(slots=True)
class Iteration(_TokenBatch):
    """W->B: one engine iteration's output (ids are broker keys).

    Each ``finished`` entry returns one credit (one slot) to the worker.
    Fields as in :class:`_TokenBatch`.
    """

    op: ClassVar[Op] = Op.ITERATION


@dataclass(slots=True)
class Results(_TokenBatch):
    """B->C: one worker iteration's output for one client (client ids).

    Also carries broker-side endings (``queue_full``, queued deadline,
    cancellation before dispatch). Fields as in :class:`_TokenBatch`.
    """

    op: ClassVar[Op] = Op.RESULTS


@dataclass(slots=True)
class Error:
    """B->C or B->W: a per-call error (the message sent could not be honoured).

    - ``code``: :class:`ErrorCode`.
    - ``message``: ``str`` what went wrong and what to do next.
    - ``request_ids``: ``list[int | str]`` requests the error ends (each gets
      its terminal ``error`` through this message), possibly empty.
    """

    op: ClassVar[Op] = Op.ERROR
    code: ErrorCode
    message: str
    request_ids: list[RequestId] = field(default_factory=list)

    def to_wire(self) -> dict:
        d: dict[str, Any] = {"code": self.code.value, "message": self.message}
        if self.request_ids:
            d["ids"] = self.request_ids
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Error":
        return cls(code=_enum(ErrorCode, _get(d, "code"), "code"),
                   message=_str(_get(d, "message"), "message"),
                   request_ids=_rids(d.get("ids", []), "ids"))


@dataclass(slots=True)
class Heartbeat:
    """Any direction: "I am alive" when a peer has sent nothing else for an interval.

    - ``broker_id``: ``str`` set by the broker, so a peer notices a restart.
    - ``progress``: ``int`` set by a worker: iterations completed so far (a
      hung worker heartbeats but stops progressing while it has work).
    """

    op: ClassVar[Op] = Op.HEARTBEAT
    broker_id: str | None = None
    progress: int | None = None

    def to_wire(self) -> dict:
        d: dict[str, Any] = {}
        if self.broker_id is not None:
            d["broker_id"] = self.broker_id
        if self.progress is not None:
            d["progress"] = self.progress
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Heartbeat":
        b = d.get("broker_id")
        return cls(broker_id=None if b is None else _str(b, "broker_id"),
                   progress=_opt_int(d.get("progress"), "progress"))


@dataclass(slots=True)
class StatusQuery:
    """C->B: ask for a :class:`Status` snapshot (``slotserve status``)."""

    op: ClassVar[Op] = Op.STATUS_QUERY

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, d: dict) -> "StatusQuery":
        return cls()


@dataclass(slots=True)
class Status:
    """B->C: the broker's state.

    - ``broker_id``: ``str``; ``uptime_s``: ``float`` seconds since start.
    - ``models``: ``{name: ModelStatus}``.
    - ``workers``: ``list[{"name": str, "model": str, "num_slots": int, "inflight": int,
      "iterations": int, "suspect": bool}]`` (``iterations``: engine iterations that
      produced tokens; ``suspect``: found hung, gets no requests until it progresses).
    - ``clients``: ``int`` clients seen within the liveness window.
    - ``counters``: ``{name: int}`` totals since start (submitted, finished,
      errors, requeued, ...).
    """

    op: ClassVar[Op] = Op.STATUS
    broker_id: str
    uptime_s: float
    models: dict[str, ModelStatus]
    workers: list[dict]
    clients: int
    counters: dict[str, int]

    def to_wire(self) -> dict:
        return {"broker_id": self.broker_id, "uptime_s": self.uptime_s,
                "models": {k: m.to_wire() for k, m in self.models.items()},
                "workers": self.workers, "clients": self.clients, "counters": self.counters}

    @classmethod
    def from_wire(cls, d: dict) -> "Status":
        workers = _list(_get(d, "workers"), "workers")
        for w in workers:
            w = _dict(w, "workers[]")
            _str(_get(w, "name"), "name"), _str(_get(w, "model"), "model")
            _int(_get(w, "num_slots"), "num_slots"), _int(_get(w, "inflight"), "inflight")
        counters = _dict(_get(d, "counters"), "counters")
        for k, c in counters.items():
            _str(k, "counters{}"), _int(c, "counters{}")
        return cls(
            broker_id=_str(_get(d, "broker_id"), "broker_id"),
            uptime_s=_num(_get(d, "uptime_s"), "uptime_s"),
            models={_str(k, "models{}"): ModelStatus.from_wire(m)
                    for k, m in _dict(_get(d, "models"), "models").items()},
            workers=workers,
            clients=_int(_get(d, "clients"), "clients"),
            counters=counters,
        )


@dataclass(slots=True)
class Bye:
    """C->B or W->B: leaving now. The broker cancels a client's requests, and
    requeues a worker's in-flight requests (with their tokens) at once instead
    of waiting for missed heartbeats.

    - ``reason``: ``str`` free text for the log.
    """

    op: ClassVar[Op] = Op.BYE
    reason: str = ""

    def to_wire(self) -> dict:
        return {"reason": self.reason}

    @classmethod
    def from_wire(cls, d: dict) -> "Bye":
        return cls(reason=_str(d.get("reason", ""), "reason"))


@dataclass(slots=True)
class Register:
    """W->B: a worker offers its slots for one model; the broker answers ``welcome``.

    - ``model``: ``str`` the model name clients ask for.
    - ``num_slots``: ``int >= 1`` the engine's batch size.
    - ``max_inflight``: ``int >= num_slots`` credits: requests the broker may
      have assigned to this worker at once (slots plus a small prefetch so a
      freed slot is refilled in the next iteration without a round trip).
    - ``info``: :class:`ModelInfo`.
    - ``worker_name``: ``str`` for logs and ``status``.
    """

    op: ClassVar[Op] = Op.REGISTER
    model: str
    num_slots: int
    max_inflight: int
    info: ModelInfo = field(default_factory=ModelInfo)
    worker_name: str = ""

    def to_wire(self) -> dict:
        return {"model": self.model, "num_slots": self.num_slots, "max_inflight": self.max_inflight,
                "info": self.info.to_wire(), "worker_name": self.worker_name}

    @classmethod
    def from_wire(cls, d: dict) -> "Register":
        num_slots = _int(_get(d, "num_slots"), "num_slots")
        max_inflight = _int(d.get("max_inflight", num_slots), "max_inflight")
        if num_slots < 1 or max_inflight < num_slots:
            raise ProtocolError(ErrorCode.MALFORMED, "need num_slots >= 1 and max_inflight >= num_slots")
        return cls(model=_str(_get(d, "model"), "model"), num_slots=num_slots, max_inflight=max_inflight,
                   info=ModelInfo.from_wire(d.get("info", {})),
                   worker_name=_str(d.get("worker_name", ""), "worker_name"))


Message = Union[Hello, Welcome, Submit, Assign, Cancel, Iteration, Results, Error, Heartbeat,
                StatusQuery, Status, Bye, Register]

MESSAGE_TYPES: dict[Op, type] = {
    cls.op: cls
    for cls in (Hello, Welcome, Submit, Assign, Cancel, Iteration, Results, Error, Heartbeat,
                StatusQuery, Status, Bye, Register)
}

CLIENT_TO_BROKER = frozenset({Op.HELLO, Op.SUBMIT, Op.CANCEL, Op.HEARTBEAT, Op.STATUS_QUERY, Op.BYE})
"""Ops the broker accepts on its frontend (from clients)."""
WORKER_TO_BROKER = frozenset({Op.REGISTER, Op.ITERATION, Op.HEARTBEAT, Op.BYE})
"""Ops the broker accepts on its backend (from workers)."""
BROKER_TO_CLIENT = frozenset({Op.WELCOME, Op.RESULTS, Op.ERROR, Op.HEARTBEAT, Op.STATUS})
"""Ops a client accepts."""
BROKER_TO_WORKER = frozenset({Op.WELCOME, Op.ASSIGN, Op.CANCEL, Op.HEARTBEAT, Op.ERROR})
"""Ops a worker accepts."""
