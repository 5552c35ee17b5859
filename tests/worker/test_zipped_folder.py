"""A model folder zipped inside a package (:mod:`worker.models.zipped`, the all-minilm-l6-v2 alias):
found without importing the package, extracted once into the cache, a path leaving the folder and a
missing package refused with the pip command."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from worker.models.zipped import ZippedFolder, extract


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``zipped_model_pkg`` whose ``__init__`` would raise if imported, holding ``model.zip``."""
    root = tmp_path / "site"
    pkg = root / "zipped_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    with zipfile.ZipFile(pkg / "model.zip", "w") as zf:
        zf.writestr("config.json", '{"model_type": "bert"}')
        zf.writestr("1_Pooling/config.json", '{"pooling_mode": "mean"}')
    monkeypatch.syspath_prepend(str(root))
    yield ZippedFolder("zipped_model_pkg", "model.zip", "tiny", install="pip install zipped-model-pkg==1")
    sys.modules.pop("zipped_model_pkg", None)


def test_extracted_once_into_the_cache_without_importing_the_package(package, tmp_path):
    cache = tmp_path / "cache"
    folder = extract(package, cache)
    assert folder.parent == cache and folder.name.startswith("tiny-")
    assert (folder / "1_Pooling" / "config.json").read_text() == '{"pooling_mode": "mean"}'
    (folder / "config.json").write_text("kept")  # a second call finds the folder: nothing extracted again
    assert extract(package, cache) == folder and (folder / "config.json").read_text() == "kept"
    assert [p.name for p in cache.iterdir()] == [folder.name]  # (no temporary folder left behind)
    assert "zipped_model_pkg" not in sys.modules


def test_a_member_outside_the_folder_is_refused(package, tmp_path):
    with zipfile.ZipFile(package.zip_path(), "a") as zf:
        zf.writestr("../escape.txt", "x")
    with pytest.raises(ValueError, match="outside its folder"):
        extract(package, tmp_path / "cache")
    assert not (tmp_path / "escape.txt").exists() and list((tmp_path / "cache").iterdir()) == []


def test_a_missing_package_names_the_pip_command(tmp_path):
    missing = ZippedFolder("no_such_package_here", "model.zip", "x", install="pip install no-such==1")
    with pytest.raises(ValueError, match="pip install no-such==1"):
        extract(missing, tmp_path)


def test_a_reinstalled_zip_finds_its_folder_and_a_changed_one_gets_its_own(package, tmp_path):
    """The cache key is the zip's contents, not its file: the same zip written again (a reinstall:
    a new modification time) reuses the extracted folder; a member changed gets another folder."""
    import os
    import shutil

    cache = tmp_path / "cache"
    folder = extract(package, cache)
    zip_path = package.zip_path()
    copy = tmp_path / "copy.zip"
    shutil.copyfile(zip_path, copy)
    zip_path.unlink()
    shutil.copyfile(copy, zip_path)  # the same bytes, a new file
    os.utime(zip_path, ns=(10**18, 10**18))
    assert extract(package, cache) == folder and len(list(cache.iterdir())) == 1
    with zipfile.ZipFile(zip_path, "w") as zf:
        zf.writestr("config.json", '{"model_type": "bert", "changed": true}')
        zf.writestr("1_Pooling/config.json", '{"pooling_mode": "mean"}')
    changed = extract(package, cache)
    assert changed != folder and '"changed"' in (changed / "config.json").read_text()


def test_an_unreadable_zip_names_the_reinstall(package, tmp_path):
    package.zip_path().write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="reinstall: pip install zipped-model-pkg==1"):
        extract(package, tmp_path / "cache")


def test_a_zip_whose_data_is_corrupt_or_holds_no_files_names_the_reinstall(package, tmp_path):
    """A member's deflated data broken (its directory intact), or a zip of no files: ValueError with
    the pip command, and nothing left in the cache."""
    zip_path = package.zip_path()
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", '{"model_type": "bert"}' * 50)
    data = bytearray(zip_path.read_bytes())
    start = data.index(b"config.json") + len("config.json")  # the local header's name, then the data
    data[start + 2:start + 12] = b"\xff" * 10
    zip_path.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="reinstall: pip install zipped-model-pkg==1"):
        extract(package, cache)
    assert list(cache.iterdir()) == []
    with zipfile.ZipFile(zip_path, "w"):
        pass
    with pytest.raises(ValueError, match="holds no files; reinstall"):
        extract(package, cache)


def test_duplicate_names_in_another_order_get_another_folder(package, tmp_path):
    """The key follows the central directory's order: with a name twice, the later copy is the one
    extracted, so two orders are two contents."""
    import warnings

    folders = []
    for first, second in (("a", "b"), ("b", "a")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (zipfile warns of the duplicate name)
            with zipfile.ZipFile(package.zip_path(), "w") as zf:
                zf.writestr("config.json", first)
                zf.writestr("config.json", second)
        folders.append(extract(package, tmp_path / "cache"))
    assert folders[0] != folders[1]
    assert [(f / "config.json").read_text() for f in folders] == ["b", "a"]


def test_the_key_and_the_files_come_from_one_open_zip(package, tmp_path, monkeypatch):
    """A zip replaced between reading the key and extracting cannot put its files under the other's
    key: both are read from one open file."""
    import shutil

    original = package.zip_path().read_bytes()
    opened = []
    real = zipfile.ZipFile

    def replacing(path, *a, **k):  # the first open sees the original; the file is replaced right after
        zf = real(path, *a, **k)
        if not opened and not a:
            opened.append(path)
            newer = tmp_path / "newer.zip"
            with real(newer, "w") as w:
                w.writestr("config.json", '{"v": "new"}')
                w.writestr("1_Pooling/config.json", "{}")
            Path(path).unlink()  # (as pip replaces a file: a new file under the name)
            shutil.copyfile(newer, path)
        return zf

    with monkeypatch.context() as patched:
        patched.setattr(zipfile, "ZipFile", replacing)
        folder = extract(package, tmp_path / "cache")
    assert (folder / "config.json").read_text() == '{"model_type": "bert"}'  # the original's, under its key
    package.zip_path().write_bytes(original)
    assert extract(package, tmp_path / "cache") == folder
