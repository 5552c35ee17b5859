"""Request bodies without ``model``, one per gateway route that defaults it (path -> body):
:data:`OPENAI_AND_VENDOR` for the /v1 routes and /tokenize, :data:`LLAMA_NATIVE` for llama.cpp's
own /completion and /infill. Shared by the tests of what a model-less request is answered
(``tests/gateway/test_model_optional.py``, ``test_no_broker_routes.py``); a test copies a body
before changing it."""

from __future__ import annotations

CHAT = [{"role": "user", "content": "hi"}]

OPENAI_AND_VENDOR = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 8},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 8},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"messages": CHAT, "max_tokens": 8},
    "/v1/messages/count_tokens": {"messages": CHAT},
    "/v1/embeddings": {"input": "hi"},
    "/v1/rerank": {"query": "hi", "documents": ["a", "b"]},
    "/tokenize": {"prompt": "hi"},
}

LLAMA_NATIVE = {
    "/completion": {"prompt": "hi", "n_predict": 8},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):"},
}
