"""A ``--model`` that names no model here, on every command that takes one (``up``, one model or several,
``run``, ``worker``): one line, exit status 1, before any process starts or ``-o`` is written, and not
one request towards a model hub -- in a newcomer's shell, without HF_HUB_OFFLINE (the hub's address
is a local socket that records connections). The messages' members are worker/models/names.py's
(tests/models/test_model_names.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

SLOTSERVE = [sys.executable, "-m", "slotserve"]


@pytest.fixture
def hub(tmp_path):
    """``(env, listener)``: the environment without HF_HUB_OFFLINE, an empty Hugging Face cache, and
    HF_ENDPOINT at ``listener``, a local socket no request may reach (checked after the test)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}", "HF_HUB_CACHE": str(tmp_path / "hub")}
    yield env, listener
    with listener:
        with pytest.raises(BlockingIOError):  # nothing is waiting to be accepted: no request was made
            listener.accept()


def slotserve(args, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(SLOTSERVE + args, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def one_error_line(proc) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    return lines[0]


def test_up_with_a_gguf_path_that_does_not_exist(hub, tmp_path):
    line = one_error_line(slotserve(["up", "--model", "./no-such.gguf", "--workers", "1"], hub[0], tmp_path))
    assert line == f"Error: model './no-such.gguf': the file {tmp_path}/no-such.gguf does not exist"


@pytest.mark.parametrize("model, says", [
    ("qwen2.5-coder-0.5B", "Error: unknown model 'qwen2.5-coder-0.5B'; did you mean 'qwen2.5-coder-0.5b'? "
                           "Known aliases: 'smollm2-135m', "),
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "(hf download Qwen/Qwen2.5-Coder-0.5B-Instruct)."),
])
def test_up_with_an_unknown_name_answers_at_once_without_asking_a_hub(hub, tmp_path, model, says):
    for workers in (["--workers", "1"], []):  # (without --workers the model's size is estimated first)
        line = one_error_line(slotserve(["up", "--model", model, *workers], hub[0], tmp_path))
        assert says in line, line


def test_up_with_several_models_checks_each(hub, tmp_path):
    (tmp_path / "text.gguf").write_text("not a model\n")
    line = one_error_line(slotserve(["up", "--model", "simulated", "--model", "./text.gguf"], hub[0], tmp_path))
    assert line.startswith(f"Error: model './text.gguf': {tmp_path}/text.gguf is not a GGUF file"), line


def test_run_with_an_empty_gguf_leaves_its_output_alone(hub, tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "in.jsonl").write_text('{"prompt": [1], "max_tokens": 2}\n')
    (tmp_path / "out.jsonl").write_text("kept\n")
    proc = slotserve(["run", "in.jsonl", "-o", "out.jsonl", "--workers", "1", "--model", "empty.gguf"], hub[0],
                     tmp_path)
    assert one_error_line(proc) == f"Error: model 'empty.gguf': {tmp_path}/empty.gguf is an empty file, not a GGUF model"
    assert (tmp_path / "out.jsonl").read_text() == "kept\n"


def test_worker_with_a_folder_that_is_no_model(hub, tmp_path):
    (tmp_path / "folder").mkdir()
    line = one_error_line(slotserve(["worker", "--model", "./folder"], hub[0], tmp_path))
    assert line == (f"Error: model './folder': {tmp_path}/folder is not a model folder: it has neither a "
                    "config.json (a Hugging Face checkpoint) nor a .gguf file")
