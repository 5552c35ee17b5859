"""The fields of llama.cpp's ``/completion`` and ``/infill`` bodies beyond the common sampling ones
(:mod:`gateway.llama_native`): what each does here, so that a client written for ``llama-server``
(its web UI, llama.vscode, scripts) works unchanged and a value that would sample otherwise than it
asks is a 400 saying so, never served as if it had been applied.

From llama.cpp's server README (``tools/server/README.md``, ``POST /completion``'s options, which
``/infill`` takes too) and its source (``params_from_json_cmpl``, ``common/sampling.cpp``):

========================================  ============================================================
field                                     here
========================================  ============================================================
``n_probs`` (0..20)                       ``logprobs`` = N: the answer's ``completion_probabilities``
                                          (:func:`llama_probs`); 0: none
``post_sampling_probs``                   false only (slotserve's probabilities are the model's, before
                                          sampling: :mod:`protocol.logprobs`)
``logit_bias``                            ``logit_bias``: ``[[id, bias]]``, ``[["text", bias]]`` (each
                                          token of the text, tokenised without special tokens),
                                          ``{"id" or "text": bias}`` (a key is an id when it is
                                          ASCII digits, as llama.cpp's ``strtol`` reads it: ``"５"``
                                          is a text); a bias ``false`` bans the token
                                          (-100, OpenAI's floor); entries for one token add up
``json_schema``, ``grammar`` (GBNF)       ``structured`` (:mod:`gateway.structured`); ``grammar: ""``:
                                          none
``samplers`` (names, or llama.cpp's       the samplers left out are off: ``top_k`` (0), ``top_p`` (1),
letters ``"kypmxt"``)                     ``min_p`` (0), ``temperature`` (1, the draw's own), and
                                          ``penalties`` (none); their order is slotserve's
``repeat_last_n``                         0: the penalties off; -1 or N: slotserve's penalties look at
                                          the whole prompt and output (llama.cpp's N the last N tokens)
``mirostat``                              0 only; ``mirostat_tau``, ``mirostat_eta``: any (unused)
``dynatemp_range``                        0 only (``dynatemp_exponent``: any)
``typical_p``                             >= 1 only (off)
``tfs_z``                                 1 only (llama.cpp removed tail-free sampling)
``top_n_sigma``                           <= 0 only (off)
``xtc_probability``, ``xtc_threshold``    off only: probability 0 or threshold > 0.5
``dry_multiplier``                        0 only; ``dry_base``, ``dry_allowed_length``,
                                          ``dry_penalty_last_n``, ``dry_sequence_breakers``: any
``adaptive_target``                       < 0 only (off); ``adaptive_decay``: any
``min_keep``                              0 or 1 (every sampler keeps one token)
``n_cmpl``                                1 only (send the prompt several times instead)
``image_data``, ``lora``                  ``[]`` only (no multimodal model, no adapters are served)
``return_progress``                       false only
``timings_per_token``                     true: each stream event carries ``timings`` so far
``penalize_nl``, ``n_keep``,              any: no effect here (llama.cpp dropped ``penalize_nl``;
``n_discard``, ``id_slot``, ``slot_id``,  slotserve never shifts a context, so nothing is discarded;
``cache_prompt``, ``n_cache_reuse``,      the broker places requests and the prefix cache is always
``api_key``, ``sse_ping_interval``        on; the API key is the ``Authorization`` header's)
``n_indent`` (>= 0),                      applied as llama.cpp applies them (:mod:`gateway.line_limits`):
``t_max_predict_ms`` (>= 0; -1: off)      a line indented less, or the first newline past the time
                                          limit, ends the generation (``stop_type`` ``limit``)
``t_max_prompt_ms``                       any: no effect (llama.cpp does not apply it either)
========================================  ============================================================

:func:`refusal` gives the 400 of the first effectful value; :func:`sampler_overrides` and
:func:`logit_bias` the request options the fields map to.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from gateway.errors import APIError, bad_request
from gateway.logprobs import clamp, utf8_bytes
from protocol.logprobs import MAX_LOGPROBS, TokenLogprob
from protocol.request import LOGIT_BIAS_BOUND
from protocol.validation import clip, described, echo

__all__ = ["LlamaFields", "gives_text", "llama_probs", "logit_bias", "refusal", "sampler_overrides", "samplers_on"]

BAN = -LOGIT_BIAS_BOUND
"""The bias a ``false`` gives (llama.cpp's -inf): OpenAI's floor, which no token overcomes."""

SAMPLERS = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties",
            "adaptive_p")
"""llama.cpp's sampler names (``common_sampler_type_to_str``)."""

_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "nucleus": "top_p", "temp": "temperature"}
_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
            "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
"""llama.cpp's one-letter names (``common_sampler_type_to_chr``), of ``samplers`` given as a string."""


