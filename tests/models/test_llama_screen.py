"""The screened LM head (worker/models/llama/screen.py): bf16 screen, fp32 decision, same argmax as fp32."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.slot_models import generate_alone, save_tiny_llama  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.llama import from_hf  # noqa: E402
from worker.models.llama.linear import DenseLinear  # noqa: E402
from worker.models.llama.screen import (  # noqa: E402
    MAX_CANDIDATES, ScreenedHead, bf16_product_available, entries_at_least, screened_head)

needs_bf16 = pytest.mark.skipif(not bf16_product_available(), reason="oneDNN has no bf16 product on this CPU")

VOCAB, K = 2048, 64


def near_tie_head(seed: int = 0) -> torch.Tensor:
    """``[VOCAB, K]`` fp32 whose rows come in pairs closer than bf16 can tell apart (0.1 % apart:
    their logits differ by ~1e-2, far above fp32's rounding and far below bf16's)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, K, generator=gen) * 0.5
    w[1::2] = w[0::2] * (1 + 1e-3 * torch.randn(VOCAB // 2, K, generator=gen))
    return w


def screened(w: torch.Tensor) -> ScreenedHead:
    return ScreenedHead(w, DenseLinear(w), lambda ids: w[ids])


@needs_bf16
def test_the_screened_argmax_is_the_fp32_argmax_where_bf16_alone_picks_wrong():
    w = near_tie_head()
    head = screened(w)
    gen = torch.Generator().manual_seed(1)
    # hidden states pointing at a pair's rows: the pair's logits differ in the 4th-5th digit
    x = w[torch.randint(0, VOCAB, (400,), generator=gen)] * 3 + 0.05 * torch.randn(400, K, generator=gen)
    with torch.inference_mode():
        got = head.greedy_logits(x)
        want = x @ w.T
        approx = head.screen(x)
    top2 = want.topk(2, dim=1).values
    decided = top2[:, 0] - top2[:, 1] > 1e-4  # not a tie within fp32 rounding (then either is fp32's)
    assert decided.float().mean() > 0.9
    assert torch.equal(got.argmax(dim=1)[decided], want.argmax(dim=1)[decided])
    assert (approx.argmax(dim=1) != want.argmax(dim=1))[decided].any()  # the screen alone would be wrong
    finite = torch.isfinite(got)
    assert (finite.sum(dim=1) >= 2).all()  # each pair is a candidate together
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert (got[~finite] == float("-inf")).all()


@needs_bf16
def test_rows_that_cannot_be_screened_take_the_full_product_and_non_finite_rows_stay_non_finite():
    w = near_tie_head(2)
    head = screened(w)
    x = torch.randn(4, K)
    x[1] = 0.0  # every logit 0: every entry a candidate, more than MAX_CANDIDATES
    x[2, 5] = float("nan")
    x[3, 0] = float("inf")
    with torch.inference_mode():
        got = head.greedy_logits(x)
        want = x @ w.T
    assert VOCAB > MAX_CANDIDATES
    assert torch.equal(got[1], want[1])
    assert got[0].argmax() == want[0].argmax()
    for row in (2, 3):
        assert not torch.isfinite(got[row].amax())


@needs_bf16
def test_screened_head_is_used_when_asked_never_when_not_and_refused_where_it_cannot_apply(tmp_path):
    w = near_tie_head(3)
    assert screened_head(w, DenseLinear(w), lambda ids: w[ids], use=False) is None
    assert isinstance(screened_head(w, DenseLinear(w), lambda ids: w[ids], use=True), ScreenedHead)
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=False))
    with pytest.raises(ValueError, match="screen_head"):
        from_hf(untied, screen_head=True)
    with pytest.raises(ValueError, match="screen_head"):
        from_hf(untied, precision="bf16", screen_head=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    return str(path), save_tiny_llama(path, tie_word_embeddings=True)


@needs_bf16
def test_screened_greedy_equals_generate_and_leaves_sampled_rows_alone(tied):
    path, reference = tied
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 320) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    max_tokens = [rng.randint(1, 16) for _ in prompts]
    runs = {}
    for screen in (True, False):
        model = from_hf(transformers.AutoModelForCausalLM.from_pretrained(path), screen_head=screen)
        assert (model.weights.greedy_head is not None) == screen
        engine = BatchInferenceEngine(model, batch_size=3)
        # even requests greedy, odd ones sampled with a seed: one batch mixes both
        handles = [engine.submit_request(p, n, **({} if i % 2 == 0 else {"temperature": 0.8, "seed": i}))
                   for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        engine.run()
        runs[screen] = [h.tokens for h in handles]
    assert runs[True] == runs[False]
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        if i % 2 == 0:
            assert runs[True][i] == generate_alone(reference, p, n)


@needs_bf16
def test_a_tied_fp32_gguf_style_load_may_screen_and_its_bytes_are_counted(tied):
    path, _ = tied
    model = load_model(path)
    screen = model.weights.greedy_head
    with_screen = model.weights.nbytes
    model.weights.greedy_head = None
    assert with_screen - model.weights.nbytes == (0 if screen is None else screen.screen.nbytes)


@pytest.mark.parametrize("width", [64 * 5, 64 * 5 + 3])
def test_entries_at_least_are_the_plain_comparison_in_the_same_order(width):
    gen = torch.Generator().manual_seed(width)
    for _ in range(20):
        values = torch.randint(0, 6, (4, width), generator=gen).float()
        values[0, 7] = float("inf")
        threshold = torch.tensor([5.0, 4.0, 6.0, float("-inf")])
        got = entries_at_least(values, threshold)
        want = (values >= threshold[:, None]).nonzero(as_tuple=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_bf16
def test_values_the_bf16_product_flushes_to_zero_are_within_the_bound():
    """oneDNN's bf16 product treats subnormals as zero: hidden components of 2^-127 times weights
    of 2^100 give logits of ~4e-6 that the screen sees as 0 (found by a breaker helper)."""
    h = torch.full((1, 576), 2.0 ** -127)
    h[0, 0] = 2.0 ** -126
    w = torch.zeros(512, 576)
    w[0, 0] = 2.0 ** 100
    w[1, 1:] = 2.0 ** 100
    head = ScreenedHead(w, DenseLinear(w), lambda ids: w[ids])
    with torch.inference_mode():
        assert head.screen(h)[0, 1] == 0.0  # what the bf16 product sees
        want = h @ w.T
        got = head.greedy_logits(h.clone())
    assert want.argmax() == 1 and got.argmax() == 1


@needs_bf16
def test_a_finite_row_past_bf16s_range_takes_the_full_product():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(512, 64, generator=gen) * 1e-3
    w[7] = 0.0
    w[7, :2] = 1.0
    head = ScreenedHead(w, DenseLinear(w), lambda ids: w[ids])
    h = torch.randn(3, 64, generator=gen)
    h[0, 3] = 3.4e38  # fp32, but bf16's inf
    h[1, :2] = torch.tensor([3.3895313892515355e38, 1e36])  # logit 7 finite in fp32, inf once rounded to bf16
    with torch.inference_mode():
        want = h @ w.T
        got = head.greedy_logits(h.clone())
    assert torch.isfinite(want).all()
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
    assert torch.isfinite(got.amax(dim=1)).all()


@needs_bf16
def test_non_finite_weights_are_not_screened():
    w = near_tie_head(5)
    w[3, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        screened(w)
    assert screened_head(w, DenseLinear(w), lambda ids: w[ids]) is None
