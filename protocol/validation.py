"""Field checks: what a value must be to be used here and to travel on the wire.

Each function takes a caller's value and returns it normalised (plain
Python ints, tuples), or raises :class:`ValueError` naming the field and what
to send instead. They accept exactly what the msgpack codec can carry:
integers in msgpack's 64-bit range ``[-2**63, 2**64)`` and strings that
UTF-8 can encode (no lone surrogates such as ``"\\ud83d"``), so a value that
passes here can never fail later in an encoder. JSON text inside a string (a tool
call's arguments, a schema) is checked for what parses to a lone surrogate, the
escape ``\\ud800`` (:func:`check_json_text`), and the JSON text of a caller's
objects for a lone surrogate in any of their strings (:func:`check_json_unicode`).

Integer rules (docs/architecture.md, "One request, defined once"): an "int"
is anything with ``__index__`` -- Python ints and numpy integers -- except
``bool`` (``True`` is a flag, never a token). Floats and strings are
rejected even when integral, so a caller's type confusion surfaces at once
instead of as a strange generation.
"""

from __future__ import annotations

import json
import math
import operator
import re
from array import array
from collections.abc import Iterable, Mapping, Set

WIRE_INT_MIN = -(2**63)
"""Smallest integer msgpack carries."""

WIRE_INT_MAX = 2**64 - 1
"""Largest integer msgpack carries."""

_count_of = operator.countOf

ECHO_MAX_CHARS = 100
"""The most characters of a caller's value an error message echoes (:func:`echo`, :func:`clip`)."""


def clip(text: str, limit: int = ECHO_MAX_CHARS) -> str:
    """``text`` as an error message echoes it unquoted: whole up to ``limit`` characters, else its
    first ``limit`` and ``… (N characters)``. Every message that echoes what a client sent (a model
    name, a key, a field's value; on the wire, over HTTP, in a ValueError) goes through this or
    :func:`echo`, so a 100 KB model name comes back as 100 characters and its length."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def start_hint(model: str) -> str:
    """What an ``unknown_model`` message suggests: ``start one (slotserve worker --model NAME)``, or
    without the command for a name too long to echo whole (:data:`ECHO_MAX_CHARS`)."""
    return f"start one (slotserve worker --model {model})" if len(model) <= ECHO_MAX_CHARS else "start a worker for it"


def echo(value: object, limit: int = ECHO_MAX_CHARS) -> str:
    """``value`` as an error message quotes it: its ``repr`` (a string quoted, escaped), or for a
    string of more than ``limit`` characters the repr of its first ``limit`` and ``… (N characters)``;
    any other repr past ``limit`` characters is cut likewise (:func:`clip`). A value nested past
    Python's recursion limit (a Python caller's: JSON off the wire is read shallower), which has no
    repr, is named by its type (``a dict nested too deeply to show``), and an int past Python's limit
    on the digits ``str`` writes (:func:`sys.get_int_max_str_digits`, 4,300 by default) by its size
    (``an int of about 5,001 digits``): neither has a repr, and Python's words are no client's."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    try:
        text = repr(value)
    except RecursionError:  # (repr's own words, "maximum recursion depth exceeded ...", are Python's)
        return f"a {type(value).__name__} nested too deeply to show"
    except ValueError:  # ("Exceeds the limit (4300 digits) for integer string conversion")
        if not isinstance(value, int):
            raise
        return f"an int of about {int(abs(value).bit_length() * _LOG10_2) + 1:,} digits"
    return clip(text, limit + 2)


_LOG10_2 = math.log10(2)


_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          bytes: "binary data", list: "an array", tuple: "an array", dict: "an object"}


def kind_of(value: object) -> str:
    """What ``value`` is, in the words of the values a client can send (JSON's, which msgpack's
    match), never Python's type names: ``"null"``, ``"a boolean"``, ``"an integer"``, ``"a number"``
    (a float), ``"a string"``, ``"binary data"`` (bytes), ``"an array"`` (a list, or a tuple: an
    array off the wire), ``"an object"`` (a mapping). Validation messages say ``got <kind>``: they
    reach clients of every entry point (HTTP bodies and JSONL rows are JSON, ZeroMQ frames msgpack),
    where ``got tuple`` named no value the client sent. Any other type (a set, a numpy array: only
    a Python caller in process sends one) is named by its type's name, as precise as it was."""
    kind = _KINDS.get(type(value))
    if kind is not None:
        return kind
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, bool):
        return "a boolean"
    return type(value).__name__


