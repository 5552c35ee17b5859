"""bench/gguf_step.py -- a GGUF model at precision ``gguf``: load time, weight bytes held, RSS, decode step.

Loads ``--model`` (default ``qwen2.5-coder-1.5b``) with slotserve's runner at
precision ``gguf`` (the file's quantisation, on the compiled kernel where it
runs), then binds ``--slots`` slots, prefills the first ``--slots`` HumanEval
prompts one by one and decodes all slots together, greedy, for ``--tokens``
steps (bench/kv_cache_dtype's ``decode_run``), ``--repeats`` times. Reported:
load seconds (``load_model``'s wall time), the weights' held bytes
(``LlamaWeights.nbytes``), the process's RSS after the runs (``/proc/self/status``
VmRSS) and peak (VmHWM), and the best median decode step (ms). The load
average before and after goes with the numbers (a shared machine).
``python -m bench.gguf_step [--slots 8] [--tokens 32] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import humaneval_problems, load_avg, own_memory_mib
from worker.models import load_model
from worker.models.base import SlotInput


def decode_run(runner, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """``(median wall ms, median CPU ms)`` of the decode steps over all slots (steps 2.. of
    ``tokens - 1``), the prompts prefilled one by one first, greedy."""
    import statistics

    runner.bind_slots(len(prompts))
    seqs = [list(p) for p in prompts]
    wall, cpu = [], []
    with torch.inference_mode():
        for s, seq in enumerate(seqs):
            logits, _ = runner.forward_batch([SlotInput(s, seq)])
            seq.append(int(logits[0].argmax()))
        for _ in range(tokens - 1):
            t0, c0 = time.perf_counter(), time.process_time()
            logits, index = runner.forward_batch([SlotInput(s, seq) for s, seq in enumerate(seqs)])
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            for row, i in enumerate(index):
                seqs[i].append(int(logits[row].argmax()))
    return statistics.median(wall[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    before = load_avg()
    t0 = time.perf_counter()
    model = load_model(args.model, precision="gguf", runner="slotserve", num_threads=args.threads,
                       prefix_cache_mb=0)
    load_s = time.perf_counter() - t0
    runner = model
    codec = model.tokenizer
    prompts = [codec.encode(p["prompt"]) for p in humaneval_problems(args.slots)]
    steps, cpus = [], []
    for _ in range(args.repeats):
        ms, cpu_ms = decode_run(runner, prompts, args.tokens)
        steps.append(ms)
        cpus.append(cpu_ms)
        print(f"decode step {ms:.2f} ms wall, {cpu_ms:.2f} ms CPU", flush=True)
    weights = getattr(runner, "weights", None)
    print({"model": args.model, "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
           "held_mb": None if weights is None else round(weights.nbytes / 1e6, 1),
           "linear_kind": getattr(weights, "linear_kind", None),
           "rss_mib": own_memory_mib("VmRSS"), "peak_rss_mib": own_memory_mib("VmHWM"),
           "decode_step_ms": round(min(steps), 2), "decode_step_cpu_ms": round(min(cpus), 2),
           "load_avg_before_after": [before, load_avg()]})


if __name__ == "__main__":
    main()
