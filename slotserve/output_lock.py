"""One job per output file: ``slotserve run -o OUT`` holds an exclusive lock on OUT for its whole
run (:class:`OutputLock`), so that a second run given the same file, with ``--resume`` or not, is
refused before it reads, empties or rewrites it.

Without it two runs on one file lost rows: a second ``--resume`` rewrote the file (a new file renamed
over it) while the first went on appending to the one it had open, whose rows were then in no file;
a second run without ``--resume`` emptied the first's output under it; two resumed runs each ran the
missing rows and wrote them twice.

The lock is ``flock(2)``'s (advisory: it binds slotserve runs, not other programs), taken without
waiting, on the file itself (no lock file is left beside it), and released when the run ends or its
process dies (the kernel drops it with the last descriptor; the cluster's children, started with
``spawn``, hold none). A file renamed over the locked one (:func:`slotserve.resume.read_previous`'s
rewrite) is locked before it is renamed, and :meth:`OutputLock.moved` then holds that one. Only a
regular file is locked: ``-o -``, ``/dev/null`` or a FIFO is no job's file to share (two runs may
write ``/dev/null`` at once).
"""

from __future__ import annotations

import os
import stat

try:
    import fcntl
except ImportError:  # (not POSIX: no lock is taken)
    fcntl = None

__all__ = ["OutputBusy", "OutputLock", "lock_fd"]


class OutputBusy(ValueError):
    """Another slotserve run holds the output file's lock: it is writing that file now."""


def lock_fd(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting: True when taken (or locks are
    not available here), False when another open of the file holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class OutputLock:
    """The exclusive lock of the output file ``path`` (a link is followed), held from construction
    until :meth:`close` (a context manager). A missing file is created empty (0o666 less the umask,
    as ``open(path, "w")`` makes it); a path that is no regular file takes no lock (``fd`` None).

    Raises :class:`OutputBusy` (a ValueError) when another run holds the lock, OSError when the
    file cannot be opened or created."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        real = os.path.realpath(path)
        while True:
            try:
                st = os.stat(real)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                return
            fd = os.open(real, os.O_RDONLY | os.O_CREAT, 0o666)
            if not lock_fd(fd):
                os.close(fd)
                raise OutputBusy(f"{path} is being written by another slotserve run (it holds the file's lock): "
                                 "wait for that run to end, or name another file")
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(real))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)  # (renamed over between the open and the lock: the lock is the new file's to take)

    def moved(self, fd: int) -> None:
        """Hold ``fd``, a file locked (:func:`lock_fd`) and then renamed over the output, instead of
        the replaced one (whose lock is released)."""
        old, self.fd = self.fd, fd
        if old is not None:
            os.close(old)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
