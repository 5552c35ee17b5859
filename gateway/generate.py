"""The generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

One HTTP request becomes prompts x ``n`` slotserve requests on the model's
shared client (:class:`~gateway.link.BrokerConnections`); the answer is one JSON
body, or server-sent events ending with ``data: [DONE]``.

A client that disconnects cancels its requests: while the answer is pending
a watcher waits for the ASGI ``http.disconnect``; once a stream is under way,
Starlette's ``StreamingResponse`` cancels the stream on it, and the stream's
end cancels whatever still runs. Either way the slots are freed on the
worker's next iteration.

While the gateway stops (:mod:`gateway.drain`) a new request is refused with
503 before its body is read; one in flight is in the drain's registry from
its start to its end, and when the drain ends it (:meth:`_Call.end`) it
answers 503, or its stream sends what it has, a final error event and
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from email.message import Message

from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from client import RemoteError
from gateway.config import GatewayConfig
from gateway.drain import REFUSED, Drain, unless_ended
from gateway.errors import APIError, bad_request, from_remote, from_value_error, reworded, shutting_down, \
    unavailable, unsupported
from gateway.generation import Generation, Signal
from gateway.link import BrokerConnections, resolve_model
from gateway.metrics import GatewayMetrics
from gateway.options import chat_messages, for_choice, model_eos, request_options
from gateway.responses import ChunkBodies, ResponseBuilder, cached_tokens, error_response, finish_reason, \
    json_response, prompt_tokens, usage
from gateway.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from gateway.structured import field_of
from gateway.reasoning import PARSERS as REASONING_PARSERS, continued_parser, split_reasoning, think_stream
from gateway.split_stream import SplitStream
from gateway.tool_parsers import AUTO, DEFAULT as DEFAULT_TOOL_PARSER, detect_parser
from gateway.tools import ToolPlan, apply_tool_calls, render_messages, stream_choices, tool_plan
from gateway.tokenizer import Tokenizer, Tokenizers, token_id_string
from gateway.translation import Translation, parse_body as validated_body
from protocol.chat import ContentError, content_text
from protocol.enums import FinishReason
from protocol.validation import echo

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default ``max_tokens`` for ``/v1/completions``."""


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


WATCH_AFTER_S = 0.005
"""A pending answer's disconnect watcher starts this late (seconds): most short
requests are answered before, and a timer costs far less than a task."""


class _Watch:
    """Watches one HTTP request for ``http.disconnect`` (from ``WATCH_AFTER_S``
    on) and wakes ``signal`` when it comes; ``gone`` is then True."""

    __slots__ = ("gone", "_timer", "_task")

    def __init__(self, request: Request, signal: Signal) -> None:
        self.gone = False
        self._task: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start, request, signal)

    def _start(self, request: Request, signal: Signal) -> None:
        self._task = asyncio.ensure_future(self._run(request, signal))

    async def _run(self, request: Request, signal: Signal) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        signal.set()

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


class _Call:
    """One generation HTTP request being served (its generations, clocks and metrics labels)."""

    __slots__ = ("endpoint", "t0", "model", "client", "gens", "signal", "prompts", "streaming", "observed", "ended",
                 "tokenizer", "tools", "_ended")

    def __init__(self, endpoint: str, signal: Signal) -> None:
        self.endpoint = endpoint
        self.ended: str | None = None  # why the gateway ended it (it is stopping), once it did
        self._ended = asyncio.Event()  # (set with ended: wakes guard())
        self.client = None
        self.streaming = False  # True once an event stream owns the call (it cancels and observes at its end)
        self.observed = False
        self.t0 = time.monotonic()
        self.model: str | None = None
        self.gens: list[Generation] = []
        self.signal = signal
        self.prompts = 0
        self.tokenizer: Tokenizer | None = None  # the model's, when the answer shows token strings or an echo
        self.tools: ToolPlan | None = None  # a chat request's tools (gateway.tools)

    def ttft_s(self) -> float | None:
        firsts = [g.handle.first_token_s for g in self.gens if g.handle.first_token_s is not None]
        return min(firsts) - self.t0 if firsts else None

    def cancel(self) -> None:
        for g in self.gens:
            if not g.finished:
                self.client.cancel(g.handle.request_id)

    def end(self, message: str) -> None:
        """The abort event (:class:`gateway.drain.AbortableCall`): the gateway is stopping and ends
        this call; its waits wake and it answers 503, or its stream ends with an error event."""
        if self.ended is None:
            self.ended = message
            self._ended.set()
            self.signal.set()

    def check_ended(self) -> None:
        """Raise the 503 of a call the gateway ended."""
        if self.ended is not None:
            raise shutting_down(self.ended)

    async def guard(self, aw):
        """``aw``'s result, unless the gateway ends this call first: then ``aw`` is cancelled and the
        call's 503 raised (:func:`gateway.drain.unless_ended`). For what the call awaits before it
        watches its signal (:func:`wait_for`): the body, the broker link, the tokenizer's work."""
        self.check_ended()
        done, result = await unless_ended(aw, self._ended)
        if not done:
            raise shutting_down(self.ended)
        return result


