"""Fixtures for every folder of tests/ (each folder's own are in its conftest.py;
helpers shared across folders are in tests/support/), and the fast lane's guard: a
test that each room's conftest.py did not mark ``process`` fails if it starts one
(tests/support/lanes.py)."""

import gc
import os
import platform
import sys
from contextlib import nullcontext

import pytest

# pytest rewrites each test module's asserts as it imports it (~9 s CPU of a test process's collection of
# the whole suite, niced on the 2-core host) and keeps the result in __pycache__ for the next run, as Python
# keeps the bytecode of the modules the tests import (~2 s more); PYTHONDONTWRITEBYTECODE, which containers
# often set, stopped both, so every test process of every run rewrote and compiled it all anew. The test
# processes write them whatever it says (__pycache__ is git-ignored; a folder they cannot write to is
# skipped, as always).
sys.dont_write_bytecode = False


def _share_cores() -> None:
    """Under pytest-xdist (``-n``, pyproject's addopts), each of the N test processes gets
    ``cores // N`` torch threads, and the processes its tests start inherit that
    (``OMP_NUM_THREADS``): N processes of one thread per core each would oversubscribe the cores,
    and a torch operation whose threads the OS deschedules waits a time slice for each
    (docs/models.md#threads). A value set by whoever runs the tests is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    if "torch" in sys.modules:  # (imported already: its OpenMP read the environment then)
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one test process per core, at most 4 (the model tests peak at ~5.5 GB each)."""
    return max(1, min(4, os.cpu_count() or 1))

from tests.support.lanes import refuse_processes
from tests.support.schedule import heaviest_first
from tests.support.tiny_text import make_tiny_text_model


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory) -> str:
    """The folder of the tiny text model (a real byte-level BPE tokenizer, a tiny
    random Llama): :func:`tests.support.tiny_text.make_tiny_text_model`, made once for the
    test process. Read-only: a test that changes the model makes its own. Needs
    transformers and tokenizers."""
    return make_tiny_text_model(tmp_path_factory.mktemp("tiny-text"))


# The standard library finds the processor by running `uname -p`, once per process; the openai SDK
# asks on its first request (for its headers). Asked here, before any test, so that no test starts it.
platform.processor()


def pytest_collection_modifyitems(items):
    """The files heaviest first, each file's tests in their order (tests/support/schedule.py): the
    order pytest-xdist hands them out in."""
    items[:] = heaviest_first(items)


def _unless_marked(item):
    """A test of the fast lane (neither ``process`` nor ``model``) may start no process (its promise). A
    ``model`` test may: loading GGUF weights builds their compiled kernel once per machine
    (worker/models/llama/qkernel.py)."""
    slow = item.get_closest_marker("process") or item.get_closest_marker("model")
    return nullcontext() if slow else refuse_processes(item.nodeid)


_FROZEN_FOR = pytest.StashKey[str]()


def _freeze_what_lives(item) -> None:
    """At the first test of each module: collect garbage, then :func:`gc.freeze` every object alive.

    Each test process imports every test module at collection, and torch, transformers, the SDKs:
    ~875,000 objects, which a full collection traverses (~0.5 s, niced on a busy 2-core host).
    Full collections are frequent here: ``load_model`` collects after each load
    (worker/models/heap.py), and CPython runs its own as the tests allocate; test_families alone
    made 97 (20 of its 48 s, its module collected alone). Frozen objects are left out of later
    collections (refcounting still frees them), so a collection traverses what the current
    module made. Garbage cycles are collected before each freeze: nothing a finished module
    left is kept; what is alive then (imports, session fixtures) would live on anyway."""
    module = item.nodeid.split("::")[0]
    if item.config.stash.get(_FROZEN_FOR, None) != module:
        item.config.stash[_FROZEN_FOR] = module
        gc.collect()
        gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _freeze_what_lives(item)  # (before the module's fixtures are set up; the last module's are torn down)
    with _unless_marked(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _unless_marked(item):
        return (yield)
