"""bench/rss.py -- peak resident memory of processes while a benchmark block runs (bench/model.py, bench/prefix.py)."""

from __future__ import annotations

import threading

import psutil


class RssPeak:
    """Peak RSS (MiB) of processes while the ``with`` block runs, sampled every ``interval_s``;
    ``before_mb`` each one's RSS at entry. A sampler: a spike shorter than the interval can be missed."""

    def __init__(self, pids: list[int], interval_s: float = 0.05) -> None:
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
