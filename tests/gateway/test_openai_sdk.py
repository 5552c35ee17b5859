"""The HTTP gateway through the official ``openai`` SDK, against a live cluster.

One cluster for the module: a broker, a simulated worker (token ids only;
its results are checked against the in-process engine), a worker running a
tiny random Llama with a real tokenizer and chat template (text and chat;
checked against the Python client on the same cluster), and the gateway
started by the launcher, as ``slotserve up --http-port`` does.
"""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from client import Client  # noqa: E402
import gateway  # noqa: E402
from gateway import GatewayConfig  # noqa: E402
from tests.support.gateway import metric, start_cluster, wait_until  # noqa: E402
from tests.support.reference import simulated_reference  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402


@pytest.fixture(scope="module")
def cluster(text_model):
    workers = (WorkerConfig(model="simulated", num_slots=8), WorkerConfig(model=text_model, num_slots=4))
    c = start_cluster(workers, gateway=GatewayConfig(port=0), models=("simulated", text_model))
    try:
        yield c
    finally:
        c.stop()


def python_client_result(cluster, model, prompt, max_tokens, **kw):
    """The same request through the Python SDK: (tokens, text, finish_reason, prompt_tokens)."""
    with Client(cluster.frontend, model=model) as c:
        h = c.submit_request(prompt, max_tokens, **kw)
        h.result(timeout=60)
        return h.tokens, h.text, h.finish_reason.value, h.prompt_tokens


# ---------------------------------------------------------------------- completions


def test_completion_of_token_ids_equals_the_engine(oai):
    prompt = [5, 17, 42]
    r = oai.completions.create(model="simulated", prompt=prompt, max_tokens=12)
    tokens, reason = simulated_reference(prompt, 12)
    (choice,) = r.choices
    assert choice.token_ids == tokens and choice.finish_reason == reason and choice.index == 0
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "simulated"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (3, len(tokens), 3 + len(tokens))


def test_several_prompts_and_n_choices(oai):
    prompts = [[1, 2, 3], [9, 8], [400, 401, 402, 403]]
    r = oai.completions.create(model="simulated", prompt=prompts, max_tokens=7, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        tokens, reason = simulated_reference(prompts[c.index // 2], 7)
        assert (c.token_ids, c.finish_reason) == (tokens, reason)
    assert r.usage.prompt_tokens == 9  # each prompt counted once, whatever n
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)


def test_streamed_completion_equals_the_plain_one(oai):
    prompt = [300, 301, 302]
    plain = oai.completions.create(model="simulated", prompt=prompt, max_tokens=40,
                                   extra_body={"stop_token_ids": [7], "ignore_eos": True})
    chunks = list(oai.completions.create(model="simulated", prompt=prompt, max_tokens=40, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"stop_token_ids": [7], "ignore_eos": True}))
    tokens = [t for ch in chunks for c in ch.choices for t in c.token_ids]
    assert tokens == plain.choices[0].token_ids
    assert tokens == simulated_reference(prompt, 40, stop_token=7)[0]
    finals = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason is not None]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(oai):
    # vLLM's stream_options.continuous_usage_stats was accepted and silently ignored (usage: null)
    prompt = [300, 301, 302]
    chunks = list(oai.completions.create(model="simulated", prompt=prompt, max_tokens=9, n=2, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body={"stop_token_ids": [], "ignore_eos": True}))
    sent = 0
    for ch in chunks[:-1]:
        sent += sum(len(c.token_ids) for c in ch.choices)
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens, ch.usage.total_tokens) == (3, sent, 3 + sent)
    assert sent == 18 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_stop_sequences_of_token_ids(oai):
    prompt = [11, 12, 13]
    free, _ = simulated_reference(prompt, 30, stop_token=None)
    seq = free[4:6]
    r = oai.completions.create(model="simulated", prompt=prompt, max_tokens=30, stop=[seq],
                               extra_body={"ignore_eos": True})
    expected, reason = simulated_reference(prompt, 30, stop_token=None, stop_sequences=[seq])
    assert r.choices[0].token_ids == expected and r.choices[0].finish_reason == reason == "stop"


