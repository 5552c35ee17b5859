"""Faults found by trying issue 20's HTTP features as a careless or hostile user would, one test per
member of each fault (all fields, both endpoints), on the gateway's handlers over the scripted broker
client of tests/support/scripted.py (no sockets, no processes):

- ``/tokenize`` and ``/detokenize`` served a body sent as ``text/plain`` (or gzip-labelled), which
  ``/v1`` refuses (400 ``unsupported_media_type``);
- they answered 200 for a model no worker serves when the gateway had one ``--tokenizer`` (which
  ``slotserve up`` always passes), where ``/v1`` answers 404 ``model_not_found``; and again (a tokenizer
  for every name) while only models on demand were configured, none loaded; their 404 called a model
  on demand that was loading "unloaded", and a known model without a worker "does not exist";
- they ran the tokenizer on the event loop: a 7 MB ``/tokenize`` stalled every other stream for 39 s
  (measured on SmolLM2 through ``slotserve up``);
- ``prompt_logprobs`` with ``stream: true`` was computed by the worker and silently dropped; vLLM
  answers 400 for a value > 0 (its ``check_logprobs``) and accepts 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway import GatewayConfig  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.link import BrokerConnections  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.tokenize import TokenizeEndpoints  # noqa: E402
from gateway.tokenizer import Tokenizer, Tokenizers  # noqa: E402
from protocol.messages import ModelStatus, Status  # noqa: E402
from tests.gateway.test_logprobs_shapes import MESSAGES  # noqa: E402
from tests.support.scripted import LetterCodec, ScriptedClient, ScriptedLink, handlers_app  # noqa: E402


class RefreshingLink(ScriptedLink):
    """The scripted link over a broker status, read by the gateway link's own methods, with the
    refresh that ``/tokenize`` asks for a name the last poll did not serve: ``m`` served, the models
    on demand of ``config`` known without a worker (as the broker lists them); ``later`` a model
    whose first worker registered after the last poll (served once refreshed)."""

    served = BrokerConnections.served
    only_model = BrokerConnections.only_model
    models = BrokerConnections.models
    model_states = BrokerConnections.model_states
    aliases = BrokerConnections.aliases
    knows = BrokerConnections.knows
    model_not_found = BrokerConnections.model_not_found
    no_worker = BrokerConnections.no_worker

    def __init__(self, client: ScriptedClient, later: str | None = None) -> None:
        super().__init__(client)
        self.later = later
        self.refreshes = 0

    @property
    def status(self) -> Status:
        models = {"m": ModelStatus(0, 0, 1, 0, 4), **({self.later: ModelStatus(0, 0, 1, 0, 4)}
                                                       if self.refreshes and self.later else {})}
        models.update({n: ModelStatus(0, 0, 0, 0, 0) for n in self.config.on_demand_models if n not in models})
        return Status("broker", 1.0, models, (), 0, {})

    async def refresh(self) -> Status:
        self.refreshes += 1
        return self.status


class StatusLink(BrokerConnections):
    """The gateway's own broker link (its 404 and 503 checks, ``client_for`` included) over a broker
    status the test gives (``models``: ``{name: ModelStatus}``; ``on_demand``: the names loaded on
    demand); no broker, no socket: a check that gets past the status fails the test."""

    def __init__(self, models: dict, on_demand: tuple[str, ...] = ()) -> None:
        super().__init__(dataclasses.replace(GatewayConfig(), on_demand_models=on_demand))
        self.status, self.broker_ok = Status("broker", 1.0, models, (), 0, {}), True

    async def refresh(self) -> Status:
        return self.status

    def _new_client(self, model: str, name: str):
        raise AssertionError(f"a client for {model!r} was asked for: the status checks let the request through")


def app_for(tokenizers: Tokenizers, link: ScriptedLink | None = None) -> tuple[Starlette, ScriptedClient]:
    client = ScriptedClient() if link is None else link.client
    return handlers_app(tokenizers, link or RefreshingLink(client)), client


def letters(name: str) -> Tokenizer:
    return Tokenizer(LetterCodec())


BODIES = [("/tokenize", b'{"prompt": "ab"}'), ("/tokenize", b'{"messages": [{"role": "user", "content": "hi"}]}'),
          ("/detokenize", b'{"tokens": [0, 1]}')]


@pytest.mark.parametrize("path, raw", BODIES)
def test_tokenizer_endpoints_take_only_plain_json_as_v1_does(path, raw):
    app, _ = app_for(Tokenizers(letters))
    with TestClient(app) as http:
        for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                        {"content-type": "application/json", "content-encoding": "gzip"}):
            r = http.post(path, content=raw, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_media_type", (headers, r.text)
            v1 = http.post("/v1/completions", content=b'{"model": "m", "prompt": [1], "max_tokens": 1}',
                           headers=headers)
            assert v1.json()["error"]["code"] == "unsupported_media_type"  # the same rule
        assert http.post(path, content=raw, headers={"content-type": "application/json; charset=utf-8"}).status_code \
            == 200
        assert http.post(path, content=raw).status_code == 200  # no Content-Type: read as JSON (as /v1)


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "ab"}), ("/tokenize", {"messages": MESSAGES}),
                                        ("/detokenize", {"tokens": [0]})])
@pytest.mark.parametrize("one_tokenizer", [None, "letters-folder"])
def test_an_unserved_model_is_404_even_with_one_tokenizer_for_all(path, body, one_tokenizer):
    link = RefreshingLink(ScriptedClient(), later="new")
    app, _ = app_for(Tokenizers(letters, one_tokenizer), link)
    with TestClient(app) as http:
        r = http.post(path, json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert r.json()["error"]["param"] == "model" and link.refreshes == 1  # asked the broker before saying so
        assert http.post(path, json={**body, "model": "m"}).status_code == 200
        assert http.post(path, json={**body, "model": "new"}).status_code == 200  # registered after the last poll


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "ab"}), ("/tokenize", {"messages": MESSAGES})])
def test_a_model_on_demand_not_loaded_now_is_503_not_404_and_keeps_a_tokenizer_it_had(path, body):
    """A model on demand exists while unloaded (``/v1/models`` lists it): not 404 ``model_not_found``,
    but 503 saying how it loads -- and no tokenizer looked up by a name its worker has not told
    yet (a failed lookup would stay cached); one loaded while the model was served still answers."""
    import dataclasses

    link = RefreshingLink(ScriptedClient())
    link.config = dataclasses.replace(GatewayConfig(), on_demand_models=("m", "lazy"))
    tokenizers = Tokenizers(letters)
    app, _ = app_for(tokenizers, link)
    with TestClient(app) as http:
        r = http.post(path, json={**body, "model": "lazy"})
        assert r.status_code == 503 and "POST /models/load" in r.json()["error"]["message"], r.text
        assert "lazy" not in tokenizers._futures
        served = http.post(path, json={**body, "model": "m"}).json()
        link.served = lambda status=None: {}  # m unloaded too: its tokenizer, loaded before, still answers
        assert http.post(path, json={**body, "model": "m"}).json() == served



def test_an_unknown_model_is_told_every_name_and_the_one_it_differs_from_in_case():
    """The 404 lists the models a request may name, those loaded on demand with their state, and
    a name that differs from the one given only in case (names are case-sensitive)."""
    import dataclasses

    link = RefreshingLink(ScriptedClient())
    link.config = dataclasses.replace(GatewayConfig(), on_demand_models=("Lazy-1B",))
    app, _ = app_for(Tokenizers(letters), link)
    with TestClient(app) as http:
        r = http.post("/tokenize", json={"prompt": "ab", "model": "lazy-1b"})
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found", r.text
    assert "(models: Lazy-1B (unloaded), m)" in error["message"] and error["message"].endswith(
        "did you mean `Lazy-1B`?"), error["message"]


def model(workers: int = 0, loading: int = 0) -> ModelStatus:
    return ModelStatus(0, 0, workers, 0, 4 * workers, loading)


# what the broker's status says: only models on demand, none loaded (one loading); or a model served
# beside them, and one not on demand whose first worker is loading (``slotserve up`` starting)
ONLY_ON_DEMAND = ({"lazy": model(), "big": model(loading=1)}, ("lazy", "big"),
                  "(models: big (loading), lazy (unloaded))")
SERVED_TOO = ({"m": model(1), "lazy": model(), "big": model(loading=1), "boot": model(loading=1)}, ("lazy", "big"),
              "(models: big (loading), boot (loading), lazy (unloaded), m)")
TOKENIZER_PATHS = [("/tokenize", {"prompt": "ab"}), ("/tokenize", {"messages": MESSAGES}),
                   ("/detokenize", {"tokens": [0, 1]})]


@pytest.mark.parametrize("one_tokenizer", [None, "letters-folder"])
@pytest.mark.parametrize("models, on_demand, listed", [ONLY_ON_DEMAND, SERVED_TOO], ids=["only-on-demand", "served"])
def test_an_unknown_model_is_the_404_of_v1_on_tokenize_and_detokenize(models, on_demand, listed, one_tokenizer):
    """``/tokenize`` and ``/detokenize`` answer a name no model has with generation's very 404 (status,
    code, message, the list of names): also when only models on demand are configured and none is
    loaded, where they answered 200 (a tokenizer for every name), and a model loading now is listed
    "loading", where they called every model on demand "unloaded"."""
    app = handlers_app(Tokenizers(letters, one_tokenizer), StatusLink(models, on_demand))
    with TestClient(app) as http:
        v1 = http.post("/v1/completions", json={"model": "nope", "prompt": [1], "max_tokens": 1})
        assert v1.status_code == 404 and v1.json()["error"]["code"] == "model_not_found", v1.text
        assert listed in v1.json()["error"]["message"], v1.text
        chat = http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES, "max_tokens": 1})
        assert (chat.status_code, chat.json()) == (404, v1.json())
        for path, body in TOKENIZER_PATHS:
            r = http.post(path, json={**body, "model": "nope"})
            assert (r.status_code, r.json()) == (404, v1.json()), (path, r.text)


@pytest.mark.parametrize("one_tokenizer", [None, "letters-folder"])
def test_a_known_model_without_a_worker_is_the_503_of_v1_not_a_404(one_tokenizer):
    """A model the broker knows whose first worker is still loading exists: ``/tokenize`` answers
    generation's 503 (retry), not a 404 saying it does not exist."""
    app = handlers_app(Tokenizers(letters, one_tokenizer), StatusLink(*SERVED_TOO[:2]))
    with TestClient(app) as http:
        v1 = http.post("/v1/completions", json={"model": "boot", "prompt": [1], "max_tokens": 1})
        assert v1.status_code == 503 and "model `boot` is loading now" in v1.json()["error"]["message"]
        for path, body in TOKENIZER_PATHS:
            r = http.post(path, json={**body, "model": "boot"})
            assert (r.status_code, r.json()) == (503, v1.json()), (path, r.text)


