"""The sampler's logits processors (worker/models/processors.py) and min_p, each against an
independent reference: transformers' RepetitionPenaltyLogitsProcessor and generate, OpenAI's
presence/frequency formula written out, vLLM's min_p definition written out; in mixed batches,
with speculative decoding on, after a migration, and through the screened LM head; min_tokens'
stop-token mask against transformers' min_new_tokens."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from protocol.request import GREEDY, RequestParams  # noqa: E402
from tests.support.reference import greedy_generate  # noqa: E402
from tests.support.slot_models import (  # noqa: E402
    TINY_LLAMA_VOCAB, CountingSteps, generate_alone, random_prompts, repetitive_prompts,
)
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import SlotInput, StepOutput  # noqa: E402
from worker.models.processors import LogitsProcessors  # noqa: E402
from worker.models.sampling import Sampler, uniform  # noqa: E402

pytestmark = pytest.mark.hf

V = 96


def sampling(**options):
    return RequestParams([1], 2, **options).sampling


def histories(seed: int, rows: int) -> list[SlotInput]:
    rng = random.Random(seed)
    out = []
    for slot in range(rows):
        prompt_len = rng.randint(1, 12)
        tokens = [rng.randrange(8) for _ in range(prompt_len + rng.randint(0, 12))]  # few ids: repeats
        out.append(SlotInput(slot=slot, tokens=tokens, prompt_len=prompt_len))
    return out


def processed(params, inputs, logits):
    stage = LogitsProcessors()
    stage.bind(len(inputs))
    scores = logits.clone()
    stage.apply(scores, params, inputs)
    return scores


def test_repetition_penalty_is_transformers_processor_over_prompt_and_output():
    inputs = histories(0, 5)
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 4
    for penalty in (1.3, 0.7):
        got = processed([sampling(repetition_penalty=penalty)] * 5, inputs, logits)
        for r, si in enumerate(inputs):
            want = transformers.RepetitionPenaltyLogitsProcessor(penalty)(
                torch.tensor([si.tokens]), logits[r:r + 1].clone())
            assert torch.equal(got[r], want[0])


def test_an_extreme_repetition_penalty_stays_finite_and_is_not_a_model_failure():
    # Any penalty > 0 is a valid request, but fp32 rounds 1e-50 to 0 and 1e300 to inf (x / 0 = inf,
    # 0 * inf = NaN): such rows were failed as "the model produced non-finite values".
    si = SlotInput(slot=0, tokens=[1, 2, 3, 4], prompt_len=2)
    logits = torch.tensor([[0.0, 5.0, -3.0, 50.0, 0.0, 2.0, float("-inf"), -1.0]])
    for penalty in (1e-300, 1e-50, 1e-38, 1e300):
        got = processed([sampling(repetition_penalty=penalty)], [si], logits)
        assert torch.isfinite(got[0, [0, 1, 2, 3, 4, 5, 7]]).all() and got[0, 6] == float("-inf")
        assert torch.equal(got[0, [0, 5, 6, 7]], logits[0, [0, 5, 6, 7]])  # unseen tokens untouched
        # small: seen positive logits soar (and tie at fp32's bound), seen negative ones go to -0
        assert (got[0, 1] >= got[0, 5] and got[0, 3] >= got[0, 5]) if penalty < 1 else got[0, 5] > got[0, 1] >= 0
        picked = Sampler().pick(logits, [sampling(repetition_penalty=penalty, temperature=0.7, seed=1)], [4],
                                inputs=[si])
        assert type(picked[0]) is int


def test_presence_and_frequency_penalties_are_openais_formula_over_output_tokens():
    inputs = histories(1, 6)
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [sampling(presence_penalty=0.6, frequency_penalty=-0.4), sampling(frequency_penalty=2.0),
              sampling(presence_penalty=-2.0)] * 2
    got = processed(params, inputs, logits)
    for r, (p, si) in enumerate(zip(params, inputs)):
        want = logits[r].tolist()
        output = si.tokens[si.prompt_len:]
        for j in range(V):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            c = output.count(j)
            want[j] = want[j] - c * p.frequency_penalty - float(c > 0) * p.presence_penalty
        assert torch.allclose(got[r], torch.tensor(want), atol=1e-5)


def test_logit_bias_is_added_and_rows_without_processors_are_untouched():
    inputs = histories(2, 4)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = [sampling(logit_bias={3: 100, 90: -2.5}), sampling(), sampling(repetition_penalty=1.5,
                                                                            logit_bias={0: 1}), sampling()]
    got = processed(params, inputs, logits)
    want = logits.clone()
    want[0, 3] += 100
    want[0, 90] -= 2.5
    want[2, 0] += 1
    want[2:3] = transformers.RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([inputs[2].tokens]), want[2:3])
    assert torch.equal(got, want)


def test_counts_are_kept_incrementally_and_cleared_when_the_slot_is_released():
    stage = LogitsProcessors()
    stage.bind(2)
    si = SlotInput(slot=1, tokens=[5, 5, 6], prompt_len=2)
    p = [sampling(frequency_penalty=1.0)]
    for step in range(4):
        stage.apply(torch.zeros(1, V), p, [si])
        si.tokens.append(7)
    counts = stage.token_counts
    assert counts.counts[1, 7].item() == 3 and counts.counts[1, 6].item() == 1 and counts.counts[1, 5].item() == 0
    assert counts.seen[1, 5] and not counts.seen[0].any()
    stage.release(1)
    assert not counts.seen.any() and not counts.counts.any()
    other = SlotInput(slot=1, tokens=[9, 9], prompt_len=1)  # a new occupant: only its own tokens count
    stage.apply(torch.zeros(1, V), p, [other])
    assert counts.counts[1].tolist() == [1.0 if j == 9 else 0.0 for j in range(V)]


def test_min_p_is_vllms_definition_with_the_same_draw():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=gen) * 3
    temperature, min_p = 0.9, 0.2
    params = [sampling(temperature=temperature, min_p=min_p, seed=11)] * 6
    positions = list(range(40, 46))
    got = Sampler().pick(logits, params, positions)
    for r in range(6):
        # vLLM's _apply_min_p: probs = softmax(logits / T); drop probs < min_p * max prob
        scaled = (logits[r] - logits[r].max()) / temperature
        probs = torch.softmax(scaled, dim=-1)
        kept = probs >= min_p * probs.max()
        cdf = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1).double().cumsum(dim=-1)
        want = int(torch.searchsorted(cdf, uniform(11, positions[r]) * cdf[-1:], right=True).clamp(max=V - 1))
        assert got[r] == want and kept[want]
    # and over many draws, only kept tokens come out
    row = logits[:1].expand(200, V)
    drawn = Sampler().pick(row, [params[0]] * 200, list(range(200)))
    scaled = (logits[0] - logits[0].max()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    assert set(drawn) <= set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def test_a_biased_greedy_row_picks_the_biased_argmax_and_leaves_the_raw_logits_alone():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    raw = logits.clone()
    target = int(logits[1].argmin())
    got = Sampler().pick(logits, [sampling(), sampling(logit_bias={target: 100}), sampling()], [5, 5, 5])
    assert got == [int(logits[0].argmax()), target, int(logits[2].argmax())]
    assert torch.equal(logits, raw)


# --------------------------------------------------------------------------- through the runner


def run(model, requests, batch_size=4):
    engine = BatchInferenceEngine(model, batch_size=batch_size)
    handles = [engine.submit_request(p, n, **o) for p, n, o in requests]
    engine.run()
    return [h.tokens for h in handles]


def hf_greedy(ref, prompt, n, **processors):
    """transformers' greedy ``generate`` with its own logits processors (``repetition_penalty``,
    ``sequence_bias``), as :func:`generate_alone` (no EOS)."""
    return greedy_generate(ref, prompt, n, eos_token_id=None, pad_token_id=0, **processors)


def openai_penalised_greedy(ref, prompt, n, presence, frequency, resume=()):
    """Greedy decoding with OpenAI's formula applied by hand to transformers' logits, one token at a time."""
    seq, out = list(prompt) + list(resume), list(resume)
    with torch.inference_mode():
        for _ in range(n - len(resume)):
            x = ref(torch.tensor([seq])).logits[0, -1].float().clone()
            for j in set(out):
                c = out.count(j)
                x[j] = x[j] - frequency * c - presence * float(c > 0)
            seq.append(int(x.argmax()))
            out.append(seq[-1])
    return out


def test_mixed_batch_penalties_equal_transformers_and_plain_rows_are_unchanged(model_dir, reference):
    prompts = repetitive_prompts(6, seed=5)  # their greedy continuations repeat: the penalties act
    rep = {"repetition_penalty": 4.0}
    pf = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
    banned = generate_alone(reference, prompts[4], 1)[0]  # its first greedy token
    bias = {"logit_bias": {7: 4.0, banned: -100.0}}
    options = [{}, rep, {}, pf, bias, {"temperature": 0.8, "seed": 3, "min_p": 0.1, "repetition_penalty": 1.2}]
    n = 14
    mixed = run(load_model(model_dir), [(p, n, o) for p, o in zip(prompts, options)])
    alone = run(load_model(model_dir), [(p, n, {}) for p, o in zip(prompts, options) if not o])
    assert [mixed[0], mixed[2]] == alone == [generate_alone(reference, prompts[i], n) for i in (0, 2)]
    assert mixed[1] == hf_greedy(reference, prompts[1], n, repetition_penalty=4.0)
    assert mixed[3] == openai_penalised_greedy(reference, prompts[3], n, 2.0, 2.0)
    assert mixed[4] == hf_greedy(reference, prompts[4], n, sequence_bias={(7,): 4.0, (banned,): -100.0})
    assert banned not in mixed[4]
    for i in (1, 3, 4):  # each processor changed something
        assert mixed[i] != generate_alone(reference, prompts[i], n)
    # the sampled row with processors is batch invariant (seeded) and reproducible
    assert run(load_model(model_dir), [(prompts[5], n, options[5])]) == [mixed[5]]


def test_speculative_decoding_drafts_plain_rows_only_and_penalised_rows_keep_their_tokens(model_dir, reference):
    prompts = repetitive_prompts(6, seed=2)
    options = [{}, {"repetition_penalty": 1.5}, {"frequency_penalty": 0.8}, {},
               {"logit_bias": {5: 3.0}}, {"presence_penalty": 1.0, "repetition_penalty": 1.1}]
    requests = [(p, 24, o) for p, o in zip(prompts, options)]
    plain = run(load_model(model_dir), requests)
    runner = load_model(model_dir)
    runner.speculative_tokens = 3
    counting = CountingSteps(runner)
    drafted_params = []
    step = runner.step

    def spy(plan):
        out = step(plan)
        drafted_params.extend(plan.batch[i].sampling for i in runner._drafts)
        return out

    runner.step = spy
    assert run(counting, requests) == plain
    assert counting.several > 0 and drafted_params and all(p.is_plain_greedy for p in drafted_params)
    assert plain[1] == hf_greedy(reference, prompts[1], 24, repetition_penalty=1.5)


def test_a_resumed_request_continues_as_uninterrupted(model_dir):
    prompt = random_prompts(1, seed=8, max_len=16)[0]
    for options in ({"repetition_penalty": 1.6, "frequency_penalty": 0.7, "presence_penalty": 0.5},
                    {"temperature": 0.9, "seed": 5, "frequency_penalty": 1.5, "min_p": 0.05}):
        whole = run(load_model(model_dir), [(prompt, 16, options)])[0]
        engine = BatchInferenceEngine(load_model(model_dir), batch_size=2)
        other = engine.submit_request(random_prompts(1, seed=9)[0], 10, presence_penalty=1.0)
        resumed = engine.submit_request(prompt, 16, resume_tokens=whole[:6], **options)
        engine.run()
        assert resumed.tokens == whole, options
        assert other.finish_reason is not None


def test_the_screened_head_leaves_biased_and_penalised_rows_to_the_full_head(tmp_path):
    from tests.support.slot_models import save_tiny_llama
    from worker.models.llama import from_hf
    from worker.models.llama.screen import bf16_product_available

    if not bf16_product_available():
        pytest.skip("oneDNN has no bf16 product on this CPU")
    reference = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    model = from_hf(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), screen_head=True)
    assert model.weights.greedy_head is not None
    prompt = random_prompts(1, seed=10, max_len=20)[0]
    with torch.inference_mode():
        raw = reference(torch.tensor([prompt])).logits[0, -1]
    target = int(raw.argsort()[TINY_LLAMA_VOCAB // 2])  # a middling token, far from the argmax
    bias = {target: 100.0}
    got = run(model, [(prompt, 6, {"logit_bias": bias}), (prompt, 6, {}), (prompt, 6, {"repetition_penalty": 2.0})])
    assert got[0][0] == target != int(raw.argmax())
    assert got[0] == hf_greedy(reference, prompt, 6, sequence_bias={(target,): 100.0})
    assert got[1] == generate_alone(reference, prompt, 6)
    assert got[2] == hf_greedy(reference, prompt, 6, repetition_penalty=2.0)


# ---- min_tokens: the request's stop tokens are masked (-inf) before min_tokens output tokens (vLLM's
# MinTokensLogitsProcessor); transformers' MinNewTokensLengthLogitsProcessor (generate's min_new_tokens)
# is the reference. A stop token the bias pushes to the top would otherwise come first every step.

def min_tokens_greedy(ref, prompt, n, stop, minimum, bias=None):
    """transformers' greedy ``generate`` with ``stop`` as its eos and ``min_new_tokens``."""
    extra = {} if bias is None else {"sequence_bias": {(t,): b for t, b in bias.items()}}
    return greedy_generate(ref, prompt, n, eos_token_id=stop, pad_token_id=0, min_new_tokens=minimum, **extra)


