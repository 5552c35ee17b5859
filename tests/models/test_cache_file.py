"""A GGUF an alias's package writes with its own ``assemble()`` (the gemma3-270m packages:
``assemble(output_path=None, overwrite=False)``) is written once, whole, by one process at a time
(worker/models/cache_file.py, shared with the Qwen aliases' part packages, tests/models/test_parts.py):
slotserve called ``assemble(<cache path>)``, which writes in place with no lock, so two workers starting
at once both wrote the file and a reader could take half of it. Now the package writes a file in a
temporary folder beside the cache path, renamed there whole under ``flock`` on ``<file>.lock``. On a
fake package of the real one's signature: nothing is imported from a real model."""

from __future__ import annotations

import threading

import pytest

from worker.models import names
from worker.models.cache_file import write_once
from worker.models.checkpoint import resolve_model_path

WHOLE = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``fake_gemma_gguf`` (alias ``fake-gemma``) whose ``assemble(output_path)`` writes
    :data:`WHOLE` in two halves, calling ``halfway(output_path)`` between them (set by the test), and
    records each call; ``(module, cache folder)``."""
    lib = tmp_path / "lib" / "fake_gemma_gguf"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(
        "from pathlib import Path\nMODEL_NAME = 'gemma.gguf'\ncalls = []\nhalfway = None\nfail = None\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    p = Path(output_path)\n"
        "    calls.append(p)\n"
        "    if fail is not None:\n"
        "        p.write_bytes(b'GG')\n"
        "        raise fail\n"
        f"    data = {WHOLE!r}\n"
        "    with open(p, 'wb') as out:\n"
        "        out.write(data[:100]); out.flush()\n"
        "        if halfway is not None: halfway(p)\n"
        "        out.write(data[100:])\n"
        "    return p\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setitem(names.ALIASES, "fake-gemma", "fake_gemma_gguf")
    import importlib
    import sys

    sys.modules.pop("fake_gemma_gguf", None)  # (test_model_names' fake package of the same name may be loaded)
    importlib.invalidate_caches()
    module = importlib.import_module("fake_gemma_gguf")
    yield module, tmp_path / "xdg" / "slotserve" / "models" / "fake_gemma_gguf"
    sys.modules.pop("fake_gemma_gguf", None)


def test_the_package_writes_beside_the_cache_path_and_a_reader_never_sees_half(package):
    module, folder = package
    seen = []
    module.halfway = lambda p: seen.append(((folder / "gemma.gguf").exists(), p.parent.parent == folder,
                                            p.name == "gemma.gguf"))
    assert resolve_model_path("fake-gemma") == (str(folder), "gemma.gguf")
    assert seen == [(False, True, True)]  # (half written: in the temporary folder only, under its own name)
    assert (folder / "gemma.gguf").read_bytes() == WHOLE
    assert sorted(p.name for p in folder.iterdir()) == ["gemma.gguf", "gemma.gguf.lock"]
    assert ((folder / "gemma.gguf").stat().st_mode & 0o777) == 0o644
    resolve_model_path("fake-gemma")  # (there already: not written again)
    assert len(module.calls) == 1


def test_workers_starting_at_once_write_it_once(package):
    """Eight callers at once (threads: each opens the lock file itself, so flock orders them as it
    orders processes): the package writes once, every caller reads the whole file."""
    module, folder = package
    barrier, results, errors = threading.Barrier(8), [], []

    def start():
        barrier.wait(timeout=30)
        try:
            where, name = resolve_model_path("fake-gemma")
            results.append((folder / name).read_bytes())  # what a worker reads the moment it has the path
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and results == [WHOLE] * 8
    assert len(module.calls) == 1
    assert sorted(p.name for p in folder.iterdir()) == ["gemma.gguf", "gemma.gguf.lock"]


@pytest.mark.parametrize("failure", [OSError("No space left on device"), ValueError("part 2 is damaged")])
def test_a_failed_assembly_leaves_nothing_but_the_lock(package, failure):
    module, folder = package
    module.fail = failure
    with pytest.raises(ValueError, match=rf"model 'fake-gemma': fake_gemma_gguf.assemble\(\) failed: {failure}"):
        resolve_model_path("fake-gemma")
    assert sorted(p.name for p in folder.iterdir()) == ["gemma.gguf.lock"]
    module.fail = None
    assert resolve_model_path("fake-gemma") == (str(folder), "gemma.gguf")  # (the next start writes it)


def test_a_dead_writers_temporary_folder_or_file_is_removed(tmp_path):
    target = tmp_path / "m.gguf"
    (tmp_path / ".m.gguf.abc.tmp").mkdir()
    (tmp_path / ".m.gguf.abc.tmp" / "m.gguf").write_bytes(b"GG")
    (tmp_path / ".m.gguf.def.tmp").write_bytes(b"GG")
    write_once(target, lambda p: p.write_bytes(b"GGUF") and None, lambda p: p.exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.lock"]


def test_the_path_a_writer_returns_is_the_one_renamed(tmp_path):
    target = tmp_path / "m.gguf"

    def write(path):
        other = path.with_name("other.gguf")
        other.write_bytes(b"GGUF")
        return other

    assert write_once(target, write, lambda p: p.exists()).read_bytes() == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.lock"]
