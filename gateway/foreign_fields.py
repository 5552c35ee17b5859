"""Request fields of other servers' APIs that a route here refuses as unknown, and what to send instead.

A client written for llama.cpp's ``llama-server`` or for Ollama sends its own fields to the OpenAI
routes (llama.cpp's ``n_predict``, ``repeat_penalty``, ``cache_prompt``; Ollama's ``options``,
``num_predict``); the route answers them the 400 of any unknown field (``unknown_parameter``, its
``param`` the field), and :func:`hint` adds, in parentheses, what this route takes instead or why
the field can be left out, so the 400 says what to do next ("Unrecognized request argument supplied:
n_predict (llama.cpp's n_predict is max_tokens here)"). The fields are those of llama.cpp's server
README (``tools/server/README.md``: ``POST /completion``'s options, which its OpenAI routes also read)
and of Ollama's API reference (``docs/api.md``: a request's ``options`` and its top-level fields);
docs/llama-cpp.md gives the same mapping. One table for every generation route that refuses unknown
fields, and one for ``/tokenize``, whose name is llama.cpp's but whose body is vLLM's (llama.cpp's
``content``, ``add_special``, ``with_pieces``: its README's ``POST /tokenize``); a route's body schema
says which route it is (``hint_route``, a :class:`Route`), and a schema without one
(``/v1/embeddings``, ``/infill``, which takes llama.cpp's own fields) gets no hints.
"""

from __future__ import annotations

import enum


class Route(enum.Enum):
    """A generation route whose unknown fields get hints: what it takes differs (``max_tokens`` is
    ``max_output_tokens`` on ``/v1/responses``)."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    TOKENIZE = "/tokenize"


_OPENAI = (Route.COMPLETIONS, Route.CHAT)
_LEAVE_OUT = "leave it out"
_NOT_HERE = "is taken by /v1/chat/completions and /v1/completions, not by this route"
_MAX_TOKENS = {Route.COMPLETIONS: "is max_tokens here", Route.CHAT: "is max_tokens here",
               Route.RESPONSES: "is max_output_tokens here", Route.MESSAGES: "is max_tokens here"}
_REPETITION = {Route.COMPLETIONS: "is repetition_penalty here", Route.CHAT: "is repetition_penalty here",
               Route.RESPONSES: f"is repetition_penalty, which {_NOT_HERE}",
               Route.MESSAGES: f"is repetition_penalty, which {_NOT_HERE}"}
_CONTEXT = ("is the server's, not a request's: slotserve up --max-model-len (per slot); leave it out")
_NOT_SUPPORTED = f"sampler is not supported; {_LEAVE_OUT}"

_LLAMA_CPP: dict[str, str | dict[Route, str]] = {
    "n_predict": _MAX_TOKENS,
    "repeat_penalty": _REPETITION,
    "n_probs": {Route.COMPLETIONS: "is logprobs here (alternatives per token)",
                Route.CHAT: "is top_logprobs here, with logprobs: true",
                Route.RESPONSES: "is top_logprobs here, with include: [\"message.output_text.logprobs\"]",
                Route.MESSAGES: "(logprobs) is taken by /v1/chat/completions and /v1/completions, not by this route"},
    "cache_prompt": f"is not needed: the prefix cache is always on; {_LEAVE_OUT}",
    "id_slot": f"is not needed: slots are assigned by the broker; {_LEAVE_OUT}",
    "n_keep": f"is not supported: a prompt past the context is a 400, never cut; {_LEAVE_OUT}",
    "samplers": f"is not supported: the sampler order is fixed; {_LEAVE_OUT}",
    "typical_p": _NOT_SUPPORTED,
    "tfs_z": _NOT_SUPPORTED,
    "mirostat": _NOT_SUPPORTED,
    "mirostat_tau": _NOT_SUPPORTED,
    "mirostat_eta": _NOT_SUPPORTED,
    "dry_multiplier": _NOT_SUPPORTED,
    "dry_base": _NOT_SUPPORTED,
    "dry_allowed_length": _NOT_SUPPORTED,
    "dry_penalty_last_n": _NOT_SUPPORTED,
    "dry_sequence_breakers": _NOT_SUPPORTED,
    "xtc_probability": _NOT_SUPPORTED,
    "xtc_threshold": _NOT_SUPPORTED,
    "top_n_sigma": _NOT_SUPPORTED,
    "dynatemp_range": _NOT_SUPPORTED,
    "dynatemp_exponent": _NOT_SUPPORTED,
    "repeat_last_n": f"is not supported: repetition_penalty counts every token so far; {_LEAVE_OUT}",
    "penalize_nl": f"is not supported; {_LEAVE_OUT}",
    "min_keep": f"is not supported; {_LEAVE_OUT}",
    # served under the same name by the two OpenAI routes, not by the others
    "ignore_eos": {Route.RESPONSES: _NOT_HERE, Route.MESSAGES: _NOT_HERE},
    "min_p": {Route.RESPONSES: _NOT_HERE},
    "top_k": {Route.RESPONSES: _NOT_HERE},
    "grammar": {Route.RESPONSES: _NOT_HERE, Route.MESSAGES: _NOT_HERE},
    "json_schema": {Route.RESPONSES: "is text.format here, {\"type\": \"json_schema\", ...}",
                    Route.MESSAGES: "is output_config.format here, {\"type\": \"json_schema\", ...}"},
    "stop": {Route.RESPONSES: f"is not supported by this route; {_LEAVE_OUT}",
             Route.MESSAGES: "is stop_sequences here"},
}
"""llama.cpp's field -> what this route takes instead (the same words for every route, or by route: a
route missing is given no hint, the field being served there or foreign to llama.cpp's use of it)."""

