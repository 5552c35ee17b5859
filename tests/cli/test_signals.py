"""Blast radius, kind "signals and child processes" (issue 10, item 4): however
`slotserve run` or `slotserve up` is asked to stop -- Ctrl-C (SIGINT),
`kill` (SIGTERM), a closed terminal (SIGHUP), `--timeout-s` -- it cancels
what is left, writes a row for every submitted row (each row was already
flushed when its request ended), prints the summary, stops its children and
exits with the documented status; its children (broker, workers, the
multiprocessing resource tracker) never outlive it, SIGKILL included; with
SIGINT ignored (as under some job runners) a group SIGINT changes nothing and
children that die are restarted, so the parent never hangs; each child says
what it is in `ps`. Real processes, real signals, waits with deadlines."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import functools

import pytest

psutil = pytest.importorskip("psutil")

from client import Client  # noqa: E402
from slotserve.signals import StopSignals  # noqa: E402
from tests.support.reference import simulated_references  # noqa: E402
from tests.support.waits import Deadline  # noqa: E402
from tests.support.waits import wait_until as _wait_until  # noqa: E402

SLOTSERVE = [sys.executable, "-m", "slotserve"]


# The conditions here read process tables and files: polled every 50 ms.
wait_until = functools.partial(_wait_until, pause_s=0.05)


def start(args, *, sigint_ignored: bool = False, **kw) -> subprocess.Popen:
    """Start `slotserve ARGS` in its own session (its own process group, so a
    group signal reaches it and its children only)."""
    cmd = SLOTSERVE + args
    if sigint_ignored:  # as a job runner does: SIG_IGN survives exec
        cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"] + cmd
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)


def reap(proc: subprocess.Popen, kids) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass


def title(p) -> str:
    try:
        return " ".join(x for x in p.cmdline() if x)
    except psutil.Error:
        return ""


def cluster_children(proc, workers: int) -> list:
    """Wait until the broker and ``workers`` workers run under ``proc`` (by their
    process titles); return all its descendants (resource tracker included)."""
    parent = psutil.Process(proc.pid)

    def ready():
        assert proc.poll() is None, proc.communicate()[1]
        kids = parent.children(recursive=True)
        titles = [title(k) for k in kids]
        if sum(t.startswith("slotserve worker ") for t in titles) == workers and \
                sum(t.startswith("slotserve broker ") for t in titles) == 1:
            return kids
        return None

    return wait_until(ready, 60, "the cluster's children")


def gone(procs) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def read_rows(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def write_input(path, n: int, max_tokens: int) -> list[dict]:
    rows = [{"id": i, "prompt": [i % 97 + 1, 3], "max_tokens": max_tokens} for i in range(n)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def reference_rows(rows) -> dict:
    """id -> (tokens, finish reason) of the fault-free in-process run."""
    ends = simulated_references([(r["prompt"], r["max_tokens"], {}) for r in rows])
    return {r["id"]: (tokens, reason.value) for r, (tokens, reason) in zip(rows, ends)}


def check_rows(got: list[dict], rows: list[dict], *, complete: bool) -> None:
    """One row per input row; finished rows equal the engine's; cancelled rows
    hold a prefix of it."""
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(r["id"] for r in rows), "one row per input row"
    ref = reference_rows(rows)
    for r in got:
        tokens, reason = ref[r["id"]]
        if r["finish_reason"] == "cancelled":
            assert not complete and r["tokens"] == tokens[:len(r["tokens"])]
        else:
            assert (r["tokens"], r["finish_reason"]) == (tokens, reason), r


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_run_stops_cleanly_on_each_stop_signal(tmp_path, sig):
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_input(inp, 300, 40)
    proc = start(["run", str(inp), "-o", str(outp), "--workers", "2", "--slots", "4", "--step-delay-ms", "30",
                  "--no-progress"])
    kids = []
    try:
        kids = cluster_children(proc, 2)
        # Rows reach the file as requests end, long before the job does.
        wait_until(lambda: len(read_rows(outp)) >= 3, 60, "the first rows on disk")
        assert proc.poll() is None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        got = read_rows(outp)
        check_rows(got, rows, complete=False)
        assert any(r["finish_reason"] == "cancelled" for r in got)
        assert "requests" in err and "300 (0 errors)" in err and f"stopped by {sig.name}" in err
        wait_until(lambda: gone(kids), 30, "the children to exit")
    finally:
        reap(proc, kids)


def group_left(pgid: int) -> list:
    """Live processes (zombies aside) still in process group ``pgid``."""
    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (psutil.Error, ProcessLookupError):
            pass
    return left


_UNREAD: dict[int, str] = {}  # pid -> stderr text read past the line stderr_line returned


def stderr_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    """Read ``proc``'s stderr until a line containing ``needle`` (deadline ``timeout_s``).

    Reads the pipe's file descriptor itself: select() on the buffered text stream can wait for
    bytes its buffer already holds (a readline() that read two lines, the second the one wanted),
    which sent the test's signal only once the command had finished (stop 38, at load 4-5)."""
    deadline = Deadline(timeout_s)
    fd = proc.stderr.fileno()
    buf = _UNREAD.pop(proc.pid, "")
    while True:
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            if needle in line:
                _UNREAD[proc.pid] = buf
                return line + "\n"
        ready, _, _ = select.select([fd], [], [], deadline.left_s())
        assert ready, f"timed out waiting for {needle!r} on stderr"
        chunk = os.read(fd, 65536)
        assert chunk, f"stderr closed before {needle!r} (exit status {proc.wait(10)})"
        buf += chunk.decode(errors="replace")


