"""Fill in the middle over HTTP: ``suffix`` on ``/v1/completions`` (the ``openai`` SDK) and llama.cpp's
``/infill`` (plain and streamed, with ``requests``), the same request through ``Client``, the 400s
for models without FIM tokens, and the prefix cache across keystrokes.

Three tiny models with random weights (tests/support/tiny_text.py): ``fim`` has Qwen2.5-Coder's FIM
tokens as special tokens, ``plain`` has them as ordinary tokens, ``nofim`` has none. The text is
gibberish; greedy makes it reproducible, so the paths are compared with each other.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import requests

from tests.support.gateway import error_of

PREFIX = "def add(a, b):\n    slotserve batches requests into slots; every iteration decodes one token per slot\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
INFILL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
               "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
               "tokens_cached", "timings"}
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from tests.support.tiny_text import make_tiny_text_model

    return {mode or "nofim": make_tiny_text_model(tmp_path_factory.mktemp(f"tiny-{mode}"), fim=mode)
            for mode in ("special", "plain", None)}


@pytest.fixture(scope="module")
def cluster(models):
    from gateway.config import GatewayConfig
    from tests.support.gateway import start_cluster
    from worker.config import WorkerConfig

    workers = tuple(WorkerConfig(model=m, num_slots=2) for m in models.values())
    c = start_cluster(workers, gateway=GatewayConfig(port=0), models=tuple(models.values()))
    try:
        yield c
    finally:
        c.stop()


def _infill(cluster, model, **body):
    return requests.post(cluster.http_url + "/infill", json={"model": model, "temperature": 0, **body}, timeout=60)


def test_openai_sdk_suffix_is_fill_in_the_middle(oai, models):
    fim = models["special"]
    out = oai.completions.create(model=fim, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    plain = oai.completions.create(model=fim, prompt=PREFIX, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 5  # the suffix and the FIM tokens were read
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    empty = oai.completions.create(model=fim, prompt=PREFIX, suffix="", max_tokens=8, temperature=0)
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens  # "" is OpenAI's "no suffix"


def test_streamed_suffix_adds_up_to_the_plain_answer(oai, models):
    fim = models["special"]
    whole = oai.completions.create(model=fim, prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
    chunks = list(oai.completions.create(model=fim, prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids


def test_infill_is_llama_cpps_shape_and_agrees_with_suffix(cluster, oai, models):
    fim = models["special"]
    r = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=12)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == INFILL_KEYS and set(out["timings"]) == TIMING_KEYS
    assert out["stop"] is True and out["stop_type"] in ("eos", "limit") and out["model"] == fim
    assert out["tokens_predicted"] == len(out["tokens"]) and out["timings"]["predicted_n"] == len(out["tokens"])
    same = oai.completions.create(model=fim, prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
    assert out["tokens"] == same.choices[0].token_ids and out["content"] == same.choices[0].text
    assert out["tokens_evaluated"] == same.usage.prompt_tokens


def test_infill_prompt_extends_the_prefix_and_input_extra_comes_first(cluster, models):
    fim = models["special"]
    split = _infill(cluster, fim, input_prefix=PREFIX[:20], prompt=PREFIX[20:], input_suffix=SUFFIX, n_predict=6).json()
    whole = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=6).json()
    assert split["tokens"] == whole["tokens"]
    extra = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=6,
                    input_extra=[{"filename": "util.py", "text": "X = 1\n"}]).json()
    assert extra["tokens_evaluated"] > whole["tokens_evaluated"]


def test_infill_stream_is_llama_cpps_events_without_done(cluster, models):
    fim = models["special"]
    plain = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=10).json()
    r = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=10, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in r.text
    *partial, final = events
    assert all(set(e) == {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"}
               and e["stop"] is False for e in partial)
    assert final["stop"] is True and set(final) == INFILL_KEYS and final["content"] == "" and final["tokens"] == []
    assert "".join(e["content"] for e in partial) == plain["content"]
    assert [t for e in partial for t in e["tokens"]] == plain["tokens"]
    assert final["tokens_predicted"] == len(plain["tokens"])


def test_infill_response_fields_keeps_only_those(cluster, models):
    out = _infill(cluster, models["special"], input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=4,
                  response_fields=["content", "timings/prompt_n", "nope"]).json()
    assert set(out) == {"content", "timings/prompt_n"}


def test_infill_accepts_what_editors_send(cluster, models):
    """llama.vscode's and llama.vim's body (their fields, beside the FIM ones)."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [], "prompt": "", "n_predict": 4,
            "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_ms", "truncated"]}
    r = requests.post(cluster.http_url + "/infill", json={"model": models["special"], **body}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode, plain", [("plain", True), ("nofim", False)])
def test_a_model_without_fim_tokens_is_400_naming_them(cluster, oai, models, mode, plain):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=models[mode], prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    assert e.value.body["param"] == "suffix" and "<|fim_prefix|>" in e.value.message
    assert ("not as special tokens" in e.value.message) is plain
    err = error_of(_infill(cluster, models[mode], input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=4), 400)
    assert err["param"] == "input_suffix" and "fill-in-the-middle" in err["message"]
    r = _infill(cluster, models[mode], input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=4, stream=True)
    assert error_of(r, 400)["param"] == "input_suffix"  # before the stream starts
    assert oai.completions.create(model=models[mode], prompt=PREFIX, max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_suffix_refusals(cluster, oai, models):
    fim = models["special"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=fim, prompt=[1, 2, 3], suffix=SUFFIX, max_tokens=4)
    assert e.value.body["param"] == "suffix" and "text prompt" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=fim, prompt=PREFIX, suffix=SUFFIX, max_tokens=4, echo=True)
    assert e.value.body["param"] == "echo"
    assert error_of(_infill(cluster, fim, input_prefix=5), 400)["param"] == "input_prefix"
    assert error_of(_infill(cluster, fim, input_prefix="a", unknown_field=1), 400)["param"] == "unknown_field"
    assert error_of(_infill(cluster, fim, input_extra=[{"file": "x"}]), 400)["param"].startswith("input_extra")


def test_the_editors_prefetch_n_predict_0_is_served(cluster, models):
    """llama.vim's and llama.vscode's prefetch (other files' chunks, empty prefix and suffix, ``n_predict``
    0, to have them evaluated and cached): the prompt alone, nothing generated shown (was a 400)."""
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    for stream, chunks in ((False, extra), (True, extra), (False, [])):  # ([]: a client's probe for /infill)
        r = _infill(cluster, models["special"], input_prefix="", input_suffix="", input_extra=chunks, prompt="",
                    n_predict=0, samplers=[], cache_prompt=True, t_max_prompt_ms=1, t_max_predict_ms=1, stream=stream)
        assert r.status_code == 200, r.text
        out = r.json() if not stream else \
            [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
        if stream:
            assert len(out) == 1, out  # (the final object alone)
            out = out[0]
        assert (out["content"], out["tokens_predicted"], out["stop"], out["stop_type"]) == ("", 0, True, "limit"), out
        assert out["tokens_evaluated"] > (10 if chunks else 0) and set(out["timings"]) == TIMING_KEYS


def test_an_empty_prefix_is_served(cluster, models):
    r = _infill(cluster, models["special"], input_prefix="", input_suffix=SUFFIX, n_predict=3)
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] >= 1


def test_client_takes_suffix_and_input_extra_as_http_does(cluster, oai, models):
    from client import Client

    fim = models["special"]
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    http = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=extra, n_predict=8).json()
    with Client(cluster.frontend, model=fim) as c:
        h = c.submit_request(PREFIX, 8, suffix=SUFFIX, input_extra=extra)
        h.result(timeout=60)
    assert h.tokens == http["tokens"] and h.text == http["content"]
    assert h.usage.prompt_tokens == http["tokens_evaluated"]


