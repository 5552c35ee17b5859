"""The model runner's compiled kernels (``qkernel.cpp``, ``attnkernel.cpp``): built once per machine
with torch's C++ extension builder, cached, and imported directly afterwards.

:func:`build` compiles a source the first time a process needs it (20 s to minutes on a busy
2-core machine) into ``~/.cache/slotserve/kernels/<key>`` (under ``$XDG_CACHE_HOME`` if set:
:func:`~worker.models.cache_root.cache_root`), keyed by
the source, torch's version and the flags, so a changed kernel or another torch builds anew and
later processes import the ``.so`` in milliseconds, without ninja. A build under way (torch's
builder holds ``<key>/lock``, and the ``.so`` may be half written) is waited for rather than
imported, on an OS lock of our own (:func:`_build_lock`: ``flock`` on ``<key>/slotserve-build.lock``,
held around the call into torch's builder) that the kernel releases when its holder dies, then its
``.so`` is imported. Torch's own lock is a file that only its builder removes: one killed during its
build (a SIGKILL, the OOM killer) left it, and every later builder of that key waited for it to go,
polling forever (a worker that never became ready). Whoever holds our lock knows that no live
slotserve builder holds torch's, so a ``lock`` found then is stale and is removed before building
(a builder of an older slotserve without our lock, building the same key at the same instant, is not
seen: both would build). Where it cannot run -- the CPU lacks the instructions, no C++
compiler, or ``SLOTSERVE_NO_KERNELS`` is set -- it returns None and the caller takes its pure-torch
path.

A build interrupted (a worker's stop during its load raises in torch's wait for ninja:
:meth:`slotserve.signals.SignalStopFlag.interrupting`) ends its whole process tree: torch's builder
runs ninja with ``subprocess.run``, which SIGKILLs ninja when its wait raises, and ninja's jobs (each
in a process group of its own) then compiled on for a minute, orphaned. During :func:`_compile` the
builder's ``subprocess`` is :data:`_BUILDER_SUBPROCESS`, whose ``run`` sends ninja SIGTERM instead:
ninja's own way to stop a build, which signals each job's process group (the compiler driver and its
``cc1plus``, ``as``) and waits for them before it exits (:func:`_run_stopping_tree`).

Every changed source makes a new build, so a new build removes the same kernel's builds of other
keys that no process has used for :data:`STALE_AFTER_S` (:func:`prune`; they were kept forever, ~2 MB
each), and the folders of builds that died before writing anything that names their kernel (no
``.so``, no ``build.ninja``: the process was killed while starting the build), whatever kernel
builds. Used means imported or built: an import touches its folder first (:func:`_mark_used`), a
build too, and then writes into its own, so a folder's newest time is its last use. The age, not a
lock, is what keeps this safe beside other processes, since a process may import a build at any
time without asking: one that runs another torch (or an older checkout) keeps its build while it
uses it; a build under way is minutes old (one starting in an abandoned folder of its own key made
it new first); and a folder is renamed away (atomic) before it is deleted, so no process sees half
of one. If an import of a build unused for a day races its removal, the import fails and
that process builds it again (slower, still correct); a process that already imported it keeps its
copy (the loaded library stays mapped). If a build starting in an abandoned folder unused for a day
races its removal (the instant between the prune's look at its age and its rename), the builder
finds its folder gone and that process runs its pure-torch path (slower, still correct).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.models.cache_root import cache_root

log = logging.getLogger(__name__)

STALE_AFTER_S = 24 * 3600.0
"""A build of another key unused for this long (seconds) is removed when a new build of its kernel is made."""

_KEY = re.compile(r"[0-9a-f]{16}")  # a build folder's name: its key
_TRASH = ".removing-"  # a build folder renamed away, being deleted
BUILD_LOCK = "slotserve-build.lock"
"""The file in a build folder that a build holds an exclusive ``flock`` on (:func:`_build_lock`)."""
_TORCH_LOCK = "lock"  # torch's builder's lock file (torch.utils.file_baton.FileBaton) in its build folder


class Held(enum.Enum):
    """How :func:`_build_lock` holds a build folder's lock."""

    AT_ONCE = "at once"  # no other process was building that key
    AFTER_WAIT = "after waiting"  # another process held it: it built, or failed, or died
    NOT_HELD = "not held"  # the lock file cannot be made or locked (a read-only cache, no flock there)


def cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists ``flag`` (e.g. ``avx512_bf16``; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return False


_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.M)


