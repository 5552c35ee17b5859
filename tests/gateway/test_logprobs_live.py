"""Logprobs, echo and the tokenizer endpoints end to end (issue 20 items 4-5): the official ``openai``
SDK against a live cluster (broker, a worker serving the tiny text model, the gateway started by the
launcher with the model's tokenizer, as ``slotserve up --http-port`` does). Values are checked
against the in-process engine on the same model (the same raw logprobs, 1e-4), token strings and
``/tokenize`` against the model's own tokenizer."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402

PROMPT = [11, 12, 13, 11, 12, 13, 11, 12]
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def local(text_model):
    """The same model in process: ``run(prompt, max_tokens, **options)`` -> the engine's handle."""
    model = load_model(text_model)

    def run(prompt, max_tokens, **options):
        engine = BatchInferenceEngine(model, batch_size=1, stop_token="model")
        h = engine.submit_request(prompt, max_tokens, **options)
        engine.run()
        return h

    run.tokenizer = model.tokenizer
    return run


def close(a, b, tol=1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_completion_logprobs_are_the_engines(oai, text_model, local):
    r = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0)
    (c,) = r.choices
    h = local(PROMPT, 6, logprobs=3)
    assert c.token_ids == h.tokens
    assert close(c.logprobs.token_logprobs, [e.logprob for e in h.logprobs])
    assert c.logprobs.tokens == [local.tokenizer.decode([t], skip_special_tokens=False) for t in h.tokens]
    def text(t):
        return local.tokenizer.decode([t], skip_special_tokens=False)

    for top, e, t in zip(c.logprobs.top_logprobs, h.logprobs, h.tokens):
        want = {text(t): e.logprob}  # the chosen token first, then the 3 most likely (vLLM's; a string
        for i, lp in e.top:          # two tokens share, e.g. U+FFFD of partial characters, is one key)
            want.setdefault(text(i), lp)
        assert list(top) == list(want) and close(list(top.values()), list(want.values()))
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == 0


def test_lm_evals_loglikelihood_request(oai, text_model, local):
    """lm-eval's body: batched token-id prompts and a text prompt, max_tokens 1, logprobs 1, echo, greedy;
    it sums token_logprobs[ctxlen:-1], which must be the engine's prompt logprobs."""
    prompts = [PROMPT, PROMPT[:3] + [40, 41]]
    r = oai.completions.create(model=text_model, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                               temperature=0)
    for p, c in zip(prompts, r.choices):
        h = local(p, 1, logprobs=1, prompt_logprobs=1)
        lp = c.logprobs
        assert len(lp.tokens) == len(p) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert close(lp.token_logprobs[1:-1], [e.logprob for e in h.prompt_logprobs[1:]])
        assert close(lp.token_logprobs[-1:], [h.logprobs[0].logprob])
        assert c.text == local.tokenizer.decode(p, skip_special_tokens=False) + local.tokenizer.decode(h.tokens)
    text = "hello world, hello"
    (c,) = oai.completions.create(model=text_model, prompt=text, max_tokens=1, logprobs=1, echo=True,
                                  temperature=0).choices
    ids = local.tokenizer.encode(text)
    h = local(ids, 1, prompt_logprobs=1)
    assert c.text.startswith(text) and "".join(c.logprobs.tokens[:len(ids)]) == text
    assert close(c.logprobs.token_logprobs[1:len(ids)], [e.logprob for e in h.prompt_logprobs[1:]])


def test_max_tokens_0_with_echo_scores_the_prompt_alone(oai, text_model, local):
    (c,) = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0).choices
    h = local(PROMPT, 1, prompt_logprobs=0)
    assert c.finish_reason == "length" and c.token_ids == [] and len(c.logprobs.tokens) == len(PROMPT)
    assert close(c.logprobs.token_logprobs[1:], [e.logprob for e in h.prompt_logprobs[1:]])


