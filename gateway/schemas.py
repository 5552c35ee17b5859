"""The HTTP request bodies, as pydantic models (field names, types and defaults
from OpenAI's API reference; extras accepted in the body as vLLM does).

Strict: unknown fields are refused (400, as OpenAI answers "Unrecognized
request argument"), and no type is coerced (``"5"`` is not an int, ``true``
is not a number). Ranges and the rules shared with the Python SDK (token ids,
``max_tokens >= 1``, ``top_p`` in (0, 1], ...) are checked once, by the client
SDK at submission, so HTTP and Python callers get the same messages; where a
vendor's range is narrower than the request's (``temperature`` in [0, 2] on
OpenAI's routes, any >= 0 in Python), the body's field checks it (:func:`in_range`). The
token-id lists (``prompt``, ``stop``, ``stop_token_ids``) are checked entry by
entry before their union types, so ``[1, 2.0]`` is answered "token ids must be
integers: prompt[1] is 2.0", not with the error of the union's first member.

OpenAI fields that slotserve does not implement are declared so that they can
be refused by name: :meth:`_Sampling.unsupported` names the first one set to
anything but its neutral value (answered with 501). Each is declared with OpenAI's type, so a value of
another type is the 400 of any wrong type (``"parallel_tool_calls": "yes"``, ``"store": 1``), not a 501
saying the feature is missing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, \
    ValidatorFunctionWrapHandler, WrapValidator, field_validator
from pydantic_core import PydanticCustomError, PydanticUseDefault

from protocol.errors import StopEntryError
from protocol.request import split_stop
from gateway.foreign_fields import Route
from gateway.json_body import value_kind
from protocol.validation import clip, echo

MAX_N = 128
"""Most choices per prompt (OpenAI's bound for ``n``)."""

MAX_STOP = 4
"""Most stop entries (OpenAI's bound for ``stop``)."""

MAX_BEST_OF = 20
"""Most ``best_of`` candidates per prompt (OpenAI's bound: its OpenAPI spec's ``CreateCompletionRequest``,
``best_of`` minimum 0, maximum 20; it must also be at least ``n``, as vLLM's ``SamplingParams`` checks)."""

MAX_TEMPERATURE = 2.0
"""The highest ``temperature`` OpenAI's routes take (OpenAI's range is [0, 2]; the Python SDK and
JSONL rows take any temperature >= 0, as vLLM does)."""

_INT64_MAX = 2**63 - 1


def _bad_type(message: str) -> PydanticCustomError:
    """A body error with a message of its own (:func:`gateway.errors.from_validation` shows it as is).
    Its type is the HTTP error code, ``invalid_type``, which no pydantic error type is."""
    return PydanticCustomError("invalid_type", message)


def _shown(value: Any) -> str:
    """``value`` (parsed JSON) as an OpenAI-shaped route's error shows what the client sent: a
    scalar as its JSON, cut as every echoed client value is (:func:`protocol.validation.clip`);
    an array or object by its JSON kind alone (``an array``, ``an object``: never Python's type
    names), as :func:`gateway.errors.from_validation` echoes pydantic's errors (``(got an array)``, this function).
    Not :func:`gateway.messages_body.json_shown`, which writes an array or object as its JSON: the
    two differ there only, and each family of messages keeps the words its clients have read
    (one function for both would change what one of them says)."""
    return clip(json.dumps(value)) if isinstance(value, (int, float, str, bool, type(None))) else value_kind(value)


def _check_ids(ids: list, where: str) -> None:
    """Every entry of ``ids`` a JSON integer (``2.0`` and ``true`` are not), else the error saying so."""
    if set(map(type, ids)) <= {int}:  # the common case, without a Python-level loop
        return
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise _bad_type(f"token ids must be integers: {where}[{i}] is {_shown(t)}")


def _token_ids(value: Any, field: str) -> Any:
    if isinstance(value, list):
        _check_ids(value, field)
    return value


_PROMPT_SHAPES = "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists"


def _prompt(value: Any) -> Any:
    """``prompt``'s shape checked before its type, so a wrong entry gets a message
    about that entry, not pydantic's about the first union member (``str``)."""
    if type(value) is not list:
        if type(value) is not str:
            raise _bad_type(f"{_PROMPT_SHAPES}, got {_shown(value)}")
        return value
    if not value:
        return value
    texts, lists = (all(type(p) is t for p in value) for t in (str, list))
    if texts or lists:  # several prompts: an empty one is named before any is sent
        for i, p in enumerate(value):
            if not p:
                raise PydanticCustomError("invalid_value", f"prompt[{i}] must not be empty")
    if texts:
        return value
    if all(type(p) is list for p in value):
        for i, ids in enumerate(value):
            _check_ids(ids, f"prompt[{i}]")
    elif any(type(p) in (str, list) for p in value):
        raise _bad_type(f"{_PROMPT_SHAPES}, not a mix")
    else:
        _check_ids(value, "prompt")
    return value


def _stop(value: Any) -> Any:
    """``stop``: a string, or a list of strings and token-id lists (shared out as
    :func:`protocol.request.split_stop` does; the lists checked entry by entry, as ``prompt``)."""
    if value is not None and type(value) not in (str, list):
        raise _bad_type(f"stop must be a string or a list of strings and token-id lists, got {_shown(value)}")
    if isinstance(value, list):
        try:
            split_stop(value)
        except StopEntryError as e:
            raise _bad_type(f"stop entries must be strings or lists of token ids: stop[{e.index}] is "
                            f"{_shown(e.entry)}") from None
        for i, entry in enumerate(value):
            if type(entry) is list:
                _check_ids(entry, f"stop[{i}]")
    return value


def _null_is_default(value: Any) -> Any:
    if value is None:
        raise PydanticUseDefault()
    return value


NULL_IS_DEFAULT = BeforeValidator(_null_is_default)
"""The check of an optional field whose type is not nullable but which has a default: null is taken
as absent (the default), as every optional field of these routes takes it (``top_n: null``,
``"stream": null``) and as llama.cpp's ``json_value`` reads a null field; another value is checked as
the field's type."""


def text_or_objects(field: str, entries: str) -> BeforeValidator:
    """The type of a field that is a string or a list of ``entries`` (objects: content parts, blocks,
    input items), its shape checked before its union type: a value of another type, or a list entry
    that is no object, is named (``content[0] is "hi"``), where the union's error would be its first
    member's, "Input should be a valid string (got list)"."""
    def check(value: Any) -> Any:
        if type(value) is list:
            for i, entry in enumerate(value):
                if not isinstance(entry, dict):
                    raise _bad_type(f"{field} must be a string or a list of {entries} (objects); {field}[{i}] is "
                                    f"{_shown(entry)}")
        elif value is not None and type(value) is not str:
            raise _bad_type(f"{field} must be a string or a list of {entries}; got {_shown(value)}")
        return value

    return BeforeValidator(check)


_ID_DIGITS = 20
"""The most digits a token id's key may have: 2**64 - 1, the wire's largest integer, has 20 (the
request checks the range; this bound keeps a 5,000-digit key from int(), which refuses past 4,300)."""


def _logit_bias(value: Any) -> Any:
    """``logit_bias`` as OpenAI sends it: a map whose keys are token ids written as strings
    (``{"50256": -100}``); the values are checked by their type, the ranges by the request.
    Two keys that name one token (``"7"`` and ``"07"``) are an error, as the request's
    repeated id is (the map of ints built from the keys would keep one silently)."""
    if isinstance(value, dict):
        named: dict[int, str] = {}
        for key in value:
            if not (type(key) is str and key.isascii() and key.isdigit() and len(key) <= _ID_DIGITS):
                raise _bad_type(f"logit_bias keys must be token ids (decimal strings), got {_shown(key)}")
            if (other := named.setdefault(int(key), key)) != key:
                raise _bad_type(f"logit_bias gives token {int(key)} twice ({_shown(other)} and {_shown(key)})")
    return value


MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata`` (its API reference, "Metadata"): at most 16 pairs, keys of at
most 64 characters, string values of at most 512."""


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """``metadata`` within OpenAI's bounds (after its type: a map of strings), else the error saying which."""
    if value is None:
        return value
    if len(value) > MAX_METADATA_KEYS:
        raise PydanticCustomError("invalid_value", f"metadata holds {len(value)} keys; at most "
                                  f"{MAX_METADATA_KEYS} are allowed")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise PydanticCustomError("invalid_value", f"a metadata key {echo(key)} is {len(key)} "
                                      f"characters long; at most {MAX_METADATA_KEY_CHARS} are allowed")
        if len(text) > MAX_METADATA_VALUE_CHARS:
            raise PydanticCustomError("invalid_value", f"metadata[{key!r}] is {len(text)} characters long; at most "
                                      f"{MAX_METADATA_VALUE_CHARS} are allowed")
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata)]
"""A body's ``metadata`` (the caller's tags, not used): string keys and values within OpenAI's bounds."""


