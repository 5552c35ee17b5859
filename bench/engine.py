"""Engine benchmark: bookkeeping cost and batching gain.

    python -m bench.engine [--repeats N] [--sleep]

Prints a table and saves bench/results/engine.json and bench/results/engine.png.

1. Bookkeeping cost. A zero-cost model (token 1 for every sequence, so all
   time is the engine's own), batch_size 256, 4,000 requests x 100 tokens,
   stop token 0 (never generated, but checked every iteration). The engine
   against bench/naive_engine.py, in the same process, alternating samples;
   the table shows the median of ``--repeats`` samples and, in brackets, the
   best; targets are judged on medians. Time is this process's CPU time
   (``time.process_time``): the work is single-threaded and never waits, so
   on an idle machine it equals wall time, and on a shared one other
   processes do not add to it (they still slow it: caches, shared cores).
   A naive sample is one run; an engine sample is the mean of
   ``ENGINE_RUNS_PER_SAMPLE`` back-to-back runs (each on a fresh engine),
   so both sides' samples span a similar stretch of time: on a shared
   machine a short run is otherwise all-or-nothing with respect to a burst
   of other work, while a long one averages over it, which skews the ratio
   of medians either way. Two timings per run: end to end (submitting all
   requests, which includes full validation, plus ``run()``) and the
   ``run()`` loop alone. Prompt lengths 16 and 128 tokens (128 is about a
   HumanEval prompt with the SmolLM2 tokenizer): the naive engine rebuilds
   every sequence every iteration, so its cost grows with sequence length
   and the engine's does not. Targets: >= 2,000,000 tokens/s and >= 5x naive.

2. Batching gain. SimulatedLLM with a cost model of 10 ms per iteration +
   0.1 ms per sequence, 500 requests whose output lengths are long-tailed
   (lognormal, median 64, sigma 1.0, clipped to [1, 1024], seed 0),
   batch_size 32: throughput of continuous vs static vs one request at a
   time, and slot occupancy = busy slot-iterations / total slot-iterations
   over the iterations in which a request was waiting. Target: continuous
   >= 98 % of the ideal (every slot busy while work waits).
   Model time is simulated on a virtual clock (SimulatedLLM(sleep=False))
   so the one-at-a-time run (~9 simulated minutes) finishes in seconds;
   throughput = output tokens / (simulated model seconds + measured engine
   wall seconds). ``--sleep`` really sleeps instead (continuous and static
   only, a few minutes).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import RESULTS, machine_record, write_results  # noqa: E402
from bench.naive_engine import NaiveEngine  # noqa: E402
from worker import BatchInferenceEngine, SimulatedLLM  # noqa: E402


class ZeroCostModel:
    """Returns token 1 for every sequence: the model costs (almost) nothing."""

    vocab_size = 1000

    def next_tokens(self, sequences):
        return [1] * len(sequences)


# ---- 1. bookkeeping cost ------------------------------------------------------------


ENGINE_RUNS_PER_SAMPLE = 5
"""Engine runs averaged per sample: the naive engine is 5-10x slower (see the module docstring)."""


def _time_engine(cls, prompt_len: int, num_requests: int, max_tokens: int, batch_size: int,
                 runs: int = 1):
    """CPU seconds (end to end, ``run()`` loop alone), each the mean of ``runs`` runs."""
    e2e = loop = 0.0
    for _ in range(runs):
        engine = cls(ZeroCostModel(), batch_size, stop_token=0)
        prompt = list(range(2, 2 + prompt_len))
        done = []
        gc.collect()
        t0 = time.process_time()
        for _ in range(num_requests):
            engine.submit_request(prompt, max_tokens, done.append)
        t1 = time.process_time()
        engine.run()
        t2 = time.process_time()
        assert len(done) == num_requests and all(len(s) == prompt_len + max_tokens for s in done)
        e2e += t2 - t0
        loop += t2 - t1
    return e2e / runs, loop / runs


def bookkeeping(repeats: int, num_requests=4000, max_tokens=100, batch_size=256):
    tokens = num_requests * max_tokens
    rows = []
    for prompt_len in (16, 128):
        times = {"engine": [], "naive": []}
        for _ in range(repeats):  # alternate, so machine noise hits both alike
            times["engine"].append(_time_engine(BatchInferenceEngine, prompt_len, num_requests,
                                                max_tokens, batch_size, ENGINE_RUNS_PER_SAMPLE))
            times["naive"].append(_time_engine(NaiveEngine, prompt_len, num_requests,
                                               max_tokens, batch_size))
        row = {"prompt_len": prompt_len, "tokens": tokens}
        for name, ts in times.items():
            e2e = [t[0] for t in ts]
            loop = [t[1] for t in ts]
            row[name] = {
                "end_to_end_tok_s_best": tokens / min(e2e),
                "end_to_end_tok_s_median": tokens / statistics.median(e2e),
                "run_loop_tok_s_best": tokens / min(loop),
                "run_loop_tok_s_median": tokens / statistics.median(loop),
            }
        for kind in ("end_to_end", "run_loop"):
            for stat in ("median", "best"):
                key = f"{kind}_tok_s_{stat}"
                row[f"ratio_{kind}_{stat}"] = row["engine"][key] / row["naive"][key]
        rows.append(row)
    targets = {}
    for kind in ("end_to_end", "run_loop"):
        targets[f">= 2M tok/s, {kind}, median, every prompt length"] = all(
            r["engine"][f"{kind}_tok_s_median"] >= 2e6 for r in rows)
        targets[f">= 5x naive, {kind}, median, every prompt length"] = all(
            r[f"ratio_{kind}_median"] >= 5 for r in rows)
    return {"num_requests": num_requests, "max_tokens": max_tokens, "batch_size": batch_size,
            "repeats": repeats, "engine_runs_per_sample": ENGINE_RUNS_PER_SAMPLE, "rows": rows,
            "targets": targets}


def check_same_results():
    """The naive engine is a correct baseline: same outputs as the engine on a mixed workload."""
    rng = random.Random(1)
    work = [([rng.randrange(1, 100) for _ in range(rng.randint(1, 8))], rng.randint(1, 40))
            for _ in range(300)]
    outs = []
    for cls in (BatchInferenceEngine, NaiveEngine):
        engine = cls(SimulatedLLM(vocab_size=100, stop_rate=0.05), 16, stop_token=0)
        res = {}
        for i, (p, n) in enumerate(work):
            engine.submit_request(p, n, lambda seq, i=i: res.__setitem__(i, seq))
        engine.run()
        outs.append(res)
    assert outs[0] == outs[1], "naive engine and engine disagree"


# ---- 2. batching gain ---------------------------------------------------------------


class Recorder:
    """Wraps the model; per call records (busy slots, requests still waiting)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.engine = None
        self.trace: list[tuple[int, int]] = []

    def next_tokens(self, sequences):
        self.trace.append((len(sequences), self.engine.num_queued))
        return self.inner.next_tokens(sequences)


