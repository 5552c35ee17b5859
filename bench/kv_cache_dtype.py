"""bench/kv_cache_dtype.py -- ``--kv-cache-dtype fp32`` vs ``bf16`` on SmolLM2-135M (issue 31 item 6).

One load of the weights (fp32, slotserve's Llama runner), two runners on
them that differ only in the KV cache's dtype
(:class:`~worker.models.llama.runner.LlamaRunner`'s ``kv_dtype``). Each
binds ``--slots`` slots and prefills the first ``--slots`` HumanEval prompts
(raw text, no chat template; with ``--prompt-tokens N``, each prompt
followed by the next problems' until it has N tokens, cut there: a longer
context to attend over), then decodes all slots together, greedy
(argmax of the full head), for ``--tokens`` steps. Reported:

- ``kv_bytes_per_slot``: the bytes one slot reserves at the default
  ``max_model_len`` (:attr:`LlamaRunner.kv_bytes_per_slot`) and per token;
- ``decode_step_ms``: the median wall time of one decode step over every
  slot (steps 2.. of ``--tokens``; the first is a warm-up); the two runners
  alternate ``--repeats`` times (fp32, bf16, bf16, fp32, ...) and each keeps
  its fastest median;
- greedy agreement: per prompt, the tokens of the bf16 run equal to the
  fp32 run's up to its first difference (``first_difference``, None when all
  ``--tokens`` agree), and the share of prompts that agree throughout.

The load average before and after goes with the numbers (a shared machine:
times are rough). ``python -m bench.kv_cache_dtype [--slots 8] [--tokens 64]``
writes ``bench/results/kv_cache_dtype.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import RESULTS, humaneval_problems, machine_record, write_results
from worker.models import load_model
from worker.models.base import SlotInput
from worker.models.llama.runner import LlamaRunner


def decode_run(runner: LlamaRunner, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """``(each prompt's greedy tokens, median decode step in ms)``: the prompts prefilled one by one,
    then ``tokens - 1`` decode steps over all slots together."""
    runner.bind_slots(len(prompts))
    seqs = [list(p) for p in prompts]
    with torch.inference_mode():
        for s, seq in enumerate(seqs):
            logits, _ = runner.forward_batch([SlotInput(s, seq)])
            seq.append(int(logits[0].argmax()))
        times = []
        for _ in range(tokens - 1):
            t0 = time.perf_counter()
            logits, index = runner.forward_batch([SlotInput(s, seq) for s, seq in enumerate(seqs)])
            times.append(time.perf_counter() - t0)
            for row, i in enumerate(index):
                seqs[i].append(int(logits[row].argmax()))
    outs = [seq[len(p):] for seq, p in zip(seqs, prompts)]
    return outs, statistics.median(times[1:]) * 1e3


def make_prompts(codec, count: int, tokens: int) -> list[list[int]]:
    """The first ``count`` HumanEval prompts as token ids; ``tokens`` > 0: each continued with the
    next problems' prompts (cyclically) and cut at ``tokens`` tokens."""
    texts = [p["prompt"] for p in humaneval_problems()]
    prompts = []
    for i in range(count):
        ids, j = codec.encode(texts[i]), i + 1
        while tokens and len(ids) < tokens:
            ids += codec.encode(texts[j % len(texts)])
            j += 1
        prompts.append(ids[:tokens] if tokens else ids)
    return prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a busy machine)")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="0: the HumanEval prompts as they are")
    parser.add_argument("--out", default=str(RESULTS / "kv_cache_dtype.json"))
    args = parser.parse_args()
    machine = machine_record()
    base = load_model(args.model, precision="fp32", runner="slotserve", num_threads=args.threads,
                      prefix_cache_mb=0)
    runners = {name: LlamaRunner(base.weights, tokenizer=base.tokenizer, kv_dtype=dtype)
               for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    prompts = make_prompts(base.tokenizer, args.slots, args.prompt_tokens)
    outs, best = {}, {}
    order = [n for r in range(args.repeats) for n in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"))]
    for name in order:
        got, ms = decode_run(runners[name], prompts, args.tokens)
        assert outs.setdefault(name, got) == got, "a runner gave other tokens on a repeat"
        best[name] = min(best.get(name, ms), ms)
        print(f"{name}: decode step {ms:.2f} ms", flush=True)
    diffs = [first_difference(a, b) for a, b in zip(outs["fp32"], outs["bf16"])]
    agree = sum(d is None for d in diffs)
    payload = {
        "model": args.model, "slots": args.slots, "tokens": args.tokens, "threads": torch.get_num_threads(),
        "prompt_tokens": [len(p) for p in prompts],
        "max_model_len": base.max_seq_len,
        "kv_bytes_per_slot": {n: r.kv_bytes_per_slot for n, r in runners.items()},
        "kv_bytes_per_token": {n: r.kv_bytes_per_slot // r.max_seq_len for n, r in runners.items()},
        "decode_step_ms": {n: round(v, 2) for n, v in best.items()},
        "first_difference": diffs,
        "prompts_agreeing_throughout": f"{agree}/{len(diffs)}",
        "tokens_before_first_difference": sum(args.tokens if d is None else d for d in diffs),
    }
    print(payload)
    print("wrote", write_results(args.out, payload, machine))


if __name__ == "__main__":
    main()