def in_range(field: str, low: float, high: float | None = None, note: str = "", *,
             words: str = "openai") -> WrapValidator:
    """The check of a number field that must lie in [``low``, ``high``] (no ``high``: no upper bound;
    null: absent), after its type's: another value is a 400 naming ``field`` in its vendor's
    ``words``, the value as JSON writes it and cut as every echo is (:func:`_shown`):

    - ``"openai"``: ``"temperature must be in [0, 2] (0 = greedy), got 5"`` (``note`` the parenthesis);
    - ``"anthropic"``: Anthropic's own 400s, ``"temperature: Input should be less than or equal to 1;
      got 5"`` (``note`` unused).

    The one check of the vendors' ranges that the request itself (:mod:`protocol.request`) is wider
    than: OpenAI's ``temperature`` on its routes, Anthropic's ``temperature``, ``top_p`` and ``top_k``
    on /v1/messages. ValueError for ``words`` of another vendor."""
    if words not in ("openai", "anthropic"):
        raise ValueError(f"words must be 'openai' or 'anthropic', got {words!r}")

    def refusal(value: Any, number: Any) -> str | None:
        if number is None or (low <= number and (high is None or number <= high)):
            return None
        if words == "openai":
            bounds = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            return f"{field} must be {'in ' if high is not None else ''}{bounds}{note}, got {_shown(value)}"
        which = "greater than or equal to" if number < low else "less than or equal to"
        return f"{field}: Input should be {which} {low if number < low else high:g}; got {_shown(value)}"

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        number = handler(value)  # (its type's check first; the error shows the value as sent)
        message = refusal(value, number)
        if message is not None:
            raise PydanticCustomError("invalid_value", message)
        return number

    return WrapValidator(check)