def output_lengths(n=500, seed=0, median=64, sigma=1.0, cap=1024):
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def batching(sleep: bool, batch_size=32, iteration_cost_s=0.010, sequence_cost_s=0.0001):
    lengths = output_lengths()
    total = sum(lengths)
    modes = [("continuous", "continuous", batch_size), ("static", "static", batch_size)]
    if not sleep:
        modes.append(("one-at-a-time", "continuous", 1))
    out = {"batch_size": batch_size, "iteration_cost_s": iteration_cost_s,
           "sequence_cost_s": sequence_cost_s, "num_requests": len(lengths),
           "output_tokens": total, "max_len": max(lengths),
           "median_len": statistics.median(lengths), "clock": "sleep" if sleep else "virtual",
           "modes": {}}
    for label, policy, bs in modes:
        model = Recorder(SimulatedLLM(vocab_size=1000, stop_rate=0.0, sleep=sleep,
                                      iteration_cost_s=iteration_cost_s,
                                      sequence_cost_s=sequence_cost_s))
        engine = BatchInferenceEngine(model, bs, stop_token=None, policy=policy)
        model.engine = engine
        for i, n in enumerate(lengths):
            engine.submit_request([i % 999 + 1], n)
        t0 = time.perf_counter()
        engine.run()
        wall = time.perf_counter() - t0
        seconds = wall + model.inner.clock_s  # virtual: simulated model time + engine time
        waiting = [(busy, q) for busy, q in model.trace if q > 0]
        occ_wait = (sum(b for b, _ in waiting) / (bs * len(waiting))) if waiting else 1.0
        occ_all = sum(b for b, _ in model.trace) / (bs * len(model.trace))
        out["modes"][label] = {
            "iterations": len(model.trace), "seconds": seconds, "engine_wall_s": wall,
            "throughput_tok_s": total / seconds, "requests_per_s": len(lengths) / seconds,
            "occupancy_while_waiting": occ_wait, "occupancy_overall": occ_all,
            "busy_trace": [b for b, _ in model.trace] if bs > 1 else None,
        }
    # Ideal: every slot busy every iteration until the tokens run out (a lower bound on time).
    ideal_iters = max(math.ceil(total / batch_size), max(lengths))
    ideal_s = ideal_iters * iteration_cost_s + total * sequence_cost_s
    out["ideal_throughput_tok_s"] = total / ideal_s
    c = out["modes"]["continuous"]
    out["continuous_vs_ideal"] = c["throughput_tok_s"] / out["ideal_throughput_tok_s"]
    out["continuous_vs_static"] = c["throughput_tok_s"] / out["modes"]["static"]["throughput_tok_s"]
    return out


# ---- report ---------------------------------------------------------------------------