def described(value: object) -> str:
    """``value`` as a message's ``got ...`` shows a value of the wrong type: its kind
    (:func:`kind_of`) and its :func:`echo`, an array or object as its JSON (an array off the wire is a
    tuple, whose repr ``(1,)`` is Python's), ``null`` for None and ``true`` / ``false`` for a boolean
    (whose kind their words say): ``got a string '5'``, ``got an array [1]``, ``got true``."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "true" if value else "false"
    if isinstance(value, (list, tuple, Mapping)):
        try:
            return f"{kind_of(value)} {clip(json.dumps(value, default=repr))}"
        except (TypeError, ValueError, RecursionError):  # (keys JSON cannot write, a big int, deep nesting)
            pass
    return f"{kind_of(value)} {echo(value)}"


def as_int(value: object, field: str, *, minimum: int = WIRE_INT_MIN) -> int:
    """``value`` as a Python int in ``[minimum, 2**64)``; ValueError for bool, float, str and friends."""
    if type(value) is not int:
        if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
            raise ValueError(f"{field} must be an int, got {described(bool(value))}")
        try:
            value = operator.index(value)
        except TypeError:
            raise ValueError(f"{field} must be an int, got {described(value)}") from None
    if not minimum <= value <= WIRE_INT_MAX:
        if value < minimum:
            raise ValueError(f"{field} must be >= {minimum}, got {echo(value)}")
        raise ValueError(f"{field} must be < 2**64 (the wire's integer range), got {echo(value)}")
    return value


def as_float(value: object, field: str) -> float:
    """``value`` as a finite float; ValueError for bool, str, NaN and infinities."""
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        raise ValueError(f"{field} must be a number, got {described(value)}")
    try:
        out = float(value)  # type: ignore[arg-type]
    except OverflowError:  # (an int past a double's range: "int too large to convert to float")
        raise ValueError(f"{field} must be a finite number, got {echo(value)}, past a double's range (about "
                         "1.8e308)") from None
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number, got {kind_of(value)}") from None
    if not math.isfinite(out):
        raise ValueError(f"{field} must be finite, got {echo(value)}")
    return out


def as_text(value: object, field: str, *, allow_empty: bool = True) -> str:
    """``value`` as a str that UTF-8 can encode; ValueError for other types and
    for lone surrogates (they cannot travel: msgpack strings are UTF-8)."""
    if type(value) is not str:
        if not isinstance(value, str):
            raise ValueError(f"{field} must be a str, got {kind_of(value)}")
        value = str(value)
    if not value and not allow_empty:
        raise ValueError(f"{field} must not be empty")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} is not valid Unicode: {e.object[e.start:e.end]!r} at position {e.start} "
                             "(a lone surrogate?); send UTF-8-encodable text") from None
    return value


LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone surrogate in a Python str (a str holds no pair: a parsed ``"\\ud800"`` escape), which UTF-8 cannot encode."""

_SURROGATE_HINT = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate's \uXXXX escape (or a "\\" before one)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string literal
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.S)  # one escape in it; group 1: a \uXXXX's code unit


def unpaired_surrogate(text: str) -> tuple[str, int, int] | None:
    """The first escape of ``text`` (JSON text) that is half a UTF-16 surrogate pair -- a high half
    (``\\ud800``-``\\udbff``) not followed at once by a low one, or a low half (``\\udc00``-``\\udfff``)
    after none -- as ``(escape, line, column)`` (1-based, in characters), when it comes before the
    text's first syntax error; else None. Python's :func:`json.loads` takes such an escape and gives
    a str holding a lone surrogate, which UTF-8 (the wire, a tokenizer, an HTTP answer) cannot
    encode; RFC 8259 (section 8.2) leaves its meaning undefined. Text without a surrogate escape
    costs one regular-expression scan."""
    if not _SURROGATE_HINT.search(text):
        return None
    try:
        json.loads(text)
        end = len(text)
    except json.JSONDecodeError as e:  # (the parser's error position bounds the search)
        end = e.pos
    except (ValueError, RecursionError):
        end = len(text)
    for literal in _STRING.finditer(text, 0, end):
        high = None  # a high half's escape, waiting for its low half
        for m in _ESCAPE.finditer(text, literal.start(), literal.end()):
            unit = int(m.group(1), 16) if m.group(1) else None
            if high is not None:
                if unit is not None and 0xDC00 <= unit <= 0xDFFF and m.start() == high.end():
                    high = None
                    continue
                return _located(text, high)
            if unit is not None and 0xD800 <= unit <= 0xDBFF:
                high = m
            elif unit is not None and 0xDC00 <= unit <= 0xDFFF:
                return _located(text, m)
        if high is not None:
            return _located(text, high)
    return None


