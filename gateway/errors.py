"""HTTP errors in OpenAI's shape, and the mapping from slotserve's error codes.

Every error the gateway answers is ``{"error": {"message", "type", "param",
"code"}}`` (OpenAI's API reference, "Error codes"), with:

======  ==============================  =============================================
status  ``type``                        when
======  ==============================  =============================================
400     ``invalid_request_error``       malformed JSON (``invalid_json``, :func:`invalid_json`),
                                        wrong types, unknown fields, values the client or
                                        worker validation refuses;
                                        prompt + ``max_tokens`` over the served context
                                        (``context_length_exceeded``, OpenAI's code, whichever
                                        side found it: the client for token ids, the worker
                                        for text and chat); a body declared as anything but
                                        JSON (``unsupported_media_type``)
401     ``invalid_request_error``       ``/v1/*`` (or ``/metrics``) without a valid API key
                                        (``invalid_api_key``; :mod:`gateway.auth`)
404     ``invalid_request_error``       no worker serves the model (``model_not_found``)
413     ``invalid_request_error``       body over ``max_body_bytes``
429     ``rate_limit_error``            the model's broker queue is full (``queue_full``;
                                        with ``Retry-After``)
500     ``server_error``                the model failed, or a request failed on too
                                        many workers
501     ``invalid_request_error``       an OpenAI feature slotserve does not implement
                                        (``unsupported``; ``x-should-retry: false``)
503     ``service_unavailable_error``   no broker answers, no worker serves the model
                                        right now (its first worker loading, or none:
                                        ``BrokerConnections.no_worker``, one message for
                                        every route), or the gateway is shutting down (a new
                                        request while it drains, or one still open at the
                                        end of its shutdown timeout; :mod:`gateway.drain`)
======  ==============================  =============================================

An error can always be written: a lone surrogate in its message or field name (which UTF-8,
and so pydantic's JSON writer, cannot encode) is kept as its escape (:func:`writable`).

The ``openai`` SDK retries 429 and 5xx by default; 501 carries
``x-should-retry: false`` (the SDK's own header) because retrying a missing
feature cannot succeed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic_core import to_json

from gateway.foreign_fields import Route, hint
from gateway.json_body import BodyProblem, body_problem, not_an_object, value_kind
from gateway.schemas import _shown
from protocol.enums import ErrorCode
from protocol.errors import error_code
from protocol.json_numbers import loads, nonfinite, nonfinite_words, path_text
from protocol.request import RequestParams
from protocol.validation import clip, surrogate_escape_message, unpaired_surrogate

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          501: "invalid_request_error", 503: "service_unavailable_error"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}
"""HTTP status -> the ``error.type`` of Anthropic's error shape (``/v1/messages``); another 4xx is
``invalid_request_error``, another 5xx ``api_error``. slotserve's 503 (no worker now, draining) is
Anthropic's ``overloaded_error``: retry later."""


class APIError(Exception):
    """An HTTP error answer: ``status`` (int), ``message`` (what went wrong and
    what to do), ``param`` (the body field at fault, or None), ``code`` (a
    short machine-readable string, or None), ``headers`` (extra response headers)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(writable(message))
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, text: str) -> None:  # (so that every way of writing the error can: body, events, logs)
        self._message = writable(text)

    @property
    def param(self) -> str | None:
        return self._param

    @param.setter
    def param(self, name: str | None) -> None:
        self._param = None if name is None else writable(name)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return to_json(self.body())

    def anthropic_body(self) -> dict:
        """The error in Anthropic's shape (its API reference, "Errors"): ``{"type": "error", "error":
        {"type", "message"}}``, the type by status (:data:`ANTHROPIC_TYPES`); Anthropic's error has no
        ``param``, so the message starts with the field at fault. An unknown field (code
        ``unknown_parameter``) is worded as Anthropic words it: ``"<field>: Extra inputs are not
        permitted"`` (and :func:`from_validation`'s hint, if any); a value of another type as ``"<field>:
        Input should be a valid number (got ...)"`` (the field once: not the OpenAI shape's ``Invalid
        value for '<field>': ...``)."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.message
        if self.code == "unknown_parameter" and self.param is not None:  # in Anthropic's own words (+ any hint)
            said = f"{UNRECOGNIZED}{self.param}"
            message = f"{self.param}: Extra inputs are not permitted" + \
                (message[len(said):] if message.startswith(f"{said} (") else "")
        elif self.param is not None and not message.lstrip("'`").startswith(self.param):
            message = f"{self.param}: {message.removeprefix(_invalid_value_for(self.param))}"
        return {"type": "error", "error": {"type": kind, "message": message}}


UNRECOGNIZED = "Unrecognized request argument supplied: "
"""How the 400 of an unknown body field starts (OpenAI's words), the field's name after it."""


