"""The batch job behind ``slotserve run``: JSONL requests in, JSONL results out.

Input rows (one JSON object per line, UTF-8; a byte-order mark, CRLF line
ends and blank lines are fine)::

    {"id": any, "prompt": [token ids] | "text" (or "messages": [chat messages]), "max_tokens": int,
     optional: any other field of protocol.request.RequestParams}

``"stop"`` is OpenAI's: a string, or a list of text stop strings and/or
token-id lists (``"stop": ["\n\n", [13, 13]]``): strings are text stop strings
(the ``stop`` field), id lists are stop sequences (``stop_sequences``).

A row without an ``id`` (or with ``"id": null``) gets its line number (an
int, counting from 1, blank lines included) as its id. Ids are unique within
a job: a later row reusing an id gets an error row (``bad_request``, with
that id) and is not run. A line whose id cannot be read (see below) claims
no id: its error row carries its line number, and a row that names that
number as its own id still runs (the error row is told apart by its
``"error"``, as a refused duplicate's is).

Output rows, each written and flushed as its request ends (completion order;
match on ``id``)::

    {"id", "tokens": generated ids only, "finish_reason",
     "usage": {"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}},
     "stop_reason": the stop string, token or sequence that matched (finish_reason "stop"; a token
        only when the row named it in "stop_token": left out when the model's EOS ended it, as vLLM),
     "error": {"code", "message"} when there is one, "text" when the model has a tokenizer,
     "logprobs": [{"token": id, "logprob": x, "top_logprobs": [[id, x], ...]}, ...] when the row
     asked ("logprobs": N), one per generated token,
     "prompt_logprobs": [null, {...}, ...] when it asked ("prompt_logprobs": N), one per prompt token}

``cached_tokens`` (OpenAI's field): the prompt tokens the worker's prefix
cache gave instead of prefilling them (0 on a miss, without a prefix cache,
and for a request that ended before its prompt was prefilled).

Logprobs are natural logs of the model's raw distribution (see
:mod:`protocol.logprobs`); JSON has no ``-inf``, so a token of probability 0
shows as ``-9999.0``, as vLLM's OpenAI server does (``max(logprob, -9999.0)``).

A line that is not valid UTF-8 or JSON (or that Python's reader cannot read: nested
past its recursion limit, an integer past its digit limit), or a row that fails validation, gets
an error row (code ``bad_request``, with the line number as id when the row
gives none, or gives one that holds a number no JSON row can write back:
``NaN``, ``Infinity``, ``1e400``) and the job goes on. A job that is stopped
(a signal, a timeout) cancels what is in flight and still writes one row for
every row it submitted; rows after the last line read get none.

An output that cannot be written (a full disk, a closed pipe: ``slotserve run
... -o - | head``) stops the job the same way, at the first row that fails:
what is in flight is cancelled, no further line is read nor row written, and
the error is kept in :attr:`BatchJob.output_error` (``slotserve run`` exits 1
naming it).

A job given ``previous`` (``slotserve run --resume``: :func:`slotserve.resume.read_previous` of
its output, which it appends to) skips each input row whose id a row of the output answers, and
each line whose refusal row is there, writing nothing for them; every other row runs as above.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TextIO

from client import Client, RemoteError
from gateway.json_body import outer_kind
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import error_code
from protocol.json_numbers import first_nonfinite, loads as json_loads, nonfinite_words, path_text, syntax_problem
from protocol.logprobs import TokenLogprob
from protocol.request import RequestParams
from protocol.validation import clip
from slotserve.resume import Previous, id_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobSummary:
    """What a job did. Latencies in milliseconds, measured by the client from
    submission; ``output_tokens_per_s`` = completion tokens / wall time.
    ``stopped``: why the job ended before its input did (``"SIGTERM"``,
    ``"timeout after 30 s"``, ...), None when it ran to the end;
    ``lines_read``: input lines read (the last one when stopped early);
    ``cached_tokens``: prompt tokens the workers' prefix caches gave (the sum of the rows');
    ``already_done``, ``already_errors``: with ``--resume``, the rows the output held before this
    run (not run again), and how many of them ended ``error``; ``foreign_ids``: how many ids those
    rows answer that no line of the input has (a whole input read: the output was written for
    another input, or the input changed), ``foreign_example`` one of them (JSON); the other counts
    are this run's."""

    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    p50_latency_ms: float | None
    p99_latency_ms: float | None
    p50_ttft_ms: float | None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    stopped: str | None = None
    lines_read: int = 0
    cached_tokens: int = 0
    already_done: int = 0
    already_errors: int = 0
    foreign_ids: int = 0
    foreign_example: str | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def format(self) -> str:
        """A small human-readable table (durations in s or ms, whichever reads better: :func:`format_duration`)."""
        def ms(v):
            return "-" if v is None else format_duration(v / 1000)
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.finish_reasons.items()))
        rows = [("already done", f"{self.already_done} rows in the output before this run "
                                 f"({self.already_errors} errors): not run again")] if self.already_done else []
        rows += [
            ("requests", f"{self.requests} ({self.errors} errors)"),
            ("finish reasons", reasons or "-"),
            ("tokens", f"{self.prompt_tokens} prompt ({self.cached_tokens} cached), "
                       f"{self.completion_tokens} completion"),
            ("wall time", format_duration(self.wall_s)),
            ("output tokens/s", f"{self.output_tokens_per_s:,.0f}"),
            ("latency p50 / p99", f"{ms(self.p50_latency_ms)} / {ms(self.p99_latency_ms)}"),
            ("TTFT p50", ms(self.p50_ttft_ms)),
        ]
        if self.foreign_ids:
            rows.append(("not in the input", f"{self.foreign_ids} ids answered in the output before this run are on no "
                                              f"line of the input (id {self.foreign_example}): was the output written "
                                              "for another input? (their rows were kept; rows without an id match by "
                                              "line number, so only an unchanged input resumes right)"))
        if self.stopped is not None:
            rows.append(("stopped", f"{self.stopped}, after input line {self.lines_read}: unfinished requests "
                                    "were cancelled; later lines were not read"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_duration(seconds: float) -> str:
    """``seconds`` for people: ``41.1 s`` from 1 s on, ``12 ms`` from 10 ms, ``2.5 ms`` below
    (never ``41134.6 ms``, nor ``0.00 s`` for a short job)."""
    if seconds >= 0.9995:  # what would round to "1000 ms" is "1.0 s"
        return f"{seconds:.1f} s"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 9.95 else f"{ms:.1f} ms"


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of an ascending list, or None if empty."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


class BatchJob:
    """A batch job over one :class:`~client.Client`: rows are read and submitted
    on a feeder thread (at most ``max_in_flight`` unfinished at a time) and
    each result row is written to ``out`` and flushed as its request ends.

    - ``inp``: an iterable of text lines (an open file); read on the feeder
      thread, so a stalled pipe never blocks :meth:`stop`.
    - ``total``: rows expected, for the progress bar (tqdm on stderr when
      ``progress``).
    - ``on_finish``: called (from any thread) once :attr:`finished` turns
      true, and once the output fails (:attr:`output_error`), e.g. to wake
      a supervising loop (which then stops the job: :meth:`stop`).
    - ``close_input``: close ``inp`` once it is read to the end (or the job
      stopped reading it).
    - ``previous``: the rows ``out`` held before (``--resume``): the input
      rows they answer are skipped (:mod:`slotserve.resume`).

    Use :meth:`start`, then :meth:`wait` or :attr:`finished`; :meth:`stop`
    ends it early; :meth:`summary` at the end.
    """

    def __init__(self, client: Client, inp: Iterable[str], out: TextIO, *, max_in_flight: int = 10_000,
                 total: int | None = None, progress: bool = True,
                 on_finish: Callable[[], None] | None = None, close_input: bool = False,
                 previous: Previous | None = None) -> None:
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.client = client
        self.inp = inp
        self.out = out
        self.max_in_flight = max_in_flight
        self.on_finish = on_finish
        self.close_input = close_input
        self.previous = previous
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc="slotserve run", mininterval=0.25)
        self.cond = threading.Condition()  # guards everything below, and out
        self.rows: dict[int, Any] = {}     # request id (= line number) -> row id
        self.handles: dict[int, Any] = {}
        self.ids_seen: dict[str, int] = {}  # row id as canonical JSON -> its line
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.reasons: dict[str, int] = {}
        self.requests = self.errors = self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.lines_read = 0
        self.skipped = 0  # input rows answered by ``previous``: not run
        self.read_all = False
        self.stopped: str | None = None
        self.failure: BaseException | None = None
        self.output_error: OSError | None = None  # writing or flushing ``out`` failed: the job stops
        self._finished = False
        self._t0 = self._t1 = None
        self._feeder = threading.Thread(target=self._feed, name="slotserve-run-feeder", daemon=True)

    # ------------------------------------------------------------------ control

    def start(self) -> "BatchJob":
        self._t0 = time.monotonic()
        self._feeder.start()
        return self

    @property
    def finished(self) -> bool:
        """True once every row read has its result row, and reading ended
        (end of input, :meth:`stop`, or a failure recorded in :attr:`failure`)."""
        return self._finished

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until :attr:`finished`, the output fails (:attr:`output_error`: then
        :meth:`stop` the job) or ``timeout_s`` seconds pass; return :attr:`finished`."""
        with self.cond:
            self.cond.wait_for(lambda: self._finished or self.output_error is not None, timeout_s)
            return self._finished

    def stop(self, reason: str, drain_timeout_s: float = 5.0) -> None:
        """End the job early: read no further, cancel every request in flight,
        and wait up to ``drain_timeout_s`` seconds for their endings; a request
        whose ending has not come by then (a broker that is gone) gets its row
        now, as ``cancelled`` with the tokens received so far. Idempotent."""
        with self.cond:
            if self.stopped is None and not self._finished:
                self.stopped = reason
            rids = list(self.handles)
            self.cond.notify_all()
        for rid in rids:
            try:
                self.client.cancel(rid)
            except Exception:  # noqa: BLE001 -- a closed client: the rows are written below
                break
        with self.cond:
            self.cond.wait_for(lambda: not self.handles, drain_timeout_s)
            for rid in list(self.handles):
                self._write_result(rid, FinishReason.CANCELLED, None)
            self._check_finished()

    def summary(self) -> JobSummary:
        with self.cond:
            wall = (self._t1 or time.monotonic()) - (self._t0 or time.monotonic())
            lat = sorted(self.latencies)
            ttft = sorted(self.ttfts)
            return JobSummary(
                requests=self.requests, errors=self.errors, prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens, wall_s=wall,
                p50_latency_ms=None if not lat else _percentile(lat, 50) * 1000,
                p99_latency_ms=None if not lat else _percentile(lat, 99) * 1000,
                p50_ttft_ms=None if not ttft else _percentile(ttft, 50) * 1000,
                finish_reasons=dict(self.reasons), stopped=self.stopped, lines_read=self.lines_read,
                cached_tokens=self.cached_tokens,
                already_done=0 if self.previous is None else self.previous.rows,
                already_errors=0 if self.previous is None else self.previous.errors,
                **self._foreign())

    def _foreign(self) -> dict:  # under self.cond
        """``foreign_ids`` and ``foreign_example`` of :class:`JobSummary` (none while the input is not
        read to its end: its later lines may have them)."""
        if self.previous is None or self.stopped is not None or self.failure is not None or not self.read_all:
            return {}
        foreign = self.previous.done_ids - self.ids_seen.keys()
        return {"foreign_ids": len(foreign), "foreign_example": clip(min(foreign))} if foreign else {}

    def close(self) -> None:
        """Close the progress bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # ------------------------------------------------------------------ feeder thread

    def _feed(self) -> None:
        try:
            for n, line in enumerate(self.inp, start=1):
                with self.cond:
                    self.cond.wait_for(lambda: len(self.handles) < self.max_in_flight or self.stopped)
                    if self.stopped:
                        return
                    self.lines_read = n
                if line.strip():
                    self.submit(n, line)
        except BaseException as e:  # noqa: BLE001 -- reported by the caller (e.g. the client closed)
            log.error("the job stopped reading its input: %s: %s", type(e).__name__, e)
            with self.cond:
                self.failure = e  # what is in flight still ends and gets its row
        finally:
            if self.close_input:
                self.inp.close()
            with self.cond:
                self.read_all = True
                self._check_finished()

    def _check_finished(self) -> None:  # under self.cond
        if not self._finished and (self.read_all or self.stopped is not None) and not self.handles:
            self._finished = True
            self._t1 = time.monotonic()
            self.cond.notify_all()
            if self.on_finish is not None:
                self.on_finish()

    # ------------------------------------------------------------------ rows

    def write(self, row: dict) -> None:  # under self.cond
        if self.output_error is None:
            try:
                self.out.write(json.dumps(row) + "\n")
                self.out.flush()  # a row is on disk when its request ends, whatever happens to this process later
            except OSError as e:  # a full disk, a closed pipe: no row can be kept any more
                self._output_failed(e)
        self.requests += 1
        reason = row["finish_reason"]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if "error" in row:
            self.errors += 1
        self.prompt_tokens += row["usage"]["prompt_tokens"]
        self.cached_tokens += row["usage"]["prompt_tokens_details"]["cached_tokens"]
        self.completion_tokens += row["usage"]["completion_tokens"]
        if self.bar is not None:
            self.bar.update(1)

    def _output_failed(self, e: OSError) -> None:  # under self.cond
        """The output failed: stop the job (read no further; the caller cancels what is in flight,
        told through ``on_finish``), and write no more rows."""
        self.output_error = e
        log.error("cannot write the job's results (%s): stopping the job", e)
        if self.stopped is None and not self._finished:
            self.stopped = f"the output cannot be written ({e})"
        self.cond.notify_all()
        if self.on_finish is not None:
            self.on_finish()

    def bad_row(self, n: int, row_id: Any, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        """Write the error row of input line ``n`` (not once the job is stopped, nor when the
        output holds it from before: ``previous``)."""
        with self.cond:
            if self._refused_when_stopped(n):
                return
            if self.previous is not None and n in self.previous.refused_lines:
                self._skip()
                return
            self.write({"id": row_id, "tokens": [], "finish_reason": FinishReason.ERROR.value,
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0,
                                  "prompt_tokens_details": {"cached_tokens": 0}},
                        "error": {"code": code.value, "message": message}})

    def _refused_when_stopped(self, n: int) -> bool:  # under self.cond
        if self.stopped is None:
            return False
        self.lines_read = min(self.lines_read, n - 1)  # line n got no row
        return True

    def _skip(self) -> None:  # under self.cond
        self.skipped += 1
        if self.bar is not None:
            self.bar.update(1)

    def _claim_id(self, n: int, key: str) -> str | None:
        """Record the row id whose :func:`~slotserve.resume.id_key` is ``key`` as used by line
        ``n``; return why not when an earlier line used it."""
        with self.cond:
            first = self.ids_seen.setdefault(key, n)
        if first != n:
            return f"line {n}: duplicate id {key} (line {first} has it); ids must be unique within a job"
        return None

    def submit(self, n: int, line: str) -> None:
        if line.startswith("\ufeff"):  # a byte-order mark (e.g. files concatenated after the first)
            line = line[1:]
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes, kept as surrogates by the reader
            self.bad_row(n, n, f"line {n}: not valid UTF-8 (at character {e.start})")
            return
        try:
            row, _ = json_loads(line)  # (NaN, Infinity, 1e400: kept as written, for the words below)
        except json.JSONDecodeError as e:
            self.bad_row(n, n, f"line {n}: not valid JSON ({syntax_problem(e, one_line=True)})")
            return
        except ValueError:  # an integer past Python's digit limit for int(): the row, not the job
            self.bad_row(n, n, f"line {n}: it holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                               "which no field takes (token ids and counts are below 2**64)")
            return
        except RecursionError:  # (nested deeper than Python's recursion limit: the row, not the job)
            if outer_kind(line) is not None:  # (an array: no row's object to count levels in)
                self.bad_row(n, n, f"line {n}: a row must be a JSON object")
                return
            self.bad_row(n, n, f"line {n}: nested too deeply to read (over {sys.getrecursionlimit()} levels of "
                               "arrays or objects)")
            return
        if not isinstance(row, dict):
            self.bad_row(n, n, f"line {n}: a row must be a JSON object")
            return
        row_id = row.get("id")
        if row_id is None:
            row_id = n
        unwritable = first_nonfinite(row_id)  # (its result row, which echoes it, would be no JSON)
        if unwritable is not None:
            self.bad_row(n, n, f"line {n}: {nonfinite_words(path_text('id', unwritable[0]), unwritable[1])}")
            return
        key = id_key(row_id)
        duplicate = self._claim_id(n, key)
        if duplicate is not None:
            self.bad_row(n, row_id, duplicate)
            return
        if self.previous is not None and key in self.previous.done_ids:  # (claimed first: a later reuse is refused)
            with self.cond:
                if not self._refused_when_stopped(n):
                    self._skip()
            return
        try:  # every other key is a request parameter (unknown ones are refused: a typo cannot pass)
            params = RequestParams.from_mapping({k: v for k, v in row.items() if k != "id"})
        except ValueError as e:
            self.bad_row(n, row_id, f"line {n}: {e}")
            return
        try:
            with self.cond:
                if self._refused_when_stopped(n):
                    return
                self.handles[n] = self.client.submit(params, lambda seq, rid=n: self.done(rid), request_id=n)
                self.rows[n] = row_id
        except ValueError as e:  # (e.g. UnsupportedError: text for a model without a tokenizer)
            self.bad_row(n, row_id, f"line {n}: {e}", error_code(e, ErrorCode.BAD_REQUEST))

    def done(self, rid: int) -> None:
        """The request's callback (client callback thread)."""
        with self.cond:
            h = self.handles.get(rid)
            if h is None:
                return  # its row was written already (stop() gave up waiting for it)
            err = h.error
            if h.latency_s is not None:
                self.latencies.append(h.latency_s)
            if h.ttft_s is not None:
                self.ttfts.append(h.ttft_s)
            self._write_result(rid, h.finish_reason, err)
            self._check_finished()

    def _write_result(self, rid: int, reason: FinishReason, err: BaseException | None) -> None:  # under self.cond
        h = self.handles.pop(rid)
        row_id = self.rows.pop(rid)
        tokens = h.tokens
        out = {"id": row_id, "tokens": tokens, "finish_reason": reason.value,
               "usage": {"prompt_tokens": h.prompt_tokens or 0, "completion_tokens": len(tokens),
                         "prompt_tokens_details": {"cached_tokens": h.cached_tokens or 0}}}
        if h.text is not None:
            out["text"] = h.text
        if h.stop_reason is not None:
            out["stop_reason"] = h.stop_reason
        if h.logprobs is not None:
            out["logprobs"] = [_scored(t, e) for t, e in zip(tokens, h.logprobs)]
        if h.prompt_logprobs is not None:
            prompt = h.prompt
            if prompt is not None and len(prompt) == len(h.prompt_logprobs):
                out["prompt_logprobs"] = [None if e is None else _scored(t, e)
                                          for t, e in zip(prompt, h.prompt_logprobs)]
        if err is not None:  # (a RemoteError's str() is "code: message": the code is its own key here)
            remote = isinstance(err, RemoteError)
            out["error"] = {"code": err.code.value if remote else ErrorCode.INTERNAL.value,
                            "message": err.message if remote else str(err)}
        self.write(out)
        self.cond.notify_all()  # room in the window


JSON_MIN_LOGPROB = -9999.0
"""What a logprob of ``-inf`` (probability 0) is written as: JSON has no infinity (vLLM's value)."""


def _scored(token: int, e: TokenLogprob) -> dict:
    """One token's logprob entry as a row shows it."""
    return {"token": token, "logprob": max(e.logprob, JSON_MIN_LOGPROB),
            "top_logprobs": [[i, max(x, JSON_MIN_LOGPROB)] for i, x in e.top]}


def open_input(path: str) -> io.TextIOWrapper:
    """Open a job's input file (``"-"``: standard input) as text lines.

    UTF-8, a leading byte-order mark skipped (``utf-8-sig``); bytes that are
    not UTF-8 are kept as lone surrogates (``surrogateescape``), so such a
    line becomes one error row and the job goes on. The text layer sits on
    an unbuffered file: a reader blocked on a stalled pipe then holds no
    buffer lock, which would abort the interpreter's shutdown ("could not
    acquire lock for <stdin> at interpreter shutdown") when the job is
    stopped meanwhile. Raises OSError when the file cannot be opened.
    """
    raw = io.FileIO(sys.stdin.fileno() if path == "-" else path, "rb", closefd=path != "-")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape")


def run_job(client: Client, inp: Iterable[str], out: TextIO, *, max_in_flight: int = 10_000,
            total: int | None = None, progress: bool = True, timeout_s: float | None = None,
            previous: Previous | None = None) -> JobSummary:
    """Run every row of ``inp`` through ``client``; write result rows to ``out``.

    - ``max_in_flight``: requests submitted and not yet finished, at most
      (keeps the broker's queue bounded on a large file).
    - ``total``: rows expected (for the progress bar), if known.
    - ``progress``: show a tqdm progress bar on stderr.
    - ``timeout_s``: stop the job after this many seconds: what is in flight
      is cancelled and the summary's ``stopped`` says so.
    - ``previous``: what ``out`` held before, for a resumed job (``out`` is
      then open for appending): :func:`slotserve.resume.read_previous`.

    Returns a :class:`JobSummary`. Bad rows become error rows. Raises
    ValueError for a bad ``max_in_flight``; a failure to read ``inp`` or to
    submit (a closed client) is re-raised after the rows in flight ended;
    a failure to write ``out`` (OSError) stops the job (what is in flight is
    cancelled) and is re-raised.
    """
    job = BatchJob(client, inp, out, max_in_flight=max_in_flight, total=total, progress=progress,
                   previous=previous)
    try:
        job.start()
        finished = job.wait(timeout_s)
        if job.output_error is not None:
            job.stop(job.stopped or "the output cannot be written")
        elif not finished:
            job.stop(f"timeout after {timeout_s:g} s")
    finally:
        job.close()
    if job.output_error is not None:
        raise job.output_error
    if job.failure is not None:
        raise job.failure
    return job.summary()
