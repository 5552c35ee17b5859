"""llama.cpp's native generation routes, ``POST /infill`` (:mod:`gateway.infill`) and ``POST /completion``
(:mod:`gateway.llama_completion`): the body fields they share, the handler, and the answer's shapes.

What llama.cpp's server answers there (its README, ``tools/server/README.md``, and its source,
``to_json_non_oaicompat`` of ``server_task_result_cmpl_partial`` and ``_final``):

- Request: ``n_predict`` (tokens to generate; 0: the prompt evaluated and nothing generated shown;
  what -1 or absent means is the route's, :meth:`LlamaEndpoint.default_budget`), ``stream``, and the sampling options of ``/completion`` with its
  defaults (``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05, ``repeat_penalty``,
  ``presence_penalty``, ``frequency_penalty``, ``seed`` (-1 or 4294967295: none), ``stop`` (a list of
  strings), ``ignore_eos``); ``model`` optional with one model; slotserve's ``priority`` and
  ``timeout_s``. llama.cpp's other fields (``n_probs``, ``logit_bias``, ``json_schema``, ``grammar``,
  ``samplers``, its other samplers at the values that leave them off, ``cache_prompt``, ``id_slot``
  ...) are :mod:`gateway.llama_fields`'s: mapped to the request's options, accepted where they change
  nothing here, a 400 saying what is supported where they would; ``return_tokens`` is the route's
  (:meth:`LlamaEndpoint.show_tokens`).
  ``response_fields`` keeps only the fields named (``"a/b"``: a nested one,
  under the key ``"a/b"``), as llama.cpp does. Anything else is a 400 naming it
  (``unknown_parameter``; no hint, :mod:`gateway.foreign_fields`: these routes take llama.cpp's own fields).
- Response, one object per prompt (a list when the body gave several): ``{"index", "content",
  "tokens", "id_slot", "stop": true, "model", "tokens_predicted", "tokens_evaluated",
  "generation_settings", "prompt", "has_new_line", "truncated", "stop_type" ("eos", "word", "limit"),
  "stopping_word", "tokens_cached", "timings": {"cache_n", "prompt_n", "prompt_ms",
  "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_token_ms",
  "predicted_per_second"}}`` (milliseconds; ``prompt_n`` the prompt tokens not taken from the prefix
  cache, ``cache_n`` those taken). ``truncated``: the generation stopped at the end of the slot's
  context. A stream sends ``data: {"index", "content", "tokens", "stop": false, "id_slot": -1,
  "tokens_predicted", "tokens_evaluated"}`` events as tokens come (several prompts: interleaved, each
  by its ``index``), then each prompt's final object with ``"content": ""`` and ``"tokens": []``,
  and no ``[DONE]``, as llama.cpp. With ``n_probs`` N > 0, each event and a whole answer carry its
  tokens' ``completion_probabilities`` (:func:`gateway.llama_fields.llama_probs`; a stream's final
  object none, as llama.cpp's).
- A body is read as JSON when it is sent as ``application/json``, with no Content-Type, or as
  ``text/plain`` or ``application/x-www-form-urlencoded`` (:data:`gateway.generate.LLAMA_BODY_TYPES`:
  ``llama-server`` reads any body as JSON, and ``curl -d`` without ``-H`` sends the form type); the
  OpenAI routes take ``application/json`` alone (or none), as OpenAI and vLLM.
- Errors are OpenAI-shaped (:mod:`gateway.errors`), ``param`` and message naming this body's fields
  (``n_predict``, not the request's ``max_tokens``). A failure before the first token is the HTTP
  error; one after it, in a stream, is a last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from client import RemoteError
from gateway.drain import REFUSED
from gateway.errors import APIError, bad_request, from_remote, from_value_error, reworded, shutting_down, unavailable
from gateway.generate import LLAMA_BODY_TYPES, ClientGone, Generate, _Call, _EventStream, parse_body, wait_for
from gateway.generation import Generation, Signal
from gateway.line_limits import LimitedGeneration, LineLimits
from gateway.link import resolve_model
from gateway.llama_fields import LlamaFields, gives_text, llama_probs, logit_bias, refusal, sampler_overrides
from gateway.logprobs import utf8_bytes
from gateway.responses import error_response, json_response, sse
from gateway.schemas import NULL_IS_DEFAULT
from gateway.structured import structured_option
from gateway.threads import TOKENIZER_THREADS
from gateway.tokenizer import token_id_string
from protocol.enums import FinishReason

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
"""llama.cpp's sampling defaults (``common_params_sampling``), used where the body gives none."""