def unknown_key(where: str, key: str, takes: str) -> APIError:
    """400 ``unknown_parameter`` for the key ``key`` of the object at ``where`` (``"tools.0.function"``),
    which takes only ``takes`` (words: ``"name, description, parameters and strict"``), named as an
    unknown top-level field is (:data:`UNRECOGNIZED`): ``param`` and the message's field are
    ``where.key``, the key clipped (:func:`~protocol.validation.clip`) as every echo of the client's text."""
    field = f"{where}.{clip(key)}"
    return bad_request(f"{UNRECOGNIZED}{field} ({where} takes {takes})", field, "unknown_parameter")


def _invalid_value_for(param: str) -> str:
    """How :func:`from_validation` starts the message of a value of another type than ``param``'s."""
    return f"Invalid value for '{param}': "


def writable(text: str) -> str:
    """``text`` as UTF-8 can write it: a lone surrogate (``"\\ud800"``: half a UTF-16 pair, which UTF-8
    cannot encode, so pydantic's JSON writer refused the whole error) becomes its escape, the six
    characters ``\\ud800`` ('backslashreplace'); any other text is itself."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def empty_content(param: str, part: str, *, null: bool = False) -> APIError:
    """400 for a message's content given as an empty array, naming ``param`` (OpenAI's rule: an array of
    at least one part, ``Invalid 'messages[0].content': empty array``); ``part``: what one part is
    (``"text part"``), ``null``: whether null is the way to send no content (an assistant's, beside its
    tool calls)."""
    instead = f"a string{', null' if null else ''} or a list of at least one {part}"
    return bad_request(f"{param} is an empty array: an empty turn is refused; send {instead}", param)


def entry_type(entry: Any, where: str, what: str, kinds: str, default: str | None = None) -> str:
    """The ``type`` of ``entry``, an entry of a list whose entries a body tags by type (a content part
    or block, an input item, a tool) at the field ``where`` (``messages.0.content.1``), for the caller to
    serve or refuse as a feature slotserve lacks. 400 naming ``where`` when the entry is no object, and
    ``where.type`` when its type is missing (unless ``default``, the type an untagged entry has), null or
    no string: the client's malformed entry, not a feature to leave out. ``what``: the entry in words
    (``"a content block"``); ``kinds``: the types the route serves there, in words (``"text or
    tool_result"``)."""
    if not isinstance(entry, dict):
        shown = value_kind(entry) if isinstance(entry, list) else clip(json.dumps(entry))
        raise bad_request(f"{what} must be an object whose \"type\" says what it is ({kinds}); got {shown}", where,
                          "invalid_type")
    if "type" not in entry and default is not None:
        return default
    kind = entry.get("type")
    if "type" not in entry:
        raise bad_request(f"{what} needs a \"type\" saying what it is ({kinds})", f"{where}.type",
                          "missing_required_parameter")
    if type(kind) is not str:
        raise bad_request(f"{what}'s \"type\" must be a string ({kinds}); got {clip(json.dumps(kind))}",
                          f"{where}.type", "invalid_type")
    return kind


def unsupported(param: str, message: str) -> APIError:
    """501 for a valid OpenAI parameter that slotserve does not implement (never retried)."""
    return APIError(501, message, param=param, code="unsupported", headers={"x-should-retry": "false"})


def unauthorized(message: str) -> APIError:
    """401 for a request without a valid API key (OpenAI's type and code), with RFC 6750's challenge."""
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, code="unavailable", headers={"Retry-After": str(retry_after_s)})


def shutting_down(message: str) -> APIError:
    """503 while the gateway stops (:mod:`gateway.drain`): ``Retry-After``, and ``Connection:
    close`` so that the client's retry opens a new connection (to another replica, behind a
    load balancer) rather than reusing this one."""
    e = unavailable(message)
    e.headers["Connection"] = "close"
    return e


# slotserve's wire error codes -> HTTP status. Codes not listed are server errors (500).
_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,  # the worker's check (text, chat); the client's is from_value_error's
    ErrorCode.MALFORMED: 400,
    ErrorCode.UNSUPPORTED: 400,       # e.g. text for a model without a tokenizer: send token ids
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.BROKER_UNAVAILABLE: 503,
    ErrorCode.SLOW_CONSUMER: 503,
}

# First words of the client's / worker's ValueError messages -> the HTTP body field they name.
_PARAMS = {
    **{name: name for name in RequestParams._fields},  # a field of the body's own name (logit_bias, min_p, ...)
    "prompt": "prompt", "max_tokens": "max_tokens", "stop_token": "stop_token_ids",
    "stop_sequences": "stop", "priority": "priority", "timeout_s": "timeout_s", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "seed": "seed", "chat": "messages", "messages": "messages",
    "stop": "stop", "min_tokens": "min_tokens", "include_stop_str_in_output": "include_stop_str_in_output",
    "model": "model",  # (a request of the kind its model does not serve: protocol.request.KIND_REFUSALS)
}
_FIRST_WORD = re.compile(r"[A-Za-z_]+")


