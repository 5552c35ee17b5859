"""bench/prefix.py -- prefix caching (issue 23) on SmolLM2-135M: cache off vs on.

Workload A: one shared system prompt of ~600 tokens (an instruction and
few-shot HumanEval problems with their canonical solutions, problems 150
onward until the system message reaches ``--system-tokens``), then each of
the first 32 HumanEval problems as the user message
(:data:`slotserve.datasets.CHAT_INSTRUCTION`), rendered with the model's
chat template; greedy, EOS stops, per-request ``max_tokens`` drawn from
[16, 128] with ``random.Random(0)`` (bench/model.py's HE32 draw); all 32
arrive at t0 (TTFT includes queueing); 8 slots, one engine (a worker's
engine, in process: no broker hop), fp32, slotserve's Llama runner.

Systems, same loaded weights, same run: ``cache-off`` (``prefix_cache_mb=0``)
and ``cache-on`` (``--cache-mb``, starting empty: the first prompts miss).
Each after a warm-up request of its own engine. Reported: wall time,
output tokens/s, TTFT p50/p99, prompt tokens prefilled (prompt tokens minus
the cache's hits), hit rate (hits / prompt tokens looked up), the pool's
blocks used, the 1-minute load average before/after (2 shared cores here),
and whether cache-on's tokens equal cache-off's for every request.

Not yet here (issue 23 item 5): workload B (conversations over 2 workers,
credit-only vs prefix-aware dispatch) and llama.cpp's server with its prompt cache.

    python bench/prefix.py [--prompts 32] [--slots 8] [--cache-mb 512]

Writes ``bench/results/prefix.json`` and ``prefix.png``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# run as a script, bench/ would come first on sys.path (bench/broker.py shadows the broker package)
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from slotserve.datasets import CHAT_INSTRUCTION, humaneval_path  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM_HEAD = ("You are a careful Python programmer. Complete the function the user gives you. Reply with "
               "code only: no explanation, no tests, no prose. Keep the signature and the docstring as given, "
               "use only the standard library, and prefer clear, direct code. Examples of finished work:\n\n")


def problems() -> list[dict]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def system_prompt(tokenizer, rows: list[dict], tokens: int) -> str:
    """:data:`SYSTEM_HEAD` plus solved problems from 150 on, each that keeps the message within ``tokens``."""
    text = SYSTEM_HEAD
    for p in rows[150:]:
        more = text + "```python\n" + p["prompt"] + p["canonical_solution"] + "```\n\n"
        if len(tokenizer.encode(more)) <= tokens:
            text = more
    return text


def workload(tokenizer, n: int, system_tokens: int) -> tuple[list[list[int]], list[int], int]:
    rows = problems()
    system = system_prompt(tokenizer, rows, system_tokens)
    rng = random.Random(0)
    prompts, max_tokens = [], []
    for p in rows[:n]:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": CHAT_INSTRUCTION.format(prompt=p["prompt"])}]
        prompts.append(tokenizer.apply_chat_template(messages))
        max_tokens.append(rng.randint(16, 128))
    return prompts, max_tokens, len(tokenizer.encode(system))


def run(model, prompts, max_tokens, slots: int, cache_mb: float) -> dict:
    model.prefix_cache_mb = cache_mb
    engine = BatchInferenceEngine(model, batch_size=slots, stop_token="model")  # binds slots: an empty cache
    engine.submit_request(list(range(1000, 1040)), 4)  # warm-up, shares nothing with the workload
    engine.run()
    cache = model.prefix_cache
    base = (cache.stats.queries, cache.stats.hits) if cache is not None else (0, 0)
    n = len(prompts)
    first, last = [None] * n, [None] * n

    def recorder(i):
        def record(_tok):
            now = time.monotonic()
            if first[i] is None:
                first[i] = now
            last[i] = now
        return record

    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    handles = [engine.submit_request(p, m, on_token=recorder(i)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    engine.run()
    wall = time.monotonic() - t0
    load_after = os.getloadavg()[0]
    outputs = [h.tokens for h in handles]
    ttft = sorted(f - t0 for f in first)
    prompt_tokens = sum(map(len, prompts))
    queries, hits = (cache.stats.queries - base[0], cache.stats.hits - base[1]) if cache is not None else (0, 0)
    return {
        "system": "cache-on" if cache_mb else "cache-off",
        "cache_mb": cache_mb,
        "wall_s": round(wall, 2),
        "output_tokens": sum(map(len, outputs)),
        "output_tokens_per_s": round(sum(map(len, outputs)) / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "ttft_p99_ms": round(1000 * ttft[min(n - 1, round(0.99 * (n - 1)))], 1),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_prefilled": prompt_tokens - hits,
        "hit_rate": round(hits / queries, 3) if queries else 0.0,
        "cache_blocks_used": None if cache is None else cache.used_blocks,
        "cache_bytes_used": None if cache is None else cache.used_blocks * cache.block_bytes,
        "load_avg_before_after": [round(load_before, 2), round(load_after, 2)],
        "outputs": outputs,
    }


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [r["system"] for r in rows]
    axes[0].bar(names, [r["ttft_p50_ms"] for r in rows], label="p50")
    axes[0].bar(names, [r["ttft_p99_ms"] - r["ttft_p50_ms"] for r in rows], bottom=[r["ttft_p50_ms"] for r in rows],
                alpha=0.4, label="p99")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(names, [r["output_tokens_per_s"] for r in rows])
    axes[1].set_ylabel("output tokens/s")
    axes[2].bar(names, [r["prompt_tokens_prefilled"] for r in rows])
    axes[2].set_ylabel("prompt tokens prefilled")
    fig.suptitle("Workload A: ~600-token shared system prompt + 32 HumanEval chats, 8 slots (SmolLM2-135M fp32)")
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--cache-mb", type=float, default=512.0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    model = load_model(args.model, precision="fp32", num_threads=args.threads)
    prompts, max_tokens, system_len = workload(model.tokenizer, args.prompts, args.system_tokens)
    rows = [run(model, prompts, max_tokens, args.slots, 0), run(model, prompts, max_tokens, args.slots, args.cache_mb)]
    identical = sum(a == b for a, b in zip(rows[0]["outputs"], rows[1]["outputs"]))
    cols = ["system", "wall_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "prompt_tokens_prefilled",
            "hit_rate", "load_avg_before_after"]
    print(f"workload A: {len(prompts)} chats, system message {system_len} tokens, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.slots} slots, fp32")
    print("  ".join(f"{c:>22}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>22}" for c in cols))
    off, on = rows
    print(f"TTFT p50 off/on: {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x (target >= 3x); output tokens/s on/off: "
          f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x; identical outputs: {identical}/{len(prompts)}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"workload": "A", "model": args.model, "precision": "fp32", "slots": args.slots, "threads": args.threads,
              "system_tokens": system_len, "prompts": len(prompts), "identical_outputs": identical,
              "ttft_p50_speedup": round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2),
              "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    (args.out / "prefix.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out / "prefix.png")
    print(f"wrote {args.out / 'prefix.json'} and {args.out / 'prefix.png'}")


if __name__ == "__main__":
    main()
