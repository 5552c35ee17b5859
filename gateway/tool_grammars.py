"""The grammars that enforce ``tool_choice: "required"`` and a named function, one per tool-call
syntax (:mod:`gateway.tool_parsers`): llguidance Lark, the arguments checked against each
function's ``parameters`` schema with ``%json``, compiled on the worker as any ``structured``
constraint. Each asks for exactly one call, written as the family's models write it and as that
family's parser reads it:

- ``hermes``: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``;
- ``llama3_json``: ``{"name": N, "parameters": {...}}``, ``<|python_tag|>`` before it allowed;
- ``mistral``: ``[TOOL_CALLS]`` then ``[{"name": N, "arguments": {...}}]`` or ``N[ARGS]{...}``
  (either form: the grammar cannot know the model's template version, and each model takes its own);
- ``openai``: gpt-oss's analysis messages first (any number: the thinking, one lexeme each,
  :data:`protocol.structured.HARMONY_ANALYSIS`), then ``<|channel|>commentary to=functions.N
  <|constrain|>json<|message|>{...}``, which the model ends with its ``<|call|>`` stop token; the
  grammar holds its own thinking, so the gateway gives it no ``think``;
- ``pythonic``: ``[N(k=V, ...)]`` (``<|python_tag|>`` before it allowed), the schema's parameters
  as keyword arguments in its order (``required`` ones always), each value the JSON its schema
  allows, which the pythonic parser reads as the Python literal it nearly is;
- ``qwen3_coder``: ``<tool_call>\\n<function=N>\\n`` then each parameter as
  ``<parameter=P>\\nVALUE\\n</parameter>\\n`` in the schema's order (``required`` ones always,
  the others optional), then ``</function>\\n</tool_call>``; a value the parser reads as text
  (:func:`gateway.tool_xml.param_is_text`) is any text up to ``\\n</parameter>`` that holds no tag
  the parser ends a value at (``</parameter>``, ``<parameter=``, ``</function>``, ``</tool_call>``), one
  lexeme with that end tag (llguidance's lexer is greedy and does not backtrack: a text lexeme
  before a literal end tag would eat the newline the tag needs, and a ``stop`` rule loses the
  bytes after the tag in the token that ends it, Qwen's ``>\\n``), or one of its ``enum``; any
  other value the JSON its schema allows.

The markers are quoted literals: the worker gives llguidance a tokenizer's marker tokens as the
text they stand for, special or not (:func:`worker.models.grammar.text_added_tokens`), so a
marker matches as one token where the vocabulary has it and as text where it does not.
"""

from __future__ import annotations

import json

from gateway.tool_xml import param_is_text
from protocol.structured import HARMONY_ANALYSIS

__all__ = ["call_grammar"]

_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def call_grammar(functions: dict[str, dict], names: list[str], parser: str) -> str:
    """The Lark text of one call of one of ``names`` (keys of ``functions``, definitions with a
    ``parameters`` schema) in ``parser``'s syntax. ValueError for an unknown ``parser``."""
    if parser == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {_json_calls(functions, names, "arguments")}\n'
    if parser == "llama3_json":
        return f'start: "<|python_tag|>"? call\ncall: {_json_calls(functions, names, "parameters")}\n'
    if parser == "mistral":
        named = " | ".join(f"fn{i}" for i in range(len(names)))
        rules = "".join(f'fn{i}: {_lit(n + "[ARGS]")} args{i}\nargs{i}: %json {_schema(_arguments(functions[n]))}\n'
                        for i, n in enumerate(names))
        return (f'start: "[TOOL_CALLS]" (array | {named})\narray: "[" call "]"\n'
                f'call: {_json_calls(functions, names, "arguments")}\n{rules}')
    if parser == "qwen3_coder":
        named = " | ".join(f"fn{i}" for i in range(len(names)))
        rules = "".join(_xml_function(i, functions[n]) for i, n in enumerate(names))
        return (f'start: "<tool_call>\\n<function=" ({named}) "</function>\\n</tool_call>"\n{rules}'
                'TEXT: /(.|\\n)*\\n<\\/parameter>/ & '
                '~/(.|\\n)*(<\\/parameter>|<parameter=|<\\/function>|<\\/tool_call>)(.|\\n)+/\n')
    if parser == "openai":
        named = " | ".join(f"fn{i}" for i in range(len(names)))
        rules = "".join(f'fn{i}: {_lit(n + " <|constrain|>json<|message|>")} %json {_schema(_arguments(functions[n]))}\n'
                        for i, n in enumerate(names))
        return f'start: ANALYSIS* "<|channel|>commentary to=functions." ({named})\n{rules}{HARMONY_ANALYSIS}'
    if parser == "pythonic":
        named = " | ".join(f"fn{i}" for i in range(len(names)))
        rules = "".join(_pythonic_function(i, functions[n]) for i, n in enumerate(names))
        return f'start: "<|python_tag|>"? "[" ({named}) "]"\n{rules}'
    raise ValueError(f"no tool-call grammar for parser {parser!r}")


