"""Tool calls streamed as OpenAI streams them (gateway/tool_stream.py :class:`ToolStream`): content as
it comes, a call's header delta once its name and arguments key are read, its argument text in fragments, the same
parse streamed or not -- checked on the parser alone for every way of cutting an output into
deltas, and end to end through the ``openai`` SDK on the gateway's handlers over a scripted broker
client whose outputs are known exactly (plain text, one call, two calls, text before a call, a call
cut by ``max_tokens``, malformed call JSON)."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from client.handle import ClientHandle  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from gateway.tool_stream import ToolStream, merged  # noqa: E402
from gateway.tools import parse_tool_calls  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from protocol.request import ModelLimits  # noqa: E402
from tests.support.scripted import VOCAB, ScriptedClient, ScriptedLink, handlers_app  # noqa: E402

FUNCTIONS = {"get_weather": {}, "get_time": {}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in FUNCTIONS]
WEATHER = '{"city": "Paris}\\"", "days": [1, {"n": 2}]}'
OUTPUTS = {  # name -> (the model's output, whether a max_tokens of 9 tokens cuts it)
    "plain": "  It is sunny, <b>really</b> < tool_call >.  ",
    "one": f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
    "two": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
           '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>',
    "text_first": 'Let me check.\n\n<tool_call>{"name": "get_time"}</tool_call>\nDone.',
    "cut": f'Sure. <tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
    "malformed": '<tool_call>{"name": get_weather, "arguments": {}}</tool_call> and '
                 '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_c',
}
BARE = {  # what small Qwen2.5-Coder models wrote without the tags (issue 33): read only with bare=True
    "bare_one": f' {{"name": "get_weather", "arguments": {WEATHER} }}',
    "bare_two": '{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}\n'
                '{"name": "get_time"} Done.',
    "bare_not_a_call": '{"name": "unknown", "arguments": {}} is not one of them',
    "bare_json_answer": '{"city": "Paris", "temperature": 21}',
    "bare_after_text": 'Here: {"name": "get_time", "arguments": {}}',
    "bare_broken": '{"name": "get_time", "arguments": {"zone": "utc"} oops',
    "bare_fenced": '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n{"name": "get_time", '
                   '"arguments": {"city": "Rome"}}\n```\nThat is all.',
    "bare_fenced_json_answer": '```json\n{"city": "Paris", "temperature": 21}\n```',
    "bare_fenced_code": '```python\nprint({"name": "get_time"})\n```',
}
VARIANTS = {"parallel": {}, "one_call": {"parallel": False}, "bare": {"bare": True},
            "bare_one_call": {"bare": True, "parallel": False}}
TOKEN_CHARS = 4  # the scripted model's tokens are 4 characters of its output


def calls_of(calls: list) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def feed_in_pieces(text: str, cuts: list[int], reason: str = "stop", **variant) -> tuple[list[dict], str]:
    stream = ToolStream(FUNCTIONS, **variant)
    deltas = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        deltas += stream.feed(text[a:b])
    more, reason = stream.finish(reason)
    return deltas + more, reason


# ---------------------------------------------------------------------- the parser alone


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted({**OUTPUTS, **BARE}))
def test_every_cut_into_deltas_adds_up_to_the_whole_parse(name, variant):
    text, options = {**OUTPUTS, **BARE}[name], VARIANTS[variant]
    content, calls = parse_tool_calls(text, FUNCTIONS, **options)
    cuttings = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]  # one cut anywhere; every char
    rng = random.Random(0)
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3))) for _ in range(50)]
    for cuts in cuttings:
        deltas, reason = feed_in_pieces(text, cuts, **options)
        got_content, got_calls = merged(deltas)
        assert (got_content, calls_of(got_calls)) == (content, calls_of(calls)), cuts
        assert reason == ("tool_calls" if calls else "stop")
        assert all(d for d in deltas), "an empty delta"


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_tool_calls(OUTPUTS["two"], FUNCTIONS, parallel=False)
    assert content is None and calls_of(calls) == [("get_time", "{}")]
    content, calls = parse_tool_calls(OUTPUTS["text_first"] + OUTPUTS["one"], FUNCTIONS, parallel=False)
    assert content == "Let me check.\nDone." and calls_of(calls) == [("get_time", "{}")]
    content, calls = parse_tool_calls(BARE["bare_two"], FUNCTIONS, parallel=False, bare=True)
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]


def test_bare_calls_are_read_only_at_the_start_and_only_when_asked():
    content, calls = parse_tool_calls(BARE["bare_one"], FUNCTIONS, bare=True)
    assert content is None and calls_of(calls) == [("get_weather", WEATHER)]
    content, calls = parse_tool_calls(BARE["bare_two"], FUNCTIONS, bare=True)
    assert content == "Done." and calls_of(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}"),
                                                      ("get_time", "{}")]
    content, calls = parse_tool_calls(BARE["bare_fenced"], FUNCTIONS, bare=True)
    assert content == "That is all." and calls_of(calls) == [("get_weather", '{"city": "Paris"}'),
                                                             ("get_time", '{"city": "Rome"}')]
    for name in ("bare_not_a_call", "bare_json_answer", "bare_after_text", "bare_fenced_json_answer",
                 "bare_fenced_code"):
        assert parse_tool_calls(BARE[name], FUNCTIONS, bare=True) == (BARE[name], []), name
    assert parse_tool_calls(BARE["bare_one"], FUNCTIONS) == (BARE["bare_one"], [])  # off: content
    content, calls = parse_tool_calls(BARE["bare_broken"], FUNCTIONS, bare=True)  # a call is not taken back
    assert content is None and calls_of(calls) == [("get_time", '{"zone": "utc"}')]


def test_what_the_parse_says():
    assert parse_tool_calls(OUTPUTS["plain"], FUNCTIONS) == (OUTPUTS["plain"], [])
    content, calls = parse_tool_calls(OUTPUTS["one"], FUNCTIONS)
    assert content is None and calls_of(calls) == [("get_weather", WEATHER)]  # the model's text, exactly
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris}"', "days": [1, {"n": 2}]}
    content, calls = parse_tool_calls(OUTPUTS["two"], FUNCTIONS)
    assert content is None and calls_of(calls) == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    content, calls = parse_tool_calls(OUTPUTS["text_first"], FUNCTIONS)
    assert content == "Let me check.\nDone." and calls_of(calls) == [("get_time", "{}")]
    assert parse_tool_calls(OUTPUTS["malformed"], FUNCTIONS) == (OUTPUTS["malformed"], [])
    cut = OUTPUTS["cut"]
    content, calls = parse_tool_calls(cut[:cut.index("Pa") + 2], FUNCTIONS)  # cut inside the arguments
    assert content == "Sure." and calls_of(calls) == [("get_weather", '{"city": "Pa')]


def test_deltas_come_as_soon_as_the_text_allows():
    stream = ToolStream(FUNCTIONS)
    assert stream.feed("Hi there <tool") == [{"content": "Hi there"}]  # the space and a tag's start held back
    assert stream.feed('_call>{"name": "get_') == []
    head, args = stream.feed('weather", "arguments": {"ci')
    call = head["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": "x"') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "x"'}}]}]
    assert stream.feed("}}\n</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.finish("stop") == ([], "tool_calls")
    short = ToolStream(FUNCTIONS)
    short.feed('<tool_call>{"name": "get_time", "arguments": {"zone": "u')
    assert short.finish("length") == ([], "length")
    text = ToolStream(FUNCTIONS)
    assert text.feed("a <tool_c") == [{"content": "a"}]
    assert text.finish("stop") == ([{"content": " <tool_c"}], "stop")  # no call came: the text is content


# ---------------------------------------------------------------------- end to end through the SDK


class LockstepHandle(ClientHandle):
    """A handle that says when its text was read (the gateway reads it for each stream delta)."""

    __slots__ = ("read",)

    @property
    def text(self) -> str | None:
        out = ClientHandle.text.fget(self)
        self.read.set()
        return out


class OutputClient(ScriptedClient):
    """Writes ``outputs[last message's content]`` (default :data:`OUTPUTS` and :data:`BARE`),
    TOKEN_CHARS characters a token, and ends ``stop`` (``length`` when ``max_tokens`` tokens came
    first). A streamed request's next token waits (up to 10 s) until the gateway has read the text
    so far: each token makes its own stream delta."""

    def __init__(self, outputs: dict[str, str] | None = None) -> None:
        super().__init__()
        self.outputs = outputs  # (None: OUTPUTS and BARE as they are when a request comes: tests patch them)

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, **options):
        params = ModelLimits(VOCAB, 4096, True).build(prompt, max_tokens, **options)
        self.submitted.append(params)
        h = LockstepHandle(len(self.threads), params, callback, on_token, time.monotonic(), None)
        h.read = threading.Event()
        t = threading.Thread(target=self._run, args=(h,))
        self.threads.append(t)
        t.start()
        return h

    def _script(self, h: ClientHandle) -> None:
        text = ({**OUTPUTS, **BARE} if self.outputs is None else self.outputs)[h.params.prompt[-1].content]
        pieces = [text[i:i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)]
        h._prompt_tokens = 5
        h.first_token_s = time.monotonic()
        for i, piece in enumerate(pieces[:h.params.max_tokens]):
            h.read.clear()
            h._tokens.append(i % VOCAB)
            h._text.append(piece)
            if h.on_token is not None:
                h.on_token(i % VOCAB)
                h.read.wait(10)
        reason = FinishReason.LENGTH if len(pieces) > h.params.max_tokens else FinishReason.STOP
        h._end(reason, None, None, time.monotonic())
        h.callback(h.tokens)
        h._done = True


@pytest.fixture
def sdk():
    client = OutputClient()
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("name", sorted({**OUTPUTS, **BARE}))
def test_a_stream_adds_up_to_the_answer(sdk, name):
    """... and every chunk after the role's says something (issue 33: ~17 ``delta: {}`` chunks came
    while text was held back); the token ids of those that would not have are on the next one."""
    max_tokens = 9 if name == "cut" else 60
    kw = dict(model="m", messages=[{"role": "user", "content": name}], max_tokens=max_tokens, tools=TOOLS)
    whole = sdk.chat.completions.create(**kw).choices[0]
    content, calls, reasons, firsts, token_ids = [], {}, [], [], []
    for k, chunk in enumerate(sdk.chat.completions.create(**kw, stream=True)):
        (choice,) = chunk.choices
        delta = choice.delta
        token_ids += choice.model_extra["token_ids"]
        assert k == 0 or delta.content or delta.tool_calls or choice.finish_reason, f"an empty delta: {chunk}"
        content += [delta.content] if delta.content else []
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the call's first delta: id, type and name, no arguments yet
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.arguments == ""
                firsts.append(tc.function.name)
                calls[tc.index] = ""
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index] += tc.function.arguments or ""
        reasons += [choice.finish_reason] if choice.finish_reason else []
    want_calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    streamed = ("".join(content) or None, list(zip(firsts, calls.values())))
    assert streamed == (whole.message.content or None, want_calls)
    assert reasons == [whole.finish_reason]
    text = {**OUTPUTS, **BARE}[name]
    cut = len(text) > max_tokens * TOKEN_CHARS
    expected_content, expected_calls = parse_tool_calls(text[:max_tokens * TOKEN_CHARS], FUNCTIONS, bare=True,
                                                        reason="length" if cut else None)
    assert (whole.message.content, want_calls) == (expected_content, calls_of(expected_calls))
    assert len(token_ids) == min(max_tokens, -(-len(text) // TOKEN_CHARS))  # every token's id, once
    assert whole.finish_reason == ("length" if name == "cut" else "tool_calls" if want_calls else "stop")


def test_a_stream_sends_content_the_header_then_argument_fragments(sdk):
    """The order the deltas come in, token by token: the text before the call first, the call's
    header before any of its arguments, the arguments in several fragments."""
    kinds = []
    for chunk in sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "text_first"}],
                                             max_tokens=60, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        kinds += ["content"] if delta.content else []
        kinds += ["head" if tc.id else "args" for tc in delta.tool_calls or []]
    assert kinds[:kinds.index("head")] == ["content"] * kinds.index("head") and kinds.count("head") == 1
    assert kinds.index("head") >= 3 and kinds[-1] == "content"  # "Let me check." in pieces; "Done." after
    args = []
    for chunk in sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}],
                                             max_tokens=60, tools=TOOLS, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            args.append(None if tc.id else tc.function.arguments)
    assert args[0] is None and None not in args[1:] and len(args) >= 6  # 44 characters, 4 a token
    assert "".join(args[1:]) == WEATHER


def test_one_generation_delta_becomes_a_chunk_per_tool_delta():
    """stream_choices: the delta's token ids and logprobs on its first chunk, the finish and stop
    reasons on its last, an empty delta when the parser holds everything back."""
    from gateway.tools import stream_choices

    stream = ToolStream(FUNCTIONS)

    def choice(text, reason=None):
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": {"content": []},
                "finish_reason": reason, "stop_reason": 7 if reason else None, "token_ids": [1, 2]}

    (held,) = stream_choices(stream, choice("<tool_call>"), False)
    assert held["delta"] == {} and held["token_ids"] == [1, 2] and held["finish_reason"] is None
    head, args = stream_choices(stream, choice('{"name": "get_time", "arguments": {"z'), False)
    assert head["token_ids"] == [1, 2] and head["logprobs"] == {"content": []} and head["finish_reason"] is None
    assert args["token_ids"] == [] and args["logprobs"] is None
    assert args["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"z'}}]}
    (last,) = stream_choices(stream, choice('": 1}}</tool_call>', "stop"), True)
    assert last["finish_reason"] == "tool_calls" and last["stop_reason"] == 7
    assert last["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]}
