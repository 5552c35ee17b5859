"""bench/threads.py -- a worker's throughput on a quiet machine and beside a busy process (issue 32, item 4).

HE32 (the first 32 HumanEval prompts, :func:`bench.common.he32`, EOS stops) through a broker and one
worker process serving SmolLM2-135M at 8 slots (:func:`bench.model.run_slotserve_broker`), in
three thread modes:

- ``default``: the worker as ``slotserve up`` starts it on this machine with no option (precision
  auto, threads not given: the GGUF's own weights, the thread count chosen per step by
  :class:`worker.models.threads.ThreadTuner`);
- ``fixed-N``: ``--threads N`` (every step at N threads).

Each mode runs ``quiet`` (nothing else started) and ``busy``: with ``--busy`` processes spinning
on the CPU beside it (``while True: pass``; 2 on a 2-core machine make the load about 4, as a
second worker of 2 threads would), in turns (quiet, busy, quiet, busy, ... per mode). Reports
tokens/s, the load average, and each mode's busy / quiet ratio of medians (issue 32's target:
the default keeps >= 0.4x its quiet throughput at load 4 on 2 cores). Writes
``bench/results/threads.json``.

    python -m bench.threads [--modes default,fixed-2,fixed-1] [--busy 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from bench.common import RESULTS, load_avg, machine_record, write_results

MODEL = "smollm2-135m"  # (bench.model.smollm2_he32 tokenizes for it)


@contextmanager
def spinning(n: int):
    """``n`` processes spinning on the CPU while the block runs (killed and reaped after it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_mode(mode: str, prompts, max_tokens, slots: int) -> dict:
    """One HE32 run of ``mode`` (``default`` or ``fixed-N``): tokens/s and its wall time."""
    from bench.model import run_slotserve_broker

    threads = None if mode == "default" else int(mode.removeprefix("fixed-"))
    run = run_slotserve_broker(prompts, max_tokens, slots, precision="auto", threads=threads, model=MODEL)
    tokens = sum(len(o) for o in run.outputs)
    return {"tokens": tokens, "wall_s": round(run.wall_s, 2), "tokens_per_s": round(tokens / run.wall_s, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="default,fixed-2,fixed-1", help="default and/or fixed-N, comma-separated")
    ap.add_argument("--busy", type=int, default=2, help="spinning processes in the busy runs (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="quiet/busy pairs per mode (default 2)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "threads.json"))
    args = ap.parse_args(argv)
    machine = machine_record()
    from bench.model import smollm2_he32

    prompts, max_tokens = smollm2_he32(args.prompts)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs = []
    for _ in range(args.repeats):
        for mode in modes:
            for busy in (0, args.busy):
                before = load_avg()
                with spinning(busy):
                    if busy:
                        time.sleep(2)  # (let the spinners reach the run queue before the run starts)
                    r = run_mode(mode, prompts, max_tokens, args.slots)
                r.update(mode=mode, busy=busy, load_avg_before_after=[before, load_avg()])
                runs.append(r)
                print(f"{mode:>9} {'busy' if busy else 'quiet':>5}: {r['tokens_per_s']:7.1f} tokens/s "
                      f"({r['tokens']} tokens in {r['wall_s']} s; load {before:.2f} -> {load_avg():.2f})", flush=True)
    summary = {}
    print(f"\n{'mode':>9} | quiet tok/s | busy tok/s | busy / quiet")
    for mode in modes:
        quiet = statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode and not r["busy"])
        busy = statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode and r["busy"])
        summary[mode] = {"quiet_tokens_per_s": quiet, "busy_tokens_per_s": busy, "busy_over_quiet": round(busy / quiet, 3)}
        print(f"{mode:>9} | {quiet:11.1f} | {busy:10.1f} | {busy / quiet:.2f}x")
    best_quiet = max(s["quiet_tokens_per_s"] for s in summary.values())
    for mode, s in summary.items():
        s["busy_over_best_quiet"] = round(s["busy_tokens_per_s"] / best_quiet, 3)
    path = write_results(args.out, {"model": MODEL, "slots": args.slots, "prompts": args.prompts,
                                    "busy_processes": args.busy, "runs": runs, "summary": summary}, machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
