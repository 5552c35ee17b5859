"""Shared pieces of the HTTP gateway tests: a cluster with a gateway (on the
shared harness, :mod:`tests.support.cluster`), its status and metrics, and
:class:`CallInFlight`, an HTTP request made on a thread while the test stops
the server under it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import threading

import httpx

from broker import BrokerConfig
from client import Client
from gateway import GatewayConfig
from gateway.link import BrokerConnections
from protocol.messages import ModelStatus, Status
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from tests.support.waits import wait_until as _wait_until
from worker.config import WorkerConfig  # The gateway tests' conditions are HTTP calls: polled every 10 ms.
wait_until = functools.partial(_wait_until, pause_s=0.01)


def start_cluster(workers: tuple[WorkerConfig, ...], *, max_queue: int = 100_000,
                  gateway: GatewayConfig | None = None, models: tuple[str, ...] = ("simulated",)) -> LocalCluster:
    """A broker, ``workers`` and a gateway on free ports; returns once ``/health``
    lists every model in ``models``. The caller stops it."""
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, max_queue=max_queue, heartbeat_interval_s=0.2)
    cfg = ClusterConfig(broker, workers, start_timeout_s=120.0, gateway=gateway or GatewayConfig(port=0))
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        def healthy():
            r = httpx.get(cluster.http_url + "/health", timeout=5)
            return r.status_code == 200 and set(models) <= set(r.json()["models"])
        wait_until(healthy, 60, "the gateway's /health")
    except BaseException:
        cluster.stop()
        raise
    return cluster


class SharedClusters:
    """Clusters that the test modules run in a row on one test process share, one per key: a cluster
    started costs ~7 s (a broker, a worker loading its model, the gateway), so modules that only send
    requests and read their own answers need not each start theirs. :meth:`get` gives the running
    cluster of a key (started on first use, and again if one of its processes has died); :meth:`close`
    stops them all, which the owner does when the next test wants none (tests/gateway/conftest.py).
    Shared means not fresh: what a module leaves (prefix-cache entries, stored responses, counters
    on /metrics) the next one sees, so a module that reads such state starts its own."""

    def __init__(self) -> None:
        self._clusters: dict[object, LocalCluster] = {}

    def get(self, key, start) -> LocalCluster:
        """The cluster of ``key`` (hashable); ``start()`` makes one (started, healthy) when none runs."""
        cluster = self._clusters.get(key)
        if cluster is not None and not _alive(cluster):
            del self._clusters[key]
            cluster.stop()
            cluster = None
        if cluster is None:
            cluster = self._clusters[key] = start()
        return cluster

    def close(self) -> None:
        """Stop every cluster held (none: nothing to do)."""
        while self._clusters:
            self._clusters.popitem()[1].stop()


def _alive(cluster: LocalCluster) -> bool:
    """True when the cluster's broker, workers and gateway all still run."""
    procs = [cluster.broker_process, cluster.gateway_process, *cluster.worker_processes]
    return all(p is not None and p.is_alive() for p in procs)


