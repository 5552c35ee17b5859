"""The gateway's handlers over a scripted broker client, in process (no sockets, no processes):
the scripted model ``m`` (:data:`VOCAB` tokens, the characters of :data:`LETTERS`, text by
:class:`LetterCodec`), :class:`ScriptedClient` (ends each request on a thread, as the client's
I/O thread does; :class:`RefusingClient` refuses constrained ones as a worker whose grammar does
not compile), :class:`ScriptedLink` (the broker link's stand-in) and the apps of each vendor's
routes on it: :func:`handlers_app` (OpenAI's completions, chat and the tokenizer endpoints),
:func:`messages_app` (Anthropic's Messages, behind the API key :data:`KEY`) and
:func:`responses_app` (OpenAI's Responses). Callers join ``client.threads`` when done."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from client import RemoteError
from client.handle import ClientHandle
from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer, Tokenizers
from protocol.enums import ErrorCode, FinishReason
from protocol.logprobs import TokenLogprob
from protocol.messages import ModelInfo
from protocol.request import ModelLimits, RequestParams

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from gateway.response_store import ResponseStore

KEY = "sk-test-messages"
"""The API key :func:`messages_app` takes (``x-api-key``)."""

VOCAB = 40
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789 .!?"


class LetterCodec:
    """A TextCodec stand-in: token ``i`` is the character ``LETTERS[i]``; id 39 (``?``) is special
    (left out of text unless asked)."""

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise ValueError("prompt text must not be empty")
        return [LETTERS.index(c) for c in text]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Each message as its role's initial, its content and ``.`` (the final one open, without its
        ``.``, when continued), then ``a`` (the generation prompt, unless none is asked for)."""
        text = "".join(f"{m['role'][0]}{m['content']}." for m in messages)
        if continue_final_message:
            return self.encode(text[:-1])
        return self.encode(text + ("a" if add_generation_prompt else ""))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(LETTERS[i] for i in ids if not (skip_special_tokens and i == 39))


def entry(token: int, n: int) -> TokenLogprob:
    """A token's scripted entry: its logprob, and ``n`` alternatives (token+1 first, then the token
    itself, then -inf ones: the chosen token ranks second)."""
    top = [(token + 1) % VOCAB, token] + [(token + 2 + k) % VOCAB for k in range(n)]
    lps = [-0.25, -0.5] + [-math.inf] * n
    return TokenLogprob(-0.5, tuple(zip(top, lps))[:n])


def generated(prompt_ids: list[int], k: int) -> list[int]:
    """The scripted model's output: the prompt's last token + 1, + 2, ..."""
    return [(prompt_ids[-1] + 1 + i) % 39 for i in range(k)]


class ScriptedClient:
    """Ends each request on a thread: ``max_tokens`` tokens (:func:`generated`), finish ``length``,
    the logprobs entries the request asked for, text by :class:`LetterCodec` (``on_token`` and
    ``on_text`` per token). ``limits``: what the
    client checks a request against (default: :data:`VOCAB` tokens, a 64-token context)."""

    def __init__(self, limits: ModelLimits | None = None) -> None:
        self.threads: list[threading.Thread] = []
        self.submitted: list[RequestParams] = []
        self.codec = LetterCodec()
        self.limits = ModelLimits(VOCAB, 64, True) if limits is None else limits

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, on_text=None, **options):
        params = self.limits.build(prompt, max_tokens, **options)  # as the client checks
        self.submitted.append(params)
        h = ClientHandle(len(self.threads), params, callback, on_token, time.monotonic(), None, on_text)
        t = threading.Thread(target=self._run, args=(h,))
        self.threads.append(t)
        t.start()
        return h

    def _run(self, h: ClientHandle) -> None:
        try:
            self._script(h)
        except BaseException as e:  # a broken script fails its request (the test), never hangs it
            h._end(FinishReason.ERROR, None, e, time.monotonic())
            h.callback([])
            h._done = True
            raise

    def _script(self, h: ClientHandle) -> None:
        p = h.params.prompt
        ids = list(p) if h.params.is_token_prompt else (
            self.codec.encode(p) if isinstance(p, str) else self.codec.apply_chat_template(
                [m._asdict() for m in p], add_generation_prompt=h.params.generation_prompt,
                continue_final_message=h.params.continue_final_message))
        h._prompt_tokens = len(ids)
        if h.params.prompt_logprobs is not None:
            h.prompt_logprobs = [None] + [entry(t, h.params.prompt_logprobs) for t in ids[1:]]
            if not h.params.is_token_prompt:
                h._prompt_ids = ids  # the worker's tokens of a text or chat prompt come with its logprobs
        h.first_token_s = time.monotonic()
        for t in generated(ids, h.params.max_tokens):
            if h.logprobs is not None:
                h.logprobs.append(entry(t, h.params.logprobs))
            h._tokens.append(t)
            h._text.append(self.codec.decode([t]))
            if h.on_token is not None:
                h.on_token(t)
            if h.on_text is not None:  # (after its token, as the client delivers them)
                h.on_text(h._text[-1])
        h._end(FinishReason.LENGTH, None, None, time.monotonic())
        h.callback((h.prompt or []) + h.tokens)
        h._done = True

    def cancel(self, request_id) -> None:
        pass


