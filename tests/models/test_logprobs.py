"""Token logprobs and prompt logprobs (issue 20 item 3) from the sampler and both runners.

The reference is transformers' own ``log_softmax(model(seq).logits)`` of the
tiny random Llama of tests/models/conftest.py (fp32): every generated token's
entry is that row at its position, the prompt's entries those at the prompt
positions; the top alternatives are its stable descending sort (ties by lower
id). Real SmolLM2 positions: tests/models/test_logprobs_smollm2.py.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from protocol.request import GREEDY, SamplingParams  # noqa: E402
from tests.support.slot_models import CountingSteps, random_prompts, repetitive_prompts  # noqa: E402
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.errors import ModelError  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.hf import HFSlotModel  # noqa: E402
from worker.models.sampling import Sampler, score, top_ids  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-4  # fp32, the bound (measured here: ~6e-6)


def ranked(row: torch.Tensor, n: int) -> list[int]:
    """The ``n`` most likely ids of a logprobs row, ties by lower id (a stable descending sort)."""
    return torch.sort(row, descending=True, stable=True).indices[:n].tolist()


def hf_logprobs(reference, seq: list[int]) -> torch.Tensor:
    """fp32 ``[len(seq), vocab]``: row ``p`` is the distribution of the token after ``seq[:p + 1]``."""
    with torch.inference_mode():
        return torch.log_softmax(reference(torch.tensor([seq])).logits[0].float(), dim=-1)


def check_against(reference, prompt, handle, n_top, prompt_top=None, resumed=0) -> float:
    """Assert ``handle``'s entries are transformers' (within TOL, same top ids); return the worst
    difference. ``n_top`` / ``prompt_top``: what the request asked (None: check it has none)."""
    seq = prompt + handle.tokens
    lp = hf_logprobs(reference, seq)
    worst = 0.0
    new = handle.tokens[resumed:]
    if n_top is None:
        assert handle.logprobs is None
    else:
        assert len(handle.logprobs) == len(new)
    for t, (tok, entry) in enumerate(zip(new, handle.logprobs or ())):
        row = lp[len(prompt) + resumed + t - 1]
        worst = max(worst, abs(entry.logprob - row[tok].item()))
        assert [i for i, _ in entry.top] == ranked(row, n_top)
        for i, value in entry.top:
            assert value == pytest.approx(row[i].item(), abs=TOL)
    if prompt_top is None:
        assert handle.prompt_logprobs is None
    else:
        entries = handle.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for q in range(1, len(prompt)):
            row = lp[q - 1]
            worst = max(worst, abs(entries[q].logprob - row[prompt[q]].item()))
            assert [i for i, _ in entries[q].top] == ranked(row, prompt_top)
    assert worst < TOL
    return worst


# ---------------------------------------------------------------- the sampler


def test_top_ids_orders_ties_by_lower_id():
    rng = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(6, 300, generator=rng), dim=-1)
    lp[:, 10:40] = lp[:, 5:6]  # a run of exact ties around a middling value
    lp[1, :] = -5.0  # a whole row of ties
    lp[2, 7] = float("-inf")
    lp[3, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, -1.0])  # signed zeros tie
    for k in (1, 5, 20, 300):
        assert top_ids(lp, k).tolist() == [ranked(row, k) for row in lp]


def test_pick_scored_gives_the_raw_distribution_in_a_mixed_batch():
    """Plain, biased, penalised, sampled and non-finite rows, some asking: tokens are pick()'s,
    entries the log_softmax of the raw logits (before bias and temperature) at the chosen token."""
    vocab = 64
    rng = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab, generator=rng) * 3
    logits[4, 3] = float("nan")
    params = [GREEDY, SamplingParams(logit_bias=((9, 50.0),)), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=0.7, seed=2, top_k=5), GREEDY, GREEDY]
    asks = [3, 2, 0, None, 1, 20]
    raw = logits.clone()
    want = Sampler().pick(logits, params, list(range(6)))
    got, scored = Sampler().pick_scored(logits, params, list(range(6)), logprobs=asks)
    assert torch.equal(logits.nan_to_num(), raw.nan_to_num())  # never modified
    assert got[:4] + got[5:] == want[:4] + want[5:] and isinstance(got[4], ModelError)
    assert got[1] == 9  # the bias chose it; its logprob is still the raw one
    lp = torch.log_softmax(raw, dim=-1)
    for b, n in enumerate(asks):
        if n is None or b == 4:
            assert scored[b] is None
            continue
        assert scored[b].logprob == pytest.approx(lp[b, got[b]].item(), abs=1e-6)
        assert [i for i, _ in scored[b].top] == ranked(lp[b], n)
        assert [v for _, v in scored[b].top] == pytest.approx(lp[b, ranked(lp[b], n)].tolist(), abs=1e-6)
    assert Sampler().pick_scored(logits, params, list(range(6)))[1] == [None] * 6  # nobody asks


def test_score_gives_each_target_its_logprob():
    rng = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=rng)
    lp = torch.log_softmax(logits, dim=-1)
    targets = [7, 0, 49, 7]
    got = score(logits.clone(), targets, [0, 3, 1, 2])
    assert [e.logprob for e in got] == pytest.approx([lp[r, t].item() for r, t in enumerate(targets)], abs=1e-6)
    assert [len(e.top) for e in got] == [0, 3, 1, 2] and got[1].top[0][0] == ranked(lp[1], 1)[0]
    assert score(logits, [], []) == []


# ---------------------------------------------------------------- the runners


def mixed_requests(seed: int):
    """``(prompt, max_tokens, options)``: plain, sampled, biased and penalised rows; about half ask."""
    rng = random.Random(seed)
    prompts = random_prompts(7, seed=seed, max_len=40) + repetitive_prompts(2, seed)
    styles = [{}, {"temperature": 0.8, "seed": 3}, {"logit_bias": {5: 3.0}}, {"repetition_penalty": 1.5},
              {"top_p": 0.9, "temperature": 1.1, "seed": 8}, {}]
    out = []
    for j, p in enumerate(prompts):
        options = dict(styles[j % len(styles)])
        asks = {}
        if j % 2 == 0:
            asks["logprobs"] = rng.randint(0, 5)
        if j % 3 != 1:
            asks["prompt_logprobs"] = rng.randint(0, 4)
        out.append((p, rng.randint(3, 16), options, asks))
    return out


def run(model, requests, batch_size=3, with_asks=True):
    engine = BatchInferenceEngine(model, batch_size=batch_size)
    handles = [engine.submit_request(p, n, **options, **(asks if with_asks else {}))
               for p, n, options, asks in requests]
    engine.run()
    return handles


@pytest.mark.parametrize("max_prefill_tokens", [16, 512])
def test_llama_runner_logprobs_are_transformers_and_change_no_token(model_dir, reference, max_prefill_tokens):
    """Chunked prefill (16-token chunks of prompts up to 48) and whole prompts; slots reused; rows
    with and without logprobs and processors in the same batches: the same tokens as without."""
    requests = mixed_requests(seed=max_prefill_tokens)
    model = load_model(model_dir, max_prefill_tokens=max_prefill_tokens)
    handles = run(model, requests)
    plain = run(load_model(model_dir, max_prefill_tokens=max_prefill_tokens), requests, with_asks=False)
    assert [h.tokens for h in handles] == [h.tokens for h in plain]
    for (p, n, options, asks), h in zip(requests, handles):
        assert h.finish_reason == FinishReason.LENGTH
        check_against(reference, p, h, asks.get("logprobs"), asks.get("prompt_logprobs"))


def test_hf_runner_logprobs_are_transformers(model_dir, reference):
    requests = mixed_requests(seed=5)
    handles = run(HFSlotModel(reference, None, max_prefill_tokens=48), requests)
    plain = run(HFSlotModel(reference, None, max_prefill_tokens=48), requests, with_asks=False)
    assert [h.tokens for h in handles] == [h.tokens for h in plain]
    for (p, n, options, asks), h in zip(requests, handles):
        check_against(reference, p, h, asks.get("logprobs"), asks.get("prompt_logprobs"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    from tests.support.slot_models import save_tiny_llama

    path = tmp_path_factory.mktemp("tied")
    return str(path), save_tiny_llama(path, tie_word_embeddings=True)


def test_a_greedy_row_asking_logprobs_gets_the_full_head_beside_screened_ones(tied):
    """With the screened head on, its rows' logits are -inf outside a few candidates: a row that
    asks for logprobs must not use it (its alternatives would be -inf), its neighbours still do."""
    from worker.models.llama import from_hf
    from worker.models.llama.screen import bf16_product_available

    if not bf16_product_available():
        pytest.skip("oneDNN has no bf16 product on this CPU")
    path, reference = tied
    model = from_hf(transformers.AutoModelForCausalLM.from_pretrained(path), screen_head=True)
    assert model.weights.greedy_head is not None
    prompts = random_prompts(4, seed=6, max_len=30)
    requests = [(p, 8, {}, {"logprobs": 5} if j % 2 else {}) for j, p in enumerate(prompts)]
    handles = run(model, requests, batch_size=4)
    for (p, n, _, asks), h in zip(requests, handles):
        check_against(reference, p, h, asks.get("logprobs"))
        if asks:
            assert all(v > float("-inf") for e in h.logprobs for _, v in e.top)


class _Counting(CountingSteps):
    gives_logprobs = True


def test_speculative_rows_asking_logprobs_draft_and_give_the_draft_free_entries(model_dir, reference):
    prompts = repetitive_prompts(6, seed=2)
    runs = {}
    for k in (0, 4):
        runner = load_model(model_dir, max_prefill_tokens=16)
        runner.speculative_tokens = k
        model = _Counting(runner)
        engine = BatchInferenceEngine(model, batch_size=3)
        handles = [engine.submit_request(p, 24, logprobs=3, prompt_logprobs=2) for p in prompts]
        engine.run()
        runs[k] = handles
        assert (model.several > 0) == (k > 0)  # drafts were accepted for rows asking logprobs
    for p, a, b in zip(prompts, runs[0], runs[4]):
        assert a.tokens == b.tokens and a.prompt_logprobs == b.prompt_logprobs
        assert [[i for i, _ in e.top] for e in a.logprobs] == [[i for i, _ in e.top] for e in b.logprobs]
        assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-5)
        check_against(reference, p, b, 3, 2)


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_a_resumed_request_gives_the_uninterrupted_entries_for_its_new_tokens(model_dir, reference, runner):
    """A migration: the request restarts elsewhere with its first tokens as resume tokens; its new
    entries are the uninterrupted run's, and its prompt is not scored again (the caller has it)."""
    def make():
        return load_model(model_dir, max_prefill_tokens=16) if runner == "slotserve" else \
            HFSlotModel(reference, None)
    prompt = random_prompts(1, seed=9, max_len=30)[0]
    engine = BatchInferenceEngine(make(), batch_size=2)
    whole = engine.submit_request(prompt, 12, logprobs=4, prompt_logprobs=1, temperature=0.9, seed=5)
    engine.run()
    engine = BatchInferenceEngine(make(), batch_size=2)
    beside = engine.submit_request(random_prompts(1, seed=10)[0], 12, logprobs=2)  # other company
    resumed = engine.submit_request(prompt, 12, logprobs=4, prompt_logprobs=1, temperature=0.9, seed=5,
                                    resume_tokens=whole.tokens[:5])
    engine.run()
    assert resumed.tokens == whole.tokens and beside.finish_reason == FinishReason.LENGTH
    assert resumed.prompt_logprobs is None and len(whole.prompt_logprobs) == len(prompt)
    assert len(resumed.logprobs) == 7
    # (the resumed tokens are prefilled, not decoded: equal up to fp32 rounding, measured 1.3e-5 on hf)
    assert [e.logprob for e in resumed.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[5:]],
                                                                  abs=TOL)
    assert [[i for i, _ in e.top] for e in resumed.logprobs] == [[i for i, _ in e.top] for e in whole.logprobs[5:]]
    check_against(reference, prompt, resumed, 4, resumed=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_logprobs_are_transformers(model_dir, reference):
    """The CUDA step (eager prefill with prompt rows, decode replayed from graphs, full logits) and
    the sampler's one sync on the device: fp32 entries as transformers' on CPU."""
    requests = mixed_requests(seed=7)
    handles = run(load_model(model_dir, device="cuda", precision="fp32", max_prefill_tokens=16), requests)
    for (p, n, options, asks), h in zip(requests, handles):
        check_against(reference, p, h, asks.get("logprobs"), asks.get("prompt_logprobs"))
