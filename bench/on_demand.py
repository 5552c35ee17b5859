"""bench/on_demand.py -- several models behind one broker, loaded on demand (issue 34 item 1).

Two measurements, each through a :class:`slotserve.launcher.LocalCluster` whose
models are all on demand (``ClusterConfig.on_demand``) and whose supervisor runs
as in ``slotserve up`` (:meth:`LocalCluster.supervise` on a thread):

- ``--models A,B --rounds N`` (default SmolLM2-135M and Qwen2.5-Coder-0.5B,
  ``--max-loaded-models 1``): requests alternate between the models, one at a
  time, a short chat each (greedy, 16 tokens): every request for the model
  that is not loaded waits for it -- the old one unloaded, the new one loaded
  and warmed up -- so its time to first token is load + warm-up + TTFT; the
  next request for the same model (sent right after) is a warm one's TTFT.
  Per request: model, cold or warm, TTFT and end-to-end seconds, finish
  reason. The issue's target: alternating requests all served, none lost or
  refused; the cold TTFT measured and reported.
- ``--soak N``: N load/unload cycles of two simulated models (load costs
  nothing, so only the supervisor's, broker's and client's own memory is
  left to grow), the RSS of this process (launcher + supervisor + client) and
  of the broker process every 10 cycles: the issue's "RSS flat over 50
  load/unload cycles".

Prints a table and writes ``bench/results/on_demand.json`` (``on_demand_soak.json``).

    python -m bench.on_demand                          # SmolLM2 + Qwen 0.5B, 3 rounds
    python -m bench.on_demand --soak 50
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time

from bench.common import ANY_PORT, RESULTS, load_avg, machine_record, write_results
from broker import BrokerConfig
from client import Client
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig
from worker.models import ModelOptions


@contextlib.contextmanager
def supervised(cfg: ClusterConfig, names):
    """``(cluster, clients)`` for the ``with`` block: the cluster started, its supervisor running on a
    thread (as ``up``'s), and a client per model of ``names``; all stopped on the way out."""
    cluster = LocalCluster(cfg)
    cluster.start()
    stop = threading.Event()
    thread = threading.Thread(target=cluster.supervise, args=(stop.is_set,), daemon=True)
    thread.start()
    clients = {}
    try:
        clients = {n: Client(cluster.frontend, model=n, connect_timeout_s=30) for n in names}
        yield cluster, clients
    finally:
        for c in clients.values():
            c.close()
        stop.set()
        thread.join(60)
        cluster.stop()


def alternate(models: list[str], rounds: int, threads: int, max_tokens: int) -> list[dict]:
    configs = tuple(WorkerConfig(model=m, num_slots=2, model_options=ModelOptions(num_threads=threads))
                    for m in models)
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT), workers=(), on_demand=configs,
                        max_loaded_models=1, idle_unload_s=0.0)
    rows = []
    with supervised(cfg, [c.served_names[0] for c in configs]) as (cluster, clients):
        for r in range(rounds):
            for name, client in clients.items():
                for kind in ("cold", "warm"):
                    t0 = time.monotonic()
                    h = client.submit_request([{"role": "user", "content": f"Write a haiku about the number {r}."}],
                                              max_tokens, temperature=0.0, timeout_s=600)
                    h.result(timeout=900)
                    row = {"round": r, "model": name, "kind": kind, "finish_reason": str(h.finish_reason.value),
                           "tokens": len(h.tokens), "ttft_s": round(h.ttft_s, 3) if h.ttft_s is not None else None,
                           "latency_s": round(time.monotonic() - t0, 3)}
                    rows.append(row)
                    print(f"round {r} {name:<22} {kind:<4} ttft {row['ttft_s']:>7} s  latency {row['latency_s']:>7} s"
                          f"  {row['finish_reason']} ({row['tokens']} tokens)", flush=True)
    return rows


def soak(cycles: int) -> list[dict]:
    import psutil

    names = ("soak-a", "soak-b")
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,), num_slots=2, warmup=False) for n in names)
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.2),
                        workers=(), on_demand=configs, max_loaded_models=1, idle_unload_s=0.0)
    me, samples = psutil.Process(), []
    with supervised(cfg, names) as (cluster, clients):
        for cycle in range(cycles + 1):
            for n in names:  # each request makes its model load and the other unload
                h = clients[n].submit_request([1, 2, 3], 4)
                h.result(timeout=120)
                assert h.finish_reason.value == "length", h.finish_reason
            if cycle % 10 == 0:
                broker = psutil.Process(cluster.broker_process.pid)
                samples.append({"cycle": cycle, "launcher_rss_mib": round(me.memory_info().rss / 2**20, 1),
                                "broker_rss_mib": round(broker.memory_info().rss / 2**20, 1)})
                print(samples[-1], flush=True)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--soak", type=int, default=0, help="instead: this many load/unload cycles of simulated models")
    args = ap.parse_args()
    machine = machine_record()
    if args.soak:
        samples = soak(args.soak)
        out = write_results(RESULTS / "on_demand_soak.json", {"cycles": args.soak, "samples": samples}, machine)
    else:
        rows = alternate(args.models.split(","), args.rounds, args.threads, args.max_tokens)
        summary = {}
        for name in args.models.split(","):
            for kind in ("cold", "warm"):
                ttfts = sorted(r["ttft_s"] for r in rows if r["model"] == name and r["kind"] == kind)
                summary[f"{name} {kind}"] = {"ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
                                             "n": len(ttfts)}
        served = sum(r["finish_reason"] in ("stop", "length") for r in rows)
        print(f"{served} of {len(rows)} requests served (load {load_avg():.1f})")
        for k, v in summary.items():
            print(f"  {k:<30} TTFT median {v['ttft_median_s']} s over {v['n']}")
        out = write_results(RESULTS / "on_demand.json", {"models": args.models.split(","), "rounds": args.rounds,
                                                         "threads": args.threads, "served": served,
                                                         "requests": len(rows), "summary": summary, "rows": rows},
                            machine)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
