"""The gateway process's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from protocol import defaults
from protocol.endpoints import check_endpoint
from protocol.validation import as_seconds

DEFAULT_BROKER = defaults.CLIENT_ENDPOINT
"""The broker's client endpoint, by default: :data:`protocol.defaults.CLIENT_ENDPOINT`."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything :func:`gateway.run` needs.

    - ``broker``: the broker's client endpoint (``tcp://host:port``).
    - ``host`` / ``port``: the HTTP address to bind (``port=0`` picks a free
      one; the bound address is reported to ``run``'s ``on_ready``).
    - ``curve``: CURVE keys for the gateway's broker connections, as
      ``Client(curve=...)`` takes them (a ``slotserve keygen`` directory), or None.
    - ``max_body_bytes``: larger request bodies get HTTP 413 (bytes).
    - ``max_choices``: most slotserve requests one HTTP request may start
      (prompts x ``n``); more get HTTP 400.
    - ``default_chat_max_tokens``: ``max_tokens`` of a chat request that sets
      neither ``max_tokens`` nor ``max_completion_tokens`` (OpenAI's default is
      "up to the context", which the gateway cannot compute: the worker
      tokenizes the messages). Completions default to 16, as OpenAI documents.
      Either default is sent as a bound the worker lowers to what the context
      leaves after the prompt (``clamp_max_tokens``), never a reason to refuse
      a prompt that fits.
    - ``reasoning_parser``: ``"deepseek_r1"`` or ``"qwen3"``: a chat answer's
      ``<think>...</think>`` goes to ``reasoning_content`` (:mod:`gateway.reasoning`);
      ``"openai_gptoss"``: gpt-oss's analysis channel does (:mod:`gateway.harmony`);
      ``"none"``: the thinking stays in the answer; None (the default): each model's own
      format, as its worker reads it from the chat template (``ModelInfo.reasoning``; none for a
      template without ``<think>`` or ``<|channel|>``), as llama.cpp detects it.
    - ``on_demand_models``: served names of models loaded on demand
      (``slotserve up`` with several models): a request for one whose worker
      is not running waits in the broker's queue while it loads (no 503),
      and ``/v1/models`` lists each with its ``status`` (loaded, loading,
      unloaded), as llama.cpp's router mode does.
    - ``on_demand_aliases``: ``((alias, primary), ...)``: which of ``on_demand_models`` name one
      model (each model's served names, its primary first: ``slotserve up`` gives them), so that
      ``/v1/models`` and the 404's list put each model's primary name first while it is unloaded
      (the broker learns a model's aliases only when its worker registers); each name one of
      ``on_demand_models``.
    - ``tool_call_parser``: the syntax a chat answer's tool calls are read in, and
      the one ``tool_choice: "required"`` enforces (:mod:`gateway.tool_parsers`):
      ``"hermes"`` (the default: Qwen2.5, Hermes), ``"llama3_json"``,
      ``"mistral"`` or ``"qwen3_coder"``, vLLM's names; or ``"auto"``: the one
      each model's chat template asks for (its tokenizer's, :func:`gateway.tool_parsers.detect_parser`).
    - ``status_interval_s``: seconds between the gateway's status queries to
      the broker (served models for ``/v1/models`` and the 404/503 checks).
    - ``connect_timeout_s``: seconds one connection attempt to the broker
      waits for its welcome (the gateway keeps retrying; meanwhile HTTP
      requests get 503).
    - ``shutdown_timeout_s``: seconds the requests and streams in flight get
      to finish once the gateway is asked to stop (while new ones get 503);
      then those still open are ended: a stream with a final error event and
      ``[DONE]``, a request not answered yet with 503 (:mod:`gateway.drain`).
      0: end them at once.
    - ``access_log``: uvicorn's per-request access log (off: it costs CPU at
      high request rates).
    - ``api_keys``: when not empty, every ``/v1/*`` request needs
      ``Authorization: Bearer KEY`` with one of these keys (else 401;
      :mod:`gateway.auth`). ``/health`` stays open for probes.
    - ``metrics_api_keys``: when not empty, ``/metrics`` needs one of these
      keys the same way (a scraper's keys, apart from the API's); else it is open.
    - ``allowed_origins``: the origins a browser page may call the server from
      (CORS, Starlette's ``CORSMiddleware``: ``"*"`` any, else exact origins such
      as ``"https://app.example"``); ``()`` (the default): no CORS headers, so
      browsers refuse other origins' pages (the server listens on 127.0.0.1,
      without keys by default: a page a browser opens would reach it; vLLM
      allows every origin). ``allowed_methods`` / ``allowed_headers``: what a
      preflight may ask for (``"*"``: any), with ``allowed_origins`` only.
    - ``tokenizer``: the tokenizer that renders token strings (logprobs, echo)
      and serves ``/tokenize``: a model alias, folder or ``.gguf`` file, loaded
      by the loader the CLI gives :func:`gateway.run` (:mod:`gateway.tokenizer`);
      None: each served model's own name, when it names a local model.
    - ``responses_store_max`` / ``responses_store_max_age_s``: the bounds of the in-memory store of
      ``/v1/responses`` answers (``previous_response_id``, ``GET``): at most this many responses
      (the oldest dropped first), each kept at most this many seconds (:mod:`gateway.response_store`).

    Keys are Bearer tokens as RFC 6750 defines them (letters, digits and
    ``-._~+/``, then optional ``=``: what ``secrets.token_urlsafe``, base64,
    hex and OpenAI-style ``sk-...`` keys are made of). They are left out of
    ``repr`` so that a logged config never shows them.
    """

    broker: str = DEFAULT_BROKER
    host: str = "127.0.0.1"
    port: int = 8000
    curve: object = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_choices: int = 1024
    default_chat_max_tokens: int = 1024
    status_interval_s: float = 1.0
    connect_timeout_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    access_log: bool = False
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    metrics_api_keys: tuple[str, ...] = field(default=(), repr=False)
    tokenizer: str | None = None
    reasoning_parser: str | None = None
    on_demand_models: tuple[str, ...] = ()
    on_demand_aliases: tuple[tuple[str, str], ...] = ()
    responses_store_max: int = 1000
    responses_store_max_age_s: float = 3600.0
    tool_call_parser: str = "hermes"
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        check_endpoint(self.broker, bind=False, name="broker")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty address, got {self.host!r}")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("max_body_bytes", "max_choices", "default_chat_max_tokens", "responses_store_max"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("status_interval_s", "connect_timeout_s", "responses_store_max_age_s"):
            as_seconds(getattr(self, name), name)
        as_seconds(self.shutdown_timeout_s, "shutdown_timeout_s", allow_zero=True)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer.strip()):
            raise ValueError(f"tokenizer must be a non-empty model name or path, or None, got {self.tokenizer!r}")
        if self.reasoning_parser is not None:
            from gateway.reasoning import PARSERS

            if self.reasoning_parser not in (*PARSERS, "none"):
                raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, none or None (the "
                                 f"model's own), got {self.reasoning_parser!r}")
        pairs = self.on_demand_aliases
        if not isinstance(pairs, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(n in self.on_demand_models for n in p) for p in pairs):
            raise ValueError("on_demand_aliases must be a tuple of (alias, primary) pairs of on_demand_models' names, "
                             f"got {pairs!r}")
        from gateway.tool_parsers import check_choice

        check_choice(self.tool_call_parser)
        for name in ("api_keys", "metrics_api_keys"):
            object.__setattr__(self, name, _keys(name, getattr(self, name)))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) and x.strip() == x and x for x in v):
                raise ValueError(f"{name} must be a tuple of non-empty strings ('*': any), got {v!r}")


_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 section 2.1, b64token

API_KEY_RULE = ("keys are Bearer tokens made of letters, digits and -._~+/ (then optional =), with no spaces; "
                "make one with python -c 'import secrets; print(secrets.token_urlsafe(32))'")
"""What makes a string an API key, for error messages."""


def is_api_key(key: object) -> bool:
    """Whether ``key`` can be an API key (see :data:`API_KEY_RULE`)."""
    return isinstance(key, str) and _BEARER_TOKEN.fullmatch(key) is not None


def _keys(name: str, keys) -> tuple[str, ...]:
    """``keys`` as a tuple, each one checked; a message names a bad key by its place, never by its value."""
    if isinstance(keys, str) or not isinstance(keys, (tuple, list)):
        raise ValueError(f"{name} must be a tuple of strings, got a {type(keys).__name__}")
    for i, k in enumerate(keys):
        if not is_api_key(k):
            raise ValueError(f"{name}[{i}] is not a usable API key: {API_KEY_RULE}")
    return tuple(keys)