VERBOSITIES = ("low", "medium", "high")
"""The values of OpenAI's ``verbosity`` (chat) and ``text.verbosity`` (Responses) it takes."""

PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
"""The values of OpenAI's ``prompt_cache_retention`` (chat and Responses) it takes."""


def not_one_of(value: Any, values: tuple[str, ...]) -> str | None:
    """OpenAI's words for ``value`` of an enum field that is not one of ``values`` (None when it is,
    or is null: absent): ``Invalid value: 'x'. Supported values are: 'low', 'medium', and 'high'.``,
    the value cut as every echo is."""
    if value is None or (type(value) is str and value in values):
        return None
    shown = f"'{clip(value)}'" if isinstance(value, str) else clip(json.dumps(value))
    supported = f"{', '.join(map(repr, values[:-1]))}{',' if len(values) > 2 else ''} and {values[-1]!r}"
    return f"Invalid value: {shown}. Supported values are: {supported}."


def one_of(values: tuple[str, ...]) -> AfterValidator:
    """The check of a string field OpenAI types as an enum of ``values`` (null: absent), after its
    type's: another string is a 400 naming the field in OpenAI's words (:func:`not_one_of`)."""

    def check(value: str | None) -> str | None:
        message = not_one_of(value, values)
        if message is not None:
            raise PydanticCustomError("invalid_value", message)
        return value

    return AfterValidator(check)


