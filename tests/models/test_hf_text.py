"""Text in and out (HFTextCodec) with a byte-level BPE tokenizer trained here.

The tokenizer is trained on a tiny corpus with a small vocabulary, so
multi-byte characters (accents, CJK, emoji) span several tokens: streamed
text must hold them back until complete.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from worker.models.hf_text import HFTextCodec  # noqa: E402

pytestmark = pytest.mark.hf

TEXTS = [
    "Hello world, plain ASCII.",
    "héllo wörld — naïve café",
    "日本語のテキスト and 中文",
    "emoji 🎉🚀 mixed with ä and ß",
]

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def codec():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    return HFTextCodec(fast)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(codec, text):
    ids = codec.encode(text)
    assert codec.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[1:])
def test_streamed_text_never_splits_characters(codec, text):
    prompt = codec.encode("hello ")
    ids = codec.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 2  # several tokens per multi-byte char
    decoder = codec.decoder(prompt)
    pieces = [decoder.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens completed no character


def test_chat_template(codec):
    messages = [{"role": "user", "content": "héllo"}]
    ids = codec.apply_chat_template(messages)
    assert codec.decode(ids) == "<|user|>héllo\n<|assistant|>"


@pytest.mark.parametrize(
    "messages", [[], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [["user", "hi"]]]
)
def test_bad_messages_raise_value_error(codec, messages):
    with pytest.raises(ValueError):
        codec.apply_chat_template(messages)


@pytest.mark.parametrize("text", ["", None, 5, b"bytes"])
def test_bad_text_raises_value_error(codec, text):
    with pytest.raises(ValueError):
        codec.encode(text)


# ---------------------------------------------------------------------- --chat-template (issue 33, item 4)

OPTION_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.parametrize("given_as", ["text", "file"])
def test_a_chat_template_option_renders_the_chats(tiny_text_dir, tmp_path, given_as):
    from worker import BatchInferenceEngine
    from worker.models import load_model

    value = OPTION_TEMPLATE
    if given_as == "file":
        value = str(tmp_path / "template.jinja")
        (tmp_path / "template.jinja").write_text(OPTION_TEMPLATE)
    model = load_model(tiny_text_dir, chat_template=value)
    chat = [{"role": "user", "content": "hi there"}]
    rendered = "[user] hi there\n[assistant] "
    assert model.tokenizer.apply_chat_template(chat) == model.tokenizer.encode(rendered)
    engine = BatchInferenceEngine(model, batch_size=1, stop_token=None)
    h = engine.submit_request(chat, 2)
    engine.run()
    assert list(h.prompt) == model.tokenizer.encode(rendered)


@pytest.mark.parametrize("value, says", [("no-such-file.jinja", "no file"), ("{% for x in %}", "does not parse"),
                                         ("  ", "no file")])
def test_a_bad_chat_template_is_a_value_error_at_load(tiny_text_dir, value, says):
    from worker.models import load_model

    with pytest.raises(ValueError, match=says):
        load_model(tiny_text_dir, chat_template=value)


def test_a_model_without_a_template_names_the_option(tiny_text_dir):
    from worker.models import load_model

    import copy

    tok = copy.copy(load_model(tiny_text_dir).tokenizer._tok)
    tok.chat_template = None  # (as the Gemma 3 GGUF has none)
    with pytest.raises(ValueError, match="--chat-template"):
        HFTextCodec(tok).apply_chat_template([{"role": "user", "content": "hi"}])
    assert load_model(tiny_text_dir).tokenizer._tok.chat_template  # the model's own is untouched


def test_simulated_refuses_a_chat_template():
    from worker.models import load_model

    with pytest.raises(ValueError, match="chat_template"):
        load_model("simulated", chat_template=OPTION_TEMPLATE)


# ---------------------------------------------------------------------- chat_template_kwargs (issue 33, item 2)

THINKING_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}[assistant] {% if enable_thinking is defined and "
                     "not enable_thinking %}<think></think> {% endif %}{% if reasoning_effort is defined %}"
                     "effort={{ reasoning_effort }} {% endif %}{% endif %}")
"""A template that reads two request variables, as Qwen3's reads ``enable_thinking`` and gpt-oss's ``reasoning_effort``."""


def test_chat_template_kwargs_reach_the_template_through_the_engine(tiny_text_dir):
    from worker import BatchInferenceEngine
    from worker.models import load_model

    model = load_model(tiny_text_dir, chat_template=THINKING_TEMPLATE)
    chat = [{"role": "user", "content": "hi"}]
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=None)
    plain = engine.submit_request(chat, 1)
    off = engine.submit_request(chat, 1, chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    engine.run()
    assert list(plain.prompt) == model.tokenizer.encode("[user] hi\n[assistant] ")
    assert list(off.prompt) == model.tokenizer.encode("[user] hi\n[assistant] <think></think> effort=low ")


@pytest.mark.parametrize("kwargs, says", [({"tools": []}, "set by the server"),
                                          ({"chat_template": "x"}, "set by the server"),
                                          ({"add_generation_prompt": False}, "set by the server"),
                                          ({"not an identifier": 1}, "identifier"),
                                          ({"x": float("nan")}, r"chat_template_kwargs\.x is NaN, which is no JSON number"),
                                          ([["x", 1]], "object of chat template variables"),
                                          ("[1]", "object of chat template variables"),
                                          ("{", "JSON object")])
def test_chat_template_kwargs_that_would_change_the_rendering_itself_are_refused(kwargs, says):
    from protocol.request import RequestParams

    with pytest.raises(ValueError, match=says):
        RequestParams([{"role": "user", "content": "hi"}], 2, chat_template_kwargs=kwargs)


def test_chat_template_kwargs_need_a_chat_and_an_empty_object_is_none():
    from protocol.request import RequestParams

    with pytest.raises(ValueError, match="need a chat prompt"):
        RequestParams("text", 2, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match="need a chat prompt"):
        RequestParams([1, 2], 2, chat_template_kwargs={"enable_thinking": False})
    assert RequestParams([{"role": "user", "content": "hi"}], 2, chat_template_kwargs={}).chat_template_kwargs is None
    assert RequestParams([{"role": "user", "content": "hi"}], 2, chat_template_kwargs={"b": 1, "a": [True]}
                         ).chat_template_kwargs == '{"a":[true],"b":1}'


# ---------------------------------------------------------------------- the thinking format, read from the template

R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}"
               "<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
"""DeepSeek-R1-Distill's shape: the generation prompt opens the thinking."""
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
"""Qwen3's shape: the model opens the thinking; ``enable_thinking=false`` writes an empty block."""


