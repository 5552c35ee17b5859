"""Logprobs, echo and the tokenizer endpoints in OpenAI's and vLLM's shapes (issue 20 items 4-5),
through the official ``openai`` SDK against the gateway's handlers over a scripted broker client:
no sockets, no processes. The handles are filled as the client fills them (each token's
:class:`TokenLogprob` before the token; the prompt's entries before the first token), so what is
checked here is the gateway's formatting: the SDK's types parse every field (extra fields would
not be caught by the SDK, so the field names are compared with the types' own). The live cluster
runs the same shapes end to end in test_openai_sdk.py."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob  # noqa: E402
from openai.types.completion_choice import Logprobs  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.logprobs import FLOOR  # noqa: E402
from gateway.tokenize import TokenizeEndpoints  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.support.scripted import (  # noqa: E402
    LETTERS, LetterCodec, ScriptedClient, ScriptedLink, entry, generated, handlers_app, letters)


@pytest.fixture(params=["tokenizer", "none"])
def setup(request):
    """``(sdk, client, has_tokenizer)``: the openai SDK on the handlers, with the letters tokenizer or none."""
    client = ScriptedClient()
    tokenizers = Tokenizers(letters if request.param == "tokenizer" else None)
    with TestClient(handlers_app(tokenizers, ScriptedLink(client))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        yield sdk, client, request.param == "tokenizer", http
    for t in client.threads:
        t.join(10)


def s(setup_has_tok: bool, token: int) -> str:
    """A token's string as the gateway shows it."""
    return LETTERS[token] if setup_has_tok else f"token_id:{token}"


