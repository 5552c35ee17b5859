"""The packages' import graph, read from the source with ``ast`` (nothing imported): no circle, and
the layering of docs/architecture.md's Layout (``slotserve -> {broker, worker, gateway -> client} ->
protocol``).

Every import counts, wherever it is written: at module level, inside a function (a lazy import)
or under ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs ``a/__init__.py`` and
``a/b/__init__.py``, so it is an edge to those packages too (except a module's own parents).
"""

from __future__ import annotations

import ast
import functools
import graphlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "worker", "broker", "client", "gateway", "slotserve")
MAY_IMPORT = {
    "protocol": set(),
    "worker": {"protocol"},
    "broker": {"protocol"},
    "client": {"protocol"},
    "gateway": {"client", "protocol"},
    "slotserve": {"broker", "worker", "client", "gateway", "protocol"},
}
"""Which other packages each may import (docs/architecture.md's Layout table; the front door also uses the
wire types directly). Nothing imports ``slotserve``; broker, worker and client never import each
other; nothing imports ``tests`` or ``bench``."""

PROTOCOL_THIRD_PARTY = {"msgpack"}
PROTOCOL_LAZY_EXCEPTIONS = {("protocol.curve", "zmq")}
"""``protocol`` imports the standard library and msgpack only. The one exception: the CURVE key
loaders (:mod:`protocol.curve`, shared by broker, worker and client) read ZeroMQ's certificate
files with pyzmq's ``zmq.auth``, imported inside the functions, so importing ``protocol`` still
needs nothing else (every process that talks CURVE has pyzmq)."""


def _sources() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (its source, whether it is a package's ``__init__``), for every module
    of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            init = parts[-1] == "__init__"
            found[".".join(parts[:-1] if init else parts)] = (path.read_text(), init)
    return found


SOURCES = _sources()


def _imports(name: str, source: str, init: bool, modules) -> list[tuple[str, bool]]:
    """``(imported dotted name, at module level)`` for every import in module ``name``, wherever
    it is; relative imports resolved; ``from m import x`` as ``m.x`` when that is one of
    ``modules``."""
    tree = ast.parse(source, name)
    top_level = {id(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if init else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.append((sub if sub in modules else module, id(node) in top_level))
    return out


def _graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (see the module docstring)."""
    graph: dict[str, set[str]] = {}
    for name, (source, init) in sources.items():
        edges = set()
        for imported, _ in _imports(name, source, init, sources):
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in sources and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


@functools.cache
def _project_graph() -> dict[str, set[str]]:
    return _graph(SOURCES)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_the_modules_are_found():
    assert {"protocol.codec", "worker.link", "worker.process", "worker.models.checkpoint",
            "worker.models.llama.source", "gateway.link", "slotserve.cli"} <= set(SOURCES)
    assert {"worker.config", "protocol.messages"} <= _project_graph()["worker.link"]


def test_no_import_circle():
    assert _circle(_project_graph()) is None


def test_a_lazy_or_type_checking_import_closes_a_circle():
    """What the check above sees: a TYPE_CHECKING import, a relative one inside a function, and
    a package's ``__init__`` run by importing its submodule."""
    fake = {"a": ("", True),
            "a.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.c import X\n", False),
            "a.c": ("def f():\n    from . import d\n", False),
            "a.d": ("import a.b\n", False),
            "e": ("from a.b import Y\n", True)}
    graph = _graph(fake)
    assert graph == {"a": set(), "a.b": {"a.c"}, "a.c": {"a.d"}, "a.d": {"a.b"}, "e": {"a", "a.b"}}
    assert set(_circle(graph)) == {"a.b", "a.c", "a.d"}
    assert _circle({**graph, "a.d": set()}) is None


def test_the_layering_of_design_md():
    wrong = []
    for name, (source, init) in SOURCES.items():
        package = name.split(".")[0]
        for imported, at_top in _imports(name, source, init, SOURCES):
            top = imported.split(".")[0]
            if top in PACKAGES and top != package and top not in MAY_IMPORT[package]:
                wrong.append(f"{name} imports {imported}")
            elif top in ("tests", "bench"):
                wrong.append(f"{name} imports {imported}")
            elif package == "protocol" and top not in PACKAGES and top not in sys.stdlib_module_names \
                    and top not in PROTOCOL_THIRD_PARTY and (at_top or (name, top) not in PROTOCOL_LAZY_EXCEPTIONS):
                wrong.append(f"{name} imports {imported} (protocol: stdlib and msgpack only)")
    assert wrong == []


def test_no_two_public_classes_share_a_name():
    """One name, one concept: a public class name is defined in one module only."""
    homes: dict[str, list[str]] = {}
    for name, (source, _) in SOURCES.items():
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(name)
    assert {cls: where for cls, where in homes.items() if len(where) > 1} == {}
