"""What the gateway's tokenizer (logprobs' token strings, echo, /tokenize) costs at start.

    python -m bench.gateway_tokenizer [--rounds N] [--up]

Prints the numbers and saves bench/results/gateway_tokenizer.json.

The gateway loads its tokenizer on a thread after it binds (gateway.tokenizer,
slotserve/tokenizer.py: transformers' import and SmolLM2's GGUF vocabulary),
so the server should listen as soon as without one. Measured:

- ``serve``: ``slotserve serve --port 0`` (no broker needed) from the command's
  start to its banner (the socket listens), without a tokenizer and with
  ``--tokenizer smollm2-135m``, alternated, ``--rounds`` each;
- ``--up`` also: ``slotserve up --model smollm2-135m --workers 1 --http-port 0``
  from the command's start to its banner, to ``/health`` 200, to the first
  ``/tokenize`` 200 (the tokenizer loaded) and to lm-eval's loglikelihood body
  answered (``max_tokens`` 1, ``logprobs`` 1, ``echo``).

Wall seconds; the machine's load average is saved with them (on a shared
2-core machine it dominates every number).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from bench.common import RESULTS, machine_record, read_results, write_results

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def serve_banner_s(extra: list[str]) -> float:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "slotserve", "serve", "--broker", "tcp://127.0.0.1:1", "--port", "0",
                          *extra], stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in p.stderr:
            if "slotserve serve:" in line:
                return time.monotonic() - t0
        raise RuntimeError("slotserve serve exited before its banner")
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)


def up_times() -> dict:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "slotserve", "up", "--model", "smollm2-135m", "--workers", "1",
                          "--slots", "2", "--http-port", "0", "--frontend", "tcp://127.0.0.1:57555",
                          "--backend", "tcp://127.0.0.1:57556"], stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"HTTP on (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("slotserve up exited before its banner")
        out = {"banner_s": time.monotonic() - t0}
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.05)
        out["health_s"] = time.monotonic() - t0
        while httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=60).status_code != 200:
            time.sleep(0.05)
        out["tokenize_s"] = time.monotonic() - t0
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 1, "logprobs": 1,
            "echo": True, "temperature": 0})
        r.raise_for_status()
        out["first_echo_logprobs_s"] = time.monotonic() - t0
        return {k: round(v, 2) for k, v in out.items()}
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--up", action="store_true", help="also time slotserve up end to end")
    args = ap.parse_args(argv)
    machine = machine_record()
    out = {"serve_banner_s": {"no_tokenizer": [], "tokenizer": []}}
    for _ in range(args.rounds):
        out["serve_banner_s"]["no_tokenizer"].append(round(serve_banner_s([]), 2))
        out["serve_banner_s"]["tokenizer"].append(round(serve_banner_s(["--tokenizer", "smollm2-135m"]), 2))
    if args.up:
        out["up"] = [up_times() for _ in range(args.rounds)]
    path = write_results(RESULTS / "gateway_tokenizer.json", out, machine)
    print(json.dumps(read_results(path), indent=2))


if __name__ == "__main__":
    main()
