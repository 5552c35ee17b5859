"""API keys: ``Authorization: Bearer KEY`` on ``/v1/*`` (and ``/metrics`` when it has keys of its own).

:class:`APIKeys` is a pure ASGI middleware in front of the routes, so every
``/v1`` path is covered, those added later and unknown ones included (an
unknown ``/v1`` path answers 401 before 404: a caller without a key learns
nothing about the routes). ``/health`` is never checked (probes carry no
key); ``/tokenize``, ``/detokenize``, ``/rerank``, ``/v2/rerank`` (vLLM's paths, outside ``/v1``),
``/infill``, ``/completion``, ``/completions``, ``/props``, ``/models`` and ``/models/*`` (llama.cpp's) as ``/v1``
(``/models`` lists what ``/v1/models`` does, and is guarded as it is);
``/metrics`` only when the gateway has ``metrics_api_keys`` (a
scraper's credential, apart from the API's: a leaked scrape key cannot
generate, an API key cannot read the metrics).

``/v1/messages`` and ``/v1/responses`` (and below them) also take the key as ``x-api-key: KEY``:
the ``anthropic`` SDK's header (Claude Code sends it), accepted on the Responses API too so that one
client configuration serves both. A refusal on ``/v1/messages`` is in Anthropic's error shape
(``authentication_error``, :meth:`gateway.errors.APIError.anthropic_body`).

A refusal is 401 in OpenAI's error shape (``invalid_request_error``,
``invalid_api_key``, as api.openai.com answers a wrong key) with RFC 6750's
``WWW-Authenticate: Bearer``. The key sent is never shown back or logged.

The compare takes the same time whichever key matches, or none: the
presented key and every configured key are hashed to SHA-256 digests (equal
lengths, so the compare does not depend on a key's length either) and the
presented digest is compared with *each* configured one by
``hmac.compare_digest``, the results or-ed with no early exit. vLLM's
``--api-key`` check does the same.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import quote

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import unauthorized
from gateway.responses import error_response, json_response

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeySet:
    """A set of API keys, kept only as SHA-256 digests. ``bool(keys)``: any configured."""

    __slots__ = ("_digests",)

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, presented: str) -> bool:
        """Whether ``presented`` is one of the keys, in a time that does not depend on which."""
        d = _digest(presented)
        ok = False
        for ref in self._digests:
            ok |= hmac.compare_digest(d, ref)  # no early exit: every key is compared
        return ok


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (the scheme is
    case-insensitive, RFC 9110 section 11.1), or None for no header or another scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None  # "Bearer " alone (an SDK given api_key="") is no key


_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/infill", "/completion", "/completions", "/props", "/rerank",
                              "/v2/rerank"})
"""Outside ``/v1`` (vLLM's and llama.cpp's paths, rerank's among them), and guarded by the API keys all the same."""

_ANTHROPIC = "/v1/messages"
_X_API_KEY_PATHS = (_ANTHROPIC, "/v1/responses")
"""The paths (and those below them) that also take the key as ``x-api-key``."""


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def presented_key(path: str, headers: Headers) -> str | None:
    """The key a request presents: its Bearer token, else (on :data:`_X_API_KEY_PATHS`) its
    ``x-api-key`` header; None for neither."""
    token = bearer_token(headers.get("authorization"))
    if token is None and any(_under(path, p) for p in _X_API_KEY_PATHS):
        token = (headers.get("x-api-key") or "").strip() or None
    return token


class APIKeys:
    """The ASGI middleware: checks ``/v1/*`` against ``api_keys`` and ``/metrics``
    against ``metrics_api_keys``; a path whose key set is empty is open."""

    def __init__(self, app: ASGIApp, *, api_keys: tuple[str, ...] = (),
                 metrics_api_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self.api = KeySet(api_keys)
        self.metrics = KeySet(metrics_api_keys)

    def _keys_for(self, path: str) -> tuple[KeySet, str] | None:
        if path == "/v1" or path.startswith("/v1/") or path in _TOKENIZER_PATHS or _under(path, "/models"):
            return self.api, "--api-key"
        if path == "/metrics" or path.startswith("/metrics/"):
            return self.metrics, "--metrics-api-key"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            guard = self._keys_for(scope["path"])
            if guard is not None and guard[0]:
                keys, option = guard
                token = presented_key(scope["path"], Headers(scope=scope))
                if token is None or not keys.accepts(token):
                    await self._refuse(scope, receive, send, token is None, option)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, missing: bool, option: str) -> None:
        client = scope.get("client")
        # the path as sent on the wire (percent-encoded, as uvicorn's access log shows it): a decoded
        # path may hold a newline and forge a log line, and this line is logged for unauthenticated callers
        log.info("401 for %s %s from %s: %s", scope.get("method"), quote(scope["path"]),
                 client[0] if client else "?", "no Bearer key" if missing else "a key that is not valid")
        if missing:
            message = (f"no API key: this gateway needs 'Authorization: Bearer KEY' with a key it was started "
                       f"with ({option}); the openai SDK sends its api_key so"
                       + ("; x-api-key: KEY also works here" if any(_under(scope["path"], p) for p in _X_API_KEY_PATHS)
                          else ""))
        else:
            message = (f"incorrect API key provided (not shown back): send one of the keys this gateway was "
                       f"started with ({option}) as 'Authorization: Bearer KEY'")
        e = unauthorized(message)
        if _under(scope["path"], _ANTHROPIC):  # (the anthropic SDK reads its own shape)
            await json_response(e.anthropic_body(), e.status, e.headers)(scope, receive, send)
            return
        await error_response(e)(scope, receive, send)
