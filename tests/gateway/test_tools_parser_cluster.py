"""``--tool-call-parser`` end to end (the one cluster test of the parsers): a broker, a worker serving the
tiny text model and a gateway reading Qwen3-Coder's XML syntax. ``tool_choice: "required"`` and a
named function make the worker's grammar (gateway/tool_grammars.py) write a call in that syntax
(the tiny model's output is gibberish, so a call is the grammar's doing), the worker decodes it,
and the gateway's parser reads it back as ``tool_calls``: the same streamed and whole."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["zone", "dst"],
          "properties": {"zone": {"enum": ["utc", "cet"]}, "dst": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_date", "parameters": {
             "type": "object", "required": ["utc"], "properties": {"utc": {"type": "boolean"}}}}}]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """The tiny text model with a longer context: the tools' Hermes prompt takes ~900 of its tokens."""
    from tests.support.tiny_text import make_tiny_text_model

    return make_tiny_text_model(tmp_path_factory.mktemp("tiny-parsers"), max_positions=2048)


@pytest.fixture(scope="module")
def cluster(text_model):
    from gateway.config import GatewayConfig
    from tests.support.gateway import start_cluster
    from worker.config import WorkerConfig

    c = start_cluster((WorkerConfig(model=text_model, num_slots=2),),
                      gateway=GatewayConfig(port=0, tool_call_parser="qwen3_coder"), models=(text_model,))
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("choice, names", [("required", {"get_time", "get_date"}),
                                           ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_a_constrained_call_in_qwen3_coder_syntax_comes_back_as_tool_calls(cluster, text_model, choice, names):
    oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=text_model, messages=[{"role": "user", "content": "time?"}], max_tokens=120, temperature=0,
              tools=TOOLS, tool_choice=choice)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert call.function.name in names
    args = json.loads(call.function.arguments)  # typed by the schema: a boolean, not the text "true"
    assert all(isinstance(v, bool) for k, v in args.items() if k in ("dst", "utc")) and args
    streamed = {"name": "", "arguments": ""}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] += tc.function.name or ""
            streamed["arguments"] += tc.function.arguments or ""
    assert (streamed["name"], streamed["arguments"]) == (call.function.name, call.function.arguments)