@pytest.mark.parametrize("runner", ["llama", "transformers"])
def test_min_tokens_masks_the_stop_token_as_transformers_min_new_tokens(model_dir, reference, runner):
    from worker.models.hf import load_hf_model

    load = load_model if runner == "llama" else load_hf_model
    prompts = random_prompts(3, seed=11, max_len=16)
    for prompt in prompts:
        engine = BatchInferenceEngine(load(model_dir), batch_size=2, stop_token=5)
        h = engine.submit_request(prompt, 10, logit_bias={5: 100.0}, min_tokens=3)
        engine.run()
        assert 5 not in h.tokens[:3] and h.tokens[3:] == [5] and h.finish_reason == "stop"  # was [5, 5, 5]
        assert h.tokens == min_tokens_greedy(reference, prompt, 10, 5, 3, {5: 100.0})
    # the request's own stop tokens (eos and stop_token ids) are masked, whichever they are
    engine = BatchInferenceEngine(load(model_dir), batch_size=1, stop_token=5)
    h = engine.submit_request(prompts[0], 10, stop_token=[7, 9], logit_bias={7: 100.0, 9: 100.0, 5: 100.0},
                              min_tokens=4)
    engine.run()
    assert not {7, 9} & set(h.tokens[:4]) and h.tokens[:4] == [5] * 4 and h.tokens[4] in (7, 9)


