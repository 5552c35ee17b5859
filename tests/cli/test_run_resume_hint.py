"""``slotserve run`` stopped before its input ended (Ctrl-C, SIGTERM, SIGHUP, ``--timeout-s``) said
``stopped by SIGINT`` (or ``stopped: timeout after N s``) and exited 128+N (124), its rows so far in
``-o``: a user stopping the README's main job ran the whole job again, where ``--resume`` runs only the
rows not done. The last line now says so. Over a stand-in ``run_batch`` (no process, no model)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import slotserve.batch
from slotserve.batch import BatchOutcome, ExitStatus
from slotserve.cli import main
from slotserve.job import JobSummary

HINT = "; the same command with --resume runs only the rows not done yet"


def _summary(stopped: str | None) -> JobSummary:
    return JobSummary(requests=4, errors=0, prompt_tokens=40, completion_tokens=8, wall_s=1.0, p50_latency_ms=None,
                      p99_latency_ms=None, p50_ttft_ms=None, finish_reasons={"cancelled": 3, "stop": 1},
                      stopped=stopped, lines_read=4)


def _run(monkeypatch, tmp_path, outcome: BatchOutcome, output: str | None = None, *extra: str):
    def run_batch(inp, out, **kwargs):  # (close_input=True: the job closes its input)
        inp.close()
        return outcome

    monkeypatch.setattr(slotserve.batch, "run_batch", run_batch)
    (tmp_path / "in.jsonl").write_text('{"prompt": [1, 2]}\n' * 4)
    out = output or str(tmp_path / "out.jsonl")
    return CliRunner().invoke(main, ["run", str(tmp_path / "in.jsonl"), "-o", out, *extra])


@pytest.mark.parametrize("stopped, status, message", [
    ("SIGINT", ExitStatus.SIGNALLED + 2, "stopped by SIGINT"),
    ("SIGTERM", ExitStatus.SIGNALLED + 15, "stopped by SIGTERM"),
    ("SIGHUP", ExitStatus.SIGNALLED + 1, "stopped by SIGHUP"),
    ("timeout after 3 s", ExitStatus.TIMEOUT, "stopped: timeout after 3 s"),
])
@pytest.mark.parametrize("resume", [False, True], ids=["first run", "resumed"])
def test_a_stopped_job_says_how_to_go_on(monkeypatch, tmp_path, stopped, status, message, resume):
    r = _run(monkeypatch, tmp_path, BatchOutcome(_summary(stopped), status, message), None,
             *(["--resume"] if resume else []))
    assert r.exit_code == status, r.output
    assert r.output.splitlines()[-1] == message + HINT


def test_to_stdout_there_is_nothing_to_resume_from(monkeypatch, tmp_path):
    r = _run(monkeypatch, tmp_path, BatchOutcome(_summary("SIGINT"), ExitStatus.SIGNALLED + 2, "stopped by SIGINT"),
             "-")
    assert r.exit_code == 130 and r.output.splitlines()[-1] == "stopped by SIGINT", r.output


def test_a_job_that_ran_to_its_end_has_no_hint(monkeypatch, tmp_path):
    r = _run(monkeypatch, tmp_path, BatchOutcome(_summary(None), ExitStatus.ROW_ERRORS, "1 row ended with an error"))
    assert r.exit_code == 3 and r.output.splitlines()[-1] == "1 row ended with an error", r.output
