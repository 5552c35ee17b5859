"""Field checks: what a value must be to be used here and to travel on the wire.

Each function takes a caller's value and returns it normalised (plain
Python ints, tuples), or raises :class:`ValueError` naming the field and what
to send instead. They accept exactly what the msgpack codec can carry:
integers in msgpack's 64-bit range ``[-2**63, 2**64)`` and strings that
UTF-8 can encode (no lone surrogates such as ``"\\ud83d"``), so a value that
passes here can never fail later in an encoder.

Integer rules (docs/architecture.md, "One request, defined once"): an "int"
is anything with ``__index__`` -- Python ints and numpy integers -- except
``bool`` (``True`` is a flag, never a token). Floats and strings are
rejected even when integral, so a caller's type confusion surfaces at once
instead of as a strange generation.
"""

from __future__ import annotations

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


def as_int(value: object, field: str, *, minimum: int = WIRE_INT_MIN) -> int:
    """``value`` as a Python int in ``[minimum, 2**64)``; ValueError for bool, float, str and friends."""
    if type(value) is not int:
        if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
            raise ValueError(f"{field} must be an int, got bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise ValueError(f"{field} must be an int, got {type(value).__name__} {value!r:.50}") from None
    if not minimum <= value <= WIRE_INT_MAX:
        if value < minimum:
            raise ValueError(f"{field} must be >= {minimum}, got {value}")
        raise ValueError(f"{field} must be < 2**64 (the wire's integer range), got {value}")
    return value


def as_float(value: object, field: str) -> float:
    """``value`` as a finite float; ValueError for bool, str, NaN and infinities."""
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        raise ValueError(f"{field} must be a number, got {type(value).__name__} {value!r:.50}")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{field} must be a number, got {type(value).__name__}") from None
    if not math.isfinite(out):
        raise ValueError(f"{field} must be finite, got {value!r}")
    return out


def as_text(value: object, field: str, *, allow_empty: bool = True) -> str:
    """``value`` as a str that UTF-8 can encode; ValueError for other types and
    for lone surrogates (they cannot travel: msgpack strings are UTF-8)."""
    if type(value) is not str:
        if not isinstance(value, str):
            raise ValueError(f"{field} must be a str, got {type(value).__name__}")
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
                         f"'_' or '-', at most 32); got {value!r:.40}")
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
        raise ValueError(f"{field} must be a list of int token ids, got {type(value).__name__}")
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
                         f"got {value!r:.50}")
    return seconds
