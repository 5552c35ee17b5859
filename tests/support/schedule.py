"""The order the suite's files run in: heaviest first, so no long file is left for last.

pytest-xdist (``--dist loadfile``, pyproject.toml) hands each test process one file at a time, in the
order collected (``--no-loadscope-reorder``; its default orders files by how many tests they hold,
which left the model files of one or two long tests, ~20-75 s each, for the end, one process busy
with them while the other had finished). Handing out the longest jobs first is the classic
longest-processing-time rule (Graham 1969): the last file to start is then a short one, and the
processes end close together.

A file's length is estimated from its tests' lanes (tests/support/lanes.py: ``model``, ``process``),
as collected, so every process orders the same collection the same way (xdist refuses collections
that differ): rough costs, in seconds, fitted to a whole run's per-test durations on the 2-core
host (the first ``model`` test of a file loads or builds a model; the first ``process`` test
starts processes).

Files that share a resource across modules (:data:`SHARED`: a fixture whose value outlives the
module, such as tests/gateway's shared cluster) are put next to each other, so that a process runs
those it gets in a row and makes the resource once.
"""

from __future__ import annotations

import pytest

MODEL_FILE_S, MODEL_TEST_S = 20.0, 0.4  # a file that loads a model: the load, then each model test
PROCESS_FILE_S, PROCESS_TEST_S = 3.0, 0.3  # one that starts processes: the first start, then each test
TEST_S = 0.01  # any other test

SHARED = ("shared_cluster",)
"""Fixtures made once for the modules that run in a row on a process and use them (each closes it
when the next test does not)."""


def estimate_s(items: list[pytest.Item]) -> float:
    """Rough seconds the tests ``items`` (one file's) take together, from their lane markers."""
    model = sum(1 for i in items if i.get_closest_marker("model"))
    process = sum(1 for i in items if i.get_closest_marker("process") and not i.get_closest_marker("model"))
    return (MODEL_FILE_S * (model > 0) + MODEL_TEST_S * model + PROCESS_FILE_S * (model + process > 0)
            + PROCESS_TEST_S * process + TEST_S * (len(items) - model - process))


def file_of(item: pytest.Item) -> str:
    """The test file of ``item``, as its node id names it (``tests/gateway/test_x.py``)."""
    return item.nodeid.split("::")[0]


def files_using(items: list[pytest.Item], fixture: str) -> set[str]:
    """The files (:func:`file_of`) of which a test among ``items`` uses ``fixture``."""
    return {file_of(i) for i in items if fixture in getattr(i, "fixturenames", ())}


def _shares(items: list[pytest.Item]) -> tuple[str, ...]:
    """The :data:`SHARED` fixtures the tests ``items`` use (a file's group: () for none)."""
    return tuple(name for name in SHARED if files_using(items, name))


def heaviest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` ordered file by file, the heaviest file first (:func:`estimate_s`); a file's tests
    keep their order, and files that share a :data:`SHARED` fixture run as one file (their sum),
    next to each other in the order collected. Ties keep the order collected."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    groups: dict[tuple, list[list[pytest.Item]]] = {}
    for path, its in files.items():
        shared = _shares(its)
        groups.setdefault(shared if shared else (path,), []).append(its)
    ordered = sorted(groups.values(), key=lambda g: -sum(estimate_s(its) for its in g))  # (a stable sort)
    return [item for group in ordered for its in group for item in its]