def test_a_keystroke_reuses_the_file_prefix(cluster, models):
    """The editor's pattern: the same file resent with one more character; its prefix is cached."""
    fim = models["special"]
    body = {"input_prefix": PREFIX * 3, "input_suffix": SUFFIX, "n_predict": 2}
    first = _infill(cluster, fim, **body).json()
    again = _infill(cluster, fim, **{**body, "input_prefix": body["input_prefix"] + "r"}).json()
    assert again["timings"]["cache_n"] >= 16 * ((first["tokens_evaluated"] - 30) // 16)
    assert again["timings"]["prompt_n"] + again["timings"]["cache_n"] == again["tokens_evaluated"]


def test_infill_without_a_model_name_uses_the_one_served_or_asks(cluster):
    r = httpx.post(cluster.http_url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=30)
    assert error_of(r, 400)["param"] == "model"  # three models here


def test_a_jsonl_row_takes_suffix_and_input_extra_as_http_does(cluster, models):
    import io

    from client import Client
    from slotserve.job import run_job

    fim = models["special"]
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    http = _infill(cluster, fim, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=extra, n_predict=6).json()
    rows = [{"id": "fim", "prompt": PREFIX, "suffix": SUFFIX, "input_extra": extra, "max_tokens": 6},
            {"id": "bad", "prompt": [1, 2], "suffix": SUFFIX, "max_tokens": 6}]
    out = io.StringIO()
    with Client(cluster.frontend, model=fim, connect_timeout_s=20) as c:
        run_job(c, io.StringIO("\n".join(json.dumps(r) for r in rows) + "\n"), out, progress=False, timeout_s=60)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert got["fim"]["tokens"] == http["tokens"] and got["fim"]["text"] == http["content"]
    assert got["bad"]["finish_reason"] == "error" and "suffix needs a text prompt" in got["bad"]["error"]["message"]
