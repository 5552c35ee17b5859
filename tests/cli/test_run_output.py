"""Blast radius, kind "the output of `slotserve run` (and `humaneval`)": whatever -o is, the job
ends promptly with a clear word, and the input is never harmed. Members: an
output that fails while the job runs (a closed pipe, `-o - | head`; a full
disk, /dev/full; a write error in the programmatic run_job), which stopped
nothing and hung the job forever with a traceback (the row's callback raised,
so the job never finished); and -o naming the input file itself (or a link
to it), which emptied the input before a row was read and exited 0."""

from __future__ import annotations

import fcntl
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from client import Client
from slotserve.job import BatchJob, run_job
from tests.support.cluster import ThreadCluster
from tests.support.waits import wait_until

SLOTSERVE = [sys.executable, "-m", "slotserve"]


def rows(n: int, max_tokens: int = 4) -> str:
    return "".join(json.dumps({"prompt": [i % 900 + 1, 2], "max_tokens": max_tokens}) + "\n" for i in range(n))


@pytest.fixture(scope="module")
def frontend():
    """A broker and one worker on threads of this process, 2 ms per iteration."""
    with ThreadCluster() as cluster:
        cluster.add_worker(num_slots=4, step_delay_ms=2)
        yield cluster.frontend


class FailingOutput(io.StringIO):
    """An output whose ``fail_at``-th write raises ``error`` (and every later one: a closed pipe stays closed)."""

    def __init__(self, fail_at: int, error: OSError) -> None:
        super().__init__()
        self.fail_at, self.error, self.writes = fail_at, error, 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes >= self.fail_at:
            raise self.error
        return super().write(text)


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), OSError(28, "No space left on device")],
                         ids=["broken-pipe", "disk-full"])
def test_run_job_stops_and_raises_when_its_output_fails(frontend, error):
    """Two short rows are written, the third fails; the long rows in flight (100,000 tokens: minutes
    at 2 ms an iteration) are cancelled at once, not left running on the broker."""
    long = "".join(json.dumps({"prompt": [i + 1], "max_tokens": 100_000, "stop_token": None}) + "\n"
                   for i in range(6))
    out = FailingOutput(3, error)
    with Client(frontend, connect_timeout_s=20) as client:
        client.wait_for_model(20)
        with pytest.raises(OSError) as raised:
            run_job(client, io.StringIO(rows(3, max_tokens=1) + long), out, progress=False, timeout_s=60)
        assert raised.value is error
        wait_until(lambda: client.status().models["simulated"].running == 0, 20,
                   "the job's requests to end after its output failed", pause_s=0.05)
    assert [json.loads(line)["finish_reason"] for line in out.getvalue().splitlines()] == ["length"] * 2


def test_a_job_whose_output_fails_finishes_and_reads_no_further(frontend):
    out = FailingOutput(1, BrokenPipeError(32, "Broken pipe"))
    woken = threading.Event()
    with Client(frontend, connect_timeout_s=20) as client:
        client.wait_for_model(20)
        job = BatchJob(client, io.StringIO(rows(2000)), out, progress=False, max_in_flight=4,
                       on_finish=woken.set).start()
        assert woken.wait(30), "the supervising loop was not told the output failed"
        assert isinstance(job.output_error, BrokenPipeError)
        job.stop("stopped")
        assert job.wait(30) and job.finished
        summary = job.summary()
    assert summary.stopped.startswith("the output cannot be written")
    assert summary.lines_read < 2000
    assert out.getvalue() == ""


