"""``GET /props``: llama.cpp's server properties, from the served model's real values.

llama.cpp's README (``GET /props``) answers, for its one model::

    {"default_generation_settings": {"id", "id_task", "n_ctx", "speculative", "is_processing",
                                     "params": {...}, "prompt": ""},
     "total_slots", "model_alias", "model_path", "chat_template", "chat_template_caps",
     "modalities": {"vision", "audio"}, "build_info", "is_sleeping"}

Here: ``n_ctx`` is the model's context per slot (``--max-model-len``: a worker's ``ModelInfo.max_seq_len``,
0 while unknown), ``params`` the sampling ``/completion`` runs with when a body gives none
(llama.cpp's defaults, ``n_predict`` -1: :func:`gateway.llama_native.generation_settings`),
``is_processing`` whether any of its slots is busy, ``total_slots`` its slots over all its workers (the
broker's status), ``model_alias`` the name asked for, ``model_path`` the model's primary name (what
``slotserve up --model`` was given), ``chat_template`` the Jinja text its worker renders chats with
(its ``--chat-template``, else its tokenizer's; ``""`` when the gateway has no tokenizer for it),
``chat_template_caps`` ``{}``, ``modalities`` all false (text models only), ``build_info``
``"slotserve VERSION"``, ``is_sleeping`` true for a model no worker serves now (a model on demand not
loaded, one whose first worker is loading: a request loads it, as a sleeping llama.cpp model wakes; one
``unloading`` is awake until its last worker has left, as it serves until then).

Which model, as llama.cpp's router mode: ``?model=NAME`` (any name ``GET /v1/models`` lists; another
is the 404 ``model_not_found``); without it, the one model served, or, with several (models on
demand), the router's own answer: ``{"role": "router", "models_autoload", "model_alias":
"slotserve", "model_path": "none", "default_generation_settings": {"params": {}, "n_ctx": 0},
"build_info"}``. 503 while draining, with no broker, or with no model at all. A GET: it loads
nothing, and is not counted in the request metrics (as ``/v1/models``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import Response

from gateway.drain import REFUSED, Drain
from gateway.errors import APIError, shutting_down, unavailable
from gateway.link import BrokerConnections
from gateway.llama_native import LlamaBody, generation_settings
from gateway.responses import error_response, json_response
from gateway.tokenizer import Tokenizers
from protocol.messages import Status


def build_info() -> str:
    """``"slotserve VERSION"`` (the installed distribution's), or ``"slotserve"`` when not installed."""
    try:
        return f"slotserve {version('slotserve')}"
    except PackageNotFoundError:
        return "slotserve"


class PropsEndpoint:
    """The ``/props`` handler (:meth:`props`) over the gateway's broker link, tokenizers and drain."""

    def __init__(self, link: BrokerConnections, tokenizers: Tokenizers, drain: Drain) -> None:
        self.link = link
        self.tokenizers = tokenizers
        self.drain = drain

    async def props(self, request: Request) -> Response:
        try:
            if self.drain.draining:
                raise shutting_down(REFUSED)
            st = await self.link.refresh()
            name = request.query_params.get("model") or None
            if name is None:
                name = self.link.only_model(st)
                if name is None:
                    if not self.link.models(st):
                        raise unavailable("no worker serves a model right now; retry")
                    return json_response(self._router())
            elif name not in self.link.model_states(st):
                raise self.link.model_not_found(name, st)
            return json_response(await self._model(name, st))
        except APIError as e:
            return error_response(e)

    def _router(self) -> dict:
        """llama.cpp's router answer (several models: each one's are ``/props?model=NAME``)."""
        return {"role": "router", "models_autoload": bool(self.link.config.on_demand_models),
                "model_alias": "slotserve", "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0}, "build_info": build_info()}

    async def _model(self, name: str, st: Status) -> dict:
        primary = self.link.aliases(st).get(name, name)
        info = self.link.model_info(primary)
        m = st.models.get(primary)
        template = "" if info is None else info.chat_template
        if not template:
            tok = await self.tokenizers.get(primary)
            template = getattr(getattr(tok, "hf", None), "chat_template", None) or ""
        n_ctx = 0 if info is None or info.max_seq_len is None else info.max_seq_len
        return {
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                "is_processing": m is not None and m.slots_busy > 0,
                "params": generation_settings(LlamaBody(), -1), "prompt": ""},
            "total_slots": 0 if m is None else m.slots_total,
            "model_alias": name, "model_path": primary, "chat_template": template, "chat_template_caps": {},
            "modalities": {"vision": False, "audio": False}, "build_info": build_info(),
            "is_sleeping": name not in self.link.served(st),  # (an unloading model serves until its workers leave)
        }
