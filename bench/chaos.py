"""Chaos, longer than the CI test: many requests, workers SIGKILLed and
replaced every second, the broker SIGKILLed and restarted several times.

Every request must end exactly once with exactly the tokens of a fault-free
in-process run (``tests/support/chaos.py`` holds the driver shared with
``tests/cluster/test_chaos.py``). Prints a summary table per run; writes
``bench/results/chaos.json``.

    python bench/chaos.py                     # 20,000 requests, 3 broker kills
    python bench/chaos.py --runs 5 --requests 4000 --broker-kills 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # don't shadow the broker package
sys.path.insert(0, str(_HERE.parent))  # the repo root: the tests package and its support modules

from tests.support.chaos import ChaosConfig, fault_free, make_requests, run_chaos  # noqa: E402

RESULTS = _HERE / "results"
COLUMNS = ("requests", "completed_once", "mismatches", "duplicate_callbacks", "missing", "stream_errors",
           "worker_kills", "broker_kills", "migrations", "resubmissions", "wall_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--step-delay-ms", type=float, default=3.0)
    ap.add_argument("--broker-kills", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    cfg = ChaosConfig(requests=args.requests, workers=args.workers, slots=args.slots,
                      step_delay_ms=args.step_delay_ms, broker_kills=args.broker_kills, timeout_s=900.0)
    expected = fault_free(make_requests(cfg.requests, cfg.seed))
    runs = []
    print(" ".join(f"{c:>14}" for c in ("run",) + COLUMNS))
    for r in range(args.runs):
        res = run_chaos(cfg, expected)
        d = res.as_dict()
        runs.append(d)
        print(" ".join([f"{r + 1:>14}"] + [f"{d[c]:>14.1f}" if c == "wall_s" else f"{d[c]:>14}"
                                           for c in COLUMNS]), flush=True)
        for note in res.notes:
            print("   ", note)
    ok = all(d["completed_once"] == d["requests"] and d["mismatches"] == 0 and d["missing"] == 0
             and d["duplicate_callbacks"] == 0 and d["stream_errors"] == 0 for d in runs)
    print(f"\nall runs: every request exactly once with the fault-free tokens: {'yes' if ok else 'NO'}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps({"config": cfg.__dict__, "runs": runs, "ok": ok,
                                                    "machine": platform.platform()}, indent=1))


if __name__ == "__main__":
    main()
