"""bench/prefix.py -- prefix caching (issue 23) on SmolLM2-135M: cache off vs on, 1 vs 2 workers, llama.cpp.

Workload A: one shared system prompt of ~600 tokens (an instruction and
few-shot HumanEval problems with their canonical solutions, problems 150
onward until the system message reaches ``--system-tokens``), then each of
the first 32 HumanEval problems as the user message
(:data:`slotserve.datasets.CHAT_INSTRUCTION`), rendered with the model's
chat template to token ids (both systems get these ids); greedy, EOS stops,
per-request ``max_tokens`` drawn from [16, 128] with ``random.Random(0)``
(bench/model.py's HE32 draw); all 32 arrive at t0 (TTFT includes
queueing); 8 slots, fp32, slotserve's Llama runner, at each of ``--threads``
(torch CPU threads; default 1 and 2). Systems, same run:

- ``A cache-off`` / ``A cache-on``: one engine in process (a worker's engine,
  no broker hop), same loaded weights, ``prefix_cache_mb`` 0 vs ``--cache-mb``
  (starting empty: the first prompts miss), each after a warm-up request of
  its own that shares nothing with the workload; ``--repeats`` alternates
  them (off, on, on, off, ...) and keeps each one's fastest run; the cache's
  own memory is cache-on's RSS growth over cache-off's (:func:`cache_growth`);
- ``A llama.cpp``: ``llama-server`` on the same GGUF (Q4_1, run natively;
  slotserve dequantizes it to fp32), ``-np 8``, ``--cache-ram
  --llamacpp-cache-mb``, ``cache_prompt: true``, the same token ids, and
  exactly the number of tokens slotserve's fastest cache-on row generated for each request
  (``ignore_eos`` + ``n_predict``: the same work, as bench/model.py); warmed
  up with 8 requests that share nothing with the workload (so its slots
  start without the system prompt too); best of ``--llamacpp-threads``. The
  tokens/s comparison takes each system at its fastest thread count.
  Its prefilled and cached tokens are its own ``timings.prompt_n`` / ``cache_n``;
- ``A alone``: the first ``--alone`` prompts one at a time (``max_tokens``
  1, each sent when the last ended), cache off and on: TTFT without the
  queueing that dominates the all-at-t0 rows, i.e. the prefill the cache skips.

Workload B: ``--conversations`` 16 chats of ``--turns`` 4 turns; turn k of
chat c sends the whole history (user messages and the model's earlier
replies, as text) plus a new user message, :data:`CHAT_INSTRUCTION` over
HumanEval problem ``c * turns + k``; chat messages go to the broker as they
are (the worker renders the chat template; the broker keys them by their
messages). Arrival: every chat's turn 1 at t0, then each chat's next turn
a think time after its previous turn finished (a closed loop per chat, so
turn k of the chats runs interleaved and before their turn k + 1): the user
reads the reply before answering, drawn uniformly from [0, 2 x ``--think-s``]
per chat and turn (:func:`think_times`; ``--think-s 0`` sends the next turn
the moment its slot frees, when credit-only dispatch sends it back to the
worker it just left, so the two policies cannot differ); greedy, EOS stops,
``--b-max-tokens`` per turn. A real broker and worker processes
(``slotserve.launcher.LocalCluster``), ``--slots`` slots and ``--b-threads``
torch threads per worker, ``--b-cache-mb`` each. Systems, each a fresh
cluster (cold caches): ``B 1 worker`` (the hit-rate reference),
``B 2w credit-only`` (``prefix_routing=False``) and ``B 2w prefix-aware``.
Cached tokens per request are the worker's count (``handle.cached_tokens``,
HTTP's ``usage.prompt_tokens_details.cached_tokens``); each worker's own
queries and hits over the workload (``slotserve status``'s prefix-cache
numbers) are listed beside them.

Reported per system: wall time, output tokens/s, TTFT p50/p99, prompt
tokens prefilled (prompt tokens minus cached ones), hit rate (cached /
prompt tokens), the 1-minute load average before/after, peak RSS of the
serving processes (sampled every 50 ms with psutil; for cache-on systems
also the growth over the RSS before the workload, against the cache budget).
``uptime`` is recorded before each system.

    python -m bench.prefix [--parts A,llamacpp,B] [--prompts 32] [--conversations 16] [--turns 4]

Writes ``bench/results/prefix.json`` and ``prefix.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import llamacpp
from bench.common import (
    ANY_PORT, RESULTS, RssPeak, he32_max_tokens, humaneval_problems, load_avg, machine_record, percentile,
    write_results,
)
from slotserve.datasets import CHAT_INSTRUCTION
SYSTEM_HEAD = ("You are a careful Python programmer. Complete the function the user gives you. Reply with "
               "code only: no explanation, no tests, no prose. Keep the signature and the docstring as given, "
               "use only the standard library, and prefer clear, direct code. Examples of finished work:\n\n")
WARMUP = list(range(1000, 1040))  # a warm-up prompt that shares nothing with the workloads


def uptime() -> str:
    """``uptime``'s line (load averages), for the record before each system."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(system: str, wall_s: float, ttft_s: list[float], outputs: int, prompt_tokens: int,
            cached: int | None, load: tuple[float, float], up: str) -> dict:
    """One table row (times in ms, rates per second)."""
    return {"system": system, "wall_s": round(wall_s, 2), "requests": len(ttft_s), "output_tokens": outputs,
            "output_tokens_per_s": round(outputs / wall_s, 2),
            "ttft_p50_ms": round(1000 * percentile(ttft_s, 50), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft_s, 99), 1),
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_prefilled": None if cached is None else prompt_tokens - cached,
            "cached_tokens": cached,
            "hit_rate": None if cached is None else round(cached / prompt_tokens, 3),
            "load_avg_before_after": [round(load[0], 2), round(load[1], 2)], "uptime_before": up}


