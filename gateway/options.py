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
``logprobs`` (completions: N)   ``logprobs`` = N (0..20: vLLM's bound; OpenAI's is 5)
``logprobs: true`` (chat)       ``logprobs`` = ``top_logprobs`` (0..20; 0 when absent)
``echo`` with ``logprobs``      ``prompt_logprobs`` = N as well (the prompt tokens' entries come first)
``prompt_logprobs``             ``prompt_logprobs`` (vLLM's extra, 0..20; the larger of the two with echo)
``suffix`` (completions)        ``suffix`` (fill in the middle; ``""`` or null: none; not with ``echo``)
``continue_final_message``      ``continue_final_message`` (chat, vLLM's: the final message continued)
``add_generation_prompt``       ``add_generation_prompt`` (chat, vLLM's: false only; both true: 400)
=============================== ==============================================================

:func:`logprob_options` checks the logprob fields' bounds and combinations (400 naming the
field and the bound: the request's own check would name its field, not chat's ``top_logprobs``).
:func:`chat_messages` gives a chat body's ``messages`` as the prompt (chat completions and
``/tokenize``).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError, bad_request, unsupported
from gateway.schemas import MAX_STOP, ChatCompletionRequest, CompletionRequest, TokenizeRequest, _Sampling
from gateway.structured import structured_option
from gateway.translation import KeyCheck, check_keys
from protocol.chat import ContentError, Fault, content_text
from protocol.logprobs import MAX_LOGPROBS
from protocol.messages import ModelInfo
from protocol.request import DEFAULT, check_template_kwargs, split_stop
from protocol.validation import as_role, echo

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default ``temperature`` (the Python SDK's is 0, greedy)."""


def model_eos(body: _Sampling, info: ModelInfo | None) -> frozenset[int]:
    """The model's EOS token ids that :func:`request_options` puts in ``stop_token`` on the
    caller's behalf (``stop_token_ids`` without ``ignore_eos``), empty when it puts none. A choice
    ended by one reports ``stop_reason`` None, as vLLM (which checks EOS before ``stop_token_ids``,
    so an EOS id listed there reads None too); with ``ignore_eos`` every stop token is the caller's."""
    if body.ignore_eos or not body.stop_token_ids or info is None:
        return frozenset()
    return frozenset(info.eos_token_ids)


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
        **logprob_options(body),
        **structured_option(body),  # response_format & co. (gateway.structured)
        **fim_option(body),
        **template_option(body),
        **chat_ending_option(body),
    }


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""``reasoning_effort`` values OpenAI's API takes."""


def template_option(body) -> dict[str, str]:
    """A chat body's ``chat_template_kwargs`` (vLLM's and llama.cpp's: extra chat template variables,
    e.g. ``{"enable_thinking": false}`` for Qwen3) with its ``reasoning_effort`` (OpenAI's) added as the
    template variable ``reasoning_effort`` unless the kwargs set one (gpt-oss's template reads it, as vLLM
    passes it; a template that does not read a variable ignores it), as the request's
    ``chat_template_kwargs`` (JSON text); absent when neither is given. 400 naming the field for a
    value the protocol refuses (:func:`protocol.request.check_template_kwargs`: not an object, a reserved name)
    or an unknown effort."""
    kwargs, effort = getattr(body, "chat_template_kwargs", None), getattr(body, "reasoning_effort", None)
    if kwargs is None and effort is None:
        return {}
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {echo(effort)}",
                          "reasoning_effort")
    if effort is not None and isinstance(kwargs, dict):
        kwargs = {"reasoning_effort": effort, **kwargs}
    elif effort is not None and kwargs is None:
        kwargs = {"reasoning_effort": effort}
    try:
        text = check_template_kwargs(kwargs, "chat_template_kwargs")
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None
    return {} if text is None else {"chat_template_kwargs": text}


def chat_ending_option(body) -> dict[str, bool]:
    """How a chat body's prompt ends (vLLM's fields) as the request's: ``continue_final_message`` true
    leaves the final message open for the model to continue (the prefill idiom; the answer is the new
    text only), with no generation prompt unless ``add_generation_prompt`` says otherwise, which is
    then a 400 in vLLM's words; ``add_generation_prompt`` false ends the prompt without the assistant's
    header. Absent for a body that sets neither (or another route's body)."""
    cont, gen = getattr(body, "continue_final_message", None), getattr(body, "add_generation_prompt", None)
    if cont and gen:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return {**({"continue_final_message": True} if cont else {}),
            **({"add_generation_prompt": False} if gen is False else {})}


def fim_option(body: _Sampling) -> dict[str, str]:
    """A completions body's ``suffix`` as the request's (absent when null or ``""``, OpenAI's
    "no suffix"); 400 with ``echo`` (the prompt shown back would not be what the model read)."""
    suffix = getattr(body, "suffix", None)
    if not suffix:
        return {}
    if body.echo:
        raise bad_request("echo cannot be combined with suffix (fill in the middle); leave one out", "echo")
    return {"suffix": suffix}


TEXT_PART_KEYS = frozenset({"type", "text"})
"""The keys of a chat message's text part (OpenAI's ``ChatCompletionContentPartTextParam``) that the
prompt reads."""

_OBJECT_OR_NULL: KeyCheck = (lambda v: v is None or isinstance(v, dict), "an object or null")
_UNUSED_PART_KEYS: dict[str, KeyCheck] = {"prompt_cache_breakpoint": _OBJECT_OR_NULL, "cache_control": _OBJECT_OR_NULL}
"""A text part's keys that change nothing here, checked as an object (or null): OpenAI's
``prompt_cache_breakpoint`` (the ``openai`` SDK's ``PromptCacheBreakpoint``) and the ``cache_control``
that OpenRouter and LiteLLM clients put on a part (Anthropic's ``{"type": "ephemeral"}`` marker): the
prefix cache keeps every prompt's prefix without them. As the Responses API's parts and the Messages
API's blocks, a text part takes no other key."""

_PART_TAKES = "type and text; prompt_cache_breakpoint and cache_control are taken and not used"


def chat_messages(body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """``body.messages`` as the client SDK takes them, the chat prompt: ``{"role", "content"}``
    with text parts joined (the chat route's and ``/tokenize``'s, alike), by the rule every entry point
    applies (:func:`protocol.chat.content_text`: OpenAI's). 400 naming the message for a
    role that is not a name (:data:`protocol.validation.ROLE`, the SDK's rule too), a
    message other than the assistant's without content (OpenAI's rule;
    the assistant's may be null beside its tool calls), content given as an empty array (OpenAI's rule,
    every role's: an array holds at least one part; ``""`` is taken), or for no message; and naming
    the part (``messages.0.content.1.type``, ``.text``) for a part without a type, one whose type is
    none of :data:`protocol.chat.PART_TYPES`, or a text part without text. 501 naming the part's type for one
    of OpenAI's other parts (an image, audio, a file, a refusal): slotserve serves text. A text part's key
    other than :data:`TEXT_PART_KEYS` is a 400 ``unknown_parameter`` naming it, as a message's own unknown
    key is (``messages.0.content.1.foo``); its unused keys are checked as typed."""
    out = []
    for i, m in enumerate(body.messages):
        try:
            as_role(m.role, "role")
        except ValueError as e:
            raise bad_request(str(e), f"messages.{i}.role") from None
        try:
            content = content_text(m.content, m.role)
        except ContentError as e:
            raise content_error(e, f"messages.{i}.content") from None
        if isinstance(m.content, list):  # (text parts, each: content_text took them)
            for j, part in enumerate(m.content):
                check_keys(part, f"messages.{i}.content.{j}", TEXT_PART_KEYS, _UNUSED_PART_KEYS, _PART_TAKES)
        out.append({"role": m.role, "content": content})
    if not out:
        raise bad_request("messages must not be empty", "messages")
    return out


def content_error(e: ContentError, content: str) -> APIError:
    """The HTTP error of ``e``, a refusal of the message content whose field is ``content``
    (``messages.0.content``): its part's field in ``param`` (``messages.0.content.1.type``), 501
    ``unsupported`` for a part slotserve does not serve, else 400 with the fault's code."""
    param = ".".join((content, *map(str, e.path)))
    message = e.named(param) if e.leads else e.words
    if e.fault is Fault.UNSUPPORTED:
        return unsupported(param, message)
    return bad_request(message, param, e.fault.value)


def _count(value: int | None, field: str, extra: str = "") -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{field} must be an integer in [0, {MAX_LOGPROBS}]{extra}, got {echo(value)}", field)
    return value


def logprob_options(body: _Sampling) -> dict[str, int]:
    """``logprobs`` / ``prompt_logprobs`` request fields of ``body`` (absent when off); 400 for a count
    outside [0, 20], chat's ``top_logprobs`` without ``logprobs: true`` (OpenAI's rule), or
    ``top_logprobs`` on ``/v1/completions`` (a chat field there: completions take ``logprobs: N``),
    or ``prompt_logprobs`` > 0 with ``stream`` (vLLM's rule and message: a stream has no place for them;
    ``prompt_logprobs: 0`` with ``stream`` is accepted, as vLLM does, and not asked of the worker)."""
    out: dict[str, int] = {}
    prompt = _count(body.prompt_logprobs, "prompt_logprobs")
    if prompt is not None and body.stream:
        if prompt > 0:
            raise bad_request("`prompt_logprobs` are not available when `stream=True` (vLLM's rule); ask them "
                              "without stream", "prompt_logprobs")
        prompt = None  # (nothing would show them)
    if isinstance(body, ChatCompletionRequest):
        top = _count(body.top_logprobs, "top_logprobs")
        if top is not None and body.logprobs is not True:
            raise bad_request("top_logprobs needs logprobs: true (OpenAI's rule)", "top_logprobs")
        if body.logprobs:
            out["logprobs"] = top or 0
    elif isinstance(body, CompletionRequest):
        if body.top_logprobs not in (None, 0) or type(body.top_logprobs) is bool:
            raise bad_request("top_logprobs is a chat completions field; /v1/completions takes logprobs: N "
                              f"(0..{MAX_LOGPROBS})", "top_logprobs")
        n = _count(body.logprobs, "logprobs", " (vLLM's bound; OpenAI's is 5)")
        if n is not None:
            out["logprobs"] = n
            if body.echo:
                prompt = n if prompt is None else max(n, prompt)
    if prompt is not None:
        out["prompt_logprobs"] = prompt
    return out


_AS_IS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
"""Body fields passed to the request under their own names when given (absent: the request's default)."""


def for_choice(options: dict[str, Any], index: int) -> dict[str, Any]:
    """``options`` for choice ``index`` of ``n``: ``seed + index`` (so choices differ and each is reproducible)."""
    seed = options["seed"]
    return options if seed is None or index == 0 else {**options, "seed": seed + index}


def _split_stop(stop) -> tuple[list[str], list[tuple[int, ...]]]:
    """``stop`` (validated by its schema) -> (text stop strings, token-id stop
    sequences), by :func:`protocol.request.split_stop`. 400 when it has more
    than :data:`MAX_STOP` entries, or naming an empty one (``stop[1] must not be empty``, as the
    Python SDK words it; ``stop`` for a lone ``""``)."""
    texts, sequences = split_stop(stop)
    entries = len(texts) + len(sequences)
    if entries > MAX_STOP:
        raise bad_request(f"stop holds {entries} entries; at most {MAX_STOP} are allowed", "stop")
    if not (all(texts) and all(sequences)):
        empty = "stop" if isinstance(stop, str) else f"stop[{next(i for i, s in enumerate(stop) if not s)}]"
        raise bad_request(f"{empty} must not be empty: an empty stop would end every answer before its first "
                          "token; leave it out", "stop")
    return texts, [tuple(s) for s in sequences]