class LlamaFields(BaseModel):
    """The fields of the module docstring's table, as the body declares them (types only: the values
    are judged by :func:`refusal`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n_probs: int | None = None
    post_sampling_probs: bool | None = None
    logit_bias: Any = None
    json_schema: Any = None
    grammar: Annotated[str | None, AfterValidator(lambda v: v or None)] = None  # ("": none, as llama.cpp's)
    samplers: list[str] | str | None = None
    repeat_last_n: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    adaptive_target: float | None = None
    adaptive_decay: float | None = None
    min_keep: int | None = None
    n_cmpl: int | None = None
    image_data: list | None = None
    lora: list | None = None
    return_progress: bool | None = None
    penalize_nl: bool | None = None
    n_keep: int | None = None
    n_discard: int | None = None
    id_slot: int | None = None
    slot_id: int | None = None
    cache_prompt: bool | None = None
    n_cache_reuse: int | None = None
    api_key: str | None = None
    sse_ping_interval: float | None = None
    timings_per_token: bool | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    n_indent: int | None = None


_USE = "use temperature, top_k, top_p and min_p"
_PENALTIES = "use repeat_penalty, presence_penalty and frequency_penalty"


def _off(field: str, value: Any, off: Callable[[Any], bool], says: str) -> APIError | None:
    """The 400 of ``field``'s ``value`` unless it is absent or ``off(value)``; the value shown as its
    JSON, as the client wrote it (``return_progress true``, ``image_data [{"data": ...}]``)."""
    return None if value is None or off(value) else bad_request(f"{field} {clip(json.dumps(value))}: {says}", field)


def refusal(body: LlamaFields) -> APIError | None:
    """The 400 of ``body``'s first field whose value would change the output in a way slotserve cannot
    (the module docstring's table), naming it and saying what is supported; None when there is none."""
    checks = (
        ("mirostat", lambda v: v == 0, f"mirostat sampling is not supported; {_USE} (mirostat 0 is off)"),
        ("dynatemp_range", lambda v: v == 0,
         f"dynamic temperature is not supported; {_USE} (dynatemp_range 0 is off)"),
        ("typical_p", lambda v: v >= 1, f"locally typical sampling is not supported; {_USE} (typical_p 1 is off)"),
        ("tfs_z", lambda v: v == 1, f"tail-free sampling is not supported (llama.cpp removed it); {_USE} "
                                    "(tfs_z 1 is off)"),
        ("top_n_sigma", lambda v: v <= 0, f"top-n-sigma sampling is not supported; {_USE} (top_n_sigma -1 is off)"),
        ("dry_multiplier", lambda v: v == 0, f"DRY sampling is not supported; {_PENALTIES} (dry_multiplier 0 is off)"),
        ("adaptive_target", lambda v: v < 0, f"adaptive-p sampling is not supported; {_USE} "
                                             "(a negative adaptive_target is off)"),
        ("min_keep", lambda v: v in (0, 1), "min_keep > 1 is not supported: the samplers keep at least one token; "
                                            "send 0"),
        ("n_cmpl", lambda v: v == 1, "n_cmpl other than 1 is not supported; send the prompt several times (a list "
                                     "of prompts) for several completions"),
        ("image_data", lambda v: v == [], "images are not supported: no multimodal model is served; send []"),
        ("lora", lambda v: v == [], "LoRA adapters are not supported; send []"),
        ("return_progress", lambda v: not v, "prompt progress events are not supported; send false"),
        ("post_sampling_probs", lambda v: not v, "post-sampling probabilities are not supported: n_probs gives "
                                                 "the model's probabilities before sampling; send false"),
        ("n_probs", lambda v: 0 <= v <= MAX_LOGPROBS, f"n_probs must be in 0..{MAX_LOGPROBS}"),
        ("repeat_last_n", lambda v: v >= -1, "repeat_last_n must be >= -1 (-1: the whole context, 0: no penalties)"),
        ("n_indent", lambda v: v >= 0, "n_indent must be >= 0 (the least indentation of a generated line; 0: off)"),
        ("t_max_predict_ms", lambda v: v >= -1, "t_max_predict_ms must be >= 0 (milliseconds; 0 or -1: off)"),
    )
    for field, off, says in checks:
        e = _off(field, getattr(body, field), off, says)
        if e is not None:
            return e
    if body.xtc_probability is not None and body.xtc_probability != 0 and \
            (body.xtc_threshold is None or body.xtc_threshold <= 0.5):
        return bad_request(f"xtc_probability {clip(json.dumps(body.xtc_probability))}: XTC sampling is not supported; "
                           f"{_USE} (xtc_probability 0 is off)", "xtc_probability")
    return None


def samplers_on(value: list[str] | str | None) -> frozenset[str] | None:
    """``samplers``' canonical names (None: absent, every sampler on); ValueError naming an unknown one."""
    if value is None:
        return None
    if isinstance(value, str):
        unknown = [c for c in value if c not in _LETTERS]
        if unknown:
            raise ValueError(f"samplers {echo(value)}: unknown sampler letter {echo(unknown[0])}; letters: "
                             f"{''.join(_LETTERS)} ({', '.join(f'{k} {v}' for k, v in _LETTERS.items())})")
        return frozenset(_LETTERS[c] for c in value)
    names = set()
    for i, name in enumerate(value):
        key = name.lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key not in SAMPLERS:
            raise ValueError(f"samplers[{i}] {echo(name)} is no sampler of llama.cpp's: {', '.join(SAMPLERS)}")
        names.add(key)
    return frozenset(names)


def sampler_overrides(body: LlamaFields) -> dict[str, Any]:
    """``RequestParams`` values that ``samplers`` and ``repeat_last_n`` force (module docstring): a
    sampler left out of ``samplers`` is off, and ``repeat_last_n`` 0 turns the penalties off. Raises
    :class:`APIError` 400 naming ``samplers`` for an unknown name."""
    try:
        on = samplers_on(body.samplers)
    except ValueError as e:
        raise bad_request(str(e), "samplers") from None
    out: dict[str, Any] = {}
    if on is not None:
        out.update({name: off for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("temperature", 1.0))
                    if name not in on})
    if (on is not None and "penalties" not in on) or body.repeat_last_n == 0:
        out.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return out