class Generate:
    """The generation handlers (bound to one :class:`BrokerConnections` and the gateway's metrics)."""

    def __init__(self, config: GatewayConfig, link: BrokerConnections, metrics: GatewayMetrics,
                 drain: Drain | None = None, tokenizers: Tokenizers | None = None) -> None:
        self.config = config
        self.link = link
        self.metrics = metrics
        self.tokenizers = Tokenizers(None) if tokenizers is None else tokenizers
        self.drain = Drain() if drain is None else drain  # the app's, which its server stops; else one never stopped

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def translated(self, request: Request, translation: Translation) -> Response:
        """Serve ``request`` of another vendor's API on the chat path: ``translation`` turns its body
        into a chat request, and the chat answer, stream or error into its own shapes
        (:mod:`gateway.translation`)."""
        return await self._generate(request, ChatCompletionRequest, translation)

    async def _generate(self, request: Request, schema: type[_Sampling], tr: Translation | None = None) -> Response:
        call = _Call(request.scope["path"], Signal(asyncio.get_running_loop()))
        self.metrics.in_flight.inc()
        try:
            if self.drain.draining:
                raise shutting_down(REFUSED)
            self.drain.add(call)
            body = await call.guard(self._parse(request, schema, tr))
            call.model = body.model
            if isinstance(body, ChatCompletionRequest):
                call.tools = tool_plan(body, await call.guard(self._tool_parser(body)))
            if tr is not None:
                tr.check_reasoning(self._reasoning_parser(body))
            if body.stream:
                return await self._start_stream(request, body, call, tr)
            await call.guard(self._submit(body, call, stream=False))
            await wait_for(request, call, lambda: all(g.finished for g in call.gens))
            self._raise_failure(call, body)  # one choice failed: the answer is its error, the others are cancelled
            out = self._response_builder(body, call).completion(call.gens, call.prompts)
            self._observe(call, 200)
            parser = self._reasoning_parser(body) if isinstance(body, ChatCompletionRequest) else None
            if parser is not None:
                _split_reasoning(out, parser)  # (tool calls are read in the answer)
            if call.tools is not None:
                out = apply_tool_calls(out, call.tools)
            return json_response(out) if tr is None else tr.answer(out)
        except APIError as e:
            self._observe(call, e.status)
            return error_response(e) if tr is None else tr.error(e)
        except (ClientGone, ClientDisconnect):
            self._observe(call, 499)
            return Response(status_code=499)
        finally:
            if not call.streaming:
                self._end(call)

    def _observe(self, call: _Call, status: int) -> None:
        """Record the call's answer in the metrics (once)."""
        if call.observed:
            return
        call.observed = True
        if status == 200:
            self.metrics.observe(call.endpoint, 200, call.ttft_s(), time.monotonic() - call.t0, call.model,
                                 prompt_tokens(call.gens, call.prompts), sum(g.completion_tokens for g in call.gens),
                                 cached_tokens(call.gens, call.prompts))
        else:
            self.metrics.observe(call.endpoint, status)

    def _end(self, call: _Call) -> None:
        """The call is over, however it ended: cancel what still runs (a no-op for
        finished requests), count an unanswered call as 499, leave the drain's registry."""
        # counted before the cancel: once the broker sees the requests end, the metrics already say so
        self.metrics.in_flight.dec()
        self._observe(call, 499)
        call.cancel()
        self.drain.discard(call)

    async def _parse(self, request: Request, schema: type[_Sampling], tr: Translation | None = None) -> _Sampling:
        body = await parse_body(request, schema, self.config.max_body_bytes, None if tr is None else tr.chat_body)
        name = body.unsupported()
        if name is not None:
            raise unsupported(name, f"'{name}' is not supported by slotserve; leave it out")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if body.model is None:  # the one model served (400 naming them when several are)
            body.model = await resolve_model(self.link, None)
            if tr is not None:
                tr.resolved(body.model)
        return body

    def _response_builder(self, body: _Sampling, call: _Call, builder: type[ResponseBuilder] = ResponseBuilder
                          ) -> ResponseBuilder:
        tok = call.tokenizer
        return builder(body.model, chat=isinstance(body, ChatCompletionRequest),
                       token_str=token_id_string if tok is None else tok.token_str,
                       echo=bool(getattr(body, "echo", False)),
                       prompt_logprobs=body.prompt_logprobs is not None,
                       token_bytes=None if tok is None else tok.token_bytes)

    async def _submit(self, body: _Sampling, call: _Call, stream: bool) -> None:
        """Submit every choice of ``body`` (prompts x n) on the model's shared client."""
        chat = isinstance(body, ChatCompletionRequest)
        prompt_param = "messages" if chat else "prompt"
        prompts = [render_messages(chat_messages(body), body.messages)] if chat else body.prompts()
        n = body.choices_per_prompt
        if len(prompts) * n > self.config.max_choices:
            raise bad_request(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} requests; at most "
                              f"{self.config.max_choices} per HTTP request",
                              "n" if n > 1 else prompt_param)  # (the field that made it too many)
        client = call.client = await self.link.client_for(body.model)
        info = self.link.model_info(body.model)
        options = request_options(body, info)
        eos_ids = model_eos(body, info)
        if call.tools is not None and call.tools.constraint is not None:  # tool_choice required or named
            if "structured" in options:
                raise bad_request("tool_choice required or a named function constrains the output; give no "
                                  "response_format with it", "tool_choice")
            options["structured"] = call.tools.constraint
        if call.tools is not None:
            options["tools"] = call.tools.definitions()
        parser = self._reasoning_parser(body) if chat else None
        if parser is not None and "structured" in options and not (call.tools is not None and call.tools.thinks):
            # the constraint holds the answer, after the thinking (harmony's tool grammar holds both)
            options["structured"] = options["structured"]._replace(think=parser)
        max_tokens = self._max_tokens(body, info)
        if _default_budget(body):  # a default, not the caller's: what the context leaves after the prompt lowers it
            options["clamp_max_tokens"] = True
        hidden = max_tokens == 0  # max_tokens 0 with echo: one token generated and dropped
        if hidden:
            max_tokens = 1
        shown = await self._shown_prompts(body, call, prompts, options)
        on_token = call.signal.poke if stream else None
        call.prompts = len(prompts)
        try:
            for i, prompt in enumerate(prompts):
                echo_tokens, echo_text = shown[i]
                for c in range(n):
                    g = Generation(i * n + c, call.signal, hidden)
                    g.echo_tokens, g.echo_text, g.eos_ids = echo_tokens, echo_text, eos_ids
                    call.gens.append(g)
                    g.handle = client.submit_request(prompt, max_tokens, g.on_end, on_token=on_token,
                                                     **for_choice(options, c))
        except ValueError as e:
            call.gens.pop()  # the one that was refused (nothing was sent for it)
            raise _said_of_max_tokens_0(_body_field(from_value_error(e, prompt_param), body, call), hidden) from None
        except RuntimeError as e:  # the client was closed: the gateway is stopping
            call.gens.pop()
            raise unavailable(f"the gateway is stopping ({e})") from None

    async def _tool_parser(self, body: ChatCompletionRequest) -> str:
        """The tool-call parser of ``body``'s model: the gateway's, or with ``auto`` the one the chat
        template its worker renders with asks for (:func:`gateway.tool_parsers.detect_parser`): the
        worker's ``--chat-template`` (``ModelInfo.chat_template``), else its tokenizer's (the default
        when it has no tokenizer or template; loads the tokenizer once, only for a chat with tools)."""
        parser = self.config.tool_call_parser
        if parser != AUTO or not body.tools or body.tool_choice == "none":
            return parser if parser != AUTO else DEFAULT_TOOL_PARSER
        template = getattr(self.link.model_info(body.model), "chat_template", "")
        if template:
            return detect_parser(template)
        tok = await self.tokenizers.get(self.link.served_name(body.model))
        return detect_parser(getattr(getattr(tok, "hf", None), "chat_template", None))

    async def _shown_prompts(self, body: _Sampling, call: _Call, prompts: list, options: dict) -> list[tuple]:
        """Per prompt: ``(ids, text)``: a token-id prompt's ids (a text or chat prompt's come
        with its prompt logprobs, from the worker that tokenised it: ``handle.prompt``), and
        its text for an echo (a token-id prompt's decoded by the tokenizer; ``""`` without one).
        Loads ``call.tokenizer`` when the answer renders token strings or an echo."""
        chat = isinstance(body, ChatCompletionRequest)
        echo = not chat and bool(body.echo)
        if echo or "logprobs" in options or "prompt_logprobs" in options:
            call.tokenizer = await self.tokenizers.get(self.link.served_name(body.model))
        tok = call.tokenizer
        out = []
        for prompt in prompts:
            if chat or isinstance(prompt, str):
                out.append((None, None if chat else prompt))
            else:
                out.append((list(prompt), ("" if tok is None else tok.decode(prompt)) if echo else None))
        return out

    def _reasoning_parser(self, body: _Sampling) -> str | None:
        """The reasoning parser of a chat answer of ``body.model``: ``--reasoning-parser``'s, else the
        model's own (``ModelInfo.reasoning``, read by its worker from the chat template); None for none.
        For a reply that continues the final message (``continue_final_message``) the parser of where
        that message's text leaves it (:func:`gateway.reasoning.continued_parser`; 400 naming the
        message where it cannot be told)."""
        chosen = self.config.reasoning_parser
        if chosen is None:
            info = self.link.model_info(body.model)
            chosen = getattr(info, "reasoning", "") or None
            if chosen not in REASONING_PARSERS:  # (a worker's word: a newer one may name a parser unknown here)
                return None
        if chosen == "none":
            return None
        if getattr(body, "continue_final_message", None) and body.messages:
            final = body.messages[-1]
            try:
                return continued_parser(chosen, content_text(final.content, final.role))
            except ContentError:  # (refused as the chat's content when the prompt is built)
                return None
            except ValueError as e:
                raise bad_request(str(e), f"messages.{len(body.messages) - 1}") from None
        return chosen

    def _max_tokens(self, body: _Sampling, info) -> object:
        if not isinstance(body, ChatCompletionRequest):
            if body.max_tokens == 0:
                if not body.echo:
                    raise bad_request("max_tokens must be >= 1; 0 is allowed only with echo: true (the prompt "
                                      "alone, e.g. to score it with logprobs)", "max_tokens")
                return 0
            return COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        a, b = body.max_tokens, body.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise bad_request(f"max_tokens ({echo(a)}) and max_completion_tokens ({echo(b)}) disagree; give one",
                              "max_completion_tokens")
        if a is not None or b is not None:
            name, value = ("max_tokens", a) if a is not None else ("max_completion_tokens", b)
            if value < 1:  # (0 too: chat has no echo, so nothing would be shown; OpenAI and vLLM refuse it)
                raise bad_request(f"{name} must be >= 1, got {echo(value)}", name)
            return value
        default = self.config.default_chat_max_tokens
        if info is not None and info.max_seq_len is not None:
            default = max(1, min(default, info.max_seq_len))  # (and at most what the prompt leaves: clamp_max_tokens)
        return default

    def _raise_failure(self, call: _Call, body: _Sampling) -> None:
        """Raise the HTTP error of the first choice that ended in error or was cancelled."""
        prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        for g in call.gens:
            reason = g.finish_reason
            if reason is FinishReason.ERROR:
                err = g.error
                if isinstance(err, RemoteError):
                    e = from_remote(err.code, err.message, prompt_param)  # (a compile error names 'structured')
                    raise _said_of_max_tokens_0(_body_field(e, body, call), g.hidden)
                raise APIError(500, f"the request failed: {err}", code="internal")
            if reason is FinishReason.CANCELLED:
                raise unavailable("the request was cancelled by slotserve (the gateway is stopping or lost "
                                  "its broker connection); retry")

    # ------------------------------------------------------------------ streaming

    async def _start_stream(self, request: Request, body: _Sampling, call: _Call,
                            tr: Translation | None = None) -> Response:
        """Submit, wait until every choice has its first token or has ended, then
        answer: an HTTP error if one failed already, else a stream from there."""
        await call.guard(self._submit(body, call, stream=True))
        await wait_for(request, call, lambda: all(g.finished or g.handle.first_token_s is not None for g in call.gens))
        self._raise_failure(call, body)
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        resp = self._response_builder(body, call, ResponseBuilder if tr is None else ChunkBodies)
        call.streaming = True
        events = self._events(call, resp, include_usage, body, continuous)
        return _EventStream(events if tr is None else tr.events(events), lambda: self._end(call))

    async def _events(self, call: _Call, resp: ResponseBuilder, include_usage: bool, body: _Sampling,
                      continuous: bool = False):
        """The SSE body: for chat, first a role chunk per choice (``{"role":
        "assistant", "content": ""}``, as OpenAI and vLLM); then one chunk per
        choice with news, the usage chunk when asked, then ``[DONE]`` (a
        failure, or the gateway ending the call as it stops: the news so far,
        an error event, then ``[DONE]``). ``continuous`` (vLLM's
        ``continuous_usage_stats``, with ``include_usage``): every chunk, the
        role chunks included, carries the usage so far (the tokens streamed up
        to and including it; null while a text prompt's length is unknown,
        see :func:`gateway.responses.usage`). With tools, each choice's text goes through its
        :class:`~gateway.call_stream.CallStream` (content and tool-call deltas,
        :func:`~gateway.tools.stream_choices`)."""
        tools = {g.index: call.tools.stream() for g in call.gens} if call.tools is not None else None
        parser = self._reasoning_parser(body) if resp.chat else None
        thinks = {g.index: think_stream(parser) for g in call.gens} if parser is not None else None
        if resp.chat or resp.echo:
            for g in call.gens:
                yield resp.chunk([resp.role_choice(g.index) if resp.chat else resp.echo_choice(g)],
                                 usage(call.gens, call.prompts, streamed=True) if continuous else None,
                                 with_usage=include_usage)
        pending = len(call.gens)
        held: dict[int, dict] = {}  # per choice: the token ids and logprobs of deltas that said nothing yet
        while pending:
            for g in call.gens:
                d = g.take()
                if d is None:
                    continue
                if d.finished:
                    pending -= 1
                    if g.finish_reason in _FAILED:
                        try:
                            self._raise_failure(call, body)
                        except APIError as e:
                            self._observe(call, e.status)
                            yield resp.error_event(e)
                            yield resp.done
                            return
                reason = finish_reason(g.finish_reason) if d.finished else None
                stop_reason = g.stop_reason if d.finished else None
                choice = resp.delta_choice(g, d, reason, stop_reason)
                texts = g.handle.text is not None  # (a model without a tokenizer streams token ids alone)
                thought: list[dict] = []
                if thinks is not None:
                    thought, choice = _reasoning_choices(thinks[g.index], choice, d.finished)
                answer = [choice] if tools is None else stream_choices(tools[g.index], choice, d.finished)
                for c in thought + answer:
                    if texts and _says_nothing(c, resp.chat):  # (text held back: a stop string's or a call's start)
                        held[g.index] = _carry(held.get(g.index), c)
                        continue
                    yield resp.chunk([_carry(held.pop(g.index, None), c)],
                                     usage(call.gens, call.prompts, streamed=True) if continuous else None,
                                     with_usage=include_usage)
            if pending:
                if call.ended is not None:
                    e = shutting_down(call.ended)
                    self._observe(call, e.status)
                    yield resp.error_event(e)
                    yield resp.done
                    return
                await call.signal.wait()
        if include_usage:
            yield resp.chunk([], usage(call.gens, call.prompts), with_usage=True)
        yield resp.done
        self._observe(call, 200)


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_end`` however it ends: the last event
    sent, the client gone (Starlette cancels the stream on ``http.disconnect``),
    or the server stopping -- even before the body's generator first ran."""

    def __init__(self, content, on_end) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


