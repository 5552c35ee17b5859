"""Which draft tokens a step keeps (worker.models.llama.draft_policy): those expected to raise its
tokens per second, from the fitted step cost and the measured acceptance per match length and depth."""

from __future__ import annotations

import pytest

from worker.models.llama.draft_policy import PRIOR_FIRST, DraftCosts


def costs(a: float, b: float) -> DraftCosts:
    c = DraftCosts()
    c.set_cost(a, b)
    return c


def throughput(c: DraftCosts, cands: dict, rows: int, kept: dict) -> float:
    """Expected tokens a second of a step keeping ``kept`` (the policy's own model)."""
    a, b = c.cost
    gain = sum(c.accept_rate(cands[i][0], t) for i, k in kept.items() for t in range(1, k + 1))
    return (rows + gain) / (a + b * (rows + sum(kept.values())))


CANDS = {0: (3, [5, 6, 7]), 3: (2, [8, 9, 10]), 5: (3, [1, 2]), 6: (2, [4])}


def test_free_drafts_are_all_kept_and_drafts_that_cost_a_whole_row_never():
    assert costs(0.01, 0.0).choose(CANDS, 8) == {0: 3, 3: 3, 5: 2, 6: 1}
    # a step that is all rows (compute-bound, no fixed part): a draft pays only if surely accepted
    assert costs(0.0, 0.001).choose(CANDS, 8) == {}
    assert costs(0.01, 0.001).choose({}, 8) == {}


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("a,b", [(0.008, 0.0013), (0.035, 0.009), (0.01, 0.0001), (0.001, 0.01)])
def test_the_choice_is_the_best_of_every_prefix_of_its_offers(rows, a, b):
    """Kept depths are contiguous per row, and no single token added or dropped raises the
    expected throughput (the greedy order is the offers' acceptance, falling)."""
    c = costs(a, b)
    kept = c.choose(CANDS, rows)
    assert all(1 <= k <= len(CANDS[i][1]) for i, k in kept.items())
    best = throughput(c, CANDS, rows, kept)
    for i, (n, tokens) in CANDS.items():
        k = kept.get(i, 0)
        if k < len(tokens):
            assert throughput(c, CANDS, rows, {**kept, i: k + 1}) <= best + 1e-12
        if k:
            fewer = {**kept, i: k - 1} if k > 1 else {j: v for j, v in kept.items() if j != i}
            assert throughput(c, CANDS, rows, fewer) <= best + 1e-12


def test_fewer_rows_keep_at_least_as_many_drafts():
    c = costs(0.008, 0.0013)
    by_rows = {r: sum(c.choose(CANDS, r).values()) for r in (1, 2, 4, 8, 16)}
    assert by_rows[1] >= by_rows[2] >= by_rows[4] >= by_rows[8] >= by_rows[16]
    assert by_rows[16] < by_rows[1]


def test_measured_acceptance_moves_the_choice():
    c = costs(0.008, 0.0013)
    before = c.choose({0: (2, [1, 2, 3])}, 8)
    for _ in range(200):  # 2-token matches always fully accepted here
        c.record_drafts(2, 3, 3)
    assert c.accept_rate(2, 3) > 0.95
    assert c.choose({0: (2, [1, 2, 3])}, 8) == {0: 3} != before
    for _ in range(200):  # 3-token matches never
        c.record_drafts(3, 3, 0)
    assert c.accept_rate(3, 1) < 0.05
    assert c.choose({0: (3, [1, 2, 3])}, 8) == {}


def test_acceptance_counts_a_depth_only_when_every_draft_before_it_was_kept():
    c = DraftCosts()
    c.record_drafts(3, 3, 1)  # the first kept, the second refused (the third never reached)
    prior = PRIOR_FIRST[3]
    assert c.accept_rate(3, 1) > prior and c.accept_rate(3, 2) < prior * 0.85 and c.accept_rate(3, 3) < prior * 0.85 ** 2
    assert DraftCosts().accept_rate(5, 1) == PRIOR_FIRST[3]  # longer matches: the 3-token prior
    assert c.accept_rate(0, 1) == PRIOR_FIRST[2]  # a match of unknown length


