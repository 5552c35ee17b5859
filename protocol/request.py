"""One request's parameters, defined once: :class:`RequestParams`.

A request's options -- prompt, ``max_tokens``, stop rules, priority,
deadline, sampling -- are the fields of :class:`RequestParams`, each
declared once below with its type, its check, its default and its unit.
Everything else derives from them: the keyword arguments of
``BatchInferenceEngine.submit_request`` and ``Client.submit_request``, the
keys of a ``slotserve run`` JSONL row (:meth:`RequestParams.from_mapping`),
and the wire format (:mod:`protocol.codec` encodes the fields in order).
One object is built from the caller's values, validated once when built
(``ValueError`` naming the field), and then travels unchanged: over the wire,
through the broker, to the worker and into the engine's request state.
What is not a parameter of the request -- its id, the broker's key, the
tokens it already has after a migration, the time left of its deadline --
travels beside it in an :class:`~protocol.messages.Envelope`.

Adding an option: add a field at the end of ``_Fields`` (type, check,
default, a comment with the unit), give it meaning where it acts (the
engine, the sampler); docs/parameters.md is generated from ``_Fields``. Nothing else spells it
out. (At the end: the wire carries the fields by position, so a peer that
does not know the new field refuses it -- never misreads it -- and an older
peer's requests get its default.)

Why a NamedTuple and not a frozen dataclass: it is as immutable and as
typed, and it is built several times per request (caller, broker, worker),
where building a frozen dataclass of this size costs about 3 us and a
tuple well under 1 us; msgpack also packs a tuple natively, field by field.
"""

from __future__ import annotations

import json
import operator
from array import array
from collections.abc import Mapping
from itertools import chain as _chain
from itertools import compress as _compress
from itertools import repeat as _repeat
from typing import Annotated, Any, Callable, NamedTuple, Union, get_type_hints

from protocol.chat import Answers, ContentError, Fault, content_text
from protocol.enums import RequestKind
from protocol.errors import ContextLengthError, StopEntryError, UnsupportedError
from protocol.json_numbers import loads as _json_loads, nonfinite_message
from protocol.logprobs import MAX_LOGPROBS
from protocol.structured import Constraint, check_structured
from protocol.tools import ToolCall, check_tool_calls, check_tools
from protocol.validation import (
    WIRE_INT_MAX, as_float, as_int, as_role, as_text, as_tokens, check_depth, check_json_text, check_json_unicode,
    check_vocab, described, echo, is_sequence, kind_of, plain_tokens, too_deep,
)

__all__ = ["DEFAULT", "GREEDY", "GREEDY_BELOW", "KIND_REFUSALS", "LOGIT_BIAS_BOUND", "MAX_LOGIT_BIAS",
           "MAX_REQUEST_ID_CHARS", "MAX_MESSAGE_NAME_CHARS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "PENALTY_BOUND",
           "ROW_ALIASES", "ChatMessage", "ModelLimits", "RequestId", "RequestParams", "SamplingParams",
           "check_request_id", "check_stop_token", "from_wire", "from_wire_plain", "split_stop",
           "to_wire"]

DEFAULT = "default"
"""``stop_token`` not given: the serving side's default stop tokens apply (the
engine's ``stop_token``, a worker's ``--stop-token``, typically the model's
EOS tokens). The one "not given" marker everywhere, and on the wire; ``None``
means *no* stop token, and ``0`` is a real token."""

MAX_REQUEST_ID_CHARS = 256
"""Longest ``str`` request id, in characters (ids travel in every message)."""

MAX_STOP_STRINGS = 16
"""Most text stop strings per request. Matching costs every generated character
one step per stop string, in the batch's loop, so the bound keeps one
request from slowing its neighbours (OpenAI allows 4, as does TGI by default;
vLLM sets no bound)."""

MAX_STOP_CHARS = 1024
"""Longest text stop string, in characters (streamed text holds back up to one
less than this while it may be the start of a stop string)."""

RequestId = Union[int, str]
"""A request id: an ``int`` in the wire's range, or a non-empty ``str`` of at
most :data:`MAX_REQUEST_ID_CHARS` characters."""

_count_of = operator.countOf
_tuple_new = tuple.__new__


MAX_MESSAGE_NAME_CHARS = 256
"""Longest ``tool_call_id`` or ``name`` of a chat message, in characters."""


class ChatMessage(NamedTuple):
    """One chat message; a prompt may be a sequence of them (rendered with the
    model's chat template by whoever holds its tokenizer). ``tool_calls``: the
    calls an assistant message made (:class:`~protocol.tools.ToolCall`; given as
    OpenAI's ``tool_calls`` list); ``tool_call_id``: the call a ``tool``
    message answers (``""``: none); ``name``: the message's ``name`` (a
    ``tool`` message's function, as some clients send it; ``""``: none) --
    Mistral's templates read the id, Llama 3's and others the name. A
    message given as OpenAI's (a mapping) may hold its content as text parts
    or, an assistant's, null (:func:`protocol.chat.content_text`): the
    ChatMessage holds the text, joined (``""`` for none). On the
    wire a message is ``[role, content, tool_calls, tool_call_id, name]``;
    the older shapes ``[role, content]`` and ``[role, content, tool_calls]``
    decode with the rest empty."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def template_dict(self) -> dict:
        """The message as chat templates read it: ``{"role", "content"}``, and ``tool_calls``
        (:meth:`ToolCall.template_dict`), ``tool_call_id`` and ``name`` when it has them."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class SamplingParams(NamedTuple):
    """How the next token is picked (OpenAI / vLLM names and ranges); the
    sampling part of :class:`RequestParams` (``params.sampling``), as a
    model's sampler reads it (:mod:`worker.models.sampling`, which applies
    them in vLLM's ``SamplingParams`` order: ``logit_bias``, the penalties,
    temperature, top-k, top-p, min-p).

    - ``temperature``: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature);
      below :data:`GREEDY_BELOW` it is greedy too.
    - ``top_p``: nucleus sampling mass in (0, 1]; 1 = off.
    - ``top_k``: keep the k most likely tokens; 0 = off.
    - ``seed``: when set, a request's random stream depends only on (seed,
      token position): the same tokens in any batch and after a migration.
    - ``min_p``: in [0, 1]; drop the tokens whose probability is below
      ``min_p`` times the most likely token's (vLLM's); 0 = off.
    - ``logit_bias``: ``((token id, bias), ...)`` sorted by id, each bias in
      [-100, 100] added to that token's logit (OpenAI's); () = none.
    - ``repetition_penalty``: > 0; the logit of every token seen in the prompt
      or the output is divided by it when positive and multiplied by it
      otherwise (CTRL, Keskar et al. 2019; transformers'
      ``RepetitionPenaltyLogitsProcessor``); 1 = off.
    - ``presence_penalty``, ``frequency_penalty``: in [-2, 2]; subtracted
      from the logit of every token generated so far, once and once per
      occurrence (OpenAI's); 0 = off.
    - ``min_tokens``, ``min_tokens_stops``: while the row has fewer than
      ``min_tokens`` output tokens (resumed tokens count), the logits of the
      ``min_tokens_stops`` ids (the request's stop tokens) are -inf (vLLM's
      ``MinTokensLogitsProcessor``, before every other processor). Not request
      fields: the worker's slot table sets them (the request's
      ``min_tokens`` and its resolved stop tokens) and drops them, back to
      the request's own sampling, once the row reaches ``min_tokens``; () =
      off.
    - ``structured``: None, or the :class:`~protocol.structured.Constraint`
      the output must match (the request's ``structured``): the sampler
      masks every token the grammar forbids (:mod:`worker.models.grammar`),
      before the other processors. ``structured_stops``: the request's own
      stop token ids, allowed where the grammar may end besides the model's
      EOS tokens (``()`` when it gives none: the serving side's default).

    Greedy rows (:attr:`greedy`) take the argmax of the *processed* logits
    (bias and penalties applied): only :attr:`is_plain_greedy` rows are the
    argmax of the raw logits, which is what the shortcuts that skip the
    sampler's stage (the screened LM head, speculative drafts) assume.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_tokens_stops: tuple[int, ...] = ()
    structured: Constraint | None = None
    structured_stops: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        """The draw is the argmax (of the processed logits, see :attr:`processed`)."""
        return self.temperature < GREEDY_BELOW

    @property
    def processed(self) -> bool:
        """True when a logits processor acts on this row (the min_tokens mask, a bias or a penalty)."""
        return bool(self.logit_bias) or bool(self.min_tokens_stops) or self.counts_tokens

    @property
    def constrained(self) -> bool:
        """True when a grammar masks this row's tokens (``structured``)."""
        return self.structured is not None

    @property
    def counts_tokens(self) -> bool:
        """True when a penalty needs the row's token counts (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no processor: the token is the argmax of the raw logits. The one
        predicate for every shortcut that relies on that (the screened LM head, speculative
        drafts, the sampler's fast path). A row under its ``min_tokens`` mask is not plain
        until the slot table drops the mask, when the row reaches ``min_tokens``. A constrained
        row (``structured``) is never plain: its token is the argmax of the grammar's allowed ones."""
        return self.temperature < GREEDY_BELOW and not self.processed and self.structured is None


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: vLLM's ``_SAMPLING_EPS`` (vllm/sampling_params.py).
Dividing logits by a temperature like 1e-40 overflows to inf and the softmax to NaN."""

GREEDY = SamplingParams()
"""The default sampling: argmax."""

MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries per request (OpenAI's bound)."""

