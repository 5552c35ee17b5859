"""Structured outputs: the constraint a request's generated text must match.

A request's ``structured`` field (:class:`~protocol.request.RequestParams`)
is None (free text) or a :class:`Constraint` ``(kind, spec)``, checked here as
far as the edge can without the model: the kind is known, the spec is
non-empty text within :data:`MAX_SPEC_CHARS`, a JSON schema is a JSON
object, a choice is a non-empty list of non-empty strings. Compiling it (a
JSON schema or regex the grammar engine refuses, a Lark or GBNF grammar with
a syntax error) happens on the worker, which holds the tokenizer
(:mod:`worker.models.grammar`, llguidance); a spec that does not compile ends
that request before its first token as ``bad_request``.

Kinds (the names of vLLM's ``structured_outputs`` where it has one):

- ``json_schema``: the output is JSON valid against ``spec``, a JSON
  schema (an object; given as a map or as its JSON text). Normalised to
  compact JSON text, key order kept (it is the order properties are
  generated in).
- ``json_object``: any JSON object (OpenAI's ``{"type": "json_object"}``);
  ``spec`` is ``""``.
- ``regex``: the output matches the regular expression (Rust ``regex``
  syntax, as llguidance reads it; anchored at both ends).
- ``choice``: the output is exactly one of the strings; ``spec`` is their
  JSON list text.
- ``grammar``: a Lark grammar (llguidance's dialect: docs/syntax.md of
  guidance-ai/llguidance), start symbol ``start``; a GBNF grammar is told
  apart and converted (as vLLM's ``grammar`` takes either).
- ``gbnf``: a llama.cpp GBNF grammar (start symbol ``root``), converted to
  Lark by llguidance.

A constraint's ``think`` (``""`` by default) lets a thinking model think
first: the constraint then applies to the answer after its thinking, in the
format of the reasoning parser named (``"qwen3"``: an optional
``<think>...</think>`` block first; ``"deepseek_r1"``: the template opened the
thinking, so the output is thinking up to ``</think>``, then the answer;
``"openai_gptoss"``: gpt-oss's harmony analysis messages, then the answer in
the ``final`` channel, ``<|channel|>final<|message|>`` first), as
vLLM applies structured outputs after the reasoning ends. The HTTP gateway
sets it from the request's reasoning parser (:mod:`gateway.reasoning`).

On the wire a constraint is the array ``[kind, spec]`` or ``[kind, spec, think]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import NamedTuple

from protocol.json_numbers import loads, nonfinite_message, syntax_problem
from protocol.validation import (
    as_text, check_depth, check_json_text, check_json_unicode, described, echo, is_sequence, kind_of, too_deep,
)

__all__ = ["HARMONY_ANALYSIS", "JSON_OBJECT", "KINDS", "MAX_CHOICES", "MAX_SPEC_CHARS", "Constraint", "check_structured"]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "gbnf")
"""The constraint kinds, see the module docstring."""

_ALIASES = {"json": "json_schema", "lark": "grammar"}  # vLLM's ``json``; llguidance's name for Lark

MAX_SPEC_CHARS = 200_000
"""Longest spec, in characters (a schema's compact JSON text, a grammar): the worker compiles
it while the batch waits, so the bound keeps one request from stalling its neighbours long."""

MAX_CHOICES = 1024
"""Most strings of a ``choice`` constraint."""


THINKS = ("", "qwen3", "deepseek_r1", "openai_gptoss")
"""The values of a constraint's ``think``: none, or a reasoning parser's name (module docstring)."""

HARMONY_ANALYSIS = ("ANALYSIS: /<\\|channel\\|>analysis<\\|message\\|>(.|\\n)*<\\|end\\|><\\|start\\|>assistant/"
                    " & ~/(.|\\n)*<\\|end\\|>(.|\\n)*<\\|end\\|>(.|\\n)*/\n")
"""The Lark (llguidance) lexeme ``ANALYSIS`` of one gpt-oss analysis message, up to its one ``<|end|>``,
and the next message's ``<|start|>assistant``: the thinking of think ``openai_gptoss``, which the
worker composes (``worker.models.grammar.after_thinking``) and the gateway's harmony tool-call
grammar writes itself (``gateway.tool_grammars``). The worker gives llguidance harmony's markers as
text (``worker.models.tool_markers``)."""


class Constraint(NamedTuple):
    """A checked constraint: ``kind`` one of :data:`KINDS`, ``spec`` its text, ``think`` one of
    :data:`THINKS` (see the module docstring)."""

    kind: str
    spec: str
    think: str = ""


JSON_OBJECT = Constraint("json_object", "")
"""Any JSON object."""


def check_structured(value: object, field: str = "structured") -> Constraint | None:
    """``value`` as a :class:`Constraint` (or None: no constraint).

    Takes a :class:`Constraint` or a ``(kind, spec)`` or ``(kind, spec, think)`` array (as off the wire),
    or a map with one key, the kind: ``{"json_schema": {...}}``,
    ``{"regex": "[0-9]+"}``, ``{"choice": ["yes", "no"]}``, ``{"grammar":
    "start: ..."}``, ``{"gbnf": "root ::= ..."}``, ``{"json_object": true}``
    (``json`` and ``lark`` are taken for ``json_schema`` and ``grammar``).
    Raises ValueError naming ``field`` and what to send instead.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        if len(value) != 1:
            raise ValueError(f"{field} must be a map with exactly one key, the kind (one of {list(KINDS)}), "
                             f"got keys {echo(sorted(map(str, value)))}")
        ((kind, spec),) = value.items()
        think = ""
    elif isinstance(value, (list, tuple)) and len(value) in (2, 3):
        kind, spec, think = (*value, "")[:3]
        if think not in THINKS:
            raise ValueError(f"{field} think must be one of {list(THINKS)}, got {echo(think)}")
    else:
        raise ValueError(f"{field} must be a map {{kind: spec}} or a (kind, spec) pair, kind one of "
                         f"{list(KINDS)}; got {described(value)}")
    if not isinstance(kind, str):
        raise ValueError(f"{field} kind must be a str, one of {list(KINDS)}, got {kind_of(kind)}")
    kind = _ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"{field} kind must be one of {list(KINDS)}, got {echo(kind)}")
    where = f"{field} {kind}"
    if kind == "json_object":
        if spec not in ("", True, None) and not (isinstance(spec, Mapping) and not spec):
            raise ValueError(f"{where} takes no spec (give true or \"\"), got {echo(spec)}")
        return JSON_OBJECT._replace(think=think) if think else JSON_OBJECT
    if kind == "json_schema":
        text = _schema_text(spec, where)
    elif kind == "choice":
        text = _choice_text(spec, where)
    else:
        text = as_text(spec, where, allow_empty=False) if isinstance(spec, str) else _not_text(spec, where)
        if not text.strip():
            raise ValueError(f"{where} must not be blank")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{where} has {len(text)} characters; at most {MAX_SPEC_CHARS} are allowed")
    return Constraint(kind, text, think)


