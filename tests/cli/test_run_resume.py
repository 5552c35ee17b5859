"""`slotserve run --resume`: a job stopped or killed part-way goes on where it stopped. Members:
a job stopped mid-run (cancelled rows, lines never read) resumed to exactly one row per input id,
submitting only the missing rows; a last line cut off by a kill (no line end, or not JSON) removed
and said; rows that ended with an error of the run (cancelled, worker_failed, model_error, ...)
run again with their old rows removed, while rows refused for what they hold (bad_request,
context_length_exceeded, a duplicate id, a line that is not JSON) are kept and not run again; an
output that is no job's output refused untouched; -o - refused; a missing output started afresh;
the exit status over the whole output. In process: a broker and workers on threads."""

from __future__ import annotations

import io
import json
import os
import threading

import pytest
from click.testing import CliRunner

from client import Client
from slotserve.cli import main
from slotserve.job import BatchJob, run_job
from slotserve.resume import NotResultRows, read_previous
from tests.support.cluster import ThreadCluster
from tests.support.reference import simulated_reference
from tests.support.waits import wait_until
from worker import SimulatedLLM


class HoldingLLM(SimulatedLLM):
    """SimulatedLLM whose calls from the ``hold_at``-th on block until :attr:`release` is set
    (``holding`` tells the test one has started); ``hold_at`` None: never."""

    def __init__(self, hold_at: int | None) -> None:
        super().__init__()
        self.hold_at = hold_at
        self.holding, self.release = threading.Event(), threading.Event()

    def next_tokens(self, sequences):
        if self.hold_at is not None and self.calls + 1 >= self.hold_at:
            self.holding.set()
            assert self.release.wait(30), "the test never released the model"
        return super().next_tokens(sequences)


def counting(client: Client) -> list:
    """Make ``client`` record the request id of each request it submits; return that list."""
    submitted, submit = [], client.submit

    def counted(params, callback=None, **kw):
        submitted.append(kw.get("request_id"))
        return submit(params, callback, **kw)

    client.submit = counted
    return submitted


def result_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_against_the_model(rows: list[dict], inputs: dict) -> None:
    """Each row that ran equals the fault-free run of its input row (``inputs``: id -> row)."""
    for r in rows:
        if r["finish_reason"] in ("stop", "length"):
            src = inputs[json.dumps(r["id"])]
            assert (r["tokens"], r["finish_reason"]) == simulated_reference(src["prompt"], src["max_tokens"]), r


def test_a_job_stopped_mid_run_resumes_to_one_row_per_id_running_only_the_missing_rows(tmp_path):
    """Twelve rows of two tokens, one slot, at most four in flight; the model holds at its 6th call,
    the job is stopped there (as SIGTERM or --timeout-s stop it): rows done, four cancelled (three
    queued, one running), the last lines never read. Rows without an id are matched by line number;
    line 2 is not JSON (its error row stands, and is not written twice)."""
    lines = []
    for i in range(1, 13):
        row = {"prompt": [i, 7], "max_tokens": 2}
        if i % 2:
            row["id"] = f"r{i}"
        lines.append(json.dumps(row))
    lines[1] = "{not json"
    text = "".join(line + "\n" for line in lines)
    inputs = {json.dumps(r.get("id", n)): r for n, r in
              ((n, json.loads(line)) for n, line in enumerate(lines, start=1) if n != 2)}
    out_path = tmp_path / "out.jsonl"
    model = HoldingLLM(hold_at=6)
    with ThreadCluster() as cluster:
        cluster.add_worker(model, num_slots=1, prefetch=0, warmup=False)
        with Client(cluster.frontend, connect_timeout_s=20) as client:
            client.wait_for_model(20)
            with open(out_path, "w") as out:
                job = BatchJob(client, io.StringIO(text), out, max_in_flight=4, progress=False).start()
                assert model.holding.wait(30)

                def window_full() -> bool:  # (the broker's four unfinished requests are the job's four)
                    m = client.status().models["simulated"]
                    return (m.queued, m.running) == (3, 1) and len(job.handles) == 4

                wait_until(window_full, 20, "the job's window to fill while the model holds")
                job.stop("SIGTERM", drain_timeout_s=0.5)  # (the running row: written cancelled when the drain ends)
                first = job.summary()
        model.hold_at = None
        model.release.set()
        before = result_rows(out_path)
        reasons = [r["finish_reason"] for r in before]
        done = [r for r in before if r["finish_reason"] != "cancelled"]
        assert reasons.count("cancelled") == 4 and any(r["finish_reason"] in ("stop", "length") for r in done)
        assert first.lines_read < 12  # lines never read: they have no row
        kept_text = "".join(json.dumps(r) + "\n" for r in done)

        previous = read_previous(str(out_path))
        assert previous.rows == len(done) and previous.again == {"cancelled": 4}
        assert out_path.read_text() == kept_text  # the cancelled rows are gone, the rest as written
        with Client(cluster.frontend, connect_timeout_s=20) as client:
            submitted = counting(client)
            with open(out_path, "a") as out:
                summary = run_job(client, io.StringIO(text), out, progress=False, timeout_s=60, previous=previous)
    rows = result_rows(out_path)
    assert sorted(json.dumps(r["id"]) for r in rows) == sorted([*inputs, "2"])  # one row per id
    assert out_path.read_text().startswith(kept_text)
    assert len(submitted) == 12 - len(done) == summary.requests  # only the missing rows ran
    assert (summary.already_done, summary.already_errors) == (len(done), 1)
    assert [r for r in rows if r["id"] == 2][0]["error"]["code"] == "bad_request"
    assert {r["finish_reason"] for r in rows} <= {"stop", "length", "error"}
    check_against_the_model(rows, inputs)


