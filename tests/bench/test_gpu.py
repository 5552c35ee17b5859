"""bench/model.py --random-weights --tiny: bench/gpu.py's cases end to end on the CPU.

The GPU mode cannot run in CI (no GPU); its tiny CPU form runs every case and
system through the same code and must write a complete, sane result.
"""

from __future__ import annotations

import json
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

from bench import gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASES = {"smol-fp32-he32-8", "smol-bf16-he32-8", "smol-bf16-mix256-64", "1b-bf16-mix256-64",
         "qwen2.5-bf16-mix256-64", "gemma2-bf16-mix256-64", "qwen2.5-bf16-he8-8", "gemma2-bf16-he8-8"}
SYSTEMS = ["slotserve", "hf-static", "hf-cb"]


def test_random_weights_tiny_cpu_writes_every_case_and_system(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.model", "--random-weights", "--tiny",
                           "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
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
            # wall_s is rounded to 1 ms, and a tiny case can take under 10 ms: the rate must lie
            # within what the rounding allows (it is computed from the unrounded time)
            fastest, slowest = (s["useful_tokens"] / max(s["wall_s"] + d, 1e-9) for d in (-5e-4, 5e-4))
            assert slowest * 0.99 <= s["tokens_per_s"] <= fastest * 1.01, s
        assert set(row["slotserve_vs"]) == {"hf-static", "hf-cb"}
        assert all(v > 0 for v in row["slotserve_vs"].values())
        assert set(row["identical_to_slotserve"]) == {"hf-static", "hf-cb"}
        assert all(0 <= v <= row["requests"] for v in row["identical_to_slotserve"].values())
    assert payload["total_s"] < 240


def test_tiny_and_device_need_random_weights():
    done = subprocess.run([sys.executable, "-m", "bench.model", "--tiny"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--random-weights only" in done.stderr


def test_time_limit_skips_what_would_start_after_it(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    payload = gpu.run_cases(device="cpu", tiny=True, he_prompts=[], he_lengths=[20] * 8, cases=gpu.CASES[:1],
                            time_limit_s=0.0, log=lambda _msg: None)
    [row] = payload["cases"]
    assert [s["system"] for s in row["systems"]] == SYSTEMS
    assert all(s["skipped"].startswith("time limit") for s in row["systems"])
    assert "slotserve_vs" not in row


def test_a_failing_system_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bad = gpu.Case("zero-slots", "smollm2-135m", "float32", "he32", 0)  # batch_size 0 -> ValueError
    payload = gpu.run_cases(device="cpu", tiny=True, he_prompts=[], he_lengths=[20] * 8, cases=(bad,),
                            systems=["slotserve"], log=lambda _msg: None)
    [row] = payload["cases"]
    assert "ValueError" in row["systems"][0]["error"]