NAMED = [("/v1/completions", {"prompt": [1], "max_tokens": 1}), ("/v1/chat/completions", {"messages": MESSAGES}),
         ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"messages": MESSAGES, "max_tokens": 1}),
         ("/v1/messages/count_tokens", {"messages": MESSAGES}), ("/infill", {"input_prefix": "a", "input_suffix": "b"}),
         ("/completion", {"prompt": "ab"}),
         ("/tokenize", {"prompt": "ab"}), ("/tokenize", {"messages": MESSAGES}), ("/detokenize", {"tokens": [0]}),
         ("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["a"]})]
"""Every route that names a model, with a body it takes."""


class GivenApp(StatusLink):
    """:class:`StatusLink` as the whole app's link (no poller: the status is the test's)."""

    async def start(self) -> None:
        pass


@pytest.mark.parametrize("model, words", [
    ("boot", "model `boot` is loading now (its first worker is starting); retry when GET /v1/models says it is "
             "loaded"),  # (was "no worker serves model `boot` right now; retry when one has registered")
    ("gone", "no worker serves model `gone` right now; retry when one has registered"),  # (its workers left)
])
def test_a_model_without_a_worker_gets_one_503_that_says_whether_it_is_loading_on_every_route(monkeypatch, model,
                                                                                            words):
    """``boot``'s first worker is loading (``slotserve up`` starting; not a model on demand): every
    route says so, as a model on demand that is loading is told; ``gone`` had workers, none now.
    One builder (``BrokerConnections.no_worker``), the same words in each route's shape."""
    import gateway.app

    link = GivenApp({"m": ModelStatus(0, 0, 1, 0, 4), "boot": ModelStatus(0, 0, 0, 0, 0, 1),
                     "gone": ModelStatus(0, 0, 0, 0, 0)})
    monkeypatch.setattr(gateway.app, "BrokerConnections", lambda config: link)
    with TestClient(gateway.app.create_app(GatewayConfig())) as http:
        for path, body in NAMED:
            r = http.post(path, json={**body, "model": model})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            if path.startswith("/v1/messages"):
                assert r.json() == {"type": "error", "error": {"type": "overloaded_error", "message": words}}, path
            else:
                assert r.json()["error"]["message"] == words, (path, r.text)


def test_a_model_on_demand_gets_a_503_that_says_whether_it_is_loading():
    """``lazy`` (on demand, not loaded) is told how to load it; ``big`` (on demand, loading now) is
    told it is loading, not that a request would load it."""
    app = handlers_app(Tokenizers(letters, None), StatusLink(*ONLY_ON_DEMAND[:2]))
    with TestClient(app) as http:
        for path, body in TOKENIZER_PATHS:
            lazy = http.post(path, json={**body, "model": "lazy"})
            big = http.post(path, json={**body, "model": "big"})
            assert lazy.status_code == big.status_code == 503, (path, lazy.text, big.text)
            assert "is not loaded now: a generation request or POST /models/load loads it" \
                in lazy.json()["error"]["message"]
            assert "is loading now; retry when GET /v1/models says it is loaded" in big.json()["error"]["message"]


def test_the_not_found_message_lists_loaded_and_on_demand_names_and_hints_only_at_a_case_match():
    from gateway.link import not_found

    names = {"smollm2-135m": "loaded", "qwen2.5-coder-0.5b": "unloaded", "big": "loading"}
    message = not_found("qwen2.5-coder-0.5B", names)
    assert "(models: big (loading), qwen2.5-coder-0.5b (unloaded), smollm2-135m)" in message
    assert message.endswith("did you mean `qwen2.5-coder-0.5b`?")
    assert "did you mean" not in not_found("gpt-4", names) and "(models: none)" in not_found("x", {})

class GatedCodec(LetterCodec):
    """``encode`` / ``apply_chat_template`` wait for a ``decode`` to happen meanwhile: on the event loop
    they would block the ``/detokenize`` that releases them, so the wait would run out. The wait is a
    deadlock's bound, not a timing: 60 s (5 s ran out on a machine loaded to 3.8 on 2 cores, with the
    code right), which only a broken gateway waits through."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.released: list[bool] = []

    def encode(self, text):
        self.released.append(self.gate.wait(60))
        return super().encode(text)

    def decode(self, ids, skip_special_tokens=True):
        self.gate.set()
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("body", [{"prompt": "ab"}, {"messages": MESSAGES}, {"prompt": "ab", "return_token_strs": True}])
def test_the_tokenizer_runs_off_the_event_loop(body):
    codec = GatedCodec()
    app, _ = app_for(Tokenizers(lambda name: Tokenizer(codec)))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            slow = asyncio.ensure_future(http.post("/tokenize", json=body))
            await asyncio.sleep(0.05)  # it is in encode now (on the loop, the loop itself would wait there)
            fast = await http.post("/detokenize", json={"tokens": [0, 1]})
            assert fast.status_code == 200 and fast.json() == {"prompt": "ab"}
            return await slow

    r = asyncio.run(main())
    assert r.status_code == 200 and codec.released == [True], r.text  # /detokenize ran while it tokenized


def test_detokenize_names_the_first_id_outside_the_vocabulary():
    app, _ = app_for(Tokenizers(letters))
    with TestClient(app) as http:
        for tokens, i in [([1, 2, 40, -1], 2), ([-5, 41], 0), ([0] * 1000 + [10**20], 1000)]:
            r = http.post("/detokenize", json={"tokens": tokens})
            e = r.json()["error"]
            assert r.status_code == 400 and e["param"] == "tokens" and e["message"].startswith(f"tokens[{i}] is "), e
        assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": [4, 5, 6]}),
                                        ("/v1/completions", {"prompt": "cde"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_prompt_logprobs_with_stream_is_vllms_400_and_0_is_not_asked(path, body):
    app, client = app_for(Tokenizers(letters))
    with TestClient(app) as http:
        for n in (1, 20):
            r = http.post(path, json={"model": "m", "max_tokens": 2, "stream": True, "prompt_logprobs": n, **body})
            e = r.json()["error"]
            assert r.status_code == 400 and e["param"] == "prompt_logprobs" and "stream" in e["message"], r.text
        assert client.submitted == []  # nothing reached a worker
        r = http.post(path, json={"model": "m", "max_tokens": 2, "stream": True, "prompt_logprobs": 0, **body})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert [p.prompt_logprobs for p in client.submitted] == [None]  # accepted (as vLLM) and not computed
        r = http.post(path, json={"model": "m", "max_tokens": 2, "prompt_logprobs": 2, **body})  # not streamed: kept
        assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][0] is None
        assert client.submitted[-1].prompt_logprobs == 2


def test_a_streamed_echo_with_logprobs_still_scores_the_prompt():
    app, client = app_for(Tokenizers(letters))
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"model": "m", "prompt": [2, 3], "max_tokens": 1, "stream": True,
                                               "echo": True, "logprobs": 1, "prompt_logprobs": 0})
        assert r.status_code == 200, r.text
        assert client.submitted[0].prompt_logprobs == 1 and client.submitted[0].logprobs == 1
        first = r.text.split("\n\n")[0]
        assert '"token_logprobs":[null,' in first  # the echoed prompt's entries, the first null
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
@pytest.mark.parametrize("declared", [False, True])
def test_a_body_over_the_limit_is_413_without_reading_it_whole(path, declared):
    """/tokenize and /detokenize read the whole body into memory before comparing it with the limit
    (a 200 MB body: 3.4 s and 200 MB held); now they stop as /v1 does: at a Content-Length over the
    limit before reading, else at the first chunk past it."""
    client = ScriptedClient()
    link = RefreshingLink(client)
    tokenizers = Tokenizers(letters)
    gen = Generate(GatewayConfig(max_body_bytes=1000), link, GatewayMetrics(), tokenizers=tokenizers)
    tok = TokenizeEndpoints(link, tokenizers, max_body_bytes=1000)
    app = Starlette(routes=[Route("/v1/completions", gen.completions, methods=["POST"]),
                            Route("/tokenize", tok.tokenize, methods=["POST"]),
                            Route("/detokenize", tok.detokenize, methods=["POST"])])
    chunks, read, sent = 100, [], []
    headers = [(b"content-type", b"application/json")] + ([(b"content-length", b"100000")] if declared else [])
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": ""}

    async def receive():
        if len(read) < chunks:
            read.append(1)
            return {"type": "http.request", "body": b" " * 1000, "more_body": len(read) < chunks}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert len(read) <= (0 if declared else 2), len(read)  # stopped at the limit, not at the body's end


class WorkerRefusesTextOverContext(ScriptedClient):
    """A text prompt is refused as a worker refuses one over the context (the client cannot count it)."""

    def _script(self, h) -> None:
        from client import RemoteError
        from protocol.enums import ErrorCode, FinishReason

        if isinstance(h.params.prompt, str):
            h._end(FinishReason.ERROR, None, RemoteError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, (
                f"prompt (64 tokens) + max_tokens ({h.params.max_tokens}) = 65 exceeds the served context of 64 "
                "tokens (--max-model-len); shorten the prompt or lower max_tokens")), 0.0)
            h.callback([])
            h._done = True
            return
        super()._script(h)


@pytest.mark.parametrize("prompt", [[1] * 64, "a" * 64])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_over_the_context_says_it_runs_as_1_token(prompt, stream):
    """max_tokens 0 with echo is submitted as 1 token: a full-context prompt was refused with
    "max_tokens (1)", a number the caller never sent; the message now says why."""
    link = RefreshingLink(WorkerRefusesTextOverContext())
    app, _ = app_for(Tokenizers(letters), link)
    with TestClient(app) as http:
        body = {"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
        e = http.post("/v1/completions", json=body).json()["error"]
        assert e["code"] == "context_length_exceeded" and e["param"] == "prompt", e
        assert "max_tokens 0 with echo runs as 1 generated token" in e["message"], e
        body["max_tokens"] = 1  # asked for 1: the message as it was
        e = http.post("/v1/completions", json=body).json()["error"]
        assert e["code"] == "context_length_exceeded" and "max_tokens 0" not in e["message"], e
        ok = http.post("/v1/completions", json={**body, "prompt": prompt[:63], "max_tokens": 0, "stream": False})
        assert ok.status_code == 200 or isinstance(prompt, str)  # (the scripted worker refuses every text)


def _aliased_link(models: dict[str, int]) -> StatusLink:
    """A status serving ``models`` (name -> workers), each under its name and a path as given (as a
    ``.gguf`` file's stem and path, or a model folder's name and path, are served)."""
    link = StatusLink({m: ModelStatus(0, 0, w, 0, 4) for m, w in models.items()})
    link.status = dataclasses.replace(link.status, aliases={f"/models/{m}.gguf": m for m in models})
    return link


def test_a_request_without_a_model_is_for_the_one_model_served_whatever_its_aliases():
    """/tokenize (and /infill) may leave out ``model`` when one model is served; a model served under
    two names (a file's stem and its path) counted as two, and the request was told to name one."""
    link = _aliased_link({"m": 1})
    assert link.only_model() == "m"
    with TestClient(handlers_app(Tokenizers(letters), link)) as http:
        r = http.post("/tokenize", json={"prompt": "ab"})
        assert r.status_code == 200 and r.json()["tokens"] == letters("m").encode("ab"), r.text

    from gateway.infill import InfillEndpoint, InfillRequest

    endpoint = InfillEndpoint(type("Gen", (), {"link": link})())
    assert asyncio.run(endpoint._model(InfillRequest(input_prefix="a"))) == "m"


def test_a_request_without_a_model_among_several_names_each_model_once():
    link = _aliased_link({"m": 1, "n": 1, "idle": 0})  # (a model without a worker is not served)
    assert link.only_model() is None
    with TestClient(handlers_app(Tokenizers(letters), link)) as http:
        r = http.post("/tokenize", json={"prompt": "ab"})
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            "model is required: this gateway serves several (m, n)", r.text
    assert _aliased_link({"idle": 0}).only_model() is None


UNNAMED = [(path, body) for path, body in NAMED if path != "/detokenize"]
"""Every route that may leave ``model`` out (/detokenize: with its ids, the one tokenizer served)."""


@pytest.mark.parametrize("models, on_demand", [
    ({"a": model(1), "b": model()}, ("a", "b")),  # one of two on demand loaded: was served by it
    ({"a": model(), "b": model(loading=1)}, ("a", "b")),  # one loading, none loaded: was 503 "retry"
    ({"a": model(), "b": model()}, ("a", "b")),  # none loaded: was 503 "retry", forever
], ids=["one-loaded", "one-loading", "none-loaded"])
def test_a_request_without_a_model_among_several_on_demand_is_told_to_name_one(monkeypatch, models, on_demand):
    """The models a request may name are those ``GET /v1/models`` lists, loaded or not: with
    several on demand, a request without ``model`` went to whichever was loaded then (each time
    another, as they were loaded and unloaded), and with none loaded got 503 'retry', which no
    retry changed (nothing loads a model no request names)."""
    import gateway.app

    link = GivenApp(models, on_demand)
    monkeypatch.setattr(gateway.app, "BrokerConnections", lambda config: link)
    assert link.only_model() is None
    with TestClient(gateway.app.create_app(GatewayConfig())) as http:
        for path, body in UNNAMED:
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["message"] == "model is required: this gateway serves several (a, b)", path


def test_a_request_without_a_model_while_the_one_model_loads_is_told_it_loads(monkeypatch):
    """The one model a request may name is loading (``slotserve up`` starting): a request without
    ``model`` is answered as one naming it (503, it is loading), not 'no worker serves a model right
    now; retry, or name the model', as if naming it could help."""
    import gateway.app

    link = GivenApp({"boot": model(loading=1)})
    monkeypatch.setattr(gateway.app, "BrokerConnections", lambda config: link)
    assert link.only_model() == "boot"
    with TestClient(gateway.app.create_app(GatewayConfig())) as http:
        for path, body in UNNAMED:
            named = http.post(path, json={**body, "model": "boot"})
            r = http.post(path, json=body)
            assert r.status_code == named.status_code == 503, (path, r.text)
            assert r.json() == named.json() and "model `boot` is loading now" in r.text, (path, r.text)


class HfLetters:
    """A transformers tokenizer's stand-in over the letters (what ``add_special_tokens`` false reads)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return LetterCodec().encode(text)


@pytest.mark.parametrize("special", [True, False])
def test_an_empty_prompt_to_tokenize_is_told_so_in_the_same_words_either_way(special):
    """``add_special_tokens`` false said "prompt text must be a non-empty str" (Python's type name),
    true "prompt text must not be empty"."""
    app, _ = app_for(Tokenizers(lambda name: Tokenizer(LetterCodec(), HfLetters())))
    with TestClient(app) as http:
        r = http.post("/tokenize", json={"prompt": "", "add_special_tokens": special})
        e = r.json()["error"]
        assert r.status_code == 400 and (e["param"], e["message"]) == ("prompt", "prompt text must not be empty"), e
        r = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": special})
        assert r.status_code == 200 and r.json()["tokens"] == [0, 1], r.text
