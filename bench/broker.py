"""Benchmark the distributed path: client -> broker -> workers -> client.

Four measurements, each on a fresh local cluster (``slotserve.launcher``):

1. **Throughput**: short requests (3-token prompt, ``max_tokens=4``, no stop
   token) with zero-cost ``SimulatedLLM`` workers; requests/s and output
   tokens/s end to end (first submit to last callback), plus CPU seconds per
   request in each process (from ``/proc``), which shows where the time goes.
2. **Added latency**: one request at a time through an idle cluster vs the
   same request in an in-process engine (submit + ``run()``); the difference
   of the p50s and of the p99s.
3. **Slot occupancy** with ``--step-delay-ms``: generated tokens / (slots x
   iterations), sampled from ``slotserve status`` while requests wait in the
   broker's queue (the definition in docs/architecture.md, "Terms").
4. **Scaling**: the same job on 1, 2 and 4 workers with a fixed step cost;
   output tokens/s and the speed-up over one worker.

Targets (issue 3): >= 10,000 requests/s, <= 1 ms added p50 latency,
occupancy >= 97 %, 4 workers >= 3.8x one. Prints a table; writes
``bench/results/broker.json`` and ``bench/results/broker.png``.

    python -m bench.broker            # full run (about two minutes)
    python -m bench.broker --quick    # smaller sizes, for a smoke check
    python -m bench.broker --compare-routing 3   # prefix-aware dispatch on vs off, alternated

``--prefix-routing off`` runs the four with credit-only dispatch
(``BrokerConfig(prefix_routing=False)``); ``--compare-routing ROUNDS``
instead measures only the throughput, on vs off alternated (issue 23: the
broker stays within 5 % with prefix routing), on the 3-token prompts above
(under the router's ``MIN_MATCH``: one length check) and on 64-token
prompts sharing 16 prefixes of 48 tokens (every request matched against both
workers' trees and inserted; their unique tails make the trees evict), and
writes ``bench/results/broker_routing.json``. ``--compare-bare ROUNDS`` measures only the
throughput (40,000 short requests, 2 workers) through this broker vs a bare pass-through one
(``bench/passthrough.py``: the same messages between two ROUTER sockets, nothing checked),
alternated, with each broker's CPU per request (issue 30: >= 0.8x); writes ``broker_bare.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from pathlib import Path

from bench.common import ANY_PORT as ANY
from bench.common import RESULTS, cpu_s, load_avg, machine_record, percentile, write_results
from bench.passthrough import PassThroughCluster
from broker import BrokerConfig
from client import Client
from slotserve.launcher import ClusterConfig, LocalCluster
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig


def cluster(workers: int, slots: int, step_delay_ms: float = 0.0, prefix_routing: bool = True,
            bare: bool = False) -> LocalCluster:
    """``bare``: the broker is bench/passthrough.py's bare pass-through one instead of slotserve's."""
    cfg = ClusterConfig(BrokerConfig(frontend=ANY, backend=ANY, prefix_routing=prefix_routing),
                        tuple(WorkerConfig(num_slots=slots, step_delay_ms=step_delay_ms) for _ in range(workers)))
    return PassThroughCluster(cfg) if bare else LocalCluster(cfg)


# ---------------------------------------------------------------------- 1. throughput


def short_prompt(i: int) -> list[int]:
    """The throughput benchmark's prompt: 3 tokens (under broker/prefix.py's MIN_MATCH: no tree work)."""
    return [i % 100 + 1, 2, 3]


def shared_prompt(i: int) -> list[int]:
    """A 64-token prompt: one of 16 shared 48-token prefixes + 16 tokens unique to ``i``, so prefix-aware
    dispatch matches and inserts in its trees on every request (and evicts: the unique tails add up)."""
    group, mixed = i % 16, (i * 2654435761) % 2**64  # Knuth's multiplicative hash: tails practically unique
    return [1 + group * 48 + k for k in range(48)] + [(mixed >> (4 * k)) % 999 + 1 for k in range(16)]


def bench_throughput(n: int, workers: int, slots: int = 64, prefix_routing: bool = True,
                     prompt=short_prompt, bare: bool = False) -> dict:
    with cluster(workers, slots, prefix_routing=prefix_routing, bare=bare) as cl, Client(cl.frontend) as c:
        pids = {"broker": cl.broker_process.pid, "client": os.getpid()}
        pids.update({f"worker{i}": p.pid for i, p in enumerate(cl.worker_processes)})
        for i in range(min(5000, n)):  # warm-up
            c.submit_request(prompt(i), 4, stop_token=None)
        c.run(timeout=120)
        cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        for i in range(n):
            c.submit_request(prompt(i), 4, stop_token=None)
        c.run(timeout=600)
        wall = time.perf_counter() - t0
        cpu = {k: (cpu_s(p) - cpu0[k]) / n * 1e6 for k, p in pids.items()}
        st = c.status()
    assert st.counters["completed"] == n + min(5000, n)
    return {"workers": workers, "slots": slots, "requests": n, "prefix_routing": prefix_routing, "bare": bare,
            "prompt": prompt.__name__, "load_avg": load_avg(), "wall_s": wall, "requests_per_s": n / wall,
            "output_tokens_per_s": 4 * n / wall, "cpu_us_per_request": cpu}


# ---------------------------------------------------------------------- 2. added latency


def bench_latency(n: int, prefix_routing: bool = True) -> dict:
    prompt, max_tokens = [5, 6, 7], 4
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=8, stop_token=None)
    local = []
    for _ in range(n):
        t = time.perf_counter()
        engine.submit_request(prompt, max_tokens)
        engine.run()
        local.append(time.perf_counter() - t)
    remote = []
    with cluster(1, 8, prefix_routing=prefix_routing) as cl, Client(cl.frontend) as c:
        for _ in range(200):  # warm-up
            c.submit_request(prompt, max_tokens, stop_token=None).result(10)
        for _ in range(n):
            t = time.perf_counter()
            c.submit_request(prompt, max_tokens, stop_token=None).result(10)
            remote.append(time.perf_counter() - t)
    ms = 1000.0
    return {"requests": n,
            "engine_p50_ms": percentile(local, 50) * ms, "engine_p99_ms": percentile(local, 99) * ms,
            "cluster_p50_ms": percentile(remote, 50) * ms, "cluster_p99_ms": percentile(remote, 99) * ms,
            "added_p50_ms": (percentile(remote, 50) - percentile(local, 50)) * ms,
            "added_p99_ms": (percentile(remote, 99) - percentile(local, 99)) * ms,
            "cluster_ms": [x * ms for x in remote]}


# ---------------------------------------------------------------------- 3. occupancy


def bench_occupancy(n: int, workers: int = 2, slots: int = 8, step_delay_ms: float = 5.0,
                    prefix_routing: bool = True) -> dict:
    rng = random.Random(0)
    samples = []
    with cluster(workers, slots, step_delay_ms, prefix_routing) as cl, Client(cl.frontend) as c:
        mon = Client(cl.frontend, name="monitor")
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                st = mon.status()
                samples.append((st.models["simulated"].queued, st.counters["tokens_out"],
                                sum(w.iterations * w.num_slots for w in st.workers)))
                stop.wait(0.05)

        for i in range(n):
            c.submit_request([rng.randrange(1, 1000) for _ in range(4)], rng.randrange(8, 33), stop_token=None)
        th = threading.Thread(target=sample)
        th.start()
        c.run(timeout=600)
        stop.set()
        th.join()
        mon.close()
    waiting = [s for s in samples if s[0] > 0]
    if len(waiting) < 2:
        raise RuntimeError("the queue emptied before two samples: raise the request count")
    (_, tok0, slot_it0), (_, tok1, slot_it1) = waiting[0], waiting[-1]
    return {"workers": workers, "slots": slots, "step_delay_ms": step_delay_ms, "requests": n,
            "samples": len(waiting), "occupancy": (tok1 - tok0) / (slot_it1 - slot_it0)}


# ---------------------------------------------------------------------- 4. scaling


def bench_scaling(n: int, slots: int = 8, step_delay_ms: float = 10.0, counts=(1, 2, 4),
                  prefix_routing: bool = True) -> list[dict]:
    rows = []
    for w in counts:
        with cluster(w, slots, step_delay_ms, prefix_routing) as cl, Client(cl.frontend) as c:
            t0 = time.perf_counter()
            for i in range(n):
                c.submit_request([i % 100 + 1, 2, 3], 16, stop_token=None)
            c.run(timeout=600)
            wall = time.perf_counter() - t0
        rows.append({"workers": w, "requests": n, "wall_s": wall, "output_tokens_per_s": 16 * n / wall})
    for r in rows:
        r["speedup"] = r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    return rows


# ---------------------------------------------------------------------- report


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    tp = res["throughput"]
    axes[0].bar([f"{r['workers']} worker(s)" for r in tp], [r["requests_per_s"] for r in tp], color="tab:blue")
    axes[0].axhline(10_000, color="red", ls="--", label="target 10,000/s")
    axes[0].set_ylabel("requests/s (max_tokens=4, zero-cost model)")
    axes[0].set_title("End-to-end throughput")
    axes[0].legend()
    lat = res["latency"]
    xmax = 1.5 * lat["cluster_p99_ms"]
    axes[1].hist([x for x in lat["cluster_ms"] if x <= xmax], bins=60, color="tab:green")
    axes[1].set_xlim(0, xmax)
    axes[1].axvline(lat["cluster_p50_ms"], color="k", ls="--", label=f"p50 {lat['cluster_p50_ms']:.2f} ms")
    axes[1].axvline(lat["engine_p50_ms"], color="tab:orange", ls=":", label=f"engine p50 {lat['engine_p50_ms']:.2f} ms")
    axes[1].set_xlabel("latency of one request through the cluster (ms, up to 1.5 x p99)")
    axes[1].set_title("Added latency")
    axes[1].legend()
    sc = res["scaling"]
    xs = [r["workers"] for r in sc]
    axes[2].plot(xs, [r["speedup"] for r in sc], "o-", label="measured")
    axes[2].plot(xs, xs, "k:", label="ideal")
    axes[2].set_xlabel("workers")
    axes[2].set_ylabel("speed-up over 1 worker")
    axes[2].set_title(f"Scaling ({sc[0]['requests']} requests, step cost fixed)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare_routing(rounds: int, n: int, workers: int = 2) -> dict:
    """Throughput with prefix-aware dispatch on vs off (``BrokerConfig.prefix_routing``), the two
    alternated (``rounds`` times each, the order flipped every round), for :func:`short_prompt`
    (today's benchmark) and :func:`shared_prompt` (the trees at work). Ratio of the medians of
    requests/s, on / off, and the broker's median CPU microseconds per request (less sensitive to
    other load on the machine than wall time)."""
    runs = []
    for r in range(rounds):
        for prompt in (short_prompt, shared_prompt):
            for routing in ((True, False) if r % 2 == 0 else (False, True)):
                row = bench_throughput(n, workers, prefix_routing=routing, prompt=prompt)
                print(f"  round {r}: {prompt.__name__:<13} prefix_routing={str(routing):<5} "
                      f"{row['requests_per_s']:,.0f} req/s (load {load_avg():.2f})")
                runs.append(row)
    out = {"rounds": rounds, "requests": n, "workers": workers, "runs": runs, "by_prompt": {}}
    for prompt in (short_prompt, shared_prompt):
        med = {routing: statistics.median(x["requests_per_s"] for x in runs
                                          if x["prompt"] == prompt.__name__ and x["prefix_routing"] is routing)
               for routing in (True, False)}
        cpu = {routing: statistics.median(x["cpu_us_per_request"]["broker"] for x in runs
                                          if x["prompt"] == prompt.__name__ and x["prefix_routing"] is routing)
               for routing in (True, False)}
        out["by_prompt"][prompt.__name__] = {"on_req_per_s": med[True], "off_req_per_s": med[False],
                                             "on_over_off": med[True] / med[False],
                                             "broker_cpu_us_per_request_on": cpu[True],
                                             "broker_cpu_us_per_request_off": cpu[False]}
    return out


def main_compare(args) -> None:
    machine = machine_record()
    res = {"routing": compare_routing(args.compare_routing, 20_000 if args.quick else 100_000)}
    print(f"\nprefix-aware dispatch on vs off, {res['routing']['workers']} zero-cost workers, "
          f"{res['routing']['requests']:,} requests x {args.compare_routing} rounds each (load average "
          f"{machine['load_avg_before_after'][0]:.1f} -> {load_avg():.1f})")
    for name, r in res["routing"]["by_prompt"].items():
        ok = r["on_over_off"] >= 0.95
        print(f"  {name:<13} on {r['on_req_per_s']:,.0f} req/s, off {r['off_req_per_s']:,.0f} req/s: "
              f"{r['on_over_off']:.3f}x (target >= 0.95: {'yes' if ok else 'NO'}); broker CPU "
              f"{r['broker_cpu_us_per_request_on']:.1f} vs {r['broker_cpu_us_per_request_off']:.1f} us/request")
    print(f"wrote {write_results(args.out / 'broker_routing.json', res, machine)}")


def compare_bare(rounds: int, n: int, workers: int = 2) -> dict:
    """Throughput through slotserve's broker vs bench/passthrough.py's bare pass-through one (the
    floor: the same messages moved between two ROUTER sockets, nothing checked), alternated
    ``rounds`` times each, the order flipped every round, :func:`short_prompt` requests. Every run
    is kept (the machine may be shared: report them all); the ratio of each round's pair, of the
    medians, and the broker's CPU microseconds per request (its process's user + system time / n)."""
    runs = []
    for r in range(rounds):
        pair = {}
        for bare in ((False, True) if r % 2 == 0 else (True, False)):
            row = bench_throughput(n, workers, bare=bare)
            pair[bare] = row
            runs.append(row)
            print(f"  round {r}: {'pass-through' if bare else 'slotserve':<12} {row['requests_per_s']:,.0f} req/s, "
                  f"broker CPU {row['cpu_us_per_request']['broker']:.1f} us/request (load {row['load_avg']:.2f})")
        print(f"  round {r}: ratio {pair[False]['requests_per_s'] / pair[True]['requests_per_s']:.3f}x")
    med = {bare: statistics.median(x["requests_per_s"] for x in runs if x["bare"] is bare) for bare in (False, True)}
    cpu = {bare: statistics.median(x["cpu_us_per_request"]["broker"] for x in runs if x["bare"] is bare)
           for bare in (False, True)}
    ratios = [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(runs[0::2], runs[1::2])]
    ratios = [x if runs[2 * i]["bare"] is False else 1 / x for i, x in enumerate(ratios)]
    return {"rounds": rounds, "requests": n, "workers": workers, "runs": runs, "ratios": ratios,
            "slotserve_req_per_s": med[False], "passthrough_req_per_s": med[True],
            "ratio_of_medians": med[False] / med[True], "broker_cpu_us_per_request": cpu[False],
            "passthrough_cpu_us_per_request": cpu[True]}


def main_bare(args) -> None:
    machine = machine_record()
    b = compare_bare(args.compare_bare, 10_000 if args.quick else 40_000)
    print(f"\nslotserve's broker vs a bare pass-through broker, {b['workers']} zero-cost workers, {b['requests']:,} "
          f"requests x {b['rounds']} rounds each (load average {machine['load_avg_before_after'][0]:.1f} -> "
          f"{load_avg():.1f})")
    print(f"  slotserve {b['slotserve_req_per_s']:,.0f} req/s, pass-through {b['passthrough_req_per_s']:,.0f} req/s "
          f"(medians): {b['ratio_of_medians']:.3f}x (target >= 0.8: {'yes' if b['ratio_of_medians'] >= 0.8 else 'NO'}); "
          f"per round {', '.join(f'{x:.3f}' for x in b['ratios'])}; broker CPU {b['broker_cpu_us_per_request']:.1f} "
          f"vs {b['passthrough_cpu_us_per_request']:.1f} us/request")
    print(f"wrote {write_results(args.out / 'broker_bare.json', {'bare': b}, machine)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke check)")
    ap.add_argument("--prefix-routing", choices=("on", "off"), default="on",
                    help="the broker's prefix-aware dispatch for the four measurements (default on)")
    ap.add_argument("--compare-routing", type=int, default=0, metavar="ROUNDS",
                    help="instead: throughput with prefix routing on vs off, alternated ROUNDS times each, "
                         "3-token and 64-token shared-prefix prompts; writes broker_routing.json")
    ap.add_argument("--compare-bare", type=int, default=0, metavar="ROUNDS",
                    help="instead: throughput (40,000 short requests, 2 workers) through slotserve's broker vs a bare "
                         "pass-through one (bench/passthrough.py), alternated ROUNDS times each; writes broker_bare.json")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for broker.json / broker.png")
    args = ap.parse_args(argv)
    if args.compare_routing:
        return main_compare(args)
    if args.compare_bare:
        return main_bare(args)
    q = args.quick
    routing = args.prefix_routing == "on"
    machine = machine_record()
    res = {"prefix_routing": routing}
    res["throughput"] = [bench_throughput(10_000 if q else 100_000, w, prefix_routing=routing) for w in (1, 2)]
    res["latency"] = bench_latency(300 if q else 2000, routing)
    res["occupancy"] = bench_occupancy(300 if q else 1500, prefix_routing=routing)
    res["scaling"] = bench_scaling(128 if q else 640, prefix_routing=routing)
    load_end = load_avg()

    best = max(res["throughput"], key=lambda r: r["requests_per_s"])
    lat, occ, sc = res["latency"], res["occupancy"], res["scaling"]
    rows = [
        ("requests/s end to end (best)", f"{best['requests_per_s']:,.0f}  ({best['workers']} worker(s))", ">= 10,000",
         best["requests_per_s"] >= 10_000),
        ("output tokens/s end to end", f"{best['output_tokens_per_s']:,.0f}", "", None),
        ("added latency p50", f"{lat['added_p50_ms']:.3f} ms", "<= 1 ms", lat["added_p50_ms"] <= 1.0),
        ("added latency p99", f"{lat['added_p99_ms']:.3f} ms", "", None),
        ("slot occupancy (step 5 ms)", f"{occ['occupancy'] * 100:.1f} %", ">= 97 %", occ["occupancy"] >= 0.97),
        ("4 workers vs 1 (step 10 ms)", f"{sc[-1]['speedup']:.2f}x", ">= 3.8x", sc[-1]["speedup"] >= 3.8),
    ]
    print(f"\nbench/broker.py on {os.cpu_count()} CPUs (load average at start "
          f"{machine['load_avg_before_after'][0]:.1f}, at end {load_end:.1f})")
    print(f"{'metric':<32} {'measured':<34} {'target':<10} ok")
    for name, val, target, ok in rows:
        print(f"{name:<32} {val:<34} {target:<10} {'' if ok is None else ('yes' if ok else 'NO')}")
    for r in res["throughput"]:
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us_per_request"].items())
        print(f"  throughput {r['workers']} worker(s): {r['requests_per_s']:,.0f} req/s; CPU us/request: {cpu}")
    for r in sc:
        print(f"  scaling {r['workers']} worker(s): {r['output_tokens_per_s']:,.0f} tokens/s, {r['speedup']:.2f}x")
    print(f"  latency: engine p50 {lat['engine_p50_ms']:.3f} ms, cluster p50 {lat['cluster_p50_ms']:.3f} ms, "
          f"p99 {lat['cluster_p99_ms']:.3f} ms")
    write_results(args.out / "broker.json", res, machine)
    plot(res, args.out / "broker.png")
    print(f"wrote {args.out / 'broker.json'} and {args.out / 'broker.png'}")


if __name__ == "__main__":
    main()
