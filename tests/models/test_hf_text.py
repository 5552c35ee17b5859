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