_NO_SEED = (-1, 0xFFFFFFFF)
"""llama.cpp's "random seed" values (``LLAMA_DEFAULT_SEED`` is 0xFFFFFFFF)."""


class LlamaBody(LlamaFields):
    """The fields of every llama.cpp native generation body (see the module docstring; llama.cpp's
    other samplers, probabilities, logit bias and grammars: :class:`gateway.llama_fields.LlamaFields`)."""

    model: str | None = None
    n_predict: int | None = None
    stream: Annotated[bool, NULL_IS_DEFAULT] = False
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
    return_tokens: bool | None = None  # (the route's: :meth:`LlamaEndpoint.show_tokens`)


_SAMPLING_PARAMS = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "temperature": "temperature", "seed": "seed",
                    "stop": "stop", "repetition_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                    "max_tokens": "n_predict", "frequency_penalty": "frequency_penalty", "priority": "priority",
                    "timeout_s": "timeout_s", "logprobs": "n_probs", "logit_bias": "logit_bias"}
"""A request field named by an error -> the body's field, for the fields every llama.cpp body shares."""

_SAMPLING_WORDS = ((r"max_tokens", "n_predict"), (r"repetition_penalty", "repeat_penalty"), (r"logprobs", "n_probs"))
"""The request's fields the bodies name otherwise, wherever an error's message names them
(:func:`gateway.errors.reworded`)."""


def sampling_options(body: LlamaBody) -> dict[str, Any]:
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
    opts.update(sampler_overrides(body))  # (samplers left out, repeat_last_n 0: off)
    return opts


def generation_settings(body: LlamaBody, n_predict: int) -> dict[str, Any]:
    """llama.cpp's ``generation_settings`` (an answer's) and ``default_generation_settings.params``
    (``GET /props``, of an empty body): the sampling the request runs with, llama.cpp's names and
    defaults; ``n_predict`` the budget it runs with (-1: until a stop or the context)."""
    opts = sampling_options(body)
    return {"n_predict": n_predict, "seed": opts.get("seed", _NO_SEED[1]), "temperature": opts["temperature"],
            "top_k": opts["top_k"], "top_p": opts["top_p"], "min_p": opts["min_p"],
            "repeat_penalty": opts.get("repetition_penalty", 1.0),
            "presence_penalty": opts.get("presence_penalty", 0.0),
            "frequency_penalty": opts.get("frequency_penalty", 0.0), "stop": body.stop or [],
            "max_tokens": n_predict, "ignore_eos": bool(body.ignore_eos), "stream": body.stream,
            "n_probs": body.n_probs or 0, "grammar": body.grammar or "", "mirostat": 0, "typical_p": 1.0,
            "min_keep": 0, "repeat_last_n": -1 if body.repeat_last_n is None else body.repeat_last_n}


class Budget:
    """How many tokens a request runs with: ``max_tokens`` (>= 1), whether the context left after the
    prompt may lower it (``clamp``: a default, not the caller's), and whether the output is dropped
    (``hidden``: llama.cpp's ``n_predict`` 0, the prompt evaluated and nothing generated shown)."""

    __slots__ = ("max_tokens", "clamp", "hidden")

    def __init__(self, max_tokens: int, clamp: bool = False, hidden: bool = False) -> None:
        self.max_tokens, self.clamp, self.hidden = max_tokens, clamp, hidden


