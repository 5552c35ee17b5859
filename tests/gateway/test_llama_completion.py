"""llama.cpp's native ``POST /completion`` (and ``/completions``) and ``GET /props``, so that tools written
for ``llama-server`` work unchanged (both were a 404 naming the OpenAI route before): each prompt form
(a string, token ids, strings and ids mixed, several prompts), whole and streamed, stop words and EOS,
``n_predict`` -1 / 0 / N, the sampling fields with llama.cpp's defaults, a wrong type of every field (the
400 ``/infill`` answers for the same field), the API key, the metrics and the drain, and ``/props``'s
values from the served model. Over the gateway's handlers and a scripted broker client (no sockets, no
processes); the last test tokenises a mixed prompt with the tiny model's real tokenizer."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from client.handle import ClientHandle  # noqa: E402
from gateway.auth import APIKeys  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.drain import Drain  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.infill import InfillEndpoint  # noqa: E402
from gateway.link import BrokerConnections  # noqa: E402
from gateway.llama_completion import LlamaCompletionEndpoint  # noqa: E402
from gateway.llama_props import PropsEndpoint  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.tokenizer import Tokenizer, Tokenizers  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from protocol.messages import ModelInfo, ModelStatus, Status  # noqa: E402
from protocol.request import ModelLimits  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import LETTERS, VOCAB, LetterCodec, ScriptedClient, entry, generated  # noqa: E402

KEY = "sk-llama"
BOS = LETTERS.index(".")
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"}
PARTIAL_KEYS = {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"}
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


class BosLetters(LetterCodec):
    """The letters codec whose text starts with a BOS token (``.``), as a Llama tokenizer's does;
    ``encode(text, add_special_tokens=False)`` (as a transformers tokenizer's) leaves it out."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + super().encode(text)


class HfLike:
    """What the gateway's tokenizer reads of a transformers tokenizer here."""

    chat_template = TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return BosLetters().encode(text, add_special_tokens)


class Stops(ScriptedClient):
    """The scripted model (:func:`tests.support.scripted.generated`) as a worker runs it: ``max_tokens``
    lowered to what the context (64) leaves when the request asks (``clamp_max_tokens``), a stop
    string ends it ``stop`` (its text left out), the token ``?`` (39, EOS) too."""

    def _script(self, h: ClientHandle) -> None:
        p = h.params.prompt
        ids = list(p) if h.params.is_token_prompt else self.codec.encode(p)
        h._prompt_tokens = len(ids)
        h.first_token_s = time.monotonic()
        reason, why = FinishReason.LENGTH, None
        for t in generated(ids, ModelLimits(VOCAB, 64, True).fit(h.params, len(ids)).max_tokens):
            h._tokens.append(t)
            text = "".join(h._text) + self.codec.decode([t])
            word = next((s for s in h.params.stop if text.endswith(s)), None)
            if word is not None:  # (the word's start, held back as a worker holds it, is dropped)
                h._text[:] = [text[:-len(word)]]
                reason, why = FinishReason.STOP, word
                break
            h._text.append(self.codec.decode([t]))
            if h.logprobs is not None:
                h.logprobs.append(entry(t, h.params.logprobs))
            if h.on_token is not None:
                h.on_token(t)
            if t == 38 and h.params.stop_token != ():  # ("!" then the EOS token ends it, unless ignore_eos)
                if h.logprobs is not None:
                    h.logprobs.append(entry(39, h.params.logprobs))
                h._tokens.append(39)
                reason, why = FinishReason.STOP, 39
                break
        h._end(reason, why, None, time.monotonic())
        h.callback(h.tokens)
        h._done = True


class Link(BrokerConnections):
    """The gateway's broker link over a status the test gives (``{name: slots}`` of the models served,
    4 busy of the first's), each model's info a 64-token context; requests go to ``client``."""

    def __init__(self, client, slots: dict[str, int] | None = None, on_demand: tuple[str, ...] = (),
                 template: str = "") -> None:
        super().__init__(dataclasses.replace(GatewayConfig(), on_demand_models=on_demand))
        slots = {"m": 8} if slots is None else slots
        models = {m: ModelStatus(0, 1, 1 if n else 0, 1 if i == 0 else 0, n) for i, (m, n) in enumerate(slots.items())}
        self.status, self.broker_ok = Status("broker", 1.0, models, (), 0, {}), True
        self.client, self.template = client, template

    async def start(self) -> None:  # (no poller: the status is the test's, no broker is reached)
        pass

    async def refresh(self) -> Status:
        return self.status

    async def client_for(self, model: str):
        return self.client

    def model_info(self, model: str) -> ModelInfo | None:
        if model not in self.status.models or not self.status.models[model].workers:
            return None  # (none registered it yet)
        return ModelInfo(vocab_size=VOCAB, max_seq_len=64, eos_token_ids=(39,), has_tokenizer=True,
                         chat_template=self.template)


def tokenizer(name: str) -> Tokenizer | None:
    return Tokenizer(BosLetters(), HfLike()) if name == "m" else None


def llama_app(link, tokenizers: Tokenizers | None = None, drain: Drain | None = None,
              metrics: GatewayMetrics | None = None) -> Starlette:
    """llama.cpp's routes as the gateway's app serves them, behind the API key :data:`KEY`."""
    tokenizers = Tokenizers(tokenizer) if tokenizers is None else tokenizers
    drain = drain or Drain()
    gen = Generate(GatewayConfig(), link, metrics or GatewayMetrics(), drain, tokenizers)
    completion = LlamaCompletionEndpoint(gen)
    return Starlette(routes=[Route("/completion", completion.handle, methods=["POST"]),
                             Route("/completions", completion.handle, methods=["POST"]),
                             Route("/infill", InfillEndpoint(gen).infill, methods=["POST"]),
                             Route("/props", PropsEndpoint(link, tokenizers, drain).props, methods=["GET"])],
                     middleware=[Middleware(APIKeys, api_keys=(KEY,))])


@pytest.fixture
def served():
    """``(http, client)``: the app over :class:`Stops` and one model ``m`` (8 slots), the key sent."""
    client = Stops()
    with TestClient(llama_app(Link(client)), headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http, client
    for t in client.threads:
        t.join(10)


def complete(http, **body):
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(r) -> list[dict]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert "[DONE]" not in r.text
    return [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]


def letters(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids)


@pytest.mark.parametrize("prompt, ids", [
    ("abc", [0, 1, 2]),                                 # a string (the worker tokenises it)
    ([0, 1, 2], [0, 1, 2]),                             # token ids
    ([0, "bc", 3], [0, 1, 2, 3]),                       # mixed: a string after an id has no BOS
    (["ab", 2], [BOS, 0, 1, 2]),                        # mixed, a string first: BOS, as llama.cpp
    ([5, "a", "b", 9], [5, 0, 1, 9]),
])
def test_each_prompt_form_is_one_request_with_its_tokens(served, prompt, ids):
    http, client = served
    out = complete(http, prompt=prompt, n_predict=3, return_tokens=True)
    assert set(out) == FINAL_KEYS and set(out["timings"]) == TIMING_KEYS, out
    sent = client.submitted[0].prompt
    assert (sent if isinstance(sent, str) else list(sent)) == (prompt if isinstance(prompt, str) else ids)
    assert out["tokens"] == generated(ids, 3) and out["content"] == letters(generated(ids, 3))
    assert out["prompt"] == (prompt if isinstance(prompt, str) else letters(ids))
    assert (out["index"], out["stop"], out["model"], out["stop_type"], out["stopping_word"]) == \
        (0, True, "m", "limit", "")
    assert out["tokens_predicted"] == out["timings"]["predicted_n"] == 3
    assert out["tokens_evaluated"] == len(ids) and out["truncated"] is False
    assert out["generation_settings"]["n_predict"] == 3


@pytest.mark.parametrize("prompt, each", [
    (["ab", "cd"], ["ab", "cd"]),
    ([[0, 1], "cd", [2, "d"]], [[0, 1], "cd", [2, 3]]),
])
def test_several_prompts_answer_a_list_one_object_each(served, prompt, each):
    http, client = served
    out = complete(http, prompt=prompt, n_predict=2)
    assert isinstance(out, list) and [o["index"] for o in out] == list(range(len(each)))
    for o, p in zip(out, each):
        ids = LetterCodec().encode(p) if isinstance(p, str) else p
        assert o["content"] == letters(generated(ids, 2)) and o["tokens"] == [] and set(o) == FINAL_KEYS
    assert len(client.submitted) == len(each)


def test_tokens_come_back_with_return_tokens_only_and_always_in_a_stream(served):
    http, _ = served
    assert complete(http, prompt="ab", n_predict=2)["tokens"] == []
    assert complete(http, prompt="ab", n_predict=2, return_tokens=True)["tokens"] == [2, 3]
    *partial, final = events(http.post("/completion", json={"prompt": "ab", "n_predict": 2, "stream": True}))
    assert [t for e in partial for t in e["tokens"]] == [2, 3] and final["tokens"] == []


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_a_stream_is_llama_cpps_events_ending_with_stop_true(served, path):
    http, _ = served
    whole = complete(http, prompt="abc", n_predict=5)
    *partial, final = events(http.post(path, json={"prompt": "abc", "n_predict": 5, "stream": True}))
    assert partial and all(set(e) == PARTIAL_KEYS and e["stop"] is False for e in partial), partial
    assert "".join(e["content"] for e in partial) == whole["content"] == "defgh"
    assert final["stop"] is True and set(final) == FINAL_KEYS and final["content"] == "" and final["tokens"] == []
    assert final["tokens_predicted"] == 5 and final["generation_settings"]["stream"] is True


def test_several_prompts_stream_each_by_index_each_ending_stop_true(served):
    http, _ = served
    got = events(http.post("/completion", json={"prompt": ["ab", [5, 6]], "n_predict": 3, "stream": True}))
    for index, text in ((0, "cde"), (1, "hij")):
        mine = [e for e in got if e["index"] == index]
        assert "".join(e["content"] for e in mine) == text and mine[-1]["stop"] is True, got
        assert sum(e["stop"] for e in mine) == 1
    assert got[-1]["stop"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_word_ends_it_word_and_is_left_out(served, stream):
    http, client = served
    r = http.post("/completion", json={"prompt": "ab", "n_predict": 10, "stop": ["ef", "zz"], "stream": stream})
    final = events(r)[-1] if stream else r.json()
    assert (final["stop_type"], final["stopping_word"]) == ("word", "ef"), final
    assert client.submitted[0].stop == ("ef", "zz")
    if not stream:
        assert final["content"] == "cd" and final["generation_settings"]["stop"] == ["ef", "zz"]


def test_eos_ends_it_eos(served):
    http, _ = served
    out = complete(http, prompt=[36], n_predict=10)  # (" " then "." "!" and EOS)
    assert (out["stop_type"], out["stopping_word"]) == ("eos", ""), out


@pytest.mark.parametrize("n_predict", [-1, None])
def test_n_predict_minus_one_or_absent_runs_to_the_end_of_the_context(served, n_predict):
    http, client = served
    given = {} if n_predict is None else {"n_predict": n_predict}
    out = complete(http, prompt=[0, 1, 2, 3], ignore_eos=True, **given)
    assert client.submitted[0].max_tokens == 64 and client.submitted[0].clamp_max_tokens
    assert out["tokens_predicted"] == 60 and out["stop_type"] == "limit" and out["truncated"] is True


PREFETCH = {"input_prefix": "ab", "input_suffix": "c", "input_extra": [{"filename": "a.py", "text": "abc"}],
            "prompt": "d", "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
"""The shape of llama.vim's and llama.vscode's prefetch: ``/infill`` with ``n_predict`` 0 to have the
server evaluate (cache) the prompt and other files' chunks (the editors send an empty prefix and suffix
too, which the worker renders with the model's FIM tokens; the scripted model here cannot encode ""),
answered as ``/completion``'s ``n_predict`` 0."""


@pytest.mark.parametrize("path, body", [("/completion", {"prompt": "abc"}),
                                        ("/infill", {"input_prefix": "abc", "input_suffix": "de"})])
def test_n_predict_0_is_the_prompt_alone_on_both_routes(served, path, body):
    """``n_predict`` 0 evaluates the prompt and shows nothing, whole and streamed, on both routes
    (``/infill`` answered it 400 before)."""
    http, client = served
    for stream in (False, True):
        r = http.post(path, json={**body, "n_predict": 0, "stream": stream})
        out = events(r)[-1] if stream else r.json()
        assert r.status_code == 200, r.text
        assert (out["content"], out["tokens"], out["tokens_predicted"], out["stop"], out["stop_type"]) == \
            ("", [], 0, True, "limit"), out
        assert out["generation_settings"]["n_predict"] == 0 and out["timings"]["predicted_n"] == 0
        assert out["tokens_evaluated"] == 3  # ("abc": the scripted model reads the prefix alone)
        assert set(out) == FINAL_KEYS and set(out["timings"]) == TIMING_KEYS
        if stream:
            assert len(events(r)) == 1
        assert client.submitted[-1].max_tokens == 1  # (one token generated and dropped)
    r = http.post(path, json={**body, "n_predict": 0, "ignore_eos": True, "stream": True})
    assert [e["content"] for e in events(r)] == [""]


def test_the_editors_prefetch_body_is_served(served):
    http, client = served
    r = http.post("/infill", json=PREFETCH)
    assert r.status_code == 200 and r.json() == {}, r.text  # (response_fields [""]: nothing kept)
    assert client.submitted[-1].max_tokens == 1 and client.submitted[-1].input_extra == (("a.py", "abc"),)


def test_sampling_fields_and_llama_cpps_defaults(served):
    http, client = served
    complete(http, prompt="ab", n_predict=1)
    p = client.submitted[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.8, 40, 0.95, 0.05, None)
    out = complete(http, prompt="ab", n_predict=1, temperature=0.5, top_k=7, top_p=0.5, min_p=0.1, seed=42,
                   repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25, cache_prompt=True, n_probs=0,
                   id_slot=-1, timings_per_token=False, n_indent=0, priority=1, timeout_s=30)
    p = client.submitted[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, p.priority) == (0.5, 7, 0.5, 0.1, 42, 1.2, 0.5, 0.25, 1)
    s = out["generation_settings"]
    assert (s["temperature"], s["top_k"], s["seed"], s["repeat_penalty"]) == (0.5, 7, 42, 1.2)
    complete(http, prompt="ab", n_predict=1, seed=-1, top_k=0, temperature=0)
    assert (client.submitted[-1].seed, client.submitted[-1].top_k) == (None, 0)


def test_response_fields_keeps_only_those(served):
    http, _ = served
    out = complete(http, prompt="ab", n_predict=2, response_fields=["content", "generation_settings/n_predict", "x"])
    assert out == {"content": "cd", "generation_settings/n_predict": 2}


WRONG = [  # (field, a value of the wrong type); each answered as /infill answers it where /infill has the field
    ("model", 1), ("n_predict", "a"), ("n_predict", 1.5), ("n_predict", True), ("stream", "yes"),
    ("temperature", "x"), ("temperature", True), ("top_k", 1.5), ("top_p", "x"), ("min_p", []), ("seed", 1.5),
    ("stop", "x"), ("stop", [1]), ("repeat_penalty", "x"), ("presence_penalty", {}), ("frequency_penalty", "x"),
    ("ignore_eos", 1), ("priority", "x"), ("timeout_s", "x"), ("response_fields", "x"), ("cache_prompt", 1),
    ("id_slot", "x"), ("samplers", 1), ("n_indent", "x"), ("t_max_prompt_ms", "x"), ("t_max_predict_ms", "x"),
    ("n_probs", "x"), ("n_probs", 21), ("n_probs", -1), ("timings_per_token", 1), ("return_tokens", "yes"),
    ("mirostat", "x"), ("typical_p", "x"), ("repeat_last_n", 1.5), ("repeat_last_n", -2), ("grammar", 1),
    ("image_data", "x"), ("dry_sequence_breakers", [1]), ("api_key", 1), ("slot_id", "x"), ("n_keep", "x"),
    ("post_sampling_probs", 1), ("logit_bias", "x"), ("logit_bias", [[1]]), ("logit_bias", [[1, True]]),
    ("logit_bias", {"1": "x"}), ("logit_bias", [[1, 500]]), ("json_schema", 5), ("samplers", ["top_q"]),
    ("temperature", -1), ("top_p", 2), ("n_predict", 2 ** 70), ("repeat_penalty", 0), ("timeout_s", -1),
]


@pytest.mark.parametrize("field, value", WRONG, ids=[f"{f}={v!r}" for f, v in WRONG])
def test_a_wrong_value_of_a_field_is_the_400_infill_answers(served, field, value):
    http, client = served
    got = error_of(http.post("/completion", json={"prompt": "ab", "n_predict": 2, field: value}), 400)
    stream = got if field == "stream" else \
        error_of(http.post("/completion", json={"prompt": "ab", "n_predict": 2, field: value, "stream": True}), 400)
    infill = error_of(http.post("/infill", json={"input_prefix": "ab", "n_predict": 2, field: value}), 400)
    param = {"stop": "stop" if value == "x" else "stop.0", "logit_bias": "logit_bias" if value in ("x", [[1, 500]]) else
             "logit_bias.1" if isinstance(value, dict) else "logit_bias[0]",
             "dry_sequence_breakers": "dry_sequence_breakers.0"}.get(field, field)
    assert got == stream == infill and got["param"] == param, got
    assert "max_tokens" not in got["message"] and "repetition_penalty" not in got["message"], got
    assert not client.submitted


@pytest.mark.parametrize("prompt, words", [
    (5, "prompt must be a string, a list of token ids or a list mixing strings and token ids, or a list of those "
        "(several prompts), got 5"),
    (None, "got null"), ([], "prompt must not be empty"), ([1, 2.0], "token ids must be integers: prompt[1] is 2.0"),
    ([1, True], "prompt[1] is true"), ([[1, 2], [3, None]], "token ids must be integers: prompt[1][1] is null"),
    ([[1], 7], "prompt[1] must be a string, a list of token ids or a list mixing strings and token ids, got 7"),
    ([["a"], []], "prompt[1] must not be empty"), ({"prompt_string": "a"}, "no multimodal model is served"),
    ("", "empty"), ([1, 99], "99"), ([[1], [-1]], "-1"),
    # an empty string in a mixed prompt, named (was the tokenizer's "prompt text must be a non-empty str")
    ([1, ""], "prompt[1] is an empty string, which has no tokens: leave it out"), (["", 1], "prompt[0] is an empty"),
    ([[1, ""], "ab"], "prompt[0][1] is an empty string"),
    # an empty string among several prompts, named (was 'prompt must not be empty', after the first was sent)
    (["ab", ""], "prompt[1] must not be empty"), (["", [1]], "prompt[0] must not be empty"),
])
def test_a_bad_prompt_is_a_400_naming_it(served, prompt, words):
    http, client = served
    e = error_of(http.post("/completion", json={"prompt": prompt}), 400)
    assert e["param"] == "prompt" and words in e["message"], e
    assert len(client.submitted) == (prompt == [[1], [-1]])  # (the first of two was sent, then cancelled)


def test_missing_prompt_and_unknown_fields_are_400s(served):
    http, _ = served
    e = error_of(http.post("/completion", json={"n_predict": 2}), 400)
    assert (e["param"], e["code"]) == ("prompt", "missing_required_parameter"), e
    for field in ("max_tokens", "logprobs", "mirostat_mode"):
        e = error_of(http.post("/completion", json={"prompt": "a", field: 1}), 400)
        assert (e["param"], e["code"], e["message"]) == (field, "unknown_parameter",
                                                         f"Unrecognized request argument supplied: {field}"), e


def test_a_mixed_prompt_without_a_tokenizer_is_a_400_saying_so():
    client = Stops()
    with TestClient(llama_app(Link(client), Tokenizers(None)), headers={"Authorization": f"Bearer {KEY}"}) as http:
        e = error_of(http.post("/completion", json={"prompt": [0, "b"]}), 400)
        assert e["param"] == "prompt" and "mixes strings and token ids" in e["message"] and \
            "without a tokenizer" in e["message"], e
        out = http.post("/completion", json={"prompt": [0, 1], "n_predict": 1}).json()  # ids alone: served
        assert out["content"] == "c" and out["prompt"] == ""
    assert len(client.submitted) == 1


def test_every_llama_route_needs_the_api_key():
    client = Stops()
    with TestClient(llama_app(Link(client))) as http:
        for method, path in (("POST", "/completion"), ("POST", "/completions"), ("GET", "/props")):
            body = {"prompt": "ab", "n_predict": 1} if method == "POST" else None
            r = http.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = http.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, (path, r.text)
            r = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (path, r.text)
    assert len(client.submitted) == 2


def test_metrics_count_completion_as_a_model_route_and_the_drain_refuses_it():
    client, metrics, drain = Stops(), GatewayMetrics(), Drain()
    with TestClient(llama_app(Link(client), metrics=metrics, drain=drain),
                    headers={"Authorization": f"Bearer {KEY}"}) as http:
        complete(http, prompt="ab", n_predict=2)
        error_of(http.post("/completion", json={"prompt": 1}), 400)
        text = metrics.render().decode()
        assert 'slotserve_http_requests_total{endpoint="/completion",status="200"} 1.0' in text
        assert 'slotserve_http_requests_total{endpoint="/completion",status="400"} 1.0' in text
        assert 'slotserve_http_completion_tokens_total{model="m"} 2.0' in text
        drain.begin()
        for method, path in (("POST", "/completion"), ("GET", "/props")):
            r = http.request(method, path, json={"prompt": "ab"} if method == "POST" else None)
            assert r.status_code == 503 and "Retry-After" in r.headers, (path, r.text)
    assert len(client.submitted) == 1


def props(link, tokenizers: Tokenizers | None = None, query: str = ""):
    with TestClient(llama_app(link, tokenizers), headers={"Authorization": f"Bearer {KEY}"}) as http:
        return http.get("/props" + query)


def test_props_is_the_served_models_values():
    r = props(Link(Stops()))
    assert r.status_code == 200, r.text
    out = r.json()
    settings = out["default_generation_settings"]
    assert (settings["n_ctx"], settings["is_processing"], out["total_slots"]) == (64, True, 8)
    params = settings["params"]
    assert (params["n_predict"], params["temperature"], params["top_k"], params["top_p"], params["min_p"],
            params["seed"]) == (-1, 0.8, 40, 0.95, 0.05, 4294967295)
    assert (out["model_path"], out["model_alias"], out["is_sleeping"]) == ("m", "m", False)
    assert out["chat_template"] == TEMPLATE  # (the tokenizer's: no --chat-template)
    assert out["modalities"] == {"vision": False, "audio": False} and out["build_info"].startswith("slotserve")
    assert props(Link(Stops()), query="?model=m").json() == out
    assert props(Link(Stops(), template="{{ x }}")).json()["chat_template"] == "{{ x }}"  # (the worker's own)
    assert props(Link(Stops()), Tokenizers(None)).json()["chat_template"] == ""


def test_props_with_several_models_is_the_routers_answer_and_each_models_by_name():
    link = Link(Stops(), {"m": 8, "n": 2, "lazy": 0}, on_demand=("lazy",))
    out = props(link).json()
    assert out["role"] == "router" and out["models_autoload"] is True and out["model_path"] == "none", out
    assert out["default_generation_settings"] == {"params": {}, "n_ctx": 0}
    n = props(link, query="?model=n").json()
    assert (n["total_slots"], n["model_path"], n["is_sleeping"], n["default_generation_settings"]["n_ctx"]) == \
        (2, "n", False, 64)
    lazy = props(link, query="?model=lazy").json()
    assert (lazy["total_slots"], lazy["is_sleeping"], lazy["default_generation_settings"]["n_ctx"]) == (0, True, 0)
    e = error_of(props(link, query="?model=nope"), 404)
    assert (e["param"], e["code"]) == ("model", "model_not_found") and "nope" in e["message"], e
    assert props(Link(Stops(), {})).status_code == 503


def test_a_mixed_prompt_is_tokenised_with_the_models_real_tokenizer(tiny_text_dir):
    """The tiny model's tokenizer (a Llama one: BOS first): a string first gets BOS, a later one not."""
    transformers = pytest.importorskip("transformers")
    from worker.models.hf_text import HFTextCodec

    tok = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    real = Tokenizer(HFTextCodec(tok), tok)
    client = ScriptedClient(ModelLimits(len(tok), 64, True))
    with TestClient(llama_app(Link(client), Tokenizers(lambda name: real if name == "m" else None)),
                    headers={"Authorization": f"Bearer {KEY}"}) as http:
        first, last = tok("Hello")["input_ids"], tok(" world", add_special_tokens=False)["input_ids"]
        out = http.post("/completion", json={"prompt": ["Hello", 5, " world"], "n_predict": 1}).json()
        assert list(client.submitted[-1].prompt) == [*first, 5, *last]
        assert out["prompt"] == tok.decode([*first, 5, *last])
        http.post("/completion", json={"prompt": [5, "Hello"], "n_predict": 1})
        assert list(client.submitted[-1].prompt) == [5, *tok("Hello", add_special_tokens=False)["input_ids"]]
        # a logit_bias text is its tokens without BOS; completion_probabilities show the tokens' strings and bytes
        out = http.post("/completion", json={"prompt": [5, 6], "n_predict": 2, "n_probs": 1, "return_tokens": True,
                                             "logit_bias": [[" world", 2]]}).json()
        assert client.submitted[-1].logit_bias == tuple(sorted((t, 2.0 * last.count(t)) for t in set(last)))
        assert [(p["id"], p["token"], p["bytes"]) for p in out["completion_probabilities"]] == \
            [(t, real.token_str(t), real.token_bytes(t)) for t in out["tokens"]]
    for t in client.threads:
        t.join(10)


def test_continues_llama_cpp_provider_body_streams_as_it_reads_it(served):
    """Continue's ``LlamaCpp`` provider: ``POST /completion`` with its options, ``stream: true``, and it
    reads each ``data:`` line's ``content``."""
    http, _ = served
    body = {"prompt": "ab", "stream": True, "n_predict": 4, "frequency_penalty": 0, "presence_penalty": 0,
            "min_p": 0.05, "stop": ["zz"], "top_k": 40, "top_p": 0.95, "temperature": 0.2}
    assert "".join(e["content"] for e in events(http.post("/completion", json=body))) == "cdef"


def test_the_gateways_app_serves_them_behind_its_keys(monkeypatch):
    """The whole app (``create_app``): the routes, and ``--api-key`` guarding them."""
    import gateway.app

    client = Stops()
    monkeypatch.setattr(gateway.app, "BrokerConnections", lambda config: Link(client))
    with TestClient(gateway.app.create_app(GatewayConfig(api_keys=(KEY,)), load_tokenizer=tokenizer)) as http:
        assert http.get("/props").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/props", headers=auth).json()["total_slots"] == 8
        for path in ("/completion", "/completions"):
            assert http.post(path, json={"prompt": [0, "b"]}).status_code == 401
            r = http.post(path, json={"prompt": [0, "b"], "n_predict": 2}, headers=auth)
            assert r.status_code == 200 and r.json()["content"] == "cd", r.text
    for t in client.threads:
        t.join(10)


# ---------------------------------------------------------------- llama.cpp's other fields (gateway.llama_fields)

class AnyText(LetterCodec):
    """The letters codec reading any text (a character outside :data:`LETTERS` as a space), so that a
    client's own prompt (capitals, newlines, colons) can be sent as it is."""

    def encode(self, text: str) -> list[int]:
        return [LETTERS.index(c) if c in LETTERS else LETTERS.index(" ") for c in text.lower()]


WEB_UI = {  # llama.cpp's web UI (tools/server/public_legacy/index.html: params, then chat()'s runLlama and
    # completion.js's paramDefaults): what it POSTs to /completion for the user's message "hi"
    "stream": True, "n_predict": 400, "temperature": 0.7, "repeat_last_n": 256, "repeat_penalty": 1.18,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "top_k": 40,
    "top_p": 0.95, "min_p": 0.05, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1,
    "grammar": "", "n_probs": 0, "min_keep": 0, "image_data": [], "cache_prompt": True, "api_key": "",
    "slot_id": -1, "stop": ["</s>", "Llama:", "User:"],
    "prompt": "This is a conversation between User and Llama, a friendly chatbot. Llama is helpful, kind, honest, "
              "good at writing, and never fails to answer any requests immediately and with precision.\n\n"
              "User: hi\nLlama:",
}

NO_OPS = {  # every llama.cpp field at a value that changes nothing (its older web UI's tfs_z and penalize_nl too)
    "tfs_z": 1, "penalize_nl": False, "dynatemp_range": 0, "dynatemp_exponent": 1, "top_n_sigma": -1,
    "adaptive_target": -1, "adaptive_decay": 0.9, "dry_sequence_breakers": ["\n", ":"], "n_keep": 0, "n_discard": 0,
    "id_slot": -1, "n_cache_reuse": 0, "n_cmpl": 1, "lora": [], "return_progress": False, "sse_ping_interval": 10,
    "post_sampling_probs": False, "timings_per_token": False, "t_max_prompt_ms": 0, "t_max_predict_ms": 0,
    "n_indent": 0, "ignore_eos": False, "logit_bias": [], "xtc_probability": 0.5, "xtc_threshold": 0.6,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
}


def test_llama_cpps_web_ui_body_streams_with_its_sampling():
    client = Stops(ModelLimits(VOCAB, 1024, True))
    client.codec = AnyText()
    with TestClient(llama_app(Link(client)), headers={"Authorization": f"Bearer {KEY}"}) as http:
        out = events(http.post("/completion", json=WEB_UI))
    assert out[-1]["stop"] is True and out[-1]["stop_type"] in ("limit", "eos") and out[0]["content"], out[-1]
    p = client.submitted[-1]
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.stop, p.logit_bias,
            p.logprobs, p.structured) == (400, 0.7, 40, 0.95, 0.05, 1.18, ("</s>", "Llama:", "User:"), (), None, None)
    for t in client.threads:
        t.join(10)


def test_every_field_at_its_no_op_value_is_the_plain_request_on_both_routes(served):
    http, client = served
    for path, plain in (("/completion", {"prompt": "ab", "n_predict": 3}),
                        ("/infill", {"input_prefix": "ab", "n_predict": 3})):
        assert http.post(path, json=plain).status_code == 200
        bare = client.submitted[-1]
        ui = {k: v for k, v in WEB_UI.items() if k != "prompt"}
        for body in ({**ui, **NO_OPS, **plain, "stop": [], "stream": False}, {**plain, **NO_OPS}):
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            p = client.submitted[-1]
            assert p.sampling._replace(temperature=bare.temperature, repetition_penalty=1.0) == bare.sampling, path
            assert p.stop_token == bare.stop_token and p.max_tokens == 3


EFFECTFUL = [  # (field, value, what the 400 says)
    ("mirostat", 2, "mirostat 2: mirostat sampling is not supported; use temperature, top_k, top_p and min_p"),
    ("dynatemp_range", 0.5, "dynamic temperature is not supported"), ("typical_p", 0.9, "locally typical sampling"),
    ("tfs_z", 0.95, "tail-free sampling is not supported"), ("top_n_sigma", 1.5, "top-n-sigma sampling"),
    ("dry_multiplier", 0.8, "DRY sampling is not supported; use repeat_penalty"),
    ("xtc_probability", 0.5, "XTC sampling is not supported"), ("adaptive_target", 0.5, "adaptive-p sampling"),
    ("min_keep", 5, "min_keep > 1 is not supported"), ("n_cmpl", 2, "send the prompt several times"),
    ("image_data", [{"data": "AAAA", "id": 10}], "no multimodal model is served"),
    ("lora", [{"id": 0, "scale": 1.0}], "LoRA adapters are not supported"),
    ("return_progress", True, "prompt progress events are not supported"),
    ("post_sampling_probs", True, "post-sampling probabilities are not supported"),
    ("samplers", ["top_k", "mirostat"], "samplers[1] 'mirostat' is no sampler of llama.cpp's"),
    ("samplers", "kz", "unknown sampler letter 'z'"),
]


@pytest.mark.parametrize("field, value, words", EFFECTFUL, ids=[f"{f}={v!r}" for f, v, _ in EFFECTFUL])
def test_a_sampler_slotserve_has_not_is_a_400_naming_it_on_both_routes(served, field, value, words):
    http, client = served
    for path, body in (("/completion", {"prompt": "ab"}), ("/infill", {"input_prefix": "ab"})):
        for stream in (False, True):
            e = error_of(http.post(path, json={**body, field: value, "stream": stream}), 400)
            assert e["param"] == field and words in e["message"], e
    assert not client.submitted


def test_samplers_left_out_are_off_and_repeat_last_n_0_turns_the_penalties_off(served):
    http, client = served
    base = {"prompt": "ab", "n_predict": 1, "temperature": 0.5, "repeat_penalty": 1.2, "presence_penalty": 0.5}
    out = complete(http, **base, samplers=["top_k", "typ_p", "infill"])
    p = client.submitted[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty) == \
        (1.0, 40, 1.0, 0.0, 1.0, 0.0)
    assert (out["generation_settings"]["temperature"], out["generation_settings"]["top_p"]) == (1.0, 1.0)
    complete(http, **base, samplers="ekpmt")  # (llama.cpp's letters: all of them on)
    p = client.submitted[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.5, 40, 0.95, 0.05, 1.2)
    complete(http, **base, samplers=["Top-K", "nucleus", "temp"])  # (alternative names, as llama.cpp reads them)
    p = client.submitted[-1]
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty) == (0.5, 0.95, 0.0, 1.0)
    complete(http, **base, repeat_last_n=0)
    assert (client.submitted[-1].repetition_penalty, client.submitted[-1].presence_penalty) == (1.0, 0.0)
    complete(http, **base, repeat_last_n=64)
    assert (client.submitted[-1].repetition_penalty, client.submitted[-1].presence_penalty) == (1.2, 0.5)


B, C = LETTERS.index("b"), LETTERS.index("c")


@pytest.mark.parametrize("bias, want", [
    ([[5, 1.5]], ((5, 1.5),)), ([[5, False]], ((5, -100.0),)), ({"5": -2}, ((5, -2.0),)),
    ([["bc", -1]], ((B, -1.0), (C, -1.0))),  # (the text's tokens, no BOS)
    ({"bcb": 2}, ((B, 4.0), (C, 2.0))),  # (a token twice: its biases add up, as llama.cpp's entries)
    ([[B, False], ["b", 3]], ((B, -100.0),)), ([], ()), ([["", 1]], ()),
])
def test_logit_bias_in_llama_cpps_forms_on_both_routes(served, bias, want):
    http, client = served
    complete(http, prompt="ab", n_predict=1, logit_bias=bias)
    assert client.submitted[-1].logit_bias == want
    assert http.post("/infill", json={"input_prefix": "ab", "n_predict": 1, "logit_bias": bias}).status_code == 200
    assert client.submitted[-1].logit_bias == want


def test_a_logit_bias_text_without_the_models_tokenizer_is_a_400_saying_so():
    client = Stops()
    with TestClient(llama_app(Link(client), Tokenizers(lambda name: None)),
                    headers={"Authorization": f"Bearer {KEY}"}) as http:
        e = error_of(http.post("/completion", json={"prompt": [1, 2], "logit_bias": [["ab", 1]]}), 400)
        assert e["param"] == "logit_bias[0]" and "tokenizer" in e["message"], e
        r = http.post("/completion", json={"prompt": [1, 2], "n_predict": 1, "logit_bias": {"5": 1}})
        assert r.status_code == 200 and client.submitted[-1].logit_bias == ((5, 1.0),), r.text


PROB_KEYS = {"id", "token", "bytes", "logprob", "top_logprobs"}


def check_probs(probs: list[dict], tokens: list[int], n: int) -> None:
    """llama.cpp's ``completion_probabilities`` of ``tokens`` (the scripted entries: tests.support.scripted.entry)."""
    assert [p["id"] for p in probs] == tokens
    for p, t in zip(probs, tokens):
        want = entry(t, n)
        assert set(p) == PROB_KEYS and p["token"] == LETTERS[t] and p["bytes"] == list(LETTERS[t].encode()), p
        assert p["logprob"] == want.logprob
        assert [(q["id"], q["logprob"]) for q in p["top_logprobs"]] == [(i, max(lp, -9999.0)) for i, lp in want.top]
        assert all(set(q) == {"id", "token", "bytes", "logprob"} for q in p["top_logprobs"])


@pytest.mark.parametrize("path, body", [("/completion", {"prompt": "ab"}), ("/infill", {"input_prefix": "ab"})])
def test_n_probs_gives_completion_probabilities_whole_and_per_stream_event(served, path, body):
    http, client = served
    r = http.post(path, json={**body, "n_predict": 3, "n_probs": 2})
    out = r.json()
    assert r.status_code == 200 and client.submitted[-1].logprobs == 2, r.text
    check_probs(out["completion_probabilities"], [C, C + 1, C + 2], 2)
    assert out["generation_settings"]["n_probs"] == 2
    got = events(http.post(path, json={**body, "n_predict": 3, "n_probs": 3, "stream": True}))
    assert "completion_probabilities" not in got[-1] and got[-1]["stop"] is True
    for e in got[:-1]:
        check_probs(e["completion_probabilities"], e["tokens"], 3)
    assert [t for e in got[:-1] for t in e["tokens"]] == [C, C + 1, C + 2]
    assert "completion_probabilities" not in complete(http, prompt="ab", n_predict=2)


def test_json_schema_and_grammar_constrain_the_output(served):
    http, client = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    complete(http, prompt="ab", n_predict=2, json_schema=schema)
    c = client.submitted[-1].structured
    assert (c.kind, json.loads(c.spec)) == ("json_schema", schema)
    complete(http, prompt="ab", n_predict=2, json_schema={})  # (llama.cpp's "any JSON")
    assert client.submitted[-1].structured.kind == "json_schema"
    assert http.post("/infill", json={"input_prefix": "ab", "n_predict": 2, "grammar": 'root ::= "x"'}).status_code \
        == 200
    assert tuple(client.submitted[-1].structured[:2]) == ("gbnf", 'root ::= "x"')
    complete(http, prompt="ab", n_predict=2, grammar="")
    assert client.submitted[-1].structured is None
    e = error_of(http.post("/completion", json={"prompt": "ab", "json_schema": schema, "grammar": 'root ::= "x"'}), 400)
    assert e["param"] == "grammar" and "not several" in e["message"], e


@pytest.mark.parametrize("field, spec, words, said", [
    ("grammar", 'root ::= "x', "structured gbnf does not compile: unterminated string",
     "grammar does not compile: unterminated string"),
    ("json_schema", {"type": "nope"}, "structured json_schema does not compile: unknown type",
     "json_schema does not compile: unknown type"),
])
def test_a_grammar_the_worker_cannot_compile_is_a_400_naming_the_field(field, spec, words, said):
    from tests.support.scripted import RefusingClient

    client = RefusingClient(words)
    with TestClient(llama_app(Link(client)), headers={"Authorization": f"Bearer {KEY}"}) as http:
        for stream in (False, True):
            e = error_of(http.post("/completion", json={"prompt": "ab", field: spec, "stream": stream}), 400)
            assert (e["param"], e["message"]) == (field, said), e
    for t in client.threads:
        t.join(10)


def test_timings_per_token_puts_the_timings_so_far_in_each_stream_event(served):
    http, _ = served
    got = events(http.post("/completion", json={"prompt": "ab", "n_predict": 3, "stream": True,
                                                "timings_per_token": True}))
    assert all(set(e["timings"]) == TIMING_KEYS and e["timings"]["predicted_n"] == e["tokens_predicted"]
               for e in got), got
    assert all("timings" not in e for e in events(http.post("/completion", json={"prompt": "ab", "n_predict": 3,
                                                                                 "stream": True}))[:-1])


LLAMA_ROUTES = [("/completion", {"prompt": "ab", "n_predict": 2}), ("/completions", {"prompt": "ab", "n_predict": 2}),
                ("/infill", {"input_prefix": "ab", "n_predict": 2})]


@pytest.mark.parametrize("path, body", LLAMA_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "text/plain; charset=utf-8", None])
def test_a_json_body_sent_as_text_or_form_is_read_as_llama_cpp_reads_it(served, path, body, content_type):
    """``curl -d '{...}'`` without ``-H`` (the form type) and ``text/plain`` bodies: llama-server parses
    any body as JSON (was a 400 ``unsupported_media_type`` here, as on the OpenAI routes), whole and
    streamed."""
    http, client = served
    headers = {} if content_type is None else {"content-type": content_type}
    for stream in (False, True):
        r = http.post(path, content=json.dumps({**body, "stream": stream}).encode(), headers=headers)
        out = events(r)[-1] if stream else r.json()
        assert r.status_code == 200 and out["tokens_predicted"] == 2, (content_type, r.text)


@pytest.mark.parametrize("path, body", LLAMA_ROUTES)
def test_llama_routes_still_refuse_what_is_no_json(served, path, body):
    http, _ = served
    raw = json.dumps(body).encode()
    for headers in ({"content-type": "application/xml"}, {"content-type": "multipart/form-data; boundary=x"},
                    {"content-type": "text/plain; charset=latin-1"},
                    {"content-type": "text/plain", "content-encoding": "gzip"}):
        e = error_of(http.post(path, content=raw, headers=headers), 400)
        assert e["code"] == "unsupported_media_type", e
        assert "(or text/plain, application/x-www-form-urlencoded, read as JSON" in e["message"], e  # what it takes
    e = error_of(http.post(path, content=b"prompt=ab&n_predict=2",
                           headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert e["code"] == "invalid_json" and e["message"] == (
        "the body is not valid JSON at line 1 column 1: expected a value (the body, sent as "
        "application/x-www-form-urlencoded, is read as JSON, as llama.cpp's server reads it)"), e
    e = error_of(http.post(path, content=b'{"n_predict": 2,}', headers={"content-type": "application/json"}), 400)
    assert e["code"] == "invalid_json" and "sent as" not in e["message"]  # (declared JSON: no note)


class AnyHf(HfLike):
    """:class:`HfLike` reading any text without special tokens (a character outside :data:`LETTERS` as
    a space, 36), as a real tokenizer reads any text."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens:
            return super().encode(text)
        return [LETTERS.index(c) if c in LETTERS else LETTERS.index(" ") for c in text]


@pytest.mark.parametrize("key, want", [
    ("5", ((5, 1.0),)), (" 5", ((5, 1.0),)), ("+5", ((5, 1.0),)),  # (what llama.cpp's strtol reads as an id)
    ("\uff15", ((36, 1.0),)), ("\u00b2", ((36, 1.0),)), ("1_0", ((26, 1.0), (27, 1.0), (36, 1.0))),  # (texts)
])
def test_a_logit_bias_key_is_an_id_only_as_llama_cpp_reads_one(key, want):
    """An object key is a token id when C's strtol reads it whole (ASCII digits), else a text: a
    fullwidth "５" was token 5 and "1_0" token 10 (Python's int reads them), and a superscript "²" was
    told the model has no tokenizer (a text, read as neither)."""
    client = Stops()
    with TestClient(llama_app(Link(client), Tokenizers(lambda name: Tokenizer(BosLetters(), AnyHf()))),
                    headers={"Authorization": f"Bearer {KEY}"}) as http:
        complete(http, prompt="ab", n_predict=1, logit_bias={key: 1})
    assert client.submitted[-1].logit_bias == tuple(sorted(want)), client.submitted[-1].logit_bias
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("field, value, words", [
    ("logit_bias", [[1, None]], "logit_bias[0] must be a number, or false to ban the token, got null"),
    ("logit_bias", {"5": True}, "logit_bias.5 must be a number, or false to ban the token, got true"),
    ("logit_bias", [[None, 1]], "logit_bias[0] must be [token id or text, bias], got an array [null, 1]"),
    ("logit_bias", "x", "bias}, got a string 'x'"),
    ("return_progress", True, "return_progress true: prompt progress events"),
    ("image_data", [{"data": "AA", "id": None}], 'image_data [{"data": "AA", "id": null}]: images are not'),
    ("lora", [{"id": 0, "scale": False}], 'lora [{"id": 0, "scale": false}]: LoRA adapters'),
    # (json's own words before: "json_schema is not valid JSON: Expecting value: line 1 column 1 (char 0)")
    ("json_schema", "x", "json_schema is not valid JSON at line 1 column 1: expected a value"),
])
def test_a_refused_value_is_shown_as_the_json_the_client_sent(served, field, value, words):
    """Python's notation of a value (True, None, a dict's repr) never reaches a client: each refusal
    shows the JSON it was sent as (the four logit_bias ones and the three others said True, None,
    [None, 1] and [{'data': 'AA', 'id': None}])."""
    http, client = served
    e = error_of(http.post("/completion", json={"prompt": "ab", field: value}), 400)
    assert words in e["message"], e
    assert not client.submitted


def test_too_many_prompts_are_refused_before_any_is_tokenised():
    """max_choices + 1 token prompts: the 400 comes before the gateway decodes each for its answer's
    prompt (a body of a million prompts cost a decode each, then the same 400)."""
    decoded = []

    class Counting(BosLetters):
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            decoded.append(ids)
            return super().decode(ids, skip_special_tokens)

    client = Stops()
    with TestClient(llama_app(Link(client), Tokenizers(lambda name: Tokenizer(Counting(), HfLike()))),
                    headers={"Authorization": f"Bearer {KEY}"}) as http:
        n = GatewayConfig().max_choices + 1
        e = error_of(http.post("/completion", json={"prompt": [[1, "b"]] * n, "n_predict": 1}), 400)
        assert (e["param"], e["message"]) == ("prompt", f"{n} prompts; at most {n - 1} per HTTP request"), e
        assert not decoded and not client.submitted
        assert http.post("/completion", json={"prompt": [[1, "b"]] * 2, "n_predict": 1}).status_code == 200
        assert len(decoded) == 2  # (served: each prompt decoded for its answer)
    for t in client.threads:
        t.join(10)
