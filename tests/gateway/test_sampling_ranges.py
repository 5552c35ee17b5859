"""A sampling number outside its vendor's range is a 400 in that vendor's error shape naming the field,
whole and streamed, before anything is submitted: on /v1/chat/completions, /v1/completions and
/v1/responses OpenAI's ranges (``temperature`` [0, 2], ``top_p`` (0, 1], the penalties [-2, 2], ``n``
[1, 128], ``logprobs`` / ``top_logprobs`` [0, 20]), on /v1/messages Anthropic's (``temperature`` and
``top_p`` [0, 1], ``top_k`` >= 0, ``max_tokens`` >= 1). Was: ``temperature: 5`` served on all four
routes, ``temperature: 1.5`` and ``top_k: -1`` (vLLM's "off") on /v1/messages. Each bound itself is
served. Over the handlers apps with a scripted broker client, no sockets."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from pydantic import ValidationError

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.support.gateway import error_of, vendor_routes  # noqa: E402
from tests.support.scripted import KEY, ScriptedClient, letters  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
BODIES = {  # route -> (path, a body that is served, headers)
    "chat": ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 2}, {}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, {}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, {}),
    "messages": ("/v1/messages", {"model": "m", "messages": HI, "max_tokens": 2}, {"x-api-key": KEY}),
}
OPENAI = {"temperature": ([5, 2.0001, -1, -0.5], [0, 2, 0.7]),
          "top_p": ([1.5, 0, -0.1], [1, 0.5]),
          "presence_penalty": ([3, -2.5], [2, -2]),
          "frequency_penalty": ([2.01, -3], [2, -2]),
          "n": ([0, 129], [1, 2])}
# (field, bad values, served values) per route; where a field needs another beside it, ``EXTRA``
RANGES = {
    "chat": {**OPENAI, "top_logprobs": ([21, -1], [0, 20])},
    "completions": {**OPENAI, "logprobs": ([21, -1], [0, 20]), "best_of": ([0, -1, 21, 10**6], [1])},
    "responses": {"temperature": OPENAI["temperature"], "top_p": OPENAI["top_p"], "top_logprobs": ([21, -1], [0, 20]),
                  "max_output_tokens": ([0, -1], [1])},
    "messages": {"temperature": ([5, 1.0001, -1], [0, 1, 0.5]), "top_p": ([1.5, -0.5], [1, 0.5]),
                 "top_k": ([-1, -5], [0, 40]), "max_tokens": ([0, -5], [1])},
}
EXTRA = {("chat", "top_logprobs"): {"logprobs": True}}
CASES = [(route, field, v) for route, fields in RANGES.items() for field, (bad, _) in fields.items() for v in bad]
SERVED = [(route, field, v) for route, fields in RANGES.items() for field, (_, ok) in fields.items() for v in ok]


@pytest.fixture(scope="module")
def apps():
    client = ScriptedClient()
    with vendor_routes(client, Tokenizers(letters)) as routes:
        yield routes, client


def post(apps, route: str, field: str, value, **more):
    http, client = apps[0][route], apps[1]
    path, body, headers = BODIES[route]
    return http.post(path, json={**body, **EXTRA.get((route, field), {}), field: value, **more}, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route, field, value", CASES)
def test_a_number_outside_the_vendor_s_range_is_a_400_naming_it(apps, route, field, value, stream):
    submitted = len(apps[1].submitted)
    r = post(apps, route, field, value, stream=stream)
    if route == "messages":  # Anthropic's shape: no param, the message starts with the field
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        error = r.json()["error"]
        assert set(error) == {"type", "message"} and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(field) and str(value) in error["message"], error
    else:
        e = error_of(r, 400)
        assert e["param"] == field and e["message"].startswith((field, f"Invalid value for '{field}'")), e
        assert str(value) in e["message"], e
    assert len(apps[1].submitted) == submitted  # refused before anything ran


@pytest.mark.parametrize("route, field, value", SERVED)
def test_each_bound_is_served(apps, route, field, value):
    r = post(apps, route, field, value)
    assert r.status_code == 200, r.text


LONG = int("9" * 300)  # a number past the 100 characters an error echoes (protocol.validation.ECHO_MAX_CHARS)


@pytest.mark.parametrize("route, field", [("chat", "temperature"), ("completions", "temperature"),
                                          ("responses", "temperature"), ("messages", "temperature"),
                                          ("messages", "top_p")])
def test_a_long_number_is_echoed_cut_as_every_echo_is(apps, route, field):
    # OpenAI's temperature echoed all 300 digits (Python's repr, uncut); Anthropic's ranges cut it
    r = post(apps, route, field, LONG)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "9" * 100 + "… (300 characters)" in message and "9" * 101 not in message, message


@pytest.mark.parametrize("route", sorted(BODIES))
@pytest.mark.parametrize("text", ["1e308", "5.0", "-2.5E1", "3"])
def test_the_number_refused_is_shown_as_json_writes_it(apps, route, text):
    # the echo is the number's JSON (json.dumps: 1e308 is '1e+308', valid JSON, as JavaScript's JSON.stringify
    # writes it too), never a Python spelling such as inf or nan; it reads back as the number sent
    http, path, (_, body, headers) = apps[0][route], BODIES[route][0], BODIES[route]
    raw = json.dumps(body)[:-1] + f', "temperature": {text}}}'
    r = http.post(path, content=raw, headers={**headers, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    shown = r.json()["error"]["message"].rsplit("got ", 1)[1]
    assert json.loads(shown) == json.loads(text), shown


def test_one_range_check_words_each_vendor_s_refusal():
    from pydantic import BaseModel

    from gateway.schemas import in_range

    class Body(BaseModel):
        openai: Annotated[float | None, in_range("openai", 0, 2, " (0 = greedy)")] = None
        anthropic: Annotated[float | None, in_range("anthropic", 0, 1, words="anthropic")] = None
        floor: Annotated[int | None, in_range("floor", 0, words="anthropic")] = None

    def message(**field):
        with pytest.raises(ValidationError) as e:
            Body(**field)
        return e.value.errors()[0]["msg"]

    assert message(openai=5) == "openai must be in [0, 2] (0 = greedy), got 5"
    assert message(anthropic=1.5) == "anthropic: Input should be less than or equal to 1; got 1.5"
    assert message(anthropic=-0.5) == "anthropic: Input should be greater than or equal to 0; got -0.5"
    assert message(floor=-1) == "floor: Input should be greater than or equal to 0; got -1"
    assert Body(openai=2, anthropic=0, floor=10**9) == Body(openai=2.0, anthropic=0.0, floor=10**9)
    assert Body(openai=None).openai is None
    with pytest.raises(ValueError, match="words must be 'openai' or 'anthropic'"):
        in_range("x", 0, 1, words="other")


# route -> (field, value, more): the gateway's own number checks, and the request's behind them
LONG_REFUSALS = [("chat", "max_tokens", -LONG, {}), ("chat", "max_completion_tokens", -LONG, {}),
                 ("chat", "max_completion_tokens", LONG, {"max_tokens": LONG - 1}),  # (the two disagree)
                 ("chat", "top_logprobs", LONG, {"logprobs": True}), ("chat", "seed", -LONG, {}),
                 ("completions", "logprobs", LONG, {}), ("completions", "max_tokens", LONG, {}),
                 ("responses", "max_output_tokens", -LONG, {}), ("responses", "top_logprobs", LONG, {}),
                 ("messages", "max_tokens", -LONG, {}), ("messages", "top_k", LONG, {}),
                 ("messages", "thinking", {"type": "enabled", "budget_tokens": -LONG}, {}),
                 ("messages", "thinking", {"type": "enabled", "budget_tokens": LONG}, {})]  # (over max_tokens)


@pytest.mark.parametrize("route, field, value, more", LONG_REFUSALS)
def test_each_number_check_echoes_a_long_number_cut(apps, route, field, value, more):
    # each wrote the number whole (f"{value}"): 300 digits in the message
    r = post(apps, route, field, value, **more)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "… (30" in message and "9" * 103 not in message, message


@pytest.mark.parametrize("n, best_of, status", [(2, 1, 400), (3, 2, 400), (2, 21, 400), (25, 20, 400),
                                                (2, 2, 200), (2, 3, 501), (1, 20, 501)])
def test_best_of_below_n_or_past_20_is_a_400_and_other_values_in_range_a_501(apps, n, best_of, status):
    # best_of 0, -1 or 21 was the 501 of a valid value not implemented, and best_of 1 with n 2 was served
    r = post(apps, "completions", "best_of", best_of, n=n)
    assert r.status_code == status, r.text
    if status != 200:
        e = r.json()["error"]
        assert e["param"] == "best_of" and e["code"] == ("invalid_value" if status == 400 else "unsupported"), e
    if status == 400 and n <= 20:
        assert e["message"] == (f"best_of must be in [{n}, 20] (at least n: the best n of best_of candidates are "
                                f"returned), got {best_of}"), e


@pytest.mark.parametrize("best_of", [20, 25, 1])
def test_best_of_with_n_above_20_is_told_to_leave_best_of_out(apps, best_of):
    # it said 'best_of must be in [25, 20]': a range no value is in
    e = post(apps, "completions", "best_of", best_of, n=25).json()["error"]
    assert e["message"] == ("best_of must be at least n (25) and at most 20, which no value is: leave best_of out for n "
                            f"above 20, got {best_of}") and e["param"] == "best_of" and e["code"] == "invalid_value", e
    assert post(apps, "completions", "max_tokens", 2, n=25).status_code == 200  # (n 25 alone is served)
