"""``POST /completion`` (also ``/completions``): llama.cpp's native completion route, so that clients
written for ``llama-server`` (Continue's llama.cpp provider, scripts) work unchanged. The fields,
answer, stream and errors it shares with ``/infill`` are :mod:`gateway.llama_native`'s; what is its
own (llama.cpp's README, ``POST /completion``, and ``tokenize_input_prompts`` in its source):

- ``prompt`` (required): a string; a list of token ids (``[12, 34, 56]``); a list mixing strings and
  token ids (``[12, "text", 56]``: one prompt, each string tokenised by the gateway's tokenizer of the
  model, special tokens such as BOS added only when the list starts with a string, as llama.cpp
  does); or a list of those (``["a", "b"]``, ``[[12, 34], "b"]``: several prompts, the answer a list
  of one object per prompt, a stream interleaving them by ``index``). llama.cpp's object form
  (``{"prompt_string", "multimodal_data"}``) is a 400: no multimodal model is served.
- ``n_predict``: -1 or absent generates until a stop (EOS, a ``stop`` string) or the end of the
  slot's context (``truncated``: true then), as llama.cpp's -1 (infinity); 0 evaluates the prompt and
  generates nothing shown (``content`` ``""``, ``stop_type`` ``limit``); N: at most N tokens.
- ``return_tokens``: the answer's ``tokens`` lists the generated ids (else ``[]``; a stream's
  events always carry them), as llama.cpp.
- The answer's ``prompt`` is the prompt's text: a string prompt's own, a token prompt's decoded by
  the model's tokenizer (``""`` without one).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from gateway.errors import bad_request, from_value_error
from gateway.llama_native import Budget, LlamaBody, LlamaEndpoint, sampling_options
from gateway.schemas import _bad_type, _shown
from gateway.threads import TOKENIZER_THREADS
from gateway.tokenizer import Tokenizer

_ONE = "a string, a list of token ids or a list mixing strings and token ids"


def _one_prompt(value: list) -> bool:
    """Whether the list ``value`` is one prompt (token ids, or strings and token ids mixed: no list in
    it, not all strings), as llama.cpp tells one prompt from a list of prompts."""
    return not any(type(p) is list for p in value) and not all(type(p) is str for p in value)


def _check_pieces(pieces: list, where: str) -> None:
    """Every entry of the one-prompt list ``pieces`` a string or an integer token id, else the error
    naming it (``2.0`` and ``true`` are not token ids); an empty string is refused naming it (it has
    no tokens, and the tokenizers refuse it; llama.cpp reads it as nothing, or a BOS alone first)."""
    if not pieces:
        raise _bad_type(f"{where} must not be empty")
    for i, p in enumerate(pieces):
        if type(p) not in (int, str):
            raise _bad_type(f"token ids must be integers: {where}[{i}] is {_shown(p)}")
        if p == "":
            raise PydanticCustomError("invalid_value",
                                      f"{where}[{i}] is an empty string, which has no tokens: leave it out")


def _prompt(value: Any) -> Any:
    """``prompt``'s shape (see the module docstring), each entry checked, so that a wrong one is named
    (``prompt[1][2] is 2.0``)."""
    if type(value) is str:
        return value
    if type(value) is dict:
        raise _bad_type("prompt as an object (llama.cpp's {\"prompt_string\", \"multimodal_data\"}) is not "
                        "supported: no multimodal model is served; send the text as a string")
    if type(value) is not list:
        raise _bad_type(f"prompt must be {_ONE}, or a list of those (several prompts), got {_shown(value)}")
    if not value or _one_prompt(value):
        _check_pieces(value, "prompt")
        return value
    for i, p in enumerate(value):
        if type(p) is list:
            _check_pieces(p, f"prompt[{i}]")
        elif type(p) is not str:
            raise _bad_type(f"prompt[{i}] must be {_ONE}, got {_shown(p)}")
        elif not p:  # (named here, before any prompt is sent)
            raise PydanticCustomError("invalid_value", f"prompt[{i}] must not be empty")
    return value


class LlamaCompletionRequest(LlamaBody):
    """The ``/completion`` body (see the module docstring and :mod:`gateway.llama_native`)."""

    prompt: Annotated[Any, BeforeValidator(_prompt)]

    def prompts(self) -> list[str | list]:
        """The prompts, one per request: a string, or a list of token ids and strings."""
        p = self.prompt
        return [p] if isinstance(p, str) or _one_prompt(p) else list(p)


def _tokens(tok: Tokenizer, pieces: list) -> list[int]:
    """The token ids of a prompt mixing strings and ids: each string tokenised, special tokens (BOS)
    added only to a string that comes first (llama.cpp's ``tokenize_mixed``). Raises ValueError."""
    ids: list[int] = []
    for i, p in enumerate(pieces):
        ids.extend([p] if type(p) is int else tok.encode(p, add_special_tokens=i == 0))
    return ids


class LlamaCompletionEndpoint(LlamaEndpoint):
    """The ``/completion`` handler (:meth:`handle`)."""

    schema = LlamaCompletionRequest

    async def prompts(self, body: LlamaCompletionRequest, model: str) -> list[tuple[Any, str, dict[str, Any]]]:
        prompts = body.prompts()
        tok = None
        if any(not isinstance(p, str) for p in prompts):  # (a token prompt's text; a mixed one's ids)
            tok = await self.gen.tokenizers.get(self.gen.link.served_name(model))
        mixed = [i for i, p in enumerate(prompts) if not isinstance(p, str) and any(type(x) is str for x in p)]
        if mixed and tok is None:
            where = "prompt" if len(prompts) == 1 else f"prompt[{mixed[0]}]"
            raise bad_request(f"{where} mixes strings and token ids, which the gateway tokenises with the model's "
                              f"tokenizer, and {self.gen.tokenizers.why_none(self.gen.link.served_name(model))}; "
                              "send text or token ids alone", "prompt")
        try:
            shown = await TOKENIZER_THREADS.run(_shown_prompts, tok, prompts)
        except ValueError as e:
            raise from_value_error(e, "prompt") from None
        options = sampling_options(body)
        return [(p, text, options) for p, text in shown]

    def prompt_count(self, body: LlamaCompletionRequest) -> int:
        return len(body.prompts())

    def default_budget(self, info) -> Budget:
        """llama.cpp's -1: until a stop or the end of the context."""
        max_seq_len = None if info is None else info.max_seq_len
        return Budget(self.gen.config.default_chat_max_tokens if max_seq_len is None else max_seq_len, clamp=True)


def _shown_prompts(tok: Tokenizer | None, prompts: list) -> list[tuple[str | list[int], str]]:
    """Per prompt: ``(what is submitted: the text or the token ids, its text for the answer)``."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, p))
            continue
        ids = _tokens(tok, p) if any(type(x) is str for x in p) else list(p)
        out.append((ids, _decoded(tok, ids)))
    return out


def _decoded(tok: Tokenizer | None, ids: list[int]) -> str:
    """The text of the token prompt ``ids`` for the answer's ``prompt``, ``""`` without a tokenizer or
    for ids it cannot decode (ids outside the vocabulary: the submission refuses those, 400)."""
    if tok is None:
        return ""
    try:
        return tok.decode(ids)
    except Exception:  # noqa: BLE001 -- display only; a library's error never reaches the client
        return ""
