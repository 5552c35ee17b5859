"""Soak: 1,000,000 short requests through a broker; is its memory flat?

A local cluster (broker + zero-cost ``SimulatedLLM`` workers) serves
``--requests`` short requests (3-token prompt, ``max_tokens=2``) submitted
by one client in chunks of ``--chunk`` (each chunk drained before the
next). The broker's RSS (``psutil``) is sampled after every chunk, when the
broker is idle, and every 0.25 s by a thread. Target (issue 5): after
warm-up (the first ``--warmup`` chunks) the per-chunk RSS stays within 10 %
of its post-warm-up minimum (``range``, the strict reading). Also reported:
the ``trend``, the median of the last ten chunks over the median of the
first ten after warm-up, which separates growth (a leak) from the
allocator's ups and downs between chunks. Prints a table; writes
``bench/results/soak.json`` and ``bench/results/soak.png``.

    python -m bench.soak                       # 1,000,000 requests
    python -m bench.soak --requests 100000     # quicker
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil

from bench.common import ANY_PORT, RESULTS, machine_record, percentile, write_results
from broker import BrokerConfig
from client import Client
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=5_000, help="requests in flight at most (drained per chunk)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=20, help="chunks before the flatness check starts")
    args = ap.parse_args(argv)
    machine = machine_record()
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                        tuple(WorkerConfig(num_slots=args.slots) for _ in range(args.workers)))
    samples: list[tuple[float, int]] = []
    chunks: list[dict] = []
    with LocalCluster(cfg) as cl, Client(cl.frontend) as c:
        proc = psutil.Process(cl.broker_process.pid)
        stop = threading.Event()
        t0 = time.monotonic()

        def sampler():
            while not stop.wait(0.25):
                samples.append((time.monotonic() - t0, proc.memory_info().rss))

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        done = 0
        while done < args.requests:
            n = min(args.chunk, args.requests - done)
            ts = time.monotonic()
            for i in range(n):
                c.submit_request([(done + i) % 997 + 1, 2, 3], 2, stop_token=None)
            c.run(timeout=600)
            done += n
            rss = proc.memory_info().rss
            chunks.append({"requests": done, "t_s": time.monotonic() - t0, "rss_bytes": rss,
                           "req_per_s": n / (time.monotonic() - ts)})
            print(f"{done:>9,} requests  {chunks[-1]['req_per_s']:>8,.0f} req/s  broker RSS {rss / 2**20:7.1f} MiB",
                  flush=True)
        stop.set()
        th.join()
        st = c.status()
    wall = time.monotonic() - t0
    post = [ch["rss_bytes"] for ch in chunks[args.warmup:]] or [chunks[-1]["rss_bytes"]]
    growth = (max(post) - min(post)) / min(post)
    trend = percentile(post[-10:], 50) / percentile(post[:10], 50) - 1
    summary = {
        "requests": args.requests, "wall_s": wall, "req_per_s": args.requests / wall,
        "rss_first_chunk_mib": chunks[0]["rss_bytes"] / 2**20,
        "rss_after_warmup_min_mib": min(post) / 2**20, "rss_after_warmup_max_mib": max(post) / 2**20,
        "rss_final_mib": chunks[-1]["rss_bytes"] / 2**20, "growth_after_warmup": growth,
        "target_within_10pct": growth <= 0.10, "trend_last10_vs_first10": trend, "completed": st.counters["completed"],
        "errors": st.counters["errors"],
    }
    print()
    print(f"{'requests':<28}{args.requests:>14,}")
    print(f"{'wall time':<28}{wall:>13.1f}s")
    print(f"{'throughput':<28}{summary['req_per_s']:>10,.0f} req/s")
    print(f"{'broker RSS, first chunk':<28}{summary['rss_first_chunk_mib']:>10.1f} MiB")
    print(f"{'broker RSS after warm-up':<28}{summary['rss_after_warmup_min_mib']:>10.1f} .. "
          f"{summary['rss_after_warmup_max_mib']:.1f} MiB")
    print(f"{'growth after warm-up':<28}{growth * 100:>12.1f} %  (target <= 10 %: "
          f"{'met' if summary['target_within_10pct'] else 'MISSED'})")
    print(f"{'trend (last 10 vs first 10)':<28}{trend * 100:>12.1f} %  (median RSS after each chunk)")
    print(f"{'completed / errors':<28}{st.counters['completed']:>10,} / {st.counters['errors']}")
    write_results(RESULTS / "soak.json", {"summary": summary, "chunks": chunks, "samples": samples}, machine)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t for t, _ in samples], [r / 2**20 for _, r in samples], lw=0.8, label="every 0.25 s")
    ax.plot([ch["t_s"] for ch in chunks], [ch["rss_bytes"] / 2**20 for ch in chunks], "o", ms=3,
            label=f"after each {args.chunk:,}-request chunk")
    ax.set_xlabel("seconds")
    ax.set_ylabel("broker RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"soak: {args.requests:,} requests; after warm-up: range {growth * 100:.1f} %, "
                 f"trend {trend * 100:+.1f} %")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=120)


if __name__ == "__main__":
    main()
