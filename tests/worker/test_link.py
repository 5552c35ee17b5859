"""The I/O thread's view of its worker (:class:`worker.link.LinkedWorker`, a Protocol, so that
``worker.link`` need not import ``worker.process``): the link uses nothing else of it, and a
:class:`~worker.process.WorkerProcess` has all of it."""

from __future__ import annotations

import ast
import inspect

from worker import SimulatedLLM, link
from worker.config import WorkerConfig
from worker.link import LinkedWorker
from worker.process import WorkerProcess

METHODS = {name for name, value in vars(LinkedWorker).items() if callable(value) and not name.startswith("_")}
MEMBERS = set(LinkedWorker.__annotations__) | METHODS


def test_the_link_uses_only_what_linked_worker_declares():
    """Every ``wp.x`` and ``self.wp.x`` in worker/link.py names a member of the Protocol."""
    used = {node.attr for node in ast.walk(ast.parse(inspect.getsource(link)))
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "wp")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "wp"))}
    assert {"take_outbox", "assign", "config", "identity"} <= used
    assert used - MEMBERS == set()


def test_a_worker_process_is_a_linked_worker():
    wp = WorkerProcess(WorkerConfig(broker="tcp://127.0.0.1:1"), SimulatedLLM())
    assert [name for name in sorted(MEMBERS) if not hasattr(wp, name)] == []
    for name in METHODS:
        protocol_params = list(inspect.signature(getattr(LinkedWorker, name)).parameters)[1:]
        assert list(inspect.signature(getattr(wp, name)).parameters) == protocol_params, name