def test_text_completion_equals_the_python_client(oai, cluster, text_model):
    r = oai.completions.create(model=text_model, prompt="hello world", max_tokens=16, temperature=0)
    tokens, text, reason, prompt_tokens = python_client_result(cluster, text_model, "hello world", 16)
    c = r.choices[0]
    assert (c.text, c.token_ids, c.finish_reason) == (text, tokens, reason)
    assert r.usage.prompt_tokens == prompt_tokens > 0 and r.usage.completion_tokens == len(tokens)


def test_text_of_a_token_id_prompt(oai, cluster, text_model):
    r = oai.completions.create(model=text_model, prompt=[5, 6, 7], max_tokens=12, temperature=0)
    tokens, text, _, _ = python_client_result(cluster, text_model, [5, 6, 7], 12)
    assert r.choices[0].token_ids == tokens and r.choices[0].text == text == tokenizer(text_model).decode(tokens)


# ---------------------------------------------------------------------- text stop strings


def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


def stop_spanning_tokens(tok, tokens, text) -> str:
    """A stop string from the middle of ``text`` that lies in no single token (so it spans
    several), away from broken characters."""
    singles = [tok.decode([t]) for t in tokens]
    for at in range(len(text) // 4, len(text) - 6):
        stop = text[at:at + 5]
        if "\ufffd" not in text[at - 1:at + 6] and not any(stop in s for s in singles):
            return stop
    raise AssertionError(f"no stop string to pick from {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(oai, cluster, text_model, include):
    free_tokens, free_text, _, _ = python_client_result(cluster, text_model, "hello world", 40, stop_token=None)
    stop = stop_spanning_tokens(tokenizer(text_model), free_tokens, free_text)
    kw = dict(model=text_model, prompt="hello world", max_tokens=40, temperature=0, stop=["never in it", stop],
              extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    r = oai.completions.create(**kw)
    (c,) = r.choices
    at = free_text.index(stop)
    assert c.text == free_text[:at + len(stop) if include else at]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert c.token_ids == free_tokens[:len(c.token_ids)] and stop in tokenizer(text_model).decode(c.token_ids)
    assert (c.token_ids, c.text) == python_client_result(
        cluster, text_model, "hello world", 40, stop_token=None, stop=["never in it", stop],
        include_stop_str_in_output=include)[:2]
    chunks = list(oai.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text  # no stop string shown, not even its start
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == c.token_ids
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_chat_stop_string_streamed_and_not(oai, cluster, text_model):
    free_tokens, free_text, _, _ = python_client_result(cluster, text_model, MESSAGES, 40, stop_token=None)
    stop = stop_spanning_tokens(tokenizer(text_model), free_tokens, free_text)
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=40, temperature=0, stop=stop,
              extra_body={"ignore_eos": True})
    plain = oai.chat.completions.create(**kw).choices[0]
    assert plain.message.content == free_text[:free_text.index(stop)] and plain.finish_reason == "stop"
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == plain.message.content


def test_stop_strings_for_a_model_without_tokenizer_are_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="simulated", prompt=[1, 2], max_tokens=4, stop=["x"])
    assert "tokenizer" in e.value.message and e.value.body["param"] == "stop"
    assert e.value.body["code"] == "unsupported"


# ---------------------------------------------------------------------- chat


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_equals_the_python_client(oai, cluster, text_model):
    r = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    tokens, text, reason, prompt_tokens = python_client_result(cluster, text_model, MESSAGES, 20)
    (c,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.message.content == text and c.finish_reason == reason
    assert c.token_ids == tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, len(tokens))


def test_streamed_chat_deltas_add_up(oai, text_model):
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=24, temperature=0)
    plain = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.delta.role is None for ch in chunks[1:] for c in ch.choices)
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert content == plain.choices[0].message.content
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == \
        len(plain.choices[0].token_ids)


