"""``stop_reason`` is vLLM's: the stop string, sequence or token id that ended a choice, and None when
the model's EOS ended it ("None if the completion finished for some other reason including
encountering the EOS token"; vLLM's check_stop tests EOS before ``stop_token_ids``). Was: the EOS id
(2 for SmolLM2 in ``slotserve run``'s rows, 151645 for Qwen over HTTP). A stop token the caller named
(``stop_token_ids``; over the wire and in JSONL rows ``stop_token``) is still reported.

Every entry point over one in-process stack (broker and worker on threads, the real client and the
gateway's whole app): a worker serving a scripted model with a real tokenizer (SmolLM2's, and
Qwen2.5's where its GGUF extra is installed) that writes :data:`TEXT` then the tokenizer's EOS."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from slotserve.job import run_job  # noqa: E402
from tests.support.gateway import sse  # noqa: E402
from tests.support.scripted_text import TEXT, scripted_stack  # noqa: E402


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def stack(request):
    """``(http, client, model)``: the gateway app (TestClient) and a client over a broker and a worker
    serving a :class:`~tests.support.scripted_text.ScriptedText` of :data:`TEXT` as ``"m"``."""
    with scripted_stack(request.param, TEXT) as (http, c, model, _):
        yield http, c, model


def test_the_model_ends_at_its_eos_with_no_stop_reason_from_the_client(stack):
    _, c, model = stack
    eos, second = model.script[-1], model.script[1]
    plain = c.submit_request("hi", 40)
    named = c.submit_request("hi", 40, stop_token=[eos])     # named by the request: reported
    other = c.submit_request("hi", 40, stop_token=[second])
    c.run(timeout=30)
    assert (plain.tokens, plain.text, plain.finish_reason, plain.stop_reason) == (model.script, TEXT, "stop", None)
    assert (named.tokens, named.stop_reason) == (model.script, eos)
    assert (other.tokens, other.stop_reason) == (model.script[:2], second)


def test_jsonl_rows_leave_stop_reason_out_at_eos(stack):
    _, c, model = stack
    eos, second = model.script[-1], model.script[1]
    rows = [{"id": "plain", "prompt": "hi", "max_tokens": 40},
            {"id": "named", "prompt": "hi", "max_tokens": 40, "stop_token": [eos]},
            {"id": "other", "prompt": "hi", "max_tokens": 40, "stop_token": second},
            {"id": "string", "prompt": "hi", "max_tokens": 40, "stop": ["friend"]}]
    out = io.StringIO()
    run_job(c, io.StringIO("".join(json.dumps(r) + "\n" for r in rows)), out, progress=False, timeout_s=30)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert got["plain"]["finish_reason"] == "stop" and "stop_reason" not in got["plain"]
    assert got["plain"]["tokens"] == model.script
    assert (got["named"]["stop_reason"], got["other"]["stop_reason"], got["string"]["stop_reason"]) == (
        eos, second, "friend")


def _choices(http, path: str, body: dict, stream: bool) -> list[tuple[str, object]]:
    """``[(finish_reason, stop_reason)]`` of each choice, whole or from the last chunk of each."""
    if not stream:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return [(ch["finish_reason"], ch["stop_reason"]) for ch in r.json()["choices"]]
    ends: dict[int, tuple] = {}
    for chunk in sse(http, path, body):
        for ch in chunk.get("choices", ()):
            if ch.get("finish_reason") is not None:
                ends[ch["index"]] = (ch["finish_reason"], ch["stop_reason"])
    return [ends[i] for i in sorted(ends)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_report_no_stop_reason_at_eos_and_the_callers_stop_token(stack, path, stream):
    http, _, model = stack
    eos, second = model.script[-1], model.script[1]
    body = {"model": "m", "max_tokens": 40, "temperature": 0, "n": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    assert _choices(http, path, body, stream) == [("stop", None)] * 2
    # EOS among stop_token_ids, or with another id there: still the EOS (vLLM checks it first)
    assert _choices(http, path, {**body, "stop_token_ids": [eos]}, stream) == [("stop", None)] * 2
    unused = next(t for t in range(10, 100) if t not in model.script)
    assert _choices(http, path, {**body, "stop_token_ids": [unused]}, stream) == [("stop", None)] * 2
    assert _choices(http, path, {**body, "stop_token_ids": [second]}, stream) == [("stop", second)] * 2
    # ignore_eos: the stop tokens are all the caller's, the EOS among them too
    assert _choices(http, path, {**body, "stop_token_ids": [eos], "ignore_eos": True}, stream) == [("stop", eos)] * 2
    assert _choices(http, path, {**body, "stop": "friend"}, stream) == [("stop", "friend")] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_messages_api_ends_end_turn_with_no_stop_sequence_at_eos(stack, stream):
    http, _, _ = stack
    body = {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        events = sse(http, "/v1/messages", body)
        delta = next(e["delta"] for e in events if e["type"] == "message_delta")
        assert (delta["stop_reason"], delta["stop_sequence"]) == ("end_turn", None)
    else:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert (r.json()["stop_reason"], r.json()["stop_sequence"], r.json()["content"][0]["text"]) == (
            "end_turn", None, TEXT)
