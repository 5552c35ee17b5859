"""What is wrong with a request body that is no JSON, in slotserve's words (:func:`body_problem`).

pydantic reads every body with its JSON parser (jiter), whose reasons are its own: ``EOF while
parsing a value``, ``expected ident``, ``recursion limit exceeded``, ``invalid unicode code point``
for bytes that are no UTF-8, a column counted in bytes. A library's words never reach a client:
each reason the parser gives is said here in words of our own, with the line and the column in
characters; a reason this table does not know is the place alone ("at line 1 column 7").
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["MAX_DEPTH", "BodyProblem", "body_problem", "not_an_object", "outer_kind", "value_kind"]

MAX_DEPTH = 200
"""How deep a body may nest arrays and objects inside its outermost object: the JSON parser's limit
(pydantic's jiter stops past 200 levels; tests/gateway/test_body_json.py pins it)."""

class BodyProblem(NamedTuple):
    """What :func:`body_problem` found: ``message``, a sentence starting ``the body``, and ``code``,
    the HTTP error code it is answered with (``invalid_json``; ``invalid_type`` for valid JSON that
    is no object)."""

    message: str
    code: str = "invalid_json"


_PLACE = re.compile(r"(?P<what>.*) at line (?P<line>\d+) column (?P<column>\d+)", re.S)

_WORDS = {  # the parser's reason -> ours
    "EOF while parsing a list": "it ends inside an array",
    "EOF while parsing an object": "it ends inside an object",
    "EOF while parsing a string": "it ends inside a string",
    "EOF while parsing a value": "it ends where a value should be",
    "expected `:`": "expected ':' after an object's key",
    "expected `,` or `]`": "expected ',' or ']' in an array",
    "expected `,` or `}`": "expected ',' or '}' in an object",
    "expected ident": "expected a value (true, false and null are lower case)",
    "expected value": "expected a value",
    "invalid escape": "a string holds an invalid escape (JSON's are \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)",
    "invalid number": "an invalid number",
    "number out of range": "a number too large to read",
    "control character (\\u0000-\\u001F) found while parsing a string":
        "a string holds a control character (U+0000 to U+001F); write it as an escape (\\n, \\t, \\u0001)",
    "key must be a string": "an object's key must be a string",
    "trailing comma": "a comma before the closing bracket",
    "trailing characters": "more text after the JSON value",
    "invalid unicode code point": "an invalid character",
    "lone leading surrogate in hex escape": "an invalid \\u escape",
    "unexpected end of hex escape": "an invalid \\u escape",
}


def body_problem(raw: bytes | str, detail: str) -> BodyProblem:
    """What is wrong with ``raw``, a body that did not parse, given the parser's ``detail`` (its
    message, ``"Invalid JSON: expected value at line 1 column 7"``): a sentence starting ``the
    body`` (``"the body is not valid JSON at line 1 column 7: expected a value"``) and its code
    (:class:`BodyProblem`). Bytes that are no UTF-8, a blank body and one nested past
    :data:`MAX_DEPTH` are told apart from syntax errors; a place is given as line and column in
    characters. An array nested past it is told
    that the body must be an object (:func:`not_an_object`, code ``invalid_type``), as a shallower
    one is."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, column = _place(data, e.start)
        return BodyProblem(f"the body is not valid UTF-8: byte 0x{data[e.start]:02x} at line {line} column {column} "
                           f"(byte {e.start + 1}); send the JSON encoded in UTF-8")
    if not text.strip():
        return BodyProblem("the body is empty: send a JSON object")
    m = _PLACE.fullmatch(detail.removeprefix("Invalid JSON: "))
    if m is None:
        return BodyProblem("the body is not valid JSON")
    line, column = _column_in_characters(data, int(m["line"]), int(m["column"]))
    where = f"at line {line} column {column}"
    if m["what"] == "recursion limit exceeded":  # (valid JSON, nested past what the parser reads)
        # (an array: no body's object to count levels in; what to fix is that it is none, as for any body
        # that is no object)
        if outer_kind(text) is not None:
            return BodyProblem(not_an_object(outer_kind(text)), "invalid_type")
        return BodyProblem(f"the body nests arrays and objects more than {MAX_DEPTH} levels deep ({where}); "
                           f"slotserve reads at most {MAX_DEPTH} levels inside the body's object")
    what = _WORDS.get(m["what"])
    return BodyProblem(f"the body is not valid JSON {where}" + (f": {what}" if what else ""))


def outer_kind(text: str) -> str | None:
    """``"an array"`` when the outermost value of ``text`` (a body or a JSONL row too deep to parse) is
    one, read from its first character after a UTF-8 byte order mark and blanks; else None (an
    object, or no value). Only an array, of the values that are no object, can nest."""
    return "an array" if text.removeprefix("\ufeff").lstrip(" \t\r\n")[:1] == "[" else None


def not_an_object(kind: str) -> str:
    """The refusal of a body whose JSON is ``kind`` (:func:`value_kind`'s words), not an object."""
    return f"the body must be a JSON object ({{\"model\": ...}}), got {kind}"


def value_kind(value: object) -> str:
    """The JSON kind of a parsed ``value`` in words (``"an array"``, ``"a string"``, ``"null"``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _place(data: bytes, offset: int) -> tuple[int, int]:
    """The line and column (1-based, in characters) of byte ``offset`` of ``data``."""
    before = data[:offset]
    start = before.rfind(b"\n") + 1
    return before.count(b"\n") + 1, len(before[start:].decode("utf-8", "replace")) + 1


def _column_in_characters(data: bytes, line: int, column: int) -> tuple[int, int]:
    """The parser's ``(line, column)``, its column counted in bytes from 1, as a column in characters."""
    lines = data.split(b"\n")
    if not 1 <= line <= len(lines) or column < 1:
        return line, max(column, 1)
    return line, len(lines[line - 1][:column - 1].decode("utf-8", "replace")) + 1