class ScriptedLink:
    """A stand-in for :class:`gateway.link.BrokerConnections`: one model ``m``."""

    broker_ok = True
    config = GatewayConfig()

    def __init__(self, client: ScriptedClient) -> None:
        self.client = client

    async def first_contact(self) -> None:  # (the broker has answered)
        pass

    async def client_for(self, model: str) -> ScriptedClient:
        return self.client

    def model_info(self, model: str) -> ModelInfo:
        return ModelInfo(vocab_size=VOCAB, max_seq_len=64, eos_token_ids=(39,), has_tokenizer=True)

    def served(self, status=None) -> dict:
        return {"m": 1}

    def only_model(self, status=None) -> str:
        return "m"

    def served_name(self, model: str) -> str:
        return model


def letters(name: str) -> Tokenizer | None:
    """The tokenizers' loader of the scripted model: :class:`LetterCodec` for ``m``, none for any other."""
    return Tokenizer(LetterCodec()) if name == "m" else None


class RefusingClient(ScriptedClient):
    """The scripted client, except that a request with a ``structured`` constraint ends ``error``
    ``bad_request`` before its first token with the worker's ``words`` (what a worker whose grammar
    does not compile answers)."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def _script(self, h: ClientHandle) -> None:
        if h.params.structured is None:
            return super()._script(h)
        h._end(FinishReason.ERROR, None, RemoteError(ErrorCode.BAD_REQUEST, self.words), time.monotonic())
        h.callback([])
        h._done = True


def handlers_app(tokenizers: Tokenizers, link, config: GatewayConfig | None = None) -> Starlette:
    """The gateway's generation and tokenizer handlers over ``link`` (a stand-in for the broker link)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from gateway.generate import Generate
    from gateway.metrics import GatewayMetrics
    from gateway.tokenize import TokenizeEndpoints

    gen = Generate(config or GatewayConfig(), link, GatewayMetrics(), tokenizers=tokenizers)
    tok = TokenizeEndpoints(link, tokenizers)
    return Starlette(routes=[Route("/v1/completions", gen.completions, methods=["POST"]),
                             Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
                             Route("/tokenize", tok.tokenize, methods=["POST"]),
                             Route("/detokenize", tok.detokenize, methods=["POST"])])


def messages_app(link, config: GatewayConfig) -> Starlette:
    """Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens`` over ``link``, with the
    :func:`letters` tokenizer, behind the API key :data:`KEY`."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from gateway.auth import APIKeys
    from gateway.generate import Generate
    from gateway.messages_api import MessagesEndpoints
    from gateway.metrics import GatewayMetrics
    from gateway.tokenize import TokenizeEndpoints

    tokenizers = Tokenizers(letters)
    gen = Generate(config, link, GatewayMetrics(), tokenizers=tokenizers)
    api = MessagesEndpoints(gen, TokenizeEndpoints(link, tokenizers))
    return Starlette(routes=[Route("/v1/messages", api.create, methods=["POST"]),
                             Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])],
                     middleware=[Middleware(APIKeys, api_keys=(KEY,))])


def responses_app(link, config: GatewayConfig, store: ResponseStore) -> Starlette:
    """OpenAI's ``/v1/responses`` (create, retrieve, delete) over ``link``, without a tokenizer,
    keeping responses in ``store``."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from gateway.generate import Generate
    from gateway.metrics import GatewayMetrics
    from gateway.responses_api import ResponsesEndpoints

    gen = Generate(config, link, GatewayMetrics(), tokenizers=Tokenizers(None))
    api = ResponsesEndpoints(gen, store)
    return Starlette(routes=[Route("/v1/responses", api.create, methods=["POST"]),
                             Route("/v1/responses/{response_id}", api.retrieve, methods=["GET"]),
                             Route("/v1/responses/{response_id}", api.delete, methods=["DELETE"])])
