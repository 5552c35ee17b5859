"""bench/model.py --random-weights --tiny: bench/gpu.py's cases end to end on the CPU.

The GPU mode cannot run in CI (no GPU); its tiny CPU form runs every case and
system through the same code and must write a complete, sane result.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parent.parent
CASES = {"smol-fp32-he32-8", "smol-bf16-he32-8", "smol-bf16-mix256-64", "1b-bf16-mix256-64"}
SYSTEMS = ["slotserve", "hf-static", "hf-cb"]


def test_random_weights_tiny_cpu_writes_every_case_and_system(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), "--random-weights", "--tiny",
                           "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "out" / "model_random_cpu_tiny.json").read_text())
    assert (tmp_path / "out" / "model_random_cpu_tiny.png").stat().st_size > 0
    assert payload["device"] == "cpu" and payload["tiny"] is True
    assert {row["case"] for row in payload["cases"]} == CASES
    for row in payload["cases"]:
        assert [s["system"] for s in row["systems"]] == SYSTEMS, row
        for s in row["systems"]:
            assert "error" not in s and "skipped" not in s, s
            # stop tokens are off: every system generates exactly the lengths asked for
            assert s["exact_lengths"] is True, (row["case"], s["system"])
            assert s["useful_tokens"] == row["tokens_asked"] > 0
            assert 0 < s["wall_s"] < 120
            assert math.isclose(s["tokens_per_s"], s["useful_tokens"] / s["wall_s"], rel_tol=0.05)
        assert set(row["slotserve_vs"]) == {"hf-static", "hf-cb"}
        assert all(v > 0 for v in row["slotserve_vs"].values())
        assert set(row["identical_to_slotserve"]) == {"hf-static", "hf-cb"}
        assert all(0 <= v <= row["requests"] for v in row["identical_to_slotserve"].values())
    assert payload["total_s"] < 240


def test_tiny_and_device_need_random_weights():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), "--tiny"],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--random-weights only" in done.stderr