LOGIT_BIAS_BOUND = 100.0
"""A ``logit_bias`` value lies in [-LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND] (OpenAI's range)."""

PENALTY_BOUND = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in [-PENALTY_BOUND, PENALTY_BOUND] (OpenAI's range)."""


_ID_DIGITS = 20
"""The most digits of a token id given as a string: 2**64 - 1, the wire's largest int, has 20
(and ``int()`` refuses strings past 4,300 digits)."""


# --------------------------------------------------------------------------- field checks
# Each takes (value, field name), returns the value normalised (tuples, plain
# ints and floats) or raises ValueError saying what to send instead.


def _prompt(value: object, field: str) -> tuple[int, ...] | str | tuple[ChatMessage, ...]:
    tokens = plain_tokens(value)
    if tokens:  # token ids, the common case (once per hop)
        return tokens
    if (type(value) is tuple or type(value) is list) and value and type(value[0]) is int:
        return as_tokens(value, field)
    if isinstance(value, str):  # ("" only before a suffix: a rule across fields, in _checked)
        return as_text(value, field)
    if not is_sequence(value):
        raise ValueError(f"{field} must be a list of token ids, a str or a list of chat messages, "
                         f"got {kind_of(value)}")
    items = value if isinstance(value, (list, tuple)) else list(value)  # type: ignore[call-overload]
    if items and isinstance(items[0], (Mapping, list, tuple)):  # maps, ChatMessages, [role, content] pairs
        return _messages(items, field)
    return as_tokens(items, field, allow_empty=False)


def _messages(items: list | tuple, field: str) -> tuple[ChatMessage, ...]:
    out = []
    answers = Answers()  # (the rule of a tool message's tool_call_id, every entry point's: protocol.chat)
    for i, m in enumerate(items):
        if isinstance(m, Mapping):
            role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
            call_id, name = m.get("tool_call_id") or "", m.get("name") or ""
        elif isinstance(m, (list, tuple)) and 2 <= len(m) <= 5:  # a ChatMessage, or one off the wire (any shape)
            role, content, calls, call_id, name = (*m, *((None, "", "")[len(m) - 2:]))
        else:
            raise ValueError(f"chat message {i} must be a map with 'role' and 'content', got {echo(m)}")
        if not isinstance(role, str):
            raise ValueError(f"chat message {i} must have a string 'role', got {echo(m)}")
        try:  # (OpenAI's content: a string, text parts, an assistant's null; protocol.chat)
            content = content_text(content, role)
        except ContentError as e:
            raise (UnsupportedError if e.fault is Fault.UNSUPPORTED else ValueError)(
                e.named(e.at(f"chat message {i} content"))) from None
        for what, value in (("tool_call_id", call_id), ("name", name)):
            if not isinstance(value, str) or len(value) > MAX_MESSAGE_NAME_CHARS:
                raise ValueError(f"chat message {i} {what} must be a string of at most {MAX_MESSAGE_NAME_CHARS} "
                                 f"characters, got {echo(value)}")
            if value:
                as_text(value, f"chat message {i} {what}")
        out.append(ChatMessage(as_role(role, f"chat message {i} role"), as_text(content, f"chat message {i} content"),
                               check_tool_calls(calls, f"chat message {i} tool_calls") if calls else (),
                               call_id, name))
        answers.check(i, out[-1].role, (c.id for c in out[-1].tool_calls), call_id)
    answers.end()  # (the last assistant message's calls answered too)
    return tuple(out)


def _count(minimum: int) -> Callable[[object, str], int]:
    def check(value: object, field: str) -> int:
        if type(value) is int and minimum <= value <= WIRE_INT_MAX:
            return value
        return as_int(value, field, minimum=minimum)
    return check


def _any_int(value: object, field: str) -> int:
    return value if type(value) is int and value.bit_length() < 64 else as_int(value, field)


def _stop_token(value: object, field: str) -> tuple[int, ...] | str:
    if value is None or type(value) is tuple and not value:  # no stop token
        return ()
    if isinstance(value, str):
        if value == DEFAULT:
            return DEFAULT
        raise ValueError(f"{field} must be an int, a list of ints, None or {DEFAULT!r}, got {echo(value)}")
    if is_sequence(value) or isinstance(value, (set, frozenset)):
        if type(value) is tuple and len(value) < 2:  # () or one id: already sorted and unique
            return as_tokens(value, field)
        return tuple(sorted(set(as_tokens(list(value) if isinstance(value, (set, frozenset)) else value, field))))
    return (as_int(value, field, minimum=0),)


def _stop_sequences(value: object, field: str) -> tuple[tuple[int, ...], ...]:
    if type(value) is tuple and not value:
        return ()
    if not is_sequence(value):
        raise ValueError(f"{field} must be a list of token lists, got {kind_of(value)}")
    out: list[tuple[int, ...]] = []
    for i, seq in enumerate(value):  # type: ignore[arg-type]
        if not is_sequence(seq):
            raise ValueError(f"{field}[{i}] must be a list of int token ids, got {kind_of(seq)} "
                             "(for one sequence pass [[...]])")
        toks = as_tokens(seq, f"{field}[{i}]", allow_empty=False)
        if toks not in out:
            out.append(toks)
    return tuple(out)


def _stop_strings(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str):  # one stop string (OpenAI's "stop": "\n")
        value = (value,)
    elif value is None:
        return ()
    elif not is_sequence(value):
        raise ValueError(f"{field} must be a str or a list of str, got {kind_of(value)}")
    out: list[str] = []
    for i, text in enumerate(value):  # type: ignore[arg-type]
        if not isinstance(text, str):
            hint = " (token-id sequences go in stop_sequences)" if is_sequence(text) else ""
            raise ValueError(f"{field}[{i}] must be a str, got {kind_of(text)}{hint}")
        text = as_text(text, f"{field}[{i}]", allow_empty=False)
        if len(text) > MAX_STOP_CHARS:
            raise ValueError(f"{field}[{i}] has {len(text)} characters; at most {MAX_STOP_CHARS} are allowed")
        if text not in out:
            out.append(text)
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(f"{field} holds {len(out)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return tuple(out)


def _flag(value: object, field: str) -> bool:
    if type(value) is bool:
        return value
    if type(value).__name__ == "bool_":  # numpy's
        return bool(value)
    raise ValueError(f"{field} must be true or false, got {described(value)}")


def _optional_flag(value: object, field: str) -> bool | None:
    return None if value is None else _flag(value, field)


def _timeout(value: object, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bool)) or type(value).__name__ == "bool_":
        raise ValueError(f"{field} must be a number of seconds or None, got {echo(value)}")
    try:
        t = as_float(value, field)
    except ValueError:
        raise ValueError(f"{field} must be a finite number of seconds > 0 or None, got {echo(value)}") from None
    if not t > 0:
        raise ValueError(f"{field} must be a finite number of seconds > 0 or None, got {echo(value)}")
    return t


def _temperature(value: object, field: str) -> float:
    if value == 0.0 and type(value) is float:
        return value
    t = as_float(value, field)
    if t < 0:
        raise ValueError(f"{field} must be >= 0 (0 = greedy), got {echo(value)}")
    return t


def _top_p(value: object, field: str) -> float:
    if value == 1.0 and type(value) is float:
        return value
    p = as_float(value, field)
    if not 0 < p <= 1:
        raise ValueError(f"{field} must be in (0, 1], got {echo(value)}")
    return p


def _seed(value: object, field: str) -> int | None:
    return None if value is None else as_int(value, field, minimum=0)


def _min_p(value: object, field: str) -> float:
    p = as_float(value, field)
    if not 0 <= p <= 1:
        raise ValueError(f"{field} must be in [0, 1] (0 = off), got {echo(value)}")
    return p


def _logprob_count(value: object, field: str) -> int | None:
    """None (off) or how many alternatives per token, in [0, MAX_LOGPROBS]."""
    if value is None:
        return None
    n = as_int(value, field, minimum=0) if type(value) is not int or value < 0 else value
    if n > MAX_LOGPROBS:
        raise ValueError(f"{field} must be in [0, {MAX_LOGPROBS}] (alternatives per token) or None (off), "
                         f"got {echo(value)}")
    return n


def _penalty(value: object, field: str) -> float:
    p = as_float(value, field)
    if not -PENALTY_BOUND <= p <= PENALTY_BOUND:
        raise ValueError(f"{field} must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}] (0 = off), got {echo(value)}")
    return p


def _repetition_penalty(value: object, field: str) -> float:
    p = as_float(value, field)
    if not p > 0:
        raise ValueError(f"{field} must be > 0 (1 = off), got {echo(value)}")
    return p


def _logit_bias(value: object, field: str) -> tuple[tuple[int, float], ...]:
    """A map token id -> bias, or (as off the wire) a sequence of (id, bias) pairs; zero biases dropped.
    An id may be a decimal string (``"50256"``): OpenAI's shape, the only one JSON has for a map
    (a ``slotserve run`` row, an HTTP body); no sign, space, point or base prefix."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif is_sequence(value):
        pairs = list(value)  # type: ignore[call-overload]
    else:
        raise ValueError(f"{field} must be a map of token id -> bias, got {kind_of(value)}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"{field} holds {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(f"{field} entries must be (token id, bias) pairs, got {echo(pair)}")
        token, bias = pair
        if type(token) is str and token.isascii() and token.isdigit() and len(token) <= _ID_DIGITS:
            token = int(token)
        elif type(token) is not int:
            if isinstance(token, str):
                raise ValueError(f"{field} keys must be token ids (ints, or decimal strings as OpenAI sends "
                                 f"them), got {echo(token)}")
            token = as_int(token, f"{field} key", minimum=0)  # (bools refused; numpy ints taken)
        if not 0 <= token <= WIRE_INT_MAX:
            raise ValueError(f"{field} keys must be token ids (ints >= 0), got {echo(token)}")
        if token in out:
            raise ValueError(f"{field} gives token {token} twice")
        b = as_float(bias, f"{field}[{token}]")
        if not -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND:
            raise ValueError(f"{field}[{token}] must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], "
                             f"got {echo(bias)}")
        out[token] = b
    return tuple(sorted((t, b) for t, b in out.items() if b != 0.0))


def _suffix(value: object, field: str) -> str | None:
    return None if value is None else as_text(value, field)


MAX_TEMPLATE_KWARGS_CHARS = 65_536
"""Longest ``chat_template_kwargs`` text, in characters."""

TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
    "self", "conversations"})
"""Names ``chat_template_kwargs`` may not set: the arguments of transformers' ``apply_chat_template``
that the renderer sets itself (the messages, tools, the template, tokenization), the other names the
keyword arguments meet on their way to the template (``self`` of the methods, ``render_jinja_template``'s
``conversations``: Python's "got multiple values for argument" else), and the variables it gives
every template (the special tokens and its helper functions)."""


def check_template_kwargs(value: object, field: str) -> str | None:
    """``chat_template_kwargs``: None, a mapping of variable names to JSON values, or its JSON text
    (as off the wire), as normalised JSON text (sorted keys) or None for an empty mapping. ValueError
    naming ``field`` for a non-mapping, a name that is not an identifier or is :data:`TEMPLATE_RESERVED`,
    a value that is not JSON, or more than :data:`MAX_TEMPLATE_KWARGS_CHARS` characters."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"{field} is {len(value)} characters; at most {MAX_TEMPLATE_KWARGS_CHARS}")
        try:
            parsed, _ = _json_loads(value)  # (a NaN or 1e400 kept as written, for the words below)
        except RecursionError:  # (nested deeper than Python's limit: a JSON object all the same)
            raise ValueError(too_deep(field)) from None
        except ValueError:
            raise ValueError(f"{field} must be a JSON object of template variables") from None
        check_json_text(value, field)  # (the escape of a lone surrogate: a string UTF-8 cannot encode)
        value = parsed
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be an object of chat template variables, e.g. {{\"enable_thinking\": false}}; "
                         f"got {kind_of(value)}")
    check_depth(value, field)
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{field}: each name must be a template variable name (an identifier), got {echo(name)}")
        if name in TEMPLATE_RESERVED:
            raise ValueError(f"{field}: {name!r} is set by the server, not by a request (reserved: "
                             f"{', '.join(sorted(TEMPLATE_RESERVED))})")
    if not value:
        return None
    try:
        text = json.dumps(dict(value), ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:  # (NaN, infinity: named where they are)
        raise ValueError(nonfinite_message(value, field) or f"{field} must hold JSON values: {e}") from None
    check_json_unicode(text, value, field)
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"{field} is {len(text)} characters as JSON; at most {MAX_TEMPLATE_KWARGS_CHARS}")
    return text


MAX_EXTRA_CHUNKS = 256
"""Most ``input_extra`` chunks per request (each a file's name and text)."""


def _input_extra(value: object, field: str) -> tuple[tuple[str, str], ...]:
    """Other files' chunks for fill in the middle: ``{"filename": str, "text": str}`` maps (llama.cpp's
    ``input_extra``; a missing ``filename`` is ``"tmp"``, a missing ``text`` ``""``, as there) or
    ``(filename, text)`` pairs, as off the wire. Normalised: a tuple of pairs."""
    if value is None:
        return ()
    if not is_sequence(value):
        raise ValueError(f"{field} must be a list of {{\"filename\": str, \"text\": str}}, got {kind_of(value)}")
    items = list(value)  # type: ignore[call-overload]
    if len(items) > MAX_EXTRA_CHUNKS:
        raise ValueError(f"{field} holds {len(items)} chunks; at most {MAX_EXTRA_CHUNKS} are allowed")
    out = []
    for i, chunk in enumerate(items):
        if isinstance(chunk, Mapping):
            unknown = set(chunk) - {"filename", "text"}
            if unknown:
                raise ValueError(f"{field}[{i}] has unknown key(s) {sorted(map(str, unknown))}; a chunk is "
                                 "{\"filename\": str, \"text\": str}")
            name, text = chunk.get("filename", "tmp"), chunk.get("text", "")
        elif isinstance(chunk, (list, tuple)) and len(chunk) == 2:
            name, text = chunk
        else:
            raise ValueError(f"{field}[{i}] must be {{\"filename\": str, \"text\": str}}, got {echo(chunk)}")
        out.append((as_text(name, f"{field}[{i}].filename"), as_text(text, f"{field}[{i}].text")))
    return tuple(out)


def _kind(value: object, field: str) -> str:
    """A :class:`~protocol.enums.RequestKind`'s value, as a plain ``str`` (the wire's type, so a
    decoded request is the built one, field types included); compare it with the enum's members."""
    try:
        return RequestKind(value).value
    except ValueError:
        raise ValueError(f"{field} must be one of {[k.value for k in RequestKind]}, got {echo(value)}") from None


# --------------------------------------------------------------------------- the definition


class _Fields(NamedTuple):
    # name: Annotated[normalised type, check] = default          # meaning, unit
    prompt: Annotated[tuple[int, ...] | str | tuple[ChatMessage, ...], _prompt]
    # token ids (ints >= 0), or text (str), or chat messages ({"role", "content"} maps; a role is a
    # name: letters, digits, _ and -, at most 32, as over HTTP; content a string, text parts or, an
    # assistant's, null, as OpenAI's); text and chat need a model with a tokenizer. Never empty, but
    # for the text before a suffix.
    max_tokens: Annotated[int, _count(1)]
    # generated tokens at most (>= 1); prompt + max_tokens must fit the model's context.
    stop_token: Annotated[tuple[int, ...] | str, _stop_token] = DEFAULT
    # token id(s) that end the request (included in the output); None = none, DEFAULT = the
    # serving side's default. Normalised: a sorted tuple of ids, or DEFAULT.
    stop_sequences: Annotated[tuple[tuple[int, ...], ...], _stop_sequences] = ()
    # token sequences that end the request when the generated tokens end with one (never the prompt).
    priority: Annotated[int, _any_int] = 0
    # lower runs first (vLLM's convention); FIFO within a level, with aging (protocol.queue).
    timeout_s: Annotated[float | None, _timeout] = None
    # seconds from submission until it ends as "deadline", queued or running; None = no deadline.
    temperature: Annotated[float, _temperature] = GREEDY.temperature
    # >= 0; 0 = greedy. See SamplingParams for this and the next three.
    top_p: Annotated[float, _top_p] = GREEDY.top_p
    # nucleus sampling mass, in (0, 1].
    top_k: Annotated[int, _count(0)] = GREEDY.top_k
    # >= 0; 0 = off.
    seed: Annotated[int | None, _seed] = GREEDY.seed
    # >= 0, or None (unseeded).
    min_tokens: Annotated[int, _count(0)] = 0
    # generated tokens (resumed ones included) before a stop token, stop sequence or stop string may
    # end the request, as vLLM's min_tokens; <= max_tokens; 0 with a structured constraint.
    stop: Annotated[tuple[str, ...], _stop_strings] = ()
    # text stop strings (a str or a list; at most MAX_STOP_STRINGS, each 1..MAX_STOP_CHARS characters),
    # matched on the generated text -- the decode of the generated tokens -- wherever a match starts and
    # however many tokens it spans: the request ends "stop" (stop_reason = the string) and its text
    # ends before the string. Needs a model with a tokenizer. Matched in the worker (worker/text.py).
    include_stop_str_in_output: Annotated[bool, _flag] = False
    # True: the text ends after the matched stop string instead (vLLM's option of this name).
    logit_bias: Annotated[tuple[tuple[int, float], ...], _logit_bias] = GREEDY.logit_bias
    # token id -> bias in [-100, 100] added to its logit (OpenAI's; at most MAX_LOGIT_BIAS entries); a map,
    # or (id, bias) pairs. Normalised: sorted (id, bias) pairs, zeros dropped. See SamplingParams for the rest.
    repetition_penalty: Annotated[float, _repetition_penalty] = GREEDY.repetition_penalty
    # > 0; 1 = off. Over prompt + output tokens (resumed ones are output).
    presence_penalty: Annotated[float, _penalty] = GREEDY.presence_penalty
    # in [-2, 2]; 0 = off. Over output tokens (resumed ones included).
    frequency_penalty: Annotated[float, _penalty] = GREEDY.frequency_penalty
    # in [-2, 2]; 0 = off. Over output tokens, per occurrence.
    min_p: Annotated[float, _min_p] = GREEDY.min_p
    # in [0, 1]; 0 = off.
    logprobs: Annotated[int | None, _logprob_count] = None
    # None = off; N in [0, 20]: every generated token carries its logprob and the N most likely
    # alternatives (protocol.logprobs.TokenLogprob; raw distribution, before processors and temperature).
    prompt_logprobs: Annotated[int | None, _logprob_count] = None
    # None = off; N in [0, 20]: every prompt token's logprob given the tokens before it (the first: None)
    # and the N most likely alternatives, computed in prefill.
    structured: Annotated[Constraint | None, check_structured] = None
    # None = free text; else the constraint the generated text must match (protocol.structured: a JSON
    # schema, any JSON object, a regex, a choice of strings, a Lark or GBNF grammar), compiled on the
    # worker (a spec that does not compile: bad_request before any token). Needs a model with a tokenizer.
    tools: Annotated[str | None, check_tools] = None
    # None = no tools; else the JSON text of OpenAI's tool definitions (protocol.tools), shown to the model
    # by whoever renders the chat prompt (the worker: through the chat template when it renders tools, else
    # in the Hermes format, worker.models.hermes). Needs a chat prompt. The output is not parsed here.
    suffix: Annotated[str | None, _suffix] = None
    # None = the prompt alone; else fill in the middle: the prompt (text; may then be "") is the code
    # before the gap and this the code after it. The worker renders them with the model's own FIM
    # tokens (worker/models/fim.py: Qwen2.5-Coder's and StarCoder's, CodeLlama's, DeepSeek-Coder's),
    # and the model's FIM end tokens join its default stop tokens. A model without them: unsupported.
    input_extra: Annotated[tuple[tuple[str, str], ...], _input_extra] = ()
    # with suffix: other files' chunks ({"filename": str, "text": str}, llama.cpp's input_extra, at
    # most 256), shown to the model before the prefix (its repo-level format where it has one).
    clamp_max_tokens: Annotated[bool, _flag] = False
    # True: max_tokens is a default budget that the model's context may lower: a prompt that leaves fewer
    # tokens gets what it leaves (a prompt that fills the context is still refused); what the HTTP gateway
    # sends for a request without max_tokens, whose prompt length only the worker knows. False: prompt +
    # max_tokens past the context is refused (context_length_exceeded).
    chat_template_kwargs: Annotated[str | None, check_template_kwargs] = None
    # None = none; else the JSON text of an object of extra variables for the chat template (vLLM's and
    # llama.cpp's chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3; the HTTP gateway puts
    # reasoning_effort here too), passed to transformers' apply_chat_template by the worker. Needs a chat
    # prompt. Names the renderer sets itself are refused (TEMPLATE_RESERVED).
    kind: Annotated[str, _kind] = RequestKind.GENERATE.value
    # "generate" (tokens) or "embed": the prompt's pooled embedding and no token, from a worker serving an
    # embedding model (an embedding request to a generation worker, or the reverse, ends "unsupported").
    # An embedding takes a token-id or text prompt (its ids as given: no special token added; a text is
    # tokenised with them), max_tokens 1, and no generation option; its prompt must fit the model's
    # max_seq_len (context_length_exceeded otherwise: never truncated).
    continue_final_message: Annotated[bool, _flag] = False
    # True: the chat's final message is left open and the model continues it (the "prefill" idiom: the
    # output is the rest of that message, e.g. an assistant's "Sure, here is"), as vLLM's and transformers'
    # continue_final_message; needs a chat prompt whose final message has no tool calls. False: the chat
    # as the template closes it.
    add_generation_prompt: Annotated[bool | None, _optional_flag] = None
    # True: the template's generation prompt (the header of the assistant's turn) ends the prompt; False:
    # none (vLLM's add_generation_prompt). None = True, but for a request that continues its final
    # message (continue_final_message), which cannot take one: True with it is refused, as vLLM does.
    # Needs a chat prompt.


_NAMES = frozenset(_Fields._fields)
_REQUIRED = object()  # "no default": never identical to a value
_CHECKS = tuple((name, hint.__metadata__[0], _Fields._field_defaults.get(name, _REQUIRED))
                for name, hint in get_type_hints(_Fields, include_extras=True).items())
"""(name, check, default) per field; a value that *is* the default needs no check."""
_DRAW_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p")
"""The request fields that shape the random draw, copied by name into its :class:`SamplingParams`
(left at :data:`GREEDY`'s where the request is greedy: they do not change an argmax)."""
_PROCESSOR_FIELDS = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty")
"""The request fields of the logits processors, copied by name into its :class:`SamplingParams`."""
_draw_values = operator.attrgetter(*_DRAW_FIELDS)
_processor_values = operator.attrgetter(*_PROCESSOR_FIELDS)
_NO_PROCESSORS = _processor_values(GREEDY)
_OPTION_DEFAULTS = tuple(_Fields._field_defaults[name] for name in _Fields._fields[2:])
_DEFAULTS = tuple(default for _, _, default in _CHECKS)
_FIELD_COUNT = len(_CHECKS)
_FIELD_INDEXES = range(_FIELD_COUNT)
_is_not = operator.is_not
_OPTION_TYPES = tuple(map(type, _OPTION_DEFAULTS))
_AFTER_STOP_DEFAULTS = _OPTION_DEFAULTS[1:]  # the options after stop_token (the first option)
_AFTER_STOP_TYPES = _OPTION_TYPES[1:]
_NUMERIC_OPTIONS = tuple(i for i in range(3, _FIELD_COUNT) if type(_DEFAULTS[i]) in (int, float, bool))
_numeric_options = operator.itemgetter(*_NUMERIC_OPTIONS)  # (the options after stop_token whose default is a number)
_NUMERIC_OPTION_TYPES = tuple(type(_DEFAULTS[i]) for i in _NUMERIC_OPTIONS)

ROW_ALIASES = {"messages": "prompt"}
"""Other names a JSONL row may use for a field: ``"messages"`` (chat messages,
as in OpenAI's API) for ``prompt``. (A row's ``"stop"`` is shared out by
entry, see :meth:`RequestParams.from_mapping`.)"""


class RequestParams(_Fields):
    """A generation request's parameters, validated and normalised when built.

    ``RequestParams(prompt, max_tokens, **options)``: the fields and their
    rules are listed (with defaults and units) in this module's ``_Fields``;
    docs/parameters.md (generated from it) describes them for users. Building raises ``ValueError``
    naming the first bad field, and ``TypeError`` for an unknown option;
    every value it accepts can travel on the wire. Normalised: token lists
    and stop sequences become tuples, ``stop_token`` a sorted tuple of ids or
    :data:`DEFAULT`, chat messages :class:`ChatMessage` tuples.

    Immutable (a tuple); ``_replace`` and ``_make`` validate like the constructor.
    Checks that need a model (vocabulary, context length) are :class:`ModelLimits`'.
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **options: Any) -> RequestParams:
        return _build(cls, args, options)

    @classmethod
    def _make(cls, iterable) -> RequestParams:  # (namedtuple's skips __new__, hence the check)
        return cls(*iterable)

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> RequestParams:
        """Build from a JSON-like mapping such as a ``slotserve run`` row (without its
        ``id``): keys are field names or their :data:`ROW_ALIASES`; ``"messages"``
        must hold chat messages. ValueError for unknown, duplicate or missing keys.

        ``"stop"`` takes what OpenAI's (and slotserve's HTTP) ``stop`` takes:
        a string, or a list whose entries are strings (text stop strings, the
        ``stop`` field) or lists of token ids (``stop_sequences``, what a row's
        ``"stop"`` has always meant), in any mix: ``"stop": ["\\n\\n", [13, 13]]``.
        """
        kwargs: dict[str, Any] = {}
        if "stop" in fields:
            fields = {**fields, **_row_stop(fields["stop"], "stop_sequences" in fields)}
        for key, value in fields.items():
            name = ROW_ALIASES.get(key, key)
            if name not in _NAMES:
                raise ValueError(f"unknown field {echo(key)}; allowed: {sorted(_NAMES | set(ROW_ALIASES))}")
            if name in kwargs:
                both = sorted(k for k in fields if ROW_ALIASES.get(k, k) == name)
                raise ValueError(f"give one of {both}, not both")
            if key == "messages" and not (isinstance(value, (list, tuple)) and value
                                          and isinstance(value[0], Mapping)):
                raise ValueError(f"messages must be a non-empty list of chat messages, got {echo(value)}")
            kwargs[name] = value
        missing = [n for n in _Fields._fields if n not in _Fields._field_defaults and n not in kwargs]
        if missing:
            raise ValueError(f"missing field(s) {missing} ('messages' may stand for 'prompt')")
        return cls(**kwargs)

    # ---- derived views

    @property
    def generation_prompt(self) -> bool:
        """Whether a chat prompt ends with the template's generation prompt: ``add_generation_prompt``,
        which left out (None) means not when the final message is continued, else yes."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    @property
    def is_token_prompt(self) -> bool:
        """True when the prompt is token ids (not text or chat messages)."""
        prompt = self.prompt
        return type(prompt) is not str and type(prompt[0]) is int

    @property
    def sampling(self) -> SamplingParams:
        """The sampling fields as a :class:`SamplingParams`; greedy (below :data:`GREEDY_BELOW`)
        with the draw's options at their defaults, where they do not matter (:data:`GREEDY`
        itself when no processor is set either)."""
        greedy = self.temperature < GREEDY_BELOW
        processors = _processor_values(self)
        if greedy and processors == _NO_PROCESSORS and self.structured is None:
            return GREEDY
        fields = dict(zip(_PROCESSOR_FIELDS, processors))
        if not greedy:
            fields.update(zip(_DRAW_FIELDS, _draw_values(self)))
        if self.structured is not None:
            fields.update(structured=self.structured,
                          structured_stops=self.stop_token if type(self.stop_token) is tuple else ())
        return SamplingParams(**fields)

    def check_resume(self, tokens: object, vocab_size: int | None = None) -> tuple[int, ...]:
        """``tokens`` already generated for this request elsewhere (migration,
        resubmission), checked: token ids, fewer than ``max_tokens``. Returns a tuple."""
        out = as_tokens(tokens, "resume_tokens")
        if len(out) >= self.max_tokens:
            raise ValueError(f"resume_tokens holds {len(out)} tokens but max_tokens is {self.max_tokens}: "
                             "the request is already complete")
        check_vocab(out, "resume_tokens", vocab_size)
        return out


def from_wire(values: tuple) -> RequestParams:
    """``RequestParams(*values)`` for the fields by position as decoded off the wire (a tuple of 2
    or more values; see :func:`protocol.codec.decode`), without unpacking them into a call: once per
    request per hop. Same values, same errors.

    An array shorter than the fields gets the defaults of those it lacks (:func:`to_wire` leaves
    trailing defaults out; an older peer knows fewer fields). The hot paths (a token-id prompt,
    each option but ``stop_token`` its default: left out, or every field given) are
    :func:`_build`'s, with one difference that only decoded values allow: their types are msgpack's
    (int, float, bool, str, bytes, None, tuples, maps, msgpack's own records), of which only a
    number equals a number of another type (``0 == 0.0 == False``), so the types of the options
    whose default is a number are compared, not all of them. A valid decoded array is then the
    request itself (its prompt and ``stop_token`` already as their checks return them)."""
    n = len(values)
    if n == 3:  # [prompt, max_tokens, stop_token], every later option its default (as to_wire leaves them out)
        prompt, max_tokens, stop_token = values
        tokens = plain_tokens(prompt)
        if tokens and type(max_tokens) is int and 1 <= max_tokens <= WIRE_INT_MAX:
            if stop_token == () and type(stop_token) is tuple and tokens is prompt:  # (no stop token: as it came)
                return _tuple_new(RequestParams, values + _AFTER_STOP_DEFAULTS)
            return _tuple_new(RequestParams, (tokens, max_tokens, _stop_token(stop_token, "stop_token"))
                              + _AFTER_STOP_DEFAULTS)
    if n != _FIELD_COUNT:  # (trailing defaults left out: to_wire's arrays, an older peer's)
        return _build(RequestParams, values, _NO_OPTIONS)
    if values[3:] == _AFTER_STOP_DEFAULTS and tuple(map(type, _numeric_options(values))) == _NUMERIC_OPTION_TYPES:
        prompt, max_tokens, stop_token = values[:3]
        tokens = plain_tokens(prompt)
        if tokens and type(max_tokens) is int and 1 <= max_tokens <= WIRE_INT_MAX:
            stop = () if stop_token == () and type(stop_token) is tuple else _stop_token(stop_token, "stop_token")
            if tokens is prompt and stop is stop_token:
                return _tuple_new(RequestParams, values)
            return _tuple_new(RequestParams, (tokens, max_tokens, stop) + _AFTER_STOP_DEFAULTS)
    return _checked(RequestParams, values, _NO_OPTIONS)  # (_build's hot paths would miss it too)


def from_wire_plain(arrays: tuple) -> list[RequestParams] | None:
    """:func:`from_wire` of each of ``arrays`` (decoded values), when every one is a plain request as
    :func:`to_wire` sends it -- ``[token-id prompt, max_tokens, stop_token]`` with no stop token or
    one id -- else None (the caller then decodes each alone, which says what is wrong with which).

    The same values and types as :func:`from_wire` gives each, checked a column at a time: the
    types, lengths and bounds of all prompts, budgets and stop tokens in a few C passes (the ids of
    every prompt and stop token in one ``array('Q')``, which takes exactly the ints in
    ``[0, 2**64)``) instead of a Python call per request: a ``submit`` carries hundreds of requests,
    and this is every one of them on every hop (``python -m bench.broker_profile``)."""
    n = len(arrays)
    if not n or _count_of(map(type, arrays), tuple) != n:
        return None
    try:
        prompts, budgets, stops = zip(*arrays, strict=True)  # (ValueError: not all of 3 values)
    except ValueError:
        return None
    if _count_of(map(type, prompts), tuple) != n or min(map(len, prompts)) < 1:
        return None
    ids = prompts + (budgets,)  # (the budgets checked with the ids: ints in range; then >= 1)
    if _count_of(stops, ()) != n:  # (() is one object: a C pass of identity tests)
        if _count_of(map(type, stops), tuple) != n or max(map(len, stops)) > 1:
            return None
        ids += stops
    ids = tuple(_chain.from_iterable(ids))
    if _count_of(map(type, ids), int) != len(ids) or min(budgets) < 1:  # (bool is not int here: refused)
        return None
    try:
        array("Q", ids)
    except OverflowError:
        return None
    return list(map(_tuple_new, _repeat(RequestParams, n), map(operator.add, arrays, _repeat(_AFTER_STOP_DEFAULTS, n))))


_NO_OPTIONS: dict[str, Any] = {}


def to_wire(params: RequestParams) -> tuple:
    """``params``' fields by position as :func:`protocol.codec.encode` puts them on the wire: the
    options after ``stop_token`` that equal their defaults, from the last one back, left out
    (``prompt``, ``max_tokens`` and ``stop_token`` always kept). :func:`from_wire` gives the left-out
    fields their defaults, so the far side decodes ``params`` itself, field types included: the
    values of a request are normalised when it is built (``temperature=0`` is the float ``0.0``,
    ``priority=False`` is refused), so one equal to its default is its default. A greedy token-id
    request is then 3 values instead of 22 (its envelope packs in 11 bytes instead of 82 with a
    3-token prompt), which every hop packs, unpacks and checks (``python -m bench.broker_profile``:
    the broker's handling of the benchmark's requests, about 15 % less time)."""
    if params[3:] == _AFTER_STOP_DEFAULTS:  # (the common case; C compares, the default objects themselves first)
        return params[:3]
    n = _FIELD_COUNT
    while n > 3 and params[n - 1] == _DEFAULTS[n - 1]:
        n -= 1
    return params[:n]


def _build(cls: type[RequestParams], args: tuple, options: dict[str, Any]) -> RequestParams:
    """:class:`RequestParams`' constructor: ``args`` by position, then ``options`` by name."""
    n = len(args)
    if n == 2 and len(options) == 1 and "stop_token" in options:
        # submit_request(prompt, max_tokens, stop_token=...): stop_token is the option a client most
        # often sets (None for no stop token, or its model's end token): a caller's hot path, checked
        # as the wire's below (measured in-process: 2.2 -> 0.9 us a request, a client's largest cost).
        prompt, max_tokens = args
        tokens = plain_tokens(prompt)
        if tokens and type(max_tokens) is int and 1 <= max_tokens <= WIRE_INT_MAX:
            return _tuple_new(cls, (tokens, max_tokens, _stop_token(options["stop_token"], "stop_token"))
                              + _AFTER_STOP_DEFAULTS)
    if (n == 2 or (n == _FIELD_COUNT and (tail := args[3:]) == _AFTER_STOP_DEFAULTS
                   and tuple(map(type, tail)) == _AFTER_STOP_TYPES)) and not options:
        # submit_request(prompt, max_tokens), or every field as decoded off the wire with each option
        # but stop_token equal to its default and of its type (a float decodes as a new object, never
        # the default itself; -0.0 becomes 0.0): the hot path, once per hop. stop_token is the option
        # a client most often sets (None for no stop token, or its model's end token): it is checked
        # here, alone (no rule between fields involves it).
        prompt, max_tokens = args[:2]
        tokens = plain_tokens(prompt)
        if tokens and type(max_tokens) is int and 1 <= max_tokens <= WIRE_INT_MAX:
            if n == 2:
                return _tuple_new(cls, (tokens, max_tokens) + _OPTION_DEFAULTS)
            return _tuple_new(cls, (tokens, max_tokens, _stop_token(args[2], "stop_token")) + _AFTER_STOP_DEFAULTS)
    elif not _NAMES.issuperset(options):
        unknown = sorted(set(options) - _NAMES)
        raise TypeError(f"unknown request option(s) {unknown}; the options are {sorted(_NAMES)}")
    return _checked(cls, args, options)


def _checked(cls: type[RequestParams], args: tuple, options: dict[str, Any]) -> RequestParams:
    """:func:`_build`'s general path: every field not given as its default checked, then the rules
    between fields (``options``: known names only)."""
    # Bind the arguments like a signature would (all of them in order, as decoded off the wire: as is).
    n = len(args)
    values = list(args if n == _FIELD_COUNT and not options else _Fields(*args, **options))
    # Each field is checked, but for its default: the default object itself, or (as a float or a
    # string decodes, a new object) a value of the default's type equal to it (which its check
    # would return as it is). The loop runs over the fields not given as the default object only.
    for i in _compress(_FIELD_INDEXES, map(_is_not, values, _DEFAULTS)):
        name, check, default = _CHECKS[i]
        value = values[i]
        if type(value) is not type(default) or value != default:
            values[i] = check(value, name)
    params = _tuple_new(cls, values)
    # The rules between fields (each field's own are its check, declared with it):
    if params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
    if params.min_tokens and params.structured is not None:  # (past the constraint's end only EOS is allowed,
        # which min_tokens masks: every token -inf, the request failed with a model error)
        raise ValueError("min_tokens cannot be combined with a structured constraint (or tool_choice required "
                         "or a named function): the constraint decides where the output ends; leave min_tokens out")
    if params.tools is not None and (type(params.prompt) is str or type(params.prompt[0]) is not ChatMessage):
        raise ValueError("tools need a chat prompt (a list of messages), not text or token ids")
    if params.chat_template_kwargs is not None and (
            type(params.prompt) is str or type(params.prompt[0]) is not ChatMessage):
        raise ValueError("chat_template_kwargs need a chat prompt (a list of messages), not text or token ids")
    if params.continue_final_message or params.add_generation_prompt is not None:
        _check_chat_ending(params)
    if params.suffix is None:
        if params.prompt == "":
            raise ValueError("prompt must not be empty")
        if params.input_extra:
            raise ValueError("input_extra needs a suffix (fill in the middle)")
    elif type(params.prompt) is not str:
        raise ValueError("suffix needs a text prompt (the code before the gap), not token ids or chat messages")
    if params.kind == RequestKind.EMBED:
        _check_embed(params)
    return params


def _check_chat_ending(params: RequestParams) -> None:
    """The rules of ``continue_final_message`` and ``add_generation_prompt``: ValueError naming the
    field for either on a prompt that is no chat, both true (vLLM's rule and words: the prompt cannot
    both continue its final message and open a new one)."""
    name = "continue_final_message" if params.continue_final_message else "add_generation_prompt"
    if type(params.prompt) is str or type(params.prompt[0]) is not ChatMessage:
        raise ValueError(f"{name} needs a chat prompt (a list of messages), not text or token ids")
    if not params.continue_final_message:
        return
    if params.add_generation_prompt:
        raise ValueError("continue_final_message: cannot set both `continue_final_message` and `add_generation_prompt` "
                         "to true: the prompt either continues its final message or opens a new one; leave "
                         "add_generation_prompt out")
    # (a final message with tool calls, which a continuation would cut off, is refused with the prompt:
    # its calls are unanswered, protocol.chat.Answers)


_EMBED_FIELDS = frozenset({"prompt", "max_tokens", "stop_token", "priority", "timeout_s", "kind"})
"""The fields an embedding request may set (the others are generation options)."""


def _check_embed(params: RequestParams) -> None:
    """The rules of an embedding request (``kind`` embed): ValueError naming what does not apply."""
    if type(params.prompt) is not str and type(params.prompt[0]) is not int:
        raise ValueError("prompt: an embedding takes text or token ids, not chat messages")
    if params.max_tokens != 1:
        raise ValueError(f"max_tokens: an embedding generates no token; send max_tokens=1, got {echo(params.max_tokens)}")
    given = [name for name, _, default in _CHECKS if name not in _EMBED_FIELDS and getattr(params, name) != default]
    if given:
        raise ValueError(f"{given[0]}: a generation option, which an embedding request (kind 'embed') cannot "
                         f"take; leave {', '.join(given)} out")


def split_stop(value: object) -> tuple[list[str], list[Any]]:
    """Share out ``stop`` as OpenAI's API and a ``slotserve run`` row take it
    (one string, None, or a list mixing strings and lists of token ids):
    returns (the strings -- text stop strings, the ``stop`` field --, the
    token-id lists -- ``stop_sequences``), each in order. The one place
    ``stop`` is shared out, for the HTTP gateway and :meth:`RequestParams.from_mapping`;
    the entries' contents are checked when the request is built.

    Raises :class:`~protocol.errors.StopEntryError` (a ValueError) for an
    entry of neither kind, ValueError for a ``value`` of none of these shapes.
    """
    if value is None:
        return [], []
    if isinstance(value, str):
        return [value], []
    if not is_sequence(value):
        raise ValueError(f"stop must be a str, a list or None, got {kind_of(value)}")
    texts, sequences = [], []
    for i, entry in enumerate(value):  # type: ignore[arg-type]
        if isinstance(entry, str):
            texts.append(entry)
        elif is_sequence(entry):
            sequences.append(entry)
        else:
            raise StopEntryError(i, entry)
    return texts, sequences


def _row_stop(value: object, has_sequences: bool) -> dict[str, Any]:
    """A row's ``"stop"`` as fields (:func:`split_stop`): strings -> ``stop``,
    lists of token ids -> ``stop_sequences``."""
    if isinstance(value, str) or not is_sequence(value):
        return {"stop": value}  # (the field's check says what is wrong with a non-list)
    texts, sequences = split_stop(value)
    if sequences and has_sequences:
        raise ValueError("give token-id stop sequences in one of ['stop', 'stop_sequences'], not both")
    return {"stop": texts, **({"stop_sequences": sequences} if sequences else {})}


KIND_REFUSALS = {
    True: "model names an embedding model, which generates no tokens: send completions and chats to a generation "
          "model, and embedding requests (/v1/embeddings, /v1/rerank) to this one",
    False: "model names a model that generates text and gives no embeddings: send embedding requests to an "
           "embedding model (a sentence-transformers folder such as all-minilm-l6-v2, or a model served with "
           "--pooling)",
}
"""What a request of the kind its model does not serve is refused with (:class:`~protocol.errors.UnsupportedError`,
by whoever knows the model: the worker, a client told its kind), by whether the model embeds. The fault is
the model the request names, not its prompt: the words start with ``model``, the field an HTTP answer
names (``param``)."""


class ModelLimits:
    """What a model accepts: token ids in ``[0, vocab_size)``, prompt +
    ``max_tokens`` within ``max_seq_len`` tokens (None: unbounded), and text
    (text or chat prompts, text stop strings) only when ``has_tokenizer``
    (None: unknown, not checked), and requests of its kind only: embeddings
    (``kind`` embed) when ``embeds``, generation when not (None: unknown).
    ``undefined``: ``((start, stop), ...)``, sorted half-open ranges of ids in ``[0, vocab_size)``
    that the model's tokenizer does not define (its vocabulary padded to the embedding's rows:
    Qwen2.5's ids 151,665-151,935; the worker's engine knows them, from its tokenizer); a
    ``logit_bias`` on one of them is refused (the model, never trained to write them, would).
    Built once per model (an engine, a client that knows the model); immutable."""

    __slots__ = ("vocab_size", "max_seq_len", "has_tokenizer", "embeds", "undefined", "_token_ids")

    def __init__(self, vocab_size: int | None = None, max_seq_len: int | None = None,
                 has_tokenizer: bool | None = None, embeds: bool | None = None,
                 undefined: tuple[tuple[int, int], ...] = ()) -> None:
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.has_tokenizer = has_tokenizer
        self.embeds = embeds
        self.undefined = undefined
        # frozenset(range(vocab_size)): a prompt's check is then one membership test per token,
        # faster than max() (measured); none past 2**18 ids (the set's memory).
        self._token_ids = None if vocab_size is None or vocab_size > 2**18 else frozenset(range(vocab_size))

    def check(self, params: RequestParams, prompt_len: int | None = None) -> None:
        """ValueError when ``params`` cannot run on this model (:class:`~protocol.errors.UnsupportedError`,
        a ValueError, when it needs a tokenizer the model lacks; :class:`~protocol.errors.ContextLengthError`,
        a ValueError, when prompt + ``max_tokens`` exceed ``max_seq_len`` -- naming ``max_tokens`` first
        when it alone leaves no room for a prompt, before the prompt is tokenised, a text prompt's too --
        or an embedding's prompt alone does; UnsupportedError too for a request of the kind the model
        does not serve). ``prompt_len``: the prompt's length in tokens when it is text (known once
        tokenised; None skips the context check for text but that of ``max_tokens`` alone)."""
        embeds = self.embeds
        if embeds is not None and (params.kind == RequestKind.EMBED) is not embeds:
            raise UnsupportedError(KIND_REFUSALS[embeds])
        vocab_size = self.vocab_size
        prompt = params.prompt
        if type(prompt) is not str and type(prompt[0]) is int:
            prompt_len = len(prompt)
            if vocab_size is not None and not (self._token_ids is not None and self._token_ids.issuperset(prompt)):
                check_vocab(prompt, "prompt", vocab_size)
        elif self.has_tokenizer is False:
            raise UnsupportedError("this model has no tokenizer: send the prompt as token ids, not text")
        if params.structured is not None and self.has_tokenizer is False:
            raise UnsupportedError("structured outputs need a model with a tokenizer (the grammar is over text), "
                                   "and this one has none")
        if params.stop and self.has_tokenizer is False:
            raise UnsupportedError("stop strings need a model with a tokenizer, and this one has none: give "
                                   "token-id stop sequences (stop_sequences) instead")
        if vocab_size is not None and (params.stop_sequences or type(params.stop_token) is tuple):
            if type(params.stop_token) is tuple:
                check_vocab(params.stop_token, "stop_token", vocab_size)
            for i, seq in enumerate(params.stop_sequences):
                check_vocab(seq, f"stop_sequences[{i}]", vocab_size)
        if vocab_size is not None and params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
            raise ValueError(f"logit_bias holds token id {params.logit_bias[-1][0]}, outside the model's "
                             f"vocabulary [0, {vocab_size})")
        if self.undefined and params.logit_bias:
            self._check_defined(params.logit_bias)
        max_seq_len = self.max_seq_len
        if params.kind == RequestKind.EMBED:  # (no token is generated: the prompt alone must fit)
            if max_seq_len is not None and prompt_len is not None and prompt_len > max_seq_len:
                raise ContextLengthError(  # (--max-model-len only lowers an embedding model's limit: no remedy)
                    f"input ({prompt_len} tokens) exceeds the {max_seq_len} tokens this model embeds at most (the "
                    "model's own limit, or a lower --max-model-len); shorten it or split it into several inputs")
            return
        if max_seq_len is not None and params.max_tokens >= max_seq_len and not params.clamp_max_tokens and (
                prompt_len is None or prompt_len < max_seq_len):  # (the budget alone is at fault: no prompt fits)
            room = "" if prompt_len is None else f" (at most {max_seq_len - prompt_len} with this prompt of {prompt_len})"
            raise ContextLengthError(f"max_tokens ({params.max_tokens}) leaves no room for the prompt in the served "
                                     f"context of {max_seq_len} tokens (--max-model-len), which the prompt and the "
                                     f"tokens generated share; lower max_tokens below {max_seq_len}{room}")
        if max_seq_len is not None and prompt_len is not None and params.clamp_max_tokens:
            if prompt_len < max_seq_len:
                return  # (the engine lowers max_tokens to what the context leaves: fit())
            raise ContextLengthError(f"prompt ({prompt_len} tokens) leaves no room to generate in the served "
                                     f"context of {max_seq_len} tokens (--max-model-len); shorten the prompt")
        if max_seq_len is not None and prompt_len is not None and prompt_len + params.max_tokens > max_seq_len:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {prompt_len + params.max_tokens} "
                f"exceeds the served context of {max_seq_len} tokens (--max-model-len); shorten the prompt or lower "
                "max_tokens")

    def _check_defined(self, logit_bias: tuple[tuple[int, float], ...]) -> None:
        """ValueError naming the first id of ``logit_bias`` (sorted by id) in a range of ``undefined``."""
        for token, _ in logit_bias:
            for start, stop in self.undefined:
                if start <= token < stop:
                    raise ValueError(f"logit_bias holds token id {token}, which the model's tokenizer does not "
                                     f"define (ids {start}..{stop - 1} only pad its vocabulary to the model's "
                                     f"{self.vocab_size} rows: no text is written as them); bias ids the "
                                     "tokenizer defines")

    def fit(self, params: RequestParams, prompt_len: int) -> RequestParams:
        """``params`` whose ``max_tokens`` fits the context after a prompt of ``prompt_len`` tokens
        when it asks for that (``clamp_max_tokens``); else ``params`` unchanged. Call after :meth:`check`."""
        left = None if self.max_seq_len is None else self.max_seq_len - prompt_len
        if not params.clamp_max_tokens or left is None or params.max_tokens <= left:
            return params
        return params._replace(max_tokens=left)

    def build(self, prompt: object, max_tokens: object, **options: Any) -> RequestParams:
        """``RequestParams(prompt, max_tokens, **options)``, checked against this model
        too (:meth:`check`): ValueError / TypeError as they raise.

        The common case -- token ids, no options -- is one membership test per
        token instead of a type pass, a wire-range pass and a vocabulary pass:
        ids of the vocabulary lie in the wire's range. (An engine submits every
        request through here; bench/engine.py's end-to-end target needs it.)
        """
        ids = self._token_ids
        if not options and ids is not None and (type(prompt) is list or type(prompt) is tuple) and prompt \
                and _count_of(map(type, prompt), int) == len(prompt) and ids.issuperset(prompt) \
                and type(max_tokens) is int and 1 <= max_tokens <= WIRE_INT_MAX \
                and (self.max_seq_len is None or len(prompt) + max_tokens <= self.max_seq_len):
            return _tuple_new(RequestParams, (tuple(prompt), max_tokens) + _OPTION_DEFAULTS)
        params = RequestParams(prompt, max_tokens, **options)
        self.check(params)
        return params


def check_stop_token(value: object) -> tuple[int, ...] | str:
    """The ``stop_token`` rule, for whoever holds a default of its own (an engine,
    a client): None -> ``()``, an id or ids -> a sorted tuple, :data:`DEFAULT` as is."""
    return _stop_token(value, "stop_token")


def check_request_id(value: object) -> RequestId:
    """A caller-chosen request id: an int (not bool) in the wire's range, or a
    non-empty str of at most :data:`MAX_REQUEST_ID_CHARS` characters. ValueError otherwise."""
    if isinstance(value, str):
        if not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters, got {len(value)}")
        return as_text(value, "request_id")
    if not hasattr(value, "__index__") or isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError(f"request_id must be an int or a str of 1..{MAX_REQUEST_ID_CHARS} characters, got "
                         f"{described(value)}")
    return as_int(value, "request_id")
