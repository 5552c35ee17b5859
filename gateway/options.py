"""HTTP body fields -> slotserve request parameters: the one place they are mapped.

:func:`request_options` is the whole mapping. Its result is keyword
arguments of :class:`protocol.request.RequestParams` (the one definition of
a request: the client SDK builds and validates it at submission, with the
same rules and messages as a Python caller gets), so this module only
translates names and defaults; it declares no option of its own:

=============================== ==============================================================
HTTP field                      ``RequestParams`` field
=============================== ==============================================================
``temperature``                 ``temperature`` (default 1, OpenAI's; 0 = greedy)
``top_p``                       ``top_p`` (default 1)
``top_k``                       ``top_k`` (0 or -1 = off, vLLM's convention)
``seed``                        ``seed``; choice ``i`` of ``n`` gets ``seed + i`` (:func:`for_choice`)
``stop`` strings                ``stop`` (text stop strings, matched on the generated text)
``stop`` token-id lists         ``stop_sequences`` (e.g. ``"stop": [[13, 13]]``)
``include_stop_str_in_output``  ``include_stop_str_in_output`` (vLLM's; default false)
``stop_token_ids``              ``stop_token`` = the model's EOS tokens + these
``ignore_eos``                  ``stop_token`` = ``stop_token_ids`` only
``min_tokens``                  ``min_tokens`` (default 0)
``priority``                    ``priority`` (lower first)
``timeout_s``                   ``timeout_s``
``logit_bias``                  ``logit_bias`` (string keys, as OpenAI sends them, -> token ids)
``presence_penalty``,           the fields of the same names (vLLM's extras ``repetition_penalty``
``frequency_penalty``,          and ``min_p`` included); absent: off
``repetition_penalty``,
``min_p``
=============================== ==============================================================
"""

from __future__ import annotations

from typing import Any

from client import DEFAULT
from gateway.errors import bad_request
from gateway.schemas import MAX_STOP, _Sampling
from protocol.messages import ModelInfo
from protocol.request import split_stop

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default ``temperature`` (the Python SDK's is 0, greedy)."""


def request_options(body: _Sampling, info: ModelInfo | None) -> dict[str, Any]:
    """``body``'s sampling and stopping fields as ``RequestParams`` keyword
    arguments, the same for every choice (see :func:`for_choice`).

    ``info``: the model's :class:`ModelInfo` (its EOS tokens, for
    ``stop_token_ids``), or None when unknown. Raises :class:`APIError` 400
    for a ``stop`` list too long or holding an empty entry; the values
    themselves are checked when the request is built (ValueError naming the field).
    """
    texts, sequences = _split_stop(body.stop)
    stop_token = DEFAULT  # the model's EOS tokens (the worker's default)
    if body.stop_token_ids or body.ignore_eos:
        base = () if body.ignore_eos or info is None else info.eos_token_ids
        stop_token = sorted({*base, *(body.stop_token_ids or ())})
    return {
        "stop_token": stop_token,
        "stop_sequences": sequences,
        "stop": texts,
        "include_stop_str_in_output": bool(body.include_stop_str_in_output),
        "priority": 0 if body.priority is None else body.priority,
        "timeout_s": body.timeout_s,
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k in (None, -1) else body.top_k,
        "seed": body.seed,
        "min_tokens": body.min_tokens or 0,
        **{name: value for name in _AS_IS if (value := getattr(body, name)) is not None},
        **({"logit_bias": {int(k): v for k, v in body.logit_bias.items()}} if body.logit_bias else {}),
    }


_AS_IS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
"""Body fields passed to the request under their own names when given (absent: the request's default)."""


def for_choice(options: dict[str, Any], index: int) -> dict[str, Any]:
    """``options`` for choice ``index`` of ``n``: ``seed + index`` (so choices differ and each is reproducible)."""
    seed = options["seed"]
    return options if seed is None or index == 0 else {**options, "seed": seed + index}


def _split_stop(stop) -> tuple[list[str], list[tuple[int, ...]]]:
    """``stop`` (validated by its schema) -> (text stop strings, token-id stop
    sequences), by :func:`protocol.request.split_stop`. 400 when it has more
    than :data:`MAX_STOP` entries or an empty one."""
    texts, sequences = split_stop(stop)
    entries = len(texts) + len(sequences)
    if entries > MAX_STOP:
        raise bad_request(f"stop holds {entries} entries; at most {MAX_STOP} are allowed", "stop")
    if not (all(texts) and all(sequences)):
        raise bad_request("stop entries must not be empty", "stop")
    return texts, [tuple(s) for s in sequences]