class LlamaEndpoint:
    """One llama.cpp native generation route (:meth:`handle`), sharing the generation endpoints' link,
    metrics and drain (``generate``). A route says its body (``schema``), the body field a refusal of
    the prompt names (``prompt_param``), the fields its errors rename (``params``, ``words``), and
    what it submits (:meth:`prompts`, :meth:`budget`)."""

    schema: ClassVar[type[LlamaBody]] = LlamaBody
    prompt_param: ClassVar[str] = "prompt"
    params: ClassVar[dict[str, str]] = _SAMPLING_PARAMS
    words: ClassVar[tuple[tuple[str, str], ...]] = _SAMPLING_WORDS

    def __init__(self, generate: Generate, clock: Callable[[], float] = time.monotonic) -> None:
        self.gen = generate
        self.clock = clock  # (t_max_predict_ms's: seconds, monotonic; tests pass a fake one)

    async def prompts(self, body: LlamaBody, model: str) -> list[tuple[str | list[int], str, dict[str, Any]]]:
        """Per prompt: ``(prompt, its text as the answer's "prompt" shows it, the request's options)``."""
        raise NotImplementedError

    def prompt_count(self, body: LlamaBody) -> int:
        """How many prompts (one request each) ``body`` gives, read before :meth:`prompts` tokenises them."""
        return 1

    def budget(self, body: LlamaBody, info) -> Budget:
        """The body's ``n_predict`` as a :class:`Budget` (``info``: the model's ``ModelInfo`` or None):
        N >= 1 at most N tokens; 0 the prompt evaluated (and cached) and nothing shown (llama.vscode's
        and llama.vim's prefetch sends it to ``/infill``), one token generated and dropped; -1 or absent
        the route's default (:meth:`default_budget`)."""
        n = body.n_predict
        if n is None or n < 0:
            return self.default_budget(info)
        return Budget(1, hidden=True) if n == 0 else Budget(n)

    def default_budget(self, info) -> Budget:
        """The budget of ``n_predict`` -1 or absent (``info``: the model's ``ModelInfo`` or None)."""
        raise NotImplementedError

    async def handle(self, request: Request) -> Response:
        gen = self.gen
        call = _Call(request.scope["path"], Signal(asyncio.get_running_loop()))
        gen.metrics.in_flight.inc()
        try:
            if gen.drain.draining:
                raise shutting_down(REFUSED)
            gen.drain.add(call)
            body = await call.guard(parse_body(request, self.schema, gen.config.max_body_bytes,
                                               also=LLAMA_BODY_TYPES))
            call.model = await call.guard(self._model(body))
            texts = await call.guard(self._submit(body, call))
            await wait_for(request, call, lambda: all(g.finished or (body.stream and g.handle.first_token_s is not None)
                                                      for g in call.gens))
            self._raise_failure(call.gens)
            if body.stream:
                call.streaming = True
                return _EventStream(self._events(call, body, texts), lambda: gen._end(call))
            gen._observe(call, 200)
            out = [_fields(self._final(call, g, body, texts[g.index], streamed=False), body.response_fields)
                   for g in call.gens]
            return json_response(out[0] if len(out) == 1 else out)
        except APIError as e:
            gen._observe(call, e.status)
            return error_response(e)
        except (ClientGone, ClientDisconnect):
            gen._observe(call, 499)
            return Response(status_code=499)
        finally:
            if not call.streaming:
                gen._end(call)

    async def _model(self, body: LlamaBody) -> str:
        """The model the body names, else the one served (400 when several are, 503 when none is)."""
        return await resolve_model(self.gen.link, body.model)

    async def _submit(self, body: LlamaBody, call: _Call) -> list[str]:
        """Submit one request per prompt; the prompts' texts (the answers' ``prompt``)."""
        gen = self.gen
        refused = refusal(body)
        if refused is not None:
            raise refused
        count = self.prompt_count(body)  # (before any is tokenised: a body of a million prompts is refused at once)
        if count > gen.config.max_choices:
            raise bad_request(f"{count} prompts; at most {gen.config.max_choices} per HTTP request", self.prompt_param)
        client = call.client = await gen.link.client_for(call.model)
        budget = self.budget(body, gen.link.model_info(call.model))
        prompts = await self.prompts(body, call.model)
        more = await self._options(body, call)
        extra = {"clamp_max_tokens": True} if budget.clamp else {}
        call.prompts = len(prompts)
        try:
            info = gen.link.model_info(call.model)
            limited = not budget.hidden and LineLimits.active(body.n_indent, body.t_max_predict_ms) and \
                (info is None or info.has_tokenizer)  # (no text, nothing to judge)
            for i, (prompt, _, options) in enumerate(prompts):
                if limited:  # (n_indent, t_max_predict_ms: judged as the text comes, the rest cancelled)
                    g = LimitedGeneration(i, call.signal, LineLimits(body.n_indent or 0, body.t_max_predict_ms or 0,
                                                                     self.clock), body.stream)
                    watch = {"on_token": g.on_token, "on_text": g.on_text}
                else:
                    g = Generation(i, call.signal, budget.hidden)
                    watch = {"on_token": call.signal.poke if body.stream else None}
                call.gens.append(g)
                g.handle = client.submit_request(prompt, budget.max_tokens, g.on_end, **watch,
                                                 **options, **more, **extra)
                if limited:
                    g.arm(lambda rid=g.handle.request_id: client.cancel(rid))
        except ValueError as e:
            call.gens.pop()  # the one that was refused (nothing was sent for it)
            raise self._renamed(from_value_error(e, self.prompt_param), str(e)) from None
        except RuntimeError as e:  # the client was closed: the gateway is stopping
            call.gens.pop()
            raise unavailable(f"the gateway is stopping ({e})") from None
        return [text for _, text, _ in prompts]

    async def _options(self, body: LlamaBody, call: _Call) -> dict[str, Any]:
        """The request options of ``n_probs`` (``logprobs``), ``logit_bias`` and ``json_schema`` or
        ``grammar`` (``structured``): :mod:`gateway.llama_fields`. Loads ``call.tokenizer`` when the
        answer shows token strings or a bias gives a text."""
        opts: dict[str, Any] = {}
        bias = body.logit_bias
        if body.n_probs or gives_text(bias):
            call.tokenizer = await self.gen.tokenizers.get(self.gen.link.served_name(call.model))
        if body.n_probs:
            opts["logprobs"] = body.n_probs
        if bias is not None:
            tok = call.tokenizer
            encode = None if tok is None else (lambda text: tok.encode(text, add_special_tokens=False))
            try:
                biases = await TOKENIZER_THREADS.run(logit_bias, bias, encode)
            except ValueError as e:  # (the tokenizer's refusal of a text)
                raise bad_request(f"logit_bias: {e}", "logit_bias") from None
            if biases:
                opts["logit_bias"] = biases
        opts.update(structured_option(body))
        return opts

    def _probs(self, call: _Call, tokens: list[int], entries: list | None) -> list[dict]:
        """llama.cpp's ``completion_probabilities`` of ``tokens`` (:func:`gateway.llama_fields.llama_probs`)."""
        tok = call.tokenizer
        token_str = token_id_string if tok is None else tok.token_str
        return llama_probs(tokens, entries or [], token_str, utf8_bytes(token_str) if tok is None else tok.token_bytes)

    def _raise_failure(self, gens: list[Generation]) -> None:
        for g in gens:
            if g.finish_reason is FinishReason.ERROR:
                err = g.error
                if isinstance(err, RemoteError):
                    raise self._renamed(from_remote(err.code, err.message, self.prompt_param), err.message)
                raise APIError(500, f"the request failed: {err}", code="internal")
            if g.finish_reason is FinishReason.CANCELLED:
                raise unavailable("the request was cancelled by slotserve (the gateway is stopping or lost its "
                                  "broker connection); retry")

    def _renamed(self, err: APIError, message: str) -> APIError:
        """``err`` with ``param`` as this body names it, and its message naming the body's fields (was:
        "repetition_penalty must be > 0" for ``repeat_penalty``, "max_tokens must be < 2**64" for
        ``n_predict``); ``message``: the refusal's own words."""
        if err.param == "structured":  # (json_schema or grammar made the constraint: "structured gbnf ...")
            said = re.match(r"structured ([a-z_]+)\b", err.message)
            err.param = "grammar" if said is not None and said.group(1) == "gbnf" else "json_schema"
            if said is not None:
                err.message = err.param + err.message[said.end():]
            return err
        err.param = self.params.get(err.param, err.param) if err.param is not None else None
        return reworded(err, self.words)

    async def _events(self, call: _Call, body: LlamaBody, texts: list[str]):
        """llama.cpp's stream: one event per batch of a prompt's new tokens, then its final object
        (no ``[DONE]``); a failure or the gateway ending the call: an error event, last."""
        ended: set[int] = set()
        while True:
            for g in call.gens:
                d = None if g.index in ended else g.take()
                if d is None:
                    continue
                if d.tokens or d.text:
                    event = {"index": g.index, "content": d.text, "tokens": d.tokens, "stop": False, "id_slot": -1,
                             "tokens_predicted": g.streamed_tokens, "tokens_evaluated": g.prompt_tokens or 0}
                    if body.n_probs and d.tokens:
                        event["completion_probabilities"] = self._probs(call, d.tokens, d.logprobs)
                    if body.timings_per_token:
                        event["timings"] = _timings(g, g.streamed_tokens)
                    yield sse(event)
                if d.finished:
                    try:
                        self._raise_failure([g])
                    except APIError as e:
                        self.gen._observe(call, e.status)
                        yield sse(e.body())
                        return
                    ended.add(g.index)
                    yield sse(_fields(self._final(call, g, body, texts[g.index], streamed=True),
                                      body.response_fields))
            if len(ended) == len(call.gens):
                self.gen._observe(call, 200)
                return
            if call.ended is not None:
                e = shutting_down(call.ended)
                self.gen._observe(call, e.status)
                yield sse(e.body())
                return
            await call.signal.wait()

    def show_tokens(self, body: LlamaBody) -> bool:
        """Whether a whole answer's ``tokens`` lists the generated ids (llama.cpp: only with
        ``return_tokens``; a stream's events always carry them)."""
        return bool(body.return_tokens)

    def _final(self, call: _Call, g: Generation, body: LlamaBody, prompt: str, streamed: bool) -> dict:
        h = g.handle
        text = g.text
        prompt_n = g.prompt_tokens or 0
        predicted = len(g.tokens)
        stop_type, word = _stop_type(g)
        info = self.gen.link.model_info(call.model)
        n_ctx = None if info is None else info.max_seq_len
        n_predict = 0 if g.hidden else h.params.max_tokens
        out = {
            "index": g.index, "content": "" if streamed else text,
            "tokens": [] if streamed or not self.show_tokens(body) else g.tokens, "id_slot": 0,
            "stop": True, "model": call.model, "tokens_predicted": predicted, "tokens_evaluated": prompt_n,
            "generation_settings": generation_settings(body, n_predict), "prompt": prompt,
            "has_new_line": "\n" in text,
            "truncated": g.finish_reason is FinishReason.LENGTH and n_ctx is not None and prompt_n + predicted >= n_ctx,
            "stop_type": stop_type, "stopping_word": word, "tokens_cached": prompt_n + predicted,
            "timings": _timings(g, predicted),
        }
        if body.n_probs and not streamed and g.tokens:  # (a stream's events carried them)
            out["completion_probabilities"] = self._probs(call, g.tokens, g.logprobs)
        return out


def _timings(g: Generation, predicted: int) -> dict[str, float]:
    """llama.cpp's ``timings`` of ``g`` with ``predicted`` tokens generated so far (milliseconds; the
    prompt's from submission to the first token, the generation's from then to the end or now)."""
    h = g.handle
    prompt_n = g.prompt_tokens or 0
    cached = g.cached_tokens or 0
    first = h.first_token_s
    end = g.ended_s if g.ended_s is not None else time.monotonic()
    prompt_ms = 1000.0 * (first - h.submitted_s) if first is not None else 0.0
    predicted_ms = 1000.0 * (end - first) if first is not None else 0.0
    return {
        "cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(1, prompt_n - cached),
        "prompt_per_second": 1000.0 * (prompt_n - cached) / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(1, predicted),
        "predicted_per_second": 1000.0 * predicted / predicted_ms if predicted_ms else 0.0,
    }


def _stop_type(g: Generation) -> tuple[str, str]:
    """llama.cpp's ``stop_type`` and ``stopping_word``: ``word`` (a stop string), ``eos`` (a stop
    token), ``limit`` (``n_predict``, the context or ``timeout_s``)."""
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