# ---------------------------------------------------------------------------------------- workload A


def system_prompt(tokenizer, rows: list[dict], tokens: int) -> str:
    """:data:`SYSTEM_HEAD` plus solved problems from 150 on, each that keeps the message within ``tokens``."""
    text = SYSTEM_HEAD
    for p in rows[150:]:
        more = text + "```python\n" + p["prompt"] + p["canonical_solution"] + "```\n\n"
        if len(tokenizer.encode(more)) <= tokens:
            text = more
    return text


def workload_a(tokenizer, n: int, system_tokens: int) -> tuple[list[list[int]], list[int], int]:
    """(prompt token ids, max_tokens, system message tokens) of workload A's ``n`` chats."""
    rows = humaneval_problems()
    system = system_prompt(tokenizer, rows, system_tokens)
    prompts = []
    for p in rows[:n]:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": CHAT_INSTRUCTION.format(prompt=p["prompt"])}]
        prompts.append(tokenizer.apply_chat_template(messages))
    return prompts, he32_max_tokens(len(prompts)), len(tokenizer.encode(system))


def fastest(runs: list[dict]) -> dict:
    """The fastest of one system's tries, with every try's wall time (``all_wall_s``)."""
    best = dict(min(runs, key=lambda x: x["wall_s"]))
    best["all_wall_s"] = [x["wall_s"] for x in runs]
    return best


def cache_growth(off: dict, on: dict) -> dict:
    """What the cache itself adds to the engine's RSS: cache-on's growth over cache-off's (the same
    engine, workload and slots; the rest of the growth, KV rows and activations, is there without a
    cache too), against the budget."""
    extra = round(max(on["memory"]["rss_growth_mb"]) - max(off["memory"]["rss_growth_mb"]), 1)
    return {"growth_over_cache_off_mb": extra, "cache_within_budget": extra <= on["memory"]["cache_budget_mb"]}


