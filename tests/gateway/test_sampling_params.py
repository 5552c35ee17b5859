"""Sampling controls over HTTP (issue 20, items 1-2): ``logit_bias``, ``presence_penalty`` and
``frequency_penalty`` in OpenAI's names (the ``openai`` SDK sends them), vLLM's extras
``repetition_penalty`` and ``min_p`` (``extra_body``), each giving the tokens the in-process
engine gives with the same options (the tiny text model, served by the transformers runner),
and out-of-range values answered 400 naming the field and the bound (OpenAI's error shape)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.support.gateway import error_of  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402

PROMPT = [11, 12, 13, 11, 12, 13, 11, 12]  # token ids: the same prompt in process and over HTTP


@pytest.fixture(scope="module")
def local(text_model):
    """The same model in process: ``run(max_tokens, **options)`` -> the generated text."""
    model = load_model(text_model)

    def run(max_tokens, **options):
        engine = BatchInferenceEngine(model, batch_size=1, stop_token="model")
        h = engine.submit_request(PROMPT, max_tokens, **options)
        engine.run()
        return model.tokenizer.decode(h.tokens)

    run.vocab_size = model.vocab_size
    return run


def test_the_sdk_sends_logit_bias_and_the_penalties_and_they_act(oai, text_model, local):
    plain = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert plain == local(8)
    biased = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"40": 100}).choices[0].text
    assert biased == local(4, logit_bias={40: 100}) == load_model(text_model).tokenizer.decode([40] * 4)
    penalised = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=2.0).choices[0].text
    assert penalised == local(8, presence_penalty=1.5, frequency_penalty=2.0)


def test_vllms_extras_come_in_extra_body(oai, text_model, local):
    r = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, temperature=0,
                               extra_body={"repetition_penalty": 1.7})
    assert r.choices[0].text == local(8, repetition_penalty=1.7)
    r = oai.completions.create(model=text_model, prompt=PROMPT, max_tokens=8, temperature=0.7, seed=3,
                               extra_body={"min_p": 0.2, "repetition_penalty": 1.2})
    assert r.choices[0].text == local(8, temperature=0.7, seed=3, min_p=0.2, repetition_penalty=1.2)
    chat = oai.chat.completions.create(model=text_model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logit_bias={"40": 100},
                                       frequency_penalty=0.5, extra_body={"min_p": 0.1, "repetition_penalty": 1.1})
    assert chat.choices[0].message.content == load_model(text_model).tokenizer.decode([40] * 4)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, says", [
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("repetition_penalty", 0, "> 0"),
    ("min_p", 1.5, "[0, 1]"),
    ("logit_bias", {"5": 101}, "[-100, 100]"),
    ("logit_bias", {"5": "x"}, "number"),
    ("logit_bias", {"abc": 1}, "token ids"),
    ("logit_bias", {"99999999": 1}, "vocabulary"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300"),
    ("logit_bias", {"9" * 5000: 1}, "token ids"),  # (int() refuses it: was a 500)
    ("logit_bias", {"7": 1, "07": 2}, "twice"),  # (one silently won)
    ("presence_penalty", "1", "number"),
])
def test_out_of_range_values_are_400_naming_the_field(cluster, text_model, path, field, value, says):
    body = {"model": text_model, "max_tokens": 2, field: value}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    e = error_of(httpx.post(cluster.http_url + path, json=body, timeout=30), 400)
    assert e["param"].split(".")[0] == field and e["type"] == "invalid_request_error", e  # (or its entry)
    assert says in e["message"], e