_OLLAMA: dict[str, str | dict[Route, str]] = {
    "options": {route: f"are not read here: send each as a top-level field, {words}; num_ctx is slotserve up "
                       "--max-model-len" for route, words in (
                    (Route.COMPLETIONS, "max_tokens for num_predict, repetition_penalty for repeat_penalty"),
                    (Route.CHAT, "max_tokens for num_predict, repetition_penalty for repeat_penalty"),
                    (Route.RESPONSES, "max_output_tokens for num_predict"),
                    (Route.MESSAGES, "max_tokens for num_predict"))},
    "num_predict": _MAX_TOKENS,
    "num_ctx": _CONTEXT,
    "keep_alive": f"is not needed: a model stays loaded (unload it with POST /models/unload); {_LEAVE_OUT}",
    "format": {Route.COMPLETIONS: "is response_format here, {\"type\": \"json_object\"} or a json_schema",
               Route.CHAT: "is response_format here, {\"type\": \"json_object\"} or a json_schema",
               Route.RESPONSES: "is text.format here", Route.MESSAGES: "is output_config.format here"},
}
"""Ollama's field -> what this route takes instead (as :data:`_LLAMA_CPP`)."""


_LLAMA_CPP_TOKENIZE = {
    "content": "is prompt here (the text to tokenize)",
    "add_special": "is add_special_tokens here",
    "with_pieces": "is return_token_strs here (each token's string as token_strs)",
}
"""llama.cpp's ``/tokenize`` field -> what ``/tokenize`` takes here (vLLM's names): the only hints of
that route, which has no sampling fields."""


def hint(field: str, route: Route | None) -> str | None:
    """The words to add, in parentheses, to the 400 of the unknown top-level body field ``field`` on
    ``route`` (``"llama.cpp's n_predict is max_tokens here"``), or None: no route, a nested field
    (``messages.0.n_predict``), or a field no other server's client sends."""
    if route is None:
        return None
    if route is Route.TOKENIZE:
        words = _LLAMA_CPP_TOKENIZE.get(field)
        return None if words is None else f"llama.cpp's {field} {words}"
    for whose, table in (("llama.cpp's", _LLAMA_CPP), ("Ollama's", _OLLAMA)):
        words = table.get(field)
        if isinstance(words, dict):
            words = words.get(route)
        if words is not None:
            return f"{whose} {field} {words}"
    return None
