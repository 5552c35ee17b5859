"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

- ``/tokenize``: ``{"prompt": str}`` (``add_special_tokens``, default true) or
  ``{"messages": [...]}`` (the chat template, as a chat request's prompt:
  ``add_generation_prompt`` default true, ``add_special_tokens`` default
  false, ``continue_final_message`` (vLLM's: the final message left open, no
  generation prompt; both true is a 400, as there); ``tools`` and ``tool_choice``, an assistant's ``tool_calls`` and
  ``tool`` messages rendered as the chat request renders them, so the
  count is its ``prompt_tokens``), ``model`` optional when one model is
  served, ``return_token_strs``
  -> ``{"count": int, "max_model_len": int | null, "tokens": [int],
  "token_strs": [str] | null}``.
- ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}`` (special
  tokens kept, as vLLM).

Both need the model's tokenizer (:mod:`gateway.tokenizer`); without one
they answer 400 ``unsupported`` saying why. API keys apply as to ``/v1``
(:mod:`gateway.auth`), and so does the body's Content-Type check (plain JSON,
:func:`gateway.generate._check_json_body_headers`). A model no worker serves
is 404 ``model_not_found``, the very answer of ``/v1`` (its message lists the names a request
may give, :meth:`gateway.link.BrokerConnections.model_not_found`), even when the gateway has one
``--tokenizer`` for every model or serves only models on demand, none loaded; a model it knows
without a worker now answers with the tokenizer it had, else 503. Errors are OpenAI-shaped
(:mod:`gateway.errors`).

The tokenizer's work (encoding, the chat template, decoding, the id checks)
runs on a thread, never on the event loop: a body of several MB takes
seconds to tokenize (a 7 MB text: 12-39 s), and on the loop every other
request's stream would stall that long (measured: 39 s without a token). The
thread is one of :data:`gateway.threads.TOKENIZER_THREADS` (daemon threads):
a gateway that stops does not wait for the work of a request it answered 503.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request, from_value_error
from gateway.link import BrokerConnections, resolve_model
from gateway.options import chat_ending_option, chat_messages, template_option
from gateway.responses import error_response, json_response
from gateway.schemas import DetokenizeRequest, TokenizeRequest
from gateway.threads import TOKENIZER_THREADS
from gateway.tokenizer import Tokenizer, Tokenizers
from gateway.tools import render_messages, tool_plan
from protocol.request import ChatMessage
from protocol.tools import check_tool_calls

MAX_BODY_BYTES = 8 * 1024 * 1024