@pytest.mark.parametrize("template, expected", [(R1_TEMPLATE, "deepseek_r1"), (QWEN3_TEMPLATE, "qwen3"),
                                                (TEMPLATE, ""), (THINKING_TEMPLATE, "qwen3")])
def test_the_thinking_format_is_read_from_the_template_in_use(codec, template, expected):
    assert codec.with_chat_template(template).reasoning_format == expected


def test_a_model_without_a_template_has_no_thinking_format(tiny_text_dir):
    import copy

    from worker.models import load_model

    tok = copy.copy(load_model(tiny_text_dir).tokenizer._tok)
    tok.chat_template = None
    assert HFTextCodec(tok).reasoning_format == ""


def test_every_name_the_template_kwargs_meet_on_their_way_to_the_template_is_reserved():
    """``chat_template_kwargs`` go as keyword arguments through transformers' ``apply_chat_template``,
    ``render_jinja_template`` and jinja's ``Template.render``: a name of one of their parameters
    (``self`` included) must be refused by the protocol, not become Python's "got multiple values"."""
    import inspect

    import jinja2
    from transformers.utils import chat_template_utils

    from protocol.request import TEMPLATE_RESERVED

    names = set()
    for fn in (transformers.PreTrainedTokenizerBase.apply_chat_template, chat_template_utils.render_jinja_template,
               jinja2.Template.render):
        names |= {n for n, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD
                  and p.kind is not p.VAR_POSITIONAL}
    assert names - TEMPLATE_RESERVED == set()


