"""bench/fim.py's pieces that need no model: the cut cases, the pass check, the keystroke files, the table."""

from __future__ import annotations

from bench.fim import cut_cases, keystroke_files, passes, table
from bench.common import humaneval_problems


def test_cases_are_the_solution_cut_in_three_and_reproducible():
    cases = cut_cases(12, seed=0)
    assert cases == cut_cases(12, seed=0) and [c["task_id"] for c in cases] == [f"HumanEval/{i}" for i in range(12)]
    for case, p in zip(cases, humaneval_problems(12)):
        assert case["prefix"] + case["middle"] + case["suffix"] == p["prompt"] + p["canonical_solution"]
        assert case["middle"] and case["middle"].count("\n") in (1, 2, 3)


def test_the_cut_middle_passes_and_a_wrong_one_fails():
    case = cut_cases(3, seed=0)[2]
    assert passes(case, case["middle"])
    assert not passes(case, "    raise SystemExit(3)\n" + case["middle"])


def test_keystroke_files_are_long_and_distinct():
    files = keystroke_files(3, 6)
    assert len({f["prefix"][:200] for f in files}) == 3 and all(len(f["prefix"]) > 2000 and f["typed"] for f in files)


def test_the_table_lists_both_systems():
    r = {"cases": [{"prompt_tokens": 5, "completion": "a"}], "passes": 1, "ttft_first_median_ms": 900.0,
         "ttft_keystroke_median_ms": 100.0, "ttft_ratio": 9.0}
    text = table("m", {"slotserve": r, "llamacpp": r}, 1)
    assert "slotserve" in text and "llamacpp" in text and "9.0" in text