def _not_text(spec: object, where: str) -> str:
    raise ValueError(f"{where} must be a str, got {kind_of(spec)}")


def _schema_text(spec: object, where: str) -> str:
    if isinstance(spec, str):
        as_text(spec, where)
        try:  # (a NaN or 1e400 kept as written, for the words below)
            parsed, _ = loads(spec)
        except RecursionError:  # (nested deeper than Python's limit: not its words)
            raise ValueError(too_deep(where)) from None
        except json.JSONDecodeError as e:  # (json's syntax error, with its line and column)
            raise ValueError(f"{where} is not valid JSON {syntax_problem(e)}") from None
        except ValueError:  # (an integer past Python's digit limit for int(): not its words)
            raise ValueError(f"{where} holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                             "which no schema needs") from None
        check_json_text(spec, where)  # (the escape of a lone surrogate: a string UTF-8 cannot encode)
        spec = parsed
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a JSON schema, a JSON object; got {described(spec)}")
    check_depth(spec, where)
    try:
        text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:  # (NaN, infinity: named where they are)
        raise ValueError(nonfinite_message(spec, where) or f"{where} must hold JSON values only: {e}") from None
    return check_json_unicode(text, spec, where)


def _choice_text(spec: object, where: str) -> str:
    if isinstance(spec, str):
        try:
            parsed = json.loads(spec)
        except RecursionError:  # (nested deeper than Python's limit: JSON all the same)
            raise ValueError(too_deep(where)) from None
        except ValueError:
            raise ValueError(f"{where} must be a list of strings, got a string that is no JSON list") from None
        check_json_text(spec, where)
        spec = parsed
    if not is_sequence(spec) or isinstance(spec, (str, bytes)):
        raise ValueError(f"{where} must be a non-empty list of strings, got {kind_of(spec)}")
    items = list(spec)  # type: ignore[call-overload]
    if not items:
        raise ValueError(f"{where} must be a non-empty list of strings, got an empty list")
    if len(items) > MAX_CHOICES:
        raise ValueError(f"{where} holds {len(items)} strings; at most {MAX_CHOICES} are allowed")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise ValueError(f"{where}[{i}] must be a non-empty str, got {echo(s)}")
        as_text(s, f"{where}[{i}]")
    return json.dumps(items, ensure_ascii=False)
