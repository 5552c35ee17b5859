"""The shared sampler (worker/models/sampling.py): filters, seeds, and per-row containment."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from protocol.request import GREEDY_BELOW, SamplingParams  # noqa: E402
from worker.errors import ModelError  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from worker.models.sampling import Sampler, argmax_rows, mix_seed, row_logsumexp, uniform  # noqa: E402

GREEDY = SamplingParams()
NAN, INF = float("nan"), float("inf")


def test_each_kind_of_non_finite_row_fails_alone():
    logits = torch.tensor([[1.0, NAN, 3.0], [1.0, 2.0, INF], [-INF, -INF, -INF], [0.0, -INF, 1.0], [5.0, 1.0, 0.0]])
    hot = SamplingParams(temperature=0.7, seed=1)
    for params in ([GREEDY] * 5, [hot] * 5):
        out = Sampler().pick(logits, params, [0] * 5)
        assert [isinstance(t, ModelError) for t in out] == [True, True, True, False, False]
        assert out[3] == 2 or params[0] is hot  # -inf entries are fine: never drawn
        assert out[3] != 1 and out[4] in (0, 1, 2)


def test_failed_rows_reported_by_the_model_fail():
    out = Sampler().pick(torch.zeros(3, 4), [GREEDY] * 3, [0] * 3, failed=torch.tensor([False, True, False]))
    assert isinstance(out[1], ModelError) and out[0] == out[2] == 0


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, GREEDY_BELOW / 2])
def test_tiny_temperatures_are_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.randn(4, 500) * 30
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    assert Sampler().pick(logits, params, [9] * 4) == logits.argmax(-1).tolist()


def test_extreme_values_give_valid_tokens():
    logits = torch.randn(4, 300) * 1e30  # huge but finite logits
    params = [SamplingParams(temperature=1e30, seed=1), SamplingParams(temperature=1e-4, seed=2),
              SamplingParams(temperature=1.0, top_k=10**9, seed=3), SamplingParams(temperature=5.0, top_p=1e-12)]
    out = Sampler().pick(logits, params, [0] * 4)
    assert all(isinstance(t, int) and 0 <= t < 300 for t in out)
    assert out[3] == int(logits[3].argmax())  # top_p keeps the most likely token only



@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_top_p_that_fp32_rounds_to_zero_keeps_the_most_likely_token(top_p):
    # Any top_p in (0, 1] is valid, but fp32 holds nothing below 1.4e-45: the sampler compared the mass
    # before each token with 0, dropped every token, the most likely one too, and the NaN row drew its
    # last id (SmolLM2 with top_p=1e-300 wrote 'ectable' over and over; with a grammar: GrammarMismatch).
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, -1.0, 3.0]])
    drawn = {Sampler().pick(logits, [SamplingParams(temperature=1.0, top_p=top_p, seed=s)], [0])[0] for s in range(20)}
    assert drawn == {2}


@pytest.mark.parametrize("temperature", [3.5e38, 1e300, 1.7e308])
def test_a_temperature_past_fp32s_range_keeps_masks_and_filters(temperature):
    # Past 3.4e38 the temperature was inf in fp32: a masked token's -inf / inf is NaN, and the row drew
    # its last id whatever its mask (a grammar's: GrammarMismatch; min_tokens': the same token each
    # time) and whatever top_k kept. Now the distribution is the limit's: uniform over what is allowed.
    masked = torch.tensor([[0.0, -INF, 5.0, -INF, -1.0, 3.0, -INF]])  # the last id masked too
    drawn = {Sampler().pick(masked, [SamplingParams(temperature=temperature, seed=s)], [0])[0] for s in range(60)}
    assert drawn == {0, 2, 4, 5}
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, -1.0, 3.0]])
    kept = {Sampler().pick(logits, [SamplingParams(temperature=temperature, top_k=2, seed=s)], [0])[0]
            for s in range(40)}
    assert kept == {2, 5}

def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k, seen_p = set(), set()
    for seed in range(300):
        seen_k.add(Sampler().pick(logits, [SamplingParams(temperature=1.0, top_k=2, seed=seed)], [0])[0])
        seen_p.add(Sampler().pick(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=seed)], [0])[0])
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log()[None].expand(2000, 4)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(2000)]
    counts = torch.bincount(torch.tensor(Sampler().pick(logits, params, [0] * 2000)), minlength=4).float() / 2000
    assert torch.allclose(counts, probs, atol=0.04)  # ~4 standard deviations at n = 2000


def test_seeded_draws_depend_on_seed_and_position_only():
    assert len({mix_seed(s, p) for s in range(20) for p in range(50)}) == 1000
    assert all(0.0 <= uniform(s, p) < 1.0 for s in (0, 1, 2**63 - 1, 2**64 - 1) for p in (0, 10**6))
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(temperature=1.0, seed=9)] * 3
    a = Sampler().pick(logits, params, [5, 6, 5])
    b = Sampler().pick(logits[:1], params[:1], [5])
    assert a[0] == a[2] == b[0] and a[0] != a[1]


SPECIAL = [0.0, -0.0, 1.0, 7.5, -INF, INF, NAN]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(2, 6), seed=st.integers(0, 2**31),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=12),
       levels=st.integers(1, 4))
def test_block_argmax_is_argmax_with_ties_infinities_and_nans(rows, blocks, seed, specials, levels):
    """Few distinct values (ties everywhere), infinities and NaNs at random places."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, blocks * 64), generator=gen).float()
    for at, value in specials:
        logits.view(-1)[at % logits.numel()] = value
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_block_argmax_falls_back_for_vocabularies_not_made_of_whole_blocks():
    for width in (1, 63, 64, 65, 100):
        logits = torch.randn(3, width)
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("width", [49152, 151936, 1000])
def test_a_rows_logsumexp_does_not_depend_on_the_rows_beside_it_nor_the_thread_count(width):
    """A row's logprobs are the same decoding alone or beside others, at 1 or 2 threads (the runner's
    thread tuner changes the count between steps): ``torch.logsumexp`` split its sum by both and
    moved a row by an ulp in ~5 % of such comparisons."""
    gen = torch.Generator().manual_seed(width)
    threads = torch.get_num_threads()
    try:
        for _ in range(12 if width > 100_000 else 40):
            x = torch.randn(16, width, generator=gen) * 4
            torch.set_num_threads(2)
            alone = torch.cat([row_logsumexp(x[i:i + 1]) for i in range(16)])
            for rows in (2, 3, 8, 16):
                assert torch.equal(row_logsumexp(x[:rows]), alone[:rows]), rows
            torch.set_num_threads(1)
            assert torch.equal(torch.cat([row_logsumexp(x[i:i + 1]) for i in range(16)]), alone)
            assert torch.allclose(alone, torch.logsumexp(x, dim=-1, keepdim=True), rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_logsumexp_of_non_finite_rows_is_torchs():
    """-inf for a row of -inf, inf with an inf, NaN with a NaN, as ``torch.logsumexp``."""
    x = torch.tensor([[-INF] * 5, [1.0, INF, 0, 0, 0], [NAN, 0, 0, 0, 0], [-INF, 2.0, -INF, 0, 1]])
    got = row_logsumexp(x)
    assert got[:3].flatten().tolist()[:2] == [-INF, INF] and got[2].isnan().all()
    torch.testing.assert_close(got, torch.logsumexp(x, -1, keepdim=True), equal_nan=True, rtol=0, atol=1e-6)