def warm_engine(model, slots: int, cache_mb: float, threads: int):
    """A fresh engine over ``model`` (binding its slots empties the prefix cache) with a ``cache_mb``
    MiB prefix cache (0: off) and ``threads`` torch CPU threads, after a warm-up request of its own
    that shares nothing with the workloads."""
    import torch

    from worker import BatchInferenceEngine

    torch.set_num_threads(threads)
    model.prefix_cache_mb = cache_mb
    engine = BatchInferenceEngine(model, batch_size=slots, stop_token="model")
    engine.submit_request(WARMUP, 4)
    engine.run()
    return engine


def run_engine(model, prompts, max_tokens, slots: int, cache_mb: float, threads: int) -> dict:
    """Workload A on one in-process engine with a prefix cache of ``cache_mb`` MiB (0: off),
    ``threads`` torch CPU threads."""
    up = uptime()
    engine = warm_engine(model, slots, cache_mb, threads)
    cache = model.prefix_cache
    base = (cache.stats.queries, cache.stats.hits) if cache is not None else (0, 0)
    n = len(prompts)
    first = [None] * n

    def recorder(i):
        def record(_tok):
            if first[i] is None:
                first[i] = time.monotonic()
        return record

    load_before = load_avg()
    with RssPeak([os.getpid()]) as rss:
        t0 = time.monotonic()
        handles = [engine.submit_request(p, m, on_token=recorder(i))
                   for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        engine.run()
        wall = time.monotonic() - t0
    outputs = [h.tokens for h in handles]
    queries, hits = (cache.stats.queries - base[0], cache.stats.hits - base[1]) if cache is not None else (0, 0)
    assert cache is None or queries == sum(map(len, prompts)), "every prompt token looked up once"
    row = summary(f"A cache-{'on' if cache_mb else 'off'} ({threads} thr)", wall, [f - t0 for f in first],
                  sum(map(len, outputs)), sum(map(len, prompts)), hits, (load_before, load_avg()), up)
    row["memory"] = rss.report(cache_mb or None)
    row["threads"] = threads
    if cache is not None:
        row["cache_blocks_used"] = cache.used_blocks
        row["cache_mb_used"] = round(cache.used_blocks * cache.block_bytes / 2**20, 1)
    row["outputs"] = outputs
    return row


def run_engine_alone(model, prompts, slots: int, cache_mb: float, threads: int) -> dict:
    """Workload A's prompts one at a time (each submitted when the last ended), ``max_tokens`` 1:
    TTFT without queueing, i.e. the prefill the cache skips (s per request, p50 / p99)."""
    up = uptime()
    engine = warm_engine(model, slots, cache_mb, threads)
    ttft = []
    for p in prompts:
        h = engine.submit_request(p, 1)
        engine.run()
        ttft.append(h.ttft_s)
    return {"system": f"A alone cache-{'on' if cache_mb else 'off'} ({threads} thr)", "requests": len(prompts),
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1), "uptime_before": up}


# ---------------------------------------------------------------------------------------- llama.cpp on A