def param_of(message: str, default: str | None = None) -> str | None:
    """The HTTP body field a validation message names (its first word), else ``default``."""
    m = _FIRST_WORD.match(message)
    return _PARAMS.get(m.group(0), default) if m else default


_FIELD_TOKEN = re.compile(r"(?<![\w.\[\]-])[A-Za-z_]\w*(?:\.\w+|\[\d+\])*")
"""A field's name as a message writes it: a word, with dotted keys and bracketed indexes
(``stop_token``, ``stop_sequences[0]``, ``tools.0.function.name``), not the tail of a hyphenated word."""

_QUOTED = re.compile(r"""(?<![\w'])'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"|<[^<>\s]*>""")
"""What a message quotes of the client's or the model's, never a field's name to reword: a value as
:func:`protocol.validation.echo` (``repr``: ``'max_tokens'``) or JSON writes it (``"stop"``; an
apostrophe inside a word, ``model's``, opens none), or a special token (``<fim-suffix>``)."""

_QUOTED_OR_FIELD = re.compile(f"({_QUOTED.pattern})|{_FIELD_TOKEN.pattern}")


def reworded(e: APIError, table: tuple[tuple[str, str], ...]) -> APIError:
    """``e`` (returned; changed in place) with each field its message names written as the client's body
    names it: a field name (:data:`_FIELD_TOKEN`, wherever it stands but inside what the message quotes,
    :data:`_QUOTED`: a tool named ``max_tokens`` stays ``'max_tokens'``) that the first of ``table``'s
    ``(pattern, replacement)`` matching its start (a regular expression ending at a name's boundary:
    ``tools\\.(\\d+)\\.function`` matches ``tools.0.function.name``, ``stop`` never ``stop_token``)
    rewrites. The client SDK's and the worker's checks word their messages in the request's own names
    (:class:`protocol.request.RequestParams`: ``stop_token``, ``stop_sequences[0]``, ``max_tokens``), and
    a route's body may name them otherwise (``stop_token_ids``, ``stop[1]``, ``max_output_tokens``)."""
    if not table:
        return e
    compiled = [(re.compile(rf"^(?:{pattern})(?![\w\[])"), replacement) for pattern, replacement in table]

    def one(m: re.Match) -> str:
        name = m.group(0)
        if m.group(1) is not None:  # (quoted: the client's own words, kept as sent)
            return name
        for pattern, replacement in compiled:
            new, n = pattern.subn(replacement, name, count=1)
            if n:
                return new
        return name

    e.message = _QUOTED_OR_FIELD.sub(one, e.message)
    return e


def from_value_error(e: ValueError, default_param: str | None = None) -> APIError:
    """A request the client SDK refused at submission (400, the SDK's message; the
    code is the error's own when it has one, e.g. ``unsupported``, as a worker's refusal would say)."""
    msg = str(e)
    code = error_code(e, None)
    return bad_request(msg, param_of(msg, default_param), "invalid_value" if code is None else code.value)


def from_remote(code: ErrorCode, message: str, prompt_param: str = "prompt") -> APIError:
    """A request the broker or a worker ended with ``code`` (``message`` is theirs)."""
    status = _STATUS.get(code, 500)
    headers = {"Retry-After": "1"} if status == 429 else None
    param = param_of(message, prompt_param if code is ErrorCode.UNSUPPORTED else None) if status == 400 else None
    if param == "prompt":
        param = prompt_param
    if code is ErrorCode.UNKNOWN_MODEL:
        param = "model"
    return APIError(status, message, param=param, code=code.value, headers=headers)


INPUT_FIELDS: dict[str, str] = {"prompt": "/v1/completions'", "messages": "/v1/chat/completions' and /v1/messages'",
                                "input": "/v1/responses'"}
"""Each generation route's input field -> the routes that take it (possessive, as a message names them)."""


def misplaced_input(field: str, sent: object) -> str | None:
    """Another route's input field (:data:`INPUT_FIELDS`) that the body ``sent`` (the parsed JSON object)
    holds (not null) where its route's input ``field`` is absent, else None. A Responses prompt template
    (``prompt``: an object) is no completions prompt, and is not counted."""
    if field not in INPUT_FIELDS or not isinstance(sent, dict) or field in sent:
        return None
    return next((other for other in INPUT_FIELDS if other != field and sent.get(other) is not None
                 and not (other == "prompt" and isinstance(sent[other], dict))), None)


