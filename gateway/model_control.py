"""``POST /models/load`` and ``POST /models/unload``: llama.cpp's router-mode endpoints, for the models
that ``slotserve up`` loads on demand (issue 34 item 1; :mod:`slotserve.on_demand`).

The body is ``{"model": NAME}`` (a served name of a model on demand); the answer ``{"success": true}``
as llama.cpp's: the order is taken, not done -- loading takes the model's load time, and unloading
waits until the model is idle (a model with requests queued or running is never unloaded). Watch
``GET /v1/models`` (each model's ``status``) for the result: it says ``loading`` (``unloading``) from
the moment the answer is sent, until the order is done (``loaded``, ``unloaded``) or the load failed
(``unloaded`` with ``failed``). The gateway hands the order to the broker
(:meth:`BrokerConnections.order <gateway.link.BrokerConnections.order>`), which shows its state at once
and keeps it for the supervisor that owns the worker processes (it takes it at its next pass:
:mod:`broker.demand`); a gateway without models on demand (``slotserve serve``, or ``up`` with one
model) answers 400 saying so, and 503 when no broker answers.
A name no model has is the 404 ``model_not_found`` that every ``/v1`` route answers
(:meth:`BrokerConnections.model_not_found <gateway.link.BrokerConnections.model_not_found>`: the
names a request may give, with their states); a model that is served but not on demand (its workers
run as long as the cluster) a 400 naming the models on demand; a malformed body a 400, read as every
route's body is (:func:`gateway.generate.parse_body`: strict, an unknown field refused by name).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request
from gateway.generate import parse_body
from gateway.link import BrokerConnections
from gateway.responses import error_response, json_response
from protocol.validation import clip

__all__ = ["ModelControl"]


class ModelOrderBody(BaseModel):
    """The body of ``POST /models/load`` and ``/models/unload`` (llama.cpp's): ``model``, a served
    name of a model on demand. Strict, as every route's body: another field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str


class ModelControl:
    """The two endpoints for the models on demand of ``link``'s config (their served names; none:
    no supervisor), whose orders go through ``link``; ``link`` words the 404 of a name no model has,
    as for ``/v1``."""

    def __init__(self, link: BrokerConnections, max_body_bytes: int) -> None:
        self.link = link
        self.models = link.config.on_demand_models
        self.max_body_bytes = max_body_bytes

    async def load(self, request: Request) -> Response:
        return await self._order(request, "load")

    async def unload(self, request: Request) -> Response:
        return await self._order(request, "unload")

    async def _order(self, request: Request, op: str) -> Response:
        try:
            model = (await parse_body(request, ModelOrderBody, self.max_body_bytes)).model
            if not model:
                raise bad_request('the body must be {"model": "<name>"}, a name not empty', "model")
            if not self.models:
                raise bad_request(f"/models/{op} applies to models loaded on demand, which `slotserve up` runs "
                                  "when given several models (--model repeated, or --models-dir)", "model")
            if model not in self.models:
                raise await self._not_on_demand(model, op)
            await self.link.order(op, model)
            return json_response({"success": True})
        except APIError as e:
            return error_response(e)

    async def _not_on_demand(self, model: str, op: str) -> APIError:
        """The error for ``model``, not a model on demand: the ``/v1`` routes' 404 for a name the
        broker does not know (503 when no broker answers), else a 400 (it is served, always)."""
        status = await self.link.refresh()
        if not self.link.knows(model, status):
            return self.link.model_not_found(model, status)
        return bad_request(f"model `{clip(model)}` is not loaded on demand: its workers run as long as the cluster "
                           f"does; /models/{op} applies to the models on demand ({', '.join(self.models)})", "model")
