"""Over HTTP, a ``logit_bias`` on an id the model's tokenizer does not define (its vocabulary's padding:
Qwen2.5's 151,665-151,935) is a 400 naming the id, ``param`` ``logit_bias``, on every route that takes
``logit_bias`` (``/v1/completions``, ``/v1/chat/completions``), whole and streamed, for each padded
tokenizer of tests/worker/test_padded_vocabulary.py: the worker's engine refuses it at submission and
the worker answers ``bad_request`` (worker/process.py), which the gateway answers as a 400. Was: taken,
and the model wrote ``[PAD151665]`` tokens. Over the gateway's handlers and a client whose requests
the real engine's check meets as the worker's does: no sockets, no processes."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")
from starlette.testclient import TestClient  # noqa: E402

from client import RemoteError  # noqa: E402
from client.handle import ClientHandle  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from protocol.request import ModelLimits  # noqa: E402
from tests.gateway.test_error_field_names import BODIES, routes_app  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import ScriptedClient  # noqa: E402
from tests.worker.test_padded_vocabulary import Padded, padded  # noqa: E402,F401 (the fixture)
from worker import BatchInferenceEngine  # noqa: E402


class EngineChecks(ScriptedClient):
    """The scripted client, each request first submitted to a real engine (never run) over a model of
    ``rows`` rows with ``codec``: what the engine refuses ends the request ``bad_request`` with its
    message, as the worker answers it; the rest are scripted as before."""

    def __init__(self, codec, rows: int) -> None:
        super().__init__()
        self.engine = BatchInferenceEngine(Padded(codec, rows), 2, max_queue=1000)
        self.rows = rows
        self.refused: dict[ClientHandle, str] = {}  # (by the handle itself: an id() is reused once it is freed)

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, **options):
        params = ModelLimits(self.rows, None, True).build(prompt, max_tokens, **options)  # (the client's check)
        h = ClientHandle(len(self.threads), params, callback, on_token, time.monotonic(), None)
        try:  # (the prompt is the scripted client's to answer: the engine meets the options alone)
            self.engine.submit(params._replace(prompt=(1,)))
        except ValueError as e:
            self.refused[h] = str(e)
        self.submitted.append(params)
        t = threading.Thread(target=self._run, args=(h,))
        self.threads.append(t)
        t.start()
        return h

    def _script(self, h: ClientHandle) -> None:
        message = self.refused.get(h)
        if message is None:
            return super()._script(h)
        h._end(FinishReason.ERROR, None, RemoteError(ErrorCode.BAD_REQUEST, message), time.monotonic())
        h.callback([])
        h._done = True


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bias_on_the_padding_is_a_400_naming_the_id(padded, path, stream):  # noqa: F811
    codec, rows, undefined = padded
    client = EngineChecks(codec, rows)
    with TestClient(routes_app(client)) as http:
        for start, stop in undefined:
            body = {**BODIES[path], "stream": stream, "logit_bias": {"5": 1, str(stop - 1): 100}}
            e = error_of(http.post(path, json=body), 400)
            assert e["param"] == "logit_bias" and e["code"] == "bad_request", e
            assert e["message"].startswith(f"logit_bias holds token id {stop - 1}, which the model's tokenizer does "
                                           "not define"), e
        last = (undefined[0][0] if undefined else rows) - 1
        r = http.post(path, json={**BODIES[path], "logit_bias": {str(last): 100}})
        assert r.status_code == 200, r.text
    for t in client.threads:
        t.join(10)