def _located(text: str, m: re.Match) -> tuple[str, int, int]:
    line = text.count("\n", 0, m.start()) + 1
    return m.group(0), line, m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1


def surrogate_escape_message(what: str, found: tuple[str, int, int], fix: str) -> str:
    """The words for an unpaired surrogate escape ``found`` (:func:`unpaired_surrogate`'s) in the JSON
    text ``what`` names (``"the body"``, a field), ``fix`` saying how to send the character."""
    escape, line, column = found
    return (f"{what} is not valid JSON: it contains an unpaired surrogate escape '{escape}' at line {line} "
            f"column {column} (half of a UTF-16 surrogate pair, which is no character); {fix}")


MAX_JSON_DEPTH = 200
"""How many levels of arrays and objects a request's JSON values may nest (tools, template
variables, a call's arguments, a schema), counting the value's own: the HTTP body's bound (its
parser reads 200 levels inside the body's object, :data:`gateway.json_body.MAX_DEPTH`) for every
entry point, text inside a string and the Python SDK's values included, so what one takes the
worker can render: transformers' chat-template walk recurses twice a level, and tools 480 levels
deep ended there in Python's RecursionError ("maximum recursion depth exceeded")."""


def too_deep(field: str) -> str:
    """The words for a value of ``field`` (JSON text, or Python values to write as JSON) nested past
    :data:`MAX_JSON_DEPTH` levels (:func:`check_depth`), or past what Python's JSON reader and
    writer take (:class:`RecursionError`, whose own words, "maximum recursion depth exceeded while
    decoding a JSON array from a unicode string", are the library's, not the caller's)."""
    return (f"{field} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; slotserve reads at most "
            f"{MAX_JSON_DEPTH}: flatten it")


def json_depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """How many levels of mappings, lists and tuples ``value`` nests (0 for a scalar, 1 for ``[1]``),
    counted up to ``limit + 1`` (the walk stops there). Iterative: any depth."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, Mapping):
            items = v.values()
        elif isinstance(v, (list, tuple)):
            items = v
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            break
        stack.extend((item, level + 1) for item in items)
    return deepest


def check_depth(value: object, field: str) -> None:
    """ValueError :func:`too_deep` naming ``field`` when ``value`` nests more than :data:`MAX_JSON_DEPTH` levels."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(too_deep(field))


def check_json_text(text: str, field: str) -> None:
    """ValueError naming ``field`` when ``text``, JSON text a caller wrote inside a string (a tool
    call's arguments, a schema, tool definitions), has an unpaired surrogate escape such as
    ``"\\ud800"`` (:func:`unpaired_surrogate`): it parses to a string UTF-8 cannot encode."""
    found = unpaired_surrogate(text)
    if found is not None:
        raise ValueError(surrogate_escape_message(field, found, "write the character itself, or both halves "
                                                                "of its pair"))


