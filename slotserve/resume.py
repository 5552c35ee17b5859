"""``slotserve run --resume``: what an earlier run of the same job left in its output.

A job killed or stopped part-way (SIGKILL, a crash, a reboot, Ctrl-C, ``--timeout-s``) leaves
in OUT.jsonl one complete row per request that ended before it stopped (each row is flushed as its
request ends), ``cancelled`` rows for what a clean stop cancelled, and, after a kill, maybe a last
line cut off mid-write. :func:`read_previous` reads that file, decides per row whether it stands
or is run again, and makes the file hold only the rows that stand; the job then skips the input
rows they answer (:class:`~slotserve.job.BatchJob`'s ``previous``) and appends the others.

Which rows stand (their input rows are not run again):

- every row that ended by the request's own rules: ``stop``, ``length``, ``deadline`` (the row's
  own ``timeout_s``; delete such a row from the file to run it again);
- a row refused for what it holds, which would be refused again: an ``error`` whose code is in
  :data:`KEPT_ERRORS` (``bad_request``, ``context_length_exceeded``, ``unsupported``,
  ``too_large``).

Run again (their rows removed from the file first): ``cancelled`` rows (the stop cancelled them)
and every other ``error`` -- ``worker_failed``, ``model_error``, ``queue_full``,
``slow_consumer``, ``client_silent``, ``broker_unavailable``, ``internal`` and any code not
named above: a failure of the cluster or of the run, not of the row.

Rows are matched to input rows by id (:func:`id_key`: a row without ``"id"`` has its line number,
so IN.jsonl must be unchanged between the runs). A row the job refused before submitting it (a
line that is not JSON, a duplicate id, a row that fails validation) names its input line in its
message (``"line 7: ..."``) and may carry another row's id (a duplicate's) or a line number that
another row names as its id: such a row answers that line, not that id
(:attr:`Previous.refused_lines`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from protocol.enums import ErrorCode, FinishReason
from slotserve.output_lock import OutputLock, lock_fd

KEPT_ERRORS = frozenset({ErrorCode.BAD_REQUEST.value, ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
                         ErrorCode.UNSUPPORTED.value, ErrorCode.TOO_LARGE.value})
"""Error codes of rows that stand on ``--resume``: the row itself was refused, and would be again."""

_REFUSED_LINE = re.compile(r"line ([1-9][0-9]*): ")  # how the job's own refusals begin (BatchJob.bad_row)


def id_key(row_id: Any) -> str:
    """A row id as one string (canonical JSON: keys sorted), so equal ids compare equal however
    an object's keys were ordered: the key of :meth:`BatchJob._claim_id` and of ``--resume``."""
    return json.dumps(row_id, sort_keys=True)


@dataclass(frozen=True, slots=True)
class CutLine:
    """The last line of the output, cut off mid-write (removed): its ``line`` number (from 1), its
    ``size`` in bytes, and ``why`` (``"no line end"``, ``"not JSON"``)."""

    line: int
    size: int
    why: str


@dataclass(frozen=True, slots=True)
class Previous:
    """What the output held before this run, once :func:`read_previous` made it hold only the rows
    that stand.

    - ``done_ids``: :func:`id_key` of each id answered by a row that stands (the input rows with
      those ids are skipped);
    - ``refused_lines``: input line numbers whose refusal row stands (the job writes no second one);
    - ``rows``, ``errors``: rows that stand, and how many of them ended ``error``;
    - ``again``: rows removed to run again, by ``"cancelled"`` or error code;
    - ``cut``: the last line cut off mid-write and removed, if there was one.
    """

    done_ids: frozenset[str] = frozenset()
    refused_lines: frozenset[int] = frozenset()
    rows: int = 0
    errors: int = 0
    again: dict[str, int] = field(default_factory=dict)
    cut: CutLine | None = None


class NotResultRows(ValueError):
    """The output holds a line that is not a result row of ``slotserve run`` (other than a cut last
    line): it is no job's output, or was edited; nothing was changed."""


