"""``POST /infill``: code infilling in llama.cpp's request and response shape.

What llama.cpp's server answers on ``/infill`` (its README and its source,
``format_prompt_infill`` and ``to_json_non_oaicompat``), as editors call it
(llama.vscode, llama.vim):

- Request: ``input_prefix`` and ``input_suffix`` (the code before and after
  the cursor, default ``""``), ``input_extra`` (other files' chunks,
  ``[{"filename", "text"}]``), ``prompt`` (text appended to the prefix --
  llama.cpp's code puts it there, after ``input_prefix``, though its README
  says after the middle token), ``n_predict`` (-1 or absent: the default
  budget), ``stream``, and the sampling options of its ``/completion`` with
  its defaults (``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.95, ``min_p``
  0.05, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``,
  ``seed`` (-1 or 4294967295: none), ``stop``, ``ignore_eos``); ``model``
  optional with one model; slotserve's ``priority`` and ``timeout_s``.
  Accepted and not used: ``cache_prompt`` (the prefix cache is always on),
  ``id_slot``, ``samplers``, ``n_indent``, ``t_max_prompt_ms``,
  ``t_max_predict_ms``, ``n_probs`` (0 only), ``return_tokens`` (tokens always
  come back). ``response_fields`` keeps only the fields named (``"a/b"``: a
  nested one, under the key ``"a/b"``), as llama.cpp does. Anything else is
  a 400 naming it.
- The prompt is rendered by the worker with the model's own FIM tokens (the
  request's ``suffix`` and ``input_extra``, :mod:`worker.models.fim`), so a
  keystroke's request reuses the KV of the file prefix it shares with the
  last one (the prefix cache).
- Response: ``{"index", "content", "tokens", "id_slot", "stop": true,
  "model", "tokens_predicted", "tokens_evaluated", "generation_settings",
  "prompt", "has_new_line", "truncated", "stop_type" ("eos", "word",
  "limit"), "stopping_word", "tokens_cached", "timings": {"cache_n",
  "prompt_n", "prompt_ms", ..., "predicted_per_second"}}``. ``prompt`` is
  ``""`` (the gateway never sees the rendered prompt). A stream sends
  ``data: {"index", "content", "tokens", "stop": false, "id_slot": -1,
  "tokens_predicted", "tokens_evaluated"}`` events, then the final object
  with ``"content": ""`` and ``"tokens": []``, and no ``[DONE]``, as
  llama.cpp.
- Errors are OpenAI-shaped (:mod:`gateway.errors`), ``param`` naming this
  body's fields (``input_suffix`` for a model without FIM tokens: 400).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from client import RemoteError
from gateway.drain import REFUSED
from gateway.errors import APIError, bad_request, from_remote, from_value_error, reworded, shutting_down, unavailable
from gateway.generate import ClientGone, Generate, _Call, _check_json_body_headers, _EventStream, read_body, wait_for
from gateway.generation import Generation, Signal
from gateway.link import resolve_model
from gateway.responses import error_response, json_response, sse
from gateway.translation import parse_body
from protocol.enums import FinishReason

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
"""llama.cpp's sampling defaults (``common_params_sampling``), used where the body gives none."""

_NO_SEED = (-1, 0xFFFFFFFF)
"""llama.cpp's "random seed" values (``LLAMA_DEFAULT_SEED`` is 0xFFFFFFFF)."""