def row(row_id, reason="length", code=None, message="it failed", tokens=(5,)) -> dict:
    """A result row as the job writes it."""
    out = {"id": row_id, "tokens": list(tokens), "finish_reason": reason,
           "usage": {"prompt_tokens": 2, "completion_tokens": len(tokens),
                     "prompt_tokens_details": {"cached_tokens": 0}}}
    if code is not None:
        out["tokens"], out["usage"]["completion_tokens"] = [], 0
        out["error"] = {"code": code, "message": message}
    return out


@pytest.fixture(scope="module")
def frontend():
    with ThreadCluster() as cluster:
        cluster.add_worker(num_slots=4, warmup=False)
        yield cluster.frontend


def resume(frontend, inp_text: str, out_path) -> tuple[list, object]:
    previous = read_previous(str(out_path))
    with Client(frontend, connect_timeout_s=20) as client:
        client.wait_for_model(20)
        submitted = counting(client)
        with open(out_path, "a") as out:
            summary = run_job(client, io.StringIO(inp_text), out, progress=False, timeout_s=60, previous=previous)
    return submitted, summary


def test_rows_that_failed_with_the_run_run_again_and_rows_refused_for_what_they_hold_do_not(frontend, tmp_path):
    ids = ["ok", "cancelled", "worker_failed", "model_error", "queue_full", "internal", "bad_request",
           "context_length", "deadline", "missing", "dup"]
    lines = [json.dumps({"id": i, "prompt": [n + 1, 3], "max_tokens": 3}) for n, i in enumerate(ids)]
    lines.append(json.dumps({"id": "dup", "prompt": [1], "max_tokens": 1}))  # line 12: a duplicate, refused
    lines.append("{cut")  # line 13: not JSON, refused with its line number as id
    lines.append(json.dumps({"id": 13, "prompt": [4, 4], "max_tokens": 2}))  # names line 13's number: runs
    text = "".join(line + "\n" for line in lines)
    out_path = tmp_path / "out.jsonl"
    old = [row("ok"), row("cancelled", "cancelled", tokens=(9,)), row("worker_failed", "error", "worker_failed"),
           row("model_error", "error", "model_error"), row("queue_full", "error", "queue_full"),
           row("internal", "error", "internal"), row("deadline", "deadline"),
           row("bad_request", "error", "bad_request", "stop_token 5000 is outside the vocabulary"),
           row("context_length", "error", "context_length_exceeded", "prompt + max_tokens is 9000, over 8192"),
           row("dup", "length"), row("dup", "error", "bad_request", 'line 12: duplicate id "dup" (line 11 has it)'),
           row(13, "error", "bad_request", "line 13: not valid JSON (Expecting property name)"),
           row(13, "cancelled")]
    out_path.write_text("".join(json.dumps(r) + "\n" for r in old))
    submitted, summary = resume(frontend, text, out_path)
    assert sorted(submitted) == [2, 3, 4, 5, 6, 10, 14]  # the lines of the rows that run again, and the missing one
    rows = result_rows(out_path)
    kept = [r for r in old if r["finish_reason"] != "cancelled" and r.get("error", {}).get("code") not in
            ("worker_failed", "model_error", "queue_full", "internal")]
    assert rows[:len(kept)] == kept  # kept as they were, in their order; none written twice
    new = rows[len(kept):]
    assert sorted(json.dumps(r["id"]) for r in new) == sorted(
        json.dumps(i) for i in ["cancelled", "worker_failed", "model_error", "queue_full", "internal", "missing", 13])
    assert all(r["finish_reason"] in ("stop", "length") for r in new)
    check_against_the_model(new, {json.dumps(json.loads(line)["id"]): json.loads(line)
                                  for n, line in enumerate(lines, start=1) if n not in (12, 13)})
    assert (summary.already_done, summary.already_errors, summary.requests) == (len(kept), 4, 7)


