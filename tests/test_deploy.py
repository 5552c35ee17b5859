"""deploy/supervisord.conf: supervisord starts a broker and two workers; a job
runs through them; stopping supervisord stops everything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client import Client
from worker import BatchInferenceEngine, SimulatedLLM

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUPERVISORD = shutil.which("supervisord", path=str(BIN)) or shutil.which("supervisord")

pytestmark = pytest.mark.skipif(SUPERVISORD is None or shutil.which("slotserve", path=str(BIN)) is None,
                                reason="needs supervisord and the slotserve command (pip install -e '.[dev]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_supervisord_runs_broker_and_two_workers(tmp_path):
    front_port, back_port = free_port(), free_port()
    front, back = f"tcp://127.0.0.1:{front_port}", f"tcp://127.0.0.1:{back_port}"
    env = dict(os.environ, SLOTSERVE_RUN_DIR=str(tmp_path), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               SLOTSERVE_BROKER_FRONTEND=front, SLOTSERVE_BROKER_BACKEND=back, SLOTSERVE_WORKER_BROKER=back,
               SLOTSERVE_WORKER_SLOTS="3")
    proc = subprocess.Popen([SUPERVISORD, "-c", str(ROOT / "deploy" / "supervisord.conf")], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "supervisord.log").read_text()
            try:
                with Client(front, connect_timeout_s=0.5) as c:
                    st = c.status()
                if "simulated" in st.models and st.models["simulated"].workers == 2:
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            assert time.monotonic() < deadline, "supervisord cluster did not come up"
        names = sorted(w.name for w in st.workers)
        assert names == ["worker-0", "worker-1"] and st.models["simulated"].slots_total == 6

        rows = [{"id": i, "prompt": [i + 1, 2], "max_tokens": 1 + i % 9} for i in range(50)]
        inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = subprocess.run([str(BIN / "slotserve"), "run", str(inp), "-o", str(outp), "--broker", front,
                              "--no-progress"], capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0, run.stderr
        engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
        hs = {r["id"]: engine.submit_request(r["prompt"], r["max_tokens"]) for r in rows}
        engine.run()
        got = {json.loads(line)["id"]: json.loads(line) for line in outp.read_text().splitlines()}
        assert {k: (v["tokens"], v["finish_reason"]) for k, v in got.items()} == \
            {k: (h.tokens, h.finish_reason.value) for k, h in hs.items()}

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert port_free(front_port) and port_free(back_port)  # the children are gone too
    assert "registered" in (tmp_path / "supervisord.log").read_text() or (tmp_path / "broker.log").exists()
