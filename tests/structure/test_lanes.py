"""tests/support/lanes.py: the reading that marks tests ``process`` and ``model``, on functions
written here to be read (never called), and the guard that refuses a process."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.lanes import loads_models, refuse_processes, starts_processes, uses
from worker.models import load_model
from worker.models.checkpoint import resolve_model_path


def _item(func, fixturenames=()):
    """What :func:`uses` reads of a pytest item: its function (fixtures: none)."""
    return SimpleNamespace(obj=func, fixturenames=list(fixturenames), _fixtureinfo=None)


def _lanes(func) -> tuple[bool, bool]:
    names = uses(_item(func))
    return starts_processes(names), loads_models(names)


def _runs_a_command():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _starts_a_cluster(config: ClusterConfig):
    with LocalCluster(config):
        pass


def _through_a_helper():
    _starts_a_cluster(None)


def _builds_a_tiny_llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig())


def _imports_a_helper_that_builds_one():
    from tests.support.slot_models import tiny_llama

    return tiny_llama()


def _loads_the_simulated_model():
    return load_model("simulated")


def _asserts_on_the_simulated_model():  # pytest rewrites the assert: its arguments become locals
    assert load_model("simulated").vocab_size == 1000


def _loads_smollm2():
    return load_model("smollm2-135m")


def _finds_a_checkpoint():
    return resolve_model_path("smollm2-135m")


def _tokenizer_only():
    import transformers

    return transformers.AutoTokenizer.from_pretrained("x")


@pytest.mark.parametrize("func, lanes", [
    (_runs_a_command, (True, False)),
    (_starts_a_cluster, (True, False)),
    (_through_a_helper, (True, False)),
    (_builds_a_tiny_llama, (False, True)),
    (_imports_a_helper_that_builds_one, (False, True)),
    (_loads_the_simulated_model, (False, False)),
    (_asserts_on_the_simulated_model, (False, False)),
    (_loads_smollm2, (False, True)),
    (_finds_a_checkpoint, (False, False)),
    (_tokenizer_only, (False, False)),
])
def test_a_function_is_marked_by_what_it_uses(func, lanes):
    assert _lanes(func) == lanes


def test_a_process_started_under_the_guard_fails_the_test_naming_it():
    with refuse_processes("tests/x.py::test_y"), pytest.raises(pytest.fail.Exception, match="test_y starts a process"):
        subprocess.run([sys.executable, "-c", "pass"])