def _source_bytes(source: Path) -> bytes:
    """``source``'s bytes and those of the headers it includes from its own folder (``#include "x.h"``,
    one level: qkernel.cpp and qkernel_avx2.cpp share ``qkernel_pack.h``), so that a changed header
    makes a new build key as a changed source does."""
    text = source.read_bytes()
    return text + b"".join((source.parent / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(text))


def cpu_has_avx2() -> bool:
    """Whether the CPU has AVX2 with FMA and F16C (what the kernels' AVX2 builds compile for)."""
    return all(cpu_has(f) for f in ("avx2", "fma", "f16c"))


def build(prefix: str, source: Path, flags: list[str], needs: str, fallback: str):
    """The compiled module of ``source`` (named ``slotserve_<prefix>_<key>``), or None where it cannot
    run here: the CPU lacks ``needs`` (a ``/proc/cpuinfo`` flag), ``SLOTSERVE_NO_KERNELS`` is set, or
    the build fails or its folder cannot be made (a read-only cache: logged once as a warning ending
    in ``fallback``, what runs instead). Another
    process's build of the same key is waited for until it ends (its ``.so`` is then imported) or its
    process dies (then this one builds)."""
    if os.environ.get("SLOTSERVE_NO_KERNELS") or not cpu_has(needs):
        return None
    key = hashlib.sha256(_source_bytes(source) + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    try:
        kernels = cache_root() / "kernels"
    except OSError as exc:  # (no home folder to be found): no build, no crash
        log.warning("%s not built: %s; %s", source.name, exc.strerror, fallback)
        return None
    folder = kernels / key
    name = f"slotserve_{prefix}_{key}"
    built = folder / f"{name}.so"
    if built.exists() and not (folder / _TORCH_LOCK).exists():
        _mark_used(folder)  # (before the import: a prune elsewhere sees it in use)
        try:
            return _import(name, built)
        except ImportError:  # unreadable or foreign: the builder below rebuilds it
            pass
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # (a read-only or full cache, a file where the folder goes): no build, no crash
        log.warning("%s not built: cannot make its build folder %s (%s); %s", source.name, folder,
                    exc.strerror or type(exc).__name__, fallback)
        return None
    _mark_used(folder)  # (an old abandoned folder of this key is in use again: a prune elsewhere keeps it)
    with _build_lock(folder, source.name) as held:
        stale = held is not Held.NOT_HELD and _remove_stale_lock(folder, source.name)
        if held is Held.AFTER_WAIT and not stale and built.exists():  # (built by the process waited for)
            try:
                return _import(name, built)
            except ImportError:
                pass
        module = _compile(name, source, flags, folder, fallback)
    if module is None:
        return None
    removed = prune(kernels, prefix, key)
    if removed:
        log.info("removed %d build(s) of %s or abandoned ones, unused for %.0f h, from %s", len(removed),
                 source.name, STALE_AFTER_S / 3600, kernels)
    return module


@contextlib.contextmanager
def _build_lock(folder: Path, what: str) -> Iterator[Held]:
    """Hold an exclusive ``flock`` on ``folder``'s :data:`BUILD_LOCK` for the block (made if missing),
    waiting, however long, while another process holds it (a live build of that key: ``what``, the
    source's name, is logged as waited for); the kernel releases it when its holder exits or dies, so
    no wait outlasts a dead build. Yields how it is held; :attr:`Held.NOT_HELD` (the block runs
    unlocked, as before this lock existed) where the file cannot be opened or locked (``OSError``)."""
    try:
        fd = os.open(folder / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.debug("cannot lock %s (%s): building without the lock", folder, exc)
        yield Held.NOT_HELD
        return
    try:
        held = Held.AT_ONCE
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process's build of %s in %s", what, folder)
            held = Held.AFTER_WAIT
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # (a filesystem without flock)
            log.debug("cannot lock %s (%s): building without the lock", folder, exc)
            held = Held.NOT_HELD
        yield held
    finally:
        os.close(fd)  # (releases the flock)


def _remove_stale_lock(folder: Path, what: str) -> bool:
    """Remove torch's builder's ``lock`` from ``folder`` if it is there, and say whether it was. Call
    only while holding :func:`_build_lock`: then no live builder holds it, its builder died during the
    build of ``what`` (the source's name), and torch's next builder would wait for it forever."""
    try:
        (folder / _TORCH_LOCK).unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:  # (the builder below finds it and fails or waits: nothing better to do here)
        log.warning("cannot remove the stale build lock %s (%s)", folder / _TORCH_LOCK, exc)
        return False
    log.warning("removed the lock of a build of %s that died in %s: building again", what, folder)
    return True


def _compile(name: str, source: Path, flags: list[str], folder: Path, fallback: str):
    """The extension module ``name`` of ``source`` built by torch's builder in ``folder``, or None
    where the build fails (logged as a warning ending in ``fallback``). Call while holding
    :func:`_build_lock`, with no stale ``lock`` of torch's in ``folder``."""
    from torch.utils import cpp_extension  # here, not above: it imports setuptools (~0.15 s of a load)

    # (a warning, so that it shows at the default log level: a first start is otherwise silent for a minute)
    log.warning("compiling %s for this machine: once per machine and torch version, about a minute on 2 cores "
                "(cached in %s)", source.name, folder.parent)
    try:
        with _stopping_trees(cpp_extension):
            return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags,
                                      extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or it failed
        log.warning("%s not built (%s); %s", source.name, str(exc).splitlines()[0] if str(exc) else
                    type(exc).__name__, fallback)
        return None


NINJA_STOP_S = 3.0
"""Seconds an interrupted build's ninja gets to stop its jobs after SIGTERM before it is killed."""


def _run_stopping_tree(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """:func:`subprocess.run`, except where its wait raises (a stop's exception, a timeout): the process
    gets SIGTERM, up to :data:`NINJA_STOP_S` seconds to end, then SIGKILL (``subprocess.run`` sends
    SIGKILL at once), and the exception goes on. ninja, on SIGTERM, signals each of its jobs' process
    groups and waits for them: no compiler outlives the build. Returns a CompletedProcess; raises
    CalledProcessError with ``check`` where the process exits non-zero, as ``subprocess.run`` does."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with subprocess.Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except BaseException:
            process.terminate()
            try:
                process.wait(NINJA_STOP_S)
            except subprocess.TimeoutExpired:
                log.warning("the build process %d did not stop within %.0f s of SIGTERM: killing it", process.pid,
                            NINJA_STOP_S)
                process.kill()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


class _BuilderSubprocess(types.ModuleType):
    """The :mod:`subprocess` module as torch's builder sees it during a build: the real one's names,
    with ``run`` stopping the whole process tree when interrupted (:func:`_run_stopping_tree`)."""

    run = staticmethod(_run_stopping_tree)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


_BUILDER_SUBPROCESS = _BuilderSubprocess("subprocess")
_builds_lock = threading.Lock()
_builds = 0  # builds under way in this process (threads): the last one to end puts subprocess back; _builds_lock


@contextlib.contextmanager
def _stopping_trees(cpp_extension) -> Iterator[None]:
    """For the block, torch's builder (the module ``cpp_extension``) runs its subprocesses through
    :data:`_BUILDER_SUBPROCESS`. Only torch's builder's name is rebound, never :mod:`subprocess`
    itself; builds on several threads at once share it until the last one ends. Where a later torch runs
    ninja some other way, the builder simply does not use it (as before: ninja killed, its jobs left)."""
    global _builds
    with _builds_lock:
        _builds += 1
        cpp_extension.subprocess = _BUILDER_SUBPROCESS
    try:
        yield
    finally:
        with _builds_lock:
            _builds -= 1
            if _builds == 0:
                cpp_extension.subprocess = subprocess


def _import(name: str, built: Path):
    """The extension module ``name`` from its built ``.so`` (ImportError when it cannot be loaded)."""
    spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, str(built)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mark_used(folder: Path) -> None:
    """Set ``folder``'s time to now: it is in use (:func:`prune` keeps it). Nothing where the cache
    cannot be written (a read-only cache is never pruned either)."""
    try:
        os.utime(folder)
    except OSError:
        pass


def prune(kernels: Path, prefix: str, keep: str, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Remove from ``kernels`` (the cache folder) the builds of kernel ``prefix`` other than ``keep``
    (a key) that have not been used for ``stale_after_s`` seconds, and the abandoned builds of any
    kernel as old; return their keys. A folder is ``prefix``'s when it holds
    ``slotserve_<prefix>_<key>.so`` or, for a build that failed, a ``build.ninja`` naming it; it is
    abandoned when it holds neither a ``.so`` nor a ``build.ninja`` (:func:`_is_abandoned`); another
    kernel's folder is left alone. Each is renamed away first, then deleted (see the module's
    docstring for why this is safe beside other processes); what an earlier prune left renamed is
    deleted too. Errors (a folder gone already: another process pruned it) skip that folder."""
    now_s = time.time()  # (wall-clock: file times are; not a duration measured by this process)
    removed: list[str] = []
    try:
        entries = list(kernels.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(_TRASH):  # (a prune that stopped midway: no process can use it)
            shutil.rmtree(entry, ignore_errors=True)
            continue
        if entry.name == keep or not _KEY.fullmatch(entry.name):
            continue
        if not (_is_build_of(entry, prefix) or _is_abandoned(entry)):
            continue
        trash = kernels / f"{_TRASH}{entry.name}.{os.getpid()}"
        try:
            if now_s - _last_used_s(entry) < stale_after_s:
                continue
            entry.rename(trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _is_build_of(folder: Path, prefix: str) -> bool:
    """Whether ``folder`` is a build of kernel ``prefix`` (its ``.so``, or its ``build.ninja``'s name)."""
    name = f"slotserve_{prefix}_{folder.name}"
    if (folder / f"{name}.so").exists():
        return True
    try:
        return f"TORCH_EXTENSION_NAME={name} " in (folder / "build.ninja").read_text(errors="replace")
    except OSError:
        return False


def _is_abandoned(folder: Path) -> bool:
    """Whether ``folder`` is a build that died before it wrote a ``build.ninja`` (torch's builder
    writes it first, once it holds the folder's ``lock``) and so a ``.so``: it names no kernel, and
    no process can import it. Such a folder is empty, or holds the locks its dead builder left (our
    :data:`BUILD_LOCK`, torch's ``lock``: a build of that key would remove the stale one)."""
    try:
        if not folder.is_dir() or (folder / "build.ninja").exists():
            return False
        return not any(f.suffix == ".so" for f in folder.iterdir())
    except OSError:
        return False


def _last_used_s(folder: Path) -> float:
    """The newest time of ``folder`` and its files (its last import or build, :func:`_mark_used`)."""
    return max([folder.stat().st_mtime, *(f.stat().st_mtime for f in folder.iterdir())])
