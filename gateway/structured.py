"""HTTP structured-output fields -> the request's ``structured`` constraint (:mod:`protocol.structured`).

One request may constrain its output by exactly one of these body fields
(on ``/v1/completions`` and ``/v1/chat/completions`` alike):

==================================  =============================================================
HTTP field                          constraint
==================================  =============================================================
``response_format``                 ``{"type": "text"}``: none; ``{"type": "json_object"}``: any
                                    JSON object; ``{"type": "json_schema", "json_schema":
                                    {"name", "schema", "strict", "description"}}``: JSON valid
                                    against ``schema`` (OpenAI's; no ``schema``: any JSON object)
``structured_outputs``              vLLM's: ``{"json": schema}``, ``{"regex": str}``, ``{"choice":
                                    [str, ...]}``, ``{"grammar": str}`` (Lark, or GBNF, told apart
                                    by llguidance), ``{"json_object": true}``; one of them
``guided_json``, ``guided_regex``,  vLLM's older names of the same
``guided_choice``, ``guided_grammar``
``json_schema``                     llama.cpp server's: a JSON schema
``grammar``                         llama.cpp server's: a GBNF grammar
==================================  =============================================================

The shapes are checked here (400 naming the field); the constraint's own
rules (a schema that is no JSON object, an empty choice) are the request's
(:func:`protocol.structured.check_structured`), re-raised naming the HTTP
field; a spec that does not compile is the worker's 400, named by
:func:`field_of` (see :meth:`gateway.generate.Generator._raise_failure`).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request, unknown_key
from protocol.structured import Constraint, check_structured
from protocol.validation import echo

__all__ = ["FIELDS", "field_of", "structured_option"]

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "json_schema", "grammar")
"""The body fields that may carry a constraint, in the order they are looked at."""

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}
_VLLM_IGNORED = frozenset({"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                           "disable_fallback"})
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def field_of(body) -> str | None:
    """The body field that set the request's constraint (for a worker's error about it), else None."""
    given = [name for name in FIELDS if _given(body, name)]
    return given[0] if given else None


def _given(body, name: str) -> bool:
    value = getattr(body, name, None)
    return value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text" and len(value) == 1)


def structured_option(body) -> dict[str, Constraint]:
    """``{"structured": constraint}`` from ``body``'s fields, or ``{}`` when it sets none. 400 naming
    the field for a shape it does not take, or when two fields set one."""
    given = [name for name in FIELDS if _given(body, name)]
    if not given:
        return {}
    if len(given) > 1:
        raise bad_request(f"give one of {given} to constrain the output, not several", given[1])
    name = given[0]
    value = getattr(body, name)
    if name == "response_format":
        constraint = _response_format(value)
    elif name == "structured_outputs":
        constraint = _structured_outputs(value)
    elif name in _GUIDED:
        constraint = _checked({_GUIDED[name]: value}, name)
    elif name == "json_schema":
        constraint = _checked({"json_schema": value}, name)
    else:  # llama.cpp's grammar: GBNF
        constraint = _checked({"gbnf": value}, name)
    return {} if constraint is None else {"structured": constraint}


def _checked(value: dict, field: str) -> Constraint | None:
    """``check_structured(value)`` (``value``: ``{kind: spec}``), its refusal a 400 naming the body's
    ``field`` alone: the request's check words it "structured <kind> ...", "<field> <kind>" here,
    where the field says the kind already."""
    try:
        return check_structured(value, field)
    except ValueError as e:
        (kind,) = value
        message = str(e)
        if message.startswith(f"{field} {kind}"):
            message = field + message[len(f"{field} {kind}"):]
        raise bad_request(message, field) from None


def _response_format(value: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a 'type': 'text', 'json_object' or "
                          "'json_schema'", field)
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise unknown_key(field, extra[0], "type and json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked({"json_object": True}, field)
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {echo(kind)}",
                          f"{field}.type")
    spec = value.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object {name, schema, strict, description}",
                          where)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise unknown_key(where, unknown[0], "name, schema, strict and description")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string (OpenAI requires it)",
                          f"{where}.name")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return _checked({"json_object": True}, field)
    return _checked({"json_schema": schema}, f"{where}.schema")


def _structured_outputs(value: Any) -> Constraint | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object with one of json, regex, choice, grammar, "
                          "json_object", field)
    unknown = sorted(set(value) - set(_VLLM_KINDS) - _VLLM_IGNORED)
    if unknown:
        raise unknown_key(field, unknown[0], f"one of {', '.join(sorted(_VLLM_KINDS))}")
    kinds = [k for k in _VLLM_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {sorted(_VLLM_KINDS)}, got {kinds}", field)
    (key,) = kinds
    return _checked({_VLLM_KINDS[key]: value[key]}, f"{field}.{key}")
