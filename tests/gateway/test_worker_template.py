"""The gateway reads the chat template its model's worker renders with (issue 33, a left-alone item
fixed as a kind): a worker's ``--chat-template`` travels in ``ModelInfo.chat_template`` (protocol
11), and both places where the gateway renders or reads a template use it -- ``/tokenize`` of a chat
(its count is the chat request's prompt) and ``--tool-call-parser auto`` (the syntax the template
asks for). Before, both read the tokenizer's own template: a model served with another template got
``/tokenize`` counts of a prompt it never saw and calls read in the wrong family's syntax."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.tokenizer import Tokenizer, Tokenizers  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import ModelInfo, Register  # noqa: E402
from tests.gateway import test_tools_stream  # noqa: E402
from tests.gateway.test_tools_parser_option import MISTRAL, TEMPLATES  # noqa: E402
from tests.gateway.test_tools_stream import TOOLS, OutputClient  # noqa: E402
from tests.support.scripted import ScriptedLink, handlers_app  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402

OPTION = "{% for m in messages %}[[{{ m.role }}]] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[[bot]]" \
         "{% endif %}"  # (what a --chat-template gives the worker: no tools, so the Hermes rendering)
CHAT = [{"role": "user", "content": "What time is it?"}]


class TemplateLink(ScriptedLink):
    """:class:`ScriptedLink` whose model's worker renders with ``template`` (its ``--chat-template``)."""

    def __init__(self, client, template: str) -> None:
        super().__init__(client)
        self.template = template

    def model_info(self, model: str):
        return super().model_info(model)._replace(chat_template=self.template)


def test_a_worker_tells_the_template_its_option_gave_it(tiny_text_dir):
    from worker.config import WorkerConfig
    from worker.models import load_model
    from worker.process import WorkerProcess

    given = WorkerProcess(WorkerConfig(num_slots=1), model=load_model(tiny_text_dir, chat_template=OPTION))
    own = WorkerProcess(WorkerConfig(num_slots=1), model=load_model(tiny_text_dir))
    assert given.info.chat_template == OPTION and own.info.chat_template == ""
    msg = Register(model="m", num_slots=1, max_inflight=1, info=given.info)  # (what the broker and gateways are told)
    assert decode(encode(msg)).info.chat_template == OPTION


def test_an_older_peer_s_model_info_without_it_still_decodes():
    import msgpack

    from protocol.messages import PROTOCOL_VERSION

    short = list(ModelInfo(vocab_size=10, reasoning="qwen3"))[:-1]  # (8 fields: a v10 worker's)
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "model": "m", "num_slots": 1,
                           "max_inflight": 1, "info": short}, use_bin_type=True)
    assert decode(frame).info == ModelInfo(vocab_size=10, reasoning="qwen3", chat_template="")


@pytest.fixture
def tokenize(tiny_text_dir):
    """``(http, client, codec)``: the handlers app over the tiny model's tokenizer (its own template)
    whose model's worker renders with OPTION, the scripted client (what chat requests submitted), and
    the codec that renders as that worker does."""
    from tests.gateway.test_tokenize_tools import Chats

    tok = transformers.AutoTokenizer.from_pretrained(tiny_text_dir)
    own = HFTextCodec(tok)
    client = Chats()
    with TestClient(handlers_app(Tokenizers(lambda name: Tokenizer(own, tok)), TemplateLink(client, OPTION))) as http:
        yield http, client, own.with_chat_template(OPTION)
    for t in client.threads:
        t.join(10)


@pytest.mark.parametrize("extra", [{}, {"add_generation_prompt": False}, {"tools": TOOLS}])
def test_tokenize_renders_a_chat_with_the_workers_template(tokenize, extra):
    from tests.gateway.test_tokenize_tools import worker_prompt

    http, client, worker_codec = tokenize
    r = http.post("/tokenize", json={"model": "m", "messages": CHAT, **extra})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = worker_codec.decode(ids, skip_special_tokens=False)
    assert "[[user]] What time is it?" in text and text.endswith("[[bot]]") is ("add_generation_prompt" not in extra)
    if "add_generation_prompt" not in extra:  # the chat request's prompt, as the worker renders it
        chat = http.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 1, **extra})
        assert chat.status_code == 200, chat.text
        assert ids == worker_prompt(worker_codec, client.submitted[-1])
        assert ("get_time" in text) is ("tools" in extra)


def test_auto_reads_the_workers_template_before_the_tokenizers(monkeypatch):
    """The tokenizer's template is Hermes' (Qwen2.5's excerpt); the worker renders with a Mistral one:
    the answer is read, and ``required`` constrained, in Mistral's syntax. No tokenizer is needed."""
    from types import SimpleNamespace

    monkeypatch.setitem(test_tools_stream.OUTPUTS, "mistral", MISTRAL)
    hermes = Tokenizer(None, SimpleNamespace(chat_template=TEMPLATES["hermes"]))
    for load in (lambda name: hermes, None):
        client = OutputClient()
        with TestClient(handlers_app(Tokenizers(load), TemplateLink(client, TEMPLATES["mistral"]),
                                     GatewayConfig(tool_call_parser="auto"))) as http:
            sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            r = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "mistral"}],
                                            max_tokens=60, tools=TOOLS)
            assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
            sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "plain"}], max_tokens=60,
                                        tools=TOOLS, tool_choice="required")
            assert client.submitted[-1].structured.spec.startswith('start: "[TOOL_CALLS]"')
        for t in client.threads:
            t.join(10)
