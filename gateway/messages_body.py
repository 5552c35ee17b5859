"""The bodies of ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's
``MessageCreateParams`` and ``MessageCountTokensParams``), and the checks of the fields they take and
do not use: each is checked as Anthropic checks it, so that a value Anthropic refuses is a 400 naming
the field, in the words of Anthropic's own 400s (``metadata.foo: Extra inputs are not permitted``,
``thinking.budget_tokens: Input should be greater than or equal to 1024``), never taken silently.

The values come from Anthropic's API reference and the ``anthropic`` SDK's types (``MetadataParam``,
``OutputConfigParam``, ``ThinkingConfigParam``, ``CacheControlEphemeralParam``, ``service_tier`` and
``speed``'s literals). A check raises :class:`~pydantic_core.PydanticCustomError`, which
:func:`gateway.errors.from_validation` makes a 400 whose message is the check's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from gateway.foreign_fields import Route
from gateway.schemas import in_range, text_or_objects
from protocol.validation import clip

__all__ = ["CACHE_TTLS", "MAX_USER_ID_CHARS", "MIN_THINKING_BUDGET", "OUTPUT_EFFORTS", "SERVICE_TIERS", "SPEEDS",
           "THINKING_DISPLAYS", "THINKING_KEYS", "CountTokensRequest", "MessagesRequest", "cache_control_error",
           "json_shown"]


MAX_USER_ID_CHARS = 256
"""The longest ``metadata.user_id`` Anthropic takes, in characters (its API's OpenAPI schema,
``Metadata.user_id``: ``maxLength: 256``)."""


def _metadata(value: Any) -> Any:
    """Anthropic's ``metadata`` (its ``Metadata`` object: no other key): null, or an object whose
    one key is ``user_id``, a string of at most :data:`MAX_USER_ID_CHARS` characters or null.
    Else the error naming the field first, in the words of Anthropic's own 400s; the field is
    not used after (an opaque id for Anthropic's abuse detection)."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", f"metadata: Input should be an object with one key, user_id; got "
                                  f"{json_shown(value)}")
    extra = next((key for key in value if key != "user_id"), None)
    if extra is not None:
        raise PydanticCustomError("invalid_value", f"metadata.{clip(extra)}: Extra inputs are not permitted "
                                  "(metadata takes one key, user_id)")
    user_id = value.get("user_id")
    if user_id is not None and type(user_id) is not str:
        raise PydanticCustomError("invalid_type", f"metadata.user_id: Input should be a valid string or null; got "
                                  f"{json_shown(user_id)}")
    if user_id is not None and len(user_id) > MAX_USER_ID_CHARS:
        raise PydanticCustomError("invalid_value", f"metadata.user_id: String should have at most {MAX_USER_ID_CHARS} "
                                  f"characters, got {len(user_id)}; send an opaque id (a uuid or a hash)")
    return value


Metadata = Annotated[dict[str, Any] | None, BeforeValidator(_metadata)]
"""A Messages body's ``metadata``: ``{"user_id": str | null}`` within Anthropic's bound (:func:`_metadata`)."""

