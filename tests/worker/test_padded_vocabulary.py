"""A ``logit_bias`` on an id the model's tokenizer does not define is refused at submission, naming the
id: Qwen2.5's vocabulary of 151,665 tokens is padded to the model's 151,936 embedding rows (llama.cpp's
GGUF names the padding ``[PAD151665]`` ... as tokens of type UNUSED, which transformers' conversion
reads as ordinary tokens), and a bias of +100 on one made the model write ``[PAD151665]`` tokens. Each
tokenizer the aliases install (the Qwen2.5-Coder GGUF's, SmolLM2's, which pads nothing) and a
transformers-style one whose vocabulary is shorter than the model's rows; the engine's check is every
entry point's (the worker answers a request from the gateway or the SDK with its ValueError as
``bad_request``). No model is loaded: a stand-in model with the real tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.support.vocab import QWEN, SMOLLM2, byte_level, kept_tokenizer  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models.hf_text import HFTextCodec  # noqa: E402


def padded_byte_level():
    from transformers import TokenizersBackend

    return TokenizersBackend(tokenizer_object=byte_level(False))  # 257 tokens: 256 bytes and the EOS


TOKENIZERS = {  # name -> (made, the model's rows, the undefined ranges)
    "qwen2.5-coder": (lambda: kept_tokenizer(QWEN), 151936, ((151665, 151936),)),
    "smollm2": (lambda: kept_tokenizer(SMOLLM2), 49152, ()),
    "byte-level": (padded_byte_level, 320, ((257, 320),)),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def padded(request):
    """``(codec, rows, undefined ranges)`` of each tokenizer (skipped where its package is not installed)."""
    made, rows, undefined = TOKENIZERS[request.param]
    tok = made()
    if tok is None:
        pytest.skip(f"no {request.param} tokenizer on disk (install its alias and load it once)")
    return HFTextCodec(tok), rows, undefined


class Padded:
    """A model of ``vocab_size`` rows with ``tokenizer``; generates token 1."""

    def __init__(self, tokenizer: HFTextCodec, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def next_tokens(self, sequences):
        return [1 for _ in sequences]


def test_the_undefined_ids_are_the_padding(padded):
    codec, rows, undefined = padded
    assert codec.undefined_ids(rows) == undefined
    for start, stop in undefined:  # (GGUF's: a token each, '[PAD<id>]'; transformers': none at all)
        assert codec.decode([start]) in ("", f"[PAD{start}]") and codec.decode([stop - 1]) in ("", f"[PAD{stop - 1}]")


def test_a_bias_on_an_undefined_id_is_refused_naming_it(padded):
    codec, rows, undefined = padded
    engine = BatchInferenceEngine(Padded(codec, rows), 2)
    for start, stop in undefined:
        for token in (start, stop - 1):
            with pytest.raises(ValueError, match=rf"^logit_bias holds token id {token}, which the model's tokenizer "
                                                 rf"does not define \(ids {start}\.\.{stop - 1} "):
                engine.submit_request([1, 2], 3, logit_bias={5: 1.0, token: 100.0})
    last = (undefined[0][0] if undefined else rows) - 1  # (the last id the tokenizer defines)
    handle = engine.submit_request([1, 2], 3, logit_bias={last: 100.0, 0: -100.0})  # (defined ids: taken)
    engine.run()
    assert handle.finish_reason == "length"
    with pytest.raises(ValueError, match=f"outside the model's vocabulary \\[0, {rows}\\)"):  # (past the rows, as before)
        engine.submit_request([1, 2], 3, logit_bias={rows: 1.0})


def test_holes_inside_the_vocabulary_are_ranges_of_their_own():
    from tokenizers import AddedToken
    from transformers import TokenizersBackend

    tok = byte_level(False)
    tok.add_tokens([AddedToken("[PAD257]", special=True)])  # (a llama.cpp padding token at its own id, 257)
    tok.add_tokens([AddedToken("[PAD7]", special=True)])     # (at 258: not its id, so a real token)
    assert HFTextCodec(TokenizersBackend(tokenizer_object=tok)).undefined_ids(262) == ((257, 258), (259, 262))