def test_the_step_cost_is_fitted_from_decode_steps_at_several_row_counts():
    c = DraftCosts()
    assert c.cost is None
    c.record_step(8, 0.008 + 0.0013 * 8)
    assert c.cost is None  # one row count: no slope yet
    for rows in (8, 11, 14, 17, 20):
        for _ in range(3):
            c.record_step(rows, 0.008 + 0.0013 * rows)
    a, b = c.cost
    assert a == pytest.approx(0.008) and b == pytest.approx(0.0013)
    for _ in range(100):  # the cache grew: every step got 2 ms dearer; the moving means follow
        for rows in (8, 14, 20):
            c.record_step(rows, 0.010 + 0.0013 * rows)
    a, b = c.cost
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(0.0013, rel=0.05)


def test_a_slope_that_comes_out_negative_leaves_the_prior():
    c = DraftCosts()
    c.record_step(8, 0.02)
    c.record_step(16, 0.019)
    assert c.cost is None  # (not "every draft free": the prior's a = 4 b decides)
    assert c.choose({0: (2, [1, 2, 3])}, 8) == DraftCosts().choose({0: (2, [1, 2, 3])}, 8)


@pytest.mark.parametrize("call", [
    lambda c: c.record_step(0, 0.01), lambda c: c.record_step(4, -1.0), lambda c: c.record_step(4, float("nan")),
    lambda c: c.record_drafts(3, 2, 3), lambda c: c.record_drafts(-1, 2, 1), lambda c: c.set_cost(-1.0, 0.0),
    lambda c: c.set_cost(0.0, float("inf")),
])
def test_bad_measurements_are_value_errors(call):
    with pytest.raises(ValueError):
        call(DraftCosts())


def test_a_row_count_no_longer_seen_leaves_the_fit():
    """A warm-up's first decode steps at one row (3.2 and 3.6 s on a loaded machine, 0.1 s after),
    then 2,000 steps at 8-32 rows costing 0.09 + 0.01 * rows s: the fit is theirs and keeps what
    their cost keeps (failed before: the one-row mean stayed, (0.19, 0.0054), every draft kept)."""
    c = DraftCosts()
    for rows, seconds in [(1, 3.18), (1, 3.62), (1, 0.107), (8, 0.195), (8, 0.216), (8, 0.225), (4, 0.139)]:
        c.record_step(rows, seconds)
    assert c.cost is None  # (the one-row steps make the slope come out negative: the prior stands)
    for step in range(2000):
        rows = 8 + step * 7 % 25
        c.record_step(rows, 0.09 + 0.01 * rows)
    a, b = c.cost
    assert a == pytest.approx(0.09, rel=0.01) and b == pytest.approx(0.01, rel=0.01)
    cands = {i: (2, [1, 2, 3]) for i in range(8)}
    assert c.choose(cands, 8) == costs(0.09, 0.01).choose(cands, 8) != {i: 3 for i in range(8)}


def test_a_row_count_seen_again_after_it_left_the_fit_starts_afresh():
    c = DraftCosts()
    c.record_step(1, 5.0)
    for _ in range(200):
        c.record_step(8, 0.02)
    c.record_step(1, 0.01)  # (the 5 s of long ago is not in its mean: the line through (1, 0.01) and (8, 0.02))
    a, b = c.cost
    assert b == pytest.approx(0.01 / 7) and a == pytest.approx(0.01 - 0.01 / 7)


def test_a_deeper_draft_measured_likelier_than_a_shallower_one_is_still_offered_in_order():
    """Depth 2's own counts above depth 1's (few drafts that deep): the row's depths are offered
    falling, so free drafts keep all three (before: depth 2 came first, was skipped for its
    missing depth 1, and never offered again)."""
    c = costs(0.01, 0.0)
    for _ in range(30):
        c.record_drafts(2, 1, 0)  # depth 1 tried alone, refused: its share falls
    for _ in range(30):
        c.record_drafts(2, 3, 3)  # three drafts all taken: depths 2 and 3 only ever seen taken
    assert c.accept_rate(2, 2) > c.accept_rate(2, 1)
    assert c.choose({0: (2, [1, 2, 3])}, 8) == {0: 3}