@pytest.mark.parametrize("cut", [b'{"id": 3, "tokens": [5, ', b'{"id": 3, "tokens": [5, \x00\x00\n',
                                 b'\xff\xfe garbage\n'], ids=["no-line-end", "not-json", "not-utf8"])
def test_a_last_line_cut_off_by_a_kill_is_removed_back_to_the_last_complete_row(tmp_path, cut):
    whole = (json.dumps(row(1)) + "\n" + json.dumps(row(2, "stop")) + "\n").encode()
    path = tmp_path / "out.jsonl"
    path.write_bytes(whole + cut)
    previous = read_previous(str(path))
    assert path.read_bytes() == whole
    assert (previous.cut.line, previous.cut.size) == (3, len(cut))
    assert previous.cut.why == ("no line end" if not cut.endswith(b"\n") else "not JSON")
    assert previous.done_ids == {"1", "2"} and previous.rows == 2 and not previous.again


def test_rows_removed_and_a_cut_line_leave_one_file_in_place_with_its_permissions(tmp_path):
    """The rewrite is a rename of a whole file beside it: no temporary file is left, the mode stays,
    and a link to the output is followed (the link stays a link)."""
    real = tmp_path / "real.jsonl"
    real.write_text(json.dumps(row(1)) + "\n" + json.dumps(row(2, "cancelled")) + "\n" + '{"id": 3')
    os.chmod(real, 0o640)
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    previous = read_previous(str(link))
    assert previous.again == {"cancelled": 1} and previous.cut.line == 3
    assert link.is_symlink() and real.read_text() == json.dumps(row(1)) + "\n"
    assert oct(os.stat(real).st_mode & 0o777) == oct(0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "real.jsonl"]


@pytest.mark.parametrize("text, words", [
    ('not json\n' + json.dumps(row(1)) + "\n", "line 1 of"),                         # a line in the middle
    (json.dumps({"prompt": [1, 2], "max_tokens": 2}) + "\n", "not a result row"),   # the input, say
    (json.dumps(row(1, "error")) + "\n", "not a result row"),                        # an error without a code
    ("[1, 2]\n", "not a result row"),
], ids=["cut-in-the-middle", "an-input-row", "error-without-code", "an-array"])
def test_an_output_that_is_no_jobs_output_is_refused_and_left_alone(tmp_path, text, words):
    path = tmp_path / "out.jsonl"
    path.write_text(text)
    with pytest.raises(NotResultRows, match=words):
        read_previous(str(path))
    assert path.read_text() == text


def test_a_missing_output_is_none_and_a_directory_is_refused(tmp_path):
    assert read_previous(str(tmp_path / "missing.jsonl")) is None
    assert not (tmp_path / "missing.jsonl").exists()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        read_previous(str(tmp_path / "fifo"))


# ---------------------------------------------------------------------------------------- the CLI


def cli(frontend, *args):
    return CliRunner().invoke(main, ["run", *map(str, args), "--broker", frontend, "--no-progress"])