@pytest.mark.parametrize("phase", ["starting", "broker up"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_run_stopped_before_its_cluster_is_up_leaves_an_output_and_no_children(tmp_path, sig, phase):
    """A stop signal while the embedded cluster starts (as the command says
    it starts, or once its broker process runs but the workers have not
    registered) ends `slotserve run` as one mid-run does: 128+N, the -o file
    there and well formed (the rows ended so far: none), no child left.
    SIGTERM to the command alone (`kill`), SIGINT to its group (Ctrl-C)."""
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_input(inp, 50, 10)
    # 200 ms a step: the run lasts ~25 s, so a signal the test sends late still lands before its end (a
    # busy machine: CI's run of stop 37 finished all 50 rows in 15 ms before the SIGTERM came; at load 5
    # with 50 ms a step, the run of stop 38 finished in 4.4 s before it). The signal ends it at once.
    proc = start(["run", str(inp), "-o", str(outp), "--workers", "2", "--slots", "2", "--no-progress",
                  "--step-delay-ms", "200"])
    try:
        stderr_line(proc, "starting a local cluster", 60)
        if phase == "broker up":
            me = psutil.Process(proc.pid)
            wait_until(lambda: any(title(k).startswith("slotserve broker ") for k in me.children(recursive=True)),
                       60, "the broker process")
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        assert f"stopped by {sig.name}" in err
        assert outp.exists(), "no -o file"
        text = outp.read_text()
        assert text == "" or text.endswith("\n")
        got = [json.loads(line) for line in text.splitlines()]
        assert {r["id"] for r in got} <= {r["id"] for r in rows}
        wait_until(lambda: not group_left(proc.pid), 30, "the children to exit")
    finally:
        reap(proc, group_left(proc.pid))


@pytest.mark.parametrize("command, sig", [("run", signal.SIGKILL), ("up", signal.SIGKILL), ("up", signal.SIGHUP),
                                          ("up", signal.SIGTERM)], ids=lambda v: getattr(v, "name", v))
def test_children_never_outlive_the_parent(tmp_path, command, sig):
    if command == "run":
        inp = tmp_path / "in.jsonl"
        write_input(inp, 200, 200)
        args = ["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--step-delay-ms", "50", "--no-progress"]
    else:
        args = ["up", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*"]
    proc = start(args + ["--workers", "2", "--slots", "2"])
    kids = []
    try:
        kids = cluster_children(proc, 2)
        titles = sorted(title(k) for k in kids)
        assert any(t.startswith("slotserve broker frontend=tcp://127.0.0.1:") and "backend=tcp://127.0.0.1:" in t
                   for t in titles), titles
        for i in range(2):
            assert any(t.startswith(f"slotserve worker {i} model=simulated slots=2 broker=tcp://127.0.0.1:")
                       for t in titles), titles
        assert len(kids) == 4, titles  # broker, two workers, multiprocessing's resource tracker
        os.kill(proc.pid, sig)
        proc.communicate(timeout=60)
        assert proc.returncode == (-sig if sig == signal.SIGKILL else 0)
        wait_until(lambda: gone(kids), 30, "the children to exit after their parent")
    finally:
        reap(proc, kids)


def test_with_sigint_ignored_nothing_hangs_and_dead_children_come_back(tmp_path):
    """A job runner starts `slotserve run` with SIGINT ignored: a SIGINT to the
    whole group stops nobody; children killed outright are restarted and the
    job still completes with every row right."""
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_input(inp, 200, 20)
    proc = start(["run", str(inp), "-o", str(outp), "--workers", "2", "--slots", "4", "--step-delay-ms", "20",
                  "--no-progress"], sigint_ignored=True)
    kids = []
    try:
        kids = cluster_children(proc, 2)
        n = wait_until(lambda: len(read_rows(outp)) >= 3 and len(read_rows(outp)), 60, "the first rows")
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: len(read_rows(outp)) > n, 30, "more rows after the group SIGINT")
        assert proc.poll() is None and all(k.is_running() for k in kids)
        for k in kids:
            if title(k).startswith("slotserve "):
                k.kill()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "died: restarting it" in err
        check_rows(read_rows(outp), rows, complete=True)
    finally:
        reap(proc, kids)


def test_run_against_a_broker_with_a_stalled_stdin_stops_and_leaves_the_cluster_alone(tmp_path):
    """`slotserve run - --broker ADDR` reading a pipe that stays open (a
    producer that stalled): SIGTERM still ends it at once, with its rows and
    summary, and the cluster it used keeps serving others."""
    up = start(["up", "--workers", "1", "--slots", "2", "--step-delay-ms", "30",
                "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*"])
    kids, run = [], None
    try:
        kids = cluster_children(up, 1)
        front = wait_until(lambda: next((t.split("frontend=")[1].split()[0] for t in map(title, kids)
                                         if t.startswith("slotserve broker ")), None), 10, "the frontend")
        outp = tmp_path / "out.jsonl"
        rows = [{"id": i, "prompt": [i + 1, 2], "max_tokens": 100, "stop_token": None} for i in range(6)]
        run = start(["run", "-", "-o", str(outp), "--broker", front, "--no-progress"], stdin=subprocess.PIPE)
        run.stdin.write("".join(json.dumps(r) + "\n" for r in rows))
        run.stdin.flush()  # and the pipe stays open: the reader blocks
        wait_until(lambda: any(len(r.get("tokens", ())) for r in read_rows(outp)) or
                   _has_tokens(front), 60, "tokens flowing")
        run.send_signal(signal.SIGTERM)
        run.wait(30)  # stdin still open: the reader is still blocked
        err = run.stderr.read()
        assert run.returncode == 128 + signal.SIGTERM, err
        got = read_rows(outp)
        assert sorted(r["id"] for r in got) == list(range(6)) and "stopped by SIGTERM" in err
        assert all(r["finish_reason"] in ("cancelled", "length") for r in got)
        assert up.poll() is None
        with Client(front, connect_timeout_s=10) as c:  # the cluster still serves
            h = c.submit_request([5, 6], 3, stop_token=None)
            assert len(h.result(timeout=30)) == 5
            assert c.status().models["simulated"].running == 0  # nothing of the stopped job left behind
    finally:
        if run is not None:
            reap(run, [])
        reap(up, kids)


def _has_tokens(front) -> bool:
    with Client(front, connect_timeout_s=5) as c:
        model = c.status().models.get("simulated")  # (absent until the worker has registered)
        return model is not None and model.running > 0


def test_timeout_stops_like_a_signal(tmp_path):
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_input(inp, 200, 200)
    proc = start(["run", str(inp), "-o", str(outp), "--workers", "1", "--slots", "2", "--step-delay-ms", "50",
                  "--no-progress", "--timeout-s", "3"])
    try:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 124, err
        got = read_rows(outp)
        check_rows(got, rows, complete=False)
        assert "stopped: timeout after 3 s" in err and "requests" in err
    finally:
        reap(proc, [])


def test_standalone_broker_and_worker_stop_on_sighup(tmp_path):
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    front, back = (f"tcp://127.0.0.1:{p}" for p in ports)
    broker = start(["broker", "--frontend", front, "--backend", back])
    worker = start(["worker", "--broker", back, "--slots", "2"])
    try:
        def registered():
            with Client(front, connect_timeout_s=2) as c:
                return c.status().models.get("simulated")
        wait_until(registered, 60, "the worker to register")
        for proc, sig in ((worker, signal.SIGHUP), (broker, signal.SIGHUP)):
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
    finally:
        reap(worker, [])
        reap(broker, [])


def test_stop_signals_set_a_flag_wake_the_loop_and_respect_ignored_signals():
    previous_term = signal.getsignal(signal.SIGTERM)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with StopSignals() as sig:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # ignored at start: stays ignored
            os.kill(os.getpid(), signal.SIGHUP)
            assert not sig.is_set()
            os.kill(os.getpid(), signal.SIGTERM)
            sig.wait(10)  # the wakeup pipe ends the wait at once
            assert sig.is_set() and sig.flag.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)
            assert sig.flag.signum == signal.SIGTERM  # the first reason is kept
        assert signal.getsignal(signal.SIGTERM) is previous_term
    finally:
        signal.signal(signal.SIGHUP, previous_hup)


def test_the_banner_says_how_to_stop_when_sigint_is_ignored():
    """A command started with SIGINT ignored (``slotserve up ... &`` from a script) keeps it ignored;
    its banner then names SIGTERM rather than saying "Ctrl-C stops", and so does the line that says how
    to cut the drain short (it said "Ctrl-C again: at once" to a command deaf to Ctrl-C)."""
    with StopSignals() as sig:
        assert sig.stop_hint() == "Ctrl-C stops."
        assert sig.again_hint() == "Ctrl-C again: at once"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as sig:
            hint, again = sig.stop_hint(), sig.again_hint()
        assert "Ctrl-C does not stop it" in hint and f"kill {os.getpid()}" in hint and "SIGTERM" in hint
        assert again == f"SIGTERM again (kill {os.getpid()}): at once", again
    finally:
        signal.signal(signal.SIGINT, previous)


def test_up_started_with_sigint_ignored_says_sigterm_stops_it(tmp_path):
    """`slotserve up ... &` from a script: SIGINT stays ignored, and the banner says so and names
    SIGTERM (it said "Ctrl-C stops."); SIGTERM then stops it."""
    proc = start(["up", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*", "--workers", "1",
                  "--slots", "2"], sigint_ignored=True)
    try:
        banner = stderr_line(proc, "slotserve up:", 60)
        assert "Ctrl-C does not stop it" in banner and f"kill {proc.pid}" in banner, banner
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == 0
    finally:
        reap(proc, [])