OUTPUT_EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""The values of ``output_config.effort`` Anthropic takes (its API's ``OutputConfig.effort``; the
anthropic SDK's ``OutputConfigParam``)."""


def _output_config(value: Any) -> Any:
    """Anthropic's ``output_config`` (its ``OutputConfig`` object: ``format`` and ``effort``, no
    other key): null, or such an object whose ``effort`` is one of :data:`OUTPUT_EFFORTS` or null;
    ``format`` is checked where it is translated (:func:`gateway.messages_api._response_format`). Else the error naming
    the field first, in the words of Anthropic's own 400s."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", "output_config: Input should be an object (format, effort); got "
                                  f"{json_shown(value)}")
    extra = next((key for key in value if key not in ("format", "effort")), None)
    if extra is not None:
        raise PydanticCustomError("invalid_value", f"output_config.{clip(extra)}: Extra inputs are not permitted "
                                  "(output_config takes format and effort)")
    effort = value.get("effort")
    if effort is not None and (type(effort) is not str or effort not in OUTPUT_EFFORTS):
        raise PydanticCustomError("invalid_value", f"output_config.effort: Input should be {_either(OUTPUT_EFFORTS)}; "
                                  f"got {json_shown(effort)}")
    return value


OutputConfig = Annotated[dict[str, Any] | None, BeforeValidator(_output_config)]
"""A Messages body's ``output_config`` (:func:`_output_config`), shared by ``count_tokens``."""


def _either(values: tuple[str, ...]) -> str:
    """``values`` as Anthropic's errors list them: ``'a', 'b' or 'c'``."""
    return f"{', '.join(map(repr, values[:-1]))} or {values[-1]!r}" if len(values) > 1 else repr(values[0])


def json_shown(value: Any) -> str:
    """``value`` (parsed JSON) as an error shows what the client sent: its JSON, cut as every echoed
    client value is (:func:`protocol.validation.clip`). The Messages checks' ``...; got <value>``
    shows an array or object as its JSON (``got [1]``), where :func:`gateway.schemas._shown` (the
    OpenAI-shaped routes' echo, and :func:`gateway.errors.from_validation`'s) names its type
    (``got list``); scalars read the same in both."""
    return clip(json.dumps(value))


def _one_of(field: str, values: tuple[str, ...]) -> Any:
    """The type of a field whose value is one of ``values`` or null (absent): any other value is a
    400 naming ``field``, in the words of Anthropic's own 400s."""
    def check(value: Any) -> Any:
        if value is not None and (type(value) is not str or value not in values):
            raise PydanticCustomError("invalid_value", f"{field}: Input should be {_either(values)}; got {json_shown(value)}")
        return value

    return Annotated[str | None, BeforeValidator(check)]


SERVICE_TIERS = ("auto", "standard_only")
"""The values of ``service_tier`` Anthropic takes (its API's ``MessageCreateParams.service_tier``)."""

SPEEDS = ("standard", "fast")
"""The values of ``speed`` Anthropic takes (``MessageCreateParams.speed``, and count_tokens')."""

CACHE_TTLS = ("5m", "1h")
"""The values of a ``cache_control``'s ``ttl`` Anthropic takes (its ``CacheControlEphemeral``)."""


def cache_control_error(value: Any) -> str | None:
    """What is wrong with ``value``, a ``cache_control`` (top-level, a block's or a tool's), else None
    (null, or Anthropic's ``CacheControlEphemeral``: ``{"type": "ephemeral"}``, ``ttl`` one of
    :data:`CACHE_TTLS`): the message after the field's name, in the words of Anthropic's 400s."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f': Input should be an object {{"type": "ephemeral"}}; got {json_shown(value)}'
    if value.get("type") != "ephemeral":
        return f".type: Input should be 'ephemeral'; got {json_shown(value.get('type'))}"
    extra = next((key for key in value if key not in ("type", "ttl")), None)
    if extra is not None:
        return f".{clip(extra)}: Extra inputs are not permitted (cache_control takes type and ttl)"
    if "ttl" in value and (type(value["ttl"]) is not str or value["ttl"] not in CACHE_TTLS):
        return f".ttl: Input should be {_either(CACHE_TTLS)}; got {json_shown(value['ttl'])}"
    return None


def _cache_control(value: Any) -> Any:
    error = cache_control_error(value)
    if error is not None:
        raise PydanticCustomError("invalid_value", "cache_control" + error)
    return value


CacheControl = Annotated[dict[str, Any] | None, BeforeValidator(_cache_control)]
"""A Messages body's top-level ``cache_control`` (:func:`cache_control_error`); checked, not used."""

THINKING_KEYS = {"enabled": ("type", "budget_tokens", "display"), "disabled": ("type",),
                 "adaptive": ("type", "display"), "between_tools": ("type",)}
"""The ``type`` values of ``thinking`` Anthropic takes and each one's keys (its API's
``ThinkingConfigParam``: ``ThinkingConfigEnabled`` / ``Disabled`` / ``Adaptive`` / ``BetweenTools``)."""

MIN_THINKING_BUDGET = 1024
"""The least ``thinking.budget_tokens`` Anthropic takes (``ThinkingConfigEnabled.budget_tokens``:
"Must be >= 1024 and less than ``max_tokens``")."""

THINKING_DISPLAYS = ("summarized", "omitted")
"""The values of ``thinking.display`` Anthropic takes."""


def _thinking(value: Any) -> Any:
    """Anthropic's ``thinking`` (:data:`THINKING_KEYS`): null, or an object whose ``type`` is one of
    them, with that type's keys only; ``enabled`` needs an int ``budget_tokens`` of at least
    :data:`MIN_THINKING_BUDGET` (below ``max_tokens`` too: :meth:`gateway.messages_api.MessagesTranslation.chat_body`
    checks that); ``display``, where taken, one of :data:`THINKING_DISPLAYS` or null. Else the error
    naming the field first, in the words of Anthropic's own 400s. Checked, not used (the model thinks as
    its chat template says)."""
    if value is None:
        return value
    kinds = tuple(THINKING_KEYS)
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", f"thinking: Input should be an object whose type is {_either(kinds)}"
                                  f"; got {json_shown(value)}")
    kind = value.get("type")
    if type(kind) is not str or kind not in THINKING_KEYS:
        raise PydanticCustomError("invalid_value", f"thinking.type: Input should be {_either(kinds)}; got {json_shown(kind)}")
    extra = next((key for key in value if key not in THINKING_KEYS[kind]), None)
    if extra is not None:
        raise PydanticCustomError("invalid_value", f"thinking.{clip(extra)}: Extra inputs are not permitted (thinking of "
                                  f"type {kind} takes {', '.join(THINKING_KEYS[kind])})")
    budget = value.get("budget_tokens")
    if kind == "enabled" and "budget_tokens" not in value:
        raise PydanticCustomError("invalid_value", "thinking.budget_tokens: Field required (thinking of type enabled "
                                  f"needs a budget of at least {MIN_THINKING_BUDGET} tokens)")
    if kind == "enabled" and type(budget) is not int:
        raise PydanticCustomError("invalid_type", f"thinking.budget_tokens: Input should be a valid integer; got "
                                  f"{json_shown(budget)}")
    if kind == "enabled" and budget < MIN_THINKING_BUDGET:
        raise PydanticCustomError("invalid_value", "thinking.budget_tokens: Input should be greater than or equal to "
                                  f"{MIN_THINKING_BUDGET}; got {json_shown(budget)}")
    display = value.get("display")
    if display is not None and (type(display) is not str or display not in THINKING_DISPLAYS):
        raise PydanticCustomError("invalid_value", f"thinking.display: Input should be {_either(THINKING_DISPLAYS)} "
                                  f"or null; got {json_shown(display)}")
    return value