def run_llamacpp(prompts, lengths, threads: int, slots: int, cache_mb: int, binary: str | None,
                 model: str) -> dict:
    """Workload A through ``llama-server`` with its prompt cache on (see the module docstring)."""
    up = uptime()
    gguf = llamacpp.gguf_path(model)
    ctx = max(map(len, prompts)) + max(lengths) + 64
    server, skipped = None, []
    for cand in llamacpp.find_binaries(binary):
        server = llamacpp.LlamaServer(cand, gguf, threads=threads, slots=slots, ctx_per_slot=ctx)
        server.args += ["--cache-ram", str(cache_mb)]  # cache_prompt is per request (below)
        try:
            server.__enter__()
            break
        except llamacpp.ServerStartError as exc:
            skipped.append(str(exc).splitlines()[0])
            server = None
    if server is None:
        raise llamacpp.ServerStartError("no llama-server serves: " + "; ".join(skipped))
    try:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            warm = [pool.submit(llamacpp.complete, server.url, [t + k for t in WARMUP], 4, time.monotonic(),
                                cache_prompt=True) for k in range(slots)]
            for w in warm:
                w.result()
            load_before = load_avg()
            with RssPeak([server.pid]) as rss:
                t0 = time.monotonic()
                futures = [pool.submit(llamacpp.complete, server.url, list(p), int(n), time.monotonic(),
                                       cache_prompt=True) for p, n in zip(prompts, lengths)]
                done = [f.result() for f in futures]
                wall = time.monotonic() - t0
    finally:
        server.__exit__(None, None, None)
    # all were submitted at t0 (the pool has a thread each), so the submit-relative TTFT is t0-relative
    timings = [d.timings for d in done]
    cached = sum(t.get("cache_n", 0) for t in timings) if all("cache_n" in t for t in timings) else None
    row = summary(f"A llama.cpp ({threads} thr)", wall, [d.first_s for d in done],
                  sum(len(d.tokens) for d in done), sum(map(len, prompts)), cached,
                  (load_before, load_avg()), up)
    row["memory"] = rss.report(None)
    row["server"] = {"binary": str(server.binary.path), "version": llamacpp.binary_version(server.binary),
                     "gguf": gguf.name, "quantization": llamacpp.gguf_quantization(gguf), "args": server.args[1:],
                     "skipped": skipped, "threads": threads}
    if cached is not None:
        row["prompt_tokens_prefilled_server"] = sum(t.get("prompt_n", 0) for t in timings)
    return row


# ---------------------------------------------------------------------------------------- workload B


def user_turns(conversations: int, turns: int) -> list[list[str]]:
    """Each chat's user messages: :data:`CHAT_INSTRUCTION` over HumanEval problem ``c * turns + k``."""
    rows = humaneval_problems()
    if conversations * turns > len(rows):
        raise ValueError(f"{conversations} x {turns} turns needs more than HumanEval's {len(rows)} problems")
    return [[CHAT_INSTRUCTION.format(prompt=rows[c * turns + k]["prompt"]) for k in range(turns)]
            for c in range(conversations)]


def think_times(conversations: int, turns: int, mean_s: float) -> list[list[float]]:
    """Seconds chat ``c`` waits after its turn ``k`` before sending turn ``k + 1`` (``[c][k]``, ``turns - 1``
    per chat): uniform on [0, 2 x ``mean_s``], from ``random.Random(0)`` (the same in every system)."""
    if mean_s < 0:
        raise ValueError(f"think time must be >= 0 s, got {mean_s}")
    rng = random.Random(0)
    return [[rng.uniform(0, 2 * mean_s) for _ in range(turns - 1)] for _ in range(conversations)]


def worker_caches(client) -> dict[str, tuple[int, int, int, int]]:
    """Each worker's cumulative prefix-cache numbers from ``status``: name -> (queries, hits,
    used_bytes, budget_bytes) (tokens, tokens, bytes, bytes); a worker without one is left out."""
    return {w.name: tuple(w.prefix_cache) for w in client.status().workers if w.prefix_cache is not None}


