"""Routes of other servers' own APIs that this gateway does not serve, and what to call instead.

A client written for llama.cpp's ``llama-server`` or for Ollama sends these first (llama.cpp's
``GET /slots``, ``POST /embedding``; Ollama's ``POST /api/chat``); the gateway answers them the 404 of
any unknown route, and :func:`instead` adds the route of its own API that does the same, so the 404
says what to do next. The routes are those of llama.cpp's server README
(``tools/server/README.md``: its non-OpenAI endpoints) and of Ollama's API reference (``docs/api.md``)
that have no route of the same path here (llama.cpp's ``/health``, ``/completion``, ``/completions``,
``/infill``, ``/props``, ``/tokenize``, ``/detokenize``, ``/models``, ``/models/load`` and
``/models/unload`` are served: docs/llama-cpp.md).
"""

from __future__ import annotations

_LLAMA_CPP = "llama.cpp's"
_OLLAMA = ("Ollama's API is not served; its OpenAI-compatible one is, under /v1: POST /v1/chat/completions, "
           "POST /v1/completions, GET /v1/models, POST /v1/embeddings")

_EXACT: dict[str, str] = {
    "/embedding": f"{_LLAMA_CPP} native embedding route is not served: POST /v1/embeddings takes the text as "
                  "input, with an embedding model",
    "/embeddings": f"{_LLAMA_CPP} native embedding route is not served: POST /v1/embeddings takes the text as "
                   "input, with an embedding model",
    "/slots": f"{_LLAMA_CPP} slot states are not served: `slotserve status` shows each model's slots busy / total",
    "/v1/health": "the health check is GET /health",
    "/apply-template": f"{_LLAMA_CPP} template route is not served: POST /tokenize with messages gives the chat's "
                       "token ids",
    "/reranking": "the rerank route is POST /v1/rerank (also /rerank)",
    "/v1/reranking": "the rerank route is POST /v1/rerank (also /rerank)",
}
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("/slots/", f"{_LLAMA_CPP} slot routes are not served: a worker's prefix cache keeps prompts' KV by itself"),
    ("/api/", _OLLAMA),
)


def instead(path: str) -> str | None:
    """What to call instead of ``path`` (a request's URL path, without its query), when it is a
    route of llama.cpp's or Ollama's own API that this gateway does not serve; None for any other
    path. A trailing ``/`` is ignored (``/slots/`` is ``/slots``)."""
    key = path.rstrip("/") or path
    if key in _EXACT:
        return _EXACT[key]
    for prefix, words in _PREFIXES:
        if path.startswith(prefix):
            return words
    return None
