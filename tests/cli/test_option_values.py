"""Blast radius, kind "an option value the CLI's types accept but the program
cannot use": each is a usage error naming the option (exit 2), or -- where only
the loaded model can tell -- one logged line and exit 1, never a traceback nor
a worker restarted in a loop. Members: NaN and infinities in every float option
of every command (click's FloatRange lets them through: `--step-delay-ms inf`
raised OverflowError in every worker's loop, restarted forever; `run
--timeout-s nan` never passed; `status --timeout-s inf` named an internal
parameter); a stop token beyond the wire's integer range (a traceback in each
worker); a stop token outside the model's vocabulary and more slots than memory
holds (known once the model is there: a ValueError or MemoryError traceback in
each worker, now a ModelLoadError's one line; the engine's own `batch_size`
likewise a ValueError, in process); `--threads 100000` (the worker died of a
segmentation fault in torch's OpenMP runtime: now at most MAX_THREADS)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from slotserve.cli import FiniteFloatRange, main
from tests.support.cluster import free_port
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig
from worker.models.options import MAX_THREADS, ModelOptions

SLOTSERVE = [sys.executable, "-m", "slotserve"]


def float_options():
    """(command, option) for every float option of every command."""
    return [(name, p.opts[-1]) for name, cmd in sorted(main.commands.items()) for p in cmd.params
            if isinstance(p.type, click.types.FloatParamType)]


def test_every_float_option_is_finite():
    found = float_options()
    assert len(found) >= 20  # (the kind's members: broker, worker, serve, up, run, status)
    assert all(isinstance(p.type, FiniteFloatRange) for cmd in main.commands.values() for p in cmd.params
               if isinstance(p.type, click.types.FloatParamType))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
@pytest.mark.parametrize("command, option", float_options())
def test_a_float_option_refuses_nan_and_infinities(tmp_path, command, option, value):
    args = [command, f"{option}={value}"]
    if command == "run":  # (its argument first: the option's error is the one reported)
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"prompt": [1], "max_tokens": 1}\n')
        args = [command, str(inp), "-o", str(tmp_path / "out.jsonl"), f"{option}={value}"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output
    assert "is not a finite number" in r.output or "is not in the range" in r.output  # (-inf: below the minimum)
    if command == "run":
        assert not (tmp_path / "out.jsonl").exists()  # a usage error leaves -o alone


@pytest.mark.parametrize("command", ["run", "worker", "up"])
def test_a_stop_token_beyond_the_wire_is_a_usage_error(tmp_path, command):
    args = [command, "--stop-token", str(2**64)]
    if command == "run":
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"prompt": [1], "max_tokens": 1}\n')
        args = [command, str(inp), "-o", str(tmp_path / "out.jsonl"), "--stop-token", str(2**64)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "below 2**64" in r.output


def test_worker_config_refuses_what_its_worker_cannot_use():
    with pytest.raises(ValueError, match="step_delay_ms must be a finite number"):
        WorkerConfig(step_delay_ms=float("inf"))
    with pytest.raises(ValueError, match="below 2\\*\\*64"):
        WorkerConfig(stop_token=2**64)
    assert WorkerConfig(stop_token=2**64 - 1).stop_token == 2**64 - 1  # (the model's vocabulary decides then)


def test_the_engine_refuses_more_slots_than_memory_holds():
    with pytest.raises(ValueError, match="batch_size 1000000000000: there is not enough memory"):
        BatchInferenceEngine(SimulatedLLM(), 10**12, stop_token=0)


@pytest.mark.parametrize("args, words", [
    (["--stop-token", "100000"], "stop_token contains token id 100000, outside the model's vocabulary [0, 1000)"),
    (["--slots", str(10**12)], "batch_size 1000000000000: there is not enough memory for that many slots"),
], ids=["stop-token-outside-vocabulary", "slots-beyond-memory"])
def test_worker_options_the_model_refuses_are_one_line_and_exit_1(args, words):
    """Known only once the model is there; the worker says so in one line (it printed a traceback)."""
    r = subprocess.run(SLOTSERVE + ["worker", "--broker", f"tcp://127.0.0.1:{free_port()}", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"cannot serve model 'simulated': {words}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["run", "worker", "up"])
def test_more_threads_than_any_machine_is_a_usage_error(tmp_path, command):
    args = [command, "--threads", "100000"]
    if command == "run":
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"prompt": [1], "max_tokens": 1}\n')
        args = [command, str(inp), "-o", str(tmp_path / "out.jsonl"), "--threads", "100000"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert f"100000 is not in the range 1<=x<={MAX_THREADS}" in r.output


def test_model_options_bound_the_threads():
    assert ModelOptions(num_threads=MAX_THREADS).num_threads == MAX_THREADS
    with pytest.raises(ValueError, match=f"num_threads must be None or an int in \\[1, {MAX_THREADS}\\]"):
        ModelOptions(num_threads=MAX_THREADS + 1)