def test_min_tokens_in_a_mixed_batch_leaves_plain_rows_unchanged_and_is_exact(model_dir, reference):
    prompts = random_prompts(5, seed=12, max_len=16)
    first = [generate_alone(reference, p, 1)[0] for p in prompts]
    stop = first[1]  # row 1's own first greedy token: min_tokens must push it back
    options = [{}, {"min_tokens": 4}, {}, {"min_tokens": 2, "logit_bias": {stop: 100.0}},
               {"min_tokens": 5, "temperature": 0.8, "seed": 4}]
    engine = BatchInferenceEngine(load_model(model_dir), batch_size=4, stop_token=stop)
    handles = [engine.submit_request(p, 9, **o) for p, o in zip(prompts, options)]
    engine.run()
    got = [h.tokens for h in handles]
    for i in (0, 2):
        assert got[i] == generate_alone(reference, prompts[i], 9, eos=stop)
    assert got[1] == min_tokens_greedy(reference, prompts[1], 9, stop, 4) and got[1][0] != stop
    assert got[3] == min_tokens_greedy(reference, prompts[3], 9, stop, 2, {stop: 100.0}) and got[3][2] == stop
    assert stop not in got[4][:5]
    # the sampled row with the mask is batch invariant (seeded)
    alone = BatchInferenceEngine(load_model(model_dir), batch_size=1, stop_token=stop)
    h = alone.submit_request(prompts[4], 9, **options[4])
    alone.run()
    assert h.tokens == got[4]


