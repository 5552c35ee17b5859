"""A file written into slotserve's cache once, whole, by one process at a time.

Invariant: a file at the target path was only ever put there by an atomic ``os.replace`` of a
complete file written beside it (in a temporary folder ``.<name>.<random>.tmp/`` of the same
folder, so the rename never crosses file systems). A reader that takes no lock (another worker
starting at the same moment) sees no file or a whole one, never half of one. Writers take an
exclusive ``flock`` on ``<target>.lock``, so two workers starting at once write it once: the second
waits, then finds the file. A writer that died leaves its temporary folder, removed by the next one
(none runs while the lock is held).

Used by the GGUFs slotserve assembles: the Qwen2.5-Coder aliases' part packages
(:func:`worker.models.parts.assemble`) and the ``assemble()`` of a package that writes its own
(the gemma3-270m alias's: :func:`worker.models.checkpoint.resolve_model_path`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_once"]


def write_once(target: Path, write: Callable[[Path], object], complete: Callable[[Path], bool]) -> Path:
    """``target``, written by ``write(path)`` unless ``complete(target)`` says it is there already.

    ``write(path)`` writes the whole file at ``path`` (a name in a fresh temporary folder beside
    ``target``, the same file name; nothing is there yet) and returns the path it wrote (None:
    ``path``); it raises to give up, and then nothing is left but the lock file. The file is made
    readable by every user (0644, as an installed file is) and renamed to ``target``. Raises what
    ``write`` raises, and ``OSError`` when the folder cannot be written."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on a crash
        if complete(target):  # another process wrote it while this one waited
            return target
        for stale in target.parent.glob(f".{target.name}.*.tmp"):  # a writer that died: none runs now
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        folder = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
        try:
            path = folder / target.name
            written = write(path)
            written = path if written is None else Path(written)
            os.chmod(written, 0o644)
            os.replace(written, target)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return target
