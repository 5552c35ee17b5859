"""Typed wire messages: one class per ``op``, plus the records they carry.

A message travels as one msgpack map: the protocol version ``v``
(:data:`PROTOCOL_VERSION`), its ``op``, and its fields by name.
:mod:`protocol.codec` encodes and decodes every class here generically from
its declared fields; nothing in this module spells a field twice.

Two kinds of class, both immutable:

- **messages** (one per ``op``): frozen dataclasses, built once per batch of
  requests; a list given for a tuple field is stored as a tuple.
  ``__post_init__`` holds the rules a field's type cannot say.
- **records**, the per-request parts inside messages (:class:`Envelope`,
  :class:`Finished`, :class:`Text`, ...): NamedTuples, built several times
  per request, where a tuple costs a fraction of a frozen dataclass; they
  travel as msgpack arrays, fields in declaration order.

Who sends what (``C`` client, ``B`` broker, ``W`` worker)::

    C->B  hello, submit, cancel, heartbeat, status_query, model_order, demand, bye
    B->C  welcome, results, error, heartbeat, status
    W->B  loading, register, iteration, heartbeat, bye
    B->W  welcome, assign, cancel, heartbeat, error

Request ids: a client chooses its own (``int`` or ``str``), scoped to that
client; the broker keys requests by (client, id) and gives each worker its
own ``int`` key instead, so worker-side ids (``assign``, ``iteration``,
``cancel`` on the backend) are broker keys, never client ids. A request's
:class:`~protocol.request.RequestParams` never change on the way; ids,
resume tokens and the time left travel beside them in an :class:`Envelope`.

Batching: ``submit`` and ``assign`` carry many requests; ``iteration`` (one per
worker iteration) carries the new tokens of every slot, and ``results`` the
same grouped for one client, so message rate follows iterations, not tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import typing
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Union

from protocol.defaults import MAX_MESSAGE_BYTES, MIN_HEARTBEAT_INTERVAL_S, MIN_MESSAGE_BYTES
from protocol.enums import ErrorCode, FinishReason, ModelAction, ModelState
from protocol.logprobs import TokenLogprob
from protocol.request import RequestId, RequestParams
from protocol.validation import echo

PROTOCOL_VERSION = 16
"""Bumped on any incompatible change; a peer with another version gets ``unsupported_version``.
(2: one request definition, generic codec, records as arrays. 3: ``loading``;
frame limits in ``welcome`` and ``register``; loading models in ``welcome`` and ``status``.
4: the error code ``context_length_exceeded``, which a v3 peer would refuse to decode.
5: served-name ``aliases`` in ``loading``, ``register``, ``welcome`` and ``status``; prompt
lengths (``started``) with a request's first tokens in ``iteration`` and ``results``: fields a
v4 peer would refuse to decode. 6: ``logprobs`` and ``prompt_logprobs`` request fields (a request is an
array of its fields), token ``logprobs`` in ``iteration`` and ``results``. 7: ``cached_tokens`` in
``finished`` and ``started`` records, ``prefix_cache`` (:class:`PrefixCacheUsage`) in a worker's
``heartbeat`` and in ``status``'s workers: records and fields a v6 peer would refuse to decode (as it
would the request field ``tools`` and a chat message's ``tool_calls``, which came in the same version).
8: ``runs`` in :class:`ModelInfo` (what the worker runs: precision and kernels), a field a v7 peer
would refuse to decode. 9: the request field ``clamp_max_tokens`` (a default budget the context
lowers), which a v8 peer would refuse to decode. 10: embeddings: the request field ``kind``
(:class:`~protocol.enums.RequestKind`), :class:`EmbeddingVector` records (``embeddings``) in ``iteration``
and ``results``, and :class:`ModelInfo`'s ``embedding_size`` and ``matryoshka_dims``; the request field
``chat_template_kwargs`` (extra chat template variables); a chat message's ``tool_call_id`` and ``name``
(its wire array ``[role, content, tool_calls, tool_call_id, name]``); and ``reasoning`` in
:class:`ModelInfo` (the model's thinking format): fields a v9 peer would refuse to decode (and a v9
worker would take an embedding request for a generation one). 11: ``chat_template`` in :class:`ModelInfo`
(the template a worker's ``--chat-template`` gave it, which the gateway's ``/tokenize`` and
``--tool-call-parser auto`` read), a field a v10 peer would refuse to decode; and the constraint
``think`` ``"openai_gptoss"`` (:mod:`protocol.structured`), which a v10 worker would refuse.
12: ``loading_workers`` in ``status`` (which worker loads which model: a supervisor finds one frozen in
its load by it), a field a v11 peer would refuse to decode. 13: the request fields
``continue_final_message`` and ``add_generation_prompt`` (how a chat prompt ends: the final message
continued, a prefill), which a v12 peer would refuse to decode. 14: ``on_demand`` in ``welcome``
(the models a supervisor loads when a request names them: a client resolves and waits for its
model by them), a field a v13 peer would refuse to decode. 15: ``model_order`` (``POST /models/load|unload``
through the broker) and ``demand`` (the supervisor's models on demand and the orders it took), ops a v14
broker would refuse, and ``on_demand`` and ``orders`` in ``status`` (each model on demand's state, shown from
the moment its load or unload is accepted), fields a v14 peer would refuse to decode. 16: ``query`` in
``status_query``, ``model_order`` and ``status`` (the client's number for a query, which the status
that answers it carries: a late answer to an earlier query that timed out is not taken for the next
one's), a field a v15 peer would refuse to decode.
A record of the older shape, without its trailing fields, still decodes here, its new fields None.)"""


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
    MODEL_ORDER = "model_order"
    DEMAND = "demand"
    BYE = "bye"
    REGISTER = "register"
    LOADING = "loading"
    ASSIGN = "assign"
    ITERATION = "iteration"

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------- records


class Envelope(NamedTuple):
    """One request on its way (inside ``submit`` and ``assign``): its parameters
    and the routing data that is not part of them.

    - ``request_id``: the client's id in ``submit``, the broker's ``int`` key in ``assign``.
    - ``params``: the request's :class:`~protocol.request.RequestParams`, unchanged from the caller.
    - ``resume_tokens``: tokens already generated elsewhere (migration, a
      resubmission after a broker restart); they count toward ``max_tokens``
      and are not streamed again.
    - ``time_left_s``: seconds left of the request's deadline when it already
      waited elsewhere (None: ``params.timeout_s`` counts from arrival).
    """

    request_id: RequestId
    params: RequestParams
    resume_tokens: tuple[int, ...] = ()
    time_left_s: float | None = None


class Rejected(NamedTuple):
    """What the decoder puts in place of an :class:`Envelope` whose parameters are
    invalid, so one bad request in a batch fails alone (the receiver ends it
    with ``bad_request`` and ``message``). Never sent."""

    request_id: RequestId
    message: str


class Finished(NamedTuple):
    """The terminal notice for one request (inside ``iteration`` and ``results``).

    - ``request_id``: broker key from a worker, client id to a client.
    - ``finish_reason``: :class:`FinishReason`.
    - ``code``: :class:`ErrorCode` when ``finish_reason`` is ``error``, else ``None``.
    - ``message``: human-readable detail for an error, else ``None``.
    - ``prompt_tokens``: prompt length in tokens when the worker knows it
      (text prompts are tokenised there), else ``None``.
    - ``stop_reason``: for ``stop``, the stop token (int) the request named in its own
      ``stop_token``, stop sequence (ids) or text stop string (str) that matched, as vLLM's
      ``stop_reason``; None when the default end tokens (the model's EOS) stopped it.
    - ``cached_tokens``: prompt tokens whose KV the worker that finished the request took from
      its prefix cache instead of prefilling them (0: a miss, or a model without a prefix
      cache), as OpenAI's ``usage.prompt_tokens_details.cached_tokens``; None when that worker
      never finished prefilling the prompt (it ended first), or from the broker. A migrated
      request's count is its last worker's (as vLLM counts the tokens its engine skipped).

    The request's last tokens travel in the same message's ``ids``/``tokens``.
    """

    request_id: RequestId
    finish_reason: FinishReason
    code: ErrorCode | None = None
    message: str | None = None
    prompt_tokens: int | None = None
    stop_reason: int | tuple[int, ...] | str | None = None
    cached_tokens: int | None = None


class Started(NamedTuple):
    """What a worker tells of a request with its first tokens (inside ``iteration``
    and ``results``, in the message that carries them): ``prompt_tokens``, the
    prompt's length in tokens. Sent only for text and chat prompts, which the
    worker tokenises (a token-id prompt's length is known to its sender), so
    usage can be reported while the request streams; once per request and
    worker (a migrated request's next worker sends it again, the same).
    ``cached_tokens``: of those, the tokens taken from the worker's prefix
    cache (as in :class:`Finished`; None from a v6-shaped record)."""

    request_id: RequestId
    prompt_tokens: int
    cached_tokens: int | None = None


class Logprobs(NamedTuple):
    """The token log-probabilities of one request's tokens in a message (inside
    ``iteration`` and ``results``), for requests that ask (``logprobs`` /
    ``prompt_logprobs`` set; see :mod:`protocol.logprobs`).

    - ``entries``: one :class:`~protocol.logprobs.TokenLogprob` per token of
      ``request_id`` in the same message, in order (a request's records in
      one message, taken in order, cover exactly its tokens there); ``()``
      when only ``prompt`` is sent, or the request asked for ``prompt_logprobs`` alone.
    - ``prompt``: once per request, in the message with its first tokens:
      one entry per prompt token, the first None (nothing before it); None
      otherwise. A resumed request (migration, resubmission) has none again:
      its caller has them (a receiver keeps the first it got and ignores
      any later one).
    - ``prompt_ids``: with ``prompt``, for text and chat prompts (which the
      worker tokenised), the prompt's token ids, one per ``prompt`` entry,
      so the receiver can name the tokens scored; None otherwise (a token-id
      prompt's are known to its sender).

    Values are natural logarithms, ``-inf`` for a token of probability 0
    (msgpack carries it; JSON outputs clamp it, see ``slotserve run``).
    """

    request_id: RequestId
    entries: tuple[TokenLogprob, ...] = ()
    prompt: tuple[TokenLogprob | None, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None


class Text(NamedTuple):
    """Newly released text of one request (models with a tokenizer), sent in the
    same message as the tokens it belongs to. The pieces of a request add up to
    its ``text`` (see :mod:`worker.text`): after any number of tokens they are
    the same function of those tokens, whichever worker produced them, so a
    request that moves to another worker continues its text without a gap."""

    request_id: RequestId
    text: str


class EmbeddingVector(NamedTuple):
    """One request's embedding (inside ``iteration`` and ``results``, in the message that ends it):
    ``vector``, the pooled (and, as the model's configuration says, normalised) embedding of its
    prompt as little-endian float32 values, 4 bytes each (``embedding_size`` of them; what OpenAI's
    ``encoding_format: "base64"`` encodes). Sent once, just before the request's ``finished`` entry,
    by a worker serving an embedding model (``kind`` embed)."""

    request_id: RequestId
    vector: bytes


class ModelInfo(NamedTuple):
    """What a worker's model accepts (from ``register``, shown in ``welcome``).

    - ``vocab_size``: token ids lie in ``[0, vocab_size)``, or ``None`` (unknown).
    - ``max_seq_len``: prompt + ``max_tokens`` limit in tokens, or ``None``.
    - ``eos_token_ids``: the worker's default stop tokens.
    - ``has_tokenizer``: whether text prompts / chat messages work.
    - ``runs``: what the worker runs the model as, for people (``/v1/models``, ``status``): the
      precision and the linears' kinds, e.g. ``"gguf: Q4_K x 169, Q6_K x 29 (compiled kernel,
      AMX-BF16)"``; ``""`` when the model does not say.
    - ``embedding_size``: for an embedding model (its requests are ``kind`` embed), the length of
      its embeddings (floats); None for a generation model. ``max_seq_len`` is then the longest
      prompt it embeds.
    - ``matryoshka_dims``: the shorter lengths an embedding may be cut to (OpenAI's ``dimensions``:
      the first values, renormalised), for a model trained so (Matryoshka representation learning,
      Kusupati et al. 2022): the checkpoint's ``matryoshka_dimensions`` (as vLLM reads them), or
      every length when it says only ``is_matryoshka``; ``()`` for any other model (no cut).
    - ``reasoning``: how its chat template lets the model think, as a reasoning parser's name
      (``"deepseek_r1"``, ``"qwen3"``; :mod:`gateway.reasoning`), ``""`` for none: the parser the
      gateway uses for it unless ``--reasoning-parser`` says otherwise.
    - ``chat_template``: the Jinja text of the chat template the worker renders chats with when
      it was given one (``--chat-template``), replacing its tokenizer's; ``""`` when it renders with
      the tokenizer's own. The gateway renders ``/tokenize``'s chats and reads the tool-call
      syntax (``--tool-call-parser auto``) from the same template.
    """

    vocab_size: int | None = None
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    has_tokenizer: bool = False
    runs: str = ""
    embedding_size: int | None = None
    matryoshka_dims: tuple[int, ...] = ()
    reasoning: str = ""
    chat_template: str = ""


class PrefixCacheUsage(NamedTuple):
    """A worker's prefix cache (``heartbeat``, and its line in ``status``), cumulative since
    the worker started (see ``worker.models.llama.prefix_cache``).

    - ``queries``: tokens of the sequences looked up in the cache (vLLM's ``prefix_cache_queries``).
    - ``hits``: of them, tokens found, whose KV was copied instead of prefilled (``prefix_cache_hits``).
    - ``used_bytes``: bytes of the blocks held now; ``budget_bytes``: the cache's budget
      (``--prefix-cache-mb``, rounded down to whole blocks).
    """

    queries: int
    hits: int
    used_bytes: int
    budget_bytes: int


class ModelStatus(NamedTuple):
    """One model's line in ``status``: requests ``queued`` in the broker and
    ``running`` on workers, ``workers`` registered, ``slots_busy`` / ``slots_total``,
    and workers still ``loading`` it (announced, not yet registered)."""

    queued: int
    running: int
    workers: int
    slots_busy: int
    slots_total: int
    loading: int = 0


class DemandState(NamedTuple):
    """One model on demand's state (``status``'s ``on_demand``, the supervisor's ``demand``).

    - ``state``: :class:`~protocol.enums.ModelState`.
    - ``failed``: its last load failed (``state`` is ``unloaded``; llama.cpp's router's
      ``"failed": true``): its worker exited before it registered, or it cannot fit in memory now.
    - ``exit_code``: that worker's exit code (negative: the signal that killed it), None when
      there is no process to speak of (it did not fit) or it is not known.
    - ``reason``: what went wrong, in words ("" when nothing is known: a worker killed while it
      started says nothing).
    """

    state: ModelState
    failed: bool = False
    exit_code: int | None = None
    reason: str = ""


class PendingOrder(NamedTuple):
    """A ``model_order`` the broker took that its supervisor has not taken yet (``status``'s
    ``orders``): ``seq``, the broker's number for it (from 1, growing; the supervisor's ``demand``
    says up to which it took them), ``action`` (:class:`~protocol.enums.ModelAction`) and ``model``
    (a served name of a model on demand, as ordered: an alias too)."""

    seq: int
    action: ModelAction
    model: str


class WorkerStatus(NamedTuple):
    """One worker's line in ``status``: ``inflight`` requests assigned of
    ``num_slots``; ``iterations`` that produced tokens; ``suspect``: found hung,
    gets no requests until it progresses; ``prefix_cache``: its latest
    :class:`PrefixCacheUsage` report, None for a worker without a prefix cache
    (or before its first heartbeat)."""

    name: str
    model: str
    num_slots: int
    inflight: int
    iterations: int
    suspect: bool
    prefix_cache: PrefixCacheUsage | None = None


# --------------------------------------------------------------------------- messages


class _Message:
    """Base of the message classes: sequences given for ``tuple`` fields are
    stored as tuples (a list passed in could be changed later; a tuple cannot)."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for name in _tuple_fields(type(self)):
            value = getattr(self, name)
            if type(value) is not tuple:
                object.__setattr__(self, name, tuple(value))


@functools.cache
def _tuple_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if typing.get_origin(hints[f.name]) is tuple)


@dataclass(frozen=True, slots=True)
class Hello(_Message):
    """C->B: a client introduces itself; the broker answers ``welcome``.
    ``client_name``: free text for logs and ``status``."""

    op: ClassVar[Op] = Op.HELLO
    client_name: str = ""


@dataclass(frozen=True, slots=True)
class Welcome(_Message):
    """B->C answer to ``hello`` (and sent again to every client when the
    models served or loading change); B->W answer to ``register`` and ``loading``.

    - ``broker_id``: a fresh id per broker start (a change means the broker
      restarted and forgot everything in flight).
    - ``heartbeat_interval_s``: seconds between heartbeats: the broker's, and
      the period every peer heartbeats at from now on (the broker's liveness
      windows are several of these periods).
    - ``models``: ``{name: ModelInfo}`` models that have workers registered.
    - ``max_message_bytes``: the largest frame the broker decodes (bytes);
      peers keep every frame they send it within this.
    - ``loading``: models a worker is loading (announced, not yet
      registered); their requests wait in the queue.
    - ``register_grace_s``: seconds left of the broker's start-up grace, in
      which requests for a model nobody serves or loads yet wait (after a
      broker restart, workers re-register shortly); 0 once it is over, when
      such requests end ``unknown_model`` at once.
    - ``aliases``: ``{alias: model}`` the other names of the models in
      ``models`` and ``loading`` (their workers' ``aliases``): a request for
      an alias is served as one for its model (named by its primary name).
    - ``on_demand``: the names of the models a supervisor loads when a request
      names them (the broker's ``on_demand_models``: ``slotserve up`` with
      several models), loaded now or not: requests for one wait in its queue
      while it loads, never ``unknown_model`` (protocol 14).
    """

    op: ClassVar[Op] = Op.WELCOME
    broker_id: str
    heartbeat_interval_s: float
    models: dict[str, ModelInfo] = field(default_factory=dict)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    loading: tuple[str, ...] = ()
    register_grace_s: float = 0.0
    aliases: dict[str, str] = field(default_factory=dict)
    on_demand: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _Message.__post_init__(self)  # (slots=True dataclasses cannot use bare super())
        if (not self.heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S or self.max_message_bytes < MIN_MESSAGE_BYTES
                or self.register_grace_s < 0):
            raise ValueError(f"need heartbeat_interval_s >= {MIN_HEARTBEAT_INTERVAL_S}, max_message_bytes >= "
                             f"{MIN_MESSAGE_BYTES} and "
                             "register_grace_s >= 0, "
                             f"got {self.heartbeat_interval_s}, {self.max_message_bytes}, {self.register_grace_s}")


@dataclass(frozen=True, slots=True)
class Submit(_Message):
    """C->B: new requests (client ids), all for one ``model`` (as workers register it).

    Each request ends in exactly one ``finished`` entry of a ``results``
    message (or an ``error`` naming it when the whole message was refused).
    A decoded ``requests`` may hold :class:`Rejected` entries.
    """

    op: ClassVar[Op] = Op.SUBMIT
    model: str
    requests: tuple[Envelope, ...]


@dataclass(frozen=True, slots=True)
class Assign(_Message):
    """B->W: requests (broker keys) for the worker's slots; never more than its
    credits. A decoded ``requests`` may hold :class:`Rejected` entries."""

    op: ClassVar[Op] = Op.ASSIGN
    requests: tuple[Envelope, ...]


@dataclass(frozen=True, slots=True)
class Cancel(_Message):
    """C->B (client ids) or B->W (broker keys): cancel these requests. Unknown or
    finished ids are ignored (a cancel may cross the request's end)."""

    op: ClassVar[Op] = Op.CANCEL
    request_ids: tuple[RequestId, ...]


@dataclass(frozen=True, slots=True)
class _TokenBatch(_Message):
    """Shared shape of ``iteration`` and ``results``.

    - ``ids``, ``tokens``: parallel: ``tokens[i]`` is the next generated token
      of request ``ids[i]``; a request appears once per iteration (more often
      only if it generated several tokens, in order). Flat sequences keep
      decoding at C speed.
    - ``texts``: newly released text per request (models with a tokenizer).
    - ``finished``: requests that ended; their final tokens are in this message.
    - ``started``: the prompt lengths of requests whose first tokens are in
      this message (text and chat prompts only; see :class:`Started`).
    - ``logprobs``: the token log-probabilities of the requests that ask for
      them (:class:`Logprobs`): for each request with entries, its records'
      entries cover its tokens in this message exactly, in order (checked).
    - ``embeddings``: the embeddings of the embedding requests that end in this
      message (:class:`EmbeddingVector`), each before its ``finished`` entry is applied.
    """

    ids: tuple[RequestId, ...] = ()
    tokens: tuple[int, ...] = ()
    texts: tuple[Text, ...] = ()
    finished: tuple[Finished, ...] = ()
    started: tuple[Started, ...] = ()
    logprobs: tuple[Logprobs, ...] = ()
    embeddings: tuple[EmbeddingVector, ...] = ()

    def __post_init__(self) -> None:
        _Message.__post_init__(self)  # (slots=True dataclasses cannot use bare super())
        if len(self.ids) != len(self.tokens):
            raise ValueError(f"ids ({len(self.ids)}) and tokens ({len(self.tokens)}) must be as long")
        if self.logprobs:  # (only messages of requests that ask pay for the count)
            _check_logprobs(self.ids, self.logprobs)


def _check_logprobs(ids: tuple[RequestId, ...], records: tuple[Logprobs, ...]) -> None:
    """ValueError unless each request with entries in ``records`` has as many as its tokens in ``ids``
    (a request with only ``prompt`` entries, which asked for ``prompt_logprobs`` alone, has none)."""
    entries: dict[RequestId, int] = {}
    for r in records:
        if r.entries:
            entries[r.request_id] = entries.get(r.request_id, 0) + len(r.entries)
    tokens = collections.Counter(ids)
    for rid, n in entries.items():
        if tokens[rid] != n:
            raise ValueError(f"request {echo(rid)} has {tokens[rid]} tokens and {n} logprobs entries in this "
                             "message; each token needs one")


@dataclass(frozen=True, slots=True)
class Iteration(_TokenBatch):
    """W->B: one engine iteration's output (broker keys); each ``finished`` entry
    returns one credit (one slot) to the worker. Fields as in :class:`_TokenBatch`."""

    op: ClassVar[Op] = Op.ITERATION


@dataclass(frozen=True, slots=True)
class Results(_TokenBatch):
    """B->C: one worker iteration's output for one client (client ids); also
    broker-side endings (``queue_full``, queued deadline, cancellation before
    dispatch). Fields as in :class:`_TokenBatch`."""

    op: ClassVar[Op] = Op.RESULTS


@dataclass(frozen=True, slots=True)
class Error(_Message):
    """B->C or B->W: a per-call error (the message sent could not be honoured).

    - ``code``: :class:`ErrorCode`; ``message``: what went wrong and what to do next.
    - ``request_ids``: requests the error ends (each gets its terminal
      ``error`` through this message), possibly none.
    """

    op: ClassVar[Op] = Op.ERROR
    code: ErrorCode
    message: str
    request_ids: tuple[RequestId, ...] = ()


@dataclass(frozen=True, slots=True)
class Heartbeat(_Message):
    """Any direction: "I am alive" when a peer has sent nothing else for an interval.

    - ``broker_id``: set by the broker, so a peer notices a restart.
    - ``progress``: set by a worker: iterations completed so far (a hung
      worker heartbeats but stops progressing while it has work).
    - ``prefix_cache``: set by a worker with a prefix cache: its
      :class:`PrefixCacheUsage` now. Such a worker also heartbeats while busy,
      once per interval when the numbers changed, so ``status`` and the
      metrics follow a busy worker within an interval.
    """

    op: ClassVar[Op] = Op.HEARTBEAT
    broker_id: str | None = None
    progress: int | None = None
    prefix_cache: PrefixCacheUsage | None = None


@dataclass(frozen=True, slots=True)
class StatusQuery(_Message):
    """C->B: ask for a :class:`Status` snapshot (``slotserve status``). ``query``: the client's number for
    this query (from 1, growing; 0: none), which the status that answers it carries (``Status.query``):
    an answer that comes after its query timed out is not taken for the next one's."""

    op: ClassVar[Op] = Op.STATUS_QUERY
    query: int = 0


@dataclass(frozen=True, slots=True)
class Status(_Message):
    """B->C: the broker's state.

    - ``broker_id``; ``uptime_s``: seconds since start.
    - ``models``: ``{name: ModelStatus}``; ``workers``: one :class:`WorkerStatus` each.
    - ``clients``: clients seen within the liveness window.
    - ``counters``: ``{name: int}`` totals since start (submitted, finished, errors, requeued, ...).
    - ``aliases``: ``{alias: model}`` as in :class:`Welcome` (the models of ``models``), and the other
      served names of the models on demand, as their supervisor gave them (``models`` lists each such
      model by its own name only).
    - ``loading_workers``: ``{worker name: model}`` of the workers loading a model (announced, not
      registered yet, not silent): what a supervisor watches to find a worker frozen in its load.
    - ``on_demand``: ``{model: DemandState}`` of each model on demand (by its primary name): the
      supervisor's last ``demand``, with the orders it has not taken yet and what the broker has
      seen since (a worker registered, a request queued), so that a load or an unload shows from
      the moment it is accepted (:mod:`broker.demand`).
    - ``orders``: the :class:`PendingOrder` s the supervisor has not taken yet (oldest first; one
      per model at most, the last order given: the last order wins).
    - ``query``: the ``query`` of the ``status_query`` or ``model_order`` it answers (0: none given).
    """

    op: ClassVar[Op] = Op.STATUS
    broker_id: str
    uptime_s: float
    models: dict[str, ModelStatus]
    workers: tuple[WorkerStatus, ...]
    clients: int
    counters: dict[str, int]
    aliases: dict[str, str] = field(default_factory=dict)
    loading_workers: dict[str, str] = field(default_factory=dict)
    on_demand: dict[str, DemandState] = field(default_factory=dict)
    orders: tuple[PendingOrder, ...] = ()
    query: int = 0


@dataclass(frozen=True, slots=True)
class ModelOrder(_Message):
    """C->B: load or unload a model on demand (``POST /models/load`` and ``/models/unload``, the
    gateway's). ``model``: a served name of a model of the broker's ``on_demand_models``;
    ``action``: :class:`~protocol.enums.ModelAction`. The broker keeps it for its supervisor, which
    takes it at its next pass, and answers ``status``: its ``on_demand`` shows the order's state at
    once (``loading``, ``unloading``), its ``orders`` lists it (an order for a model that is not on
    demand is not kept, and logged). The order is taken, not done: the state says when it is.
    ``query``: the client's number for it, as :class:`StatusQuery`'s (the status answering it carries it)."""

    op: ClassVar[Op] = Op.MODEL_ORDER
    model: str
    action: ModelAction
    query: int = 0


@dataclass(frozen=True, slots=True)
class Demand(_Message):
    """C->B: what the supervisor of the models on demand (``slotserve up``'s) does, after each of its
    passes; the broker answers nothing.

    - ``broker_id``: the broker whose ``status`` the pass read (``orders_taken`` counts only there:
      a restarted broker numbers its orders from 1 again).
    - ``models``: ``{model: DemandState}``, each model on demand by its primary name.
    - ``aliases``: ``{alias: model}``: the other served names of those models (an order may name one).
    - ``orders_taken``: the ``seq`` of the last :class:`PendingOrder` it took (0: none; >= 0).

    ValueError (``malformed`` on the wire) for a negative ``orders_taken`` or a :class:`DemandState` that
    is not one: ``failed`` in a state other than ``unloaded``, or an ``exit_code`` or a ``reason``
    without ``failed``.
    """

    op: ClassVar[Op] = Op.DEMAND
    broker_id: str
    models: dict[str, DemandState]
    aliases: dict[str, str] = field(default_factory=dict)
    orders_taken: int = 0

    def __post_init__(self) -> None:
        _Message.__post_init__(self)  # (slots=True dataclasses cannot use bare super())
        if self.orders_taken < 0:
            raise ValueError(f"orders_taken must be >= 0 (an order's seq, 0: none), got {self.orders_taken}")
        for model, st in self.models.items():
            if (st.failed and st.state is not ModelState.UNLOADED) or (
                    not st.failed and (st.exit_code is not None or st.reason)):
                raise ValueError(f"model {echo(model)}: a failed load is unloaded, and only a failed one has an "
                                 f"exit code or a reason; got {st.state.value}, failed {st.failed}, exit code "
                                 f"{st.exit_code}, reason {echo(st.reason)}")


@dataclass(frozen=True, slots=True)
class Bye(_Message):
    """C->B or W->B: leaving now. The broker cancels a client's requests, and
    requeues a worker's in-flight requests (with their tokens) at once instead
    of waiting for missed heartbeats. ``reason``: free text for the log.

    ``load_failed`` (a worker that has not registered): it leaves because its model could not
    load or warm up, and ``reason`` says so in words for clients: the requests waiting for that
    model end with them (a model on demand is marked failed). False: it was told to stop (a
    signal) while loading, and the requests wait for the model's next load (on demand: its
    supervisor loads it again while it is wanted)."""

    op: ClassVar[Op] = Op.BYE
    reason: str = ""
    load_failed: bool = False


MAX_SLOTS = 2**32
"""The most credits (``max_inflight``, so slots too) a ``register`` may claim: more cannot be a
real engine's, and the sums over workers in ``status`` then stay within msgpack's 64-bit ints."""


@dataclass(frozen=True, slots=True)
class Register(_Message):
    """W->B: a worker offers its slots for one model; the broker answers ``welcome``.

    - ``model``: the model name clients ask for (the primary one: the broker's queue, ``status``
      and a client's default model name it so).
    - ``aliases``: other names clients may ask for the same model by
      (``--served-model-name``); the broker ignores an empty one, ``model``
      itself, and one that names another model.
    - ``num_slots``: ``>= 1``, the engine's batch size.
    - ``max_inflight``: ``>= num_slots`` (at most :data:`MAX_SLOTS`) credits: requests the broker may have
      assigned to this worker at once (slots plus a small prefetch so a freed
      slot is refilled in the next iteration without a round trip).
    - ``info``: :class:`ModelInfo` (``vocab_size`` and ``max_seq_len`` >= 1 or None, its
      ``eos_token_ids`` within the vocabulary: the broker tells every client of the model
      these, and the gateway adds the EOS ids to a request's ``stop_token_ids``);
      ``worker_name``: for logs and ``status``.
    - ``max_message_bytes``: the largest frame the worker decodes (bytes);
      the broker keeps every ``assign`` within it.
    """

    op: ClassVar[Op] = Op.REGISTER
    model: str
    num_slots: int
    max_inflight: int
    info: ModelInfo = ModelInfo()
    worker_name: str = ""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _Message.__post_init__(self)  # (slots=True dataclasses cannot use bare super())
        if self.num_slots < 1 or not self.num_slots <= self.max_inflight <= MAX_SLOTS \
                or self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"need num_slots >= 1, num_slots <= max_inflight <= {MAX_SLOTS} and max_message_bytes >= "
                             f"{MIN_MESSAGE_BYTES}, got "
                             f"{self.num_slots}, {self.max_inflight}, {self.max_message_bytes}")
        vocab, seq, eos = self.info.vocab_size, self.info.max_seq_len, self.info.eos_token_ids
        if (vocab is not None and vocab < 1) or (seq is not None and seq < 1):
            raise ValueError(f"need info.vocab_size and info.max_seq_len >= 1 or None, got {vocab}, {seq}")
        if eos and (min(eos) < 0 or (vocab is not None and max(eos) >= vocab)):
            raise ValueError(f"info.eos_token_ids must lie in [0, vocab_size), got {echo(eos)}")
        size, dims = self.info.embedding_size, self.info.matryoshka_dims
        if (size is not None and size < 1) or (dims and (size is None or min(dims) < 1 or max(dims) > size)):
            raise ValueError(f"need info.embedding_size >= 1 or None, and info.matryoshka_dims in [1, embedding_size], "
                             f"got {size}, {echo(dims)}")


@dataclass(frozen=True, slots=True)
class Loading(_Message):
    """W->B: a worker starts loading ``model`` (sent before the slow load; it
    sends ``register`` once loaded and warmed up, and heartbeats meanwhile).
    Requests for a model being loaded -- by its name or one of its
    ``aliases`` (as in :class:`Register`) -- wait in its queue instead of
    failing ``unknown_model``. The broker answers ``welcome``.
    ``worker_name``: for logs and ``status``."""

    op: ClassVar[Op] = Op.LOADING
    model: str
    worker_name: str = ""
    aliases: tuple[str, ...] = ()


Message = Union[Hello, Welcome, Submit, Assign, Cancel, Iteration, Results, Error, Heartbeat,
                StatusQuery, Status, ModelOrder, Demand, Bye, Register, Loading]

MESSAGE_TYPES: dict[Op, type] = {
    cls.op: cls
    for cls in (Hello, Welcome, Submit, Assign, Cancel, Iteration, Results, Error, Heartbeat,
                StatusQuery, Status, ModelOrder, Demand, Bye, Register, Loading)
}

CLIENT_TO_BROKER = frozenset({Op.HELLO, Op.SUBMIT, Op.CANCEL, Op.HEARTBEAT, Op.STATUS_QUERY, Op.MODEL_ORDER,
                              Op.DEMAND, Op.BYE})
"""Ops the broker accepts on its frontend (from clients)."""
WORKER_TO_BROKER = frozenset({Op.LOADING, Op.REGISTER, Op.ITERATION, Op.HEARTBEAT, Op.BYE})
"""Ops the broker accepts on its backend (from workers)."""
BROKER_TO_CLIENT = frozenset({Op.WELCOME, Op.RESULTS, Op.ERROR, Op.HEARTBEAT, Op.STATUS})
"""Ops a client accepts."""
BROKER_TO_WORKER = frozenset({Op.WELCOME, Op.ASSIGN, Op.CANCEL, Op.HEARTBEAT, Op.ERROR})
"""Ops a worker accepts."""