def _neutral(value: Any, allowed: tuple) -> bool:
    """True when ``value`` is one of ``allowed`` with the same type (so ``0`` is not ``False``)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


_NEUTRAL = {
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "skip_special_tokens": (None, True),
}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, the usage so far on every chunk


class _Sampling(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the one model served (gateway.link.BrokerConnections.resolve)
    max_tokens: int | None = None
    temperature: Annotated[float | None, in_range("temperature", 0, MAX_TEMPERATURE, " (0 = greedy)")] = None
    # ^ OpenAI's default: 1
    top_p: float | None = None                # OpenAI's default: 1
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, le=_INT64_MAX)
    stop: Annotated[str | list[str | list[int]] | None, BeforeValidator(_stop)] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None                   # for the caller's own tracking; not used
    # slotserve extras (vLLM's names where vLLM has them)
    top_k: int | None = None                  # 0 or -1: off
    min_tokens: int | None = Field(default=None, ge=0)
    priority: int | None = None               # lower runs first
    include_stop_str_in_output: bool | None = None  # the text ends after a matched stop string
    stop_token_ids: Annotated[list[int] | None, BeforeValidator(lambda v: _token_ids(v, "stop_token_ids"))] = None
    # ^ added to the model's EOS tokens
    ignore_eos: bool | None = None            # True: the model's EOS tokens do not stop
    timeout_s: float | None = None            # deadline, seconds from arrival
    repetition_penalty: float | None = None   # vLLM's: > 0, 1 = off
    min_p: float | None = None                # vLLM's: in [0, 1], 0 = off
    skip_special_tokens: bool | None = None   # vLLM's; true (its default) is how the worker decodes (the special
    # ^ tokens left out of the text, but the markers its tool and reasoning parsers read); false: 501 (_NEUTRAL)
    spaces_between_special_tokens: bool | None = None  # vLLM's: taken, no effect either way (fast tokenizers; vLLM's
    # ^ own decoding of a fast tokenizer's tokens does not read it either)
    # sampling controls (OpenAI's); their ranges are the request's (protocol.request), checked at submission
    logit_bias: Annotated[dict[str, float] | None, BeforeValidator(_logit_bias)] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt_logprobs: int | None = None        # vLLM's: every prompt token's logprob and N alternatives (0..20)
    # structured outputs (gateway.structured: shapes checked there): OpenAI's, vLLM's, llama.cpp's
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None
    grammar: Any = None
    # OpenAI fields slotserve does not implement: refused unless neutral (typed as OpenAI types them)
    service_tier: str | None = None
    store: bool | None = None
    metadata: Metadata = None                 # the caller's tags; not used

    def unsupported(self) -> str | None:
        """The first field set to a value slotserve cannot honour, else None."""
        given = self.model_fields_set
        for name, neutral in _NEUTRAL.items():
            if name in given and not _neutral(getattr(self, name), neutral):
                return name
        return None

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, a
    list of strings or a list of token-id lists (one slotserve request each,
    times ``n``). ``max_tokens`` defaults to 16 (OpenAI). ``suffix`` (a string;
    ``""`` or null: none): fill in the middle, each text prompt being the code
    before the gap (the request's ``suffix``, :mod:`worker.models.fim`)."""

    hint_route: ClassVar[Route] = Route.COMPLETIONS  # a llama.cpp or Ollama field's 400 says what to send

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_prompt)]
    logprobs: int | None = None               # N alternatives per token (0..20; OpenAI's bound is 5, vLLM's 20)
    echo: bool | None = None                  # the prompt before the completion (with logprobs: its tokens' first)
    top_logprobs: Any = None                  # a chat field: refused unless null or 0 (gateway.options)
    suffix: str | None = None
    best_of: int | None = None  # candidates of which the best n are returned: only n itself is served (501)

    @field_validator("best_of")
    @classmethod
    def _best_of_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        """``best_of`` within OpenAI's range, [``n``, :data:`MAX_BEST_OF`], else a 400 naming it (a value
        in range other than ``n`` is valid and not implemented: :meth:`unsupported`'s 501)."""
        n = info.data.get("n") or 1
        if value is not None and not n <= value <= MAX_BEST_OF:
            if n > MAX_BEST_OF:  # (no value is in [n, 20]: "[25, 20]" named an empty range)
                raise PydanticCustomError("invalid_value", f"best_of must be at least n ({n}) and at most {MAX_BEST_OF}, "
                                          f"which no value is: leave best_of out for n above {MAX_BEST_OF}, "
                                          f"got {_shown(value)}")
            raise PydanticCustomError("invalid_value", f"best_of must be in [{n}, {MAX_BEST_OF}] (at least n: the best n "
                                      f"of best_of candidates are returned), got {_shown(value)}")
        return value

    def unsupported(self) -> str | None:
        if "best_of" not in self.model_fields_set:
            return super().unsupported()
        if not _neutral(self.best_of, (None, self.choices_per_prompt)):
            return "best_of"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per slotserve request (before ``n``)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessageParam(BaseModel):
    """One chat message of a request body (OpenAI's ``ChatCompletionMessageParam``; it becomes a
    :class:`protocol.request.ChatMessage` of the request's prompt). ``content``: a string or a
    list of text parts (``{"type": "text", "text": ...}``, joined); ``name`` and a ``tool``
    message's ``tool_call_id`` are passed to the chat template (Mistral's reads the id)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: Annotated[str | list[dict[str, Any]] | None, text_or_objects("content", "content parts")] = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: dict[str, Any] | None = None  # (OpenAI's deprecated {name, arguments})
    audio: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (OpenAI's newer
    name) and ``max_tokens`` mean the same; giving both with different values is a 400.
    ``continue_final_message`` and ``add_generation_prompt``: vLLM's, how the prompt ends
    (:func:`gateway.options.chat_ending_option`). OpenAI's ``safety_identifier``,
    ``prompt_cache_key`` (strings), ``prompt_cache_retention`` (:data:`PROMPT_CACHE_RETENTIONS`) and
    ``verbosity`` (:data:`VERBOSITIES`) are checked as OpenAI types them and not used, as on
    ``/v1/responses`` (the prefix cache keeps what it keeps; the model writes as it writes)."""

    hint_route: ClassVar[Route] = Route.CHAT  # a llama.cpp or Ollama field's 400 says what to send

    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None              # true: each generated token's logprob (choices[].logprobs.content)
    top_logprobs: int | None = None           # with logprobs: the N most likely alternatives too (0..20)
    tools: Any = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: the answer's first call only (gateway.tools)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Any = None              # OpenAI's; the template variable reasoning_effort (gateway.options)
    chat_template_kwargs: Any = None          # vLLM's and llama.cpp's: extra chat template variables
    continue_final_message: bool | None = None  # vLLM's: the final message left open, continued (a prefill)
    add_generation_prompt: bool | None = None  # vLLM's: default true (false when continue_final_message)
    web_search_options: dict[str, Any] | None = None
    # OpenAI's, checked as OpenAI types them and not used (as /v1/responses takes them)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Annotated[str | None, one_of(PROMPT_CACHE_RETENTIONS)] = None
    verbosity: Annotated[str | None, one_of(VERBOSITIES)] = None

    def unsupported(self) -> str | None:
        # tools and tool_choice: gateway.tools; reasoning_effort and chat_template_kwargs: gateway.options
        for name in ("functions", "audio", "prediction", "web_search_options"):
            if not _neutral(getattr(self, name), (None, [])):
                return name
        for name in ("function_call",):
            if not _neutral(getattr(self, name), (None, "none", "auto")):
                return name
        if not _neutral(self.modalities, (None, ["text"])):
            return "modalities"
        for i, m in enumerate(self.messages):
            for name in ("function_call", "audio"):  # (tool_calls, tool_call_id: gateway.tools)
                if not _neutral(getattr(m, name), (None, [])):
                    return f"messages.{i}.{name}"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shapes): ``prompt`` (text; ``add_special_tokens`` default true)
    or ``messages`` (the chat template's tokens; ``add_generation_prompt`` default true, false with
    ``continue_final_message`` (the final message left open, as a chat request's), ``add_special_tokens``
    default false; ``tools`` and ``tool_choice`` as a chat request's), one of them. ``model``: optional when one model is served. ``return_token_strs``: also each token's string."""

    model_config = ConfigDict(extra="forbid", strict=True)
    hint_route: ClassVar[Route] = Route.TOKENIZE  # llama.cpp's content, add_special, with_pieces: say the names here
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    tools: Any = None        # with messages: as a chat request's (gateway.tools), shown as the chat shows them
    tool_choice: Any = None
    chat_template_kwargs: Any = None  # with messages: as a chat request's (gateway.options.template_option)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): ``tokens`` (ids) -> ``{"prompt": text}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: Annotated[list[int], BeforeValidator(lambda v: _token_ids(v, "tokens"))]
