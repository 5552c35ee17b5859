"""bench/logprobs.py -- what token logprobs and prompt logprobs cost slotserve's Llama runner (issue 20 item 3).

SmolLM2-135M fp32 from its GGUF (the worker's default load: slotserve's runner, screened LM
head as measured), in process, on the first HumanEval prompts:

- ``decode``: one batched decode step of ``--slots`` rows with 160 cached tokens each
  (bench/model.py's ``forward_limits`` shape), median of ``--reps`` steps, for each
  ``logprobs`` setting of every row (None = nobody asks, then each ``--logprobs`` value),
  the settings interleaved round by round so that the machine's drift hits them alike;
- ``he``: HE``--prompts`` through :class:`worker.BatchInferenceEngine` (``--slots`` slots,
  greedy, HumanEval lengths as bench/model.py: ``max_tokens`` from ``random.Random(0)`` in
  [16, 128], EOS stops) with every request asking ``logprobs`` N against none asking, same
  process, alternated ``--repeats`` times; tokens/s and the ratio (target: >= 0.9x);
- ``prefill``: the first prompt's prefill (``max_tokens`` 1) with and without
  ``prompt_logprobs`` (the LM head over its positions and their scoring; target: at most one
  prefill plus its LM head rows).

Through broker + worker the same targets are bench/model.py's (``slotserve-broker``) to run with
``logprobs`` on; this script isolates the model step. The machine is a shared 2-core VM: the
1-minute load average is recorded with every number.

Usage: ``python -m bench.logprobs [--slots 8] [--logprobs 0,5,20] [--prompts 32] [--repeats 2]``.
Writes ``bench/results/logprobs.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import RESULTS, he32, load_avg, machine_record, write_results  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import BatchPlan, SlotInput  # noqa: E402


def decode_steps(model, prompts, slots: int, settings: list, reps: int, context: int = 160) -> dict:
    """Median decode-step ms per ``logprobs`` setting (None: nobody asks), interleaved."""
    times = {str(n): [] for n in settings}
    model.bind_slots(slots)
    seqs = [list((prompts[i % len(prompts)] * 4)[:context]) for i in range(slots)]
    inputs = [SlotInput(s, seqs[s]) for s in range(slots)]
    for seq, tok in zip(seqs, model.step(BatchPlan(inputs)).tokens):  # prefill every row whole (not timed)
        seq.append(tok)
    for _ in range(reps):
        for n in settings:
            for si in inputs:
                si.logprobs = n
            t = time.perf_counter()
            toks = model.step(BatchPlan(inputs, {})).tokens
            times[str(n)].append(time.perf_counter() - t)
            for seq, tok in zip(seqs, toks):
                seq.append(tok)
    for s in range(slots):
        model.release_slot(s)
    return {n: round(1000 * statistics.median(v), 2) for n, v in times.items()}


def he_run(model, prompts, max_tokens, slots: int, logprobs) -> dict:
    engine = BatchInferenceEngine(model, batch_size=slots, stop_token="model")
    options = {} if logprobs is None else {"logprobs": logprobs}
    t = time.perf_counter()
    handles = [engine.submit_request(p, m, **options) for p, m in zip(prompts, max_tokens)]
    engine.run()
    wall = time.perf_counter() - t
    tokens = sum(len(h.tokens) for h in handles)
    return {"wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "outputs": [h.tokens for h in handles]}


def prefill_cost(model, prompt, reps: int) -> dict:
    times = {"plain": [], "prompt_logprobs": []}
    engine = BatchInferenceEngine(model, batch_size=1, stop_token=None)
    for _ in range(reps):
        for name, options in (("plain", {}), ("prompt_logprobs", {"prompt_logprobs": 1})):
            t = time.perf_counter()
            engine.submit_request(prompt, 1, **options)
            engine.run()
            times[name].append(time.perf_counter() - t)
    out = {k: round(1000 * statistics.median(v), 1) for k, v in times.items()}
    out["prompt_tokens"] = len(prompt)
    out["ratio"] = round(out["prompt_logprobs"] / out["plain"], 3)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--logprobs", default="0,5,20", help="comma-separated logprobs values to time (besides none)")
    ap.add_argument("--prompts", type=int, default=32, help="HumanEval prompts for the 'he' run (0: skip it)")
    ap.add_argument("--repeats", type=int, default=2, help="alternated 'he' runs per setting")
    ap.add_argument("--reps", type=int, default=30, help="decode steps per setting")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parts", default="decode,prefill,he",
                    help="which measurements (decode with --logprobs '' also runs on code before logprobs)")
    ap.add_argument("--out", type=Path, default=RESULTS / "logprobs.json")
    args = ap.parse_args(argv)
    machine = machine_record()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the prefix cache off: every prefill is cold (with it, a repeated prompt is a hit, and
        # prompt_logprobs, which bypass the cache, would be compared with a prefill that did not run)
        model = load_model("smollm2-135m", prefix_cache_mb=0)
    except (TypeError, ValueError):  # a tree from before the prefix cache
        model = load_model("smollm2-135m")
    prompts, max_tokens = he32(model.tokenizer, max(args.prompts, args.slots))
    counts = [int(n) for n in args.logprobs.split(",") if n]
    result = {"model": "smollm2-135m", "precision": model.precision, "slots": args.slots,
              "screened_head": model.weights.greedy_head is not None, "threads": torch.get_num_threads()}
    parts = args.parts.split(",")
    if "decode" in parts:
        before = load_avg()
        result["decode_step_ms"] = decode_steps(model, prompts, args.slots, [None] + counts, args.reps)
        result["decode_load_avg_before_after"] = [before, load_avg()]
        print(f"decode step, {args.slots} slots, 160 cached tokens: " +
              ", ".join(f"logprobs={n}: {ms} ms" for n, ms in result["decode_step_ms"].items()))
    if "prefill" in parts:
        result["prefill"] = prefill_cost(model, prompts[0], reps=5)
        print(f"prefill of {result['prefill']['prompt_tokens']} tokens: {result['prefill']['plain']} ms, with "
              f"prompt_logprobs {result['prefill']['prompt_logprobs']} ms ({result['prefill']['ratio']}x)")
    if args.prompts and "he" in parts:
        n = args.prompts
        he_run(model, prompts[:args.slots], [4] * args.slots, args.slots, None)  # warm-up
        runs = {"none": [], "logprobs_5": []}
        for _ in range(args.repeats):
            runs["none"].append(he_run(model, prompts[:n], max_tokens[:n], args.slots, None))
            runs["logprobs_5"].append(he_run(model, prompts[:n], max_tokens[:n], args.slots, 5))
        best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
        result["he"] = {k: {"tokens_per_s": b["tokens_per_s"], "wall_s": b["wall_s"], "tokens": b["tokens"],
                            "all_tokens_per_s": [r["tokens_per_s"] for r in runs[k]]} for k, b in best.items()}
        result["he"]["ratio"] = round(best["logprobs_5"]["tokens_per_s"] / best["none"]["tokens_per_s"], 3)
        result["he"]["same_tokens"] = best["none"]["outputs"] == best["logprobs_5"]["outputs"]
        print(f"HE{n}, {args.slots} slots: none {best['none']['tokens_per_s']} tok/s, logprobs=5 "
              f"{best['logprobs_5']['tokens_per_s']} tok/s ({result['he']['ratio']}x), "
              f"same tokens: {result['he']['same_tokens']}")
    print(f"wrote {write_results(args.out, result, machine)}")


if __name__ == "__main__":
    main()
