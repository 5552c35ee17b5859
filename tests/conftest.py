"""Fixtures for every folder of tests/ (each folder's own are in its conftest.py;
helpers shared across folders are in tests/support/), and the fast lane's guard: a
test that each room's conftest.py did not mark ``process`` fails if it starts one
(tests/support/lanes.py)."""

import platform
from contextlib import nullcontext

import pytest

from tests.support.lanes import refuse_processes
from tests.support.tiny_text import make_tiny_text_model


@pytest.fixture(scope="module")
def tiny_text_dir(tmp_path_factory) -> str:
    """The folder of the tiny text model (a real byte-level BPE tokenizer, a tiny
    random GPT-2): :func:`tests.support.tiny_text.make_tiny_text_model`. Needs
    transformers and tokenizers."""
    return make_tiny_text_model(tmp_path_factory.mktemp("tiny-text"))


# The standard library finds the processor by running `uname -p`, once per process; the openai SDK
# asks on its first request (for its headers). Asked here, before any test, so that no test starts it.
platform.processor()


def _unless_marked(item):
    """A test of the fast lane (neither ``process`` nor ``model``) may start no process (its promise). A
    ``model`` test may: loading GGUF weights builds their compiled kernel once per machine
    (worker/models/llama/qkernel.py)."""
    slow = item.get_closest_marker("process") or item.get_closest_marker("model")
    return nullcontext() if slow else refuse_processes(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _unless_marked(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _unless_marked(item):
        return (yield)
