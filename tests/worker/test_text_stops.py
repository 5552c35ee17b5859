"""Text stop strings and streamed text: :class:`worker.text.TextStream` against
an oracle (hypothesis, a real byte-level BPE tokenizer), then through the
in-process engine with a model whose output is known exactly
(:class:`tests.support.tiny_text.ScriptedTextModel`) and with a real HF model.

What is pinned: the text is ``decode(tokens)`` cut before the first stop
string to complete (after it with ``include_stop_str_in_output``); the tokens
run up to and including the one that completed it; streamed pieces add up to
the final text and hold back exactly the longest end that starts a stop
string; ``min_tokens`` passes over earlier matches; a stream resumed from any
token continues the same text (migration, resubmission).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from protocol.enums import FinishReason  # noqa: E402
from protocol.request import MAX_STOP_CHARS, MAX_STOP_STRINGS, RequestParams  # noqa: E402
from tests.support.tiny_text import ScriptedTextModel  # noqa: E402
from worker import BatchInferenceEngine, SimulatedLLM, UnsupportedError  # noqa: E402
from worker.text import TextStream  # noqa: E402

SCRIPT = "Hello world, the quick brown fox 😀 jumps over 日本 the lazy dog."
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def scripted(tiny_text_dir):
    return ScriptedTextModel(tiny_text_dir, SCRIPT, len(PROMPT))


@pytest.fixture(scope="module")
def codec(scripted):
    return scripted.tokenizer


# ---------------------------------------------------------------------- the oracle


def complete_text(codec, tokens) -> str:
    """The text of ``tokens`` as far as whole characters go (valid UTF-8 input:
    an incomplete last character decodes to U+FFFD)."""
    return codec.decode(tokens).rstrip("\ufffd")


def held(text: str, stops, include: bool) -> int:
    """The longest end of ``text`` that is a proper start of a stop string."""
    if include:
        return 0
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


def expected(codec, tokens, stops, include, min_tokens):
    """(tokens consumed, final text, stop string or None) by brute force."""
    prev = ""
    for k in range(1, len(tokens) + 1):
        text = complete_text(codec, tokens[:k])
        if k >= min_tokens:
            found = []  # (end, list position, stop) of each string's first match ending in this token's text
            for i, s in enumerate(stops):
                start = text.find(s, max(0, len(prev) - len(s) + 1))
                if start != -1:
                    found.append((start + len(s), i, s))
            if found:
                end, _, s = min(found)
                return k, text[:end if include else end - len(s)], s
        prev = text
    return len(tokens), codec.decode(tokens), None


ALPHABET = "ab c\n,é日😀"


@st.composite
def cases(draw):
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=24))
    substrings = st.integers(0, len(text) - 1).flatmap(
        lambda i: st.integers(i + 1, min(len(text), i + 6)).map(lambda j: text[i:j]))
    stops = draw(st.lists(st.one_of(substrings, st.text(alphabet=ALPHABET, min_size=1, max_size=4)),
                          max_size=3, unique=True))
    return text, stops, draw(st.booleans()), draw(st.integers(0, 8)), draw(st.integers(0, 100))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_stream_is_decode_cut_at_first_match_and_holds_back_just_enough(codec, case):
    text, stops, include, min_tokens, resume_pct = case
    tokens = codec.encode(text)
    k_want, text_want, stop_want = expected(codec, tokens, stops, include, min_tokens)

    ts = TextStream(codec, stops, include)
    pieces, hit = [], None
    for k, t in enumerate(tokens, 1):
        hit = ts.feed(t, k >= min_tokens)
        pieces.append(ts.take())
        if hit is None:  # released = the whole text so far, less exactly the end that starts a stop string
            so_far = complete_text(codec, tokens[:k])
            assert "".join(pieces) == so_far[:len(so_far) - held(so_far, stops, include)]
        else:
            break
    ts.finish(tokens[:k])
    pieces.append(ts.take())
    assert (k, ts.text, hit) == (k_want, text_want, stop_want)
    assert "".join(pieces) == ts.text  # streamed pieces add up to the final text (so no streamed stop prefix)

    # Resumed after any token before the last (a migration, a resubmission; a request that has its
    # last token has ended): the same text, no gap, no duplicate, the same match.
    r = (k - 1) * resume_pct // 100
    again = TextStream(codec, stops, include, resumed=tokens[:r])
    rest, hit2 = [], None
    for j, t in enumerate(tokens[r:k], r + 1):
        hit2 = again.feed(t, j >= min_tokens)
        rest.append(again.take())
    again.finish(tokens[:k])
    rest.append(again.take())
    assert "".join(pieces[:r]) + "".join(rest) == ts.text and hit2 == hit


def test_a_character_split_over_byte_tokens_is_held_whole(codec):
    tokens = codec.encode(" 😀 日本")
    assert len(tokens) >= 6  # the tiny tokenizer has no merges for these: one token per byte
    ts = TextStream(codec)
    pieces = []
    for t in tokens:
        ts.feed(t)
        pieces.append(ts.take())
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == " 😀 日本"
    assert pieces[1:4] == ["", "", ""]  # three of the emoji's four bytes show nothing


def test_an_incomplete_last_character_decodes_as_the_tokenizer_does(codec):
    tokens = codec.encode("ab 😀")[:-2]  # cut inside the emoji
    ts = TextStream(codec, ["zz"])
    for t in tokens:
        ts.feed(t)
    assert ts.text == "ab "  # the emoji's first bytes show nothing yet
    ts.finish(tokens)
    assert ts.text == codec.decode(tokens) and ts.text.endswith("\ufffd")



@pytest.fixture(scope="module")
def merged():
    """A byte-level BPE codec whose merges join whole characters with part of the next one, as
    Qwen2.5's vocabulary does (its token "お" + two bytes of the next character, and 265 more):
    "お動" is ["お\\xe5\\x8b", "\\x95"], "a日x" is ["a\\xe6", "\\x97\\xa5x"]."""
    import tokenizers
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from worker.models.hf_text import HFTextCodec

    chars = bytes_to_unicode()
    spell = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    vocab = {spell(bytes([b])): i for i, b in enumerate(sorted(chars))}
    merges = []
    for left, right in ((b"\xe3", b"\x81"), (b"\xe3\x81", b"\x8a"), (b"\xe3\x81\x8a", b"\xe5"),
                        (b"\xe3\x81\x8a\xe5", b"\x8b"), (b"a", b"\xe6"), (b"\x97", b"\xa5"), (b"\x97\xa5", b"x")):
        merges.append((spell(left), spell(right)))
        vocab[spell(left + right)] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return HFTextCodec(transformers.PreTrainedTokenizerFast(tokenizer_object=tok))


@pytest.mark.parametrize("text, stop", [("お動", "お"), ("a日x", "a"), ("zお動", "zお"),
                                        ("お動お動", "動お")])
def test_whole_characters_in_a_token_that_ends_inside_the_next_are_text_at_that_token(merged, text, stop):
    # tokenizers' DecodeStream shows nothing of a token whose text ends inside a character, not even the
    # whole characters before it: the stop string "お" in Qwen2.5's token "お" + 2 bytes matched a token
    # late, and not at all when the request ended at that token (its text 'お\ufffd', finish "length").
    tokens = merged.encode(text)
    k_want, text_want, stop_want = expected(merged, tokens, [stop], False, 0)
    ts, pieces = TextStream(merged, [stop]), []
    for k, t in enumerate(tokens, 1):
        hit = ts.feed(t)
        pieces.append(ts.take())
        if hit is not None:
            break
    assert (k, ts.text, hit) == (k_want, text_want, stop_want)
    assert "".join(pieces) == ts.text
    for k in range(1, len(tokens) + 1):  # without stops: each token's whole characters stream at once
        ts, pieces = TextStream(merged), []
        for t in tokens[:k]:
            ts.feed(t)
            pieces.append(ts.take())
        assert "".join(pieces) == complete_text(merged, tokens[:k])
        ts.finish(tokens[:k])
        pieces.append(ts.take())
        assert "".join(pieces) == ts.text == merged.decode(tokens[:k])


def test_merged_tokens_keep_the_property(merged):
    # the oracle's cases over the merged codec: the split character of each token streams as whole text
    text = "お動a日xお動"
    tokens = merged.encode(text)
    assert len(tokens) < len(text.encode())  # (merges were used)
    for stops in (["動"], ["日x", "お動a"], ["xお"], ["動a"]):
        for include in (False, True):
            k_want, text_want, stop_want = expected(merged, tokens, stops, include, 0)
            ts, pieces = TextStream(merged, stops, include), []
            for k, t in enumerate(tokens, 1):
                hit = ts.feed(t)
                pieces.append(ts.take())
                if hit is not None:
                    break
            ts.finish(tokens[:k])
            pieces.append(ts.take())
            assert (k, ts.text, hit) == (k_want, text_want, stop_want) and "".join(pieces) == ts.text


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_request_ending_at_such_a_token_stops_on_its_whole_characters(merged, max_tokens):
    # Qwen2.5 through the engine: the request ended "length" with text 'お\ufffd' at max_tokens 1 (the stop
    # string in its text uncut), and at 2 it took the second token before it saw the stop.
    script = merged.encode("お動")

    class Scripted:
        tokenizer, vocab_size = merged, 400

        def next_tokens(self, sequences):
            return [script[len(s) - 2] for s in sequences]

    engine = BatchInferenceEngine(Scripted(), batch_size=1, stop_token=None)
    streamed = []
    h = engine.submit_request([1, 2], max_tokens, stop=["お"], on_text=streamed.append)
    engine.run()
    assert (h.finish_reason, h.stop_reason, h.tokens, h.text) == (FinishReason.STOP, "お", script[:1], "")
    assert streamed == []

# ---------------------------------------------------------------------- the request definition


def test_stop_field_takes_a_string_or_strings_and_refuses_the_rest():
    assert RequestParams([1], 2, stop="\n").stop == ("\n",)
    assert RequestParams([1], 2, stop=["a", "b", "a"]).stop == ("a", "b")
    assert RequestParams([1], 2, stop=None).stop == ()
    for bad, message in [([""], "stop[0] must not be empty"), ([[1, 2]], "stop_sequences"),
                         ([1], "stop[0] must be a str"), (["\ud83d"], "not valid Unicode"),
                         (["x" * (MAX_STOP_CHARS + 1)], "at most"),
                         ([str(i) for i in range(MAX_STOP_STRINGS + 1)], "at most"), (5, "a str or a list")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            RequestParams([1], 2, stop=bad)
    with pytest.raises(ValueError, match="true or false"):
        RequestParams([1], 2, include_stop_str_in_output=1)


def test_a_row_stop_shares_strings_and_token_lists_out():
    p = RequestParams.from_mapping({"prompt": [1], "max_tokens": 2, "stop": ["\n\n", [13, 13], "END"]})
    assert p.stop == ("\n\n", "END") and p.stop_sequences == ((13, 13),)
    assert RequestParams.from_mapping({"prompt": [1], "max_tokens": 2, "stop": [[4], [5, 6]]}).stop_sequences \
        == ((4,), (5, 6))  # what a row's "stop" always meant
    assert RequestParams.from_mapping({"prompt": [1], "max_tokens": 2, "stop": "x"}).stop == ("x",)
    with pytest.raises(ValueError, match="stop_sequences'], not both"):
        RequestParams.from_mapping({"prompt": [1], "max_tokens": 2, "stop": [[1]], "stop_sequences": [[2]]})
    with pytest.raises(ValueError, match=r"stop\[0\] must be a str .* or a list of token ids"):
        RequestParams.from_mapping({"prompt": [1], "max_tokens": 2, "stop": [13, 13]})


# ---------------------------------------------------------------------- the engine, output known exactly


def run_one(model, max_tokens=40, **kw):
    engine = BatchInferenceEngine(model, batch_size=4)
    pieces, tokens = [], []
    h = engine.submit_request(PROMPT, max_tokens, on_token=tokens.append, on_text=pieces.append, **kw)
    engine.run()
    assert "".join(pieces) == h.text and tokens == h.tokens
    return h


def test_token_prompts_get_text_too(scripted, codec):
    engine = BatchInferenceEngine(scripted, batch_size=2)
    h = engine.submit_request(PROMPT, 20)
    engine.run()
    assert h.text == codec.decode(h.tokens) == SCRIPT[:len(h.text)] and len(h.tokens) == 20


@pytest.mark.parametrize("stop", ["quick bro", "x 😀 j", "ck", "😀", " the lazy"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_ends_the_text_before_it(scripted, codec, stop, include):
    script = scripted.script
    h = run_one(scripted, 60, stop=["never", stop], include_stop_str_in_output=include)
    at = SCRIPT.index(stop)
    assert h.finish_reason is FinishReason.STOP and h.stop_reason == stop
    assert h.text == SCRIPT[:at + len(stop) if include else at]
    # The tokens: up to and including the one that completed the match (vLLM's).
    k = next(k for k in range(1, len(script) + 1) if stop in codec.decode(script[:k]))
    assert h.tokens == script[:k]


def test_several_stops_the_first_to_complete_wins(scripted):
    h = run_one(scripted, 60, stop=["brown fox", "quick", "the quick brown"])
    assert h.stop_reason == "quick" and h.text == SCRIPT[:SCRIPT.index("quick")]


def test_min_tokens_passes_over_an_earlier_match(scripted, codec):
    first_o = next(k for k in range(1, 60) if "o" in codec.decode(scripted.script[:k]))
    h = run_one(scripted, 60, stop=["o"], min_tokens=first_o + 1)
    text = codec.decode(h.tokens)
    assert h.stop_reason == "o" and text.count("o") >= 2
    assert h.text == text[:text.rindex("o")] and h.text.count("o") == text.count("o") - 1


def test_held_text_is_released_when_the_request_ends_another_way(scripted, codec):
    # "fox 😀X" never matches; its start "fox 😀" is held until max_tokens ends the request.
    n = next(k for k in range(1, 60) if codec.decode(scripted.script[:k]).endswith("fox 😀"))
    pieces = []
    engine = BatchInferenceEngine(scripted, batch_size=2)
    h = engine.submit_request(PROMPT, n, stop=["fox 😀X"], on_text=pieces.append)
    seen_before_end = []
    engine.submit_request(PROMPT, n - 1, callback=lambda seq: seen_before_end.append("".join(pieces)))
    engine.run()
    assert h.finish_reason is FinishReason.LENGTH and h.text == codec.decode(h.tokens)
    assert h.text.endswith("fox 😀") and "".join(pieces) == h.text
    assert seen_before_end == [h.text[:h.text.rindex("fox")]]  # held back while it could still match


def test_a_request_without_text_stops_beside_one_with_them_is_unchanged(scripted):
    engine = BatchInferenceEngine(scripted, batch_size=3)
    plain = engine.submit_request(PROMPT, 30)
    stopped = engine.submit_request(PROMPT, 30, stop=["brown"])
    engine.run()
    assert plain.finish_reason is FinishReason.LENGTH and len(plain.tokens) == 30
    assert stopped.finish_reason is FinishReason.STOP and plain.tokens[:len(stopped.tokens)] == stopped.tokens


def test_resumed_request_streams_only_new_text_and_matches_across_the_resume_point(scripted, codec):
    script = scripted.script
    k = next(k for k in range(1, 60) if codec.decode(script[:k]).endswith("fox"))
    engine = BatchInferenceEngine(scripted, batch_size=1)
    pieces = []
    h = engine.submit_request(PROMPT, 60, stop=["fox 😀 j"], on_text=pieces.append, resume_tokens=script[:k])
    engine.run()
    assert h.stop_reason == "fox 😀 j" and h.text == SCRIPT[:SCRIPT.index("fox")]
    assert "".join(pieces) == ""  # "fox" was held when it was resumed, and the match swallowed it


def test_text_needs_a_tokenizer_at_submit():
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=1)
    with pytest.raises(UnsupportedError, match="stop strings need a model with a tokenizer"):
        engine.submit_request([1, 2], 4, stop=["x"])
    with pytest.raises(UnsupportedError, match="on_text"):
        engine.submit_request([1, 2], 4, on_text=print)
    assert engine.num_queued == 0
    h = engine.submit_request([1, 2], 4, stop_sequences=[[3]])  # token-id stops still work there
    engine.run()
    assert h.text is None


def test_a_failing_on_text_ends_its_request_only(scripted):
    engine = BatchInferenceEngine(scripted, batch_size=2)

    def boom(piece):
        raise RuntimeError("no")

    bad = engine.submit_request(PROMPT, 10, on_text=boom)
    good = engine.submit_request(PROMPT, 10, on_text=lambda piece: None)
    engine.run()
    assert bad.finish_reason is FinishReason.ERROR and isinstance(bad.error, RuntimeError)
    assert good.finish_reason is FinishReason.LENGTH and len(good.tokens) == 10


def test_a_real_model_stops_on_text_it_generated(tiny_text_dir):
    from worker.models import load_model

    model = load_model(tiny_text_dir)
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=None)
    free = engine.submit_request("hello world", 40)
    engine.run()
    text = free.text
    assert text == model.tokenizer.decode(free.tokens)
    # a stop string from the middle of what it wrote, away from broken characters
    at = next(i for i in range(len(text) // 3, len(text) - 4) if "\ufffd" not in text[i - 1:i + 5])
    stop = text[at:at + 4]
    h = engine.submit_request("hello world", 40, stop=stop)
    engine.run()
    assert h.finish_reason is FinishReason.STOP and h.stop_reason == stop
    assert h.text == text[:text.index(stop)] and h.tokens == free.tokens[:len(h.tokens)]
    assert stop in model.tokenizer.decode(h.tokens)