def test_chat_content_parts_are_joined(oai, text_model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    a = oai.chat.completions.create(model=text_model, messages=parts, max_tokens=8, temperature=0)
    b = oai.chat.completions.create(model=text_model, messages=[{"role": "user", "content": "Say hello."}],
                                    max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_seeds_are_reproducible_and_choices_get_seed_plus_index(oai, text_model):
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=24, temperature=1.0)
    a = oai.chat.completions.create(seed=7, **kw).choices[0].token_ids
    assert oai.chat.completions.create(seed=7, **kw).choices[0].token_ids == a
    assert oai.chat.completions.create(seed=8, **kw).choices[0].token_ids != a
    three = oai.chat.completions.create(seed=7, n=3, **kw).choices
    assert [c.token_ids for c in three] == \
        [oai.chat.completions.create(seed=7 + i, **kw).choices[0].token_ids for i in range(3)]


# ---------------------------------------------------------------------- errors


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt=[1], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 100_000]}, "prompt"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"extra_body": {"top_k": -3}}, "top_k"),
    ({"extra_body": {"timeout_s": 0}}, "timeout_s"),
    ({"max_tokens": 511}, "prompt"),  # prompt + max_tokens over the tiny model's 512-token context
    ({"max_tokens": 2000}, "max_tokens"),  # max_tokens alone: no prompt fits beside it
])
def test_invalid_values_are_400_naming_the_field(oai, text_model, kw, param):
    kw = {"model": text_model, "prompt": [5, 6], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"prompt": [5, 6]}, "prompt"),                   # token ids: the client's check
    ("/v1/completions", {"prompt": "hello world"}, "prompt"),            # text: the worker's, after tokenising
    ("/v1/completions", {"prompt": ["hello world", "hi"], "n": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "messages"),        # chat: the worker's
])
def test_context_exceeded_is_the_same_400_on_every_path(cluster, text_model, stream, path, fields, param):
    # it was code "invalid_value" for token ids (found by the client) and "bad_request" for text (by the worker)
    # (a budget that fits alone: one that does not is refused naming it, tests/gateway/test_refusal_words.py)
    r = httpx.post(cluster.http_url + path, json={"model": text_model, "max_tokens": 511, "stream": stream, **fields},
                   timeout=30)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["type"], e["code"], e["param"]) == ("invalid_request_error", "context_length_exceeded", param), e
    assert "exceeds the served context of 512 tokens (--max-model-len)" in e["message"]


def test_text_for_a_model_without_tokenizer_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="simulated", messages=MESSAGES, max_tokens=4)
    assert "tokenizer" in e.value.message and e.value.body["param"] == "messages"


@pytest.mark.parametrize("kw, param", [
    ({"best_of": 3}, "best_of"),
])
def test_unsupported_features_are_501_and_not_retried(cluster, text_model, kw, param):
    before = metric(cluster.http_url, "slotserve_http_requests_total", endpoint="/v1/completions", status="501")
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=2) as retrying:
        with pytest.raises(openai.APIStatusError) as e:
            retrying.completions.create(model=text_model, prompt="hi", max_tokens=4, **kw)
    assert e.value.status_code == 501 and e.value.body["param"] == param
    assert e.value.body["code"] == "unsupported"
    assert metric(cluster.http_url, "slotserve_http_requests_total", endpoint="/v1/completions", status="501") == before + 1


def test_legacy_functions_in_chat_are_501(oai, text_model):
    """(tools are served: tests/gateway/test_tools.py; the deprecated functions field is not)"""
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=4, functions=functions)
    assert e.value.status_code == 501 and e.value.body["param"] == "functions"


# ---------------------------------------------------------------------- many at once, models, health, metrics


def test_many_concurrent_streams(cluster):
    prompts = [[i + 1, (7 * i) % 999 + 1] for i in range(64)]

    async def one(c, prompt):
        stream = await c.completions.create(model="simulated", prompt=prompt, max_tokens=25, stream=True)
        return [t async for ch in stream for ch_c in ch.choices for t in ch_c.token_ids]

    async def main():
        async with openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0,
                                      http_client=None) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [simulated_reference(p, 25)[0] for p in prompts]