_FAILED = (FinishReason.ERROR, FinishReason.CANCELLED)


LLAMA_BODY_TYPES = ("text/plain", "application/x-www-form-urlencoded")
"""The media types llama.cpp's native routes (``/completion``, ``/completions``, ``/infill``) read as
JSON besides ``application/json``, as ``llama-server`` parses any body as JSON: ``curl -d`` without
``-H`` sends the form type, and some editors' HTTP clients ``text/plain``."""


def _check_json_body_headers(headers: Headers, also: tuple[str, ...] = ()) -> str | None:
    """Refuse a body declared as anything but plain JSON (400 ``unsupported_media_type``); ``also``:
    other media types (lower case) read as JSON on this route (:data:`LLAMA_BODY_TYPES`). Returns the
    declared type when it is one of ``also`` (so a body that is no JSON can be told why), else None.

    ``application/json`` passes with any parameters but a charset other than UTF-8 (JSON's encoding,
    RFC 8259 section 8.1: a Latin-1 body was read as UTF-8 and refused as an invalid code point).
    Another type is refused before the body is read, as vLLM does (its
    answer is 400 with "Only 'application/json' is allowed"): ``curl -d``
    sends ``application/x-www-form-urlencoded``, and serving that as JSON
    would hide the client's mistake. A body with no Content-Type at all is
    read as JSON, unlike vLLM: RFC 9110 (section 8.3) lets the recipient
    examine such data, and ``requests.post(url, data=json.dumps(body))``
    sends none; the openai SDK always sends ``application/json``. llama.cpp's
    routes take ``also`` too (``llama-server`` reads any body as JSON, and
    what was written for it sends them); the charset rule holds for those.

    Content-Type is one header (RFC 9110 section 5.3): sent twice, which one
    a proxy or we would read is a guess, so it is refused. A
    ``Content-Encoding`` other than ``identity`` (``gzip``...) is refused too
    (RFC 9110 section 8.4: the server does not decode it): it was read as
    JSON, so a gzipped body got "not valid JSON" and a plain body labelled
    gzip was served.
    """
    types = headers.getlist("content-type")
    if len(types) > 1:
        raise _not_plain_json(f"one Content-Type header, not {len(types)}", also)
    lenient = None
    if types:
        media = types[0].split(";", 1)[0].strip().lower()
        if media != "application/json":
            if media not in also:
                raise _not_plain_json(f"not {echo(types[0])}", also)
            lenient = media
        declared = Message()  # (the standard library reads the parameters: quoting, case, spaces)
        declared["content-type"] = types[0]
        charset = declared.get_param("charset")  # JSON is UTF-8 (RFC 8259 section 8.1): another is refused by name
        if isinstance(charset, str) and charset.lower() not in ("utf-8", "utf8"):
            raise _not_plain_json(f"UTF-8 (JSON's encoding, RFC 8259), not charset {echo(charset)}", also)
    codings = [c.strip().lower() for v in headers.getlist("content-encoding") for c in v.split(",")]
    if any(c not in ("", "identity") for c in codings):
        shown = ", ".join(headers.getlist("content-encoding"))
        raise _not_plain_json(f"uncompressed: Content-Encoding {echo(shown)} is not supported", also)
    return lenient


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: 413 as soon as its Content-Length or the bytes
    read so far say it is larger (a larger body is never held whole in memory)."""
    too_large = APIError(413, f"the request body is over the gateway's limit of {limit} bytes "
                              "(slotserve serve --max-body-bytes)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_for(request: Request, call: _Call, done: Callable[[], bool]) -> None:
    """Wait on ``call``'s signal until ``done()`` or one of its choices failed (the caller answers its
    error); ``call.check_ended()`` at each wake (the gateway ending it as it stops), and
    :class:`ClientGone` once the HTTP client has disconnected (:class:`_Watch`)."""
    watch = _Watch(request, call.signal)
    try:
        while not done() and not _any_failed(call):
            call.check_ended()
            await call.signal.wait()
            if watch.gone:
                raise ClientGone
    finally:
        watch.stop()


async def parse_body(request: Request, schema: type[BaseModel], limit: int, parse=None,
                     also: tuple[str, ...] = ()) -> BaseModel:
    """The request's JSON body as ``schema`` (a pydantic model; ``parse(raw)`` instead when given: a
    translation's own, :mod:`gateway.translation`): 400 for a body declared as anything but JSON or
    one of the media types ``also`` (:func:`_check_json_body_headers`; such a body that is no JSON is
    told it was read as JSON), one ``schema`` refuses or one holding a number no double holds
    (:func:`gateway.translation.parse_body`), 413 past ``limit`` bytes (:func:`read_body`). Every endpoint's
    body is read so."""
    lenient = _check_json_body_headers(request.headers, also)
    raw = await read_body(request, limit)  # (never more than the limit in memory)
    try:
        return validated_body(schema, raw) if parse is None else parse(raw)
    except APIError as e:
        if lenient is not None and e.code == "invalid_json":
            e.message += f" (the body, sent as {lenient}, is read as JSON, as llama.cpp's server reads it)"
        raise


def _not_plain_json(detail: str, also: tuple[str, ...] = ()) -> APIError:
    """The 400 of a body not declared as plain JSON; ``also``: the other media types the route reads
    as JSON (named in the message, as what the route takes too)."""
    takes = "'Content-Type: application/json'"
    if also:  # (a llama.cpp route)
        takes += f" (or {', '.join(also)}, read as JSON as llama.cpp's server reads them)"
    return bad_request(f"the body must be JSON sent as {takes}, {detail} "
                       "(with curl: -H 'Content-Type: application/json')", None, "unsupported_media_type")


def _split_reasoning(completion: dict, parser: str) -> None:
    """A chat completion's choices with their thinking split off (in place): ``message.content`` the
    answer, ``reasoning_content`` and ``reasoning`` (vLLM's older and newer names) the thinking or
    None (:mod:`gateway.reasoning`)."""
    for choice in completion["choices"]:
        message = choice["message"]
        reasoning, answer = split_reasoning(message.get("content") or "", parser)
        message["content"] = answer if answer or reasoning is None else None
        message["reasoning_content"] = message["reasoning"] = reasoning


def _reasoning_choices(think: SplitStream, choice: dict, finished: bool) -> tuple[list[dict], dict]:
    """A chat stream's choice split by ``think``: the reasoning deltas (``reasoning_content`` and
    ``reasoning``), then the choice with the answer's content (and the finish reason); the token ids
    and logprobs ride on the first of them."""
    pieces = think.feed(choice["delta"].get("content", ""))
    if finished:
        pieces += think.finish()
    thought = [{**choice, "delta": {"reasoning_content": t, "reasoning": t}, "finish_reason": None,
                "stop_reason": None} for kind, t in pieces if kind == "reasoning"]
    answer = "".join(t for kind, t in pieces if kind == "content")
    rest = {**choice, "delta": {"content": answer} if answer else {}}
    for c in thought[1:] + ([rest] if thought else []):
        c.update(token_ids=[], logprobs=None)
    return thought, rest


def _says_nothing(choice: dict, chat: bool) -> bool:
    """Whether a stream choice of a model with a tokenizer has no text, no tool call and no finish
    reason: it makes no chunk of its own (issue 33: a chat with tools sent ~17 ``delta: {}`` chunks while text was held back);
    its token ids and logprobs go out with the choice's next chunk (:func:`_carry`)."""
    return choice["finish_reason"] is None and not (choice["delta"] if chat else choice["text"])


