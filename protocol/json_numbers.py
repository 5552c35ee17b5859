"""Numbers that JSON cannot hold: ``NaN``, ``Infinity``, ``-Infinity`` and one past a double's range.

RFC 8259 (section 6) has no NaN or Infinity, yet Python's :func:`json.loads` and pydantic's JSON
parser take both, and both read ``1e400`` (valid JSON, past a double's about 1.8e308) as infinity.
Such a value, taken into a free-form field (a schema, tool definitions, template variables,
metadata), failed later in someone else's words: ``json.dumps(allow_nan=False)``'s "Out of range
float values are not JSON compliant", Starlette's JSON response (a 500), or jinja's ``tojson``
writing ``Infinity`` into a prompt. Every entry point refuses them where they come in, naming
where: :func:`check_finite` (Python values: the SDK, the wire), :func:`loads` and
:func:`first_nonfinite` (JSON text: HTTP bodies, ``slotserve run`` rows, JSON inside strings).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from protocol.validation import clip

__all__ = ["WrittenNumber", "check_finite", "first_nonfinite", "loads", "nonfinite", "nonfinite_message", "nonfinite_words",
           "path_text", "syntax_problem"]


class WrittenNumber(float):
    """A number read from JSON text that no double holds: NaN or an infinity, with ``text``, its
    spelling in that text (``"NaN"``, ``"-Infinity"``, ``"1e400"``), for the words that refuse it."""

    text: str

    def __new__(cls, text: str) -> WrittenNumber:
        out = super().__new__(cls, text)
        out.text = text
        return out


def loads(text: str | bytes) -> tuple[Any, bool]:
    """``(value, nonfinite)``: :func:`json.loads` of ``text``, each number no double holds read as a
    :class:`WrittenNumber`, and whether there was one (so a caller walks the value only then).
    Raises what :func:`json.loads` raises (ValueError, RecursionError)."""
    seen = []

    def written(s: str) -> float:
        seen.append(s)
        return WrittenNumber(s)

    def number(s: str) -> float:
        x = float(s)
        return x if x - x == 0.0 else written(s)  # (inf - inf and NaN - NaN are NaN: not 0)

    return json.loads(text, parse_constant=written, parse_float=number), bool(seen)


_SYNTAX_WORDS = (  # the start of json's reason -> ours (CPython's json.decoder and its C scanner)
    ("Expecting value", "expected a value"),
    ("Expecting property name enclosed in double quotes", "expected an object's key in double quotes"),
    ("Expecting ':' delimiter", "expected ':' after an object's key"),
    ("Expecting ',' delimiter", "expected ',' or a closing bracket"),
    ("Unterminated string", "a string that starts there never ends"),
    ("Invalid control character", "a string holds a control character (U+0000 to U+001F); write it as an escape "
                                  "(\\n, \\t, \\u0001)"),
    ("Invalid \\uXXXX escape", "an invalid \\u escape"),
    ("Invalid \\escape", "a string holds an invalid escape (JSON's are \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)"),
    ("Extra data", "more text after the JSON value"),
    ("Illegal trailing comma", "a comma before the closing bracket"),
)


def syntax_problem(e: json.JSONDecodeError, one_line: bool = False) -> str:
    """Where and what :func:`loads` (:func:`json.loads`) found wrong, in our words, never the
    parser's ("Expecting value"): ``"at line 1 column 7: expected a value"`` (line and column from
    1, in characters; ``one_line``, a JSONL row: ``"at column 7: ..."``); a reason not known here
    is the place alone."""
    where = f"at column {e.colno}" if one_line and e.lineno == 1 else f"at line {e.lineno} column {e.colno}"
    words = next((ours for theirs, ours in _SYNTAX_WORDS if e.msg.startswith(theirs)), None)
    return where if words is None else f"{where}: {words}"


def first_nonfinite(value: Any) -> tuple[tuple[str | int, ...], float] | None:
    """``(path, number)``: the first float of ``value`` (nested mappings, lists and tuples, in their
    order) that is NaN or infinite, with the keys and indexes that lead to it (``("a", 0)``); None
    when there is none (:func:`nonfinite`'s first)."""
    return next(nonfinite(value), None)


def nonfinite(value: Any) -> Iterator[tuple[tuple[str | int, ...], float]]:
    """Each ``(path, number)`` of :func:`first_nonfinite`, in order. Iterative: any depth."""
    return ((path, x) for path, x in _floats(value) if not math.isfinite(x))


def _floats(value: Any) -> Iterator[tuple[tuple[str | int, ...], float]]:
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float):
            yield path, v
        elif isinstance(v, Mapping):
            stack.extend(((*path, k), item) for k, item in reversed(list(v.items())))
        elif isinstance(v, (list, tuple)):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(v))))


def path_text(field: str, path: tuple[str | int, ...], *, dotted: bool = False) -> str:
    """``path`` (:func:`first_nonfinite`'s) under ``field``: ``tools[0].function.parameters`` (a key
    of other characters as ``["a b"]``), or with ``dotted`` as an HTTP ``param`` writes it
    (``tools.0.function.parameters``, pydantic's ``loc`` joined); ``field`` empty: the path alone."""
    out = field
    for part in path:
        if isinstance(part, str) and (dotted or _KEY.fullmatch(part)):
            out += f".{part}"
        elif dotted or isinstance(part, int):
            out += f".{part}" if dotted else f"[{part}]"
        else:
            out += f"[{json.dumps(part)}]"
    return out.removeprefix(".")


_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a key written after a dot in a path; others as ["..."]


def nonfinite_words(where: str, number: float) -> str:
    """The refusal of ``number`` (NaN or infinite) at ``where``, in words that say what JSON holds and
    what to send instead; ``number`` a :class:`WrittenNumber` is named as it was written."""
    text = getattr(number, "text", None)
    if text is None:
        text = "NaN" if number != number else ("Infinity" if number > 0 else "-Infinity")
    if text.lstrip("-") in ("NaN", "Infinity"):
        return (f"{where} is {text}, which is no JSON number (JSON has no NaN or Infinity, RFC 8259); send a "
                "finite number, or the value as a string")
    return (f"{where} is {clip(text)}, past a double's range (about 1.8e308: it reads as infinity); send a number "
            "within range, or the value as a string")


def nonfinite_message(value: Any, field: str) -> str | None:
    """The refusal (:func:`nonfinite_words`) of the first number of ``value`` that is NaN or infinite,
    named by its place under ``field`` (``tools[0].function.parameters.maximum``); None when there is
    none. For the ``except`` of a ``json.dumps(allow_nan=False)`` that failed: its own words name
    neither the value nor where it is ("Out of range float values are not JSON compliant")."""
    found = first_nonfinite(value)
    return None if found is None else nonfinite_words(path_text(field, found[0]), found[1])


def check_finite(value: Any, field: str) -> None:
    """ValueError :func:`nonfinite_message` when ``value`` holds a number that is NaN or infinite."""
    message = nonfinite_message(value, field)
    if message is not None:
        raise ValueError(message)