def test_a_fresh_gateway_knows_every_models_context_before_its_first_request(cluster, text_model):
    # max_model_len (and the chat default max_tokens derived from it) came only from the model's own
    # client, made on its first request: a fresh gateway's /v1/models left it out for every model but one
    stop, ready = threading.Event(), []
    t = threading.Thread(target=gateway.run, args=(GatewayConfig(broker=cluster.frontend, port=0),),
                         kwargs={"stop": stop, "on_ready": ready.append})
    t.start()
    try:
        url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 30, "/health")
        models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert models[text_model]["max_model_len"] == 512
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()


def test_models_health_and_metrics(oai, cluster, text_model):
    models = oai.models.list()
    name = os.path.basename(text_model)  # (a model folder is served by its name, its path an alias)
    assert {m.id for m in models.data} == {"simulated", name, text_model}
    for tiny in (m for m in models.data if m.id in (name, text_model)):
        assert tiny.owned_by == "slotserve" and tiny.max_model_len == 512
    for m in models.data:  # OpenAI's retrieve, by each listed name (the folder's path: its / sent as %2F)
        assert oai.models.retrieve(m.id) == m
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "(models: " in e.value.message
    h = httpx.get(cluster.http_url + "/health")
    assert h.status_code == 200 and h.json()["models"] == {"simulated": 1, name: 1, text_model: 1}
    before = metric(cluster.http_url, "slotserve_http_completion_tokens_total", model="simulated")
    r = oai.completions.create(model="simulated", prompt=[3, 4], max_tokens=9)
    assert metric(cluster.http_url, "slotserve_http_completion_tokens_total", model="simulated") == \
        before + r.usage.completion_tokens
    oai.chat.completions.create(model=text_model, messages=MESSAGES, max_completion_tokens=2)  # this test's own
    text = httpx.get(cluster.http_url + "/metrics").text
    assert 'slotserve_http_ttft_seconds_count{endpoint="/v1/completions"}' in text
    assert 'slotserve_http_request_latency_seconds_count{endpoint="/v1/chat/completions"}' in text


# ---------------------------------------------------------------------- cached tokens (issue 23)
# OpenAI's usage.prompt_tokens_details.cached_tokens: the text model's worker runs with its prefix
# cache on (sized from the machine); a repeated prompt reuses every whole 16-token block of it but
# the one holding its last token.

SYSTEM = "You are a careful assistant who answers in one short sentence and never repeats itself. " * 3


def reused(prompt_tokens: int) -> int:
    """What a repeat of an already cached prompt of ``prompt_tokens`` tokens gets from the cache."""
    from worker.models.llama.prefix_cache import BLOCK_TOKENS

    return (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_a_repeated_chat_prompt_reports_its_cached_tokens_plain_and_streamed(oai, cluster, text_model):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a slot?"}]
    kw = dict(model=text_model, messages=messages, max_tokens=4, temperature=0)
    first = oai.chat.completions.create(**kw)
    n = first.usage.prompt_tokens
    cold = first.usage.prompt_tokens_details.cached_tokens
    assert type(cold) is int and cold % 16 == 0 and cold < reused(n)  # (what warm-up left may hit)
    before = metric(cluster.http_url, "slotserve_http_cached_tokens_total", model=text_model)
    again = oai.chat.completions.create(**kw)
    assert again.usage.prompt_tokens == n and again.usage.prompt_tokens_details.cached_tokens == reused(n) > 0
    assert metric(cluster.http_url, "slotserve_http_cached_tokens_total", model=text_model) == before + reused(n)
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == n
    assert usage.prompt_tokens_details.cached_tokens == reused(n)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_report_0_on_a_miss_and_count_each_prompt_once(oai, text_model):
    prompt = "slotserve keeps the keys and values of earlier prompts in blocks of sixteen tokens " * 2
    kw = dict(model=text_model, max_tokens=3, temperature=0)
    miss = oai.completions.create(prompt=[7, 8, 9], **kw)  # shorter than a block: never a hit
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    first = oai.completions.create(prompt=prompt, **kw)
    n = first.usage.prompt_tokens
    r = oai.completions.create(prompt=[prompt, prompt], n=2, **kw)  # two prompts, four choices: counted twice
    assert r.usage.prompt_tokens == 2 * n and r.usage.prompt_tokens_details.cached_tokens == 2 * reused(n)
    chunks = list(oai.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused(n)
