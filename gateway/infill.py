"""``POST /infill``: code infilling in llama.cpp's request and response shape.

What llama.cpp's server answers on ``/infill`` (its README and its source, ``format_prompt_infill``),
as editors call it (llama.vscode, llama.vim); the fields, answer and stream it shares with
``/completion`` are :mod:`gateway.llama_native`'s:

- Request: ``input_prefix`` and ``input_suffix`` (the code before and after the cursor, default
  ``""``), ``input_extra`` (other files' chunks, ``[{"filename", "text"}]``), ``prompt`` (text
  appended to the prefix -- llama.cpp's code puts it there, after ``input_prefix``, though its README
  says after the middle token), ``n_predict`` (-1 or absent: the default budget,
  ``default_chat_max_tokens`` within the context; 0 the prompt evaluated and cached, nothing shown, as
  ``/completion``: llama.vscode's and llama.vim's prefetch of other files' chunks), and the shared fields. Accepted and not
  used: ``return_tokens`` (an answer's ``tokens`` are always there).
- The prompt is rendered by the worker with the model's own FIM tokens (the request's ``suffix``
  and ``input_extra``, :mod:`worker.models.fim`), so a keystroke's request reuses the KV of the file
  prefix it shares with the last one (the prefix cache).
- Response: :mod:`gateway.llama_native`'s, ``prompt`` ``""`` (the gateway never sees the rendered
  prompt).
- Errors name this body's fields (``input_suffix`` for a model without FIM tokens: 400;
  ``input_prefix`` for the prompt).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import APIError
from gateway.llama_native import _SAMPLING_PARAMS, _SAMPLING_WORDS, LLAMA_DEFAULTS, Budget, LlamaBody, \
    LlamaEndpoint, sampling_options
from gateway.schemas import NULL_IS_DEFAULT

__all__ = ["LLAMA_DEFAULTS", "ExtraChunk", "InfillEndpoint", "InfillRequest", "infill_options"]


class ExtraChunk(BaseModel):
    """One ``input_extra`` entry: another file's chunk (llama.cpp's defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    filename: str = "tmp"
    text: str = ""


class InfillRequest(LlamaBody):
    """The ``/infill`` body (see the module docstring)."""

    input_prefix: Annotated[str, NULL_IS_DEFAULT] = ""  # (null: "", as llama.cpp's json_value reads it)
    input_suffix: Annotated[str, NULL_IS_DEFAULT] = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)  # (null: a 400, as llama.cpp's "must be an array")
    prompt: Annotated[str, NULL_IS_DEFAULT] = ""


def infill_options(body: InfillRequest) -> dict[str, Any]:
    """The body's sampling and stopping fields as ``RequestParams`` keyword arguments
    (:func:`gateway.llama_native.sampling_options`), with its suffix and other files' chunks."""
    opts = sampling_options(body)
    opts["suffix"] = body.input_suffix
    if body.input_extra:
        opts["input_extra"] = [(c.filename, c.text) for c in body.input_extra]
    return opts


class InfillEndpoint(LlamaEndpoint):
    """The ``/infill`` handler (:meth:`infill`)."""

    schema = InfillRequest
    prompt_param = "input_prefix"
    params = {**_SAMPLING_PARAMS, "suffix": "input_suffix", "prompt": "input_prefix", "input_extra": "input_extra"}
    words = (*_SAMPLING_WORDS, (r"suffix", "input_suffix"))
    # (``prompt`` is left as it is in messages: the body's ``prompt`` is a part of the request's)

    async def infill(self, request):
        return await self.handle(request)

    async def prompts(self, body: InfillRequest, model: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [(body.input_prefix + body.prompt, "", infill_options(body))]

    def default_budget(self, info) -> Budget:
        """The chat default (``default_chat_max_tokens``) within the context, lowered to what the
        prompt leaves."""
        max_tokens = self.gen.config.default_chat_max_tokens
        if info is not None and info.max_seq_len is not None:
            max_tokens = max(1, min(max_tokens, info.max_seq_len))
        return Budget(max_tokens, clamp=True)

    def show_tokens(self, body: InfillRequest) -> bool:
        return True

    def _renamed(self, err: APIError, message: str) -> APIError:
        err = super()._renamed(err, message)
        if message.startswith("suffix:"):
            err.param = "input_suffix"
        return err
