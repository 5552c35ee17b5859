"""Model load time: ``load_model`` from a GGUF file, directly and through transformers.

    python -m bench.load [--model gemma3-270m] [--repeats 2] [--paths direct,transformers]

Each load runs in a fresh Python process (imports included, as a worker
starts), timed from the process's start to ``load_model`` returning:

- ``direct``: ``load_model(name)``, slotserve's path for a GGUF of a served
  family (:func:`worker.models.checkpoint.read_gguf`: one header parse, each
  tensor dequantised once, the tokenizer from its cache next to the file);
- ``transformers``: the same model through transformers' loader
  (``checkpoint.load_pretrained``: ``from_pretrained(gguf_file=...)`` and
  ``AutoTokenizer``) into the same runner, the path a Gemma GGUF took before
  the direct read served it.

The first direct load of a file converts the tokenizer and keeps it; later
loads read the kept one (``--fresh-tokenizer`` deletes it first, to time a
first load). Reports the load average (``os.getloadavg``) before and after
each run, since the machine is shared. Prints a table; writes
bench/results/load.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, load_avg, machine_record, write_results

ROOT = Path(__file__).resolve().parent.parent

_CODE = {
    "direct": "from worker.models import load_model; m = load_model({name!r})",
    "transformers": ("from worker.models import ModelOptions, _load_through_transformers\n"
                     "from worker.models.heap import bound_onednn_caches\n"
                     "bound_onednn_caches(); o = ModelOptions(); d, p = o.resolve()\n"
                     "m = _load_through_transformers({name!r}, o, d, p, None)"),
}


def time_load(path: str, name: str) -> dict:
    """One load in a fresh process: ``{"path", "seconds", "runner", "load_avg_before_after"}``."""
    code = (f"import time; t = time.monotonic()\n{_CODE[path].format(name=name)}\n"
            "print('RESULT', type(m).__name__, time.monotonic() - t)")
    before = load_avg()
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.monotonic() - start
    runner = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("RESULT"))
    return {"path": path, "seconds": round(wall, 1), "runner": runner, "load_avg_before_after": [before, load_avg()]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m", help="alias or .gguf path (default gemma3-270m)")
    parser.add_argument("--repeats", type=int, default=2, help="loads per path (default 2)")
    parser.add_argument("--paths", default="direct,transformers", help="comma-separated: direct, transformers")
    parser.add_argument("--fresh-tokenizer", action="store_true", help="delete the kept tokenizer first")
    args = parser.parse_args(argv)
    machine = machine_record()
    from worker.models.checkpoint import resolve_model_path

    folder, gguf = resolve_model_path(args.model)
    if gguf is None:
        raise SystemExit(f"{args.model!r} is not a GGUF file")
    if args.fresh_tokenizer:
        import shutil

        for entry in Path(folder).glob(f"{gguf}.tokenizer-*"):
            shutil.rmtree(entry)
    rows = [time_load(path, args.model) for path in args.paths.split(",") for _ in range(args.repeats)]
    print(f"{'path':<14}{'seconds':>9}  {'runner':<12}{'load avg before/after':>22}")
    for r in rows:
        before, after = r["load_avg_before_after"]
        print(f"{r['path']:<14}{r['seconds']:>9}  {r['runner']:<12}{before:>12} / {after}")
    print(f"wrote {write_results(RESULTS / 'load.json', {'model': args.model, 'runs': rows}, machine)}")


if __name__ == "__main__":
    main()