def _carry(held: dict | None, choice: dict) -> dict:
    """``choice`` with the token ids and logprobs of ``held`` (earlier choices that said nothing) before
    its own; ``held`` None: ``choice`` itself."""
    if held is None:
        return choice
    out = {**choice, "token_ids": [*held["token_ids"], *choice["token_ids"]]}
    a, b = held["logprobs"], choice["logprobs"]
    if a is not None and b is not None:
        out["logprobs"] = {k: [*a[k], *b[k]] if isinstance(a[k], list) else a[k] for k in a}
    elif a is not None:
        out["logprobs"] = a
    return out


def _default_budget(body: _Sampling) -> bool:
    """Whether the request's ``max_tokens`` is the gateway's default (none given): every such budget
    is a bound the context may lower (``clamp_max_tokens``), never a reason to refuse a prompt that
    fits (issue 33: a chat without max_tokens whose prompt fit was refused for prompt + 1024)."""
    if isinstance(body, ChatCompletionRequest):
        return body.max_tokens is None and body.max_completion_tokens is None
    return body.max_tokens is None


def _said_of_max_tokens_0(e: APIError, hidden: bool) -> APIError:
    """A context-length refusal of a ``max_tokens: 0`` request (run as 1 token, dropped) says so: the
    message's "max_tokens (1)" is not what the caller sent."""
    if hidden and e.code == "context_length_exceeded":
        e.message += ("; max_tokens 0 with echo runs as 1 generated token (dropped), so the prompt may "
                      "hold at most the context minus 1 tokens")
    return e


