"""Speculative decoding in slotserve's Llama runner: drafts from prompt lookup, verified in the step.

The tokens must be exactly the greedy tokens of transformers' ``generate``
(the tiny random Llama of tests/models/conftest.py, whose logits are well
separated), whatever is drafted and accepted; sampled requests get no
drafts; drafts never pass the context.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.slot_models import CountingSteps, generate_alone, random_prompts, repetitive_prompts  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import ModelOptions, load_model  # noqa: E402
from worker.models.llama import LlamaRunner  # noqa: E402
from worker.models.llama.draft_policy import DraftCosts  # noqa: E402
from worker.models.llama.lookup import PromptLookup  # noqa: E402

pytestmark = pytest.mark.hf


def drafting_prompt(ref, context):
    """A repetitive prompt and ``n`` (to reach ``context``) such that greedy decoding repeats an
    earlier bigram (a MIN_NGRAM match) before the end: drafts are then proposed for it."""
    for seed in range(100):
        prompt = repetitive_prompts(1, seed)[0][:context // 2]
        n = context - len(prompt)
        seq = prompt + generate_alone(ref, prompt, n)
        seen = {tuple(seq[e - 2:e]) for e in range(2, len(prompt) + 1)}
        for e in range(len(prompt) + 1, len(seq) - 1):  # decode steps (the prompt's is a prefill)
            if tuple(seq[e - 2:e]) in seen:
                return prompt, n
            seen.add(tuple(seq[e - 2:e]))
    raise AssertionError("no prompt of the tiny model repeats a bigram")


@pytest.mark.parametrize("k,max_prefill_tokens", [(1, 512), (3, 16), (6, 512)])
def test_speculative_greedy_equals_generate(model_dir, reference, k, max_prefill_tokens):  # noqa: F811
    """Drafted rows, undrafted rows, padding rows and prompt chunks in the same iterations."""
    runner = load_model(model_dir, max_prefill_tokens=max_prefill_tokens)
    runner.speculative_tokens = k
    model = CountingSteps(runner)
    prompts = repetitive_prompts(6, seed=k) + random_prompts(3, seed=k)
    max_tokens = [random.Random(i).randint(5, 40) for i in range(len(prompts))]
    engine = BatchInferenceEngine(model, batch_size=4)
    handles = [engine.submit_request(p, n) for p, n in zip(prompts, max_tokens)]
    engine.run()
    assert model.several > 0  # drafts were accepted
    for p, n, h in zip(prompts, max_tokens, handles):
        assert h.finish_reason == FinishReason.LENGTH
        assert h.tokens == generate_alone(reference, p, n)


def test_speculative_greedy_at_gguf_gives_the_tokens_of_decoding_without_drafts(quantized_gguf):
    """Precision gguf (the tiny Llama GGUF of every block format): drafts verified in the step give
    the tokens one token a step gives."""
    prompts = repetitive_prompts(6, seed=3) + random_prompts(3, seed=3)
    max_tokens = [random.Random(i).randint(5, 40) for i in range(len(prompts))]
    tokens, several = [], 0
    for k in (0, 3):
        model = CountingSteps(load_model(quantized_gguf, precision="gguf", speculative_tokens=k,
                                         max_prefill_tokens=16))
        engine = BatchInferenceEngine(model, batch_size=4)
        handles = [engine.submit_request(p, n) for p, n in zip(prompts, max_tokens)]
        engine.run()
        tokens.append([h.tokens for h in handles])
        several = model.several
    assert several > 0  # drafts were accepted
    assert tokens[1] == tokens[0]


def test_sampled_rows_get_no_drafts_and_drafts_stop_at_the_context(model_dir, reference):  # noqa: F811
    runner = load_model(model_dir, max_cache_len=48)
    runner.speculative_tokens = 8
    model = CountingSteps(runner)
    engine = BatchInferenceEngine(model, batch_size=3)
    prompt, n = drafting_prompt(reference, 48)  # n: up to the context
    greedy = engine.submit_request(prompt, n)
    sampled = engine.submit_request(prompt, n, temperature=1.0, seed=3)
    engine.run()
    assert greedy.finish_reason == sampled.finish_reason == FinishReason.LENGTH
    assert greedy.tokens == generate_alone(reference, prompt, n)
    assert len(sampled.tokens) == n
    assert all(type(t) is int and more is None for s, t, more in model.entries if not s.greedy)
    assert model.drafted > 0


def test_speculation_with_a_growing_cache(model_dir, reference):  # noqa: F811
    """The growth mode makes room for the draft positions too."""
    runner = LlamaRunner(load_model(model_dir).weights, capacity_step=8, speculative_tokens=5)
    prompts = repetitive_prompts(3, seed=11)
    engine = BatchInferenceEngine(runner, batch_size=3)
    handles = [engine.submit_request(p, 30) for p in prompts]
    engine.run()
    for p, h in zip(prompts, handles):
        assert h.tokens == generate_alone(reference, p, 30)


def test_load_model_and_options_take_speculative_tokens(model_dir):  # noqa: F811
    assert load_model(model_dir, speculative_tokens=4).speculative_tokens == 4
    with pytest.raises(ValueError, match="speculative_tokens"):
        ModelOptions(speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative"):
        ModelOptions(runner="hf", speculative_tokens=2)


def test_prompt_lookup_takes_the_latest_occurrence_of_the_longest_tail():
    look = PromptLookup(2, max_ngram=3, min_ngram=1)
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # tail (2, 3) occurred last before position 7: "7 5 2 3" follows
    assert look.propose(0, seq, 4) == [7, 5, 2, 3]
    seq += [7]  # tail (2, 3, 7): the occurrence at 5..7 is followed by 5
    assert look.propose(0, seq, 2) == [5, 2]
    assert look.propose(0, seq, 2) == PromptLookup(1, 3, 1).propose(0, seq, 2)  # incremental == fresh
    assert look.propose(1, [4, 5, 6], 3) == []  # no earlier occurrence of any tail
    look.reset(0)
    assert look.propose(0, [8, 8], 3) == [8, 8, 8]  # (8) at 0, one token after it: continued with period 1
    assert PromptLookup(1).propose(0, [8, 8], 3) == []  # by default a match needs 2 tokens (MIN_NGRAM)


def test_prompt_lookup_never_returns_more_than_asked():
    look = PromptLookup(1)
    seq = [1, 2] * 20
    for k in range(0, 6):
        assert len(look.propose(0, seq, k)) == k


def test_a_non_finite_pick_after_accepted_drafts_keeps_them(model_dir, reference, monkeypatch):  # noqa: F811
    """Perfect drafts (the greedy continuation) through a token whose embedding is NaN:
    the tokens accepted before the failing pick are returned and the request ends with
    the error one step later, exactly as one token per step (same tokens, same error)."""
    prompt = [3, 17, 99, 4, 250]
    cont = generate_alone(reference, prompt, 40)
    full = prompt + cont
    at = next(i for i in range(8, 40) if cont[i] not in full[:len(prompt) + i])  # first seen at cont[at]
    monkeypatch.setattr(PromptLookup, "propose", lambda self, row, tokens, k: (
        full[len(tokens):len(tokens) + k] if full[:len(tokens)] == list(tokens) else []))
    results = {}
    for k in (0, 4):
        model = load_model(model_dir, speculative_tokens=k)
        model.weights.embed.table[cont[at]] = float("nan")
        counting = CountingSteps(model)
        engine = BatchInferenceEngine(counting, batch_size=2, stop_token=None)
        handle = engine.submit_request(prompt, 30)
        engine.run()
        assert handle.finish_reason == FinishReason.ERROR
        results[k] = (handle.tokens, counting.several)
    assert results[4][0] == results[0][0] == cont[:at + 1]  # through the poisoned token, then the error
    assert results[4][1] > 0  # drafts were accepted on the way


class _FixedCost(DraftCosts):
    """The draft policy with a step cost given, not measured (the choice then depends on no clock)."""

    def record_step(self, rows, seconds):
        pass


@pytest.mark.parametrize("fixed,per_row", [(1.0, 0.0), (0.0, 1.0)])
def test_the_draft_policy_keeps_what_pays_and_the_tokens_are_the_same(model_dir, reference, fixed, per_row):  # noqa: F811
    """Drafts that cost nothing are all verified; drafts that cost a whole row each (a step with no
    fixed part) are never made. Either way the tokens are greedy decoding's, and every verified
    draft is counted by its match length."""
    runner = load_model(model_dir, max_prefill_tokens=512)
    runner.speculative_tokens = 3
    model = CountingSteps(runner)
    runner.draft_costs = costs = _FixedCost()  # (after CountingSteps, which sets every draft found)
    costs.set_cost(fixed, per_row)
    prompts = repetitive_prompts(4, seed=5)
    engine = BatchInferenceEngine(model, batch_size=4)
    handles = [engine.submit_request(p, 24) for p in prompts]
    engine.run()
    for p, h in zip(prompts, handles):
        assert h.tokens == generate_alone(reference, p, 24)
    tried = sum(v for (n, t), v in costs._tried.items() if t == 1)
    if per_row:
        assert model.drafted == 0 and tried == 0
    else:
        assert model.drafted > 0 and tried > 0 and all(n >= 2 for n, _ in costs._tried)


class _Recording(DraftCosts):
    """The draft policy, its step times recorded as they are told (rows only: the clock's are not asserted)."""

    def __init__(self):
        super().__init__()
        self.told = []

    def record_step(self, rows, seconds):
        self.told.append(rows)
        super().record_step(rows, seconds)


def test_the_draft_policy_is_told_the_decode_only_steps_and_their_query_rows(model_dir):
    """Each step without prompt tokens is told once, with its decode rows and draft tokens; a step
    with a prompt chunk (its cost is the prompt's) never: the policy's cost model is of decode steps."""
    runner = load_model(model_dir, max_prefill_tokens=16)
    runner.speculative_tokens = 3
    runner.draft_costs = costs = _Recording()
    costs.set_cost(1.0, 0.0)  # (drafts free: every one found is kept, and verified)
    steps, step = [], runner.step

    def watching(plan):
        told = len(costs.told)
        out = step(plan)
        drafted = sum(len(d.tokens) for d in runner._drafts.values())
        steps.append((runner._shape[1], len(plan.batch) + drafted, costs.told[told:], drafted))
        return out

    runner.step = watching
    prompts = repetitive_prompts(6, seed=7)
    engine = BatchInferenceEngine(runner, batch_size=4)
    for p in prompts:
        engine.submit_request(p, 24)
    engine.run()
    assert any(prompt for prompt, *_ in steps) and any(d for *_, d in steps)  # (both kinds of step ran)
    for prompt_tokens, rows, told, _ in steps:
        assert told == ([] if prompt_tokens else [rows])
