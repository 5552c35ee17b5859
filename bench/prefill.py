"""Chunked prefill: what a long prompt costs the requests already decoding.

    python -m bench.prefill [--long-tokens 1536] [--chunks 64,128,256,512,4096] [--threads 2]

SmolLM2-135M on slotserve's own runner (fp32, in-process engine, 8 slots):
7 short requests (HumanEval prompts, greedy, 48 tokens each, no stop token)
decode; when the first of them has 8 tokens, one request with a long prompt
(``--long-tokens`` tokens: HumanEval prompts concatenated, 16 generated
tokens) arrives. ``max_prefill_tokens`` (``--max-prefill-tokens`` of
``slotserve worker``) caps the prompt tokens an iteration takes, so the long
prompt is prefilled in chunks while the others keep decoding, as in vLLM
and SGLang. The largest value in ``--chunks`` is at least the prompt:
the prompt in one iteration (no chunking) as the baseline.

Reported per chunk size, from the engine's ``on_token`` times (wall clock):
- the long request's TTFT (from its submission to its first token);
- the short requests' worst inter-token latency (ITL, max gap between two
  tokens of one request) over the span of the long prefill, and their mean
  TPOT (time per output token after the first);
- the run's wall time.

Expected shape: the worst ITL of the decoding requests falls with the chunk
size (each waits for at most one chunk per iteration) while the long
request's TTFT grows a little (more iterations, the weights read once per
chunk). Prints a table; writes bench/results/prefill.json and prefill.png.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.common import RESULTS, humaneval_problems, load_avg, machine_record, write_results

MODEL = "smollm2-135m"
SHORT = 7
SHORT_TOKENS = 48
LONG_GEN = 16


def prompts(tokenizer, long_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The 7 short prompts (HumanEval 0..6, token ids) and one long prompt of
    exactly ``long_tokens`` ids (HumanEval prompts 7.. concatenated)."""
    ids = [tokenizer.encode(r["prompt"]) for r in humaneval_problems(64)]
    long: list[int] = []
    for p in ids[SHORT:]:
        long.extend(p)
        if len(long) >= long_tokens:
            break
    if len(long) < long_tokens:
        raise ValueError(f"HumanEval's first 64 prompts hold only {len(long)} tokens")
    return ids[:SHORT], long[:long_tokens]


def run_once(model, short: list[list[int]], long: list[int]) -> dict:
    """One engine run; times in milliseconds."""
    from worker import BatchInferenceEngine

    engine = BatchInferenceEngine(model, batch_size=SHORT + 1, stop_token=None)
    stamps: dict[str, list[float]] = {f"s{i}": [] for i in range(len(short))}
    stamps["long"] = []
    long_sent: list[float] = []

    def on_token_of(name):
        def on_token(_tok):
            stamps[name].append(time.perf_counter())
            if name == "s0" and len(stamps["s0"]) == 8 and not long_sent:
                long_sent.append(time.perf_counter())
                engine.submit_request(long, LONG_GEN, on_token=on_token_of("long"), request_id="long")
        return on_token

    t0 = time.perf_counter()
    for i, p in enumerate(short):
        engine.submit_request(p, SHORT_TOKENS, on_token=on_token_of(f"s{i}"), request_id=f"s{i}")
    engine.run()
    wall = time.perf_counter() - t0
    sent, first = long_sent[0], stamps["long"][0]
    gaps, tpots = [], []
    for i in range(len(short)):
        ts = stamps[f"s{i}"]
        tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
        # gaps that overlap the long request's prefill (its submission to its first token)
        gaps += [b - a for a, b in zip(ts, ts[1:]) if b > sent and a < first]
    return {"long_ttft_ms": round((first - sent) * 1000, 1),
            "short_worst_itl_ms": round(max(gaps) * 1000, 1) if gaps else None,
            "short_mean_tpot_ms": round(sum(tpots) / len(tpots) * 1000, 1),
            "wall_s": round(wall, 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long-tokens", type=int, default=1536, help="the long prompt's tokens (default 1536)")
    ap.add_argument("--chunks", default="64,128,256,512,4096",
                    help="max_prefill_tokens values; one >= --long-tokens is the unchunked baseline")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per chunk size, the fastest kept (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    machine = machine_record()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker.models import load_model
    from worker.models.options import ModelOptions

    chunks = [ModelOptions(max_prefill_tokens=int(c)).max_prefill_tokens for c in args.chunks.split(",") if c]
    rows = []
    # One model for every chunk size: the runner reads max_prefill_tokens at each iteration. Its
    # prefix cache is off: every run prefills the same long prompt (the warm-up its first 64
    # tokens), which a cache would hand the later runs instead of the chunks measured.
    model = load_model(MODEL, num_threads=args.threads, precision="fp32", prefix_cache_mb=0)
    short, long = prompts(model.tokenizer, args.long_tokens)
    for chunk in chunks:
        model.max_prefill_tokens = chunk
        run_once(model, short[:2], long[:64])  # warm-up
        tries = []
        for _ in range(args.repeats):
            before = load_avg()
            r = run_once(model, short, long)
            r["load_avg_before_after"] = [before, load_avg()]
            tries.append(r)
        best = min(tries, key=lambda r: r["wall_s"])
        best.update(max_prefill_tokens=chunk, chunked=chunk < args.long_tokens,
                    all_worst_itl_ms=[t["short_worst_itl_ms"] for t in tries])
        rows.append(best)
        print(f"max_prefill_tokens {chunk}: {best}", flush=True)

    cols = ["max_prefill_tokens", "long_ttft_ms", "short_worst_itl_ms", "short_mean_tpot_ms", "wall_s",
            "load_avg_before_after"]
    print("\n" + " | ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print(" | ".join(f"{str(r[c]):>18}" for c in cols))
    payload = {"model": MODEL, "precision": "fp32", "threads": args.threads, "short_requests": SHORT,
               "short_tokens": SHORT_TOKENS, "long_prompt_tokens": args.long_tokens, "long_generated": LONG_GEN,
               "rows": rows}
    write_results(args.out / "prefill.json", payload, machine)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [str(r["max_prefill_tokens"]) for r in rows]
        ax.plot(xs, [r["short_worst_itl_ms"] for r in rows], "o-", label="decoding requests: worst ITL")
        ax.plot(xs, [r["long_ttft_ms"] for r in rows], "s-", label="long prompt: TTFT")
        ax.plot(xs, [r["short_mean_tpot_ms"] for r in rows], "^-", label="decoding requests: mean TPOT")
        ax.set_xlabel("max_prefill_tokens (prompt tokens per iteration)")
        ax.set_ylabel("ms")
        ax.set_title(f"SmolLM2-135M fp32: {args.long_tokens}-token prompt beside {SHORT} decoding requests")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "prefill.png", dpi=100)
    except ImportError:
        pass
    print(f"wrote {args.out / 'prefill.json'}")


if __name__ == "__main__":
    main()