def check_json_unicode(text: str, value: object, field: str) -> str:
    """``text``, the JSON text of ``value`` (written with ``ensure_ascii=False``), when UTF-8 can
    encode it; else ValueError naming the first string of ``value`` (a value or a key) that holds a
    lone surrogate, by its path under ``field`` (``tools[0].function.description``)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            try:
                _refuse_surrogates(value, field)
            except RecursionError:  # (nested about as deep as json.dumps goes: the words below)
                pass
            raise ValueError(f"{field} is not valid Unicode (a lone surrogate?); send UTF-8-encodable text") \
                from None  # (the walk found none: a type json.dumps writes by another rule)
    return text


def _refuse_surrogates(value: object, path: str) -> None:
    """:func:`as_text` of every string of ``value`` (nested maps and sequences), named by its path."""
    if isinstance(value, str):
        as_text(value, path)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                as_text(key, f"a key of {path}")
            _refuse_surrogates(item, f"{path}.{key}" if isinstance(key, str) and _KEY.fullmatch(key)
                               else f"{path}[{json.dumps(key)}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_surrogates(item, f"{path}[{i}]")


_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a key written after a dot in a path; others as ["..."]


ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
"""A chat message's role: OpenAI's (system, developer, user, assistant, tool, function) or a
template's own (``ipython``, ``observation``: vLLM and llama.cpp pass any role to the template, and
clients of Llama 3.x tool use send ``ipython``), a name; never text that would write template
markup (``user<|im_end|>``) or nothing. (OpenAI refuses roles other than its own; a stricter
check here would refuse those clients, so a name such as ``wizard`` reaches the template, as in
vLLM.) One rule for every entry point: HTTP, the Python SDK, ``slotserve run`` rows, the wire."""


def as_role(value: object, field: str) -> str:
    """``value``, a chat message's role that :data:`ROLE` matches (a name of letters, digits, ``_``
    and ``-``, at most 32 characters, not starting with a digit or ``-``); ValueError naming
    ``field`` else."""
    if type(value) is not str or not ROLE.fullmatch(value):
        raise ValueError(f"{field} must be a name such as 'user', 'assistant' or 'system' (letters, digits, "
                         f"'_' or '-', at most 32); got {echo(value)}")
    return value


def is_sequence(value: object) -> bool:
    """True for lists, tuples and other non-string, non-mapping, non-set iterables."""
    return type(value) is tuple or type(value) is list or (
        not isinstance(value, (str, bytes, bytearray, Mapping, Set)) and isinstance(value, Iterable))


def as_tokens(value: object, field: str, *, allow_empty: bool = True) -> tuple[int, ...]:
    """A sequence of token ids (ints >= 0; numpy arrays work) as a tuple.

    Raises ValueError for anything else, a bool, a negative id, or an empty
    sequence while ``allow_empty`` is False.
    """
    if type(value) is tuple or type(value) is list:
        plain = plain_tokens(value)
        if plain:
            return plain  # the common case, at C speed
        tokens = value
    elif is_sequence(value):
        tokens = list(value)  # type: ignore[call-overload]
    else:
        raise ValueError(f"{field} must be a list of int token ids, got {kind_of(value)}")
    if not tokens:
        if not allow_empty:
            raise ValueError(f"{field} must not be empty")
        return ()
    if _count_of(map(type, tokens), int) != len(tokens):  # C speed; the slow path for numpy ints
        tokens = [as_int(t, f"{field} element") for t in tokens]
    low, high = min(tokens), max(tokens)
    if low < 0:
        raise ValueError(f"{field} contains negative token id {low}; token ids are >= 0")
    if high > WIRE_INT_MAX:
        raise ValueError(f"{field} contains token id {high}, beyond the wire's integer range")
    return tokens if type(tokens) is tuple else tuple(tokens)


def plain_tokens(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple when it is a list or tuple of Python ints in
    ``[0, 2**64)`` -- token ids as nearly every caller sends them -- else None:
    the caller then takes its slow path, which says what is wrong (or
    accepts numpy integers). The token-id fast path of every check here.

    Two C passes and no Python loop: the types counted, then ``array('Q')``,
    which holds exactly the unsigned 64-bit integers and raises OverflowError
    for any other (measured: about 3x faster than ``min`` and ``max``; it
    runs for every prompt, once per hop).
    """
    kind = type(value)
    if (kind is list or kind is tuple) and _count_of(map(type, value), int) == len(value):
        try:
            array("Q", value)
        except OverflowError:
            return None
        return tuple(value) if kind is list else value
    return None


def check_vocab(tokens: tuple[int, ...], field: str, vocab_size: int | None) -> None:
    """ValueError when a token id of ``tokens`` lies outside ``[0, vocab_size)``."""
    if vocab_size is not None and tokens:
        high = max(tokens)
        if high >= vocab_size:
            raise ValueError(f"{field} contains token id {high}, outside the model's vocabulary [0, {vocab_size})")


def check_callbacks(**callbacks: object) -> None:
    """Raise :class:`ValueError` naming the first of ``callbacks`` (name ->
    value) that is neither None nor callable. The one check behind every
    ``callback``/``on_token``/``on_text`` argument, in process and in the client."""
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable or None, got {type(fn).__name__}")


def as_seconds(value: object, field: str, *, allow_zero: bool = False) -> float:
    """``value`` as a finite number of seconds, > 0 (>= 0 with ``allow_zero``).

    The one check behind every duration in a process's config: durations go
    on the wire (msgpack carries no infinity here: :func:`as_float`) or into
    deadlines, so ``inf`` and NaN are refused like bools and strings, with a
    ValueError naming ``field``. "Never" is spelled ``None`` where a config
    allows it, not ``inf``."""
    try:
        seconds = as_float(value, field)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 if allow_zero else seconds > 0):
        raise ValueError(f"{field} must be a finite number of seconds {'>=' if allow_zero else '>'} 0, "
                         f"got {echo(value)}")
    return seconds