def missing_parameter(field: str, sent: object) -> APIError:
    """400 ``missing_required_parameter`` for the body ``sent`` (the parsed JSON object) lacking ``field``
    (``param``: ``field``). Where ``sent`` holds another route's input instead (:func:`misplaced_input`:
    chat given ``prompt``, completions given ``messages``), one more sentence names the route that takes
    it: the bare "Missing required parameter: 'messages'" did not tell a client that sent a completions
    body to chat where it belongs."""
    message = f"Missing required parameter: '{field}'"
    other = misplaced_input(field, sent)
    if other is not None:
        message += f"; '{other}' is {INPUT_FIELDS[other]} field; this route takes '{field}'"
    return bad_request(message, field, "missing_required_parameter")


def from_validation(errors: list[dict], route: Route | None = None) -> APIError:
    """pydantic's ``ValidationError.errors()`` -> one 400 naming the first bad field. An unknown field
    (``unknown_parameter``) is "Unrecognized request argument supplied: <field>", and on ``route`` (the
    body's, if a generation route's) a llama.cpp or Ollama field also says, in parentheses, what to
    send instead (:func:`gateway.foreign_fields.hint`); status, type, param and code are the same."""
    e = errors[0]
    kind = e.get("type", "")
    loc = ".".join(str(p) for p in e.get("loc", ()) if not _is_union_tag(p))
    if kind == "json_invalid":
        return invalid_json(e.get("input"), e.get("msg", ""))
    if kind == "model_type" and not loc:
        return bad_request(not_an_object(value_kind(e.get("input"))), None, "invalid_type")
    if kind == "extra_forbidden":
        instead = hint(loc, route)
        return bad_request(f"{UNRECOGNIZED}{loc}{'' if instead is None else f' ({instead})'}", loc, "unknown_parameter")
    if kind == "missing":
        return missing_parameter(loc, e.get("input"))
    if kind in ("invalid_type", "invalid_value"):  # gateway.schemas' own checks: their message says it all
        return bad_request(e.get("msg", "invalid"), loc, kind)
    return bad_request(f"{_invalid_value_for(loc)}{e.get('msg', 'invalid')} (got {_shown(e.get('input'))})", loc,
                       "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value")


def invalid_json(raw: object, detail: str) -> APIError:
    """400 ``invalid_json`` for a body that does not parse (``raw``: its bytes; ``detail``: the parser's
    reason), in slotserve's words (:func:`gateway.json_body.body_problem`: never the parser's). A
    string escape of half a UTF-16 surrogate pair (``"\\ud800"`` alone: no character, and refused by
    the parser) is named with its line and column, as the parser's own words for it ("unexpected
    end of hex escape", "lone leading surrogate" for a trailing half) point elsewhere."""
    lone = _unpaired_surrogate(raw)
    if lone is not None:
        return bad_request(surrogate_escape_message("the body", lone, "send the character itself as UTF-8, or both "
                                                                      "halves of its pair"), None, "invalid_json")
    problem = body_problem(raw, detail) if isinstance(raw, (bytes, bytearray, str)) else \
        BodyProblem("the body is not valid JSON")
    return bad_request(problem.message, None, problem.code)


def nonfinite_number(raw: bytes, owned: Callable[[Any, tuple], bool] | None = None) -> APIError | None:
    """400 ``invalid_value`` naming, as its ``param`` (``metadata.x``, ``tools.0.function.parameters.maximum``),
    the first number of the JSON body ``raw`` that no double holds: ``NaN``, ``Infinity`` (not JSON, yet
    pydantic's parser takes them) or one such as ``1e400``, which reads as infinity
    (:mod:`protocol.json_numbers`); None when there is none, or when ``raw`` does not parse (the schema's
    parser says why). ``owned(body, path)``: whether the route refuses the number at ``path`` of the
    parsed ``body`` itself, in its own words (passed over here). One check for every field of every
    route: the free-form ones (schemas, tools, template variables, metadata) failed in a library's
    words or with a 500 (a JSON answer cannot hold NaN)."""
    try:
        body, found = loads(raw)
    except (ValueError, RecursionError):
        return None
    if not found:  # (the usual body: no walk)
        return None
    for path, number in nonfinite(body):
        if owned is None or not owned(body, path):
            where = path_text("", path, dotted=True) or "the body"
            return bad_request(nonfinite_words(where, number), where if path else None)
    return None


def _unpaired_surrogate(raw: object) -> tuple[str, int, int] | None:
    """:func:`protocol.validation.unpaired_surrogate` of ``raw``, a body (UTF-8 bytes, or a string)."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return unpaired_surrogate(raw) if isinstance(raw, str) else None


def _is_union_tag(part) -> bool:
    # pydantic puts the union member it tried into `loc` (e.g. 'list[int]'); the field name is what callers need
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "function-after"))
