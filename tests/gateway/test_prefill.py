"""A chat's final message continued (the "prefill" idiom) at every entry point, rendered by the real
tokenizers' chat templates (SmolLM2's, and Qwen2.5's where its GGUF extra is installed).

Anthropic's Messages API continues a final ``assistant`` message: the answer goes on from its text,
and the response's content holds only the new text. It was rendered as a closed turn and a new
generation prompt (``...<|im_start|>assistant\\nThe answer is<|im_end|>\\n<|im_start|>assistant\\n``),
so the model started a second turn. Now the prompt is transformers' ``apply_chat_template(...,
continue_final_message=True)``; ``count_tokens`` counts it; a final text ending in whitespace and a
final ``tool_use`` are Anthropic's 400s. The OpenAI chat path, ``/tokenize``, the Python SDK and
``slotserve run``'s rows take vLLM's ``continue_final_message`` (and ``add_generation_prompt``; both
true is a 400 in vLLM's words).

One in-process stack (broker and worker on threads, the real client and the gateway's whole app): a
worker serving a scripted model with a real tokenizer that records each prompt it is given and writes
:data:`TEXT`, then its EOS."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("transformers")

from protocol.request import RequestParams  # noqa: E402
from slotserve.job import run_job  # noqa: E402
from tests.support.gateway import sse  # noqa: E402
from tests.support.scripted_text import scripted_stack  # noqa: E402

TEXT = " forty-two."
PREFILL = "The answer is"
CHAT = [{"role": "user", "content": "What is the answer?"}, {"role": "assistant", "content": PREFILL}]


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def stack(request):
    """``(http, client, model, tok)``: the gateway app (TestClient, rendering with the model's tokenizer)
    and a client over a broker and a worker serving a :class:`~tests.support.scripted_text.ScriptedText`
    of :data:`TEXT` (it records each prompt) as ``"m"``, and the transformers tokenizer under it."""
    with scripted_stack(request.param, TEXT, gateway_tokenizer=True) as parts:
        yield parts


def continued(tok, messages=CHAT) -> tuple[int, ...]:
    """The prompt transformers renders for ``messages`` continuing the final one."""
    return tuple(tok.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=True)
                 ["input_ids"])


def _last_prompt(model, before: int) -> tuple[int, ...]:
    assert len(model.prompts) == before + 1, model.prompts[before:]
    return model.prompts[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_api_continues_a_final_assistant_message_and_answers_the_new_text(stack, stream):
    http, _, model, tok = stack
    before = len(model.prompts)
    body = {"model": "m", "max_tokens": 40, "messages": CHAT, "stream": stream}
    if stream:
        events = sse(http, "/v1/messages", body)
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        usage = next(e["usage"] for e in events if e["type"] == "message_delta")
    else:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        text, usage = r.json()["content"][0]["text"], r.json()["usage"]
    prompt = _last_prompt(model, before)
    assert prompt == continued(tok) and tok.decode(prompt).endswith(PREFILL), tok.decode(prompt)
    assert text == TEXT  # (the new text only: not the prefill again)
    count = http.post("/v1/messages/count_tokens", json={"model": "m", "messages": CHAT})
    assert count.status_code == 200 and count.json()["input_tokens"] == len(prompt) == usage["input_tokens"], count.text


def test_messages_api_still_closes_a_final_user_turn(stack):
    http, _, model, tok = stack
    before = len(model.prompts)
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 40, "messages": CHAT[:1]})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == TEXT, r.text
    assert _last_prompt(model, before) == tuple(tok.apply_chat_template(CHAT[:1], add_generation_prompt=True,
                                                                        tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("final, field, says", [
    ({"role": "assistant", "content": "The answer is "}, "messages.1.content",
     "final assistant content cannot end with trailing whitespace"),
    ({"role": "assistant", "content": [{"type": "text", "text": "The answer"}, {"type": "text", "text": " is\n"}]},
     "messages.1.content.1.text", "final assistant content cannot end with trailing whitespace"),
    ({"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                       {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
     "messages.1", "`tool_use` ids were found without `tool_result` blocks immediately after: t1."),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_api_refuses_a_prefill_anthropic_refuses(stack, final, field, says, path):
    http, _, model, _ = stack
    before = len(model.prompts)
    body = {"model": "m", "messages": [CHAT[0], final], **({"max_tokens": 40} if path == "/v1/messages" else {})}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith(f"{field}: {says}"), r.text
    assert len(model.prompts) == before


@pytest.mark.parametrize("flags", [{"continue_final_message": True},
                                   {"continue_final_message": True, "add_generation_prompt": False}])
def test_chat_completions_take_vllm_s_continue_final_message(stack, flags):
    http, _, model, tok = stack
    before = len(model.prompts)
    r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 40, "messages": CHAT, **flags})
    assert r.status_code == 200, r.text
    assert _last_prompt(model, before) == continued(tok)
    assert r.json()["choices"][0]["message"]["content"] == TEXT
    assert r.json()["usage"]["prompt_tokens"] == len(continued(tok))
    t = http.post("/tokenize", json={"model": "m", "messages": CHAT, **flags})
    assert t.status_code == 200 and tuple(t.json()["tokens"]) == continued(tok), t.text


def test_chat_completions_take_add_generation_prompt_false(stack):
    http, _, model, tok = stack
    before = len(model.prompts)
    r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 40, "messages": CHAT,
                                                 "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert _last_prompt(model, before) == tuple(tok.apply_chat_template(CHAT, add_generation_prompt=False,
                                                                        tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_both_flags_true_is_a_400_in_vllm_s_words(stack, path):
    http, _, model, _ = stack
    before = len(model.prompts)
    r = http.post(path, json={"model": "m", "messages": CHAT, "continue_final_message": True,
                              "add_generation_prompt": True, **({"max_tokens": 40} if "chat" in path else {})})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["param"], e["message"]) == ("continue_final_message", "Cannot set both `continue_final_message` and "
                                                                    "`add_generation_prompt` to True."), e
    assert len(model.prompts) == before


def test_the_sdk_and_jsonl_rows_continue_the_final_message(stack):
    _, c, model, tok = stack
    before = len(model.prompts)
    h = c.submit_request(CHAT, 40, continue_final_message=True)
    c.run(timeout=30)
    assert h.text == TEXT and _last_prompt(model, before) == continued(tok)
    out = io.StringIO()
    row = {"id": "r", "messages": CHAT, "max_tokens": 40, "continue_final_message": True}
    run_job(c, io.StringIO(json.dumps(row) + "\n"), out, progress=False, timeout_s=30)
    assert json.loads(out.getvalue())["text"] == TEXT and _last_prompt(model, before + 1) == continued(tok)


@pytest.mark.parametrize("options, says", [
    ({"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message: cannot set both `continue_final_message` and `add_generation_prompt` to true"),
    ({"add_generation_prompt": False, "_prompt": [1, 2]}, "add_generation_prompt needs a chat prompt"),
    ({"continue_final_message": True, "_prompt": "text"}, "continue_final_message needs a chat prompt"),
    ({"continue_final_message": True, "_prompt": CHAT[:1] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "chat message 1 tool_calls: An assistant message with 'tool_calls' must be followed by tool messages"),
    # ^ (a final message's calls are unanswered, whether it is continued or not: protocol.chat.Answers)
])
def test_the_request_refuses_what_it_cannot_render(options, says):
    prompt = options.pop("_prompt", CHAT)
    with pytest.raises(ValueError) as e:
        RequestParams(prompt, 4, **options)
    assert str(e.value).startswith(says), e.value
