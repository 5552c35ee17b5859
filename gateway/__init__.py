"""The OpenAI-compatible HTTP gateway (``slotserve serve``): one more client of the broker.

    from gateway import GatewayConfig, run
    run(GatewayConfig(broker="tcp://127.0.0.1:5555", port=8000))

:func:`create_app` gives the ASGI app alone (Starlette), for another server.
Layout: :mod:`gateway.app` (the app, plain endpoints), :mod:`gateway.generate`
(completions and chat), :mod:`gateway.translation` (other vendors' APIs on the chat path:
:mod:`gateway.responses_api` with :mod:`gateway.responses_output` and :mod:`gateway.response_store`,
OpenAI's Responses API; :mod:`gateway.messages_api` with :mod:`gateway.messages_output`, Anthropic's
Messages API), :mod:`gateway.schemas` (request
bodies), :mod:`gateway.options` (body fields -> request options, the one
mapping), :mod:`gateway.responses` (bodies, chunks, finish_reason mapping),
:mod:`gateway.errors` (OpenAI's error shape, status codes), :mod:`gateway.auth`
(API keys), :mod:`gateway.logprobs` (token logprobs in OpenAI's shapes),
:mod:`gateway.tokenizer` (the models' tokenizers, from the CLI's loader),
:mod:`gateway.tokenize` (``/tokenize``, ``/detokenize``),
:mod:`gateway.link` (the shared broker connections), :mod:`gateway.generation`
(one request seen from the event loop), :mod:`gateway.metrics`,
:mod:`gateway.drain` (stopping: refuse new requests, let those in flight
finish, end the rest), :mod:`gateway.server` (uvicorn, and the stop sequence) over :mod:`gateway.listen` (its socket).

``run`` and ``create_app`` are imported on first use, so importing the
config (the launcher does) does not load the HTTP stack.
"""

from gateway.config import DEFAULT_BROKER, GatewayConfig

__all__ = ["DEFAULT_BROKER", "GatewayConfig", "create_app", "run"]


def __getattr__(name: str):
    if name == "run":
        from gateway.server import run

        return run
    if name == "create_app":
        from gateway.app import create_app

        return create_app
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