class GivenStatusLink(BrokerConnections):
    """The gateway's own broker link over a broker status the test gives (:meth:`show`), with the
    models on demand ``on_demand`` (``aliases``: their ``(alias, primary)`` pairs, as ``slotserve up``
    gives them); no broker, no socket (``refresh`` answers the given status)."""

    def __init__(self, on_demand: tuple[str, ...] = (), aliases: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(dataclasses.replace(GatewayConfig(), on_demand_models=on_demand, on_demand_aliases=aliases))
        self.broker_ok = True

    def show(self, models: dict[str, ModelStatus], aliases: dict[str, str] | None = None,
             on_demand: dict | None = None) -> None:
        """The status to answer from now on: ``models`` (name -> ModelStatus), ``aliases`` (alias -> model),
        ``on_demand`` (model -> DemandState: the broker's states of the models on demand)."""
        self.status = Status("broker", 1.0, models, (), 0, {}, aliases or {}, {}, on_demand or {})

    async def refresh(self) -> Status:
        return self.status


def model_status(workers: int = 0, loading: int = 0) -> ModelStatus:
    """A model's line in a status: ``workers`` registered (4 slots each), ``loading`` starting."""
    return ModelStatus(0, 0, workers, 0, 4 * workers, loading)


def broker_status(cluster: LocalCluster):
    with Client(cluster.frontend, name="test-status") as c:
        return c.status()


def metric(url: str, name: str, **labels) -> float:
    """One sample of the gateway's /metrics (0.0 when absent)."""
    text = httpx.get(url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@contextlib.contextmanager
def served(app, client):
    """A Starlette ``TestClient`` over ``app`` (a gateway app made on the in-process ``client``, a
    scripted broker client with ``threads``), entered; on leaving, the client's threads are joined
    (10 s each), so a module's requests end before the next module's start."""
    from starlette.testclient import TestClient

    with TestClient(app) as h:
        yield h
    for t in client.threads:
        t.join(10)


@contextlib.contextmanager
def vendor_routes(client, tokenizers, config: GatewayConfig | None = None):
    """``{route: TestClient}`` of the generation routes of both vendors' shapes over the in-process
    ``client`` (a scripted broker client with ``threads``; no sockets), each app on its own
    ``ScriptedLink`` to it, under ``config`` (default ``GatewayConfig()``): "chat" and "completions"
    (one app: the OpenAI handlers, with ``tokenizers``, a :class:`gateway.tokenizer.Tokenizers`),
    "responses" (a store of 8 responses kept 60 s) and "messages" (Anthropic's; requests need the
    header ``x-api-key: tests.support.scripted.KEY``). Entered; on leaving, the client's
    threads are joined, as :func:`served` does."""
    from starlette.testclient import TestClient

    from gateway.response_store import ResponseStore
    from tests.support.scripted import ScriptedLink, handlers_app, messages_app, responses_app

    config = config or GatewayConfig()
    with TestClient(handlers_app(tokenizers, ScriptedLink(client), config)) as openai_routes, \
            TestClient(responses_app(ScriptedLink(client), config, ResponseStore(8, 60.0))) as responses, \
            TestClient(messages_app(ScriptedLink(client), config)) as messages:
        yield {"chat": openai_routes, "completions": openai_routes, "responses": responses, "messages": messages}
    for t in client.threads:
        t.join(10)


def sse(http, path: str, body: dict, *, done: bool = False, **kw) -> list[dict]:
    """The ``data:`` events of ``body`` POSTed to ``path`` with ``stream: true`` over ``http`` (a
    TestClient, or an ``httpx.Client`` with a ``base_url``; ``kw``: more of ``stream``'s arguments,
    such as headers), JSON-decoded, ``[DONE]`` left out; asserts the status is 200 and the body an
    event stream, and with ``done`` that its last event is ``[DONE]`` (OpenAI's chat and completions
    streams end so)."""
    with http.stream("POST", path, json={**body, "stream": True}, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert not done or data[-1:] == ["[DONE]"], data[-1:]
    return [json.loads(d) for d in data if d != "[DONE]"]


def async_items(*items):
    """An async iterator over ``items`` (chunk bodies, an APIError, STREAM_END), as the chat path
    yields them to a translation (:class:`gateway.responses_api.ResponsesTranslation`, Messages')."""
    async def gen():
        for item in items:
            yield item
    return gen()


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    """A chat completion chunk's body: choice 0 with ``delta`` and ``finish``, and a usage of 3 + 1 tokens."""
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def chat_stream(chunks: list[dict]) -> tuple[str, list[tuple[str, str]], str | None]:
    """``(content, [(name, arguments)], finish_reason)`` that a chat completion's stream of
    ``chunks`` (:func:`sse`'s events) adds up to: the content deltas joined, each tool call's name
    and arguments deltas joined by its ``index``, the last finish reason given."""
    text, calls, finish = "", {}, None
    for chunk in chunks:
        for ch in chunk["choices"]:
            text += ch["delta"].get("content") or ""
            for t in ch["delta"].get("tool_calls") or []:
                name, args = calls.get(t["index"], ("", ""))
                calls[t["index"]] = (name + (t["function"].get("name") or ""), args + t["function"]["arguments"])
            finish = ch["finish_reason"] or finish
    return text, list(calls.values()), finish


def error_of(r: httpx.Response, status: int) -> dict:
    """The ``error`` object of an OpenAI-shaped error reply with HTTP ``status``
    (asserting the status and the shape: exactly message, type, param, code)."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class CallInFlight:
    """One ``POST`` of ``body`` to ``url + path``, made at once on a thread and read
    as it comes: :attr:`events` (a stream's ``data:`` events, JSON-decoded,
    ``"[DONE]"`` as it is) or :attr:`json` (a body that is not a stream), with
    :attr:`status` and :attr:`headers`; :attr:`error` is a transport error
    (connection refused or cut). :meth:`wait` for its end."""

    def __init__(self, url: str, path: str, body: dict, *, timeout_s: float = 60.0) -> None:
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.events: list = []
        self.json: dict | None = None
        self.error: httpx.HTTPError | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url + path, body, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, timeout_s: float) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
                self.status, self.headers = r.status_code, r.headers
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            data = line[len("data: "):]
                            self.events.append(data if data == "[DONE]" else json.loads(data))
                else:
                    self.json = json.loads(r.read())
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float = 30.0) -> "CallInFlight":
        assert self._done.wait(timeout_s), f"the HTTP call did not end within {timeout_s} s"
        return self

    def streamed_tokens(self) -> list[int]:
        """The token ids of the stream's chunks so far, in order."""
        return [t for e in self.events if isinstance(e, dict) and "choices" in e
                for c in e["choices"] for t in c["token_ids"]]