def logit_bias(value: Any, encode: Callable[[str], list[int]] | None) -> dict[int, float]:
    """llama.cpp's ``logit_bias`` (module docstring) as ``{token id: bias}``; ``encode`` tokenises a
    text key (None: no tokenizer, a text key is a 400 saying so). Raises :class:`APIError` 400 naming
    the entry for a shape llama.cpp does not take."""
    if isinstance(value, dict):
        pairs = [(f"logit_bias.{k}", _key(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        pairs = []
        for i, entry in enumerate(value):
            if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) not in (int, str):
                raise bad_request(f"logit_bias[{i}] must be [token id or text, bias], got {described(entry)}",
                                  f"logit_bias[{i}]")
            pairs.append((f"logit_bias[{i}]", entry[0], entry[1]))
    else:
        raise bad_request("logit_bias must be a list of [token id or text, bias] or an object {token id or text: "
                          f"bias}}, got {described(value)}", "logit_bias")
    out: dict[int, float] = {}
    for where, key, bias in pairs:
        if bias is False:
            bias = BAN
        elif type(bias) not in (int, float) or not math.isfinite(bias):
            raise bad_request(f"{where} must be a number, or false to ban the token, got {described(bias)}", where)
        if isinstance(key, str):
            if encode is None:
                raise bad_request(f"{where} gives a text, which the gateway tokenises with the model's tokenizer, "
                                  "and there is none; give token ids", where)
            ids = encode(key) if key else []
        else:
            ids = [key]
        for t in ids:  # (a banned token stays banned whatever else is added)
            prev = out.get(t, 0.0)
            out[t] = BAN if BAN in (bias, prev) else prev + bias
    return out


_TOKEN_ID = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")
"""An object key that names a token id: what C's ``strtol(key, &end, 10)`` reads whole, as llama.cpp
reads the keys (ASCII blanks before, a sign, ASCII digits), where Python's ``int`` reads ``"５"``,
``"²"`` (no: a ValueError) and ``"1_000"`` too."""


def _key(key: str) -> int | str:
    """An object key: a token id when it is an integer's text (:data:`_TOKEN_ID`), else a text
    (llama.cpp's)."""
    return int(key) if _TOKEN_ID.fullmatch(key) else key


def gives_text(bias: Any) -> bool:
    """Whether llama.cpp's ``logit_bias`` ``bias`` names a token by its text (the tokenizer is needed
    to read it): a key or an entry's first item that :func:`logit_bias` reads as a text."""
    if isinstance(bias, dict):
        return any(isinstance(_key(k), str) for k in bias)
    return isinstance(bias, list) and any(isinstance(e, list) and e and isinstance(e[0], str) for e in bias)


def llama_probs(tokens: Sequence[int], entries: Sequence[TokenLogprob], token_str: Callable[[int], str],
                token_bytes: Callable[[int], list[int]] | None = None) -> list[dict]:
    """llama.cpp's ``completion_probabilities`` for ``tokens`` (``entries[i]`` scores ``tokens[i]``):
    per token ``{"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes",
    "logprob"}]}``, the ``n_probs`` most likely first (``probs_to_json`` in its source); natural logs,
    ``-inf`` as :data:`gateway.logprobs.FLOOR`."""
    tb = token_bytes or utf8_bytes(token_str)
    return [{"id": t, "token": token_str(t), "bytes": tb(t), "logprob": clamp(e.logprob),
             "top_logprobs": [{"id": i, "token": token_str(i), "bytes": tb(i), "logprob": clamp(lp)}
                              for i, lp in e.top]}
            for t, e in zip(tokens, entries)]
