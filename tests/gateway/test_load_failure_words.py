"""A model that fails to load tells clients so in slotserve's words: its served name and a short
cause (its files could not be read; its configuration is not valid), never the loader's text nor
the server's paths, which stay in the log (the :class:`~worker.errors.ModelLoadError` the worker
ends with, which the launcher and the CLI log).

Before, the worker's goodbye -- which the broker puts in the error of every request waiting for the
model (``worker_failed`` for a model on demand) and in ``/v1/models``' failed reason -- was the
loader's first line: "cannot load model '/tmp/.../broken' from '/tmp/.../broken': It looks like the
config file at '/tmp/.../broken/config.json' is not a valid JSON file", "Class validation error for
validator 'validate_architecture': ...", "cannot read GGUF file '/tmp/.../bad.gguf': ...".

The worker's words for each broken model (a folder whose config.json is no JSON, a config that
transformers' validation refuses, a GGUF file cut short, a folder that does not exist; every other
kind of file fault: tests/worker/test_model_file_faults.py), then every route through one in-process
stack (broker and worker on threads, the gateway's whole app): a request waits for a model on demand
while its worker loads it, and ends with the worker's words. Streamed too: the gateway has sent
nothing yet when the load fails, so a request with ``stream: true`` gets the same 500 JSON error, no
event stream; the client SDK's streams (``on_token``/``on_text`` callbacks, ``AsyncClient.stream``)
end ``worker_failed`` with the same words, no token or text before."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from client import AsyncClient, Client, RemoteError  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from tests.support.cluster import ThreadCluster, ThreadWorker  # noqa: E402
from tests.support.vocab import SMOLLM2, kept_tokenizer  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402
from worker.errors import ModelLoadError  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402
from worker.process import WorkerProcess  # noqa: E402

FILES = "model 'broken' failed to load: its files could not be read (missing, unreadable, cut short or not a model's)"
CONFIG = ("model 'broken' failed to load: its configuration is not valid (or the server's options for it do not "
          "fit it)")


def _broken(tmp_path, kind: str) -> str:
    """A model of ``kind`` that cannot load, under ``tmp_path``: its path."""
    if kind == "json":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{ not json")
    elif kind == "invalid":  # transformers' validation: the hidden size is no multiple of the heads
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text(
            '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 1, '
            '"intermediate_size": 128, "vocab_size": 100}')
    elif kind == "gguf":
        (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
        return str(tmp_path / "m.gguf")
    return str(tmp_path / "m")


@pytest.mark.parametrize("kind, words", [("json", FILES), ("invalid", CONFIG), ("gguf", FILES), ("missing", FILES)])
def test_the_goodbye_of_a_failed_load_is_in_slotserves_words_and_the_detail_stays_in_the_error(tmp_path, kind, words):
    path = _broken(tmp_path, kind)
    wp = WorkerProcess(WorkerConfig(model=path, served_model_names=("broken",), warmup=False))
    with pytest.raises(Exception) as raised:
        wp._prepare(threading.Event())
    assert wp.goodbye == words
    if isinstance(raised.value, ModelLoadError):  # (the log's line: the path and the loader's words)
        assert str(tmp_path) in str(raised.value)


def _failing_load(http, tmp_path, folder: str | None = None) -> tuple[ThreadWorker, threading.Event]:
    """A worker loading a broken folder (``folder``; None: one whose config.json is no JSON) for model
    ``broken`` (on demand), held before the load until the returned gate is set: ``(worker, gate)`` once
    the broker counts the load."""
    folder = _broken(tmp_path, "json") if folder is None else folder

    class Gated(WorkerProcess):
        gate = threading.Event()

        def _load(self):
            assert Gated.gate.wait(30)
            super()._load()

    cluster = http.cluster
    w = ThreadWorker(cluster.backend, process_cls=Gated, load=True, keep_error=True, model=folder,
                     served_model_names=("broken",), warmup=False)
    cluster.workers.append(w)
    wait_until(lambda: (m := http.broker_client.status().models.get("broken")) is not None and m.loading == 1, 30,
               "the load to start")
    return w, Gated.gate


def _fail(http, w: ThreadWorker, gate: threading.Event, waiting) -> None:
    """Once the broker holds one request for ``broken`` (``waiting()`` says what was sent, for the failure
    message), let ``w``'s load go on and fail."""
    wait_until(lambda: http.broker_client.status().models["broken"].queued == 1, 30, "the request to wait", waiting)
    gate.set()
    w.thread.join(10)
    assert isinstance(w.error, ModelLoadError)