def _body_field(e: APIError, body: _Sampling, call: _Call) -> APIError:
    """``e`` (returned; changed in place) naming the body's field: the request's ``structured``
    constraint came from the body's structured-output field, or (tool_choice required or named)
    from ``tools``, whose parameters schemas made the grammar (:func:`_grammar_tools` names them),
    and a refusal of it says so in its words too ("structured json_schema does not compile: ..." is
    the worker's; a position in the gateway's own tool grammar is left out); any other param is the
    body's own, and its message names the body's fields (:func:`body_names`), as does its ``param``
    (``max_completion_tokens`` where a chat body gave that one)."""
    names = body_names(body)
    reworded(e, names)
    if e.param is not None:
        e.param = next((given for name, given in names if re.fullmatch(name, e.param)), e.param)
    if e.param != "structured":
        return e
    plan = call.tools if call.tools is not None and call.tools.constraint is not None else None
    e.param = field_of(body) if plan is None else _grammar_tools(plan)
    said = re.match(r"structured [a-z_]+\b", e.message)
    if said and e.param is not None:
        rest = e.message[said.end():]
        if plan is not None:  # (a line and column of the gateway's own grammar, which the client never saw)
            rest = re.sub(r"^ does not compile: at \d+\(\d+\): ", " does not compile: ", rest)
        e.message = e.param + rest
    return e