def read_previous(path: str, lock: OutputLock | None = None) -> Previous | None:
    """Read the output ``path`` of an earlier run of the job; remove from it a last line cut off
    mid-write (the file is truncated back to the last complete row) and the rows that run again
    (the file is rewritten without them: a temporary file beside it, fsynced, then renamed over it,
    keeping its permissions; a link is followed). Return None when ``path`` does not exist (the
    job starts afresh). ``lock``: the run's lock of ``path`` (:mod:`slotserve.output_lock`), which
    then holds the rewritten file (locked before it is renamed over the old one, so that no other
    run can take it between).

    Raises :class:`NotResultRows` (a ValueError) when a line other than the last is not a result
    row (JSON with ``"id"`` and ``"finish_reason"``), or the last is JSON but no such row; a
    ValueError when ``path`` is not a regular file; OSError when it cannot be read or rewritten.
    The file is left as it was when anything is raised before the rename.
    """
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file: --resume reads and rewrites it")
    with open(real, "rb") as f:
        scan = _scan(f, path)
    if scan.drop:
        _rewrite(real, scan.drop, scan.complete_lines, stat.S_IMODE(st.st_mode), lock)
    elif scan.cut is not None:
        os.truncate(real, scan.complete_bytes)
    return Previous(done_ids=frozenset(scan.done_ids), refused_lines=frozenset(scan.refused_lines),
                    rows=scan.rows, errors=scan.errors, again=dict(scan.again), cut=scan.cut)


@dataclass(slots=True)
class _Scan:
    done_ids: set[str] = field(default_factory=set)
    refused_lines: set[int] = field(default_factory=set)
    drop: set[int] = field(default_factory=set)  # line numbers of rows that run again
    again: Counter = field(default_factory=Counter)
    rows: int = 0
    errors: int = 0
    complete_lines: int = 0  # lines before the cut one (all of them when none is cut)
    complete_bytes: int = 0
    cut: CutLine | None = None


def _scan(f: BinaryIO, path: str) -> _Scan:
    scan = _Scan()
    unreadable: tuple[int, int, str] | None = None  # (line, size, why): only the last line may be
    n = 0
    for n, raw in enumerate(f, start=1):
        if unreadable is not None:
            raise NotResultRows(f"line {unreadable[0]} of {path} is {unreadable[2]}, and lines follow it: only the "
                                "last line can be cut off by a kill; --resume changed nothing")
        if not raw.endswith(b"\n"):
            unreadable = (n, len(raw), "no line end")
            break  # (the last line: nothing follows)
        if not raw.strip():  # a blank line: kept as it is
            scan.complete_lines, scan.complete_bytes = n, scan.complete_bytes + len(raw)
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            unreadable = (n, len(raw), "not JSON")
            continue
        _classify(scan, n, row, path)
        scan.complete_lines, scan.complete_bytes = n, scan.complete_bytes + len(raw)
    if unreadable is not None:
        scan.cut = CutLine(*unreadable)
    return scan


def _classify(scan: _Scan, n: int, row: Any, path: str) -> None:
    """Count line ``n``'s ``row``: it stands (its id done, or its refused line) or runs again."""
    reason = row.get("finish_reason") if isinstance(row, dict) and "id" in row else None
    error = row.get("error") if reason == FinishReason.ERROR.value else None
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(reason, str) or (reason == FinishReason.ERROR.value and not isinstance(code, str)):
        raise NotResultRows(f"line {n} of {path} is not a result row of slotserve run (a JSON object with \"id\" "
                            "and \"finish_reason\", and \"error\": {\"code\", ...} when that is \"error\"); is -o "
                            "this job's output? --resume changed nothing")
    if reason == FinishReason.CANCELLED.value or (code is not None and code not in KEPT_ERRORS):
        scan.drop.add(n)
        scan.again[code or reason] += 1
        return
    scan.rows += 1
    if code is None:
        scan.done_ids.add(id_key(row["id"]))
        return
    scan.errors += 1
    message = error.get("message")
    refused = _REFUSED_LINE.match(message) if isinstance(message, str) else None
    if refused is not None:
        scan.refused_lines.add(int(refused.group(1)))
    else:  # refused by the worker or broker: it answers its id
        scan.done_ids.add(id_key(row["id"]))


def _rewrite(real: str, drop: set[int], lines: int, mode: int, lock: OutputLock | None) -> None:
    """Rewrite ``real`` with its first ``lines`` lines but those in ``drop``, atomically: written to
    a temporary file in the same folder (so the rename stays on one file system), fsynced, given
    ``mode``, renamed over ``real``, and the folder fsynced so the rename is on disk too. The new
    file is locked before the rename and ``lock`` holds it after (:meth:`OutputLock.moved`)."""
    folder, name = os.path.split(real)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".resume.tmp")
    lock_fd(fd)  # (a file no one else has open: taken at once)
    held = os.dup(fd)  # (the lock lives while one descriptor of it is open)
    try:
        with os.fdopen(fd, "wb") as dst, open(real, "rb") as src:
            for n, raw in enumerate(src, start=1):
                if n > lines:
                    break
                if n not in drop:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        os.close(held)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if lock is not None:
        lock.moved(held)
    else:
        os.close(held)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