def test_min_tokens_with_speculative_decoding_masked_rows_are_not_drafted_until_min_tokens(model_dir, reference):
    prompts = repetitive_prompts(4, seed=2)  # row 3's continuation repeats itself: it is drafted
    stop = generate_alone(reference, prompts[1], 6)[3]  # a token row 1 would give early (no other row does)
    requests = [(p, 24, o) for p, o in zip(prompts, [{}, {"min_tokens": 12}, {"min_tokens": 3}, {}])]

    def go(model):
        engine = BatchInferenceEngine(model, batch_size=4, stop_token=stop)
        handles = [engine.submit_request(p, n, **o) for p, n, o in requests]
        engine.run()
        return [h.tokens for h in handles]

    plain = go(load_model(model_dir))
    runner = load_model(model_dir)
    runner.speculative_tokens = 3
    counting = CountingSteps(runner)
    drafted = []
    step = runner.step

    def spy(plan):
        out = step(plan)
        drafted.extend((plan.batch[i].sampling, len(plan.batch[i].tokens) - plan.batch[i].prompt_len)
                       for i in runner._drafts)
        return out

    runner.step = spy
    assert go(counting) == plain
    assert plain[1] == min_tokens_greedy(reference, prompts[1], 24, stop, 12) and stop not in plain[1][:12]
    assert counting.several > 0 and drafted and all(p.is_plain_greedy and not p.min_tokens_stops
                                                    for p, _ in drafted)


