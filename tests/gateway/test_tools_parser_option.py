"""``--tool-call-parser`` (issue 33, item 3): the CLI option on ``serve`` and ``up`` reaches the gateway's
config (an unknown name is a usage error naming the choices), and the gateway reads chat answers
in that family's syntax and constrains ``tool_choice: "required"`` in it -- through the ``openai``
SDK on the gateway's handlers over a scripted broker client (tests/gateway/test_tools_stream.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from tests.gateway import test_tools_stream  # noqa: E402
from tests.gateway.test_tools_stream import TOOLS, OutputClient  # noqa: E402
from tests.support.launcher import record_clusters  # noqa: E402
from tests.support.scripted import ScriptedLink, handlers_app  # noqa: E402

MISTRAL = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'
QWEN3 = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture
def served(monkeypatch):
    """`slotserve serve` with gateway.run stubbed: the configs it was given."""
    import gateway

    got = []
    monkeypatch.setattr(gateway, "run", lambda cfg, *, on_ready=None, **kw: (got.append(cfg), on_ready("http://x")))
    return got


def test_serve_takes_the_parser_and_defaults_to_hermes(served):
    from slotserve.cli import main

    for args, env, want in ((["--tool-call-parser", "mistral"], {}, "mistral"), ([], {}, "hermes"),
                            ([], {"SLOTSERVE_SERVE_TOOL_CALL_PARSER": "llama3_json"}, "llama3_json")):
        r = CliRunner().invoke(main, ["serve", *args], env=env)
        assert r.exit_code == 0, r.output
        assert served[-1].tool_call_parser == want
    r = CliRunner().invoke(main, ["serve", "--tool-call-parser", "auto"])
    assert r.exit_code == 0 and served[-1].tool_call_parser == "auto"
    r = CliRunner().invoke(main, ["serve", "--tool-call-parser", "llama"])
    assert r.exit_code == 2 and "--tool-call-parser" in r.output and "qwen3_coder" in r.output
    assert len(served) == 4


def test_up_gives_its_gateway_the_parser_and_needs_an_http_port(monkeypatch):
    from slotserve.cli import main

    clusters = record_clusters(monkeypatch, http_url="http://127.0.0.1:3")
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--tool-call-parser", "qwen3_coder"])
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.tool_call_parser == "qwen3_coder"
    r = CliRunner().invoke(main, ["up", "--http-port", "0"])
    assert r.exit_code == 0 and clusters[-1].gateway.tool_call_parser == "hermes"
    r = CliRunner().invoke(main, ["up", "--tool-call-parser", "mistral"])  # no HTTP server to give it to
    assert r.exit_code == 2 and "--http-port" in r.output and len(clusters) == 2


def test_the_config_refuses_an_unknown_parser():
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, mistral, qwen3_coder, "
                                         "pythonic, openai, auto"):
        GatewayConfig(tool_call_parser="llama")
    assert GatewayConfig().tool_call_parser == "hermes"


@pytest.fixture
def sdk(request, monkeypatch):
    """The SDK on handlers whose gateway reads ``request.param``'s syntax; the scripted model writes
    MISTRAL or QWEN3 for a user message saying so."""
    monkeypatch.setitem(test_tools_stream.OUTPUTS, "mistral", MISTRAL)
    monkeypatch.setitem(test_tools_stream.OUTPUTS, "qwen3", QWEN3)
    client = OutputClient()
    app = handlers_app(Tokenizers(None), ScriptedLink(client), GatewayConfig(tool_call_parser=request.param))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), client
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("sdk, said, calls", [
    ("mistral", "mistral", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ("qwen3_coder", "qwen3", [("get_weather", '{"city": "Oslo"}')]),
    ("hermes", "mistral", []),  # another family's syntax is content under the default parser
], indirect=["sdk"])
def test_the_gateway_reads_answers_in_its_parser_s_syntax(sdk, said, calls):
    client, kw = sdk[0], dict(model="m", messages=[{"role": "user", "content": said}], max_tokens=60, tools=TOOLS)
    whole = client.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert got == calls and whole.finish_reason == ("tool_calls" if calls else "stop")
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, [tc.function.name, ""])
            entry[1] += tc.function.arguments or ""
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls


@pytest.mark.parametrize("sdk, start", [("mistral", 'start: "[TOOL_CALLS]"'), ("llama3_json", 'start: "<|python_tag|>"?'),
                                        ("qwen3_coder", 'start: "<tool_call>\\n<function="'),
                                        ("hermes", 'start: "<tool_call>\\n"'), ("pythonic", 'start: "<|python_tag|>"? "["'),
                                        ("openai", 'start: ANALYSIS* "<|channel|>commentary to=functions."')],
                         indirect=["sdk"])
def test_required_is_constrained_in_the_parser_s_syntax(sdk, start):
    client, scripted = sdk
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "plain"}], max_tokens=60,
                                   tools=TOOLS, tool_choice="required")
    assert scripted.submitted[-1].structured.spec.startswith(start)


TEMPLATES = {  # excerpts of the published chat templates, as their tool-call parts read
    "mistral": '{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in '
               'message.tool_calls %}{{- \', "id": "\' + tool_call.id + \'"}\' }}',  # Mistral 7B Instruct v0.3
    "qwen3_coder": '{{- "<tool_call>\\n<function=" + tool_call.name + ">\\n" }}{%- for args_name, args_value in '
                   'tool_call.arguments|items %}{{- "<parameter=" + args_name + ">\\n" }}',  # Qwen3-Coder
    "hermes": '{{- "<tool_call>\\n{\\"name\\": \\"" }}{{- tool_call.name }}',  # Qwen2.5
    "llama3_json": '{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}'
                   '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}'
                   '{{- "<|python_tag|>" + tool_call.name + ".call(" }}',  # Llama 3.1
    "pythonic": '{{- "If you decide to invoke any of the function(s), you MUST put it in the format of '
                '[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\\n" }}'
                '{{- "<|python_tag|>" if builtin_tools is defined }}',  # Llama 3.2 (vLLM's pythonic template)
    "openai": '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
              '{{- "json<|message|>" }}{{- tool_call.arguments|tojson }}{{- "<|call|>" }}',  # gpt-oss
}


@pytest.mark.parametrize("parser", sorted(TEMPLATES))
def test_auto_picks_the_parser_the_template_asks_for(parser):
    from gateway.tool_parsers import detect_parser

    assert detect_parser(TEMPLATES[parser]) == parser
    assert detect_parser({"default": "x", "tool_use": TEMPLATES[parser]}) == parser  # (named templates)


def test_auto_without_a_tools_syntax_or_a_template_is_hermes():
    from gateway.tool_parsers import detect_parser

    smollm2 = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>"
    assert detect_parser(smollm2) == detect_parser(None) == "hermes"  # (the Hermes rendering)


def test_auto_reads_each_model_s_template_through_the_gateway(monkeypatch):
    """``--tool-call-parser auto``: the gateway reads the model's tokenizer's template (a Mistral one
    here) and the answer in its syntax; without a tokenizer, Hermes."""
    from types import SimpleNamespace

    from gateway.tokenizer import Tokenizer

    monkeypatch.setitem(test_tools_stream.OUTPUTS, "mistral", MISTRAL)
    for load, calls in ((lambda name: Tokenizer(None, SimpleNamespace(chat_template=TEMPLATES["mistral"])), 2),
                        (None, 0)):
        client = OutputClient()
        with TestClient(handlers_app(Tokenizers(load), ScriptedLink(client),
                                     GatewayConfig(tool_call_parser="auto"))) as http:
            sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            r = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "mistral"}],
                                            max_tokens=60, tools=TOOLS)
            assert len(r.choices[0].message.tool_calls or []) == calls
            if calls:
                sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "plain"}], max_tokens=60,
                                            tools=TOOLS, tool_choice="required")
                assert client.submitted[-1].structured.spec.startswith('start: "[TOOL_CALLS]"')
        for t in client.threads:
            t.join(10)