class TokenizeEndpoints:
    """The two handlers, over the gateway's broker link (the served models, their context) and tokenizers."""

    def __init__(self, link: BrokerConnections, tokenizers: Tokenizers, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.link = link
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._parse(request, TokenizeRequest)
            model, ids, strs = await self.tokens(body)
            info = self.link.model_info(model)
            out = {"count": len(ids), "max_model_len": None if info is None else info.max_seq_len, "tokens": ids,
                   "token_strs": strs}
            return json_response(out)
        except APIError as e:
            return error_response(e)

    async def tokens(self, body: TokenizeRequest) -> tuple[str, list[int], list[str] | None]:
        """``(model, ids, token strings or None)`` of a ``/tokenize`` body (also Anthropic's
        ``count_tokens``, :mod:`gateway.messages_api`); :class:`APIError` for what it refuses."""
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give one of prompt (text) or messages (a chat)",
                              "prompt" if body.prompt is None else "messages")
        model, tok = await self._tokenizer(body.model)
        if body.prompt is not None and (body.add_generation_prompt is not None
                                        or body.continue_final_message is not None):
            field = "add_generation_prompt" if body.add_generation_prompt is not None else "continue_final_message"
            raise bad_request(f"{field} applies to messages, not prompt", field)
        chat_ending_option(body)  # (both true: vLLM's 400)
        if body.prompt is not None and (body.tools is not None or body.tool_choice is not None
                                        or body.chat_template_kwargs is not None):
            field = next(f for f in ("tools", "tool_choice", "chat_template_kwargs") if getattr(body, f) is not None)
            raise bad_request(f"{field} applies to messages, not prompt", field)
        messages, tools, extra = None, None, None
        if body.messages is not None:  # the chat as a chat request's: its checks, its tools, the worker's dicts
            messages = _worker_messages(render_messages(chat_messages(body), body.messages))
            # (a final message with calls, continued or not, is refused there: its calls are unanswered)
            plan = tool_plan(body)
            tools = None if plan is None else plan.definitions()
            text = template_option(body).get("chat_template_kwargs")
            extra = None if text is None else json.loads(text)
        info = self.link.model_info(model)
        template = getattr(info, "chat_template", "") or ""  # (the worker's --chat-template: it renders with that)
        try:
            ids, strs = await TOKENIZER_THREADS.run(_tokenize, tok, body, messages, tools, extra, template)
        except ValueError as e:
            raise from_value_error(e, "prompt" if body.prompt is not None else "messages") from None
        return model, ids, strs

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._parse(request, DetokenizeRequest)
            model, tok = await self._tokenizer(body.model)
            info = self.link.model_info(model)
            vocab = None if info is None else info.vocab_size
            return json_response({"prompt": await TOKENIZER_THREADS.run(_detokenize, tok, body.tokens, vocab)})
        except APIError as e:
            return error_response(e)

    async def _parse(self, request: Request, schema):
        from gateway.generate import parse_body

        return await parse_body(request, schema, self.max_body_bytes)

    async def _tokenizer(self, model: str | None) -> tuple[str, Tokenizer]:
        """The model a request names (or the one served) and its tokenizer; 400/404/503 else."""
        await self.link.first_contact()  # (a gateway that just started: what is served is not known yet)
        served = self.link.served()
        if not served and self.link.broker_ok is False and self.tokenizers.name is None:
            raise self.link.no_broker()
        own = model is None and not served and self.tokenizers.name is not None
        if own:  # (the gateway's own tokenizer, while no worker serves a model)
            model = self.tokenizers.name
        elif model is None:
            model = await resolve_model(self.link, None)  # (the one model, loaded or not; else 400/503)
        if not own and model not in served:
            # (refreshed first: the last poll may predate the model's first worker, as client_for does)
            status = await self.link.refresh()
            if model not in self.link.served(status):
                return model, self._unserved(model, status)
        tok = await self.tokenizers.get(self.link.served_name(model))
        if tok is None:
            raise bad_request(f"/tokenize and /detokenize need the model's tokenizer, and "
                              f"{self.tokenizers.why_none(model)}", "model", "unsupported")
        return model, tok

    def _unserved(self, model: str, status) -> Tokenizer:
        """The tokenizer of ``model``, which no worker serves in ``status``: the 404 that generation
        answers for a name ``status`` does not know (with the same list of names); for a known model
        (on demand and not loaded, or loading), the tokenizer it had already, else 503 saying why.
        None is looked up by name here: its worker has not told its names yet, and a failed lookup
        would stay cached."""
        if not self.link.knows(model, status):
            raise self.link.model_not_found(model, status)
        tok = self.tokenizers.loaded(self.link.served_name(model))  # (one it had before stays)
        if tok is not None:
            return tok
        raise self.link.no_worker(model, status)  # (loading, a model on demand not loaded, or none now)


def _worker_messages(messages: list[dict]) -> list[dict]:
    """Checked chat messages (:func:`gateway.tools.render_messages`) as the worker hands them to the
    chat template: :meth:`protocol.request.ChatMessage.template_dict` (a call's arguments a mapping)."""
    return [ChatMessage(m["role"], m["content"], check_tool_calls(m.get("tool_calls"), f"messages.{i}.tool_calls"),
                        m.get("tool_call_id", ""), m.get("name", "")).template_dict() for i, m in enumerate(messages)]


def _tokenize(tok: Tokenizer, body: TokenizeRequest, messages: list[dict] | None,
              tools: list[dict] | None = None, template_kwargs: dict | None = None,
              template: str = "") -> tuple[list[int], list | None]:
    """``/tokenize``'s ids and (``return_token_strs``) token strings (on a thread), a chat rendered
    with ``template`` (the worker's ``--chat-template``; ``""``: the tokenizer's). ValueError as the tokenizer."""
    if messages is None:
        ids = tok.encode(body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
    else:
        cont = bool(body.continue_final_message)  # (no generation prompt then, unless asked: chat_ending_option)
        ids = tok.chat(messages, body.add_generation_prompt is not False and not cont, bool(body.add_special_tokens),
                       tools, template_kwargs, template, continue_final_message=cont)
    return ids, ([tok.token_str(t) for t in ids] if body.return_token_strs else None)


def _detokenize(tok: Tokenizer, tokens: list[int], vocab: int | None) -> str:
    """``/detokenize``'s text (on a thread): 400 naming the first id outside [0, vocab), or one the
    tokenizer cannot decode."""
    if tokens and (min(tokens) < 0 or (vocab is not None and max(tokens) >= vocab)):
        i, t = next((i, t) for i, t in enumerate(tokens) if t < 0 or (vocab is not None and t >= vocab))
        raise bad_request(f"tokens[{i}] is {t}: token ids are in [0, {vocab})" if vocab
                          else f"tokens[{i}] is {t}: token ids are >= 0", "tokens")
    try:
        return tok.decode(tokens)
    except Exception as e:  # noqa: BLE001 -- an id the tokenizer does not know
        raise bad_request(f"tokens cannot be decoded: {e}", "tokens") from None