def _arguments(function: dict) -> dict:
    """A function's arguments' schema: an object even where the schema leaves out its type ({}
    would allow any JSON)."""
    return {"type": "object", **function["parameters"]}


def _schema(schema: dict) -> str:
    return json.dumps({"x-guidance": _JSON_STYLE, **schema})


def _lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_calls(functions: dict[str, dict], names: list[str], key: str) -> str:
    """``%json`` of a call object ``{"name": N, key: {...}}`` of one of ``names``."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": n}, key: _arguments(functions[n])}} for n in names]
    return "%json " + _schema(calls[0] if len(calls) == 1 else {"anyOf": calls})


def _xml_function(i: int, function: dict) -> str:
    """Rule ``fn{i}``: ``N>\\n`` and the parameters of ``function`` in Qwen3-Coder's syntax."""
    params = function["parameters"].get("properties") or {}
    required = set(function["parameters"].get("required") or ())
    parts, rules = [], []
    for j, (name, prop) in enumerate(params.items()):
        rule = f"p{i}_{j}"
        if param_is_text(function, name):
            enum = prop.get("enum") if isinstance(prop, dict) else None
            value = ("(" + " | ".join(_lit(str(v)) for v in enum) + ")") if enum else "TEXT"
        else:
            value = f"v{i}_{j}"
            rules.append(f"{value}: %json {_schema(prop)}\n")
        end = '"\\n"' if value == "TEXT" else '"\\n</parameter>\\n"'  # (TEXT ends with the end tag)
        rules.append(f'{rule}: {_lit(f"<parameter={name}>" + chr(10))} {value} {end}\n')
        parts.append(rule if name in required else rule + "?")
    return f'fn{i}: {_lit(function["name"] + ">" + chr(10))} {" ".join(parts)}\n' + "".join(rules)


def _pythonic_function(i: int, function: dict) -> str:
    """Rule ``fn{i}``: ``N(k=V, ...)`` of ``function`` in the pythonic syntax: its schema's
    parameters in order as keyword arguments (``required`` ones always, the others optional, ", "
    between those written), each value the JSON its schema allows (JSON's literals are Python's
    but ``true``/``false``/``null``, which the parser takes: :func:`gateway.call_stream.literal_json`)."""
    params = list((function["parameters"].get("properties") or {}).items())
    required = set(function["parameters"].get("required") or ())
    rules = [f'p{i}_{j}: {_lit(name + "=")} %json {_schema(prop if isinstance(prop, dict) else {})}\n'
             for j, (name, prop) in enumerate(params)]
    optional = [name not in required for name, _ in params]

    def later(j: int) -> str:
        """Parameters j.. after one already written: each with ", " before it."""
        parts = [f'(", " p{i}_{k})' + ("?" if optional[k] else "") for k in range(j, len(params))]
        return " ".join(parts)

    def first(j: int) -> tuple[str, bool]:
        """Parameters j.. with none written yet: ``(expression, whether it may be empty)``."""
        if j == len(params):
            return "", True
        this = f"p{i}_{j} {later(j + 1)}".strip()
        if not optional[j]:
            return this, False
        rest, empty = first(j + 1)
        return (f"({this}) | ({rest})" if rest else this), empty

    args, empty = first(0)
    body = f"({args})" + ("?" if empty else "") if args else ""
    return f'fn{i}: {_lit(function["name"] + "(")} {body} ")"\n' + "".join(rules)