def completion_object(tokens, entries, has_tok, offset=0) -> dict:
    """``choices[].logprobs`` written out by hand from the entries (the chosen token first in top_logprobs)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in zip(tokens, entries):
        out["tokens"].append(s(has_tok, t))
        out["text_offset"].append(offset)
        offset += len(s(has_tok, t))
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(max(e.logprob, FLOOR))
            top = {s(has_tok, t): max(e.logprob, FLOOR)}
            for i, lp in e.top:
                top.setdefault(s(has_tok, i), max(lp, FLOOR))
            out["top_logprobs"].append(top)
    return out


def field_names_match(obj: dict, model) -> None:
    assert set(obj) == set(model.model_fields), (sorted(obj), sorted(model.model_fields))


# ---------------------------------------------------------------------- completions


@pytest.mark.parametrize("n", [0, 1, 3, 20])
def test_completion_logprobs_are_openais_shape(setup, n):
    sdk, client, has_tok, _ = setup
    prompt = [1, 2, 3]
    r = sdk.completions.create(model="m", prompt=prompt, max_tokens=4, logprobs=n, temperature=0)
    (c,) = r.choices
    out = generated(prompt, 4)
    assert isinstance(c.logprobs, Logprobs) and c.token_ids == out
    assert c.logprobs.model_dump() == completion_object(out, [entry(t, n) for t in out], has_tok)
    field_names_match(c.logprobs.model_dump(), Logprobs)
    assert client.submitted[0].logprobs == n and client.submitted[0].prompt_logprobs is None
    assert all(len(top) == (1 if n == 0 else len({s(has_tok, t)} | {s(has_tok, i) for i, _ in entry(t, n).top}))
               for t, top in zip(out, c.logprobs.top_logprobs))
    assert FLOOR in c.logprobs.top_logprobs[0].values() if n >= 3 else True  # -inf became vLLM's -9999.0


def test_echo_with_logprobs_puts_the_prompt_tokens_first(setup):
    sdk, client, has_tok, _ = setup
    prompt = [7, 8, 9, 10]
    r = sdk.completions.create(model="m", prompt=prompt, max_tokens=2, logprobs=2, echo=True, temperature=0)
    (c,) = r.choices
    out = generated(prompt, 2)
    assert client.submitted[0].prompt_logprobs == 2 and client.submitted[0].logprobs == 2
    want = completion_object(prompt + out, [None] + [entry(t, 2) for t in prompt[1:]] + [entry(t, 2) for t in out],
                             has_tok)
    assert c.logprobs.model_dump() == want
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.text == ("hijk" if has_tok else "") + "lm"  # the prompt's text needs the tokenizer
    assert c.token_ids == out


def test_lm_evals_request_scores_the_prompt_by_token_ids_and_by_text(setup):
    """lm-eval's loglikelihood body: max_tokens 1, logprobs 1, echo, temperature 0; it sums
    token_logprobs[ctxlen:-1]. Batched prompts, token ids and (with a tokenizer) text."""
    sdk, client, has_tok, http = setup
    prompts = [[1, 2, 3, 4], [5, 6]]
    r = sdk.completions.create(model="m", prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    for p, c in zip(prompts, r.choices):
        assert len(c.logprobs.token_logprobs) == len(p) + 1
        assert c.logprobs.token_logprobs[1:-1] == [entry(t, 1).logprob for t in p[1:]]
    body = {"model": "m", "prompt": "abcd", "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    (c,) = r.json()["choices"]
    assert client.submitted[-1].prompt == "abcd"  # the worker tokenises it; its ids come with the logprobs
    assert c["logprobs"]["tokens"][:4] == [s(has_tok, t) for t in (0, 1, 2, 3)] and c["text"].startswith("abcd")
    assert c["logprobs"]["token_logprobs"][1:4] == [-0.5] * 3 and c["logprobs"]["token_logprobs"][0] is None
    assert c["logprobs"]["text_offset"][:2] == [0, len(s(has_tok, 0))]


def test_max_tokens_0_with_echo_returns_the_prompt_alone(setup):
    sdk, client, has_tok, http = setup
    r = sdk.completions.create(model="m", prompt=[3, 4, 5], max_tokens=0, echo=True, logprobs=0)
    (c,) = r.choices
    assert client.submitted[0].max_tokens == 1  # one token generated, then dropped
    assert c.finish_reason == "length" and c.token_ids == [] and r.usage.completion_tokens == 0
    assert c.text == ("def" if has_tok else "")
    assert c.logprobs.model_dump() == completion_object([3, 4, 5], [None, entry(4, 0), entry(5, 0)], has_tok)
    r = http.post("/v1/completions", json={"model": "m", "prompt": [3], "max_tokens": 0})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "max_tokens" and "echo" in e["message"]


def test_echo_without_logprobs_is_the_prompt_text_then_the_completion(setup):
    sdk, client, has_tok, _ = setup
    r = sdk.completions.create(model="m", prompt=[0, 1], max_tokens=3)
    assert r.choices[0].logprobs is None and r.choices[0].text == "cde"
    r = sdk.completions.create(model="m", prompt=[0, 1], max_tokens=3, echo=True)
    assert r.choices[0].text == ("ab" if has_tok else "") + "cde" and r.choices[0].logprobs is None
    assert client.submitted[-1].prompt_logprobs is None and client.submitted[-1].logprobs is None


def test_streamed_completion_logprobs_cover_each_chunks_tokens(setup):
    sdk, _, has_tok, _ = setup
    prompt = [2, 3]
    chunks = list(sdk.completions.create(model="m", prompt=prompt, max_tokens=5, logprobs=2, echo=True,
                                         stream=True))
    tokens, lps, offsets = [], [], []
    for ch in chunks:
        for c in ch.choices:
            if c.logprobs is not None:
                assert isinstance(c.logprobs, Logprobs)
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    out = generated(prompt, 5)
    want = completion_object(prompt + out, [None, entry(3, 2)] + [entry(t, 2) for t in out], has_tok)
    assert (tokens, lps, offsets) == (want["tokens"], want["token_logprobs"], want["text_offset"])
    assert chunks[0].choices[0].text == ("cd" if has_tok else "")  # the echo comes first
    assert "".join(c.text for ch in chunks for c in ch.choices) == ("cd" if has_tok else "") + "efghi"


def test_prompt_logprobs_is_vllms_extra(setup):
    sdk, client, has_tok, http = setup
    r = http.post("/v1/completions", json={"model": "m", "prompt": [4, 5, 6], "max_tokens": 1,
                                           "prompt_logprobs": 1})
    (c,) = r.json()["choices"]
    assert client.submitted[0].prompt_logprobs == 1 and client.submitted[0].logprobs is None
    assert c["logprobs"] is None and c["prompt_logprobs"][0] is None
    assert c["prompt_logprobs"][1] == {"5": {"logprob": -0.5, "rank": None, "decoded_token": s(has_tok, 5)},
                                       "6": {"logprob": -0.25, "rank": 1, "decoded_token": s(has_tok, 6)}}
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1,
                                                "prompt_logprobs": 0})
    (c,) = r.json()["choices"]
    ids = LetterCodec().apply_chat_template(MESSAGES)
    assert [None if d is None else list(d) for d in c["prompt_logprobs"]] == [None] + [[str(t)] for t in ids[1:]]


# ---------------------------------------------------------------------- chat

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("top", [None, 0, 2, 20])
def test_chat_logprobs_are_openais_shape(setup, top):
    sdk, client, has_tok, _ = setup
    kw = {} if top is None else {"top_logprobs": top}
    r = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, logprobs=True, **kw)
    (c,) = r.choices
    ids = LetterCodec().apply_chat_template(MESSAGES)
    out = generated(ids, 3)
    assert client.submitted[0].logprobs == (top or 0)
    content = c.logprobs.content
    assert [x.token for x in content] == [s(has_tok, t) for t in out]
    for x, t in zip(content, out):
        assert isinstance(x, ChatCompletionTokenLogprob) and x.logprob == -0.5
        assert x.bytes == list(s(has_tok, t).encode())
        assert [(y.token, y.logprob) for y in x.top_logprobs] == \
            [(s(has_tok, i), max(lp, FLOOR)) for i, lp in entry(t, top or 0).top]
        field_names_match(x.model_dump(), ChatCompletionTokenLogprob)
        for y in x.top_logprobs:
            field_names_match(y.model_dump(), TopLogprob)
    r = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_streamed_chat_logprobs_are_on_each_chunk(setup):
    sdk, _, has_tok, _ = setup
    chunks = list(sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, logprobs=True,
                                              top_logprobs=1, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    got = [x for ch in chunks[1:] for c in ch.choices for x in c.logprobs.content]
    out = generated(LetterCodec().apply_chat_template(MESSAGES), 4)
    assert [(x.token, x.logprob, len(x.top_logprobs)) for x in got] == [(s(has_tok, t), -0.5, 1) for t in out]
    # each chunk's logprobs cover exactly that chunk's tokens
    assert all(len(c.logprobs.content) == len(c.model_extra["token_ids"]) for ch in chunks[1:] for c in ch.choices)


# ---------------------------------------------------------------------- 400s


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": False, "top_logprobs": 2}, "top_logprobs",
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 1}, "logprobs", "bool"),
    ("/v1/completions", {"prompt": [1], "logprobs": 21}, "logprobs", "20"),
    ("/v1/completions", {"prompt": [1], "logprobs": -1}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": [1], "logprobs": True}, "logprobs", "int"),
    ("/v1/completions", {"prompt": [1], "top_logprobs": 2}, "top_logprobs", "logprobs: N"),
    ("/v1/completions", {"prompt": [1], "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ("/v1/completions", {"prompt": [1], "echo": "yes"}, "echo", "bool"),
    ("/v1/completions", {"prompt": [1], "logit_bias": {"40": 5}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {"prompt": [1], "logit_bias": {"4": "high"}}, "logit_bias.4", "number"),
])
def test_out_of_range_values_are_400_naming_the_field(setup, path, body, param, words):
    _, _, _, http = setup
    r = http.post(path, json={"model": "m", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and words in e["message"], e


# ---------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize_are_vllms_shapes(setup):
    _, _, has_tok, http = setup
    r = http.post("/tokenize", json={"prompt": "hello"})
    if not has_tok:
        e = r.json()["error"]
        assert r.status_code == 400 and e["code"] == "unsupported" and "tokenizer" in e["message"], r.text
        r = http.post("/detokenize", json={"tokens": [1]})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        return
    assert r.json() == {"count": 5, "max_model_len": 64, "tokens": [7, 4, 11, 11, 14], "token_strs": None}
    r = http.post("/tokenize", json={"model": "m", "messages": MESSAGES, "return_token_strs": True})
    ids = LetterCodec().apply_chat_template(MESSAGES)
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                        "token_strs": [LETTERS[i] for i in ids]}
    assert http.post("/detokenize", json={"tokens": [7, 4, 39]}).json() == {"prompt": "he?"}
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": MESSAGES},
                                                           "messages"),
                              ("/detokenize", {"tokens": [40]}, "tokens"), ("/detokenize", {"tokens": [1.5]},
                                                                          "tokens"),
                              ("/tokenize", {"prompt": "a", "extra": 1}, "extra")]:
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert json.loads(http.post("/tokenize", json={"prompt": "ab"}).text)["count"] == 2


def test_the_tokenizer_endpoints_need_an_api_key_as_v1_does():
    from gateway.auth import APIKeys

    link = ScriptedLink(ScriptedClient())
    tok = TokenizeEndpoints(link, Tokenizers(letters))
    app = Starlette(routes=[Route("/tokenize", tok.tokenize, methods=["POST"]),
                            Route("/detokenize", tok.detokenize, methods=["POST"])])
    guarded = APIKeys(app, api_keys=("k1",))
    with TestClient(guarded) as http:
        for path, body in [("/tokenize", {"prompt": "ab"}), ("/detokenize", {"tokens": [0]})]:
            assert http.post(path, json=body).status_code == 401
            assert http.post(path, json=body, headers={"Authorization": "Bearer k2"}).status_code == 401
            assert http.post(path, json=body, headers={"Authorization": "Bearer k1"}).status_code == 200
