"""The batch job behind ``slotserve run``: JSONL requests in, JSONL results out.

Input rows (one JSON object per line; blank lines skipped)::

    {"id": any, "prompt": [token ids] | "text" (or "messages": [chat messages]), "max_tokens": int,
     optional: any other field of protocol.request.RequestParams ("stop" for "stop_sequences")}

Output rows, written as requests finish (completion order; match on ``id``)::

    {"id", "tokens": generated ids only, "finish_reason",
     "usage": {"prompt_tokens", "completion_tokens"},
     "error": {"code", "message"} when there is one, "text" for text prompts}

A row that cannot be parsed or fails validation gets an error row (code
``bad_request``) and the job goes on.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from client import Client, RemoteError
from protocol.enums import ErrorCode, FinishReason
from protocol.request import RequestParams


@dataclass(frozen=True, slots=True)
class JobSummary:
    """What a job did. Latencies in milliseconds, measured by the client from
    submission; ``output_tokens_per_s`` = completion tokens / wall time."""

    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    p50_latency_ms: float | None
    p99_latency_ms: float | None
    p50_ttft_ms: float | None
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def format(self) -> str:
        """A small human-readable table."""
        def ms(v):
            return "-" if v is None else f"{v:.1f} ms"
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.finish_reasons.items()))
        rows = [
            ("requests", f"{self.requests} ({self.errors} errors)"),
            ("finish reasons", reasons or "-"),
            ("tokens", f"{self.prompt_tokens} prompt, {self.completion_tokens} completion"),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("output tokens/s", f"{self.output_tokens_per_s:,.0f}"),
            ("latency p50 / p99", f"{ms(self.p50_latency_ms)} / {ms(self.p99_latency_ms)}"),
            ("TTFT p50", ms(self.p50_ttft_ms)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of an ascending list, or None if empty."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


class _Job:
    def __init__(self, client: Client, out: TextIO, max_in_flight: int, bar) -> None:
        self.client = client
        self.out = out
        self.bar = bar
        self.window = threading.Semaphore(max_in_flight)
        self.lock = threading.Lock()          # guards rows, out, the counters
        self.rows: dict[int, tuple[Any, int]] = {}  # request id -> (row id, prompt tokens)
        self.handles: dict[int, Any] = {}
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.reasons: dict[str, int] = {}
        self.requests = self.errors = self.prompt_tokens = self.completion_tokens = 0

    def write(self, row: dict) -> None:  # under self.lock
        self.out.write(json.dumps(row) + "\n")
        self.requests += 1
        reason = row["finish_reason"]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if "error" in row:
            self.errors += 1
        self.prompt_tokens += row["usage"]["prompt_tokens"]
        self.completion_tokens += row["usage"]["completion_tokens"]
        if self.bar is not None:
            self.bar.update(1)

    def bad_row(self, row_id: Any, message: str) -> None:
        with self.lock:
            self.write({"id": row_id, "tokens": [], "finish_reason": FinishReason.ERROR.value,
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
                        "error": {"code": ErrorCode.BAD_REQUEST.value, "message": message}})

    def submit(self, n: int, line: str) -> None:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            self.bad_row(None, f"line {n}: not valid JSON ({e.msg})")
            return
        if not isinstance(row, dict):
            self.bad_row(None, f"line {n}: a row must be a JSON object")
            return
        row_id = row.get("id")
        try:  # every other key is a request parameter (unknown ones are refused: a typo cannot pass)
            params = RequestParams.from_mapping({k: v for k, v in row.items() if k != "id"})
        except ValueError as e:
            self.bad_row(row_id, f"line {n}: {e}")
            return
        self.window.acquire()
        try:
            with self.lock:
                self.handles[n] = self.client.submit(params, lambda seq, rid=n: self.done(rid), request_id=n)
                self.rows[n] = row_id
        except ValueError as e:
            self.window.release()
            self.bad_row(row_id, f"line {n}: {e}")

    def done(self, rid: int) -> None:
        """The request's callback (client callback thread)."""
        with self.lock:
            h = self.handles.pop(rid)
            row_id = self.rows.pop(rid)
            tokens = h.tokens
            out = {"id": row_id, "tokens": tokens, "finish_reason": h.finish_reason.value,
                   "usage": {"prompt_tokens": h.usage.prompt_tokens or 0, "completion_tokens": len(tokens)}}
            if h.text is not None:
                out["text"] = h.text
            err = h.error
            if err is not None:
                code = err.code.value if isinstance(err, RemoteError) else ErrorCode.INTERNAL.value
                out["error"] = {"code": code, "message": str(err)}
            if h.latency_s is not None:
                self.latencies.append(h.latency_s)
            if h.ttft_s is not None:
                self.ttfts.append(h.ttft_s)
            self.write(out)
        self.window.release()


def run_job(client: Client, inp: TextIO, out: TextIO, *, max_in_flight: int = 10_000, total: int | None = None,
            progress: bool = True, timeout_s: float | None = None) -> JobSummary:
    """Run every row of ``inp`` through ``client``; write result rows to ``out``.

    - ``max_in_flight``: requests submitted and not yet finished, at most
      (keeps the broker's queue bounded on a large file).
    - ``total``: rows expected (for the progress bar), if known.
    - ``progress``: show a tqdm progress bar on stderr.
    - ``timeout_s``: give up waiting after this many seconds (``TimeoutError``).

    Returns a :class:`JobSummary`. Bad rows become error rows; only a broken
    connection or the timeout raises.
    """
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="slotserve run", mininterval=0.25)
    job = _Job(client, out, max_in_flight, bar)
    t0 = time.monotonic()
    try:
        for n, line in enumerate(inp, start=1):
            if line.strip():
                job.submit(n, line)
        client.run(timeout=timeout_s)
    finally:
        if bar is not None:
            bar.close()
    wall = time.monotonic() - t0
    lat = sorted(job.latencies)
    ttft = sorted(job.ttfts)
    return JobSummary(
        requests=job.requests, errors=job.errors, prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens, wall_s=wall,
        p50_latency_ms=None if not lat else _percentile(lat, 50) * 1000,
        p99_latency_ms=None if not lat else _percentile(lat, 99) * 1000,
        p50_ttft_ms=None if not ttft else _percentile(ttft, 50) * 1000,
        finish_reasons=dict(job.reasons))
