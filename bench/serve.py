"""Benchmark the HTTP gateway with vLLM's serving-benchmark method.

Requests arrive as a Poisson process (exponential gaps, fixed seed) at
several rates, plus one burst (every request at t=0), and stream over HTTP
(``/v1/completions`` or ``/v1/chat/completions`` with ``stream: true``,
aiohttp as the load generator, like vLLM's ``benchmark_serving.py``). Per
rate: TTFT, TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (gaps between
streamed chunks), end-to-end latency (p50/p99), throughput (requests/s and
output tokens/s over the run's wall time) and goodput (requests/s that met
every SLO: TTFT and TPOT bounds, vLLM's ``--goodput`` definition).

``--model simulated`` (default) also measures, with zero-cost workers and
the Python ``Client`` on the same cluster in the same run:

- **added latency**: one short non-streamed request at a time, HTTP vs the
  Python client; the difference of the p50s (target <= 2 ms);
- **throughput**: short non-streamed completions (3-token prompt,
  ``max_tokens=4``) from many concurrent HTTP connections (target >= 1,000
  requests/s), with CPU microseconds per request of every process, to show
  where the time goes;
- the rate sweep through the Python client too, so HTTP's cost shows at every rate.

``--model smollm2-135m`` runs the first 32 HumanEval prompts (chat) through
HTTP at 0.5, 1 and 2 requests/s (several minutes).

Prints a table; writes ``bench/results/serve[_MODEL].json`` and ``.png``
(latency vs request rate). Load averages are recorded: the machine is shared.

    python -m bench.serve                       # simulated, about two minutes
    python -m bench.serve --quick               # smaller sizes (smoke check)
    python -m bench.serve --model smollm2-135m  # HE32 over HTTP at 0.5, 1, 2 req/s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common import (
    ANY_PORT, RESULTS, cpu_s, load_avg, machine_record, percentile, read_results, write_results,
)
from broker import BrokerConfig
from client import Client
from gateway import GatewayConfig
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig

MS = 1000.0


def start(model: str, workers: int, slots: int, step_delay_ms: float = 0.0) -> LocalCluster:
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                        tuple(WorkerConfig(model=model, num_slots=slots, step_delay_ms=step_delay_ms)
                              for _ in range(workers)),
                        gateway=GatewayConfig(port=0))
    cl = LocalCluster(cfg)
    cl.start()
    deadline = time.monotonic() + 60  # start() returned once the workers registered; the gateway polls status

    async def healthy():
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                async with s.get(cl.http_url + "/health") as r:
                    if r.status == 200:
                        return
                await asyncio.sleep(0.05)
        raise RuntimeError("the gateway did not become healthy")
    try:
        asyncio.run(healthy())
    except BaseException:
        cl.stop()
        raise
    return cl


# ---------------------------------------------------------------------- one request's record


@dataclass
class Record:
    """One request: times in seconds from its send; ``chunks`` = arrival times of streamed chunks."""

    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunks: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def summarize(records: list[Record], wall_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in records if r.error is None and r.e2e_s is not None]
    ttft = [r.ttft_s * MS for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * MS for r in ok if r.tpot_s is not None]
    itl = [x * MS for r in ok for x in r.itl_s]
    e2e = [r.e2e_s * MS for r in ok]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s * MS <= slo_ttft_ms
            and (r.tpot_s is None or r.tpot_s * MS <= slo_tpot_ms)]
    out = {"requests": len(records), "errors": len(records) - len(ok), "wall_s": wall_s,
           "requests_per_s": len(ok) / wall_s, "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s,
           "goodput_requests_per_s": len(good) / wall_s, "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}}
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_p50_ms"] = percentile(vals, 50) if vals else None
        out[f"{name}_p99_ms"] = percentile(vals, 99) if vals else None
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["error_kinds"] = errors[:5]
    return out


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s from start): Poisson at ``rate`` req/s, or all at 0 (a burst) for None."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------------- HTTP


async def http_stream(session: aiohttp.ClientSession, url: str, body: dict) -> Record:
    rec = Record()
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"]["message"][:120]
                    break
                n = sum(len(c.get("token_ids", ())) for c in chunk["choices"])
                if n:
                    rec.output_tokens += n
                    rec.chunks.append(now)
                    if rec.ttft_s is None:
                        rec.ttft_s = now
        rec.e2e_s = time.perf_counter() - t0
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def http_plain(session: aiohttp.ClientSession, url: str, body: dict) -> Record:
    rec = Record()
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        data = await resp.read()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {data[:120]!r}"
            return rec
    rec.e2e_s = time.perf_counter() - t0
    rec.output_tokens = json.loads(data)["usage"]["completion_tokens"]
    return rec


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=3600))


async def http_rate(url: str, bodies: list[dict], rate: float | None, seed: int) -> tuple[list[Record], float]:
    times = arrivals(len(bodies), rate, seed)
    async with session() as s:
        t0 = time.perf_counter()

        async def one(at: float, body: dict) -> Record:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))  # the Poisson schedule
            return await http_stream(s, url, body)

        recs = await asyncio.gather(*(one(t, b) for t, b in zip(times, bodies)))
        return list(recs), time.perf_counter() - t0


# ---------------------------------------------------------------------- the Python client


def client_rate(frontend: str, model: str, work: list[tuple[list[int], int]], rate: float | None,
                seed: int) -> tuple[list[Record], float]:
    """The same schedule through ``Client.submit_request`` (``on_token`` times each token)."""
    times = arrivals(len(work), rate, seed)
    recs = [Record() for _ in work]
    with Client(frontend, model=model, name="bench-client") as c:
        t0 = time.perf_counter()
        handles = []
        for (prompt, max_tokens), at, rec in zip(work, times, recs):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)  # the Poisson schedule
            rec.sent_s = time.perf_counter()

            def on_token(_t, rec=rec):
                rec.chunks.append(time.perf_counter() - rec.sent_s)

            def done(_seq, rec=rec):
                rec.e2e_s = time.perf_counter() - rec.sent_s

            handles.append(c.submit_request(prompt, max_tokens, done, on_token=on_token, stop_token=None))
        c.run(timeout=3600)
        wall = time.perf_counter() - t0
    for rec, h in zip(recs, handles):
        rec.output_tokens = len(h.tokens)
        rec.ttft_s = rec.chunks[0] if rec.chunks else None
        if h.error is not None:
            rec.error = str(h.error)[:120]
    return recs, wall


# ---------------------------------------------------------------------- zero-cost measurements


def bench_added_latency(cl: LocalCluster, n: int) -> dict:
    """One request at a time: HTTP (non-streamed) vs the Python client."""
    prompt, max_tokens = [5, 6, 7], 4
    body = {"model": "simulated", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    with Client(cl.frontend, name="bench-latency") as c:
        for _ in range(200):
            c.submit_request(prompt, max_tokens, stop_token=None).result(10)
        py = []
        for _ in range(n):
            t = time.perf_counter()
            c.submit_request(prompt, max_tokens, stop_token=None).result(10)
            py.append((time.perf_counter() - t) * MS)

    async def http_loop():
        out, floor = [], []
        async with session() as s:
            url = cl.http_url + "/v1/completions"
            for _ in range(200):
                await http_plain(s, url, body)
            for _ in range(n):
                r = await http_plain(s, url, body)
                assert r.error is None, r.error
                out.append(r.e2e_s * MS)
            for _ in range(n):  # the HTTP stack alone: a 404 answered by the app, no broker involved
                t = time.perf_counter()
                async with s.get(cl.http_url + "/v1/nothing") as resp:
                    await resp.read()
                floor.append((time.perf_counter() - t) * MS)
        return out, floor

    http, floor = asyncio.run(http_loop())
    return {"requests": n, "client_p50_ms": percentile(py, 50), "client_p99_ms": percentile(py, 99),
            "http_p50_ms": percentile(http, 50), "http_p99_ms": percentile(http, 99),
            "http_stack_only_p50_ms": percentile(floor, 50),
            "added_p50_ms": percentile(http, 50) - percentile(py, 50),
            "added_p99_ms": percentile(http, 99) - percentile(py, 99)}


def bench_throughput(cl: LocalCluster, n: int, concurrency: int) -> dict:
    """Short non-streamed completions from ``concurrency`` connections, closed loop."""
    body = {"model": "simulated", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    pids = {"gateway": cl.gateway_process.pid, "broker": cl.broker_process.pid, "load generator": os.getpid()}
    pids.update({f"worker{i}": p.pid for i, p in enumerate(cl.worker_processes)})

    async def run(count: int) -> tuple[float, int]:
        left = count
        errors = 0
        async with session() as s:
            url = cl.http_url + "/v1/completions"

            async def conn():
                nonlocal left, errors
                while left > 0:
                    left -= 1
                    r = await http_plain(s, url, body)
                    errors += r.error is not None

            t0 = time.perf_counter()
            await asyncio.gather(*(conn() for _ in range(concurrency)))
            return time.perf_counter() - t0, errors

    asyncio.run(run(min(2000, n)))  # warm-up: connections, imports, caches
    load0 = load_avg()
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    wall, errors = asyncio.run(run(n))
    cpu = {k: (cpu_s(p) - cpu0[k]) / n * 1e6 for k, p in pids.items()}
    return {"requests": n, "concurrency": concurrency, "wall_s": wall, "requests_per_s": n / wall, "errors": errors,
            "cpu_us_per_request": cpu, "load_avg_before_after": [load0, load_avg()]}


# ---------------------------------------------------------------------- workloads


def simulated_work(n: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, 1000) for _ in range(rng.randrange(8, 33))], max_tokens) for _ in range(n)]


def he32_bodies(model: str, max_tokens: int) -> list[dict]:
    from slotserve.datasets import humaneval_rows

    return [{"model": model, "messages": row["messages"], "max_tokens": max_tokens, "temperature": 0.0,
             "stream": True} for row in humaneval_rows(32, max_tokens=max_tokens, chat=True)]


# ---------------------------------------------------------------------- report


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = res["sweep"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for via, style in (("http", "o-"), ("client", "s--")):
        rows = [r for r in sweeps if r["via"] == via and r["rate"] is not None]
        if not rows:
            continue
        xs = [r["rate"] for r in rows]
        for metric, ax in (("ttft", axes[0]), ("tpot", axes[1])):
            for q, alpha in (("p50", 1.0), ("p99", 0.5)):
                ax.plot(xs, [r[f"{metric}_{q}_ms"] for r in rows], style, alpha=alpha, label=f"{via} {q}")
        axes[2].plot(xs, [r["requests_per_s"] for r in rows], style, label=f"{via} throughput")
        axes[2].plot(xs, [r["goodput_requests_per_s"] for r in rows], style, alpha=0.5, label=f"{via} goodput")
    axes[0].set_title("TTFT vs request rate")
    axes[1].set_title("TPOT vs request rate")
    axes[2].set_title("throughput and goodput")
    for ax, ylabel in zip(axes, ("ms", "ms", "requests/s")):
        ax.set_xlabel("request rate (Poisson, requests/s)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    xs = sorted({r["rate"] for r in sweeps if r["rate"] is not None})
    axes[2].plot(xs, xs, "k:", lw=0.8)
    before, after = res["machine"]["load_avg_before_after"]
    fig.suptitle(f"bench/serve.py: {res['config']['model']} over HTTP (load average {before:.1f} -> {after:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(res: dict) -> None:
    m = res["machine"]
    print(f"\nbench/serve.py, {res['config']['model']}, on {m['cores']} CPUs (load average at start "
          f"{m['load_avg_before_after'][0]:.1f}, at end {m['load_avg_before_after'][1]:.1f})")
    print(f"{'via':<7} {'rate':>6} {'reqs':>5} {'err':>4} {'req/s':>7} {'tok/s':>8} {'goodput':>8} "
          f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99':>14} {'ITL p50/p99':>14} {'e2e p50/p99 ms':>17}")
    for r in res["sweep"]:
        rate = "burst" if r["rate"] is None else f"{r['rate']:g}"
        print(f"{r['via']:<7} {rate:>6} {r['requests']:>5} {r['errors']:>4} {r['requests_per_s']:>7.1f} "
              f"{r['output_tokens_per_s']:>8.0f} {r['goodput_requests_per_s']:>8.1f} "
              f"{fmt(r['ttft_p50_ms']):>8}/{fmt(r['ttft_p99_ms']):<8} {fmt(r['tpot_p50_ms'], '.2f'):>6}/"
              f"{fmt(r['tpot_p99_ms'], '.2f'):<7} {fmt(r['itl_p50_ms'], '.2f'):>6}/{fmt(r['itl_p99_ms'], '.2f'):<7} "
              f"{fmt(r['e2e_p50_ms']):>8}/{fmt(r['e2e_p99_ms']):<8}")
    slo = res["sweep"][0]["slo"]
    print(f"goodput: requests/s with TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms")
    lat, tp = res.get("added_latency"), res.get("throughput")
    if lat:
        ok = "yes" if lat["added_p50_ms"] <= 2.0 else "NO"
        print(f"added latency (zero-cost workers, one at a time, non-streamed): HTTP p50 {lat['http_p50_ms']:.3f} ms "
              f"vs Python client p50 {lat['client_p50_ms']:.3f} ms -> +{lat['added_p50_ms']:.3f} ms p50 "
              f"(+{lat['added_p99_ms']:.3f} ms p99); target <= 2 ms: {ok}")
        print(f"  of which the HTTP stack alone (a 404 round trip: aiohttp -> uvicorn -> Starlette): "
              f"p50 {lat['http_stack_only_p50_ms']:.3f} ms")
    if tp:
        ok = "yes" if tp["requests_per_s"] >= 1000 else "NO"
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in tp["cpu_us_per_request"].items())
        print(f"throughput (short non-streamed, {tp['concurrency']} connections): {tp['requests_per_s']:,.0f} "
              f"requests/s, {tp['errors']} errors; target >= 1,000: {ok}")
        print(f"  CPU us per request: {cpu} (load average {tp['load_avg_before_after'][0]:.1f} -> "
              f"{tp['load_avg_before_after'][1]:.1f})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="simulated", help="'simulated' (default) or e.g. smollm2-135m")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s (default: simulated "
                                                  "25,50,100,200; a real model 0.5,1,2)")
    ap.add_argument("--duration-s", type=float, default=8.0, help="simulated: arrivals per rate span this long")
    ap.add_argument("--burst", type=int, default=None, help="requests sent at once (default: simulated 256, "
                                                             "real models none)")
    ap.add_argument("--slots", type=int, default=None, help="slots per worker (simulated 64, real 8)")
    ap.add_argument("--step-delay-ms", type=float, default=5.0, help="simulated: cost of one iteration in the sweep")
    ap.add_argument("--max-tokens", type=int, default=None, help="simulated 32, real 128")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO (simulated 100, real 5000)")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO (simulated 20, real 250)")
    ap.add_argument("--throughput-requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64, help="connections in the throughput run")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke check)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the cluster
    sim = args.model == "simulated"
    rates = [float(x) for x in (args.rates or ("25,50,100,200" if sim else "0.5,1,2")).split(",")]
    burst = args.burst if args.burst is not None else (256 if sim else 0)
    slots = args.slots or (64 if sim else 8)
    max_tokens = args.max_tokens or (32 if sim else 128)
    slo_ttft = args.slo_ttft_ms or (100.0 if sim else 5000.0)
    slo_tpot = args.slo_tpot_ms or (20.0 if sim else 250.0)
    if args.quick:
        args.duration_s, burst, args.throughput_requests = 2.0, min(burst, 64), 3000
    machine = machine_record()
    res = {"config": {"model": args.model, "rates": rates, "burst": burst, "slots": slots, "max_tokens": max_tokens,
                      "step_delay_ms": args.step_delay_ms if sim else None}, "sweep": []}

    cl = start(args.model, 1, slots, args.step_delay_ms if sim else 0.0)
    try:
        plan = [(r, max(50, int(r * args.duration_s)) if sim else 32) for r in rates]
        if burst:
            plan.append((None, burst))
        for i, (rate, n) in enumerate(plan):
            load0 = load_avg()
            if sim:
                work = simulated_work(n, max_tokens, seed=i)
                bodies = [{"model": "simulated", "prompt": p, "max_tokens": m, "ignore_eos": True, "stream": True}
                          for p, m in work]
            else:
                bodies = he32_bodies(args.model, max_tokens)
            recs, wall = asyncio.run(http_rate(cl.http_url + "/v1/" + ("completions" if sim else "chat/completions"),
                                               bodies, rate, seed=100 + i))
            row = {"via": "http", "rate": rate, "load_avg_before_after": [load0, load_avg()],
                   **summarize(recs, wall, slo_ttft, slo_tpot)}
            res["sweep"].append(row)
            print(f"  http   rate {rate}: {row['requests']} requests, {row['errors']} errors, "
                  f"{row['requests_per_s']:.2f} req/s, TTFT p50 {fmt(row['ttft_p50_ms'])} ms "
                  f"(load average {load_avg():.1f})", flush=True)
            if sim:
                load0 = load_avg()
                recs, wall = client_rate(cl.frontend, "simulated", work, rate, seed=100 + i)
                row = {"via": "client", "rate": rate, "load_avg_before_after": [load0, load_avg()],
                       **summarize(recs, wall, slo_ttft, slo_tpot)}
                res["sweep"].append(row)
                print(f"  client rate {rate}: {row['requests_per_s']:.1f} req/s, TTFT p50 "
                      f"{fmt(row['ttft_p50_ms'])} ms", flush=True)
    finally:
        cl.stop()
    if sim:
        cl = start("simulated", 1, 64)
        try:
            res["added_latency"] = bench_added_latency(cl, 300 if args.quick else 2000)
            res["throughput"] = bench_throughput(cl, args.throughput_requests, args.concurrency)
        finally:
            cl.stop()
    stem = "serve" if sim else f"serve_{args.model.replace('/', '_')}"
    write_results(args.out / f"{stem}.json", res, machine)
    res = read_results(args.out / f"{stem}.json")  # with the machine record, as the table and plot show it
    print_table(res)
    plot(res, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")


if __name__ == "__main__":
    main()
