"""Tools through the model's chat template (worker/models/hf_text.py, protocol/tools.py): a template
that renders ``tools`` gets the definitions, the assistant's ``tool_calls`` and the ``tool``
messages itself, with no Hermes prompt on top; one that does not (the tiny model's, like SmolLM2's)
gets the Hermes rendering; the tools and calls travel on the wire and from the gateway."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from protocol import codec  # noqa: E402
from protocol.messages import Envelope, Submit  # noqa: E402
from protocol.request import RequestParams  # noqa: E402

TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|>RESULT {{ m.content }}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A small template that renders ``tools`` (transformers' convention: ``tools``, ``message.tool_calls``)."""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
HISTORY = [{"role": "user", "content": "What time is it?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]


@pytest.fixture(scope="module")
def codecs(tiny_text_dir):
    """``(with_tools, without)``: the tiny model's tokenizer with :data:`TOOLS_TEMPLATE`, and with its
    own template (which has no tools)."""
    import transformers

    from worker.models.hf_text import HFTextCodec

    with_tools = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    with_tools.chat_template = TOOLS_TEMPLATE
    return HFTextCodec(with_tools), HFTextCodec(transformers.AutoTokenizer.from_pretrained(tiny_text_dir))


def rendered(codec_, params: RequestParams) -> str:
    """The prompt text the worker renders for ``params`` (as worker/engine.py's _tokenize does)."""
    messages = [m.template_dict() for m in params.prompt]
    ids = codec_.apply_chat_template(messages) if params.tools is None else \
        codec_.apply_chat_template(messages, tools=json.loads(params.tools))
    return codec_.decode(ids)


def test_a_template_with_tools_renders_them_and_no_hermes_prompt(codecs):
    with_tools, _ = codecs
    text = rendered(with_tools, RequestParams(HISTORY, 8, tools=TOOLS))
    assert text == ('<|system|>TOOLS:[get_weather][get_time]<|user|>What time is it?\n'
                    '<|assistant|>CALL get_time {"zone": "utc"}<|tool|>RESULT 12:00<|assistant|>')
    for hermes in ("<tools>", "function calling AI model", "<tool_call>", "<tool_response>"):
        assert hermes not in text
    plain = rendered(with_tools, RequestParams(HISTORY[:1], 8))  # no tools: the template shows none
    assert plain == "<|user|>What time is it?\n<|assistant|>"


def test_a_template_without_tools_gets_the_hermes_rendering(codecs):
    _, without = codecs
    text = rendered(without, RequestParams(HISTORY, 8, tools=TOOLS))
    assert text.startswith("<|system|>You are a function calling AI model.") and "<tools>" in text
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert '<|assistant|><tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>' in text
    assert "<|user|><tool_response>\n12:00\n</tool_response>" in text and "<|tool|>" not in text
    no_tools = rendered(without, RequestParams(HISTORY, 8))  # tool_choice none: calls and results, no prompt
    assert "<tools>" not in no_tools and "<tool_response>" in no_tools
    assert rendered(without, RequestParams(HISTORY[:1], 8)) == "<|user|>What time is it?\n<|assistant|>"


def test_tools_and_calls_travel_on_the_wire():
    params = RequestParams(HISTORY, 8, tools=json.dumps(TOOLS))
    assert json.loads(params.tools) == TOOLS and params.prompt[1].tool_calls[0].arguments == '{"zone": "utc"}'
    (env,) = codec.decode(codec.encode(Submit(model="m", requests=(Envelope("r", params, (), None),)))).requests
    assert env.params == params
    assert params.prompt[1].template_dict()["tool_calls"][0]["function"] == {"name": "get_time",
                                                                             "arguments": {"zone": "utc"}}


@pytest.mark.parametrize("kw, says", [
    (dict(prompt="text", tools=TOOLS), "tools need a chat prompt"),
    (dict(prompt=HISTORY, tools=[]), "non-empty list"),
    (dict(prompt=HISTORY, tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (dict(prompt=HISTORY, tools=TOOLS + TOOLS[:1]), "each name once"),
    (dict(prompt=HISTORY, tools="{not json"), "JSON list"),
    (dict(prompt=HISTORY[:1] + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]), "JSON text of an object"),
])
def test_bad_tools_are_refused_at_the_edge(kw, says):
    with pytest.raises(ValueError) as e:
        RequestParams(kw.pop("prompt"), 8, **kw)
    assert says in str(e.value)


def test_the_gateway_sends_the_tools_and_calls(tiny_text_dir):
    """Through the openai SDK on the handlers app: the submitted request carries the definitions
    and the history's calls (the scripted client answers plain text)."""
    openai = pytest.importorskip("openai")
    from starlette.testclient import TestClient

    from gateway.tokenizer import Tokenizers
    from tests.gateway.test_tools_stream import OutputClient
    from tests.support.scripted import ScriptedLink, handlers_app

    client = OutputClient()
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        history = HISTORY + [{"role": "user", "content": "plain"}]
        history[2] = {**history[2], "tool_call_id": "call_1"}
        sdk.chat.completions.create(model="m", messages=history, max_tokens=30, tools=TOOLS)
        sdk.chat.completions.create(model="m", messages=history, max_tokens=30, tools=TOOLS, tool_choice="none")
    for t in client.threads:
        t.join(10)
    auto, none = client.submitted
    assert [f["function"]["name"] for f in json.loads(auto.tools)] == ["get_weather", "get_time"]
    assert none.tools is None  # tool_choice none: the tools are not shown
    for params in (auto, none):
        assert params.prompt[1].tool_calls[0].name == "get_time" and params.prompt[2].role == "tool"


def test_a_tool_message_s_call_id_and_name_reach_the_template(codecs, tiny_text_dir):
    """Issue 33, item 3: Mistral's templates read a tool message's ``tool_call_id`` (and refuse the chat
    without it), others its ``name``; the gateway checked the id and dropped it. Carried now from the
    body through the wire (old message shapes still decode) to the template."""
    import transformers

    from worker.models.hf_text import HFTextCodec

    tok = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    tok.chat_template = TOOLS_TEMPLATE.replace("RESULT {{ m.content }}",
                                               "RESULT[{{ m.tool_call_id }}|{{ m.name }}] {{ m.content }}")
    call = {**HISTORY[1]["tool_calls"][0], "id": "a1B2c3D4e"}
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}, {**HISTORY[2], "tool_call_id": "a1B2c3D4e",
                                                                  "name": "get_time"}]
    params = RequestParams(history, 8, tools=TOOLS)
    assert params.prompt[2].tool_call_id == "a1B2c3D4e" and params.prompt[2].name == "get_time"
    (env,) = codec.decode(codec.encode(Submit(model="m", requests=(Envelope("r", params, (), None),)))).requests
    assert env.params == params
    assert "<|tool|>RESULT[a1B2c3D4e|get_time] 12:00" in rendered(HFTextCodec(tok), env.params)
    # older shapes: a message without its name (the tool's answer) or without its id and name (the others)
    old = RequestParams([["user", "hi"], ["assistant", "", [["c", "get_time", "{}"]]], ["tool", "12:00", [], "c"],
                         ["user", "and?"]], 8)
    assert old.prompt[3] == ("user", "and?", (), "", "") and old.prompt[1].tool_calls[0].name == "get_time"
    assert old.prompt[2] == ("tool", "12:00", (), "c", "")
    with pytest.raises(ValueError, match="a tool message needs the tool_call_id"):  # (a tool message names its call)
        RequestParams([["user", "hi"], ["assistant", "", [["c", "get_time", "{}"]]], ["tool", "12:00"]], 8)
    with pytest.raises(ValueError, match="tool_call_id must be a string"):
        RequestParams(HISTORY[:2] + [{**HISTORY[2], "tool_call_id": 7}], 8)


def test_the_gateway_sends_a_tool_message_s_call_id_and_name():
    openai = pytest.importorskip("openai")
    from starlette.testclient import TestClient

    from gateway.tokenizer import Tokenizers
    from tests.gateway.test_tools_stream import OutputClient
    from tests.support.scripted import ScriptedLink, handlers_app

    client = OutputClient()
    with TestClient(handlers_app(Tokenizers(None), ScriptedLink(client))) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        history = HISTORY + [{"role": "user", "content": "plain"}]
        history[2] = {**history[2], "tool_call_id": "call_1", "name": "get_time"}
        sdk.chat.completions.create(model="m", messages=history, max_tokens=30, tools=TOOLS)
    for t in client.threads:
        t.join(10)
    (params,) = client.submitted
    assert params.prompt[2].template_dict() == {"role": "tool", "content": "12:00", "tool_call_id": "call_1",
                                                "name": "get_time"}
    assert "tool_call_id" not in params.prompt[0].template_dict()
