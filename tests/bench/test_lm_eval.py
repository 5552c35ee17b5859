"""bench/lmeval.py on a few questions: lm-evaluation-harness's own API models
(``local-completions`` for loglikelihood, ``local-chat-completions`` for
generation) against slotserve serving the tiny text model, and lm-eval's ``hf``
model on the same folder: every request's loglikelihood within 1e-3 (fp32),
the same choice for every question, the same reply to every chat question."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("lm_eval")

from bench import lmeval  # noqa: E402

QUESTIONS = 3


@pytest.fixture(scope="module")
def compared(tiny_text_dir):
    """bench/lmeval.run on the first QUESTIONS questions of the task, the tiny
    text model served with 2 slots (2 requests in flight)."""
    return lmeval.run(tiny_text_dir, limit=QUESTIONS, slots=2)


def test_every_loglikelihood_agrees_with_lm_evals_hf_model(compared):
    mc = compared["mc"]
    assert mc["questions"] == QUESTIONS and mc["requests"] == 4 * QUESTIONS  # four choices a question
    assert mc["max_abs_diff"] <= lmeval.LOGLIKELIHOOD_TOLERANCE, mc["worst_request"]
    worst = mc["worst_request"]
    assert worst["hf"] < 0  # a real score: some tokens of a choice, each with probability < 1


def test_the_same_choice_for_every_question_and_the_same_accuracy(compared):
    mc = compared["mc"]
    assert mc["differing_predictions"] == []
    assert mc["acc"]["slotserve"] == mc["acc"]["hf"] and mc["acc_norm"]["slotserve"] == mc["acc_norm"]["hf"]


def test_the_same_chat_reply_to_every_question(compared):
    gen = compared["gen"]
    assert gen["questions"] == QUESTIONS
    assert gen["differing_replies"] == []
    assert any(e["reply"] for e in gen["examples"])  # not only empty replies compared
    assert gen["acc"]["slotserve"] == gen["acc"]["hf"]


def test_loglikelihoods_reads_each_choice_of_each_question():
    samples = [{"doc_id": 3, "filtered_resps": [(-1.5, False), (-0.25, True)]}]
    assert lmeval.loglikelihoods(samples) == {(3, 0): -1.5, (3, 1): -0.25}


def test_compare_mc_finds_the_worst_request_and_a_changed_choice():
    def run(lls, acc):
        return {"results": {"acc,none": acc, "acc_norm,none": acc},
                "samples": [{"doc_id": 0, "filtered_resps": [(x, False) for x in lls], "acc": acc, "acc_norm": acc}]}

    out = lmeval.compare_mc(run([-1.0, -2.0], 1.0), run([-1.0005, -0.5], 0.0))
    assert out["max_abs_diff"] == pytest.approx(1.5)
    assert out["worst_request"]["choice"] == 1 and out["differing_predictions"] == [0]
    with pytest.raises(ValueError, match="different requests"):
        lmeval.compare_mc(run([-1.0], 1.0), run([-1.0, -2.0], 1.0))