def body_names(body: _Sampling) -> tuple[tuple[str, str], ...]:
    """The request's field names that ``body`` names otherwise, as :func:`gateway.errors.reworded`'s table
    (each an exact name): ``stop_token`` is ``stop_token_ids``; ``stop`` is shared out into the text
    strings (the request's ``stop[i]``) and the token-id lists (its ``stop_sequences[i]``), each the body's
    ``stop[j]`` at its own place in the list (``stop`` alone when it is one string), and ``stop_sequences``
    alone the token-id lists of ``stop``; ``max_tokens`` is ``max_completion_tokens`` where a chat body gave
    that one. Was: "stop_token contains token id 99999, ..." for ``stop_token_ids``, "stop_sequences[0]
    contains ..." for ``"stop": ["a", [99999]]``."""
    names = {"stop_token": "stop_token_ids", "stop_sequences": "stop"}
    if isinstance(body, ChatCompletionRequest) and body.max_tokens is None and body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    stop = body.stop
    if isinstance(stop, str):
        names["stop[0]"] = "stop"
    elif stop:
        texts = [j for j, entry in enumerate(stop) if isinstance(entry, str)]
        lists = [j for j, entry in enumerate(stop) if not isinstance(entry, str)]
        names.update({f"stop[{i}]": f"stop[{j}]" for i, j in enumerate(texts)})
        names.update({f"stop_sequences[{i}]": f"stop[{j}]" for i, j in enumerate(lists)})
    return tuple((re.escape(name), given) for name, given in names.items())


def _grammar_tools(plan: ToolPlan) -> str:
    """The body field a refusal of ``plan``'s grammar names: the parameters of the one function it
    calls (a named ``tool_choice``, or one tool), else ``tools`` (its schemas are all in it)."""
    names = list(plan.functions)
    if plan.choice != "required":
        return f"tools.{names.index(plan.choice)}.function.parameters"
    return "tools.0.function.parameters" if len(names) == 1 else "tools"


def _any_failed(call: _Call) -> bool:
    return any(g.finished and g.finish_reason in _FAILED for g in call.gens)