class ExtraChunk(BaseModel):
    """One ``input_extra`` entry: another file's chunk (llama.cpp's defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    filename: str = "tmp"
    text: str = ""


class InfillRequest(BaseModel):
    """The ``/infill`` body (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    timeout_s: float | None = None
    response_fields: list[str] | None = None
    # accepted, not used (see the module docstring)
    cache_prompt: bool | None = None
    id_slot: int | None = None
    samplers: list[str] | str | None = None
    n_indent: int | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    n_probs: Literal[0] | None = None
    return_tokens: bool | None = None
    timings_per_token: bool | None = None


_PARAMS = {"suffix": "input_suffix", "prompt": "input_prefix", "input_extra": "input_extra", "top_k": "top_k",
           "top_p": "top_p", "min_p": "min_p", "temperature": "temperature", "seed": "seed", "stop": "stop",
           "repetition_penalty": "repeat_penalty", "presence_penalty": "presence_penalty", "max_tokens": "n_predict",
           "frequency_penalty": "frequency_penalty", "priority": "priority", "timeout_s": "timeout_s"}
"""A request field named by an error -> this body's field."""


def infill_options(body: InfillRequest) -> dict[str, Any]:
    """The body's sampling and stopping fields as ``RequestParams`` keyword arguments (llama.cpp's
    defaults where absent; ``top_k`` <= 0 and ``seed`` -1 mean off, as there)."""
    opts: dict[str, Any] = {name: default if getattr(body, name) is None else getattr(body, name)
                            for name, default in LLAMA_DEFAULTS.items()}
    opts["top_k"] = max(0, opts["top_k"])
    if body.seed is not None and body.seed not in _NO_SEED:
        opts["seed"] = body.seed
    if body.stop:
        opts["stop"] = body.stop
    if body.ignore_eos:
        opts["stop_token"] = ()
    for field, name in (("repeat_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                        ("frequency_penalty", "frequency_penalty"), ("priority", "priority"),
                        ("timeout_s", "timeout_s")):
        if getattr(body, field) is not None:
            opts[name] = getattr(body, field)
    opts["suffix"] = body.input_suffix
    if body.input_extra:
        opts["input_extra"] = [(c.filename, c.text) for c in body.input_extra]
    return opts


class InfillEndpoint:
    """The ``/infill`` handler, sharing the generation endpoints' link, metrics and drain (``generate``)."""

    def __init__(self, generate: Generate) -> None:
        self.gen = generate

    async def infill(self, request: Request) -> Response:
        gen = self.gen
        call = _Call(request.scope["path"], Signal(asyncio.get_running_loop()))
        gen.metrics.in_flight.inc()
        try:
            if gen.drain.draining:
                raise shutting_down(REFUSED)
            gen.drain.add(call)
            body = await self._parse(request)
            call.check_ended()
            call.model = await self._model(body)
            await self._submit(body, call)
            await wait_for(request, call, lambda: all(g.finished or (body.stream and g.handle.first_token_s is not None)
                                                      for g in call.gens))
            self._raise_failure(call)
            if body.stream:
                call.streaming = True
                return _EventStream(self._events(call, body), lambda: gen._end(call))
            gen._observe(call, 200)
            return json_response(_fields(self._final(call, body, streamed=False), body.response_fields))
        except APIError as e:
            gen._observe(call, e.status)
            return error_response(e)
        except (ClientGone, ClientDisconnect):
            gen._observe(call, 499)
            return Response(status_code=499)
        finally:
            if not call.streaming:
                gen._end(call)

    async def _parse(self, request: Request) -> InfillRequest:
        _check_json_body_headers(request.headers)
        return parse_body(InfillRequest, await read_body(request, self.gen.config.max_body_bytes))

    async def _model(self, body: InfillRequest) -> str:
        """The model the body names, else the one served (400 when several are, 503 when none is)."""
        return await resolve_model(self.gen.link, body.model)

    async def _submit(self, body: InfillRequest, call: _Call) -> None:
        gen = self.gen
        client = call.client = await gen.link.client_for(call.model)
        info = gen.link.model_info(call.model)
        max_tokens = body.n_predict
        options = infill_options(body)
        if max_tokens is None or max_tokens < 0:  # llama.cpp's -1: as long as it takes (here: the chat default)
            max_tokens = gen.config.default_chat_max_tokens
            if info is not None and info.max_seq_len is not None:
                max_tokens = max(1, min(max_tokens, info.max_seq_len))
            options["clamp_max_tokens"] = True  # (a default: what the context leaves after the prompt lowers it)
        elif max_tokens == 0:
            raise bad_request("n_predict must be >= 1, or negative (-1, as llama.cpp) for the default budget", "n_predict")
        g = Generation(0, call.signal)
        call.gens.append(g)
        call.prompts = 1
        try:
            g.handle = client.submit_request(body.input_prefix + body.prompt, max_tokens, g.on_end,
                                             on_token=call.signal.poke if body.stream else None,
                                             **options)
        except ValueError as e:
            call.gens.pop()
            err = from_value_error(e, "input_prefix")
            raise _renamed(err, str(e)) from None
        except RuntimeError as e:  # the client was closed: the gateway is stopping
            call.gens.pop()
            raise unavailable(f"the gateway is stopping ({e})") from None

    def _raise_failure(self, call: _Call) -> None:
        for g in call.gens:
            if g.finish_reason is FinishReason.ERROR:
                err = g.error
                if isinstance(err, RemoteError):
                    raise _renamed(from_remote(err.code, err.message, "input_prefix"), err.message)
                raise APIError(500, f"the request failed: {err}", code="internal")
            if g.finish_reason is FinishReason.CANCELLED:
                raise unavailable("the request was cancelled by slotserve (the gateway is stopping or lost its "
                                  "broker connection); retry")

    async def _events(self, call: _Call, body: InfillRequest):
        """llama.cpp's stream: one event per batch of new tokens, then the final object (no ``[DONE]``)."""
        g = call.gens[0]
        while True:
            d = g.take()
            if d is not None and (d.tokens or d.text):
                yield sse({"index": 0, "content": d.text, "tokens": d.tokens, "stop": False, "id_slot": -1,
                           "tokens_predicted": g.streamed_tokens, "tokens_evaluated": g.prompt_tokens or 0})
            if d is not None and d.finished:
                try:
                    self._raise_failure(call)
                except APIError as e:
                    self.gen._observe(call, e.status)
                    yield sse(e.body())
                    return
                yield sse(_fields(self._final(call, body, streamed=True), body.response_fields))
                self.gen._observe(call, 200)
                return
            if call.ended is not None:
                e = shutting_down(call.ended)
                self.gen._observe(call, e.status)
                yield sse(e.body())
                return
            await call.signal.wait()

    def _final(self, call: _Call, body: InfillRequest, streamed: bool) -> dict:
        g = call.gens[0]
        h = g.handle
        text = g.text
        prompt_n = g.prompt_tokens or 0
        cached = g.cached_tokens or 0
        predicted = len(g.tokens)
        stop_type, word = _stop_type(g)
        first = h.first_token_s
        end = h.finished_s if h.finished_s is not None else time.monotonic()
        prompt_ms = 1000.0 * (first - h.submitted_s) if first is not None else 0.0
        predicted_ms = 1000.0 * (end - first) if first is not None else 0.0
        opts = infill_options(body)
        settings = {"n_predict": h.params.max_tokens, "temperature": opts["temperature"], "top_k": opts["top_k"],
                    "top_p": opts["top_p"], "min_p": opts["min_p"], "seed": opts.get("seed", 0xFFFFFFFF),
                    "stop": body.stop or [], "ignore_eos": bool(body.ignore_eos), "stream": body.stream}
        return {
            "index": 0, "content": "" if streamed else text, "tokens": [] if streamed else g.tokens, "id_slot": 0,
            "stop": True, "model": call.model, "tokens_predicted": predicted, "tokens_evaluated": prompt_n,
            "generation_settings": settings, "prompt": "", "has_new_line": "\n" in text, "truncated": False,
            "stop_type": stop_type, "stopping_word": word, "tokens_cached": prompt_n + predicted,
            "timings": {
                "cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(1, prompt_n - cached),
                "prompt_per_second": 1000.0 * (prompt_n - cached) / prompt_ms if prompt_ms else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(1, predicted),
                "predicted_per_second": 1000.0 * predicted / predicted_ms if predicted_ms else 0.0,
            },
        }


def _stop_type(g: Generation) -> tuple[str, str]:
    """llama.cpp's ``stop_type`` and ``stopping_word``: ``word`` (a stop string), ``eos`` (a stop
    token), ``limit`` (``n_predict`` or ``timeout_s``)."""
    if g.finish_reason is FinishReason.STOP:
        reason = g.stop_reason
        return ("word", reason) if isinstance(reason, str) else ("eos", "")
    return "limit", ""


def _fields(out: dict, fields: list[str] | None) -> dict:
    """``out`` with only ``fields`` (llama.cpp's ``response_fields``: ``"a/b"`` reads ``out["a"]["b"]``,
    shown under the key ``"a/b"``; a missing one is left out)."""
    if not fields:
        return out
    kept = {}
    for path in fields:
        value: Any = out
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            kept[path] = value
    return kept


_WORDS = ((r"max_tokens", "n_predict"), (r"repetition_penalty", "repeat_penalty"), (r"suffix", "input_suffix"))
"""The request's fields this body names otherwise, wherever an error's message names them
(:func:`gateway.errors.reworded`; ``prompt`` is left as it is: the body's ``prompt`` is a part of the request's)."""


def _renamed(err: APIError, message: str) -> APIError:
    """``err`` with ``param`` as this body names it (the request's ``suffix`` is ``input_suffix``, ...), and
    its message naming the body's fields (was: "repetition_penalty must be > 0" for ``repeat_penalty``,
    "max_tokens must be < 2**64" for ``n_predict``)."""
    err.param = _PARAMS.get(err.param, err.param) if err.param is not None else None
    if message.startswith("suffix:"):
        err.param = "input_suffix"
    return reworded(err, _WORDS)