def test_min_tokens_of_a_resumed_request_count_the_resumed_tokens(model_dir, reference):
    prompt = random_prompts(1, seed=13, max_len=16)[0]
    engine = BatchInferenceEngine(load_model(model_dir), batch_size=1, stop_token=5)
    whole = engine.submit_request(prompt, 12, logit_bias={5: 100.0}, min_tokens=6)
    engine.run()
    assert whole.tokens == min_tokens_greedy(reference, prompt, 12, 5, 6, {5: 100.0}) and len(whole.tokens) == 7
    for cut in (2, 5):
        engine = BatchInferenceEngine(load_model(model_dir), batch_size=2, stop_token=5)
        other = engine.submit_request(random_prompts(1, seed=14)[0], 8, logit_bias={5: 100.0})
        resumed = engine.submit_request(prompt, 12, logit_bias={5: 100.0}, min_tokens=6,
                                        resume_tokens=whole.tokens[:cut])
        engine.run()
        assert resumed.tokens == whole.tokens and resumed.finish_reason == "stop", cut
        assert other.tokens == [5]  # no min_tokens: the bias wins at once
    # reached already by the resumed tokens: no mask at all (plain greedy)
    engine = BatchInferenceEngine(load_model(model_dir), batch_size=1, stop_token=5)
    h = engine.submit_request(prompt, 12, logit_bias={5: 100.0}, min_tokens=6, resume_tokens=whole.tokens[:6])
    engine.run()
    assert h.tokens == whole.tokens


def test_the_min_tokens_mask_is_checked_per_row_each_step_and_lifted_at_min_tokens():
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0
    masked = sampling()._replace(min_tokens=3, min_tokens_stops=(5, 200))  # an id past the vocab is ignored
    assert not masked.is_plain_greedy and sampling().is_plain_greedy
    rows = [SlotInput(slot=0, tokens=[1, 2, 3, 4], prompt_len=2),
            SlotInput(slot=1, tokens=[1, 2, 3, 4, 5], prompt_len=2)]
    picks = Sampler().pick(logits, [masked, masked], [4, 5], inputs=rows)
    assert picks[0] != 5 and picks[1] == 5  # row 1 has its 3 output tokens: the mask is off

    class Recording:  # a slot model that reports each step's sampling (and emits no stop token)
        def __init__(self):
            self.seen = []

        def bind_slots(self, num_slots):
            pass

        def release_slot(self, slot):
            pass

        def step(self, plan):
            self.seen.append([(len(si.tokens) - si.prompt_len, si.sampling) for si in plan.batch])
            return StepOutput([7] * len(plan.batch))

    model = Recording()
    engine = BatchInferenceEngine(model, batch_size=3, stop_token=5)  # one row each, in submission order
    held = engine.submit_request([1, 2], 6, min_tokens=3)
    plain = engine.submit_request([1], 6, logit_bias={9: 1.0})
    resumed = engine.submit_request([3], 6, min_tokens=3, resume_tokens=[7, 7, 7])  # reached: never held
    engine.run()
    assert all(len(h.tokens) == 6 for h in (held, plain, resumed))
    by_row = [[] for _ in range(3)]
    for step in model.seen:
        for r, (n, p) in enumerate(step):
            by_row[r].append((n, p))
    assert [(n, p.min_tokens_stops) for n, p in by_row[0]] == [(0, (5,)), (1, (5,)), (2, (5,))] + [
        (n, ()) for n in range(3, 6)]
    assert by_row[0][-1][1] is GREEDY  # back to the request's own sampling: plain greedy again
    assert all(not p.min_tokens_stops for row in by_row[1:] for n, p in row)
    assert [n for n, p in by_row[2]] == [3, 4, 5] and all(p is GREEDY for n, p in by_row[2])