def run_cli(args, **kw):
    return subprocess.run(SLOTSERVE + ["run", "--no-progress", *args], capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_cli_output_on_a_full_disk_exits_1_at_once_without_a_traceback(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(rows(50))
    r = run_cli([str(inp), "-o", "/dev/full"])
    assert r.returncode == 1, r.stderr
    assert "Error: cannot write the results: [Errno 28] No space left on device" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_output_to_a_closed_pipe_exits_1_at_once_without_a_traceback(tmp_path):
    """``slotserve run in.jsonl -o - | head -1``: the reader goes, the job stops (it hung forever)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(rows(3000))
    p = subprocess.Popen(SLOTSERVE + ["run", "--no-progress", str(inp), "-o", "-"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
        p.stdout.close()  # as head does once it has its line
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert json.loads(first)["finish_reason"] in ("stop", "length")
    assert p.returncode == 1, err
    assert "cannot write the results: [Errno 32] Broken pipe" in err
    assert "Traceback" not in err and "Exception ignored" not in err


@pytest.mark.parametrize("how", ["same", "link", "spelled"])
def test_cli_output_naming_the_input_is_a_usage_error_and_leaves_it_whole(tmp_path, how):
    inp = tmp_path / "in.jsonl"
    text = rows(3)
    inp.write_text(text)
    if how == "link":
        out = tmp_path / "link.jsonl"
        out.symlink_to(inp)
    elif how == "spelled":
        out = tmp_path / "." / ".." / tmp_path.name / "in.jsonl"
    else:
        out = inp
    r = run_cli([str(inp), "-o", str(out)])
    assert r.returncode == 2, r.stderr
    assert "is the input file IN.jsonl" in r.stderr and "Traceback" not in r.stderr
    assert inp.read_text() == text


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_humaneval_output_on_a_full_disk_is_one_clear_error():
    """The same kind in `slotserve humaneval`: its file's close raised OSError out of click (a traceback)."""
    r = subprocess.run(SLOTSERVE + ["humaneval", "-n", "3", "-o", "/dev/full"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "Error: cannot write the rows to /dev/full: [Errno 28] No space left on device" in r.stderr
    assert "Traceback" not in r.stderr


def test_humaneval_output_to_a_closed_pipe_is_one_clear_error():
    p = subprocess.Popen(SLOTSERVE + ["humaneval", "-n", "164"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # (the rows, ~100 KB, must not all fit in the pipe: one page)
        fcntl.fcntl(p.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    try:
        first = p.stdout.readline()
        p.stdout.close()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert json.loads(first)["id"] == "HumanEval/0"
    assert p.returncode == 1
    assert "Error: cannot write the rows to -: [Errno 32] Broken pipe" in err
    assert "Traceback" not in err and "Exception ignored" not in err


# ---------------------------------------------------------------------- an error row says its code once

class FailsOn999:
    """A stateless model that raises for a batch holding a sequence that starts with token 999."""

    def next_tokens(self, sequences):
        if any(s[0] == 999 for s in sequences):
            raise RuntimeError("the scripted model fails on token 999")
        return [(s[-1] + 1) % 50 for s in sequences]


def test_an_error_row_s_message_does_not_repeat_its_code():
    # it was {"code": "model_error", "message": "model_error: ModelError: model failed: RuntimeError: ..."}: the
    # RemoteError's str() ("code: message") and the worker's class name before its own words
    text = json.dumps({"id": "fails", "prompt": [999, 2], "max_tokens": 3}) + "\n" + \
        json.dumps({"id": "bad", "prompt": [1], "max_tokens": 0}) + "\n"
    out = io.StringIO()
    with ThreadCluster() as cluster:
        cluster.add_worker(FailsOn999(), num_slots=2)
        with Client(cluster.frontend, connect_timeout_s=20) as client:
            client.wait_for_model(20)
            run_job(client, io.StringIO(text), out, progress=False, timeout_s=60)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert got["fails"]["error"] == {"code": "model_error",
                                     "message": "model failed: RuntimeError: the scripted model fails on token 999"}
    bad = got["bad"]["error"]  # (the client's refusal: its own words, as before)
    assert bad["code"] == "bad_request" and bad["message"].startswith("line 2: max_tokens must be"), bad


def test_a_worker_error_s_words_are_its_own_when_its_code_says_its_kind():
    from worker.errors import ModelError, QueueFullError
    from worker.process import error_words

    assert error_words(ModelError("model failed: RuntimeError: boom")) == "model failed: RuntimeError: boom"
    assert error_words(QueueFullError("the worker's queue is full")) == "the worker's queue is full"
    assert error_words(KeyError("k")) == "KeyError: 'k'"  # (no code of its own: its type is the clue)


def test_a_refusal_whose_code_is_no_error_code_is_a_bad_request_row():
    # a ValueError carrying a code of its own ('E42') at submission wrote no row: the job read code.value of a str
    from slotserve.job import BatchJob

    class Refusal(ValueError):
        code = "E42"

    class RefusingClient:
        def submit(self, *args, **kwargs):
            raise Refusal("a foreign refusal")

    out = io.StringIO()
    BatchJob(RefusingClient(), io.StringIO(""), out, progress=False).submit(1, json.dumps({"id": "x", "prompt": [1],
                                                                                          "max_tokens": 2}))
    (row,) = map(json.loads, out.getvalue().splitlines())
    assert row["id"] == "x" and row["error"] == {"code": "bad_request", "message": "line 1: a foreign refusal"}