def test_streamed_completion_logprobs_equal_the_whole_answer(oai, text_model):
    whole = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, logprobs=2, echo=True,
                                   temperature=0).choices[0].logprobs
    tokens, lps = [], []
    for ch in oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, logprobs=2, echo=True,
                                     temperature=0, stream=True):
        for c in ch.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert tokens == whole.tokens and lps[0] is None and close(lps[1:], whole.token_logprobs[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_engines(oai, text_model, local, stream):
    kw = dict(model=text_model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0)
    if stream:
        content = [x for ch in oai.chat.completions.create(**kw, stream=True) for c in ch.choices
                   if c.logprobs is not None for x in c.logprobs.content]
    else:
        content = oai.chat.completions.create(**kw).choices[0].logprobs.content
    h = local(MESSAGES, 5, logprobs=2)
    assert [x.token for x in content] == [local.tokenizer.decode([t], skip_special_tokens=False) for t in h.tokens]
    assert close([x.logprob for x in content], [e.logprob for e in h.logprobs])
    assert all(len(x.top_logprobs) == 2 for x in content)
    # bytes: each token's own (a partial character's bytes, not U+FFFD's): they add up to the text's
    # (the random model's bytes need not be valid UTF-8: decoded lossily, as the tokenizer does)
    assert b"".join(bytes(x.bytes) for x in content).decode("utf-8", "replace") == \
        local.tokenizer.decode(h.tokens, skip_special_tokens=False)
    assert all(x.bytes == list(x.token.encode()) for x in content if "\ufffd" not in x.token)


def test_tokenize_and_detokenize(cluster, text_model, local):
    url = cluster.http_url
    r = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()
    ids = local.tokenizer.encode("hello world")
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 512
    chat = httpx.post(url + "/tokenize", json={"model": text_model, "messages": MESSAGES}).json()
    assert chat["tokens"] == local.tokenizer.apply_chat_template(MESSAGES)
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}


def test_a_logit_bias_id_outside_the_vocabulary_is_400(oai, text_model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=2, logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias" and "vocabulary" in e.value.message


@pytest.mark.parametrize("chat, kw, param, words", [
    (True, {"logprobs": True, "top_logprobs": 30}, "top_logprobs", "[0, 20]"),
    (True, {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    (False, {"logprobs": 21}, "logprobs", "[0, 20]"),
    (False, {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs", "[0, 20]"),
    (False, {"logit_bias": {"5": "high"}}, "logit_bias.5", "number"),
    (False, {"max_tokens": 0}, "max_tokens", "echo"),
])
def test_the_sdks_out_of_range_values_are_400_naming_the_field(oai, text_model, chat, kw, param, words):
    kw = {"max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            oai.chat.completions.create(model=text_model, messages=MESSAGES, **kw)
        else:
            oai.completions.create(model=text_model, prompt=PROMPT, **kw)
    assert e.value.body["param"] == param and words in e.value.message, e.value.body


@pytest.mark.parametrize("chat", [False, True])
def test_vllms_prompt_logprobs_name_the_workers_prompt_tokens(oai, text_model, local, chat):
    """A text or chat prompt's tokens come from the worker that tokenised it, with their logprobs."""
    if chat:
        c = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=1,
                                        extra_body={"prompt_logprobs": 2}).choices[0]
        ids = local.tokenizer.apply_chat_template(MESSAGES)
    else:
        c = oai.completions.create(model=text_model, prompt="hello world, hello", max_tokens=1,
                                   extra_body={"prompt_logprobs": 2}).choices[0]
        ids = local.tokenizer.encode("hello world, hello")
    got = c.model_extra["prompt_logprobs"]
    h = local(ids, 1, prompt_logprobs=2)
    assert len(got) == len(ids) and got[0] is None
    for d, t, e in zip(got[1:], ids[1:], h.prompt_logprobs[1:]):
        assert list(d)[0] == str(t) and abs(d[str(t)]["logprob"] - e.logprob) <= 1e-4
        assert d[str(t)]["decoded_token"] == local.tokenizer.decode([t], skip_special_tokens=False)
        assert [int(k) for k in list(d)[1:]] == [i for i, _ in e.top if i != t][:len(d) - 1]