def test_cli_resume_to_stdout_is_a_usage_error(frontend, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    r = cli(frontend, inp, "-o", "-", "--resume")
    assert r.exit_code == 2, r.output
    assert "--resume" in r.stderr and "not - (standard output)" in r.stderr
    assert r.stdout == ""


def test_cli_resume_of_a_missing_output_starts_afresh_and_says_so(frontend, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": [1, 2], "max_tokens": 2}\n{"prompt": [3, 4], "max_tokens": 2}\n')
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert f"{out} does not exist: starting afresh" in r.stderr
    assert sorted(x["id"] for x in result_rows(out)) == [1, 2]


def test_cli_resume_says_what_it_removed_and_exits_over_the_whole_output(frontend, tmp_path):
    """A bad_request row kept from before makes the resumed job exit 3 as one whole run would; a
    job whose earlier rows all ran exits 0; a second resume runs nothing."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [i + 1, 2], "max_tokens": 2}) + "\n" for i in range(4)))
    cut = '{"id": 3, "to'
    out.write_bytes((json.dumps(row(0)) + "\n" + json.dumps(row(1, "error", "bad_request", "bad")) + "\n"
                     + json.dumps(row(2, "error", "worker_failed")) + "\n" + cut).encode())
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 3, r.output
    assert f"the last line of {out} (line 4, {len(cut)} bytes, no line end) was cut off mid-write" in r.stderr
    assert f"2 rows already done in {out} (1 errors): not run again; 1 rows to run again (worker_failed 1)" \
        in r.stderr
    assert "already done       2 rows in the output before this run (1 errors)" in r.stderr
    assert "requests           2 (0 errors)" in r.stderr
    assert "1 row(s) ended with finish_reason 'error', 1 of them before this run" in r.stderr
    assert sorted(x["id"] for x in result_rows(out)) == [0, 1, 2, 3]
    again = cli(frontend, inp, "-o", out, "--resume")
    assert again.exit_code == 3 and "requests           0 (0 errors)" in again.stderr
    assert sorted(x["id"] for x in result_rows(out)) == [0, 1, 2, 3]
    out.write_text(json.dumps(row(0)) + "\n")
    assert cli(frontend, inp, "-o", out, "--resume").exit_code == 0


def test_cli_resume_of_an_output_that_is_no_jobs_is_a_usage_error_and_leaves_it(frontend, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text = '{"prompt": [1, 2], "max_tokens": 2}\n'
    inp.write_text(text)
    out.write_text(text)
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 2, r.output
    assert "not a result row of slotserve run" in r.stderr and "Traceback" not in r.output
    assert out.read_text() == text


# ------------------------------------------------------------------------ one run per output file


def test_a_run_on_an_output_another_run_holds_is_refused_and_leaves_it(frontend, tmp_path):
    """A second run on the output of a running one, with --resume or without, exits 2 before it reads,
    empties or rewrites it (it lost rows before: a resume's rewrite renamed a new file over the one the
    first run was appending to, a plain run emptied it, two resumes wrote the missing rows twice); once
    the first run ends, the file is the next run's."""
    from slotserve.output_lock import OutputLock

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [i + 1, 2], "max_tokens": 2}) + "\n" for i in range(3)))
    text = json.dumps(row(0)) + "\n" + json.dumps(row(1, "cancelled")) + "\n"
    out.write_text(text)
    inode = os.stat(out).st_ino
    with OutputLock(str(out)):  # (the first run)
        for args in (["--resume"], []):
            r = cli(frontend, inp, "-o", out, *args)
            assert r.exit_code == 2, r.output
            assert f"{out} is being written by another slotserve run" in r.stderr and "Traceback" not in r.output
            assert out.read_text() == text and os.stat(out).st_ino == inode
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert sorted(x["id"] for x in result_rows(out)) == [0, 1, 2]


def test_a_resume_that_rewrites_the_output_holds_the_new_file_locked(tmp_path):
    """read_previous renames a new file over the output (rows removed): the run's lock holds that new
    file, locked before the rename, so no other run can take it; a missing output is created and
    locked; a path that is no regular file (/dev/null, a FIFO) is not locked."""
    from slotserve.output_lock import OutputBusy, OutputLock

    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1, "cancelled")) + "\n")
    with OutputLock(str(out)) as lock:
        before = os.fstat(lock.fd).st_ino
        previous = read_previous(str(out), lock)
        assert previous.again == {"cancelled": 1} and os.stat(out).st_ino != before  # (rewritten: a new file)
        assert os.path.samestat(os.fstat(lock.fd), os.stat(out))
        with pytest.raises(OutputBusy, match="is being written by another slotserve run"):
            OutputLock(str(out))
    OutputLock(str(out)).close()  # (released)
    with OutputLock(str(tmp_path / "new.jsonl")):
        assert (tmp_path / "new.jsonl").read_text() == ""
        with pytest.raises(OutputBusy):
            OutputLock(str(tmp_path / "new.jsonl"))
    os.mkfifo(tmp_path / "fifo")
    with OutputLock(str(tmp_path / "fifo")) as a, OutputLock(str(tmp_path / "fifo")) as b:
        assert a.fd is None and b.fd is None


def test_cli_resume_with_another_input_says_the_ids_it_does_not_have(frontend, tmp_path):
    """A resume whose output answers ids that no line of the input has (the output written for
    another input) said nothing: it ran the input's rows beside them. Now the summary says how many
    and one of them; an output of this input's ids says nothing of the kind."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [i + 1, 2], "max_tokens": 2}) + "\n" for i in range(3)))
    out.write_text(json.dumps(row(0)) + "\n" + json.dumps(row("other-7")) + "\n" + json.dumps(row("other-9")) + "\n")
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert "not in the input " in r.stderr and '2 ids answered in the output before this run are on no line of ' \
           'the input (id "other-7"): was the output written for another input?' in r.stderr, r.stderr
    assert sorted(map(str, (x["id"] for x in result_rows(out)))) == ["0", "1", "2", "other-7", "other-9"]
    out.write_text(json.dumps(row(0)) + "\n")
    r = cli(frontend, inp, "-o", out, "--resume")
    assert r.exit_code == 0 and "not in the input" not in r.stderr, r.stderr