TOOLS_TEMPLATE = ("{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
                  "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tools(levels: int) -> list[dict]:
    """One tool whose parameters nest ``levels`` levels of arrays and objects (the tools list's own too)."""
    inner: object = 1
    for _ in range(levels - 4):  # (the list, the tool, its function and its parameters are 4)
        inner = [inner]
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": inner}}}]


def test_tools_as_deep_as_a_request_takes_render_and_deeper_ones_are_refused_in_our_words(tiny_text_dir):
    # tools 500 levels deep (the Python SDK's, a JSONL row's, or JSON text) were taken, and the worker's template
    # render failed in Python's words: 'chat template rejected the messages: maximum recursion depth exceeded'
    # (transformers' mark_control_tokens recurses twice a level); a request now nests at most MAX_JSON_DEPTH
    from protocol.validation import MAX_JSON_DEPTH, json_depth
    from worker import BatchInferenceEngine
    from worker.models import load_model

    engine = BatchInferenceEngine(load_model(tiny_text_dir, chat_template=TOOLS_TEMPLATE), batch_size=1,
                                  stop_token=None)
    chat = [{"role": "user", "content": "hi"}]
    deepest = _tools(MAX_JSON_DEPTH)
    assert json_depth(deepest) == MAX_JSON_DEPTH
    h = engine.submit_request(chat, 1, tools=deepest)
    engine.run()
    assert h.finish_reason == "length" and len(h.prompt) > 2 * MAX_JSON_DEPTH  # (the tools rendered: "[[[...]]]")
    for levels in (MAX_JSON_DEPTH + 1, 500):
        with pytest.raises(ValueError) as e:
            engine.submit_request(chat, 1, tools=_tools(levels))
        assert str(e.value).startswith("tools nests arrays and objects more than 200 levels deep"), e.value
        assert "recursion" not in str(e.value)
    assert engine.num_queued == 0


def test_tokenizer_json_has_padding_and_truncation_off_and_leaves_the_codec_as_it_was(codec):
    """llguidance's input: the tokenizers library's JSON with padding and truncation off. Where the
    kept tokenizer has them off already it is written as it is (no copy: a copy is a JSON round trip,
    ~0.5 s of a Qwen warm-up); where they are on, a copy has them switched off, the codec's own not."""
    import json

    backend = codec._backend
    assert backend.padding is None and backend.truncation is None
    assert codec.tokenizer_json() == backend.to_str()
    backend.enable_padding(pad_id=0, pad_token="<eos>")
    backend.enable_truncation(max_length=8)
    try:
        data = json.loads(codec.tokenizer_json())
        assert data["padding"] is None and data["truncation"] is None
        assert backend.padding is not None and backend.truncation is not None
    finally:
        backend.no_padding()
        backend.no_truncation()


DROPS_ASSISTANT = (  # renders the users' turns only: a final assistant message never appears in the chat
    "SYSTEM PROMPT NOT FOR CLIENTS\n{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("entry", ["worker codec", "gateway tokenizer"])
def test_a_final_message_the_template_drops_is_refused_in_our_words_without_the_rendered_chat(codec, entry):
    """transformers refuses continue_final_message when the template drops the final message, with
    the whole rendered chat in its message (the template's own text): the worker's codec and the
    gateway's tokenizer (its add_special_tokens path, transformers' renderer) say it in our words."""
    from gateway.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The answer is"}]
    dropping = codec.with_chat_template(DROPS_ASSISTANT)
    with pytest.raises(ValueError) as info:
        if entry == "worker codec":
            dropping.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
        else:
            Tokenizer(dropping, hf=codec._tok).chat(chat, add_generation_prompt=False, add_special_tokens=True,
                                                   template=DROPS_ASSISTANT, continue_final_message=True)
    said = str(info.value)
    assert said.startswith("continue_final_message: the chat template changes or drops the final message's text")
    assert "SYSTEM PROMPT" not in said and "Rendered chat" not in said


def test_a_template_error_without_continue_final_message_keeps_the_templates_words(codec):
    raising = codec.with_chat_template("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template rejected the messages: Conversation roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