def _wait_and_fail(http, tmp_path, path: str, body: dict, folder: str | None = None) -> "object":
    """``body`` to ``path`` for model ``broken`` (on demand) while a worker loads a broken folder for it
    (``folder``, as :func:`_failing_load`): the response once the load has failed."""
    w, gate = _failing_load(http, tmp_path, folder)
    wait_until(lambda: "broken" in {m["id"] for m in http.get("/v1/models").json()["data"]}, 30,
               "the gateway to see the load", lambda: http.get("/v1/models").json())
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", http.post(path, json={"model": "broken", **body})))
    t.start()
    _fail(http, w, gate, lambda: out)
    t.join(30)
    return out["r"]


CHAT = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"messages": CHAT, "max_tokens": 4},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/v1/embeddings": {"input": ["hi"]},
}


@pytest.fixture(scope="module")
def http():
    tok = kept_tokenizer(SMOLLM2)
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not installed")
    with ThreadCluster(on_demand_models=("broken",), register_grace_s=0.0) as cluster:
        cluster.add_worker(model="other")
        codec = HFTextCodec(tok)
        config = GatewayConfig(broker=cluster.frontend, on_demand_models=("broken",))
        with TestClient(create_app(config, lambda name: Tokenizer(codec))) as h:
            wait_until(lambda: h.get("/v1/models").status_code == 200 and h.get("/v1/models").json()["data"], 30,
                       "the gateway to see the broker")
            with Client(cluster.frontend, model="other") as c:
                h.cluster, h.broker_client = cluster, c
                yield h


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_every_route_says_the_model_failed_to_load_in_slotserves_words(http, tmp_path, path):
    r = _wait_and_fail(http, tmp_path, path, ROUTES[path])
    assert r.status_code == 500, r.text
    text = r.text
    assert FILES in text, text
    for leak in (str(tmp_path), "config.json", "JSON file", "It looks like"):
        assert leak not in text, text


def test_weights_that_do_not_fit_config_json_say_so_and_name_the_tensor(http, tmp_path):
    # (before: "model 'broken' failed to load: an unexpected error", transformers' RuntimeError)
    from tests.support.slot_models import save_unfitting_llama

    folder = save_unfitting_llama(tmp_path / "m", "vocab_size", 400)
    r = _wait_and_fail(http, tmp_path, "/v1/chat/completions", ROUTES["/v1/chat/completions"], folder)
    assert r.status_code == 500, r.text
    said = ("model 'broken' failed to load: its weights do not match its config.json (lm_head.weight is [320, 64] in "
            "the weights, [400, 64] by config.json, and 1 other tensor); fix config.json or download the model again")
    assert said in r.json()["error"]["message"], r.text
    assert str(tmp_path) not in r.text


STREAMED = sorted(set(ROUTES) - {"/v1/embeddings"})  # (an embedding is never streamed)


@pytest.mark.parametrize("path", STREAMED)
def test_a_streamed_request_gets_the_same_error_before_any_event(http, tmp_path, path):
    # the load fails before the first token: the gateway has not started the event stream, so the error is
    # the route's JSON error with its status, as without stream
    r = _wait_and_fail(http, tmp_path, path, {**ROUTES[path], "stream": True})
    assert r.status_code == 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    text = r.text
    assert FILES in text and "data:" not in text, text
    assert "worker_failed" in text or path == "/v1/messages", text  # (Anthropic's error shape has no code)
    for leak in (str(tmp_path), "config.json", "JSON file", "It looks like"):
        assert leak not in text, text


def _ended_in_words(error: BaseException | None, tmp_path) -> None:
    """``error`` is the worker's goodbye, as the broker ends the requests waiting for the failed load."""
    assert isinstance(error, RemoteError), error
    assert error.code is ErrorCode.WORKER_FAILED, error
    assert FILES in error.message and str(tmp_path) not in error.message, error.message


def test_a_clients_streaming_callbacks_get_nothing_and_the_handle_the_workers_words(http, tmp_path):
    w, gate = _failing_load(http, tmp_path)
    tokens, texts = [], []
    with Client(http.cluster.frontend, model="broken") as client:
        h = client.submit_request([1, 2, 3], 4, on_token=tokens.append, on_text=texts.append)
        _fail(http, w, gate, lambda: h)
        h.result(30)
    assert h.finish_reason is FinishReason.ERROR
    _ended_in_words(h.error, tmp_path)
    assert tokens == [] and texts == []


@pytest.mark.parametrize("stream", ["stream", "stream_text"])
def test_an_async_clients_stream_raises_the_workers_words(http, tmp_path, stream):
    async def main():
        client = await AsyncClient.connect(http.cluster.frontend, model="broken")
        async with client:
            w, gate = await asyncio.to_thread(_failing_load, http, tmp_path)
            got = []

            async def consume():
                async for item in getattr(client, stream)([1, 2, 3], 4):
                    got.append(item)

            task = asyncio.create_task(consume())
            await asyncio.to_thread(_fail, http, w, gate, lambda: got)
            with pytest.raises(RemoteError) as raised:
                await asyncio.wait_for(task, 30)
            assert got == []
            return raised.value

    _ended_in_words(asyncio.run(main()), tmp_path)