Thinking = Annotated[dict[str, Any] | None, BeforeValidator(_thinking)]
"""A Messages body's ``thinking`` (:func:`_thinking`), shared by ``count_tokens``."""


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``'s body (strict, unknown fields 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # None: the one model served
    messages: list[dict[str, Any]]
    system: Annotated[str | list[dict[str, Any]] | None, text_or_objects("system", "text blocks")] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig = None  # format: structured output; effort: not used
    # checked as Anthropic checks them, not used
    thinking: Thinking = None
    cache_control: CacheControl = None
    speed: _one_of("speed", SPEEDS) = None
    # refused unless absent
    mcp_servers: Any = None
    context_management: Any = None

    def unsupported(self) -> str | None:
        return next((name for name in ("mcp_servers", "context_management", "container")
                     if getattr(self, name, None) is not None), None)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``'s body (Anthropic's ``MessageCreateParams``)."""

    hint_route: ClassVar[Route] = Route.MESSAGES  # a llama.cpp or Ollama field's 400 says what to send

    max_tokens: int
    stop_sequences: list[str] | None = None
    # Anthropic's ranges (its API reference's MessageCreateParams): temperature and top_p in [0, 1], top_k
    # >= 0 (the chat path's top_k -1, vLLM's "off", is no Anthropic value)
    temperature: Annotated[float | None, in_range("temperature", 0, 1, words="anthropic")] = None
    top_p: Annotated[float | None, in_range("top_p", 0, 1, words="anthropic")] = None
    top_k: Annotated[int | None, in_range("top_k", 0, words="anthropic")] = None
    stream: bool | None = None
    metadata: Metadata = None  # checked as Anthropic does, not used
    service_tier: _one_of("service_tier", SERVICE_TIERS) = None  # checked, not used
    inference_geo: str | None = None  # accepted, not used (any region: Anthropic's are named per workspace)
    # refused unless absent
    container: Any = None