def settled_caches(client, timeout_s: float = 10.0) -> dict[str, tuple[int, int, int, int]]:
    """:func:`worker_caches` once two looks a heartbeat interval apart agree (a busy worker reports once
    per interval, an idle one with every heartbeat), or the last look after ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, worker_caches(client)
    while time.monotonic() < deadline:
        time.sleep(1.1)  # protocol.defaults.HEARTBEAT_INTERVAL_S, the workers' default
        now = worker_caches(client)
        if now == last:
            break
        last = now
    return last


def run_cluster(system: str, users: list[list[str]], *, workers: int, routing: bool, slots: int, threads: int,
                cache_mb: float, max_tokens: int, model: str, think_s: float = 0.0) -> dict:
    """Workload B on a fresh broker + ``workers`` worker processes (see the module docstring)."""
    from broker import BrokerConfig
    from client import Client
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig
    from worker.models import ModelOptions

    opts = ModelOptions(device="cpu", runner="slotserve", precision="fp32", num_threads=threads,
                        prefix_cache_mb=cache_mb)
    config = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT,
                                        prefix_routing=routing),
                           tuple(WorkerConfig(model=model, num_slots=slots, name=f"w{i}", model_options=opts)
                                 for i in range(workers)), start_timeout_s=600.0)
    turns = len(users[0])
    think = think_times(len(users), turns, think_s)
    handles: list = []
    lock = threading.Lock()
    chats_done = threading.Semaphore(0)  # released once per chat, after its last turn
    with LocalCluster(config) as cluster, Client(cluster.frontend, model=model, connect_timeout_s=60) as client:
        for _ in range(slots * workers):  # every slot runs once; shares nothing with the chats
            client.submit_request(WARMUP, 4)
        client.run(timeout=600)
        up = uptime()
        caches_before = settled_caches(client)

        def submit(c: int, history: list[dict]) -> None:
            k = len(history) // 2
            messages = history + [{"role": "user", "content": users[c][k]}]

            def done(_seq, c=c, messages=messages):
                if k + 1 == turns:
                    chats_done.release()
                    return
                nxt = messages + [{"role": "assistant", "content": h.text}]
                if think[c][k] == 0:
                    submit(c, nxt)
                    return
                t = threading.Timer(think[c][k], submit, (c, nxt))  # the client is thread-safe
                t.daemon = True
                t.start()

            h = client.submit_request(messages, max_tokens, done)
            with lock:
                handles.append(h)

        load_before = load_avg()
        with RssPeak([p.pid for p in cluster.worker_processes]) as rss:
            t0 = time.monotonic()
            for c in range(len(users)):
                submit(c, [])
            for _ in users:  # between turns a chat may have nothing in flight: wait for each chat's end
                if not chats_done.acquire(timeout=max(1.0, 3600 - (time.monotonic() - t0))):
                    raise TimeoutError(f"workload B ({system}) still running after 3600 s")
            client.run(timeout=600)
            wall = time.monotonic() - t0
        caches_after = settled_caches(client)
    bad = [h for h in handles if h.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].error!r}")
    cached = [h.cached_tokens for h in handles]
    row = summary(system, wall, [h.ttft_s for h in handles], sum(len(h.tokens) for h in handles),
                  sum(h.prompt_tokens for h in handles), None if None in cached else sum(cached),
                  (load_before, load_avg()), up)
    row.update(workers=workers, prefix_routing=routing, think_s_mean=think_s)
    row["memory"] = rss.report(cache_mb)
    row["workers_prefix_cache"] = {}  # each worker's own counters over the workload (from status)
    for name, (queries, hits, used, budget) in sorted(caches_after.items()):
        q0, h0 = caches_before.get(name, (0, 0))[:2]
        row["workers_prefix_cache"][name] = {
            "queries": queries - q0, "hits": hits - h0, "hit_rate": round((hits - h0) / max(1, queries - q0), 3),
            "used_mb": round(used / 2**20, 1), "budget_mb": round(budget / 2**20, 1)}
    by_turn = {}
    for h in handles:
        by_turn.setdefault(len(h.params.prompt) // 2 + 1, []).append(h)
    row["by_turn"] = {k: {"prompt_tokens": sum(h.prompt_tokens for h in hs),
                          "cached_tokens": None if None in (cs := [h.cached_tokens for h in hs]) else sum(cs),
                          "ttft_p50_ms": round(1000 * percentile([h.ttft_s for h in hs], 50), 1)}
                      for k, hs in sorted(by_turn.items())}
    return row


# ---------------------------------------------------------------------------------------- report

COLS = ("system", "wall_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "prompt_tokens_prefilled",
        "hit_rate", "load_avg_before_after")


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print("  ".join(f"{c:>24}" for c in COLS + ("rss_peak_mb",)))
    for r in rows:
        peak = max(r["memory"]["rss_peak_mb"]) if "memory" in r else ""
        print("  ".join(f"{str(r[c]):>24}" for c in COLS) + f"  {peak:>24}")


def plot(groups: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {k: v for k, v in groups.items() if v}
    fig, axes = plt.subplots(len(groups), 4, figsize=(16, 3.6 * len(groups)), squeeze=False)
    for ax_row, (title, rows) in zip(axes, groups.items()):
        names = [r["system"].split(" ", 1)[1] for r in rows]
        p50 = [r["ttft_p50_ms"] / 1000 for r in rows]
        ax_row[0].bar(names, p50, label="p50")
        ax_row[0].bar(names, [r["ttft_p99_ms"] / 1000 - p for r, p in zip(rows, p50)], bottom=p50, alpha=0.4,
                      label="p99")
        ax_row[0].set_ylabel("TTFT (s)")
        ax_row[0].legend()
        ax_row[1].bar(names, [r["output_tokens_per_s"] for r in rows])
        ax_row[1].set_ylabel("output tokens/s")
        ax_row[2].bar(names, [r["prompt_tokens_prefilled"] or 0 for r in rows])
        ax_row[2].set_ylabel("prompt tokens prefilled")
        ax_row[3].bar(names, [r["hit_rate"] or 0 for r in rows])
        ax_row[3].set_ylabel("hit rate (cached / prompt tokens)")
        ax_row[3].set_ylim(0, 1)
        ax_row[0].set_title(title, loc="left", fontsize=10)
        for ax in ax_row:
            ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="A,llamacpp,B", help="which parts run (default A,llamacpp,B)")
    ap.add_argument("--model", default="smollm2-135m", help="a model name slotserve knows (default smollm2-135m)")
    ap.add_argument("--prompts", type=int, default=32, help="workload A's chats (default 32)")
    ap.add_argument("--slots", type=int, default=8, help="slots per engine / worker / llama-server (default 8)")
    ap.add_argument("--system-tokens", type=int, default=600,
                    help="workload A's system message budget, tokens (default 600; the longest that fits)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="workload A's slotserve runs per system, alternated; the fastest kept (default 1)")
    ap.add_argument("--alone", type=int, default=8,
                    help="workload A's first N prompts also one at a time, max_tokens 1 (default 8)")
    ap.add_argument("--cache-mb", type=float, default=512.0, help="workload A's prefix cache, MiB (default 512)")
    ap.add_argument("--threads", default="1,2",
                    help="workload A's torch CPU threads, each value a pair of cache-off/on rows (default 1,2)")
    ap.add_argument("--b-threads", type=int, default=1, help="workload B's torch CPU threads per worker (default 1)")
    ap.add_argument("--llama-server", default="/work/llamacpp/lsbuild/bin/llama-server",
                    help="llama-server binary tried first (then bench/llamacpp.py's candidates)")
    ap.add_argument("--llamacpp-threads", default="1,2",
                    help="llama-server --threads values; fastest kept (default 1,2)")
    ap.add_argument("--llamacpp-cache-mb", type=int, default=512, help="llama-server --cache-ram, MiB (512)")
    ap.add_argument("--conversations", type=int, default=16, help="workload B's chats (default 16)")
    ap.add_argument("--turns", type=int, default=4, help="workload B's turns per chat (default 4)")
    ap.add_argument("--b-max-tokens", type=int, default=48, help="workload B's max_tokens per turn (default 48)")
    ap.add_argument("--think-s", type=float, default=2.0,
                    help="workload B's mean think time between a reply and the next turn, s (default 2; 0: none)")
    ap.add_argument("--b-cache-mb", type=float, default=1024.0,
                    help="workload B's prefix cache per worker, MiB (default 1024)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for prefix.json / prefix.png (default bench/results)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"A", "llamacpp", "B"} or not parts:
        ap.error(f"--parts takes A, llamacpp and B, got {args.parts!r}")
    if args.cache_mb <= 0 or args.b_cache_mb <= 0 or args.repeats < 1 or args.think_s < 0:
        ap.error("--cache-mb and --b-cache-mb must be > 0 (cache-off is always run), --repeats >= 1, --think-s >= 0")
    if "llamacpp" in parts and "A" not in parts:
        ap.error("llamacpp generates slotserve cache-on's lengths: --parts needs A with it")
    binary = args.llama_server if args.llama_server and Path(args.llama_server).is_file() else None
    machine = machine_record()
    result: dict = {"model": args.model, "precision": "fp32", "slots": args.slots, "threads_a": args.threads,
                    "threads_b_per_worker": args.b_threads,
                    "args": {k: str(v) for k, v in vars(args).items()}, "uptime_at_start": uptime()}
    a_rows, b_rows = [], []
    threads_a = [int(t) for t in args.threads.split(",")]
    if "A" in parts:
        from worker.models import load_model

        model = load_model(args.model, precision="fp32")
        prompts, max_tokens, system_len = workload_a(model.tokenizer, args.prompts, args.system_tokens)
        pairs, alone = [], []  # (off, on) per thread count; the one-at-a-time TTFT rows
        for threads in threads_a:
            tries: dict[float, list[dict]] = {0: [], args.cache_mb: []}
            for r in range(args.repeats):  # alternated: off, on, on, off, ...
                for mb in ((0, args.cache_mb) if r % 2 == 0 else (args.cache_mb, 0)):
                    tries[mb].append(run_engine(model, prompts, max_tokens, args.slots, mb, threads))
                    t = tries[mb][-1]
                    print(f"{t['system']}: {t['wall_s']} s ({t['uptime_before']})", flush=True)
            off, on = (fastest(runs) for runs in tries.values())
            on["memory"].update(cache_growth(off, on))
            pairs.append((off, on))
            a_rows += [off, on]
            alone += [run_engine_alone(model, prompts[:args.alone], args.slots, mb, threads)
                      for mb in (0, args.cache_mb)]
        del model
        best_on = max((on for _, on in pairs), key=lambda r: r["output_tokens_per_s"])
        if "llamacpp" in parts:
            lengths = [max(1, len(o)) for o in best_on["outputs"]]
            runs = [run_llamacpp(prompts, lengths, int(t), args.slots, args.llamacpp_cache_mb, binary, args.model)
                    for t in args.llamacpp_threads.split(",")]
            best = dict(max(runs, key=lambda r: r["output_tokens_per_s"]))
            best["all_threads"] = {r["server"]["threads"]: r["output_tokens_per_s"] for r in runs}
            a_rows.append(best)
        result["A"] = {
            "prompts": len(prompts), "system_tokens": system_len, "cache_mb": args.cache_mb,
            "prompt_tokens_range": [min(map(len, prompts)), max(map(len, prompts))],
            "identical_outputs": {on["threads"]: sum(x == y for x, y in zip(off["outputs"], on["outputs"]))
                                  for off, on in pairs},
            "ttft_p50_speedup": {on["threads"]: round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2) for off, on in pairs},
            "alone": alone, "alone_ttft_p50_speedup": {
                t: round(alone[2 * i]["ttft_p50_ms"] / alone[2 * i + 1]["ttft_p50_ms"], 2)
                for i, t in enumerate(threads_a)},
            "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in a_rows]}
        if "llamacpp" in parts:  # each system at its fastest thread count on this machine
            result["A"]["tokens_per_s_vs_llamacpp"] = {
                "slotserve": best_on["system"], "llama.cpp": a_rows[-1]["system"],
                "ratio": round(best_on["output_tokens_per_s"] / a_rows[-1]["output_tokens_per_s"], 2)}
    if "B" in parts:
        users = user_turns(args.conversations, args.turns)
        common = dict(slots=args.slots, threads=args.b_threads, cache_mb=args.b_cache_mb, max_tokens=args.b_max_tokens,
                      model=args.model, think_s=args.think_s)
        b_rows = [run_cluster("B 1 worker", users, workers=1, routing=True, **common),
                  run_cluster("B 2w credit-only", users, workers=2, routing=False, **common),
                  run_cluster("B 2w prefix-aware", users, workers=2, routing=True, **common)]
        ref = b_rows[0]["hit_rate"]
        result["B"] = {"conversations": args.conversations, "turns": args.turns, "max_tokens": args.b_max_tokens,
                       "think_s_mean": args.think_s,
                       "cache_mb_per_worker": args.b_cache_mb, "rows": b_rows,
                       "hit_rate_vs_1_worker": None if not ref else
                       {r["system"]: round(r["hit_rate"] / ref, 3) for r in b_rows[1:] if r["hit_rate"] is not None}}
    if a_rows:
        a = result["A"]
        print_table(f"workload A: {a['prompts']} chats, system message {a['system_tokens']} tokens, prompts "
                    f"{a['prompt_tokens_range'][0]}-{a['prompt_tokens_range'][1]} tokens, {args.slots} slots", a_rows)
        for t, x in a["ttft_p50_speedup"].items():
            print(f"{t} thr: TTFT p50 off/on {x:.2f}x (target >= 3x); identical outputs "
                  f"{a['identical_outputs'][t]}/{a['prompts']}")
        for r in a["alone"]:
            print(f"{r['system']}: TTFT p50 / p99 {r['ttft_p50_ms']} / {r['ttft_p99_ms']} ms over {r['requests']} "
                  "requests one at a time")
        print(f"one at a time, TTFT p50 off/on: {a['alone_ttft_p50_speedup']}")
        if "tokens_per_s_vs_llamacpp" in a:
            v = a["tokens_per_s_vs_llamacpp"]
            print(f"tokens/s {v['slotserve']} vs {v['llama.cpp']}: {v['ratio']:.2f}x (target >= 1.5x)")
    if b_rows:
        b = result["B"]
        print_table(f"workload B: {b['conversations']} chats x {b['turns']} turns, max_tokens {b['max_tokens']}, "
                    f"think time {b['think_s_mean']} s mean, {args.slots} slots per worker", b_rows)
        print(f"hit rate vs 1 worker: {b['hit_rate_vs_1_worker']} (target: prefix-aware >= 0.9)")
    for r in a_rows + b_rows:
        m = r["memory"]
        if "cache_budget_mb" in m:
            print(f"memory {r['system']}: RSS peak {max(m['rss_peak_mb'])} MiB, growth {m['rss_growth_mb']} MiB, "
                  f"budget {m['cache_budget_mb']} MiB per process: within {m['within_budget']}"
                  + (f"; growth over cache-off {m['growth_over_cache_off_mb']} MiB: within "
                     f"{m['cache_within_budget']}" if "growth_over_cache_off_mb" in m else ""))
    result["uptime_at_end"] = uptime()
    write_results(args.out / "prefix.json", result, machine)
    plot({"Workload A: ~600-token shared system prompt + 32 HumanEval chats, 8 slots (SmolLM2-135M)": a_rows,
          f"Workload B: {args.conversations} chats x {args.turns} turns, think {args.think_s} s, "
          f"{args.slots} slots per worker": b_rows}, args.out / "prefix.png")
    print(f"wrote {args.out / 'prefix.json'} and {args.out / 'prefix.png'}")


if __name__ == "__main__":
    main()