def report(book, gain) -> None:
    print(f"\n1. Bookkeeping cost: zero-cost model, batch {book['batch_size']}, "
          f"{book['num_requests']} requests x {book['max_tokens']} tokens, "
          f"median of {book['repeats']} samples (best in brackets; an engine sample is the "
          f"mean of {book['engine_runs_per_sample']} runs)")
    print(f"{'prompt':>6} {'timing':>10} {'engine tok/s':>25} {'naive tok/s':>25} {'ratio':>11}")
    for r in book["rows"]:
        for kind, label in (("end_to_end", "submit+run"), ("run_loop", "run() only")):
            e, n = r["engine"], r["naive"]
            print(f"{r['prompt_len']:>6} {label:>10} "
                  f"{e[kind + '_tok_s_median']:>12,.0f} ({e[kind + '_tok_s_best']:>10,.0f}) "
                  f"{n[kind + '_tok_s_median']:>12,.0f} ({n[kind + '_tok_s_best']:>10,.0f}) "
                  f"{r[f'ratio_{kind}_median']:>5.1f}x ({r[f'ratio_{kind}_best']:.1f}x)")
    for name, ok in book["targets"].items():
        print(f"   {name}: {'met' if ok else 'NOT met'}")
    print(f"\n2. Batching gain: SimulatedLLM {gain['iteration_cost_s'] * 1e3:g} ms/iteration + "
          f"{gain['sequence_cost_s'] * 1e3:g} ms/sequence ({gain['clock']} clock), "
          f"{gain['num_requests']} requests, {gain['output_tokens']} output tokens "
          f"(median {gain['median_len']}, max {gain['max_len']}), batch {gain['batch_size']}")
    print(f"{'mode':>14} {'iterations':>10} {'seconds':>9} {'tok/s':>9} {'req/s':>7} "
          f"{'occ. while waiting':>19} {'occ. overall':>13}")
    for label, m in gain["modes"].items():
        print(f"{label:>14} {m['iterations']:>10} {m['seconds']:>9.1f} "
              f"{m['throughput_tok_s']:>9.0f} {m['requests_per_s']:>7.2f} "
              f"{m['occupancy_while_waiting']:>18.1%} {m['occupancy_overall']:>13.1%}")
    print(f"   ideal (every slot busy until the tokens run out): "
          f"{gain['ideal_throughput_tok_s']:.0f} tok/s; continuous = "
          f"{gain['continuous_vs_ideal']:.1%} of ideal, {gain['continuous_vs_static']:.2f}x static")
    occ = gain["modes"]["continuous"]["occupancy_while_waiting"]
    print(f"   target continuous occupancy while waiting >= 98%: {'met' if occ >= 0.98 else 'NOT met'}")


def plot(book, gain, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    labels, eng, nai = [], [], []
    for r in book["rows"]:
        for kind, short in (("end_to_end", "e2e"), ("run_loop", "run")):
            labels.append(f"prompt {r['prompt_len']}\n{short}")
            eng.append(r["engine"][kind + "_tok_s_median"] / 1e6)
            nai.append(r["naive"][kind + "_tok_s_median"] / 1e6)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], eng, 0.4, label="engine")
    ax.bar([i + 0.2 for i in x], nai, 0.4, label="naive")
    ax.axhline(2.0, color="k", ls="--", lw=1, label="target 2M tok/s")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens/s (millions)")
    ax.set_title("Bookkeeping cost (zero-cost model, batch 256)")
    ax.legend()
    ax = axes[1]
    names = list(gain["modes"])
    ax.bar(names, [gain["modes"][n]["throughput_tok_s"] for n in names], color="C2")
    ax.axhline(gain["ideal_throughput_tok_s"], color="k", ls="--", lw=1, label="ideal")
    for i, n in enumerate(names):
        m = gain["modes"][n]
        ax.text(i, m["throughput_tok_s"], f"occ {m['occupancy_while_waiting']:.0%}",
                ha="center", va="bottom")
    ax.set_ylabel("output tokens/s (simulated)")
    ax.set_title(f"Batching gain (batch {gain['batch_size']}, 500 long-tailed requests)")
    ax.legend()
    ax = axes[2]
    for n in ("continuous", "static"):
        ax.plot(gain["modes"][n]["busy_trace"], label=n, lw=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("busy slots")
    ax.set_title("Busy slots per iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9,
                    help="samples per bookkeeping case (default 9)")
    ap.add_argument("--sleep", action="store_true",
                    help="batching gain with real sleeps instead of a virtual clock (minutes)")
    args = ap.parse_args(argv)
    machine = machine_record()
    check_same_results()
    book = bookkeeping(args.repeats)
    gain = batching(args.sleep)
    report(book, gain)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(book, gain, RESULTS / "engine.png")
    for mode in gain["modes"].values():
        mode.pop("busy_trace", None)  # plotted, too long for the JSON
    write_results(RESULTS / "engine.json", {"bookkeeping": book, "batching": gain}, machine)
    print(f"\nsaved {RESULTS / 'engine.json'} and {RESULTS / 'engine.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
